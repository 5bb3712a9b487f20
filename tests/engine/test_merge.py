"""merge: growing label ranges, empty sides, merging a state with itself."""

import numpy as np
import pytest

import richness
from reference import dlr_naive, dlr_thin, nc1_naive, one_hot, states_equal


def chunk(seed, n, labels_upto, p=5, C=3):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, p)) @ rng.normal(size=(p, p)) + seed
    F = X @ rng.normal(size=(p, C)) + np.sin(X[:, :C])
    y = rng.integers(0, labels_upto, size=n)
    T = rng.normal(size=(n, 2))
    return X, F, y, T


def moments_of(*chunks, **kw):
    m = richness.Moments(**kw)
    for X, F, y, T in chunks:
        m.update(X, F, labels=y, targets=T)
    return m


def assert_close_states(a, b, rtol=1e-12):
    for key in ("n", "p", "c", "t", "k", "num_classes", "precision"):
        assert a[key] == b[key], key
    assert np.array_equal(a["class_counts"], b["class_counts"])
    for key in ("mean", "M", "out_mean", "B", "A", "tgt_mean", "Bt", "At", "class_sums"):
        scale = max(np.abs(b[key]).max(initial=0.0), 1.0)
        assert np.abs(a[key] - b[key]).max(initial=0.0) <= rtol * scale, key


def test_merge_grows_label_range():
    c1, c2 = chunk(1, 80, 3), chunk(2, 60, 6)  # labels 0..2 and 0..5
    a, b = moments_of(c1), moments_of(c2)
    assert a.state_dict()["k"] == 3 and b.state_dict()["k"] == 6
    whole = moments_of(c1, c2)
    ab = moments_of(c1)
    ab.merge(b)
    ba = moments_of(c2)
    ba.merge(a)
    for merged in (ab, ba):
        st = merged.state_dict()
        assert st["k"] == 6
        assert_close_states(st, whole.state_dict())
    X = np.vstack([c1[0], c2[0]])
    y = np.concatenate([c1[2], c2[2]])
    rep = ab.compute()
    assert abs(rep.nc1 - nc1_naive(X, y)) < 1e-10 * rep.nc1
    counts = np.bincount(y, minlength=6)
    assert np.array_equal(ab.state_dict()["class_counts"], counts)
    np.testing.assert_allclose(ab.state_dict()["class_sums"], one_hot(y, 6).T @ X, rtol=1e-13, atol=1e-10)


def test_merge_with_fixed_num_classes():
    c1, c2 = chunk(3, 50, 2), chunk(4, 50, 4)
    a = moments_of(c1, num_classes=4)
    b = moments_of(c2)  # grows: k = 4
    a.merge(b)
    assert a.state_dict()["k"] == 4 and a.num_classes == 4
    assert_close_states(a.state_dict(), moments_of(c1, c2, num_classes=4).state_dict())


@pytest.mark.parametrize("how", ["new", "reset", "fixed classes"])
def test_merge_into_empty(how):
    c = chunk(5, 70, 4)
    src = moments_of(c)
    if how == "new":
        dst = richness.Moments()
    elif how == "reset":
        dst = moments_of(chunk(6, 20, 2, p=7, C=1))  # other widths before the reset
        dst.reset()
    else:
        dst = richness.Moments(num_classes=6)
    dst.merge(src)
    want = moments_of(c, num_classes=6) if how == "fixed classes" else src
    assert states_equal(dst.state_dict(), want.state_dict())
    # the source is untouched and the two are independent afterwards
    assert states_equal(src.state_dict(), moments_of(c).state_dict())
    dst.update(*c[:2], labels=c[2], targets=c[3])
    assert src.n == 70 and dst.n == 140


def test_merge_empty_into_filled_is_a_no_op():
    c = chunk(7, 40, 3)
    m = moments_of(c)
    before = m.state_dict()
    m.merge(richness.Moments())
    empty_after_reset = moments_of(chunk(8, 10, 2))
    empty_after_reset.reset()
    m.merge(empty_after_reset)
    assert states_equal(m.state_dict(), before)


def test_merge_self_doubles_the_samples():
    c = chunk(9, 90, 4)
    m = moments_of(c)
    twice = moments_of(c, c)
    m.merge(m)
    assert m.n == 180
    assert_close_states(m.state_dict(), twice.state_dict())
    st = m.state_dict()
    # duplicating every sample: same mean, twice the scatter, same DLR
    np.testing.assert_allclose(st["M"], 2 * moments_of(c).state_dict()["M"], rtol=1e-14)
    X, F = c[0], c[1]
    assert abs(m.compute().dlr - dlr_naive(np.vstack([X, X]), np.vstack([F, F]))[0]) < 1e-12


def test_merge_keeps_the_coarser_precision():
    c = chunk(10, 60, 3)
    a = moments_of(c)
    b = richness.Moments()
    X, F, y, T = chunk(11, 40, 3)
    b.update(X.astype(np.float32), F.astype(np.float32), labels=y, targets=T.astype(np.float32))
    a.merge(b)
    assert a.compute().precision == "fp32"
    ref, _ = dlr_naive(np.vstack([c[0], X.astype(np.float32)]), np.vstack([c[1], F.astype(np.float32)]))
    assert abs(a.compute().dlr - ref) < 1e-6


def test_merge_matches_reference_with_far_apart_means():
    # Chan's correction term carries the between-part scatter: parts with very
    # different means must merge to the pooled covariance.
    rng = np.random.default_rng(12)
    parts = [rng.normal(size=(30, 4)) + 1e3 * rng.normal(size=4) for _ in range(4)]
    outs = [P @ rng.normal(size=(4, 2)) for P in parts]
    ms = []
    for P, Fp in zip(parts, outs):
        m = richness.Moments()
        m.update(P, Fp)
        ms.append(m)
    total = ms[0]
    for m in ms[1:]:
        total.merge(m)
    X, F = np.vstack(parts), np.vstack(outs)
    Xc = X - X.mean(axis=0)
    np.testing.assert_allclose(total.state_dict()["M"], Xc.T @ Xc, rtol=1e-11)
    assert abs(total.compute().dlr - dlr_naive(X, F)[0]) < 1e-12


def test_merge_that_would_overflow_is_refused():
    # Each side is finite; the between-means term f d d^T of their merge is not: refuse it, naming
    # overflow, and leave both sides as they were (the Inf used to land in M and spread on).
    X, F, y, T = chunk(0, 40, 3)
    near = moments_of((X, F, y, T))
    far = moments_of((X + 1e160, F, y, T))  # constant within itself: X is lost beside 1e160
    near_before, far_before = near.state_dict(), far.state_dict()
    for sink, source in ((near, far), (far, near)):
        with pytest.raises(ValueError, match=r"cannot merge: the merged features moments would overflow float64"):
            sink.merge(source)
    assert states_equal(near.state_dict(), near_before)
    assert states_equal(far.state_dict(), far_before)
    assert np.isfinite(near.state_dict()["M"]).all()


def test_merge_growing_classes_is_all_or_nothing():
    # The class arrays grow before the merge; a merge refused afterwards must not leave them grown.
    a = moments_of(chunk(1, 30, 2))
    b = moments_of((chunk(2, 30, 6)[0] + 1e160,) + chunk(2, 30, 6)[1:])
    before = a.state_dict()
    with pytest.raises(ValueError, match=r"overflow"):
        a.merge(b)
    assert states_equal(a.state_dict(), before)
    assert a.state_dict()["k"] == 2


def test_shift_and_sum_merge_of_many_states():
    """The one-sum merge of several states (what torch.distributed and the
    torchmetrics metric use) equals one pass over all the data, and the
    column means and second moments of the data themselves."""
    from richness import _state

    chunks = [chunk(s, 40 + 7 * s, 2 + s) for s in range(4)]  # growing label ranges
    parts = [moments_of(c).state_dict() for c in chunks] + [richness.Moments().state_dict()]  # and an empty one
    got = _state.merge(parts)
    whole = moments_of(*chunks).state_dict()
    assert_close_states(got, whole)
    X = np.concatenate([c[0] for c in chunks])
    F = np.concatenate([c[1] for c in chunks])
    Xc, Fc = X - X.mean(0), F - F.mean(0)
    np.testing.assert_allclose(got["M"], Xc.T @ Xc, rtol=1e-12, atol=1e-10 * np.abs(Xc.T @ Xc).max())
    np.testing.assert_allclose(got["B"], Xc.T @ Fc, rtol=1e-12, atol=1e-10 * np.abs(Xc.T @ Fc).max())
    y = np.concatenate([c[2] for c in chunks])
    np.testing.assert_array_equal(got["class_counts"], np.bincount(y))


def test_shift_and_sum_merge_rejects_incompatible_states():
    from richness import _state

    a = moments_of(chunk(1, 30, 3)).state_dict()
    b = richness.Moments()
    b.update(*chunk(2, 30, 3)[:2])  # no labels, no targets
    with pytest.raises(ValueError, match="labels|target widths"):
        _state.merge([a, b.state_dict()])
    c = moments_of(chunk(3, 30, 3), num_classes=4).state_dict()
    d = moments_of(chunk(4, 30, 3), num_classes=5).state_dict()
    with pytest.raises(ValueError, match="num_classes"):
        _state.merge([c, d])


def test_shift_and_sum_merge_refuses_overflow():
    from richness import _state

    a = richness.Moments()
    a.update(np.array([[1e153], [-1e153]]))  # each state is finite and accepted ...
    b = richness.Moments()
    b.update(np.array([[1.5e154], [1.5e154 + 1e140]]))
    with pytest.raises(ValueError, match="overflow"):  # ... but the mean shifts of their merge overflow
        _state.merge([a.state_dict(), b.state_dict()])


def test_one_field_list_in_python_and_cpp():
    """The state's arrays are declared once per language (python/richness/_state.py
    FIELDS, csrc/common/state.hpp RICHNESS_STATE_ARRAYS): the compiled core's own
    list must agree with Python's, names, element types, axes and order."""
    from richness import _core, _state

    compiled = [(name, dtype, tuple(axes), sym) for name, dtype, axes, sym in _core.state_fields()]
    python = [(f.name, np.dtype(f.dtype).name, f.axes, f.symmetric) for f in _state.FIELDS]
    assert compiled == python
    core = _core.CpuMoments()
    core_keys = [k for k in core.get_state() if k not in _state.SCALARS]  # what the core exports, in order
    assert core_keys == list(_state.FIELD_NAMES)
    m = moments_of(chunk(1, 30, 3))
    full = m.state_dict()
    for f in _state.FIELDS:
        assert full[f.name].dtype == np.dtype(f.dtype)
        assert full[f.name].shape == _state.shape_of(f, full)
        if f.symmetric:
            assert np.array_equal(full[f.name], full[f.name].T)


def test_merge_refuses_a_sample_count_beyond_int64():
    # n used to wrap around: 60 self-merges gave n = -6.9e18 and a state that could not be saved.
    m = richness.Moments()
    X = np.random.default_rng(0).normal(size=(30, 4))
    m.update(X, X[:, :2])
    st = m.state_dict()
    st["n"] = 2**61
    m.load_state_dict(st)
    m.merge(m)
    assert m.n == 2**62
    before = m.state_dict()
    twin = richness.Moments()
    twin.load_state_dict(before)
    for other in (m, twin):
        with pytest.raises(ValueError, match=r"the sample count would pass 2\*\*63 - 1 \(9223372036854775808\)"):
            m.merge(other)
        assert states_equal(m.state_dict(), before)


def test_precision_facts_come_from_the_compiled_table():
    from richness import _core, _state

    table = _core.precisions()
    assert [m["name"] for m in table] == list(_core.PRECISIONS) == list(_state.precisions())
    for row, mode in zip(table, _state.precision_modes()):
        assert (mode.name, mode.coarseness, mode.rtol, mode.cuda_only, mode.resolves_nc1) == (
            row["name"], row["coarseness"], row["rtol"], row["cuda_only"], row["resolves_nc1"])
        assert row["input_bytes"] == np.dtype(row["input"] if row["input"] != "bfloat16" else "float16").itemsize
    assert {m["name"] for m in table if not m["cuda_only"]} == {"fp32", "fp64"}


@pytest.mark.parametrize("name", [m.name for m in __import__("richness")._state.precision_modes() if m.cuda_only])
def test_a_cuda_only_precision_gets_one_message_on_every_route(name):
    """The CPU refuses every CUDA-only mode of the table, with one message,
    whether the Moments constructor or the core's update sees it first."""
    from richness import _core

    with pytest.raises(ValueError) as ctor:
        richness.Moments(precision=name, device="cpu")
    x = np.ones((4, 2)) * np.arange(4)[:, None]
    with pytest.raises(ValueError) as core:
        _core.CpuMoments().update((x.ctypes.data, 4, 2, 2, "float64"), precision=name)
    assert str(ctor.value) == str(core.value)
    assert str(core.value) == f"precision '{name}' needs device='cuda'; the CPU multiplies in fp64 or fp32"


# -- one merge rule ------------------------------------------------------------------------

from hypothesis import given, settings, strategies as st  # noqa: E402


def _shaped(n, p, c, k, num_classes, seed, groups=None):
    """A Moments of n rows of width p, with c outputs (None: none) and labels below k (None: none)."""
    m = richness.Moments(num_classes, groups=groups)
    if n:
        rng = np.random.default_rng(seed)
        X = rng.normal(size=(n, p))
        m.update(X, None if c is None else rng.normal(size=(n, c)),
                 labels=None if k is None else np.arange(n) % k)
    return m


SHAPES = st.tuples(st.sampled_from([0, 6]), st.sampled_from([2, 3]), st.sampled_from([None, 1, 2]),
                   st.sampled_from([None, 2, 3]), st.sampled_from([None, 2, 3, 4]))


@settings(max_examples=120, deadline=None, derandomize=True)
@given(SHAPES, SHAPES)
def test_every_merge_route_applies_the_one_python_rule(a, b):
    """Moments.merge (with and without groups) refuses exactly what
    _state.check_compatible refuses, in its words, leaving the state as it was;
    whatever that rule accepts, the core's own pairwise check accepts too."""
    from richness import _state

    if a[3] is not None and a[4] is not None and a[3] > a[4]:
        a = a[:4] + (None,)  # labels beyond a fixed num_classes never make a state
    if b[3] is not None and b[4] is not None and b[3] > b[4]:
        b = b[:4] + (None,)
    other = _shaped(*b, seed=2)
    widths = [_shaped(*a, seed=1)._widths(), other._widths()]
    try:
        _state.check_compatible(widths)
        refusal = None
    except ValueError as e:
        refusal = str(e)
    for groups in (None, 2):
        m = _shaped(*a, seed=1, groups=groups)
        before = m.state_dict()
        if refusal is None:
            m.merge(other)  # the core merges what the rule accepts
            assert m.n == a[0] + other.n
        else:
            with pytest.raises(ValueError) as e:
                m.merge(other)
            assert str(e.value) == refusal
            assert states_equal(m.state_dict(), before)


def test_states_fixing_different_num_classes_do_not_merge_on_any_route():
    from richness import _state

    a, b = moments_of(chunk(1, 30, 2), num_classes=4), moments_of(chunk(2, 30, 2), num_classes=5)
    message = r"cannot merge: states fix different num_classes \[4, 5\]"
    with pytest.raises(ValueError, match=message):
        a.merge(b)
    with pytest.raises(ValueError, match=message):
        _state.merge([a.state_dict(), b.state_dict()])
    assert a.num_classes == 4 and a.n == 30


@pytest.mark.parametrize("drift", [0.0, 0.2, 50.0])
def test_float32_batches_centered_on_the_state_means(drift):
    """With float32 products, a batch after the first is centered on the
    state's means by the read that checks it, and the merge takes the shift
    out in float64; a batch whose means lie too far from the state's (here 50
    spreads: labels sorted by class, say) is centered on its own means
    instead. Either way the co-moments match the float64 reference of all the
    rows to float32 precision, on a large common offset (the float32 rows
    keep only about four digits of their spread) and on a constant column."""
    rng = np.random.default_rng(41)
    p, C, nb = 20, 4, 12000  # 12,000 x 24 float32 centered rows: past the 1 MiB of the shifted route
    W = rng.normal(size=(p, C))
    batches = []
    for k in range(4):
        X = 1e4 + rng.normal(size=(nb, p)) @ rng.normal(size=(p, p)) + drift * k
        X[:, 2] = 7.25  # constant: its centered rows are exactly zero
        batches.append((X.astype(np.float32), (X @ W).astype(np.float32)))
    m32 = richness.Moments(precision="fp32")
    for X, F in batches:
        m32.update(X, F)
    st = m32.state_dict()
    X = np.concatenate([x.astype(np.float64) for x, _ in batches])
    F = np.concatenate([f.astype(np.float64) for _, f in batches])
    Xc, Fc = X - X.mean(0), F - F.mean(0)
    sx, sf = np.sqrt(np.diag(Xc.T @ Xc)), np.sqrt(np.diag(Fc.T @ Fc))
    for key, want, scale in (("M", Xc.T @ Xc, np.outer(sx, sx)), ("B", Xc.T @ Fc, np.outer(sx, sf)),
                             ("A", Fc.T @ Fc, np.outer(sf, sf))):
        assert np.all(np.abs(st[key] - want) <= 1e-5 * scale), key
    assert np.all(st["M"][2, :] == 0) and np.all(st["M"][:, 2] == 0)  # the constant column: no false covariance
    np.testing.assert_allclose(st["mean"], X.mean(0), rtol=1e-12)
    assert abs(m32.compute().dlr - dlr_thin(X, F)[0]) < 1e-6
