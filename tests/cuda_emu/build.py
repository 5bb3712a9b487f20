"""Build the CUDA backend (csrc/cuda) as host code against the CPU emulator.

    python tests/cuda_emu/build.py          # builds, prints the module's path

Each .cu file is translated (translate.py) into a temporary directory and
compiled with g++ together with csrc/bindings/cuda.cpp and the emulator's
runtime; <cuda_runtime.h>, <cublas_v2.h>, ... resolve to the stubs in
include/. The result is ``_cuda<EXT_SUFFIX>`` in a cache directory keyed by
the sources and flags, loaded under the name ``_cuda`` (never installed into
the package). Nothing links or loads a real CUDA library.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CUDA_DIR = ROOT / "csrc" / "cuda"
# -Drichness=...: the emulated classes get C++ names of their own, so that pybind11 does not see
# them as the types the real richness._cuda registered when both are loaded in one process
# ("generic_type: type "CudaMoments" is already registered!").
FLAGS = ["-std=c++20", "-O1", "-fPIC", "-g0", "-Wall", "-Wno-unknown-pragmas", "-Wno-unused-function",
         "-Wno-unused-variable", "-Wno-sign-compare", "-Drichness=richness_cuda_emu",
         # 7 blocks along y instead of 65535: every grid-stride loop over rows (and over the column
         # means' row chunks, as beyond 16.7M rows on a GPU) runs several times in the tests
         "-DRICHNESS_GRID_Y_MAX=7"]
BINDINGS = ROOT / "csrc" / "bindings" / "cuda.cpp"
CUDA_SOURCES = sorted(CUDA_DIR.glob("*.cu"))  # every translation unit of the backend (CMakeLists.txt lists the same)
SOURCES = [*CUDA_SOURCES, *sorted(CUDA_DIR.glob("*.hpp")), *sorted(CUDA_DIR.glob("*.cuh")), BINDINGS,
           *sorted((ROOT / "csrc" / "common").glob("*.hpp")), ROOT / "csrc" / "bindings" / "common.hpp",
           HERE / "cuda_emu.hpp", HERE / "emu_runtime.cpp", HERE / "translate.py", HERE / "build.py",
           *sorted((HERE / "include").glob("*.h"))]


def missing_tools() -> str:
    """Why the emulated build cannot run here ('' if it can)."""
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        return "g++ not found"
    if importlib.util.find_spec("pybind11") is None:
        return "pybind11 not installed"
    return ""


def _includes() -> list:
    import pybind11

    return ["-I" + sysconfig.get_paths()["include"], "-I" + pybind11.get_include(), "-I" + str(HERE / "include"),
            "-I" + str(CUDA_DIR), "-include", str(HERE / "cuda_emu.hpp")]


def _key() -> str:
    h = hashlib.sha256()
    for p in SOURCES:
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    h.update(" ".join(FLAGS + [sys.version, os.environ.get("CXX", "g++")]).encode())
    return h.hexdigest()[:16]


def build(cache: Path | None = None, verbose: bool = False) -> Path:
    """Path of the built module (built unless the cache holds it)."""
    sys.path.insert(0, str(HERE))
    try:
        from translate import translate
    finally:
        sys.path.pop(0)
    cache = Path(cache or os.environ.get("RICHNESS_EMU_CACHE") or Path(tempfile.gettempdir()) / "richness_cuda_emu")
    out_dir = cache / _key()
    target = out_dir / ("_cuda" + sysconfig.get_config_var("EXT_SUFFIX"))
    if target.exists():
        return target
    work = Path(tempfile.mkdtemp(prefix="build-", dir=cache if cache.exists() else None))
    try:
        units = []
        for src in CUDA_SOURCES:  # each .cu translated on its own: its launches are of its own kernels
            text, _, _ = translate(src.read_text(), str(src))
            cu = work / (src.stem + "_emu.cpp")
            cu.write_text(text)
            units.append(cu)
        cxx = os.environ.get("CXX", "g++")
        units += [BINDINGS, HERE / "emu_runtime.cpp"]

        def compile_one(src: Path) -> Path:
            obj = work / (src.stem + ".o")
            cmd = [cxx, *FLAGS, *_includes(), "-c", str(src), "-o", str(obj)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"emulated CUDA build failed:\n{' '.join(cmd)}\n{r.stderr[-20000:]}")
            if verbose and r.stderr:
                print(r.stderr, file=sys.stderr)
            return obj

        with ThreadPoolExecutor(max_workers=max(1, min(3, os.cpu_count() or 1))) as pool:
            objs = list(pool.map(compile_one, units))
        tmp = work / target.name
        r = subprocess.run([cxx, "-shared", "-o", str(tmp), *map(str, objs)], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"emulated CUDA link failed:\n{r.stderr}")
        out_dir.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, target)  # atomic: a concurrent build leaves one complete file
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def load(path: Path):
    """Import the built module as ``_cuda`` (not registered in sys.modules)."""
    loader = importlib.machinery.ExtensionFileLoader("_cuda", str(path))
    spec = importlib.util.spec_from_file_location("_cuda", str(path), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


if __name__ == "__main__":
    import time

    t0 = time.time()
    p = build(verbose=True)
    print(f"{p} ({time.time() - t0:.1f} s)")
