"""The invariances of docs/MATH.md ("Known values"), property-based: DLR does not move under scaling, added
constants, rotations of the features, invertible mixing of the outputs, sample
permutation, batch splits and merge order; compute never touches the state."""

import numpy as np
from hypothesis import given, settings, strategies as st

import richness
from reference import dlr_naive, states_equal

SETTINGS = settings(max_examples=50, deadline=None, derandomize=True)
TOL = {np.float64: 1e-12, np.float32: 1e-6}


class Problem:
    """Random features (correlated, offset) and outputs = a well-conditioned linear
    read-out + a nonlinear part. Well conditioned on purpose: the logit Gram's
    condition number multiplies the rounding of float32 products, and the
    invariances are claims about the package, not about ill-posed data."""

    def __init__(self, seed, n, p, C, dtype):
        self.args = (seed, n, p, C, dtype)
        self.dtype = dtype
        self.rng = rng = np.random.default_rng(seed)
        X = rng.normal(size=(n, p)) @ well_conditioned(rng, p) + rng.normal(size=p) * 3.0
        F = X[:, :C] @ well_conditioned(rng, C) + 0.3 * np.tanh(X[:, -C:]) + rng.normal(size=C)
        self.X, self.F = X.astype(dtype), F.astype(dtype)

    def __iter__(self):
        return iter((self.rng, self.X, self.F, self.dtype))

    def __repr__(self):
        seed, n, p, C, dtype = self.args
        return f"Problem(seed={seed}, n={n}, p={p}, C={C}, dtype={dtype.__name__})"


@st.composite
def problems(draw, dtypes=(np.float64, np.float32)):
    p = draw(st.integers(3, 12))
    return Problem(draw(st.integers(0, 2**32 - 1)), draw(st.integers(40, 160)), p,
                   draw(st.integers(2, min(p, 5))), draw(st.sampled_from(dtypes)))


def dlr_of(X, F, splits=None):
    m = richness.Moments()
    if splits is None:
        m.update(X, F)
    else:
        for idx in np.split(np.arange(X.shape[0]), splits):
            m.update(X[idx], F[idx])
    return m.compute().dlr


def well_conditioned(rng, k):
    """A random k x k matrix with condition number below about 3."""
    Q1 = np.linalg.qr(rng.normal(size=(k, k)))[0]
    Q2 = np.linalg.qr(rng.normal(size=(k, k)))[0]
    return Q1 @ np.diag(rng.uniform(1.0, 3.0, size=k)) @ Q2


@SETTINGS
@given(problems(), st.sampled_from([2.0**-7, 0.5, 4.0, 2.0**10]), st.sampled_from([2.0**-5, 8.0, 2.0**12]))
def test_scaling_features_and_outputs(prob, a, b):
    # Powers of two scale float32 and float64 values exactly, so only the arithmetic differs.
    _, X, F, dtype = prob
    base = dlr_of(X, F)
    ref, _ = dlr_naive(X, F)
    assert abs(base - ref) < TOL[dtype]
    assert abs(dlr_of(X * dtype(a), F) - base) < TOL[dtype]
    assert abs(dlr_of(X, F * dtype(b)) - base) < TOL[dtype]
    assert abs(dlr_of(X * dtype(a), F * dtype(b)) - base) < TOL[dtype]


@SETTINGS
@given(problems(dtypes=(np.float64,)), st.floats(0.01, 1e3), st.floats(0.01, 1e3))
def test_scaling_by_any_factor_float64(prob, a, b):
    _, X, F, _ = prob
    assert abs(dlr_of(a * X, b * F) - dlr_of(X, F)) < 1e-12


@SETTINGS
@given(problems(), st.floats(-100.0, 100.0), st.floats(-100.0, 100.0))
def test_added_constants(prob, cx, cf):
    rng, X, F, dtype = prob
    shift_x = (cx * rng.uniform(-1, 1, size=X.shape[1])).astype(dtype)
    shift_f = (cf * rng.uniform(-1, 1, size=F.shape[1])).astype(dtype)
    Xs, Fs = X + shift_x, F + shift_f
    # Against the reference on the shifted values (float32 rounds the shifted inputs) ...
    ref, _ = dlr_naive(Xs, Fs)
    assert abs(dlr_of(Xs, Fs) - ref) < TOL[dtype]
    # ... and, in float64, against the unshifted value.
    if dtype == np.float64:
        assert abs(dlr_of(Xs, Fs) - dlr_of(X, F)) < 1e-12


@SETTINGS
@given(problems())
def test_orthogonal_rotation_of_features(prob):
    rng, X, F, dtype = prob
    Q = np.linalg.qr(rng.normal(size=(X.shape[1], X.shape[1])))[0]
    Xr = (X.astype(np.float64) @ Q).astype(dtype)
    assert abs(dlr_of(Xr, F) - dlr_of(X, F)) < TOL[dtype]


@SETTINGS
@given(problems())
def test_invertible_mixing_of_outputs(prob):
    rng, X, F, dtype = prob
    G = well_conditioned(rng, F.shape[1])
    Fm = (F.astype(np.float64) @ G).astype(dtype)
    assert abs(dlr_of(X, Fm) - dlr_of(X, F)) < TOL[dtype]
    # head mode: mixing the head's rows (and bias) is mixing its outputs; the head is well
    # conditioned too (rows of a well-conditioned p x p matrix: C <= p here)
    W = well_conditioned(rng, X.shape[1])[:F.shape[1]]
    m = richness.Moments()
    m.update(X)
    assert abs(m.compute(head_weights=(G.T @ W, None)).dlr - m.compute(head_weights=W).dlr) < TOL[dtype]


@SETTINGS
@given(problems())
def test_sample_permutation(prob):
    rng, X, F, dtype = prob
    perm = rng.permutation(X.shape[0])
    assert abs(dlr_of(X[perm], F[perm]) - dlr_of(X, F)) < TOL[dtype]


@SETTINGS
@given(problems(), st.data())
def test_any_split_into_batches(prob, data):
    _, X, F, dtype = prob
    n = X.shape[0]
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=8)))  # empty and 1-row batches too
    whole = richness.Moments()
    whole.update(X, F)
    split = richness.Moments()
    for idx in np.split(np.arange(n), cuts):
        split.update(X[idx], F[idx])
    assert split.n == n
    assert abs(split.compute().dlr - whole.compute().dlr) < TOL[dtype]
    a, b = whole.state_dict(), split.state_dict()
    scale = np.abs(a["M"]).max()
    rel = 1e-12 if dtype == np.float64 else 1e-6
    assert np.abs(a["M"] - b["M"]).max() <= rel * scale * 10
    assert np.abs(a["mean"] - b["mean"]).max() <= 1e-12 * np.abs(a["mean"]).max() + 1e-15


@SETTINGS
@given(problems(), st.data())
def test_any_merge_order(prob, data):
    rng, X, F, dtype = prob
    n = X.shape[0]
    y = rng.integers(0, 3, size=n)
    cuts = sorted(data.draw(st.lists(st.integers(1, n - 1), min_size=1, max_size=6, unique=True)))
    parts = []
    for idx in np.split(np.arange(n), cuts):
        m = richness.Moments()
        m.update(X[idx], F[idx], labels=y[idx])
        parts.append(m)
    # a random binary merge tree over a random order of the parts
    order = data.draw(st.permutations(range(len(parts))))
    pool = [parts[i] for i in order]
    while len(pool) > 1:
        i = data.draw(st.integers(0, len(pool) - 2))
        pool[i].merge(pool.pop(i + 1))
    merged = pool[0]
    whole = richness.Moments()
    whole.update(X, F, labels=y)
    assert merged.n == n
    rm, rw = merged.compute(), whole.compute()
    assert abs(rm.dlr - rw.dlr) < TOL[dtype]
    assert abs(rm.nc1 - rw.nc1) <= TOL[dtype] * max(1.0, rw.nc1)
    sm, sw = merged.state_dict(), whole.state_dict()
    assert np.array_equal(sm["class_counts"], sw["class_counts"])
    np.testing.assert_allclose(sm["class_sums"], sw["class_sums"], rtol=1e-12, atol=1e-12)


@SETTINGS
@given(problems())
def test_repeated_compute_leaves_state_unchanged(prob):
    rng, X, F, dtype = prob
    n, p = X.shape
    y = rng.integers(0, 4, size=n)
    T = rng.normal(size=(n, 2)).astype(dtype)
    m = richness.Moments()
    m.update(X, F, labels=y, targets=T)
    test = richness.Moments()
    test.update(X[: n // 2] * dtype(2), F[: n // 2], labels=y[: n // 2], targets=T[: n // 2])
    before, before_test = m.state_dict(), test.state_dict()
    W = rng.normal(size=(3, p))
    reports = [m.compute(), m.compute(head_weights=W), m.compute(test=test), m.compute(centered=False),
               m.compute(rtol=1e-3), m.compute()]
    assert states_equal(m.state_dict(), before)
    assert states_equal(test.state_dict(), before_test)
    first, last = reports[0], reports[-1]
    assert first.dlr == last.dlr
    assert np.array_equal(first.eigenvalues, last.eigenvalues)
    assert np.array_equal(first.utilization, last.utilization)
    assert np.array_equal(first.quality, last.quality)
