"""The CUDA backend (csrc/cuda) run on the CPU under an emulator (tests/cuda_emu).

The .cu file is compiled with g++ against emulated CUDA runtime and cuBLAS
(tests/cuda_emu/build.py), and the resulting ``_cuda.CudaMoments`` is compared
with the CPU backend ``_core.CpuMoments`` and with float64 oracles computed
here from the raw data. This tests the host logic, index arithmetic, kernels
and cuBLAS calls of the CUDA backend without a GPU; it cannot test timing,
concurrency between blocks, or the real cuBLAS. In the emulator device
pointers are host pointers, so batches are numpy arrays; work is queued per
stream and runs at synchronising calls, so every array passed to update is
kept alive until the next synchronising call (as on a GPU).
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cuda_emu"))
import build as emu_build  # noqa: E402
from translate import kernels_with_sync, translate  # noqa: E402

sys.path.pop(0)

from reference import center_rows  # noqa: E402

_why = emu_build.missing_tools()
pytestmark = pytest.mark.skipif(bool(_why), reason=f"CUDA emulator build needs g++ and pybind11: {_why}")

# The names the core takes for element types and precision modes (csrc/common/types.hpp).
F32, F64, F16, BF16, I32, I64 = "float32", "float64", "float16", "bfloat16", "int32", "int64"
PREC = {name: name for name in ("fp64", "fp32", "tf32", "bf16")}
CODES = {np.dtype(np.float32): F32, np.dtype(np.float64): F64, np.dtype(np.float16): F16,
         np.dtype(np.int32): I32, np.dtype(np.int64): I64}
KEYS = ("mean", "M", "out_mean", "B", "A", "tgt_mean", "Bt", "At", "class_sums")
SEED = int(os.environ.get("EMU_SEED", "20261201"))  # the emulator's schedule (block order, stream interleaving)
SCHEDULE = 0 if os.environ.get("EMU_SCHEDULE") == "fifo" else 1


class Emu:
    def __init__(self, path: Path):
        self.mod = emu_build.load(path)
        lib = ctypes.CDLL(str(path))
        lib.emu_errors.restype = ctypes.c_char_p
        lib.emu_count.restype = ctypes.c_longlong
        lib.emu_count.argtypes = [ctypes.c_char_p]
        lib.emu_pending.restype = ctypes.c_longlong
        lib.emu_host_syncs.restype = ctypes.c_longlong
        lib.emu_live_allocations.restype = ctypes.c_longlong
        lib.emu_set_schedule.argtypes = [ctypes.c_int, ctypes.c_uint]
        lib.emu_register.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.emu_unregister.argtypes = [ctypes.c_void_p]
        lib.emu_double2bfloat16.restype = ctypes.c_uint
        lib.emu_double2bfloat16.argtypes = [ctypes.c_double]
        lib.emu_half2float.restype = ctypes.c_float
        lib.emu_half2float.argtypes = [ctypes.c_uint]
        self.lib = lib

    def count(self, name: str) -> int:
        return self.lib.emu_count(name.encode())


@pytest.fixture(scope="session")
def emu():
    return Emu(emu_build.build())


@pytest.fixture(autouse=True)
def emulator_clean(emu):
    """Every test starts with a fixed random schedule and ends without emulator-detected errors
    (out-of-bounds cuBLAS operands or copies, invalid launches, writes past allocations)."""
    emu.lib.emu_set_schedule(SCHEDULE, SEED)
    emu.mod.clear_measured_products()  # each test measures its own shapes
    emu.lib.emu_clear_errors()
    emu.lib.emu_reset_counts()
    yield
    errors = emu.lib.emu_errors().decode()
    emu.lib.emu_clear_errors()
    assert errors == "", "emulator detected:\n" + errors


# ---- batches as the core sees them ----------------------------------------------------------

def bf16_bits(x) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of x, rounded to nearest even through float32."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


class Bf16Bits(np.ndarray):
    """A uint16 array holding bfloat16 bits (the core reads it as dtype bfloat16)."""


def as_bf16(x) -> np.ndarray:
    return bf16_bits(x).view(Bf16Bits)


def marg(a: np.ndarray) -> tuple:
    """(ptr, rows, cols, ld, dtype name) of a 2-D row-major view (rows may be strided), or of 1-D labels."""
    code = BF16 if isinstance(a, Bf16Bits) else CODES[a.dtype]
    item = a.itemsize
    if a.ndim == 1:
        assert a.strides[0] % item == 0
        return (a.__array_interface__["data"][0], a.shape[0], 1, a.strides[0] // item, code)
    assert a.strides[1] == item and a.strides[0] % item == 0
    ld = a.strides[0] // item if a.shape[0] > 1 else a.shape[1]
    return (a.__array_interface__["data"][0], a.shape[0], a.shape[1], ld, code)


def values(a: np.ndarray) -> np.ndarray:
    """What the core reads from a, in float64."""
    if isinstance(a, Bf16Bits):
        return bf16_value(np.asarray(a).view(np.uint16))
    return np.asarray(a, dtype=np.float64)


class Twin:
    """The emulated CUDA backend and, optionally, the CPU backend fed the same batches; keeps every
    array alive (the emulated device reads them when the queued work runs)."""

    def __init__(self, emu, num_classes=-1, cpu=True, product=None, stack=None, stream=0):
        from richness._core import CpuMoments

        self.gpu = emu.mod.CudaMoments(num_classes, 0)
        self.cpu = CpuMoments(num_classes) if cpu else None
        self.keep = []
        self.stream = stream
        if product:
            self.gpu.set_product(*product)
        if stack:
            self.gpu.set_stack(*stack)

    def update(self, x, f=None, y=None, t=None, precision="fp64", cpu_precision=None, stream=None):
        self.keep += [x, f, y, t]
        args = [marg(x)] + [None if v is None else marg(v) for v in (f, y, t)]
        self.gpu.update(*args, precision=PREC[precision], stream=self.stream if stream is None else stream)
        if self.cpu is not None:
            self.cpu.update(*args, precision=PREC[cpu_precision or precision])


def oracle(X, F=None, T=None, y=None, k=None) -> dict:
    """Float64 state from all rows at once (docs/MATH.md's definitions; no streaming)."""
    X = np.asarray(X, dtype=np.float64)
    Xc = center_rows(X)
    s = {"n": X.shape[0], "mean": X.mean(0), "M": Xc.T @ Xc}
    if F is not None:
        Fc = center_rows(F)
        s.update(out_mean=np.asarray(F, np.float64).mean(0), B=Xc.T @ Fc, A=Fc.T @ Fc)
    if T is not None:
        Tc = center_rows(T)
        s.update(tgt_mean=np.asarray(T, np.float64).mean(0), Bt=Xc.T @ Tc, At=Tc.T @ Tc)
    if y is not None:
        y = np.asarray(y)
        k = int(y.max()) + 1 if k is None else k
        s["class_counts"] = np.bincount(y, minlength=k)
        sums = np.zeros((k, X.shape[1]))
        np.add.at(sums, y, X)
        s["class_sums"] = sums
    return s


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def assert_close(got: dict, want: dict, rtol: float, keys=KEYS, what=""):
    for key in ("n", "p", "c", "t", "k"):
        if key in want and key in got:
            assert got[key] == want[key], f"{what} {key}: {got[key]} != {want[key]}"
    if "class_counts" in want:
        np.testing.assert_array_equal(got["class_counts"], want["class_counts"], err_msg=f"{what} class_counts")
    for key in keys:
        if key in want:
            r = rel(got[key], want[key])
            assert r <= rtol, f"{what} {key}: relative error {r:.3g} > {rtol:.3g}"


def assert_equal_states(got: dict, want: dict, what=""):
    """Bit for bit, except the class sums, whose atomic additions may come in any order."""
    assert set(got) == set(want)
    for key in got:
        if key == "class_sums":
            assert rel(got[key], want[key]) <= 1e-15, what
        elif isinstance(want[key], np.ndarray):
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{what} {key}")
        else:
            assert got[key] == want[key], f"{what} {key}: {got[key]} != {want[key]}"


def problem(n=300, p=40, c=7, t=3, k=5, seed=0, mean=3.0):
    rng = np.random.default_rng(seed)
    W = rng.normal(size=(p, p)) / np.sqrt(p)
    X = rng.normal(size=(n, p)) @ W + mean * rng.normal(size=p)  # correlated, off-centre
    F = X[:, :c] @ rng.normal(size=(c, c)) + rng.normal(size=(n, c)) + 1.0
    T = rng.normal(size=(n, t)) - 2.0
    y = rng.integers(0, k, size=n)
    return X, F, T, y


SIZES = (64, 1, 100, 135)  # uneven, with a one-row batch


def slices(sizes=SIZES):
    out, r = [], 0
    for s in sizes:
        out.append(slice(r, r + s))
        r += s
    return out


# ---- the emulator itself ----------------------------------------------------------------------

def test_translate_rewrites_multiline_template_launches():
    src = """
template <typename T>
__global__ void k1(const T* x, int n) { __shared__ double s[4]; __syncthreads(); }
__global__ void k2(int* y) { y[threadIdx.x] = 1; }  // no barrier
void host(int n, cudaStream_t s) {
  k1<std::pair<int,
              float>><<<dim3(n, 2), 256, 0,
                        s>>>(
      nullptr, std::min<int>(n, 3));
  k2<<<1, 32>>>(nullptr);
}
"""
    assert kernels_with_sync(src) == {"k1": True, "k2": False}
    out, launches, _ = translate(src, "x.cu")
    assert launches == ["k1", "k2"]
    assert "<<<" not in out and ">>>" not in out
    assert out.count("\n") == src.count("\n") + 1  # line numbers kept (plus the #line directive)
    assert '::emu::Launch("k1", true, dim3(n, 2), 256, 0,' in out
    assert "k1<std::pair<int,\n              float>>(a...)" in out
    assert '::emu::Launch("k2", false, 1, 32).run([](const auto&... a) { k2(a...); }, nullptr)' in out


def test_every_cuda_source_is_translated_built_and_keyed():
    """The emulator build and the CMake target compile the same .cu files, translate.py accepts each
    one (its launches are of its own kernels), and the build cache key covers every source."""
    cuda_dir = emu_build.CUDA_DIR
    units = sorted(p.name for p in cuda_dir.glob("*.cu"))
    assert len(units) >= 4  # host class, kernels, products, staging
    assert [p.name for p in emu_build.CUDA_SOURCES] == units
    cmake = (cuda_dir / "CMakeLists.txt").read_text()
    listed = cmake.split("pybind11_add_module(_cuda", 1)[1].split(")", 1)[0].split()
    assert sorted(u for u in listed if u.endswith(".cu")) == units
    for name in units:
        _, launches, _ = translate((cuda_dir / name).read_text(), name)
    for p in [*cuda_dir.glob("*.cu"), *cuda_dir.glob("*.cuh"), *cuda_dir.glob("*.hpp")]:
        assert p in emu_build.SOURCES, p


def test_bfloat16_and_half_conversions_bit_exact(emu):
    rng = np.random.default_rng(1)
    # doubles near bf16 rounding ties (where rounding through float32 first would err), and at
    # the ends of the range
    with np.errstate(invalid="ignore"):
        base = bf16_value(rng.integers(0, 1 << 16, size=400).astype(np.uint16))
    base = base[np.isfinite(base)]
    ulp = np.abs(base) * 2.0**-8
    cases = np.concatenate([base, base + ulp / 2, base - ulp / 2, base + ulp / 2 * (1 + 2**-40),
                            base + ulp / 2 * (1 - 2**-40), rng.normal(size=200) * 10.0 ** rng.integers(-40, 38, 200),
                            [0.0, -0.0, 3.4e38, 3.5e38, 1e-45, -1e-41, np.inf, -np.inf]])
    def rne(d: float) -> int:
        """bfloat16 bits of d: one exact rounding to nearest even (Fraction arithmetic)."""
        sign = 0x8000 if np.signbit(d) else 0
        a = abs(d)
        if a == 0:
            return sign
        if np.isinf(a):
            return sign | 0x7F80
        ex = math.frexp(a)[1]  # a = m 2^ex, m in [0.5, 1)
        ulp = Fraction(2) ** (max(ex, -125) - 8)  # 8 significant bits; subnormal spacing 2^-133
        v = round(Fraction(a) / ulp) * ulp  # round() of a Fraction: ties to even
        if v >= 2**128:
            return sign | 0x7F80
        return sign | int(np.array([float(v)], np.float32).view(np.uint32)[0] >> 16)

    for d in cases:
        got = emu.lib.emu_double2bfloat16(float(d))
        assert got == rne(float(d)), (d, hex(got), hex(rne(float(d))))
    assert emu.lib.emu_double2bfloat16(float("nan")) & 0x7FFF > 0x7F80
    halves = np.arange(1 << 16, dtype=np.uint16)
    want = halves.view(np.float16).astype(np.float32)
    got = np.array([emu.lib.emu_half2float(int(h)) for h in halves[::37]], np.float32)
    np.testing.assert_array_equal(got, want[::37])


# ---- per-batch updates --------------------------------------------------------------------

def test_features_only_fp64_matches_cpu_and_oracle(emu):
    X, _, _, _ = problem()
    tw = Twin(emu)
    for s in slices():
        tw.update(X[s])
    g, c = tw.gpu.get_state(), tw.cpu.get_state()
    assert g["n"] == 300 and g["c"] == g["t"] == g["k"] == -1 and g["precision"] == "fp64"
    assert_close(g, c, 1e-12, what="vs cpu")
    assert_close(g, oracle(X), 1e-12, what="vs oracle")


@pytest.mark.parametrize("label_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("num_classes", [-1, 6])
def test_outputs_labels_targets_fp64(emu, label_dtype, num_classes):
    X, F, T, y = problem()
    y = y.astype(label_dtype)
    tw = Twin(emu, num_classes)
    for s in slices():
        tw.update(X[s], F[s], y[s], T[s])
    g, c = tw.gpu.get_state(), tw.cpu.get_state()
    assert g["k"] == (6 if num_classes == 6 else y.max() + 1)
    assert_close(g, c, 1e-12, what="vs cpu")
    assert_close(g, oracle(X, F, T, y, g["k"]), 1e-12, what="vs oracle")


def test_strided_rows_and_labels(emu):
    X, F, T, y = problem()
    wide = np.zeros((300, 53))
    wide[:, 5:45] = X  # features at a column offset, row stride 53 > 40
    fw = np.zeros((300, 9), np.float32)
    fw[:, :7] = F
    yy = np.zeros(600, np.int64)
    yy[::2] = y  # labels with element stride 2
    tw = Twin(emu)
    for s in slices():
        tw.update(wide[s, 5:45], fw[s, :7], yy[::2][s], T[s])
    assert marg(wide[0:64, 5:45])[3] == 53 and marg(yy[::2])[3] == 2
    g = tw.gpu.get_state()
    assert_close(g, tw.cpu.get_state(), 1e-12, what="vs cpu")
    assert_close(g, oracle(X, F.astype(np.float32), T, y), 1e-12, what="vs oracle")


def test_float32_inputs_at_fp32(emu):
    X, F, T, y = problem(seed=3)
    X, F = X.astype(np.float32), F.astype(np.float32)
    tw = Twin(emu)
    for s in slices():
        tw.update(X[s], F[s], y[s], precision="fp32")
    g = tw.gpu.get_state()
    assert g["precision"] == "fp32"
    assert_close(g, tw.cpu.get_state(), 2e-5, what="vs cpu")
    assert_close(g, oracle(X, F, None, y), 2e-5, what="vs oracle")
    assert emu.count("cublasSsyrk") > 0 and emu.count("cublasDsyrk") == 0


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_half_and_bfloat16_inputs(emu, kind):
    X, F, _, _ = problem(seed=4)
    conv = (lambda a: a.astype(np.float16)) if kind == "float16" else as_bf16
    Xh, Fh = conv(X), conv(F)
    tw = Twin(emu)
    for s in slices():
        tw.update(Xh[s], Fh[s])
    g = tw.gpu.get_state()
    assert_close(g, tw.cpu.get_state(), 1e-12, what="vs cpu")
    assert_close(g, oracle(values(Xh), values(Fh)), 1e-12, what="vs oracle")
    tw32 = Twin(emu)
    for s in slices():
        tw32.update(Xh[s], Fh[s], precision="fp32")
    assert_close(tw32.gpu.get_state(), oracle(values(Xh), values(Fh)), 2e-5, what="fp32 vs oracle")


@pytest.mark.parametrize("precision, rtol", [("tf32", 3e-3), ("bf16", 2e-2)])
def test_reduced_precisions(emu, precision, rtol):
    X, F, T, y = problem(seed=5)
    tw = Twin(emu, cpu=False)
    for s in slices():
        tw.update(X[s].astype(np.float32), F[s].astype(np.float32), y[s], T[s], precision=precision)
    g = tw.gpu.get_state()
    assert g["precision"] == precision
    want = oracle(X.astype(np.float32), F.astype(np.float32), T, y)
    # the means and class sums are float64 whatever the product precision
    assert_close(g, want, 1e-12, keys=("mean", "out_mean", "tgt_mean", "class_sums"))
    assert_close(g, want, rtol, keys=("M", "B", "A", "Bt", "At"))
    assert rel(g["M"], want["M"]) > 1e-9  # the reduced precision was really used


# ---- product algorithms -----------------------------------------------------------------------

def large_mean_dlr_error(emu, rows, stack, row_cap, seed=3, p=16, C=4):
    """|DLR - float64 reference| of fp32 products over `rows` rows of mean 1e4 and spread 1e-2
    (the float32 inputs carry a few bits of spread: the products' rounding is what moves DLR)."""
    import richness
    from reference import dlr_thin

    rng = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(rng.normal(size=(p, p)))
    X = (1e4 + 1e-2 * (rng.normal(size=(rows, p)) * np.linspace(0.5, 2.0, p)) @ Q).astype(np.float32)
    Xv = X.astype(np.float64)
    F = (Xv @ rng.normal(size=(C, p)).T + 1e-3 * rng.normal(size=(rows, C))).astype(np.float32)
    want, _ = dlr_thin(Xv, F.astype(np.float64))
    g = emu.mod.CudaMoments(-1, 0)
    g.set_row_cap(row_cap)
    if stack:
        g.set_stack(rows, True)
    keep = []
    for s in (slices((rows // 3, rows // 3, rows - 2 * (rows // 3))) if stack else [slice(0, rows)]):
        keep += [X[s], F[s]]
        g.update(marg(X[s]), marg(F[s]), None, None, precision=PREC["fp32"])
    st = g.get_state()
    m = richness.Moments()
    m.load_state_dict({**st, "precision": "fp32"})
    return abs(m.compute().dlr - want)


@pytest.mark.parametrize("stack", [False, True])
def test_fp32_row_cap_keeps_large_mean_dlr_within_1e6(emu, stack):
    # The emulated float32 products accumulate along the rows with one rounding per term, as a GPU
    # GEMM thread does: over 16,384 rows that moves DLR past the 1e-6 contract; products of at most
    # 1,024 rows (the default cap), summed in float64, stay within it.
    assert emu.mod.CudaMoments(-1, 0).row_cap == 1024
    assert large_mean_dlr_error(emu, 16384, stack, row_cap=0) > 1.2e-6  # past the contract
    assert large_mean_dlr_error(emu, 16384, stack, row_cap=1024) < 2e-7


@pytest.mark.parametrize("stack, joint", [(None, True), ((2000, True), True), ((2000, False), False)])
@pytest.mark.parametrize("algo", ["syrk", "gemm", "block_rows", "tiles"])
def test_fp32_split_products_match_unsplit(emu, stack, joint, algo):
    # Products split into row blocks of 100 (summed in float64) against one product per batch, with
    # outputs and targets: the same state up to float32 rounding.
    X, F, T, y = problem(n=700, p=48, seed=33)
    X, F, T = X.astype(np.float32), F.astype(np.float32), T.astype(np.float32)
    got = {}
    for cap in (0, 100):
        tw = Twin(emu, 5, cpu=False, stack=stack, product=(algo, 16))
        tw.gpu.set_row_cap(cap)
        for s in slices((520, 1, 179)):
            tw.update(X[s], F[s], y[s], T[s], precision="fp32")
        got[cap] = tw.gpu.get_state()
    want = oracle(X, F, T, y, 5)
    assert_close(got[100], want, 2e-6, what="split")
    assert_close(got[100], got[0], 2e-6, what="split vs unsplit")
    with pytest.raises(ValueError, match="row cap"):
        tw.gpu.set_row_cap(-1)


@pytest.mark.parametrize("precision", ["fp64", "fp32", "tf32", "bf16"])
@pytest.mark.parametrize("algo", ["syrk", "gemm", "block_rows", "tiles"])
@pytest.mark.parametrize("p, block", [(48, 16), (40, 16), (10, 16)])
def test_product_algorithms(emu, algo, precision, p, block):
    X, F, T, _ = problem(n=200, p=p, c=5, seed=6)
    tw = Twin(emu, cpu=False, product=(algo, block))
    for s in slices((90, 1, 109)):
        tw.update(X[s].astype(np.float32), F[s].astype(np.float32), None, T[s], precision=precision)
    g = tw.gpu.get_state()
    rtol = {"fp64": 1e-12, "fp32": 2e-5, "tf32": 3e-3, "bf16": 2e-2}[precision]
    assert_close(g, oracle(X.astype(np.float32), F.astype(np.float32), T), rtol)
    tiles = algo == "tiles" and precision != "fp64" and p % block == 0 and p // block >= 2
    assert (emu.count("cublasGemmBatchedEx") > 0) == tiles
    if algo == "syrk" and precision in ("fp64", "fp32", "tf32"):
        assert emu.count("cublasDsyrk" if precision == "fp64" else "cublasSsyrk") >= 3  # M, A, At per batch


def test_automatic_product_choice(emu):
    X, _, _, _ = problem(n=100, p=64)
    for precision, fn in (("fp64", "cublasDsyrk"), ("fp32", "cublasSsyrk"), ("tf32", "cublasGemmEx"),
                          ("bf16", "cublasGemmBatchedEx")):
        emu.lib.emu_reset_counts()
        tw = Twin(emu, cpu=False, product=("auto", 16))
        tw.update(X.astype(np.float32), precision=precision)
        assert tw.gpu.n == 100
        assert emu.count(fn) > 0, precision


@pytest.mark.parametrize("precision, rtol", [("fp64", 1e-12), ("fp32", 2e-5), ("bf16", 2e-2)])
def test_one_pass_centering_matches_oracle(emu, precision, rtol):
    # The per-batch path reads each batch once (center_partials): rows centered on their 256-row
    # chunk's mean, the chunks' offsets from the batch mean added back in float64 at the merge.
    # Chunks whose means drift far apart (8 chunks past the emulator's 7 blocks along y, the last
    # one short), then a one-row batch and a short one.
    X, F, T, y = problem(n=2200, seed=41)
    drift = np.linspace(0.0, 40.0, 2200)[:, None]
    X, F, T = X + drift, F - drift[:, :1] * 3, T + drift[:, :1] * 0.5
    X32, F32 = X.astype(np.float32), F.astype(np.float32)
    tw = Twin(emu, 5, cpu=precision != "bf16")
    emu.lib.emu_reset_counts()
    parts = slices((1900, 1, 299))
    for s in parts:
        tw.update(X32[s], F32[s], y[s], T[s], precision=precision)
    assert emu.count("center_partials") == 3 * len(parts)  # features, outputs, targets of each batch
    assert emu.count("center") == 0 and emu.count("column_partials") == 0  # no second pass
    got = tw.gpu.get_state()
    assert_close(got, oracle(X32, F32, T, y, 5), rtol)
    if tw.cpu is not None:
        assert_close(got, tw.cpu.get_state(), rtol)


# cuBLAS calls one product of X^T X makes (p = 32, block 16: two block rows, three lower tiles).
PRODUCT_CALLS = {"syrk": {"cublasSsyrk": 1}, "gemm": {"cublasGemmEx": 1}, "block_rows": {"cublasGemmEx": 2},
                 "tiles": {"cublasGemmBatchedEx": 1}}
PRODUCT_FNS = ("cublasSsyrk", "cublasGemmEx", "cublasGemmBatchedEx")


def product_counts(emu) -> dict:
    return {fn: emu.count(fn) for fn in PRODUCT_FNS if emu.count(fn)}


def test_product_measured_once_per_shape_without_host_syncs(emu):
    X, _, _, _ = problem(n=170, p=32, seed=21)
    X = X.astype(np.float32)
    tw = Twin(emu, product=("auto", 16))
    tw.update(X[:50], precision="fp32")  # shape (fp32, 32, 50): allocates (synchronises), measures
    assert emu.mod.measured_products() == []
    emu.lib.emu_reset_counts()
    before = emu.lib.emu_host_syncs()
    tw.update(X[50:90], precision="fp32")  # a new shape (40 rows): measured again, scratch already there
    assert emu.lib.emu_host_syncs() == before, "update waited for the device while timing"
    # every applicable algorithm, twice, the default (syrk) last: 2 x (syrk + gemm + 2 block rows + tiles)
    assert product_counts(emu) == {"cublasSsyrk": 2, "cublasGemmEx": 6, "cublasGemmBatchedEx": 2}
    emu.lib.emu_reset_counts()
    tw.update(X[90:130], precision="fp32")  # same shape, times not read yet: the default, no new timing
    assert emu.lib.emu_host_syncs() == 0
    assert emu.count("cudaEventQuery") >= 1  # asked, without waiting
    assert product_counts(emu) == {"cublasSsyrk": 1}
    assert emu.mod.measured_products() == []  # nothing read before a synchronisation
    assert tw.gpu.n == 130
    chosen = {(m["precision"], m["n"], m["rows"], m["block"]): m for m in emu.mod.measured_products()}
    assert set(chosen) == {("fp32", 32, 50, 16), ("fp32", 32, 40, 16)}
    for m in chosen.values():
        assert set(m["ms"]) == {"syrk", "gemm", "block_rows", "tiles"} and m["device"] == 0
        assert m["product"] == min(m["ms"], key=lambda a: (m["ms"][a], a != "syrk"))
    # the choice is kept: this object and a new one multiply (fp32, 32, 40) by it alone
    pick = chosen[("fp32", 32, 40, 16)]["product"]
    other = Twin(emu, product=("auto", 16))
    for t in (tw, other):
        emu.lib.emu_reset_counts()
        t.update(X[130:170], precision="fp32")
        assert product_counts(emu) == PRODUCT_CALLS[pick], t
    assert len(emu.mod.measured_products()) == 2
    # whatever ran, the same state (candidates run in turn over the same rows, the default last)
    assert_close(tw.gpu.get_state(), oracle(X), 2e-5)
    assert_close(tw.gpu.get_state(), tw.cpu.get_state(), 2e-5)


@pytest.mark.parametrize("stack", [None, (100, True)])
def test_every_candidate_gives_the_same_state(emu, stack):
    X, F, T, y = problem(n=200, p=32, c=5, seed=22)
    X, F = X.astype(np.float32), F.astype(np.float32)
    states = {}
    for algo in ("auto", "syrk", "gemm", "block_rows", "tiles"):
        emu.mod.clear_measured_products()
        tw = Twin(emu, 5, cpu=False, product=(algo, 16), stack=stack)
        for s in slices((40, 1, 59, 40, 60)):  # the last two shapes measured (auto), then chosen
            tw.update(X[s], F[s], y[s], T[s], precision="fp32")
        states[algo] = tw.gpu.get_state()
    want = oracle(X, F, T, y, 5)
    for algo, g in states.items():
        assert_close(g, want, 2e-5, what=algo)


def test_product_override_by_call_and_environment(emu, monkeypatch):
    X, _, _, _ = problem(n=60, p=32, seed=23)
    X = X.astype(np.float32)
    for explicit, calls in (("gemm", {"cublasGemmEx": 1}), ("tiles", {"cublasGemmBatchedEx": 1})):
        emu.lib.emu_reset_counts()
        tw = Twin(emu, cpu=False, product=(explicit, 16))
        tw.update(X, precision="fp32")
        assert tw.gpu.n == 60 and tw.gpu.product == explicit
        assert product_counts(emu) == calls  # no measurement
    assert emu.mod.measured_products() == []
    monkeypatch.setenv("RICHNESS_CUDA_PRODUCT", "block_rows:16")
    emu.lib.emu_reset_counts()
    tw = Twin(emu, cpu=False)
    assert tw.gpu.product == "block_rows"
    tw.update(X, precision="fp32")
    assert tw.gpu.n == 60 and product_counts(emu) == {"cublasGemmEx": 2}
    emu.lib.emu_reset_counts()
    tw = Twin(emu, cpu=False, product=("syrk", 16))  # an explicit call wins over the environment
    tw.update(X, precision="fp32")
    assert tw.gpu.n == 60 and product_counts(emu) == {"cublasSsyrk": 1}
    assert emu.mod.measured_products() == []
    for bad in ("fastest", "tiles:x", "tiles:8"):
        monkeypatch.setenv("RICHNESS_CUDA_PRODUCT", bad)
        with pytest.raises(ValueError, match="RICHNESS_CUDA_PRODUCT"):
            emu.mod.CudaMoments(-1, 0)


@pytest.mark.parametrize("stack", [None, (500, False)])
def test_fp32_outputs_gram_by_gemm(emu, stack):
    # F^T F in fp32 by one GEMM (cuBLAS's SSYRK was twice as slow on an H200 at C = 1000); M stays a
    # SYRK when chosen. Same state as the CPU core.
    X, F, _, _ = problem(n=300, p=40, c=7)
    X, F = X.astype(np.float32), F.astype(np.float32)
    emu.lib.emu_reset_counts()
    tw = Twin(emu, stack=stack, product=("syrk", 512))
    tw.update(X, F, precision="fp32")
    g = tw.gpu.get_state()
    assert emu.count("cublasSsyrk") == 1 and emu.count("cublasGemmEx") == 2
    assert_close(g, tw.cpu.get_state(), 2e-6)


# ---- staging ----------------------------------------------------------------------------------

def staged_vs_plain(emu, sizes, stack, joint, precision="fp64", labels=True, outputs=True, targets=True,
                    product=None, num_classes=-1, seed=7, dtype=np.float64):
    n = sum(sizes)
    X, F, T, y = problem(n=n, seed=seed)
    X, F = X.astype(dtype), F.astype(dtype)
    st = Twin(emu, num_classes, stack=(stack, joint), product=product,
              cpu=precision in ("fp64", "fp32"))
    plain = Twin(emu, num_classes, cpu=False, product=product)
    staged = []
    for s in slices(sizes):
        args = (X[s], F[s] if outputs else None, y[s] if labels else None, T[s] if targets else None)
        st.update(*args, precision=precision)
        plain.update(*args, precision=precision)
        staged.append((st.gpu.staged_rows, st.gpu.staged_batches))
    return st, plain, staged, oracle(X, F if outputs else None, T if targets else None, y if labels else None)


@pytest.mark.parametrize("joint", [True, False])
def test_stage_fills_exactly_overflows_and_is_bypassed(emu, joint):
    # stage of 100 rows: 60 + 40 fill it; 30 overflows it (flush, then staged); 150 is bigger than
    # the stage (per batch, 30 rows stay staged); 1 row; 69 more rows overflow again
    sizes = (60, 40, 30, 150, 1, 70)
    st, plain, staged, want = staged_vs_plain(emu, sizes, 100, joint)
    assert staged == [(60, 1), (100, 2), (30, 1), (30, 1), (31, 2), (70, 1)]
    assert st.gpu.stack_rows == 100 and st.gpu.stack_joint == joint
    g = st.gpu.get_state()  # flushes
    assert st.gpu.staged_rows == 0 and st.gpu.staged_batches == 0
    assert_close(g, plain.gpu.get_state(), 1e-12, what="vs per batch")
    assert_close(g, st.cpu.get_state(), 1e-12, what="vs cpu")
    assert_close(g, want, 1e-12, what="vs oracle")


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("joint", [True, False])
def test_stage_reduced_precisions(emu, precision, joint):
    st, plain, _, want = staged_vs_plain(emu, (50, 70, 1, 79, 100), 128, joint, precision, dtype=np.float32)
    g = st.gpu.get_state()
    assert g["precision"] == precision
    rtol = {"fp32": 2e-5, "tf32": 3e-3, "bf16": 2e-2}[precision]
    assert_close(g, want, rtol, what="vs oracle")
    assert_close(g, want, 1e-12, keys=("mean", "out_mean", "tgt_mean", "class_sums"), what="means")
    assert_close(plain.gpu.get_state(), want, rtol, what="per batch vs oracle")


@pytest.mark.parametrize("algo", ["syrk", "gemm", "block_rows", "tiles"])
@pytest.mark.parametrize("joint", [True, False])
def test_stage_product_algorithms(emu, algo, joint):
    # p = 40, joint width 40 + 7 + 3 = 50 (padded row width 56): block 16 splits neither evenly;
    # block 25 tiles the joint product (50 = 2 x 25) but not the features alone
    for block in (16, 25):
        emu.lib.emu_reset_counts()
        st, plain, _, want = staged_vs_plain(emu, (60, 60, 1, 39), 200, joint, "fp32", product=(algo, block),
                                             dtype=np.float32)
        g = st.gpu.get_state()
        assert_close(g, want, 2e-5, what=f"block {block}")
        assert_close(g, plain.gpu.get_state(), 2e-5, what=f"block {block} vs per batch")
        if algo == "tiles":
            assert emu.count("cublasGemmBatchedEx") > 0 or not (block == 25 and joint)


def test_stage_features_only_and_many_small_batches(emu):
    # more batches than the stage holds means for (256): flushed at 256 batches
    sizes = (2,) * 300
    st, plain, staged, want = staged_vs_plain(emu, sizes, 100000, True, labels=False, outputs=False,
                                              targets=False)
    assert staged[255] == (512, 256) and staged[256] == (2, 1)
    assert_close(st.gpu.get_state(), want, 1e-12)
    assert_close(plain.gpu.get_state(), want, 1e-12)


@pytest.mark.parametrize("num_classes", [-1, 5])
def test_stage_labels_growing(emu, num_classes):
    X, F, T, y = problem(n=300, k=5, seed=8)
    y = y.copy()
    y[:150] = np.minimum(y[:150], 1)  # the class range grows mid-stage without num_classes
    tw = Twin(emu, num_classes, stack=(1000, True))
    for s in slices((100, 50, 150)):
        tw.update(X[s], F[s], y[s], T[s])
    g = tw.gpu.get_state()
    assert_close(g, tw.cpu.get_state(), 1e-12)
    assert_close(g, oracle(X, F, T, y), 1e-12)


def test_stage_precision_switch_flushes(emu):
    X, F, _, _ = problem(n=200)
    tw = Twin(emu, cpu=False, stack=(1000, True))
    tw.update(X[:100], F[:100], precision="fp64")
    tw.update(X[100:].astype(np.float32), F[100:].astype(np.float32), precision="fp32")
    assert tw.gpu.staged_batches == 1 and tw.gpu.staged_rows == 100  # the fp64 rows were flushed
    g = tw.gpu.get_state()
    assert g["precision"] == "fp32"
    assert_close(g, oracle(np.vstack([X[:100], X[100:].astype(np.float32)]),
                           np.vstack([F[:100], F[100:].astype(np.float32)])), 2e-5)


def test_set_stack_flushes_and_turns_off(emu):
    X, F, _, _ = problem(n=300)
    tw = Twin(emu, stack=(1000, True))
    tw.update(X[:100], F[:100])
    tw.gpu.set_stack(0, True)  # flushes
    assert tw.gpu.staged_rows == 0 and tw.gpu.stack_rows == 0
    tw.update(X[100:], F[100:])
    assert tw.gpu.staged_rows == 0
    assert_close(tw.gpu.get_state(), tw.cpu.get_state(), 1e-12)
    with pytest.raises(ValueError, match="stack_rows"):
        tw.gpu.set_stack(-1, True)


# ---- bad batches --------------------------------------------------------------------------------

BAD_MSG = {
    "nan": r"1 batch was not added \(checked on the device\): features contain 3 non-finite values",
    "inf": r"1 batch was not added \(checked on the device\): outputs contain 1 non-finite value \(NaN or Inf\)",
    "label": r"1 batch was not added \(checked on the device\): labels out of range: 2 labels outside 0..4",
    # finite values whose co-moments would overflow float64, or whose squares underflow it (the CPU's rules)
    "overflow": r"1 batch was not added \(checked on the device\): features are too large: their co-moments overflow "
                r"float64 \(largest magnitude in the batch \S+e\+16\d\); rescale them",
    "outputs overflow": r"1 batch was not added \(checked on the device\): outputs are too large: .*overflow float64",
    "underflow": r"1 batch was not added \(checked on the device\): targets vary by at most \S+e-170, too little for "
                 r"fp64 products: their squares underflow float64; rescale them",
}


BAD_LIMIT = {"nan": "finite", "inf": "finite", "label": "num_classes", "overflow": "overflow",
             "outputs overflow": "overflow", "underflow": "underflow"}


def spoil(kind, x, f, y):
    x, f, y = x.copy(), f.copy(), y.copy()
    if kind == "nan":
        x[3, 1] = x[7, 0] = x[0, 39] = np.nan
    elif kind == "inf":
        f[2, 2] = -np.inf
    elif kind == "overflow":
        x = x * 1e160
    elif kind == "outputs overflow":
        f = f * 1e160
    elif kind == "underflow":
        pass  # the targets, in the test
    else:
        y[5] = 5
        y[9] = -1
    return x, f, y


@pytest.mark.parametrize("stack", [None, (1000, True), (1000, False), (120, True)])
@pytest.mark.parametrize("kind", ["nan", "inf", "label", "overflow", "outputs overflow", "underflow"])
@pytest.mark.parametrize("where", ["first", "middle"])
def test_bad_batch_adds_nothing_and_raises_at_next_sync(emu, kind, stack, where):
    X, F, T, y = problem(n=300, k=5, seed=9)
    parts = slices((100, 60, 140))
    bad_at = 0 if where == "first" else 1
    with_bad = Twin(emu, 5, cpu=False, stack=stack)
    without = Twin(emu, 5, cpu=False, stack=stack)
    for i, s in enumerate(parts):
        x, f, yy = X[s], F[s], y[s]
        if i == bad_at:
            bx, bf, by = spoil(kind, x, f, yy)
            bt = T[s] * 1e-170 if kind == "underflow" else T[s]
            with_bad.update(bx, bf, by, bt)  # no error here: update never waits for the device
        else:
            with_bad.update(x, f, yy, T[s])
            without.update(x, f, yy, T[s])
    if stack == (1000, True) or stack == (1000, False):
        assert with_bad.gpu.staged_batches == 3  # the bad batch is in the middle of (or opens) the stage
    with pytest.raises(ValueError, match=BAD_MSG[kind]) as refused:
        with_bad.gpu.n
    assert refused.value.limit == BAD_LIMIT[kind]  # the structured field, as the CPU's refusal carries it
    assert with_bad.gpu.n == (200 if bad_at == 0 else 240)  # the error was cleared; the state is usable
    want = without.gpu.get_state()
    if stack == (120, True):
        # the bad batch's rows take stage space (the host cannot know it is bad), so the stages
        # flush at other times than without it and the merges come in another order: rounding
        assert_close(with_bad.gpu.get_state(), want, 1e-15)
    else:
        assert_equal_states(with_bad.gpu.get_state(), want)
    good = np.r_[100:300] if bad_at == 0 else np.r_[0:100, 160:300]
    assert_close(want, oracle(X[good], F[good], T[good], y[good], 5), 1e-12)


def test_scale_checks_as_on_the_cpu(emu):
    # The same batches the CPU refuses at update (csrc/cpu: overflow_of, the underflow check) are refused
    # at the next synchronisation, with the same largest magnitude; the state stays as it was.
    X, F, T, y = problem(n=300, k=5, seed=31)
    cases = {
        # fp32 products: squares of 2e19 overflow float32 (not float64)
        "fp32 products": (lambda x, f, t: ((x * 1e19).astype(np.float32), f, t), "fp32",
                          r"features are too large: their co-moments overflow the float32 products.*"
                          r"\(largest magnitude in the batch (\S+)\).*precision='fp64'"),
        # constant within the batch, 1e160 from the state's mean: the mean-shift term overflows
        "mean shift": (lambda x, f, t: (x + 1e160, f, t), "fp64",
                       r"features are too large: .*overflow float64 \(largest magnitude in the batch (\S+)\)"),
        "fp32 underflow": (lambda x, f, t: ((x * 1e-30).astype(np.float32), f, t), "fp32",
                           r"features vary by at most \S+e-30, too little for fp32 products: their squares underflow "
                           r"float32.*precision='fp64'"),
    }
    for name, (make, precision, pattern) in cases.items():
        tw = Twin(emu, 5)
        tw.update(X[:100], F[:100], y[:100], T[:100], precision=precision)
        before = tw.gpu.get_state()
        bx, bf, bt = make(X[100:200], F[100:200], T[100:200])
        tw.keep.append((bx, bf, bt))
        tw.gpu.update(marg(bx), marg(bf), marg(y[100:200]), marg(bt), precision=precision)
        with pytest.raises(ValueError, match=pattern) as cpu_err:
            tw.cpu.update(marg(bx), marg(bf), marg(y[100:200]), marg(bt), precision=precision)
        with pytest.raises(ValueError, match=pattern) as gpu_err:
            tw.gpu.n
        if "magnitude" in pattern:
            import re

            assert re.search(pattern, str(gpu_err.value)).group(1) == re.search(pattern, str(cpu_err.value)).group(1)
        assert_equal_states(tw.gpu.get_state(), before, name)
        tw.update(X[200:], F[200:], y[200:], T[200:], precision=precision)  # still usable
        rows = np.r_[0:100, 200:300]
        assert_close(tw.gpu.get_state(), oracle(X[rows], F[rows], T[rows], y[rows], 5),
                     1e-12 if precision == "fp64" else 2e-5, what=name)


def test_bad_batches_counted_together(emu):
    X, F, T, y = problem(n=300, k=5, seed=10)
    tw = Twin(emu, 5, cpu=False)
    bx, bf, by = spoil("nan", X[:100], F[:100], y[:100])
    tw.update(bx, bf, by, T[:100])
    cx, cf, cy = spoil("label", X[100:200], F[100:200], y[100:200])
    tw.update(cx, cf, cy, T[100:200])
    tw.update(X[200:], F[200:], y[200:], T[200:])
    with pytest.raises(ValueError, match=r"2 batches were not added .*features contain 3 non-finite values \(NaN or Inf\); "
                                         r"labels out of range: 2 labels"):
        tw.gpu.get_state()
    assert_close(tw.gpu.get_state(), oracle(X[200:], F[200:], T[200:], y[200:], 5), 1e-12)


def test_negative_label_without_num_classes(emu):
    X, _, _, y = problem(n=200, k=4, seed=11)
    tw = Twin(emu, -1, cpu=False)
    tw.update(X[:100], None, y[:100])
    yb = y[100:].copy()
    yb[3] = -2
    tw.update(X[100:], None, yb)
    with pytest.raises(ValueError, match=r"labels out of range: 1 label negative"):
        tw.gpu.n
    assert_close(tw.gpu.get_state(), oracle(X[:100], None, None, y[:100], 4), 1e-12)


def test_all_staged_batches_bad(emu):
    X, F, _, _ = problem(n=200)
    tw = Twin(emu, cpu=False, stack=(1000, True))
    tw.update(X[:100], F[:100])
    tw.gpu.n  # flushed
    bx, bf, _ = spoil("nan", X[100:150], F[100:150], np.zeros(50, np.int64))
    tw.update(bx, bf)
    tw.update(bx, bf)
    with pytest.raises(ValueError, match="2 batches were not added"):
        tw.gpu.get_state()
    assert_close(tw.gpu.get_state(), oracle(X[:100], F[:100]), 1e-12)


# ---- merge, state round trips, export, reset ---------------------------------------------------

@pytest.mark.parametrize("stack", [None, (1000, True)])
def test_merge_two_states(emu, stack):
    X, F, T, y = problem(n=300, k=5, seed=12)
    a, b = Twin(emu, -1, stack=stack), Twin(emu, -1, stack=stack)
    a.update(X[:50], F[:50], np.minimum(y[:50], 2), T[:50])  # fewer classes here than in b
    b.update(X[50:170], F[50:170], y[50:170], T[50:170])
    b.update(X[170:], F[170:], y[170:], T[170:])
    a.gpu.merge(b.gpu)  # both staged (with stack): merge flushes
    a.cpu.merge(b.cpu)
    yy = np.concatenate([np.minimum(y[:50], 2), y[50:]])
    g = a.gpu.get_state()
    assert_close(g, a.cpu.get_state(), 1e-12, what="vs cpu")
    assert_close(g, oracle(X, F, T, yy), 1e-12, what="vs oracle")
    assert_close(b.gpu.get_state(), oracle(X[50:], F[50:], T[50:], y[50:]), 1e-12, what="other unchanged")
    # merge into an empty one and into itself
    e = Twin(emu, -1)
    e.gpu.merge(a.gpu)
    assert_close(e.gpu.get_state(), g, 1e-15, what="into empty")
    a.gpu.merge(a.gpu)
    twice = a.gpu.get_state()
    assert twice["n"] == 600
    np.testing.assert_array_equal(twice["class_counts"], 2 * g["class_counts"])
    assert_close(twice, {**g, "n": 600, "class_counts": 2 * g["class_counts"], "M": 2 * g["M"], "B": 2 * g["B"], "A": 2 * g["A"], "Bt": 2 * g["Bt"],
                         "At": 2 * g["At"], "class_sums": 2 * g["class_sums"]}, 1e-12,
                 keys=("mean", "M", "B", "A", "Bt", "At", "class_sums"))


def test_merge_raises_the_others_pending_error(emu):
    X, F, _, _ = problem(n=200)
    a, b = Twin(emu, cpu=False), Twin(emu, cpu=False)
    a.update(X[:100], F[:100])
    bx, bf, _ = spoil("nan", X[100:], F[100:], np.zeros(100, np.int64))
    b.update(bx, bf)
    with pytest.raises(ValueError, match="features contain 3"):
        a.gpu.merge(b.gpu)
    assert a.gpu.n == 100


def test_set_state_get_state_round_trip(emu):
    X, F, T, y = problem(n=300, k=5, seed=13)
    tw = Twin(emu, 7)
    for s in slices((150, 150)):
        tw.update(X[s], F[s], y[s], T[s])
    cpu_state = tw.cpu.get_state()
    g = emu.mod.CudaMoments(-1, 0)
    g.set_state(cpu_state)
    assert_equal_states(g.get_state(), cpu_state, "cpu -> emu -> dict")
    from richness._core import CpuMoments

    c = CpuMoments(-1)
    c.set_state(tw.gpu.get_state())
    assert_close(c.get_state(), cpu_state, 1e-12, what="emu -> cpu")
    # a restored state keeps streaming
    g.update(marg(X[:10]), marg(F[:10]), marg(y[:10]), marg(T[:10]), precision="fp64")
    tw.cpu.update(marg(X[:10]), marg(F[:10]), marg(y[:10]), marg(T[:10]), precision="fp64")
    assert_close(g.get_state(), tw.cpu.get_state(), 1e-12, what="after more batches")
    empty = emu.mod.CudaMoments(3, 0)
    empty.set_state(CpuMoments(3).get_state())
    assert empty.n == 0 and empty.get_state()["num_classes"] == 3


def test_export_to_host_buffers(emu):
    X, F, T, y = problem(n=300, k=5, seed=14)
    tw = Twin(emu, 5, stack=(1000, True))
    for s in slices():
        tw.update(X[s], F[s], y[s], T[s])
    want = tw.gpu.get_state()
    bufs = {key: np.full_like(want[key], np.nan if want[key].dtype == np.float64 else -7)
            for key in KEYS + ("class_counts",)}
    for b in bufs.values():
        emu.lib.emu_register(b.ctypes.data, b.nbytes)  # as device memory, for the emulator's checks
    try:
        tw.update(X[:30], F[:30], y[:30], T[:30])  # staged: export_to flushes first
        want = oracle(np.vstack([X, X[:30]]), np.vstack([F, F[:30]]), np.vstack([T, T[:30]]),
                      np.concatenate([y, y[:30]]), 5)
        tw.gpu.export_to({key: b.ctypes.data for key, b in bufs.items()})
    finally:
        for b in bufs.values():
            emu.lib.emu_unregister(b.ctypes.data)
    got = tw.gpu.get_state()
    assert_close(got, want, 1e-12)
    for key, b in bufs.items():
        np.testing.assert_array_equal(b, got[key], err_msg=key)


def test_reset_forgets_state_and_staged_rows(emu):
    X, F, _, _ = problem(n=300)
    tw = Twin(emu, cpu=False, stack=(1000, True))
    tw.update(X[:100], F[:100])
    tw.gpu.n
    tw.update(X[100:150], F[100:150])
    assert tw.gpu.staged_rows == 50
    tw.gpu.reset()
    assert tw.gpu.n == 0 and tw.gpu.staged_rows == 0 and tw.gpu.p == -1
    Y = X[:, :13].copy()
    tw.update(Y[:120])  # new width, no outputs
    tw.update(Y[120:])
    g = tw.gpu.get_state()
    assert g["p"] == 13 and g["c"] == -1
    assert_close(g, oracle(Y), 1e-12)


# ---- asynchrony and streams ---------------------------------------------------------------------

@pytest.mark.parametrize("stack", [None, (250, True)])
def test_update_never_waits_for_the_device(emu, stack):
    X, F, T, y = problem(n=600, seed=15)
    tw = Twin(emu, 5, cpu=False, stack=stack)
    tw.update(X[:100], F[:100], y[:100], T[:100])  # first batch: allocates (synchronises)
    tw.gpu.n
    before = emu.lib.emu_host_syncs()
    for s in (slice(100, 200), slice(200, 300), slice(300, 400), slice(400, 500)):
        tw.update(X[s], F[s], y[s], T[s])  # with the stack: 100 + 100 rows staged, flushed in update
        assert emu.lib.emu_pending() > 0
    assert emu.lib.emu_host_syncs() == before
    assert tw.gpu.n == 500
    assert_close(tw.gpu.get_state(), oracle(X[:500], F[:500], T[:500], y[:500], 5), 1e-12)


@pytest.mark.parametrize("stack", [None, (250, True)])
def test_labels_without_num_classes_never_wait_and_defer_past_capacity(emu, stack):
    # Without num_classes the first labelled batch sizes the class arrays (64 classes here: room for
    # twice its labels); rows labelled past that are copied on the device and added at the next
    # synchronising call. No update waits for the device, and the state is the CPU core's.
    X, F, T, y = problem(n=700, k=5, seed=31)
    y = y.copy()
    y[300:400] += 70  # a whole batch past the capacity
    y[450] = 200      # one row of a batch
    tw = Twin(emu, -1, stack=stack)
    tw.update(X[:100], F[:100], y[:100], T[:100])  # first batch: allocates (synchronises)
    assert tw.gpu.n == 100 and tw.gpu.shape()["k"] == 5
    before = emu.lib.emu_host_syncs()
    for s in slices((100,) * 6):
        s = slice(s.start + 100, s.stop + 100)
        tw.update(X[s], F[s], y[s], T[s])
    assert emu.lib.emu_host_syncs() == before
    g = tw.gpu.get_state()
    assert g["k"] == 201 and tw.gpu.shape()["k"] == 201
    assert_close(g, tw.cpu.get_state(), 1e-12, what="vs cpu")
    assert_close(g, oracle(X, F, T, y, 201), 1e-12, what="vs oracle")
    # grown at that synchronising call: the same labels no longer need the deferral
    tw.update(X[300:400], F[300:400], y[300:400], T[300:400])
    assert_close(tw.gpu.get_state(), tw.cpu.get_state(), 1e-12, what="after growth")


def test_labels_past_capacity_beyond_the_deferral_buffer_are_refused_whole(emu):
    # The deferral buffer holds 1,024 rows (or the widest labelled batch) between synchronising
    # calls: a batch whose rows past the capacity do not fit is not added at all (an error at the
    # next synchronising call), the ones before and after it are.
    X, _, _, y = problem(n=2400, k=5, seed=32)
    y = y.copy()
    y[600:] += 100
    tw = Twin(emu, -1)
    tw.update(X[:600], None, y[:600])  # the widest batch first: scratch sized, no growth later
    tw.gpu.n
    before = emu.lib.emu_host_syncs()
    tw.update(X[600:1200], None, y[600:1200])  # 600 deferred rows: fit
    tw.gpu.update(marg(X[1200:1800]), None, marg(y[1200:1800]), None, precision="fp64")  # 600 more: do not
    assert emu.lib.emu_host_syncs() == before
    with pytest.raises(ValueError, match=r"1 batch was not added.*600 rows labelled past the class capacity"):
        tw.gpu.n
    assert_close(tw.gpu.get_state(), tw.cpu.get_state(), 1e-12, what="refused batch left out")
    tw.update(X[1800:], None, y[1800:])  # capacity grown at the sync: added directly
    g = tw.gpu.get_state()
    assert g["n"] == 1800 and g["k"] == int(y.max()) + 1
    keep = np.r_[0:1200, 1800:2400]
    assert_close(g, oracle(X[keep], None, None, y[keep], g["k"]), 1e-12, what="vs oracle")


@pytest.mark.parametrize("stack", [None, (150, True)])
def test_updates_on_alternating_streams_are_ordered(emu, stack):
    # Streams are opaque handles to the emulator: work on two of them interleaves at random unless
    # the backend orders them (order_after_last)
    X, F, T, y = problem(n=600, seed=16)
    tw = Twin(emu, 5, stack=stack)
    for i, s in enumerate(slices((100,) * 6)):
        tw.update(X[s], F[s], y[s], T[s], stream=0x1000 if i % 2 else 0x2000)
    g = tw.gpu.get_state()
    assert_close(g, tw.cpu.get_state(), 1e-12)


def test_device_info_and_module_surface(emu):
    assert "CPU emulator" in emu.mod.info()
    assert "sm_90" in emu.mod.device_info(0)
    with pytest.raises(ValueError, match="does not exist"):
        emu.mod.CudaMoments(-1, 1)
    g = emu.mod.CudaMoments(-1, 0)
    assert g.n == 0 and g.p == -1
    with pytest.raises(ValueError, match="product must be"):
        g.set_product("fast", 64)
    with pytest.raises(ValueError, match="at least 16"):
        g.set_product("tiles", 8)
    X = np.ones((4, 3))
    with pytest.raises(TypeError):
        g.update((X.ctypes.data, 4, 3, 3, I32))
    g.update(marg(X))
    with pytest.raises(ValueError, match="columns"):
        g.update(marg(np.ones((4, 5))))
    assert g.get_state()["M"].shape == (3, 3) and g.n == 4


@pytest.mark.parametrize("stack", [None, (1000, True)])
def test_skipped_batch_does_not_grow_the_classes(emu, stack):
    # Without num_classes, update() sizes the class arrays from the batch's largest label before the
    # device has checked the batch; a skipped batch must not leave its labels in the state's k.
    X, _, _, y = problem(n=300, k=3, seed=17)
    tw = Twin(emu, -1, stack=stack)
    tw.update(X[:100], None, y[:100])
    bx, by = X[100:200].copy(), y[100:200].copy()
    bx[0, 0] = np.nan
    by[1] = 7
    tw.gpu.update(marg(bx), None, marg(by), None, precision="fp64")
    with pytest.raises(ValueError, match="features contain 1 non-finite value"):
        tw.gpu.n
    g = tw.gpu.get_state()
    assert g["k"] == 3 and tw.gpu.shape()["k"] == 3
    assert_close(g, tw.cpu.get_state(), 1e-12)
    tw.update(X[200:], None, np.maximum(y[200:], 1))
    assert_close(tw.gpu.get_state(), tw.cpu.get_state(), 1e-12, what="after growing again")
    # a state shaped by a skipped first batch: empty, and merging into it takes the other's shape
    e = Twin(emu, -1, cpu=False, stack=stack)
    e.gpu.update(marg(bx), None, marg(by), None, precision="fp64")
    with pytest.raises(ValueError):
        e.gpu.n
    assert e.gpu.get_state()["n"] == 0 and e.gpu.get_state()["k"] == -1
    e.gpu.merge(tw.gpu)
    assert_close(e.gpu.get_state(), tw.cpu.get_state(), 1e-12, what="merged into skipped-shaped")


@pytest.mark.parametrize("how", ["load", "merge"])
def test_skipped_batch_keeps_a_loaded_states_empty_classes(emu, how):
    # A state that ends in empty classes (counted with num_classes=8 on the CPU, labels 0..2) keeps
    # its k = 8 when it is loaded into, or merged into, a backend without num_classes and a later
    # batch with a larger label is skipped: the trim stops at the k of the last check.
    from richness._core import CpuMoments

    X, _, _, y = problem(n=200, k=3, seed=21)
    src = CpuMoments(8)
    src.update(marg(X[:100]), None, marg(y[:100]), None, precision="fp64")
    want = src.get_state()
    assert want["k"] == 8
    g = emu.mod.CudaMoments(-1, 0)
    if how == "load":
        g.set_state({**want, "num_classes": -1})  # k = 8 without num_classes: the labels may grow
    else:
        other = emu.mod.CudaMoments(8, 0)
        other.set_state(want)
        g.merge(other)
    bx, by = X[100:].copy(), y[100:].copy()
    bx[3, 1] = np.inf
    by[0] = 11
    g.update(marg(bx), None, marg(by), None, precision="fp64")
    with pytest.raises(ValueError, match="non-finite"):
        g.n
    got = g.get_state()
    assert got["k"] == 8 and g.shape()["k"] == 8
    assert_equal_states(got, {**want, "num_classes": got["num_classes"]}, what=how)


@pytest.mark.parametrize("stack", [None, (2000, True), (2000, False)])
def test_wide_and_long_batches(emu, stack):
    # several row chunks of 256 in the column means, several 256-column blocks in the centering,
    # several 128-column blocks in the cross merge, several 32 x 32 tiles in the merges
    X, F, T, y = problem(n=700, p=300, c=140, t=3, k=4, seed=18)
    tw = Twin(emu, 4, stack=stack)
    for s in slices((520, 1, 179)):
        tw.update(X[s], F[s], y[s], T[s])
    g = tw.gpu.get_state()
    assert_close(g, tw.cpu.get_state(), 1e-12, what="vs cpu")
    assert_close(g, oracle(X, F, T, y, 4), 1e-12, what="vs oracle")


@pytest.mark.parametrize("stack", [None, (6000, True)])
def test_tall_batch_strides_over_row_chunks(emu, stack):
    # The emulated build caps grid.y at 7 blocks (build.py): a batch of 2,500 rows has 10 row chunks
    # of 256 in the column means, so blocks take several chunks each (as beyond 16.7M rows on a GPU),
    # and the centering, class sums and cross merges stride over rows too.
    X, F, T, y = problem(n=2600, p=9, c=4, t=2, k=3, seed=23, mean=50.0)
    tw = Twin(emu, 3, stack=stack)
    for s in slices((2500, 100)):
        tw.update(X[s], F[s], y[s], T[s])
    g = tw.gpu.get_state()
    assert_close(g, tw.cpu.get_state(), 1e-12, what="vs cpu")
    assert_close(g, oracle(X, F, T, y, 3), 1e-11, what="vs oracle")


# ---- CUDA graph capture -----------------------------------------------------------------------

def setup_capture(emu):
    emu.lib.emu_begin_capture.argtypes = [ctypes.c_size_t]
    emu.lib.emu_end_capture.restype = ctypes.c_longlong


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("stack", [None, (4096, True)])
@pytest.mark.parametrize("algo", ["auto", "tiles"])
@pytest.mark.parametrize("fixed", [True, False])
def test_update_captures_in_a_graph_and_replays(emu, precision, stack, algo, fixed):
    # Captured on a side stream (global mode): no synchronisation, allocation or legacy-stream work
    # may happen inside update (the emulator records any as an error). Each replay re-reads the
    # same input buffers, refilled by the host in between, as a training loop would. Without
    # num_classes (fixed=False) the replayed batches carry labels past the first batch's capacity.
    setup_capture(emu)
    n, K = 256, 6
    X, F, _, y = problem(n=5 * n, p=64, c=8, k=K, seed=19)
    X, F = X.astype(np.float32), F.astype(np.float32)
    if not fixed:
        y = y.copy()
        y[n + 5::7] += 90
        K = int(y.max()) + 1
    bx, bf, by = X[:n].copy(), F[:n].copy(), y[:n].copy()
    side = 0x5000
    tw = Twin(emu, K if fixed else -1, cpu=False, stack=stack, product=(algo, 16), stream=side)
    tw.update(X[:n], F[:n], y[:n], precision=precision)  # warm-up: allocates the state and scratch
    tw.gpu.n
    before = emu.lib.emu_host_syncs()
    emu.lib.emu_begin_capture(side)
    try:
        tw.update(bx, bf, by, precision=precision)
    finally:
        captured = emu.lib.emu_end_capture()
    assert captured > 5 and emu.lib.emu_host_syncs() == before
    assert tw.gpu.staged_rows == 0  # a captured update never stages
    for i in range(1, 5):
        tw.gpu.n  # the host's refill must not race the previous replay
        bx[:], bf[:], by[:] = X[i * n:(i + 1) * n], F[i * n:(i + 1) * n], y[i * n:(i + 1) * n]
        emu.lib.emu_replay()
    g = tw.gpu.get_state()
    assert g["n"] == 5 * n
    rtol = {"fp32": 2e-5, "tf32": 3e-3, "bf16": 2e-2}[precision]
    assert_close(g, oracle(X, F, None, y, K), rtol)
    assert_close(g, oracle(X, F, None, y, K), 1e-12, keys=("mean", "out_mean", "class_sums"))


def test_set_state_into_a_staged_moments_then_stage_more(emu):
    X, F, T, y = problem(n=400, k=5, seed=20)
    src = Twin(emu, 5)
    src.update(X[:150], F[:150], y[:150], T[:150])
    tw = Twin(emu, 5, cpu=False, stack=(200, True))
    tw.update(X[150:200], F[150:200], y[150:200], T[150:200])  # staged, then replaced by set_state
    tw.gpu.set_state(src.cpu.get_state())
    assert tw.gpu.staged_rows == 0 and tw.gpu.stack_rows == 200
    for s in slices((150, 60, 1, 300 - 211)):
        s = slice(s.start + 150, s.stop + 150)
        tw.update(X[s], F[s], y[s], T[s])
    bx = X[150:400].copy()  # a bad batch bigger than the stage, while rows are staged
    bx[7, 3] = np.inf
    tw.update(bx, F[150:400], y[150:400], T[150:400])
    with pytest.raises(ValueError, match="features contain 1 non-finite value"):
        tw.gpu.n
    assert_close(tw.gpu.get_state(), oracle(X, F, T, y, 5), 1e-12)


def test_threads_share_one_object(emu):
    # The bindings' per-object lock: 4 threads updating (and one reading) one CudaMoments give the
    # oracle's state; without it they raced on the host-side staging and scratch.
    import threading

    rng = np.random.default_rng(5)
    for _ in range(5):
        gpu = emu.mod.CudaMoments(4, 0)
        data = [(rng.normal(size=(n, 5)), rng.normal(size=(n, 2)), rng.integers(0, 4, size=n))
                for n in rng.integers(1, 200, size=12)]
        keep, errors = [], []
        start = threading.Barrier(5)

        def feed(part):
            start.wait()
            try:
                for x, f, y in part:
                    keep.append((x, f, y))  # alive until the next synchronising call
                    gpu.update(marg(x), marg(f), marg(y), None, precision=PREC["fp64"], stream=0)
            except Exception as e:
                errors.append(e)

        def read():
            start.wait()
            try:
                for _ in range(10):
                    st = gpu.get_state()
                    assert st["class_counts"].sum() == st["n"]
            except Exception as e:
                errors.append(e)

        threads = [threading.Thread(target=feed, args=(data[i::4],)) for i in range(4)]
        threads.append(threading.Thread(target=read))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        X, F, y = (np.concatenate([b[i] for b in data]) for i in range(3))
        assert_close(gpu.get_state(), oracle(X, F, y=y, k=4), 1e-12, what="threads vs oracle")


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_device_moments_copies_and_pickles_through_its_state(emu, monkeypatch, how):
    """A CUDA Moments copies through its state dict into a new device
    accumulator (the emulated one here): equal, independent, staging kept."""
    import copy
    import pickle

    import richness
    from richness._engine import backend as _backend

    monkeypatch.setattr(_backend, "_cuda_core", lambda num_classes, device: emu.mod.CudaMoments(num_classes, 0))
    X, F, T, y = problem(n=300, k=5, seed=21)
    cpu = richness.Moments(5)
    cpu.update(X[:200], F[:200], y[:200], T[:200])
    m = richness.Moments(5, device="cuda:0", cuda=richness.CudaOptions(stack_rows=64))
    m.load_state_dict(cpu.state_dict())
    before = m.state_dict()
    dup = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": lambda o: pickle.loads(pickle.dumps(o))}[how](m)
    core, orig_core = dup._backend.core, m._backend.core  # the device accumulators themselves: internals under test
    assert dup.device == "cuda:0" and type(core) is type(orig_core) and core is not orig_core
    assert core.stack_rows == 64 and dup.num_classes == 5
    assert_equal_states(dup.state_dict(), before)
    core.update(marg(X[200:]), marg(F[200:]), marg(y[200:]), marg(T[200:]), precision="fp64")
    assert_equal_states(m.state_dict(), before)  # the original is untouched
    assert_close(dup.state_dict(), oracle(X, F, T, y, 5), 1e-12, what="copy after more rows")


def test_device_moments_cuda_options_reach_the_core_and_survive_copies(emu, monkeypatch):
    """Moments' CUDA options (staging, joint product, product algorithm) are
    set on the device accumulator, on every group's, and on a copy's;
    ``staged_rows``/``staged_batches`` read the stage."""
    import copy

    import richness
    from richness._engine import backend as _backend

    monkeypatch.setattr(_backend, "_cuda_core", lambda num_classes, device: emu.mod.CudaMoments(num_classes, 0))
    X, F, T, y = problem(n=120, k=5, seed=22)
    for groups in (None, 2):
        options = richness.CudaOptions(stack_rows=64, stack_joint=False, product="tiles:16")
        m = richness.Moments(5, device="cuda:0", cuda=options, groups=groups)
        # the options as the device accumulator (and each group's) holds them: no public view of those
        backend = m._backend if groups is None else m._backend.parts[1]
        assert m.staged_rows == 0 and m.staged_batches == 0
        backend.core.update(marg(X[:50]), marg(F[:50]), marg(y[:50]), marg(T[:50]), precision="fp32")
        assert m.staged_rows == 50 and m.staged_batches == 1
        for core in (backend.core, copy.deepcopy(m)._backend.whole().core):
            assert (core.stack_rows, core.stack_joint, core.product) == (64, False, "tiles")
    auto = richness.Moments(device="cuda:0")._backend.core
    assert auto.stack_rows == 0 and auto.product == "auto"
    with pytest.raises(ValueError, match="product must be auto, syrk, gemm, block_rows or tiles"):
        richness.Moments(device="cuda:0", cuda=richness.CudaOptions(product="fastest"))
    with pytest.raises(ValueError, match="block size must be at least 16"):
        richness.Moments(device="cuda:0", cuda=richness.CudaOptions(product="tiles:8"))

