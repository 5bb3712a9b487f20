"""The finishing math on torch tensors (the path a CUDA state and the Monitor's window take),
here as torch CPU float64 tensors, against the numpy path on the same states; the numpy path
against the n x n references (reference.py)."""

import numpy as np
import pytest

import richness
from reference import center_rows, dlr_naive, nc1_naive
from richness import finish as fin
from richness.finish.dlr import dlr_values, span_of_grams
from richness.finish.nc1 import nc1_from_grams
from richness.finish.samplespace import GramRows, finish_gram_rows

torch = pytest.importorskip("torch")

TOL = 1e-12


def as_torch(st):
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in st.items()}


def labelled(rng, n, p, K, C, targets=False):
    means = rng.normal(size=(K, p)) * 2.0
    y = rng.integers(0, K, size=n)
    X = means[y] + rng.normal(size=(n, p)) @ (np.eye(p) + 0.3 * rng.normal(size=(p, p))) + 1.5
    F = X @ rng.normal(size=(p, C)) + 0.1 * rng.normal(size=(n, C))
    m = richness.Moments(num_classes=K)
    if targets:
        m.update(X, F, targets=np.sin(X[:, :3]))
    else:
        m.update(X, F, labels=y)
    return m, X, F, y


def assert_same(a, b, scale=1.0):
    if a is None or b is None:
        assert a is None and b is None
        return
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64),
                               rtol=0, atol=TOL * scale)


def assert_reports_equal(got, want):
    assert got.rank == want.rank and got.feature_rank == want.feature_rank
    assert got.active_features == want.active_features and got.warnings == want.warnings
    for name in ("dlr", "nc1", "effective_dim", "dlr_isotropic", "dlr_normalized", "quality", "utilization",
                 "test_quality", "test_utilization", "test_eigenfunction_norms", "relative_eigenvalues"):
        w = getattr(want, name)
        assert_same(getattr(got, name), w, 1.0 if w is None else max(1.0, float(np.max(np.abs(w)))))
    assert_same(got.dlr_rtol_range, want.dlr_rtol_range)
    assert_same(got.eigenvalues, want.eigenvalues, want.eigenvalues[0])
    assert_same(got.logit_eigenvalues, want.logit_eigenvalues, want.logit_eigenvalues[0])


@pytest.mark.parametrize("centered", [True, False])
def test_torch_finishing_equals_numpy_with_outputs_labels_and_held_out(centered):
    rng = np.random.default_rng(0)
    train, X, F, y = labelled(rng, 400, 24, 5, 6)
    test, *_ = labelled(rng, 150, 24, 5, 6)
    st, st_test = train.state_dict(), test.state_dict()
    want = fin.finish(st, test=st_test, centered=centered)
    got = fin.finish(as_torch(st), test=as_torch(st_test), centered=centered)
    assert isinstance(got.eigenvalues, np.ndarray) and isinstance(got.quality, np.ndarray)
    assert_reports_equal(got, want)
    # and the numpy path is right (independent n x n references)
    d, r = dlr_naive(X, F)
    assert want.rank == r and abs(want.dlr - d) < 1e-10
    assert abs(want.nc1 - nc1_naive(X, y)) < 1e-10 * nc1_naive(X, y)
    assert want.test_quality is not None and want.test_utilization is not None


@pytest.mark.parametrize("C", [4, 40])  # C < p: B = M W^T; C > p: the p-space head route
def test_torch_finishing_equals_numpy_with_a_head(C):
    rng = np.random.default_rng(1)
    p = 16
    m, X, _, _ = labelled(rng, 300, p, 3, 2, targets=True)
    W = rng.normal(size=(C, p))
    st = m.state_dict()
    want = fin.finish(st, W=W)
    got = fin.finish(as_torch(st), W=torch.from_numpy(W))
    assert_reports_equal(got, want)
    assert fin.dlr_of_state(as_torch(st), torch.from_numpy(W), 1e-10) == pytest.approx(
        fin.dlr_of_state(st, W, 1e-10), abs=TOL)
    d, r = dlr_naive(X, X @ W.T)
    assert want.rank == r and abs(want.dlr - d) < 1e-10


def stacked_grams(rng, steps, n, p, C, K):
    """Per-step Grams as the Monitor's one-batch route forms them (C space)."""
    out = {"norm_m": [], "A": [], "Q": [], "DDt": [], "DMD": [], "counts": []}
    data = []
    for s in range(steps):
        X = rng.normal(size=(n, p)) * np.linspace(0.2, 2.0, p) + 3.0
        y = rng.integers(0, K - (s % 2), size=n)  # odd steps miss a class
        F = X @ rng.normal(size=(p, C))
        if s == 2:
            F[:, -1] = F[:, 0]  # duplicated logit: rank C - 1
        Xc, Fc = center_rows(X), center_rows(F)
        G = Xc @ Xc.T
        Y = np.eye(K)[y]
        counts = Y.sum(axis=0)
        D = (Y / np.maximum(counts, 1)).T @ Xc  # class means of Xc; absent classes 0
        out["norm_m"].append(np.linalg.norm(G))
        out["A"].append(Fc.T @ Fc)
        out["Q"].append(Fc.T @ G @ Fc)
        out["DDt"].append(D @ D.T)
        out["DMD"].append(D @ (Xc.T @ Xc) @ D.T)
        out["counts"].append(counts)
        data.append((X, F, y))
    return {k: np.array(v) for k, v in out.items()}, data


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_batched_dlr_and_nc1_on_stacked_grams(backend):
    # The Monitor's every=1 route: span_of_grams, dlr_values and nc1_from_grams over a leading step
    # axis give each step's n x n reference values, on numpy and torch alike.
    rng = np.random.default_rng(2)
    g, data = stacked_grams(rng, 5, 40, 64, 6, 4)
    if backend == "torch":
        g = {k: torch.from_numpy(v) for k, v in g.items()}
    a, terms = span_of_grams(g["A"], g["Q"], 1e-10)
    dlr, rank = dlr_values(g["norm_m"], a, terms, 1e-10)
    nc1, defined = nc1_from_grams(g["DDt"], g["DMD"], g["counts"], 40.0, 1e-10)
    assert tuple(dlr.shape) == (5,) and bool(defined.all())
    for i, (X, F, y) in enumerate(data):
        d, r = dlr_naive(X, F)
        assert int(rank[i]) == r == (5 if i == 2 else 6)
        assert abs(float(dlr[i]) - d) < 1e-10
        want = nc1_naive(X, y)
        assert abs(float(nc1[i]) - want) < 1e-10 * want


def test_batched_values_are_undefined_where_the_state_is():
    # constant features (||M|| = 0), constant outputs (A = 0), one class: NaN / not defined, not 0 or 1
    a = np.array([[2.0, 1.0], [0.0, 0.0], [3.0, 0.0]])
    dlr, rank = dlr_values(np.array([0.0, 1.0, 2.0]), a, np.ones((3, 2)), 1e-10)
    assert np.isnan(dlr[0]) and np.isnan(dlr[1]) and not np.isnan(dlr[2])
    assert rank.tolist() == [2, 0, 1]
    DDt = np.array([[[1.0, 0.0], [0.0, 0.0]]])
    _, defined = nc1_from_grams(DDt, DDt, np.array([[5.0, 0.0]]), 5.0, 1e-10)
    assert not defined[0]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_gram_rows_pack_by_name_and_finish_each_step(backend):
    # The one-batch route's packed rows: packed side by side, read back by name, finished per step
    # against each step's n x n reference; a step with a label outside the classes has no NC1.
    rng = np.random.default_rng(3)
    g, data = stacked_grams(rng, 4, 40, 64, 6, 4)
    invalid = np.array([0.0, 0.0, 2.0, 0.0])
    if backend == "torch":
        g, invalid = {k: torch.from_numpy(v) for k, v in g.items()}, torch.from_numpy(invalid)
    rows = GramRows(g["norm_m"], g["A"], g["Q"], g["counts"], g["DDt"], g["DMD"], invalid)
    packed = rows.pack()
    assert tuple(packed.shape) == (4, 1 + 2 * 36 + 4 + 2 * 16 + 1)
    packed = np.asarray(packed)
    back = GramRows.unpack(packed, 6, 4)
    np.testing.assert_array_equal(back.DMD, np.asarray(g["DMD"]))
    dlrs, ranks, nc1s = finish_gram_rows(back, 40, 1e-10, sample_space=False)
    for i, (X, F, y) in enumerate(data):
        d, r = dlr_naive(X, F)
        assert ranks[i] == r and abs(dlrs[i] - d) < 1e-10
        assert (nc1s[i] is None) == (i == 2)
        assert i == 2 or abs(nc1s[i] - nc1_naive(X, y)) < 1e-10 * nc1_naive(X, y)
    with pytest.raises(ValueError, match="packed rows have 110 columns"):
        GramRows.unpack(packed, 6, 0)


def test_dlr_only_shares_the_reports_rules():
    # Same rank cut and NC1 as the full report; None (with the reason) where the report raises;
    # NC1 withheld from products that cannot resolve it, as the report withholds it.
    rng = np.random.default_rng(4)
    X = rng.normal(size=(200, 12)) * np.linspace(0.5, 2.0, 12)
    y = rng.integers(0, 3, 200)
    F = X[:, :4] + 0.1 * rng.normal(size=(200, 4)) + y[:, None]
    m = richness.Moments(3)
    m.update(X, F, y)
    st, rep = m.state_dict(), m.compute()
    q = fin.dlr_only(st)
    assert (q.n, q.dlr, q.rank, q.nc1, q.undefined, q.warnings) == (200, rep.dlr, rep.rank, rep.nc1, None, ())
    assert abs(q.dlr - dlr_naive(X, F)[0]) < 1e-10
    assert fin.dlr_only(st, with_nc1=False).nc1 is None
    coarse = dict(st, precision="bf16")
    q = fin.dlr_only(coarse)
    assert q.nc1 is None and "NC1 not reported" in q.warnings[0]
    assert q.warnings[0] in fin.finish(coarse).warnings
    one = richness.Moments()
    one.update(X[:1], F[:1])
    assert fin.dlr_only(one.state_dict()).undefined == "until at least 2 samples are added (one sample was added)"
    flat = richness.Moments()
    flat.update(np.ones((20, 3)), F[:20, :2])
    q = fin.dlr_only(flat.state_dict())
    assert q.dlr is None and q.rank is None and "features are constant" in q.undefined
    with pytest.raises(ValueError, match=r"rtol must be a number in \(0, 1\)"):
        fin.dlr_only(st, rtol=1.5)
