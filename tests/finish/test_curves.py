"""Spectrum, interpretability curves, held-out curves, NC1 and the rest of the
Report, against explicit eigenfunctions evaluated sample by sample (reference.py)."""

import json

import numpy as np
import pytest

import richness
from reference import (cumulative_curve, effective_dim_naive, eigenfunctions, nc1_naive, one_hot, pad_curve,
                       spectrum_naive, spectrum_uncentered_naive)


def labelled_data(rng, n, p, K, spread=1.0, sizes=None):
    means = rng.normal(size=(K, p)) * 2.0
    y = rng.integers(0, K, size=n) if sizes is None else np.repeat(np.arange(K), sizes)
    X = means[y] + spread * rng.normal(size=(len(y), p)) @ (np.eye(p) + 0.3 * rng.normal(size=(p, p)))
    return X + 1.5, y


def training_curve(X, G, rtol=1e-10):
    rho, V, r = spectrum_naive(X, rtol)
    E = eigenfunctions(X, X.mean(axis=0), V[:, :r], rho[:r])
    return pad_curve(cumulative_curve(E, G), X.shape[1])


def assert_monotone(curve, upper=1.0):
    assert np.all(np.diff(curve) >= -1e-14)
    assert curve[0] >= -1e-15
    if upper is not None:
        assert curve[-1] <= upper + 1e-12


# -- training curves -------------------------------------------------------------------

@pytest.mark.parametrize("streamed", [True, False])
def test_utilization_reaches_one_at_feature_rank(streamed):
    rng = np.random.default_rng(21)
    n, p, r, C = 300, 12, 5, 3
    X = rng.normal(size=(n, r)) @ rng.normal(size=(r, p)) + 2.0  # features of rank r
    W, b = rng.normal(size=(C, p)), rng.normal(size=C)
    F = X @ W.T + b
    m = richness.Moments()
    m.update(X, F) if streamed else m.update(X)
    rep = m.compute() if streamed else m.compute(head_weights=(W, b))
    assert rep.feature_rank == r
    u = rep.utilization
    assert u.shape == (p,)
    assert abs(u[r - 1] - 1.0) < 1e-10 and abs(u[-1] - 1.0) < 1e-10
    assert u[r - 2] < 1.0 - 1e-6  # it is not reached before the feature rank here
    assert_monotone(u)
    np.testing.assert_allclose(u, training_curve(X, F), rtol=0, atol=1e-10)


def test_utilization_full_rank_features_reaches_one_at_p():
    rng = np.random.default_rng(22)
    X = rng.normal(size=(200, 7)) * np.arange(1, 8)
    W = rng.normal(size=(3, 7))
    m = richness.Moments()
    m.update(X)
    u = m.compute(head_weights=W).utilization
    assert abs(u[-1] - 1.0) < 1e-12
    np.testing.assert_allclose(u, training_curve(X, X @ W.T), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 1e-5)])
def test_training_curves_against_eigenfunctions(dtype, tol):
    rng = np.random.default_rng(23)
    n, p, K = 400, 9, 4
    X, y = labelled_data(rng, n, p, K)
    X = X.astype(dtype)
    F = (np.tanh(X.astype(np.float64) @ rng.normal(size=(p, 5)))).astype(dtype)  # not linear in X
    m = richness.Moments()
    for idx in np.array_split(np.arange(n), 3):
        m.update(X[idx], F[idx], labels=y[idx])
    rep = m.compute()
    rtol = rep.rtol
    assert rtol == (1e-10 if dtype == np.float64 else 1e-5)
    util_ref = training_curve(X, F, rtol)
    qual_ref = training_curve(X, one_hot(y, K), rtol)
    np.testing.assert_allclose(rep.utilization, util_ref, rtol=0, atol=tol)
    np.testing.assert_allclose(rep.quality, qual_ref, rtol=0, atol=tol)
    assert_monotone(rep.utilization)
    assert_monotone(rep.quality)
    assert rep.utilization[-1] < 0.999  # nonlinear outputs: not all carried by linear features


def test_spectrum_relative_eigenvalues_effective_dim():
    rng = np.random.default_rng(24)
    n, p = 500, 10
    X = rng.normal(size=(n, p)) * np.geomspace(5.0, 0.1, p) @ np.linalg.qr(rng.normal(size=(p, p)))[0] - 4.0
    m = richness.Moments()
    m.update(X)
    rep = m.compute()
    rho, _, r = spectrum_naive(X)
    assert rep.dlr is None and rep.utilization is None and rep.quality is None and rep.nc1 is None
    assert rep.feature_rank == r == p
    np.testing.assert_allclose(rep.eigenvalues, rho, rtol=1e-10, atol=0)
    np.testing.assert_allclose(rep.relative_eigenvalues, rho / rho[0], rtol=1e-10, atol=0)
    assert rep.relative_eigenvalues[0] == 1.0
    assert abs(rep.effective_dim - effective_dim_naive(rho)) < 1e-10
    assert 1.0 <= rep.effective_dim <= p


def test_effective_dim_isotropic_and_rank_one():
    rng = np.random.default_rng(25)
    p = 6
    Q = np.linalg.qr(rng.normal(size=(p, p)))[0]
    X = np.vstack([np.eye(p), -np.eye(p)]) @ Q * 3.0  # covariance exactly proportional to I
    m = richness.Moments()
    m.update(X)
    assert abs(m.compute().effective_dim - p) < 1e-10
    z = rng.normal(size=(50, 1))
    m1 = richness.Moments()
    m1.update(z @ rng.normal(size=(1, p)))
    rep1 = m1.compute()
    assert rep1.feature_rank == 1
    assert abs(rep1.effective_dim - effective_dim_naive(spectrum_naive(z @ np.ones((1, p)))[0])) < 1e-6


# -- quality: labels, one-hot targets, float targets ---------------------------------------------

def test_quality_labels_equals_one_hot_targets():
    rng = np.random.default_rng(26)
    n, p, K = 300, 8, 5
    X, y = labelled_data(rng, n, p, K)
    ml, mt = richness.Moments(), richness.Moments()
    for idx in np.array_split(np.arange(n), 4):
        ml.update(X[idx], labels=y[idx])
        mt.update(X[idx], targets=one_hot(y[idx], K))
    ql, qt = ml.compute().quality, mt.compute().quality
    np.testing.assert_allclose(ql, qt, rtol=0, atol=1e-12)
    np.testing.assert_allclose(ql, training_curve(X, one_hot(y, K)), rtol=0, atol=1e-12)
    assert_monotone(ql)


def test_quality_float_targets_regression():
    rng = np.random.default_rng(27)
    n, p = 250, 7
    X = rng.normal(size=(n, p)) @ rng.normal(size=(p, p))
    T = np.sin(X[:, :2]) + 0.1 * rng.normal(size=(n, 2))
    m = richness.Moments()
    m.update(X, targets=T)
    rep = m.compute()
    np.testing.assert_allclose(rep.quality, training_curve(X, T), rtol=0, atol=1e-12)
    m1 = richness.Moments()
    m1.update(X, targets=T[:, 0])  # 1-D targets are one column
    np.testing.assert_allclose(m1.compute().quality, training_curve(X, T[:, :1]), rtol=0, atol=1e-12)


def test_quality_with_empty_classes():
    rng = np.random.default_rng(28)
    X, y = labelled_data(rng, 200, 6, 3)
    y = np.where(y == 1, 4, y)  # classes 1 and 3 never occur
    m = richness.Moments(num_classes=6)
    m.update(X, labels=y)
    rep = m.compute()
    np.testing.assert_allclose(rep.quality, training_curve(X, one_hot(y, 6)), rtol=0, atol=1e-12)
    assert abs(rep.nc1 - nc1_naive(X, y)) < 1e-10 * max(1.0, rep.nc1)


# -- head mode = streamed outputs -----------------------------------------------------------

def test_head_mode_equals_streamed_outputs():
    rng = np.random.default_rng(29)
    n, p, C = 300, 10, 4
    X = rng.normal(size=(n, p)) @ rng.normal(size=(p, p)) + 1.0
    Xt = rng.normal(size=(150, p)) @ rng.normal(size=(p, p)) - 1.0
    W, b = rng.normal(size=(C, p)), rng.normal(size=C)
    ms, mh = richness.Moments(), richness.Moments()
    ts, th = richness.Moments(), richness.Moments()
    ms.update(X, X @ W.T + b)
    mh.update(X)
    ts.update(Xt, Xt @ W.T + b)
    th.update(Xt)
    rs, rh = ms.compute(test=ts), mh.compute(head_weights=(W, b), test=th)
    assert rs.rank == rh.rank == C
    assert abs(rs.dlr - rh.dlr) < 1e-12
    np.testing.assert_allclose(rh.logit_eigenvalues, rs.logit_eigenvalues, rtol=1e-10)
    np.testing.assert_allclose(rh.utilization, rs.utilization, rtol=0, atol=1e-12)
    np.testing.assert_allclose(rh.test_utilization, rs.test_utilization, rtol=0, atol=1e-10)
    np.testing.assert_allclose(rh.test_eigenfunction_norms, rs.test_eigenfunction_norms, rtol=1e-12)


# -- held-out curves (Nystrom extension) ----------------------------------------------------------

def heldout_reference(X, Xt, G_test, centered=True):
    if centered:
        rho, V, r = spectrum_naive(X)
        mu = X.mean(axis=0)
    else:
        rho, V, r = spectrum_uncentered_naive(X)
        mu = np.zeros(X.shape[1])
    Et = eigenfunctions(Xt, mu, V[:, :r], rho[:r])
    norms = np.zeros(X.shape[1])
    norms[:r] = np.mean(Et**2, axis=0)
    return pad_curve(cumulative_curve(Et, G_test), X.shape[1]), norms


@pytest.mark.parametrize("centered", [True, False])
def test_heldout_curves_equal_explicit_projections(centered):
    rng = np.random.default_rng(30)
    n, nt, p, K = 400, 300, 8, 3
    means = rng.normal(size=(K, p)) * 2
    y, yt = rng.integers(0, K, size=n), rng.integers(0, K, size=nt)
    scale_train = np.ones(p)
    scale_train[-2:] = 0.1  # the training set barely varies along two directions
    X = means[y] + rng.normal(size=(n, p)) * scale_train + 1.0
    Xt = means[yt] + rng.normal(size=(nt, p)) + 1.3  # the test set does, and is shifted
    V = rng.normal(size=(p, 4))
    F, Ft = np.tanh(X @ V), np.tanh(Xt @ V)
    F[:, 0] += X[:, -1]
    Ft[:, 0] += Xt[:, -1]
    train, test = richness.Moments(), richness.Moments()
    train.update(X, F, labels=y)
    test.update(Xt, Ft, labels=yt)
    rep = train.compute(test=test, centered=centered)

    want_u, norms = heldout_reference(X, Xt, Ft, centered)
    want_q, _ = heldout_reference(X, Xt, one_hot(yt, K), centered)
    np.testing.assert_allclose(rep.test_utilization, want_u, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(rep.test_quality, want_q, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(rep.test_eigenfunction_norms, norms, rtol=1e-10, atol=1e-12)
    assert_monotone(rep.test_utilization, upper=None)
    assert_monotone(rep.test_quality, upper=None)
    # Not bounded by 1: the variance shift makes training eigenfunctions large on test data.
    assert rep.test_utilization[-1] > 1.2
    assert rep.test_eigenfunction_norms.max() > 4.0


def test_heldout_on_training_set_equals_training_curves():
    rng = np.random.default_rng(31)
    X, y = labelled_data(rng, 300, 7, 4)
    F = np.tanh(X @ rng.normal(size=(7, 3)))
    m = richness.Moments()
    m.update(X, F, labels=y)
    rep = m.compute(test=m)
    np.testing.assert_allclose(rep.test_utilization, rep.utilization, rtol=0, atol=1e-12)
    np.testing.assert_allclose(rep.test_quality, rep.quality, rtol=0, atol=1e-12)
    np.testing.assert_allclose(rep.test_eigenfunction_norms, np.ones(7), rtol=0, atol=1e-10)


def test_heldout_with_head():
    rng = np.random.default_rng(32)
    p = 6
    X = rng.normal(size=(300, p)) * np.geomspace(3, 0.2, p)
    Xt = rng.normal(size=(200, p))
    W, b = rng.normal(size=(2, p)), rng.normal(size=2)
    train, test = richness.Moments(), richness.Moments()
    train.update(X)
    test.update(Xt)
    rep = train.compute(head_weights=(W, b), test=test)
    want, _ = heldout_reference(X, Xt, Xt @ W.T + b)
    np.testing.assert_allclose(rep.test_utilization, want, rtol=1e-10)
    assert rep.test_quality is None
    assert rep.test_utilization[-1] > 1.0


# -- uncentered option (the paper's v1) -----------------------------------------------------------

def test_uncentered_spectrum_and_curves():
    rng = np.random.default_rng(33)
    n, p, K = 300, 6, 3
    X, y = labelled_data(rng, n, p, K)
    F = X @ rng.normal(size=(p, 3)) + np.tanh(X[:, :3])
    m = richness.Moments()
    m.update(X, F, labels=y)
    rep = m.compute(centered=False)
    assert rep.centered is False
    rho, V, r = spectrum_uncentered_naive(X)
    np.testing.assert_allclose(rep.eigenvalues, rho, rtol=1e-10, atol=1e-12 * rho[0])
    np.testing.assert_allclose(rep.relative_eigenvalues, rho / rho[0], rtol=1e-9, atol=1e-12)
    assert abs(rep.effective_dim - effective_dim_naive(rho)) < 1e-10
    E = eigenfunctions(X, np.zeros(p), V[:, :r], rho[:r])  # e_k(x) = phi(x)^T v_k / sqrt(rho_k)
    np.testing.assert_allclose(rep.utilization, pad_curve(cumulative_curve(E, F), p), rtol=0, atol=1e-10)
    np.testing.assert_allclose(rep.quality, pad_curve(cumulative_curve(E, one_hot(y, K)), p), rtol=0,
                               atol=1e-10)
    assert_monotone(rep.utilization)
    assert_monotone(rep.quality)
    # DLR does not depend on the spectrum option; the centered spectrum differs (X has a mean)
    rc = m.compute()
    assert rep.dlr == rc.dlr
    assert abs(rc.eigenvalues[0] - rep.eigenvalues[0]) > 1e-3 * rep.eigenvalues[0]


# -- NC1 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("K,p,sizes", [(3, 5, None), (5, 8, [40, 10, 25, 60, 5]), (6, 4, None)])
def test_nc1_against_direct_computation(K, p, sizes):
    rng = np.random.default_rng(34 + K)
    X, y = labelled_data(rng, 240, p, K, spread=0.7, sizes=sizes)
    m = richness.Moments()
    for idx in np.array_split(np.arange(len(y)), 3):
        m.update(X[idx], labels=y[idx])
    got = m.compute().nc1
    want = nc1_naive(X, y)
    assert want > 0
    assert abs(got - want) < 1e-10 * want


@pytest.mark.parametrize("dtype,rel", [(np.float64, 1e-8), (np.float32, 5e-3)])
def test_nc1_near_collapse(dtype, rel):
    # docs/MATH.md, "NC1": within-class spread 1e-2 of the between-class spread; fp32 products give
    # NC1 to about 1e-3 relative (Sigma_W by subtraction cancels).
    rng = np.random.default_rng(35)
    K, p = 4, 6
    means = rng.normal(size=(K, p)) * 3
    y = rng.integers(0, K, size=800)
    X = (means[y] + 3e-2 * rng.normal(size=(800, p)) + 5.0).astype(dtype)
    m = richness.Moments()
    m.update(X, labels=y)
    got = m.compute().nc1
    want = nc1_naive(X, y)
    assert 0 < want < 1e-3
    assert abs(got - want) < rel * want


def test_nc1_perfect_collapse_is_zero_and_single_class_is_none():
    rng = np.random.default_rng(36)
    means = rng.normal(size=(3, 5))
    y = np.repeat(np.arange(3), 20)
    m = richness.Moments()
    m.update(means[y], labels=y)
    assert abs(m.compute().nc1 - nc1_naive(means[y], y)) < 1e-10
    assert m.compute().nc1 < 1e-10
    m1 = richness.Moments()
    m1.update(rng.normal(size=(30, 5)), labels=np.zeros(30, dtype=np.int64))
    assert m1.compute().nc1 is None  # NC1 needs two classes


# -- Report ----------------------------------------------------------------------------------------

def test_report_to_dict_is_json_ready():
    rng = np.random.default_rng(37)
    X, y = labelled_data(rng, 100, 4, 3)
    m = richness.Moments()
    m.update(X, X @ rng.normal(size=(4, 2)), labels=y)
    rep = m.compute(test=m)
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["dlr"] == rep.dlr and d["rank"] == rep.rank and d["n"] == 100
    np.testing.assert_array_equal(np.array(d["eigenvalues"]), rep.eigenvalues)
    np.testing.assert_array_equal(np.array(d["quality"]), rep.quality)
    assert "DLR" in str(rep)


def test_nc1_float32_large_mean():
    # Class sums are raw float64 sums; a large common mean must not spoil NC1.
    rng = np.random.default_rng(38)
    K, p = 4, 6
    means = rng.normal(size=(K, p))
    y = rng.integers(0, K, size=1200)
    X32 = (1e4 + means[y] + 0.3 * rng.normal(size=(1200, p))).astype(np.float32)
    m = richness.Moments()
    m.update(X32, labels=y)
    got = m.compute().nc1
    want = nc1_naive(X32, y)
    assert abs(got - want) < 1e-4 * want


def test_quality_prefers_float_targets_over_labels():
    # docs/MATH.md, "Projections and curves": quality uses the task; with both streamed, the float targets are the task.
    rng = np.random.default_rng(39)
    X, y = labelled_data(rng, 200, 5, 3)
    T = np.cos(X[:, :2])
    m = richness.Moments()
    m.update(X, labels=y, targets=T)
    rep = m.compute()
    np.testing.assert_allclose(rep.quality, training_curve(X, T), rtol=0, atol=1e-12)
    assert abs(rep.nc1 - nc1_naive(X, y)) < 1e-10 * rep.nc1


def test_curves_with_more_outputs_than_features():
    # C > p: the head path that works in p-space (docs/MATH.md, "Many outputs").
    rng = np.random.default_rng(40)
    p, C = 6, 40
    X = rng.normal(size=(300, p)) * np.geomspace(3, 0.3, p) + 1.0
    Xt = rng.normal(size=(200, p)) * 1.5
    W, b = rng.normal(size=(C, p)), rng.normal(size=C)
    train, test = richness.Moments(), richness.Moments()
    train.update(X)
    test.update(Xt)
    rep = train.compute(head_weights=(W, b), test=test)
    np.testing.assert_allclose(rep.utilization, training_curve(X, X @ W.T + b), rtol=0, atol=1e-12)
    want, _ = heldout_reference(X, Xt, Xt @ W.T + b)
    np.testing.assert_allclose(rep.test_utilization, want, rtol=1e-10)
    assert abs(rep.utilization[-1] - 1.0) < 1e-12
    Fc = X @ W.T - (X @ W.T).mean(axis=0)
    top = np.sort(np.linalg.eigvalsh(Fc.T @ Fc))[::-1][:p]
    np.testing.assert_allclose(rep.logit_eigenvalues[:p], top, rtol=1e-9)
