"""``richness eval`` on ImageNet-sized features without a GPU: time and peak memory.

Generates (once) a float16 .npy of 1.3M x 2048 features (5.3 GB: low-rank
structure plus noise), int64 labels (1000 classes) and float32 head weights
(1000 x 2048), then runs ``richness eval FEATURES --labels ... --head ...``
in a fresh interpreter and reads that process's peak resident set (VmHWM)
at exit. Target: peak RSS < 2 GB (benchmarks/RESULTS.md).

The same run measures the two limits the eval is read against: the
arithmetic (rows x p^2 / 2 multiply-adds of the symmetric product at the
GEMM rate torch's ``addmm_`` reaches on 8192-row float32 batches here) and
reading the file (``cat`` to /dev/null with the file evicted from the page
cache, then again with it cached). The eval itself starts with the file
evicted, as a first read of a dataset would.

    python benchmarks/bench_eval_large.py [--dir DIR (default: richness-large in the temp folder)] [--rows 1300000] [--keep] [--no-limits]

Check free disk first (``df -h``). The data file is deleted afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import sys
import time

import numpy as np

from _common import print_and_save

CHILD = r"""
import sys, time
from richness.cli import main
t0 = time.time()
rc = main(sys.argv[1:])
wall = time.time() - t0
hwm = None
with open("/proc/self/status") as f:
    for line in f:
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) / 1024.0
print(f"@@ wall_s={wall:.2f} vmhwm_mb={hwm:.1f} rc={rc}", file=sys.stderr)
"""


def generate(path: str, rows: int, p: int, seed: int = 0, chunk: int = 32768) -> None:
    rng = np.random.default_rng(seed)
    rank = 64
    basis = rng.standard_normal((rank, p), dtype=np.float32) * np.linspace(3.0, 0.3, rank, dtype=np.float32)[:, None]
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        np.lib.format.write_array_header_2_0(f, {"descr": np.dtype(np.float16).str, "fortran_order": False,
                                                 "shape": (rows, p)})
        for a in range(0, rows, chunk):
            b = min(a + chunk, rows)
            z = rng.standard_normal((b - a, rank), dtype=np.float32)
            x = z @ basis
            x += rng.standard_normal(x.shape, dtype=np.float32)
            x += 1.0  # a mean, as post-ReLU features have
            x.astype(np.float16).tofile(f)
            if hasattr(os, "posix_fadvise"):  # keep the page cache from filling with what we wrote
                f.flush()
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    os.replace(tmp, path)


def evict(path: str) -> None:
    """Drop the file's pages from the page cache (clean pages: no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cat_seconds(path: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(["cat", path], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def gemm_rate(p: int, rows: int = 8192, reps: int = 5) -> float:
    """Multiply-adds per second of torch's float32 ``S.addmm_(x.T, x)`` (the
    full p x p product, both triangles) on rows x p batches, best of reps."""
    import torch

    x = torch.randn(rows, p)
    S = torch.zeros(p, p)
    S.addmm_(x.T, x)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        S.addmm_(x.T, x)
        best = min(best, time.perf_counter() - t0)
    return rows * p * p / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "richness-large"))
    ap.add_argument("--rows", type=int, default=1_300_000)
    ap.add_argument("--features", type=int, default=2048)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-limits", action="store_true", help="skip the arithmetic and file-read limits")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    need = args.rows * args.features * 2
    free = shutil.disk_usage(args.dir).free
    feats = os.path.join(args.dir, f"features_{args.rows}x{args.features}_f16.npy")
    if not os.path.exists(feats) and free < need * 1.2:
        sys.exit(f"not enough disk in {args.dir}: {free / 1e9:.1f} GB free, need {need / 1e9:.1f} GB")
    rng = np.random.default_rng(1)
    labels = os.path.join(args.dir, "labels.npy")
    head = os.path.join(args.dir, "head.npy")
    t0 = time.time()
    if not os.path.exists(feats):
        generate(feats, args.rows, args.features)
    gen_s = time.time() - t0
    np.save(labels, rng.integers(0, args.classes, args.rows))
    np.save(head, (rng.standard_normal((args.classes, args.features)) / np.sqrt(args.features)).astype(np.float32))
    limits = {}
    if not args.no_limits:
        rate = gemm_rate(args.features)
        evict(feats)
        cold = cat_seconds(feats)
        warm = cat_seconds(feats)
        madds = args.rows * args.features ** 2 / 2
        limits = {"gemm_madd_per_s": rate, "product_madds": madds, "arithmetic_limit_s": madds / rate,
                  "cat_cold_s": cold, "cat_warm_s": warm}
        evict(feats)
    cmd = [sys.executable, "-c", CHILD, "eval", feats, "--labels", labels, "--head", head, "--chunk", str(args.chunk),
           "--json", "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    stats = dict(kv.split("=") for kv in r.stderr.strip().splitlines()[-1].split()[1:]) if "@@" in r.stderr else {}
    if r.returncode != 0 or not stats:
        sys.exit(f"eval failed: {r.stderr[-2000:]}")
    rep = json.loads(r.stdout)
    out = {"rows": args.rows, "features": args.features, "file_gb": os.path.getsize(feats) / 1e9,
           "generate_s": round(gen_s, 1), "eval_wall_s": float(stats["wall_s"]), "peak_rss_mb": float(stats["vmhwm_mb"]),
           "rows_per_s": args.rows / float(stats["wall_s"]), "dlr": rep["dlr"], "nc1": rep["nc1"],
           "precision": rep["precision"], "chunk": args.chunk, "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **limits}
    if limits:
        larger = max(limits["arithmetic_limit_s"], limits["cat_cold_s"])
        out["larger_limit_s"] = larger
        out["eval_over_larger_limit"] = out["eval_wall_s"] / larger
    print_and_save(out, args.json)
    if not args.keep:
        for pth in (feats, labels, head):
            os.unlink(pth)


if __name__ == "__main__":
    main()
