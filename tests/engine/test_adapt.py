"""Inputs: numpy and torch dtypes and layouts, DLPack objects, label types.
Every layout of the same values must give the same state; every dtype must match
the float64 reference on exactly the values it holds."""

import numpy as np
import pytest
import torch

import richness
from reference import dlr_naive, one_hot, states_equal
from conftest import linear_data


def data(seed=0, n=240, p=8):
    return linear_data(n, p, c=3, seed=seed, classes=4)


def state_of(*batches, **kw):
    m = richness.Moments(**kw)
    for b in batches:
        m.update(*b[:2], labels=b[2] if len(b) > 2 else None)
    return m


# -- dtypes ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,precision,tol", [
    (np.float64, "fp64", 1e-12), (np.float32, "fp32", 1e-6), (np.float16, "fp32", 1e-6)])
def test_numpy_dtypes_against_reference(dtype, precision, tol):
    X, F, y = data()
    Xd, Fd = X.astype(dtype), F.astype(dtype)
    m = state_of((Xd, Fd, y))
    rep = m.compute()
    assert rep.precision == precision
    want, r = dlr_naive(Xd, Fd)  # the reference sees the same (rounded) values
    assert rep.rank == r
    assert abs(rep.dlr - want) < tol
    mean = Xd.astype(np.float64).mean(axis=0)
    np.testing.assert_allclose(m.state_dict()["mean"], mean, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("tdtype,precision,tol", [
    (torch.float64, "fp64", 1e-12), (torch.float32, "fp32", 1e-6), (torch.bfloat16, "fp32", 1e-6),
    (torch.float16, "fp32", 1e-6)])
def test_torch_dtypes_against_reference(tdtype, precision, tol):
    X, F, y = data(1)
    Xt, Ft = torch.from_numpy(X).to(tdtype), torch.from_numpy(F).to(tdtype)
    Xd, Fd = Xt.double().numpy(), Ft.double().numpy()
    m = richness.Moments()
    m.update(Xt, Ft, labels=torch.from_numpy(y))
    rep = m.compute()
    assert rep.precision == precision
    want, _ = dlr_naive(Xd, Fd)
    assert abs(rep.dlr - want) < tol
    assert np.array_equal(m.state_dict()["class_counts"], np.bincount(y, minlength=4))


def test_mixed_dtypes_multiply_in_the_narrower():
    X, F, _ = data(2)
    m = richness.Moments()
    m.update(X, F.astype(np.float32))  # one float32 input makes the batch fp32
    assert m.compute().precision == "fp32"
    m64 = richness.Moments(precision="fp64")  # widening on request
    m64.update(X.astype(np.float32), F.astype(np.float32))
    rep = m64.compute()
    assert rep.precision == "fp64" and rep.rtol == 1e-10
    want, _ = dlr_naive(X.astype(np.float32), F.astype(np.float32))
    assert abs(rep.dlr - want) < 1e-12


def test_precision_is_the_coarsest_seen():
    X, F, _ = data(3)
    m = richness.Moments()
    m.update(X[:100], F[:100])
    assert m.compute().precision == "fp64"
    m.update(X[100:].astype(np.float32), F[100:].astype(np.float32))
    assert m.compute().precision == "fp32"


def test_torch_requires_grad_is_read_without_grad():
    X, F, _ = data(4)
    Xt = torch.from_numpy(X).requires_grad_(True)
    Ft = (Xt * 1.0)[:, :3] + torch.from_numpy(F - X[:, :3])  # part of a graph
    m = richness.Moments()
    m.update(Xt, Ft)
    assert abs(m.compute().dlr - dlr_naive(X, F)[0]) < 1e-12


# -- layouts: every view of the same values gives the identical state ------------------------------

def test_numpy_layouts_give_identical_state():
    X, F, y = data(5)
    base = state_of((X, F, y)).state_dict()
    big = np.zeros((X.shape[0] * 2, X.shape[1] + 5))
    big[::2, 2:-3] = X
    views = {
        "fortran": (np.asfortranarray(X), np.asfortranarray(F)),
        "transposed": (np.ascontiguousarray(X.T).T, np.ascontiguousarray(F.T).T),
        "strided rows and offset": (big[::2, 2:-3], F),
        "column step": (np.repeat(X, 2, axis=1)[:, ::2], F),
        "big-endian": (X.astype(">f8"), F.astype(">f8")),
        "list of lists": (X.tolist(), F.tolist()),
    }
    for name, (Xv, Fv) in views.items():
        got = state_of((Xv, Fv, y)).state_dict()
        assert states_equal(got, base), name


def test_torch_layouts_give_identical_state():
    X, F, y = data(6)
    base = state_of((X, F, y)).state_dict()
    Xt, Ft, yt = torch.from_numpy(X), torch.from_numpy(F), torch.from_numpy(y)
    big = torch.zeros(X.shape[0] * 2, X.shape[1] + 5, dtype=torch.float64)
    big[::2, 2:-3] = Xt
    views = {
        "contiguous": (Xt, Ft),
        "transposed view": (Xt.t().contiguous().t(), Ft.t().contiguous().t()),
        "strided rows and offset": (big[::2, 2:-3], Ft),
        "column step": (Xt.repeat_interleave(2, dim=1)[:, ::2], Ft),
        "expanded labels": (Xt, Ft),
    }
    for name, (Xv, Fv) in views.items():
        assert not name.startswith("transposed") or not Xv.is_contiguous()
        got = state_of((Xv, Fv, yt)).state_dict()
        assert states_equal(got, base), name
    # labels through a strided view
    y2 = torch.stack([yt, yt], dim=1)[:, 1]
    assert y2.stride(0) == 2
    assert states_equal(state_of((Xt, Ft, y2)).state_dict(), base)


def test_float32_layouts_give_identical_state():
    X, F, y = data(7)
    X32, F32 = X.astype(np.float32), F.astype(np.float32)
    base = state_of((X32, F32, y)).state_dict()
    assert states_equal(state_of((np.asfortranarray(X32), F32, y)).state_dict(), base)
    Xt = torch.from_numpy(np.ascontiguousarray(X32.T)).t()
    assert states_equal(state_of((Xt, torch.from_numpy(F32), y)).state_dict(), base)


class OnlyDLPack:
    """An array producer that exposes nothing but ``__dlpack__``."""

    def __init__(self, array):
        self._a = array

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)


class DLPackWithDevice(OnlyDLPack):
    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


@pytest.mark.parametrize("wrapper", [OnlyDLPack, DLPackWithDevice])
def test_dlpack_objects(wrapper):
    X, F, y = data(8)
    base = state_of((X, F, y)).state_dict()
    assert not hasattr(wrapper(X), "shape") and not isinstance(wrapper(X), np.ndarray)
    got = state_of((wrapper(X), wrapper(F), wrapper(y))).state_dict()
    assert states_equal(got, base)
    X32 = X.astype(np.float32)
    m = richness.Moments()
    m.update(wrapper(X32), wrapper(F.astype(np.float32)))
    assert abs(m.compute().dlr - dlr_naive(X32, F.astype(np.float32))[0]) < 1e-6


# -- labels -------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda y: y.astype(np.int32), lambda y: y.astype(np.int64), lambda y: y.astype(np.uint8),
    lambda y: y.astype(np.int16), lambda y: torch.from_numpy(y), lambda y: torch.from_numpy(y).int(),
    lambda y: y.tolist(), lambda y: y.astype(">i8")],
    ids=["int32", "int64", "uint8", "int16", "torch64", "torch32", "list", "big-endian"])
def test_label_types(make):
    X, _, y = data(9)
    m = richness.Moments()
    m.update(X, labels=make(y))
    st = m.state_dict()
    assert np.array_equal(st["class_counts"], np.bincount(y, minlength=4))
    sums = one_hot(y, 4).T @ X
    np.testing.assert_allclose(st["class_sums"], sums, rtol=1e-14, atol=1e-12)


def test_empty_batch_adds_nothing():
    X, F, y = data(10)
    m = state_of((X, F, y))
    before = m.state_dict()
    m.update(X[:0], F[:0], labels=y[:0])
    assert states_equal(m.state_dict(), before)
    assert m.n == X.shape[0]


# -- large batches (the row passes split over threads) --------------------------------------------

def test_large_batch_threaded_passes():
    from richness import _core

    rng = np.random.default_rng(11)
    n, p = 12000, 24
    X = (1e4 + 1e-2 * rng.normal(size=(n, p))).astype(np.float32)  # centering precision at scale
    W = rng.normal(size=(3, p))
    Xd = X.astype(np.float64)
    threads = _core.blas_get_num_threads()
    try:
        states = []
        for t in sorted({1, max(threads, 2)}):
            _core.blas_set_num_threads(t)
            m = richness.Moments()
            m.update(X)
            states.append(m.state_dict())
            np.testing.assert_allclose(m.state_dict()["mean"], Xd.mean(axis=0), rtol=1e-15)
            from reference import dlr_thin
            assert abs(m.compute(head_weights=W).dlr - dlr_thin(Xd, Xd @ W.T)[0]) < 1e-6
            # a strided view gives the identical state at the same thread count
            big = np.zeros((n, p + 3), dtype=np.float32)
            big[:, 1:-2] = X
            mv = richness.Moments()
            mv.update(big[:, 1:-2])
            assert states_equal(mv.state_dict(), m.state_dict())
            bad = X.copy()
            bad[n - 1, 0] = np.nan
            bad[n // 2, 3] = np.inf
            with pytest.raises(ValueError, match=r"contain 2 non-finite values"):
                m.update(bad)
        a, b = states[0], states[-1]
        assert np.abs(a["M"] - b["M"]).max() <= 1e-6 * np.abs(a["M"]).max()
    finally:
        _core.blas_set_num_threads(threads)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_class_sums_same_bits_on_any_thread_count(dtype):
    """The class sums split over the workers by columns, each summing its rows
    in their order: the bits of a sequential float64 sum in row order, on one
    worker or several (p not a multiple of the split)."""
    from richness import _core

    rng = np.random.default_rng(5)
    n, p, k = 3000, 70, 13
    X = (3.0 + rng.normal(size=(n, p))).astype(dtype)
    y = rng.integers(0, k, n)
    y[:5] = 12  # a class whose rows come first
    ref = np.zeros((k, p))
    for i in range(n):  # sequential float64 sums in row order
        ref[y[i]] += X[i].astype(np.float64)
    threads = _core.blas_get_num_threads()
    try:
        for t in (1, 2, 3):
            _core.blas_set_num_threads(t)
            m = richness.Moments(k)
            m.update(X, labels=y)
            st = m.state_dict()
            assert np.array_equal(st["class_sums"], ref), t
            assert np.array_equal(st["class_counts"], np.bincount(y, minlength=k))
    finally:
        _core.blas_set_num_threads(threads)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_vector_passes_give_the_plain_loops_bits(dtype):
    """The batch passes run in AVX-512 or AVX2 where the processor has them
    (csrc/cpu/passes.hpp). Every level gives the bits of the plain loops: the
    state (means, co-moments, class sums) of each level is equal bit for bit,
    the means are the sequential float64 sums in row order, and widths that
    are not a multiple of the vector width, strided rows, partial row blocks
    and a non-finite value are covered."""
    from richness import _core

    rng = np.random.default_rng(8)
    available = _core.simd_available()
    cases = []
    for n, p in ((1, 5), (9, 8), (700, 13), (1031, 70), (4001, 70)):  # the last past 1 MiB: centered on the state means
        X = (100.0 + 7.0 * rng.normal(size=(n, p + 3))).astype(dtype)[:, 2:-1]  # strided rows
        cases.append((X, rng.integers(0, 9, n)))
    try:
        for X, y in cases:
            ref_sum = np.zeros(X.shape[1])
            for i in range(X.shape[0]):  # sequential float64 sums in row order
                ref_sum += X[i].astype(np.float64)
            states = []
            for level in range(available + 1):
                assert _core.set_simd_level(level) == level
                m = richness.Moments(9)
                m.update(X, labels=y)
                m.update(X[::-1].copy(), labels=y[::-1].copy())
                st = m.state_dict()
                one = richness.Moments()
                one.update(X)
                mean = np.clip(ref_sum * (1.0 / X.shape[0]), X.min(0), X.max(0))  # sum * (1 / n), within [min, max]
                assert np.array_equal(one.state_dict()["mean"], mean)
                states.append(st)
                bad = X.copy()
                bad[X.shape[0] // 2, X.shape[1] - 1] = np.inf
                with pytest.raises(ValueError, match="contain 1 non-finite value"):
                    m.update(bad, labels=y)
                assert states_equal(m.state_dict(), st)
            for st in states[1:]:
                assert states_equal(st, states[0])
    finally:
        _core.set_simd_level(available)
    assert _core.simd_level() == available


def test_same_batches_give_bit_identical_states():
    X, F, y = data(12, n=5000, p=16)
    a = state_of((X, F, y), (X[:100], F[:100], y[:100]))
    b = state_of((X, F, y), (X[:100], F[:100], y[:100]))
    assert states_equal(a.state_dict(), b.state_dict())


def test_negative_strides_and_read_only():
    X, F, y = data(13)
    m = richness.Moments()
    Xr, Fr = X[::-1], F[::-1, ::-1]
    Xr.setflags(write=False)
    m.update(Xr, Fr, labels=y[::-1])
    ref, _ = dlr_naive(X, F)
    assert abs(m.compute().dlr - ref) < 1e-12
    np.testing.assert_allclose(m.state_dict()["mean"], X.mean(axis=0), rtol=1e-14)
    assert np.array_equal(m.state_dict()["class_counts"], np.bincount(y, minlength=4))


def test_one_feature_and_one_sample_batches():
    rng = np.random.default_rng(14)
    x = rng.normal(size=(50, 1)) + 7.0
    f = np.hstack([2 * x, np.sin(x)])
    m = richness.Moments()
    for i in range(50):  # one sample per update
        m.update(x[i:i + 1], f[i:i + 1])
    ref, r = dlr_naive(x, f)
    rep = m.compute()
    assert rep.rank == r == 2
    assert abs(rep.dlr - ref) < 1e-12
    xc = x - x.mean()
    assert abs(m.state_dict()["M"][0, 0] - np.sum(xc * xc)) < 1e-12 * np.sum(xc * xc)


def test_core_centered_grams_against_float64_and_bad_blocks():
    # the Monitor's one-batch windows: Gram matrices of row blocks, each centered on its own mean
    from richness import _core
    from richness._engine import adapt as _adapt

    rng = np.random.default_rng(0)
    X = (1e4 + 1e-2 * rng.standard_normal((3 * 20, 30))).astype(np.float32)  # the mean-1e4, spread-1e-2 case (docs/MATH.md, "Streaming estimator")
    for prec, dt, tol in (("fp32", np.float32, 1e-5), ("fp64", np.float64, 1e-12)):
        G, norms = np.empty((3, 20, 20), dt), np.empty(3)
        _core.centered_grams(_adapt.as_matrix(X, "x").arg(), 20, prec, G.ctypes.data, norms.ctypes.data)
        Xb = X.astype(np.float64).reshape(3, 20, 30)
        Xc = Xb - Xb.mean(axis=1, keepdims=True)
        want = Xc @ Xc.transpose(0, 2, 1)
        assert np.abs(G - want).max() < tol * np.abs(want).max()
        assert np.array_equal(G, G.transpose(0, 2, 1))
        assert np.allclose(norms, np.linalg.norm(want, axis=(1, 2)), rtol=tol, atol=0)
    G = np.empty((3, 20, 20), np.float32)
    with pytest.raises(ValueError, match="do not split into blocks of 7"):
        _core.centered_grams(_adapt.as_matrix(X, "x").arg(), 7, "fp32", G.ctypes.data, norms.ctypes.data)
    with pytest.raises(TypeError, match="float32, float64"):
        _core.centered_grams(_adapt.as_matrix(np.zeros((4, 3), np.int32), "x").arg(), 2, "fp32", G.ctypes.data,
                             norms.ctypes.data)


def test_core_one_block_gram_shared_by_two_threads_against_float64():
    # One block with more threads than blocks: the Gram's two halves and the
    # block between them are formed on two threads (an odd row count, so the
    # halves differ); one thread forms it whole. Both against float64.
    from richness import _core
    from richness._engine import adapt as _adapt

    rng = np.random.default_rng(1)
    X = (3.0 + rng.standard_normal((131, 256))).astype(np.float32)
    Xc = X.astype(np.float64) - X.astype(np.float64).mean(axis=0)
    want = Xc @ Xc.T
    threads = _core.blas_get_num_threads()
    try:
        for n_threads in (1, 2):
            _core.blas_set_num_threads(n_threads)
            for prec, dt, tol in (("fp32", np.float32, 1e-5), ("fp64", np.float64, 1e-12)):
                G, norms = np.full((1, 131, 131), np.nan, dt), np.empty(1)
                _core.centered_grams(_adapt.as_matrix(X, "x").arg(), 131, prec, G.ctypes.data, norms.ctypes.data)
                assert np.abs(G[0] - want).max() < tol * np.abs(want).max(), (n_threads, prec)
                assert np.array_equal(G[0], G[0].T)
                assert abs(norms[0] - np.linalg.norm(want)) < tol * np.linalg.norm(want)
    finally:
        _core.blas_set_num_threads(threads)


def test_core_matmul_against_float64_and_refusals():
    from richness import _core

    rng = np.random.default_rng(2)
    a, b, bt = rng.standard_normal((37, 19)), rng.standard_normal((19, 11)), rng.standard_normal((11, 19))
    for dt, tol in ((np.float32, 1e-5), (np.float64, 1e-13)):
        out = np.full((37, 11), np.nan, dt)
        _core.matmul(a.astype(dt), b.astype(dt), out)
        assert np.abs(out - a.astype(dt).astype(np.float64) @ b.astype(dt).astype(np.float64)).max() < tol * 10
        _core.matmul(a.astype(dt), bt.astype(dt), out, trans_b=True)
        assert np.abs(out - a.astype(dt).astype(np.float64) @ bt.astype(dt).astype(np.float64).T).max() < tol * 10
    out = np.zeros((37, 11))
    with pytest.raises(ValueError, match="shapes do not match"):
        _core.matmul(a, bt, out)
    with pytest.raises(ValueError, match="share one dtype"):
        _core.matmul(a, b.astype(np.float32), out)
    with pytest.raises(ValueError, match="C-contiguous"):
        _core.matmul(a, np.asfortranarray(b), out)
    assert not out.any()


def test_export_into_writes_the_state_dict_and_refuses_before_writing():
    rng = np.random.default_rng(3)
    m = richness.Moments()
    x, f = rng.standard_normal((40, 6)) + 2.0, rng.standard_normal((40, 3))
    m.update(x, f, rng.integers(0, 4, 40), targets=rng.standard_normal(40))
    want = m.state_dict()
    arrays = {k: np.full_like(v, -7) for k, v in want.items() if isinstance(v, np.ndarray)}
    got = m.export_into(arrays)
    assert got["n"] == 40 and got["k"] == 4 and got["precision"] == want["precision"]
    for k, v in arrays.items():
        assert np.array_equal(v, want[k]), k
    sentinel = {k: np.full_like(v, -7) for k, v in arrays.items()}
    for bad_key, bad in (("class_sums", np.zeros((5, 6))), ("M", np.zeros((6, 6), np.float32)),
                         ("class_counts", np.zeros(4))):
        arrays = {k: v.copy() for k, v in sentinel.items()}
        arrays[bad_key] = bad
        with pytest.raises(ValueError, match=bad_key):
            m.export_into(arrays)
        for k, v in arrays.items():  # nothing written
            if k != bad_key:
                assert np.array_equal(v, sentinel[k]), k
    arrays = {k: v.copy() for k, v in sentinel.items()}
    del arrays["A"]
    with pytest.raises(ValueError, match="no array for 'A'"):
        m.export_into(arrays)


@pytest.mark.parametrize("precision", ["fp32", "fp64"])
def test_merge_into_is_the_merge_in_the_callers_arrays(precision):
    # p = 600: the merge of M runs on two threads (each mirrors its own rows).
    # A state in the caller's arrays, each batch state merged into it in place,
    # equals the same merges of Moments bit for bit; the first merge fills
    # empty arrays; a refused merge writes nothing.
    from richness import _core

    rng = np.random.default_rng(4)
    x = rng.standard_normal((1500, 600)).astype(np.float32) + 1.0
    f, y = rng.standard_normal((1500, 3)).astype(np.float32), rng.integers(0, 5, 1500)
    threads = _core.blas_get_num_threads()
    whole = richness.Moments(5, precision=precision)
    _core.blas_set_num_threads(2)
    try:
        arrays = widths = None
        for i in (0, 500, 1000):
            batch = richness.Moments(5, precision=precision)
            batch.update(x[i:i + 500], f[i:i + 500], y[i:i + 500])
            if arrays is None:  # an empty state: arrays of the merged widths, any content
                arrays = {k: np.full_like(v, -7) for k, v in batch.state_dict().items() if isinstance(v, np.ndarray)}
                widths = dict(richness.Moments(5).state_dict(), precision=precision)
                widths = {k: widths[k] for k in ("n", "p", "c", "t", "k", "num_classes", "precision")}
            widths = batch._backend.merge_into(arrays, widths)
            whole.merge(batch)
            want = whole.state_dict()
            assert widths["n"] == i + 500 and widths["k"] == 5 and widths["precision"] == precision
            for k, v in arrays.items():
                assert np.array_equal(v, want[k]), (i, k)
        kept = {k: v.copy() for k, v in arrays.items()}
        other = richness.Moments(precision=precision)
        other.update(x[:10, :7], f[:10], y[:10])
        with pytest.raises(ValueError, match="cannot merge"):  # another feature width
            other._backend.merge_into(arrays, widths)
        small = dict(arrays, class_sums=np.zeros((4, 600)))
        with pytest.raises(ValueError, match="'class_sums' does not have the merged state's size"):
            batch._backend.merge_into(small, widths)
        with pytest.raises(ValueError, match="no array for 'A'"):
            batch._backend.merge_into({k: v for k, v in arrays.items() if k != "A"}, widths)
        assert all(np.array_equal(arrays[k], kept[k]) for k in arrays)
    finally:
        _core.blas_set_num_threads(threads)


@pytest.mark.parametrize("precision,tol", [("fp32", 1e-6), ("fp64", 1e-12)])
def test_norm_m_and_get_fields_read_the_state(precision, tol):
    # ||M||_F from M's lower triangle and a copy of chosen arrays, against
    # float64 numpy on the values the batch holds.
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((500, 600)) * np.linspace(0.5, 2.0, 600) + 3.0).astype(np.float32)
    f = (x[:, :3].astype(np.float64) * 2.0 + rng.standard_normal((500, 3))).astype(np.float32)
    m = richness.Moments(precision=precision)
    m.update(x, f)
    xb, fb = x.astype(np.float64), f.astype(np.float64)
    xc, fc = xb - xb.mean(axis=0), fb - fb.mean(axis=0)
    core = m._backend.core
    want = np.linalg.norm(xc.T @ xc)
    assert abs(core.norm_m() - want) < tol * want
    got = core.get_fields(["B", "mean"])
    assert sorted(got) == ["B", "mean"] and np.array_equal(got["B"], m.state_dict()["B"])
    assert np.abs(got["B"] - xc.T @ fc).max() < tol * np.abs(xc.T @ fc).max()
    with pytest.raises(ValueError, match="unknown state array 'C'"):
        core.get_fields(["C"])
    assert richness.Moments(device="cpu")._backend.core.norm_m() == 0.0


def test_float16_widening_is_exact_for_every_finite_half():
    # Every finite float16 (subnormals and both zeros included), in rows of an
    # odd width so that whole groups of eight and the tail are both widened:
    # the float64 state must equal that of numpy's exact widening, bit for bit.
    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    h = h[np.isfinite(h.astype(np.float32)) & (np.abs(h.astype(np.float32)) < 300)]
    x = np.random.default_rng(0).permutation(h)[: len(h) // 37 * 37].reshape(-1, 37)
    assert (x.astype(np.float32) == 0).any() and (np.abs(x.astype(np.float32)) < 6.2e-5).any()  # subnormals
    got = state_of((x, None), precision="fp64").state_dict()
    want = state_of((x.astype(np.float64), None), precision="fp64").state_dict()
    assert np.array_equal(got["mean"], want["mean"]) and np.array_equal(got["M"], want["M"])
