"""CUDA backend against the CPU backend against the float64 n x n reference.

Skips cleanly without torch, without a CUDA GPU, or without the compiled
richness._cuda module (build with RICHNESS_CUDA=ON; benchmarks/gpu_check.py
does it on a GPU machine).
"""

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
try:
    from richness import _cuda  # noqa: F401
    _why = None
except ImportError as e:  # pragma: no cover - depends on the build
    _cuda, _why = None, f"richness._cuda not built ({e})"
GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU or _cuda is None, reason=_why or "no CUDA GPU")

import richness
from reference import dlr_naive, nc1_naive, simplex_etf

DEV = "cuda:0"
# DLR tolerance by product precision (docs/MATH.md, "Precision of products").
TOL = {"fp64": 1e-12, "fp32": 1e-6, "tf32": 1e-3, "bf16": 5e-3}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64}


def features(rng, n, p, mean=3.0):
    """Well-conditioned correlated features (spectrum 0.25..4, rotated), so that
    no logit eigenvalue sits near the coarsest rank cut (bf16: 1e-2)."""
    Q, _ = np.linalg.qr(rng.normal(size=(p, p)))
    return (rng.normal(size=(n, p)) * np.linspace(0.5, 2.0, p)) @ Q + mean


@functools.lru_cache(maxsize=None)
def problem(dtype_name, n=2048, p=48, C=8, seed=0):
    """X, F on the GPU in `dtype_name`, their float64 values, W, b, and the
    n x n reference DLR of the streamed outputs and of the head."""
    rng = np.random.default_rng(seed)
    X64 = features(rng, n, p)
    W, b = rng.normal(size=(C, p)), rng.normal(size=C)
    F64 = X64 @ W.T + b + 0.5 * rng.normal(size=(n, C))
    dt = TORCH_DTYPES[dtype_name]
    X = torch.from_numpy(X64).to(DEV, dt)
    F = torch.from_numpy(F64).to(DEV, dt)
    Xv = X.double().cpu().numpy()  # the values the package sees
    Fv = F.double().cpu().numpy()
    want, r = dlr_naive(Xv, Fv)
    want_head, _ = dlr_naive(Xv, Xv @ W.T + b)
    return X, F, Xv, Fv, W, b, want, want_head, r


CASES = [(d, p) for d in ("float32", "float16", "bfloat16") for p in ("fp32", "tf32", "bf16")]
CASES += [("float64", "fp64"), ("float64", "fp32")]


@pytest.mark.parametrize("dtype_name,precision", CASES)
@needs_gpu
def test_dlr_gpu_vs_cpu_vs_reference(dtype_name, precision):
    X, F, Xv, Fv, W, b, want, want_head, r = problem(dtype_name)
    tol = TOL[precision]
    gpu = richness.Moments(device="cuda", precision=precision)
    gpu_head = richness.Moments(device="cuda", precision=precision)
    for chunk in torch.arange(X.shape[0]).chunk(5):
        gpu.update(X[chunk], F[chunk])
        gpu_head.update(X[chunk])
    rep = gpu.compute()
    assert rep.precision == precision and rep.rank == r
    assert isinstance(rep.eigenvalues, np.ndarray) and isinstance(rep.dlr, float)
    assert abs(rep.dlr - want) < tol, (rep.dlr, want)
    assert abs(gpu_head.compute(head_weights=(W, b)).dlr - want_head) < tol

    # The CPU backend on the same values (fp64 or fp32 products).
    cpu = richness.Moments(device="cpu", precision="fp64" if precision == "fp64" else "fp32")
    cpu.update(X.cpu(), F.cpu())
    assert abs(cpu.compute().dlr - rep.dlr) < tol
    # Device finishing == host finishing of the same state.
    host = richness.finish.finish(gpu.state_dict())
    assert abs(host.dlr - rep.dlr) < 1e-10
    np.testing.assert_allclose(host.eigenvalues, rep.eigenvalues, rtol=1e-8, atol=1e-12 * rep.eigenvalues[0])


@needs_gpu
@pytest.mark.parametrize("n, batches, stack", [(4096, 3, 0), (4096, 3, 4096), (4096, 1, 0), (16384, 1, 0),
                                               (16384, 4, 16384)])
def test_fp32_large_mean_small_spread(n, batches, stack):
    # docs/MATH.md (precision): mean 1e4, spread 1e-2 in float32 must give DLR
    # to 1e-6, staged or not, however many rows one batch or stage holds (the
    # fp32 products are split into row blocks of 1,024, summed in float64).
    rng = np.random.default_rng(3)
    p, C = 16, 4
    X64 = 1e4 + 1e-2 * features(rng, n, p, mean=0.0)
    X = torch.from_numpy(X64).to(DEV, torch.float32)
    Xv = X.double().cpu().numpy()
    W = rng.normal(size=(C, p))
    F = (torch.from_numpy(Xv @ W.T + 1e-3 * rng.normal(size=(n, C)))).to(DEV, torch.float32)
    want, _ = dlr_naive(Xv, F.double().cpu().numpy())
    m = richness.Moments(device="cuda", precision="fp32", cuda=richness.CudaOptions(stack_rows=stack))
    for chunk in torch.arange(n).chunk(batches):
        m.update(X[chunk], F[chunk])
    assert abs(m.compute().dlr - want) < 1e-6


@needs_gpu
def test_state_matches_cpu_backend_float64():
    rng = np.random.default_rng(4)
    n, p, C, K, T = 1500, 24, 5, 6, 3
    X = features(rng, n, p)
    F = X @ rng.normal(size=(p, C)) + rng.normal(size=(n, C))
    y = rng.integers(0, K, n)
    Tg = rng.normal(size=(n, T))
    cpu = richness.Moments(K)
    cpu.update(X, F, y, Tg)
    gpu = richness.Moments(K, device="cuda")
    t = lambda a: torch.from_numpy(a).to(DEV)  # noqa: E731
    for chunk in np.array_split(np.arange(n), 4):
        gpu.update(t(X[chunk]), t(F[chunk]), t(y[chunk]), t(Tg[chunk]))
    a, b = cpu.state_dict(), gpu.state_dict()
    assert b["precision"] == "fp64" and b["n"] == n
    for key in ("n", "p", "c", "t", "k", "num_classes"):
        assert a[key] == b[key], key
    np.testing.assert_array_equal(a["class_counts"], b["class_counts"])
    for key in ("mean", "M", "out_mean", "B", "A", "tgt_mean", "Bt", "At", "class_sums"):
        np.testing.assert_allclose(b[key], a[key], rtol=1e-11, atol=1e-11 * np.abs(a[key]).max(), err_msg=key)
    ra, rb = cpu.compute(), gpu.compute()
    assert abs(ra.dlr - rb.dlr) < 1e-12
    assert abs(ra.nc1 - rb.nc1) < 1e-9 * max(1.0, abs(ra.nc1))
    np.testing.assert_allclose(rb.quality, ra.quality, atol=1e-10)
    np.testing.assert_allclose(rb.utilization, ra.utilization, atol=1e-10)
    assert abs(rb.nc1 - nc1_naive(X, y)) < 1e-9 * max(1.0, rb.nc1)


@pytest.mark.parametrize("num_classes", [None, 7])
@needs_gpu
def test_labels_growing_and_fixed(num_classes):
    rng = np.random.default_rng(5)
    X = features(rng, 600, 12)
    y = rng.integers(0, 7, 600)
    y[:300] = np.minimum(y[:300], 3)  # the class range grows after the first batches
    cpu = richness.Moments(num_classes)
    gpu = richness.Moments(num_classes, device="cuda")
    for chunk in np.array_split(np.arange(600), 3):
        cpu.update(X[chunk], labels=y[chunk])
        gpu.update(torch.from_numpy(X[chunk]).to(DEV), labels=torch.from_numpy(y[chunk]).to(DEV, torch.int32))
    a, b = cpu.state_dict(), gpu.state_dict()
    assert a["k"] == b["k"]
    np.testing.assert_array_equal(a["class_counts"], b["class_counts"])
    np.testing.assert_allclose(b["class_sums"], a["class_sums"], rtol=1e-12)


@needs_gpu
def test_neural_collapse_zero_on_gpu():
    rng = np.random.default_rng(6)
    K, p = 5, 8
    means = simplex_etf(K, p, rng, scale=5.0)
    y = np.repeat(np.arange(K), 40)
    X = means[y] + 2.0
    Wh = rng.normal(size=(K, K)) @ means
    F = X @ Wh.T
    m = richness.Moments(K, device="cuda", precision="fp32")
    m.update(torch.from_numpy(X).to(DEV, torch.float32), torch.from_numpy(F).to(DEV, torch.float32),
             torch.from_numpy(y).to(DEV))
    rep = m.compute()
    assert rep.rank == K - 1
    assert rep.dlr < 1e-6


@pytest.mark.parametrize("precision", ["fp64", "fp32"])
@needs_gpu
def test_batch_split_and_merge_invariance(precision):
    rng = np.random.default_rng(7)
    n, p, C = 3000, 20, 4
    X64 = features(rng, n, p)
    F64 = X64 @ rng.normal(size=(p, C)) + rng.normal(size=(n, C))
    dt = torch.float64 if precision == "fp64" else torch.float32
    X, F = torch.from_numpy(X64).to(DEV, dt), torch.from_numpy(F64).to(DEV, dt)
    tol = TOL[precision]
    states = []
    for splits in (1, 7, 64):
        m = richness.Moments(device="cuda", precision=precision)
        for chunk in torch.arange(n).chunk(splits):
            m.update(X[chunk], F[chunk])
        states.append(m)
    parts = [richness.Moments(device="cuda", precision=precision) for _ in range(3)]
    for i, chunk in enumerate(torch.arange(n).chunk(9)):
        parts[i % 3].update(X[chunk], F[chunk])
    merged_a = richness.Moments(device="cuda")
    for part in parts:
        merged_a.merge(part)
    merged_b = richness.Moments(device="cuda")
    for part in reversed(parts):
        merged_b.merge(part)
    ref = states[0].state_dict()
    scale = np.abs(ref["M"]).max()
    for m in states[1:] + [merged_a, merged_b]:
        st = m.state_dict()
        assert st["n"] == n
        np.testing.assert_allclose(st["M"], ref["M"], atol=(1e-12 if precision == "fp64" else 1e-5) * scale)
        np.testing.assert_allclose(st["mean"], ref["mean"], rtol=1e-12, atol=1e-12)
        assert abs(m.compute().dlr - states[0].compute().dlr) < tol


@needs_gpu
def test_state_moves_between_backends(tmp_path):
    rng = np.random.default_rng(8)
    X = features(rng, 800, 10)
    F = X @ rng.normal(size=(10, 3)) + rng.normal(size=(800, 3))
    y = rng.integers(0, 4, 800)
    gpu = richness.Moments(4, device="cuda")
    gpu.update(torch.from_numpy(X).to(DEV), torch.from_numpy(F).to(DEV), torch.from_numpy(y).to(DEV))
    gpu.save(tmp_path / "g.npz")
    cpu = richness.Moments.load(tmp_path / "g.npz")
    assert cpu.device == "cpu"
    assert abs(cpu.compute().dlr - gpu.compute().dlr) < 1e-12
    back = richness.Moments.load(tmp_path / "g.npz", device="cuda")
    assert back.device == "cuda:0"
    a, b = gpu.state_dict(), back.state_dict()
    for key in ("M", "B", "A", "class_sums", "mean"):
        np.testing.assert_array_equal(a[key], b[key])
    # CPU + GPU merge both ways equals one state over both halves.
    both = richness.Moments(4)
    both.update(np.vstack([X, X + 1]), np.vstack([F, F]), np.concatenate([y, y]))
    other = richness.Moments(4)
    other.update(X + 1, F, y)
    g2 = richness.Moments.load(tmp_path / "g.npz", device="cuda")
    g2.merge(other)
    c2b = richness.Moments(4)
    c2b.merge(other)
    c2b.merge(gpu)
    want = both.state_dict()["M"]
    for m in (g2, c2b):
        np.testing.assert_allclose(m.state_dict()["M"], want, rtol=1e-10, atol=1e-12 * np.abs(want).max())


@needs_gpu
def test_nonfinite_batch_skipped_and_raised_later():
    rng = np.random.default_rng(9)
    X = torch.from_numpy(features(rng, 512, 8)).to(DEV, torch.float32)
    F = X[:, :3] * 2 + 1
    m = richness.Moments(3, device="cuda")
    y = torch.from_numpy(rng.integers(0, 3, 512)).to(DEV)
    m.update(X[:256], F[:256], y[:256])
    before = m.state_dict()
    bad = X[256:].clone()
    bad[3, 2] = float("nan")
    bad[7, 0] = float("inf")
    bad[9, 5] = float("-inf")
    m.update(bad, F[256:], y[256:])  # returns at once: the check runs on the device
    with pytest.raises(ValueError, match="3 non-finite"):
        _ = m.n
    after = m.state_dict()  # the error was reported once; the state is as before the bad batch
    for key in ("M", "B", "A", "mean", "out_mean", "class_sums"):
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)
    np.testing.assert_array_equal(after["class_counts"], before["class_counts"])
    assert after["n"] == 256
    # labels out of range (num_classes=3) are caught the same way
    yb = y[256:].clone()
    yb[0] = 3
    yb[1] = -1
    m.update(X[256:], F[256:], yb)
    with pytest.raises(ValueError, match="labels out of range: 2 labels"):
        m.compute()
    m.update(X[256:], F[256:], y[256:])  # still usable
    assert m.n == 512


@needs_gpu
def test_host_validation_raises_at_once():
    m = richness.Moments(device="cuda")
    X = torch.randn(10, 4, device=DEV)
    m.update(X)
    with pytest.raises(ValueError, match="columns"):
        m.update(torch.randn(10, 5, device=DEV))
    with pytest.raises(ValueError, match="outputs"):
        m.update(X, torch.randn(10, 2, device=DEV))
    with pytest.raises(TypeError):
        m.update(X.to(torch.int32))
    assert m.n == 10


def update_behind_spins(m, src, n: int, count: int) -> None:
    """Updates ``m`` with ``count`` batches of ``n`` rows of ``src``, each
    written on its own side stream behind a long spin and added on that stream:
    an update that ran on any other stream would read a buffer before it is
    written."""
    streams = [torch.cuda.Stream() for _ in range(count)]
    bufs = [torch.zeros(n, src.shape[1], device=DEV) for _ in range(count)]
    torch.cuda.synchronize()
    for i, (s, buf) in enumerate(zip(streams, bufs)):
        with torch.cuda.stream(s):
            torch.cuda._sleep(20_000_000)
            buf.copy_(src[i * n:(i + 1) * n])
            m.update(buf)


def graph_problem():
    """n, K and a batch (features, outputs, labels) on the GPU for the CUDA-graph tests."""
    rng = np.random.default_rng(11)
    n, p, C, K = 1024, 64, 10, 10
    X = torch.from_numpy(features(rng, n, p)).to(DEV, torch.float32)
    F = X @ torch.randn(p, C, device=DEV) + torch.randn(n, C, device=DEV)
    y = torch.from_numpy(rng.integers(0, K, n)).to(DEV)
    return n, K, X, F, y


@needs_gpu
def test_update_on_side_stream_is_ordered():
    # Each batch is produced on a side stream behind a long spin: an update
    # that ran on any other stream would read the buffer before it is written.
    rng = np.random.default_rng(10)
    n, p = 4096, 32
    X64 = features(rng, 2 * n, p)
    src = torch.from_numpy(X64).to(DEV, torch.float32)
    want = richness.Moments(precision="fp32")
    want.update(src.cpu())
    m = richness.Moments(device="cuda", precision="fp32")
    update_behind_spins(m, src, n, 2)
    np.testing.assert_allclose(m.state_dict()["M"], want.state_dict()["M"], rtol=1e-5,
                               atol=1e-6 * np.abs(want.state_dict()["M"]).max())
    assert m.n == 2 * n


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@needs_gpu
def test_update_captures_in_cuda_graph(precision):
    # A host synchronisation inside update would abort the capture.
    n, K, X, F, y = graph_problem()
    m = richness.Moments(K, device="cuda", precision=precision)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m.update(X, F, y)  # warm-up: allocates the state and scratch, times the product algorithms
    torch.cuda.current_stream().wait_stream(s)
    # Reads the timings (a synchronising call): the capture and the reference below then multiply
    # by the same measured choice, so their states agree to rounding of one algorithm.
    assert m.n == n
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        m.update(X, F, y)
    for _ in range(3):
        g.replay()
    assert m.n == 4 * n
    ref = richness.Moments(K, device="cuda", precision=precision)
    for _ in range(4):
        ref.update(X, F, y)
    np.testing.assert_allclose(m.state_dict()["M"], ref.state_dict()["M"], rtol=1e-6,
                               atol=1e-6 * np.abs(ref.state_dict()["M"]).max())
    assert abs(m.compute().dlr - ref.compute().dlr) < TOL[precision]


@needs_gpu
def test_update_with_labels_without_num_classes_captures_in_cuda_graph():
    # Without num_classes no update waits for the device either: labels past the class arrays'
    # capacity (set from the warm-up batch) are deferred on the device, so the capture succeeds.
    n, K, X, F, y = graph_problem()
    y2 = y.clone()
    y2[::5] += 100
    m = richness.Moments(device="cuda", precision="fp32")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m.update(X, F, y)  # warm-up: allocates the state and sizes the class arrays
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        m.update(X, F, y2)
    g.replay()
    assert m.n == 3 * n
    ref = richness.Moments()
    for labels in (y, y2, y2):
        ref.update(X.cpu(), F.cpu(), labels.cpu())
    a, b = ref.state_dict(), m.state_dict()
    assert b["k"] == a["k"] == int(y2.max()) + 1
    np.testing.assert_array_equal(b["class_counts"], a["class_counts"])
    np.testing.assert_allclose(b["class_sums"], a["class_sums"], rtol=1e-12, atol=1e-12 * np.abs(a["class_sums"]).max())
    assert abs(m.compute().nc1 - ref.compute().nc1) < 1e-6 * max(1.0, abs(ref.compute().nc1))


@pytest.mark.parametrize("algo,block", [("syrk", 512), ("gemm", 512), ("block_rows", 16), ("tiles", 16)])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@needs_gpu
def test_product_algorithms_agree(algo, block, precision):
    X, F, Xv, Fv, W, b, want, want_head, r = problem("float32")
    m = richness.Moments(device="cuda", precision=precision, cuda=richness.CudaOptions(product=f"{algo}:{block}"))
    m.update(X[:8], F[:8])
    m.update(X[8:], F[8:])
    assert abs(m.compute().dlr - want) < TOL[precision]


@needs_gpu
def test_product_choice_measured_on_the_gpu():
    # The first product of a shape times every algorithm with CUDA events (read at the next
    # synchronisation); the state is the default algorithm's, then the fastest is kept.
    from richness import _cuda

    _cuda.clear_measured_products()
    X, F, Xv, Fv, W, b, want, want_head, r = problem("float32")
    m = richness.Moments(device="cuda", precision="tf32")
    m.update(X, F)
    assert m.n == len(X)
    got = [e for e in _cuda.measured_products() if e["precision"] == "tf32"]
    assert got and all(ms > 0 for e in got for ms in e["ms"].values())
    assert all(e["ms"][e["product"]] == min(e["ms"].values()) for e in got)
    m.update(X, F)  # the kept choice
    assert abs(m.compute().dlr - want) < TOL["tf32"]


@needs_gpu
def test_repeated_compute_does_not_change_state():
    X, F, *_ = problem("float32")
    m = richness.Moments(device="cuda")
    m.update(X, F)
    a = m.compute()
    b = m.compute()
    assert a.dlr == b.dlr
    np.testing.assert_array_equal(a.eigenvalues, b.eigenvalues)


@pytest.mark.skipif(GPU, reason="checks the error where no GPU is usable")
def test_cuda_device_without_gpu_raises_clearly():
    with pytest.raises(RuntimeError, match="CUDA"):
        richness.Moments(device="cuda")


# -- staging (Moments(cuda=CudaOptions(stack_rows=...))) ----------------------------------
#
# Staged and per-batch accumulation narrow the same centered rows (each batch on
# its own float64 mean), so their states differ only by the products'
# accumulation (one product over the stage vs one per batch, summed in float64)
# and float64 rounding of the multi-batch merge: a bound far below the DLR
# tolerances, relative to the largest entry of each block.
STACK_EPS = {"fp64": 1e-12, "fp32": 2e-5, "tf32": 1e-4, "bf16": 1e-4}
STACK = 600
UNEVEN = [300, 17, 512, 1, 700, 130, 388]  # 2048 rows; with STACK = 600: two flushes inside update,
#                                            700 > STACK goes per batch while 513 rows are staged,
#                                            518 rows still staged at the end


def row_slices(sizes):
    edges = np.concatenate([[0], np.cumsum(sizes)])
    return [slice(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


def stacked(stack=STACK, joint=True, *args, product=None, **kwargs):
    options = richness.CudaOptions(stack_rows=stack, stack_joint=joint, product=product)
    return richness.Moments(*args, device="cuda", cuda=options, **kwargs)


def assert_states_close(got, want, keys, eps, err=""):
    assert got["n"] == want["n"]
    for key in keys:
        scale = max(np.abs(want[key]).max(), 1e-300)
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=eps * scale, err_msg=f"{err} {key}")


STACK_CASES = [("float32", "fp32"), ("float32", "tf32"), ("bfloat16", "bf16"), ("float64", "fp64"),
               ("float16", "fp32")]


@pytest.mark.parametrize("mode", ["head", "outputs_joint", "outputs_split"])
@pytest.mark.parametrize("dtype_name,precision", STACK_CASES)
@needs_gpu
def test_stacked_matches_unstacked_and_reference(dtype_name, precision, mode):
    X, F, Xv, Fv, W, b, want, want_head, r = problem(dtype_name)
    assert sum(UNEVEN) == X.shape[0]
    with_outputs = mode != "head"
    plain = richness.Moments(device="cuda", precision=precision)
    stack = stacked(joint=mode != "outputs_split", precision=precision)
    for sl in row_slices(UNEVEN):
        args = (X[sl], F[sl]) if with_outputs else (X[sl],)
        plain.update(*args)
        stack.update(*args)
    assert stack.staged_rows == 130 + 388 and stack.staged_batches == 2
    a, s = plain.state_dict(), stack.state_dict()  # state_dict flushes
    assert stack.staged_rows == 0 and s["precision"] == precision
    keys = ("mean", "M") + (("out_mean", "B", "A") if with_outputs else ())
    assert_states_close(s, a, keys, STACK_EPS[precision], mode)
    tol = TOL[precision]
    if with_outputs:
        rs, rp, ref = stack.compute(), plain.compute(), want
        assert rs.rank == r
    else:
        rs, rp, ref = stack.compute(head_weights=(W, b)), plain.compute(head_weights=(W, b)), want_head
    assert abs(rs.dlr - ref) < tol, (rs.dlr, ref)
    assert abs(rs.dlr - rp.dlr) < tol


@pytest.mark.parametrize("joint", [True, False])
@pytest.mark.parametrize("num_classes", [None, 6])
@needs_gpu
def test_stacked_labels_and_targets_match_cpu(joint, num_classes):
    rng = np.random.default_rng(12)
    n, p, C, K, T = 1500, 24, 5, 6, 3
    X = features(rng, n, p)
    F = X @ rng.normal(size=(p, C)) + rng.normal(size=(n, C))
    y = rng.integers(0, K, n)
    y[:400] = np.minimum(y[:400], 2)  # without num_classes, the class range grows mid-stack
    Tg = rng.normal(size=(n, T))
    cpu = richness.Moments(num_classes)
    cpu.update(X, F, y, Tg)
    plain = richness.Moments(num_classes, device="cuda")
    stack = stacked(700, joint, num_classes)
    t = lambda a: torch.from_numpy(a).to(DEV)  # noqa: E731
    for sl in row_slices([400, 250, 13, 600, 237]):
        for m in (plain, stack):
            m.update(t(X[sl]), t(F[sl]), t(y[sl]), t(Tg[sl]))
    a, b, c = plain.state_dict(), stack.state_dict(), cpu.state_dict()
    assert b["precision"] == "fp64" and b["k"] == c["k"] == K
    np.testing.assert_array_equal(b["class_counts"], c["class_counts"])
    keys = ("mean", "M", "out_mean", "B", "A", "tgt_mean", "Bt", "At", "class_sums")
    assert_states_close(b, a, keys, 1e-11, "vs unstacked")
    assert_states_close(b, c, keys, 1e-11, "vs cpu")
    rb, rc = stack.compute(), cpu.compute()
    assert abs(rb.dlr - rc.dlr) < 1e-11
    assert abs(rb.nc1 - nc1_naive(X, y)) < 1e-9 * max(1.0, rb.nc1)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@needs_gpu
def test_stacked_bad_batches_add_nothing(precision):
    rng = np.random.default_rng(13)
    nb, p, C, K = 256, 16, 3, 3
    X = torch.from_numpy(features(rng, 4 * nb, p)).to(DEV, torch.float32)
    F = X[:, :C] * 2 + 1 + 0.1 * torch.randn(4 * nb, C, device=DEV)
    y = torch.from_numpy(rng.integers(0, K, 4 * nb)).to(DEV)
    part = row_slices([nb] * 4)
    bad_x = X[part[1]].clone()
    bad_x[3, 2], bad_x[7, 0], bad_x[9, 5] = float("nan"), float("inf"), float("-inf")
    bad_y = y[part[2]].clone()
    bad_y[0], bad_y[1] = K, -1
    m = stacked(4096, precision=precision, num_classes=K)  # the four batches share one stage
    m.update(X[part[0]], F[part[0]], y[part[0]])
    m.update(bad_x, F[part[1]], y[part[1]])  # returns at once: checked on the device
    m.update(X[part[2]], F[part[2]], bad_y)
    m.update(X[part[3]], F[part[3]], y[part[3]])
    assert m.staged_batches == 4
    with pytest.raises(ValueError, match=r"2 batches were not added.*features contain 3 non-finite.*"
                                         r"labels out of range: 2 labels"):
        _ = m.n
    good = richness.Moments(K, device="cuda", precision=precision)
    for i in (0, 3):
        good.update(X[part[i]], F[part[i]], y[part[i]])
    a, b = good.state_dict(), m.state_dict()  # reported once; the state holds the good batches only
    assert b["n"] == 2 * nb
    np.testing.assert_array_equal(b["class_counts"], a["class_counts"])
    assert_states_close(b, a, ("mean", "M", "out_mean", "B", "A", "class_sums"), STACK_EPS[precision])
    assert np.isfinite(b["M"]).all()
    m.update(X[part[1]], F[part[1]], y[part[1]])  # still usable
    assert m.n == 3 * nb

    # A stage of bad batches only: nothing is added, the next good batch starts the state.
    e = stacked(4096, precision=precision, num_classes=K)
    e.update(bad_x, F[part[1]], y[part[1]])
    with pytest.raises(ValueError, match=r"1 batch was not added"):
        e.compute()
    assert e.n == 0
    e.update(X[part[0]], F[part[0]], y[part[0]])
    one = richness.Moments(K, device="cuda", precision=precision)
    one.update(X[part[0]], F[part[0]], y[part[0]])
    assert_states_close(e.state_dict(), one.state_dict(), ("mean", "M", "B", "A"), STACK_EPS[precision])


@needs_gpu
def test_stacked_merge_state_dict_and_save_mid_stack(tmp_path):
    rng = np.random.default_rng(14)
    n, p, C = 3000, 20, 4
    X64 = features(rng, n, p)
    F64 = X64 @ rng.normal(size=(p, C)) + rng.normal(size=(n, C))
    X, F = torch.from_numpy(X64).to(DEV, torch.float32), torch.from_numpy(F64).to(DEV, torch.float32)
    keys = ("mean", "M", "out_mean", "B", "A")
    chunks = torch.arange(n).chunk(10)  # 300 rows each

    def unstacked(*parts):
        m = richness.Moments(device="cuda", precision="fp32")
        for idx in parts:
            m.update(X[idx], F[idx])
        return m.state_dict()

    a, b = stacked(1000, precision="fp32"), stacked(1000, precision="fp32")
    for i, ch in enumerate(chunks[:6]):
        (a if i % 2 == 0 else b).update(X[ch], F[ch])
    assert a.staged_rows == b.staged_rows == 900
    sd = a.state_dict()  # mid-stack: flushes; same keys and shapes as ever
    assert a.staged_rows == 0 and sd["n"] == 900
    assert_states_close(sd, unstacked(chunks[0], chunks[2], chunks[4]), keys, STACK_EPS["fp32"])
    a.update(X[chunks[6]], F[chunks[6]])  # staged again
    a.merge(b)  # flushes both sides first
    assert b.staged_rows == 0 and a.n == 2100
    for ch in chunks[7:]:
        a.update(X[ch], F[ch])
    assert a.staged_rows > 0
    a.save(tmp_path / "s.npz")  # flushes
    st = a.state_dict()
    assert_states_close(st, unstacked(torch.arange(n)), keys, STACK_EPS["fp32"])
    for device in ("cpu", "cuda"):
        back = richness.Moments.load(tmp_path / "s.npz", device=device).state_dict()
        for key in keys:
            np.testing.assert_array_equal(back[key], st[key], err_msg=key)
    # into a stacked Moments with rows of its own pending, and into itself
    c = stacked(1000)
    c.update(X[:100], F[:100])
    c.merge(a)
    assert_states_close(c.state_dict(), unstacked(slice(0, 100), torch.arange(n)), keys, STACK_EPS["fp32"])
    c.update(X[:100], F[:100])
    c.merge(c)
    assert_states_close(c.state_dict(), unstacked(slice(0, 100), torch.arange(n), slice(0, 100), slice(0, 100),
                                                  torch.arange(n), slice(0, 100)), keys, STACK_EPS["fp32"])
    # load_state_dict replaces the state, pending rows included
    d = stacked(1000)
    d.update(X[:50], F[:50])
    d.load_state_dict(sd)
    assert d.n == 900
    d.update(X[:50], F[:50])
    assert d.n == 950


@needs_gpu
def test_stacked_precision_switch_reset_and_width_change():
    rng = np.random.default_rng(15)
    X64 = features(rng, 900, 12)
    X = torch.from_numpy(X64).to(DEV)
    plain, stack = richness.Moments(device="cuda"), stacked(4096)
    for m in (plain, stack):
        m.update(X[:300])  # float64: fp64 products
        m.update(X[300:600].float())  # float32: fp32 (the stage is flushed before the switch)
        m.update(X[600:])
    a, b = plain.state_dict(), stack.state_dict()
    assert a["precision"] == b["precision"] == "fp32"
    assert_states_close(b, a, ("mean", "M"), STACK_EPS["fp32"])
    stack.update(X[:10].float())
    stack.reset()  # forgets the staged rows too
    assert stack.n == 0 and stack.staged_rows == 0
    Y = torch.from_numpy(features(rng, 500, 30)).to(DEV, torch.float32)
    F = Y[:, :5] * 3
    stack.update(Y[:250], F[:250])  # new widths after reset
    stack.update(Y[250:], F[250:])
    ref = richness.Moments(device="cuda")
    ref.update(Y, F)
    assert_states_close(stack.state_dict(), ref.state_dict(), ("mean", "M", "B", "A"), STACK_EPS["fp32"])


@pytest.mark.parametrize("algo,block", [("auto", 512), ("syrk", 512), ("gemm", 512), ("block_rows", 16),
                                        ("tiles", 16)])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@needs_gpu
def test_stacked_product_algorithms_agree(algo, block, precision):
    # p + C = 56 + 8 = 64: tiles of 16 divide the joint product (p = 56 alone
    # falls back to block rows; test_product_algorithms_agree covers head tiles).
    X, F, Xv, Fv, W, b, want, want_head, r = problem("float32", p=56)
    for joint in (True, False):
        m = stacked(1000, joint, precision=precision, product=f"{algo}:{block}")
        h = stacked(1000, precision=precision, product=f"{algo}:{block}")
        for sl in row_slices(UNEVEN):
            m.update(X[sl], F[sl])
            h.update(X[sl])
        assert abs(m.compute().dlr - want) < TOL[precision]
        assert abs(h.compute(head_weights=(W, b)).dlr - want_head) < TOL[precision]


@needs_gpu
def test_stacked_update_on_side_streams_is_ordered():
    # The second batch's update (on s2) flushes the first's rows, staged on s1
    # behind a long spin: the flush must wait for them.
    rng = np.random.default_rng(10)
    n, p = 4096, 32
    src = torch.from_numpy(features(rng, 3 * n, p)).to(DEV, torch.float32)
    want = richness.Moments(precision="fp32")
    want.update(src.cpu())
    m = stacked(n + n // 2, precision="fp32")
    update_behind_spins(m, src, n, 3)
    ref = want.state_dict()["M"]
    np.testing.assert_allclose(m.state_dict()["M"], ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    assert m.n == 3 * n


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@needs_gpu
def test_update_captures_in_cuda_graph_with_stacking(precision):
    # A captured update takes the per-batch path (a replay would otherwise
    # rewrite the same stage rows); rows staged before the capture stay staged
    # and are merged once. No allocation or host sync inside the capture.
    n, K, X, F, y = graph_problem()
    m = stacked(4096, num_classes=K, precision=precision)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m.update(X, F, y)  # warm-up: staged; sizes the per-batch scratch as well
    torch.cuda.current_stream().wait_stream(s)
    assert m.staged_rows == n
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        m.update(X, F, y)
    assert m.staged_rows == n
    for _ in range(3):
        g.replay()
    m.update(X, F, y)  # eager again: staged next to the warm-up batch
    assert m.staged_rows == 2 * n
    assert m.n == 5 * n  # warm-up, three replays, one eager update (the capture itself runs nothing)
    ref = richness.Moments(K, device="cuda", precision=precision)
    for _ in range(5):
        ref.update(X, F, y)
    a, b = ref.state_dict(), m.state_dict()
    np.testing.assert_array_equal(b["class_counts"], a["class_counts"])
    np.testing.assert_allclose(b["M"], a["M"], rtol=1e-6, atol=STACK_EPS[precision] * np.abs(a["M"]).max())
    assert abs(m.compute().dlr - ref.compute().dlr) < TOL[precision]


@needs_gpu
def test_stacked_groups_and_repeated_compute():
    X, F, *_ = problem("float32")
    plain = richness.Moments(device="cuda", precision="fp32", groups=4)
    stack = stacked(precision="fp32", groups=4)
    for sl in row_slices(UNEVEN):
        plain.update(X[sl], F[sl])
        stack.update(X[sl], F[sl])
    ra, rb = plain.compute(uncertainty=True), stack.compute(uncertainty=True)
    assert abs(ra.dlr - rb.dlr) < TOL["fp32"] and abs(ra.dlr_stderr - rb.dlr_stderr) < TOL["fp32"]
    again = stack.compute(uncertainty=True)
    assert again.dlr == rb.dlr
    np.testing.assert_array_equal(again.eigenvalues, rb.eigenvalues)
