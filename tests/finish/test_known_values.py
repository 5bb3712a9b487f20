"""Known values of DLR (docs/MATH.md, "Known values"): neural collapse,
isotropic features, duplicated logits, the large-mean float32 case and more,
each against the independent float64 n x n reference."""

import numpy as np
import pytest
import torch

import richness
from reference import dlr_naive, dlr_thin, simplex_etf


def correlated_features(rng, n, p, mean=3.0):
    return rng.normal(size=(n, p)) @ rng.normal(size=(p, p)) + mean


# -- random features with a linear head ----------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 1e-6)])
def test_random_linear_head_three_ways(dtype, tol):
    rng = np.random.default_rng(11)
    n, p, C = 360, 18, 6
    X = correlated_features(rng, n, p).astype(dtype)
    W, b = rng.normal(size=(C, p)), rng.normal(size=C)
    F = (X.astype(np.float64) @ W.T + b).astype(dtype)
    want, r = dlr_naive(X, F)  # reference on exactly the values the package sees
    assert r == C

    streamed = richness.Moments()
    features_only = richness.Moments()
    for chunk in np.array_split(np.arange(n), 5):
        streamed.update(X[chunk], F[chunk])
        features_only.update(X[chunk])
    rep = streamed.compute()
    assert rep.rank == C
    assert abs(rep.dlr - want) < tol

    # head_weights=(W, b): only M is streamed; the reference uses the exact linear outputs.
    want_head, _ = dlr_naive(X, X.astype(np.float64) @ W.T + b)
    assert abs(features_only.compute(head_weights=(W, b)).dlr - want_head) < tol
    assert abs(features_only.compute(head_weights=W).dlr - want_head) < tol

    lin = torch.nn.Linear(p, C).double()
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(W))
        lin.bias.copy_(torch.from_numpy(b))
    rep_lin = features_only.compute(head_weights=lin)
    assert rep_lin.rank == C
    assert abs(rep_lin.dlr - want_head) < tol
    # the one-shot function agrees
    assert abs(richness.dlr(X, F) - want) < tol
    assert abs(richness.dlr(X, head_weights=lin) - want_head) < tol


def test_float32_linear_module_head():
    rng = np.random.default_rng(12)
    X = correlated_features(rng, 200, 10)
    lin = torch.nn.Linear(10, 4)  # float32 parameters, used in float64 for finishing
    W = lin.weight.detach().double().numpy()
    want, _ = dlr_naive(X, X @ W.T)
    m = richness.Moments()
    m.update(X)
    assert abs(m.compute(head_weights=lin).dlr - want) < 1e-12


# -- neural collapse -------------------------------------------------------------------

@pytest.mark.parametrize("K,p,per_class", [(4, 6, 50), (10, 16, 20), (3, 3, 7)])
def test_perfect_neural_collapse_balanced_is_zero(K, p, per_class):
    rng = np.random.default_rng(K)
    means = simplex_etf(K, p, rng, scale=5.0)
    y = np.repeat(np.arange(K), per_class)
    X = means[y] + 2.0  # no within-class spread; an offset is allowed
    W = rng.normal(size=(K, K)) @ means  # head in the span of the class means
    F = X @ W.T + rng.normal(size=K)
    m = richness.Moments()
    m.update(X, F, labels=y)
    rep = m.compute()
    assert rep.rank == K - 1
    assert 0.0 <= rep.dlr < 1e-12
    assert m.compute(head_weights=(W, None)).dlr < 1e-12
    ref, _ = dlr_naive(X, F)
    assert abs(ref) < 1e-12


def test_neural_collapse_unbalanced_known_value():
    rng = np.random.default_rng(5)
    K, p = 4, 8
    means = simplex_etf(K, p, rng)
    y = np.repeat(np.arange(K), [300, 100, 50, 50])
    X = means[y]
    W = rng.normal(size=(K, K)) @ means
    F = X @ W.T
    m = richness.Moments()
    m.update(X, F)
    got = m.compute().dlr
    ref, r = dlr_naive(X, F)
    assert r == 3
    assert abs(got - ref) < 1e-12
    assert abs(got - 0.119) < 5e-4  # docs/MATH.md, "Known values": 0.119 (three decimals)


# -- isotropic features ------------------------------------------------------------------

def test_isotropic_features_near_limit():
    # docs/MATH.md, "Known values": 1 - sqrt(C/p) = 0.75 for p = 64, C = 4; at n = 20000 the value is
    # 0.7486 +- 0.0008 (biased low by O(p/n)). A fixed seed, a 4-sigma band, and the
    # exact float64 reference on the same samples.
    rng = np.random.default_rng(2026)
    n, p, C = 20000, 64, 4
    X = rng.normal(size=(n, p))
    W = rng.normal(size=(C, p))
    m = richness.Moments()
    for chunk in np.array_split(np.arange(n), 4):
        m.update(X[chunk])
    got = m.compute(head_weights=W).dlr
    ref, r = dlr_thin(X, X @ W.T)
    assert r == C
    assert abs(got - ref) < 1e-12
    assert abs(got - 0.7486) < 4 * 0.0008
    assert abs(got - (1 - np.sqrt(C / p))) < 0.004


def test_isotropic_bias_toward_rich_at_small_n():
    # docs/MATH.md, "Finite-sample bias and the isotropic reference": p = 512, C = 10 gives 0.686 at n = 128, 0.844 at
    # n = 2048, limit 1 - sqrt(10/512) = 0.860. those are single draws; the bands
    # are a few times the seed-to-seed spread at these sizes.
    p, C = 512, 10
    vals = []
    for n, spec, band in ((128, 0.686, 0.02), (2048, 0.844, 0.005)):
        rng = np.random.default_rng(n)
        X = rng.normal(size=(n, p))
        W = rng.normal(size=(C, p))
        m = richness.Moments()
        m.update(X)
        rep = m.compute(head_weights=W)
        ref, _ = dlr_thin(X, X @ W.T)
        assert abs(rep.dlr - ref) < 1e-12
        assert abs(rep.dlr - spec) < band
        assert any("biased toward rich" in w for w in rep.warnings)  # n < 10 p
        vals.append(rep.dlr)
    assert vals[0] < vals[1] < 1 - np.sqrt(C / p)


# -- centering precision ---------------------------------------------------------------------

def test_float32_large_mean_small_spread():
    rng = np.random.default_rng(3)
    n, p, C = 3000, 8, 3
    X32 = (1e4 + 1e-2 * (rng.normal(size=(n, p)) @ rng.normal(size=(p, p)))).astype(np.float32)
    X = X32.astype(np.float64)  # the values the package sees, exactly
    assert np.ptp(X, axis=0).min() > 0  # the spread survives float32 storage
    W = rng.normal(size=(C, p))

    want_head, _ = dlr_thin(X, X @ W.T)
    m = richness.Moments()
    for chunk in np.array_split(np.arange(n), 3):
        m.update(X32[chunk])
    assert m.compute().precision == "fp32"
    assert abs(m.compute(head_weights=W).dlr - want_head) < 1e-6

    # streamed float32 outputs whose mean is large too
    F32 = (X @ W.T).astype(np.float32)
    want, r = dlr_thin(X, F32)
    assert r == C
    ms = richness.Moments()
    for chunk in np.array_split(np.arange(n), 3):
        ms.update(X32[chunk], F32[chunk])
    assert abs(ms.compute().dlr - want) < 1e-6
    # the state's mean and covariance are float64-accurate
    st = m.state_dict()
    Xc = X - X.mean(axis=0)
    np.testing.assert_allclose(st["mean"], X.mean(axis=0), rtol=1e-15, atol=0)
    assert np.abs(st["M"] - Xc.T @ Xc).max() < 1e-5 * np.abs(Xc.T @ Xc).max()

    # The case is sensitive: raw float32 sums (E[xx^T] - E[x]E[x]^T) lose it entirely.
    S = (X32.T @ X32) / np.float32(n) - np.outer(X32.mean(0), X32.mean(0)).astype(np.float32)
    naive_err = np.abs(S.astype(np.float64) * n - Xc.T @ Xc).max() / np.abs(Xc.T @ Xc).max()
    assert naive_err > 1.0


# -- duplicated logits --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_duplicated_logits_rank(dtype):
    rng = np.random.default_rng(4)
    n, p, C = 500, 12, 5
    X = correlated_features(rng, n, p).astype(dtype)
    W = rng.normal(size=(C, p))
    W[3] = W[1]  # a duplicated logit
    F = (X.astype(np.float64) @ W.T).astype(dtype)
    assert np.array_equal(F[:, 3], F[:, 1])
    m = richness.Moments()
    for chunk in np.array_split(np.arange(n), 4):
        m.update(X[chunk], F[chunk])
    rep = m.compute()
    assert rep.rank == C - 1
    ref, r = dlr_naive(X, np.delete(F, 3, axis=1))
    assert r == C - 1
    tol = 1e-12 if dtype == np.float64 else 1e-6
    assert abs(rep.dlr - ref) < tol
    # head mode with a duplicated row
    mh = richness.Moments()
    mh.update(X)
    rep_h = mh.compute(head_weights=W)
    assert rep_h.rank == C - 1
    ref_h, _ = dlr_naive(X, X.astype(np.float64) @ np.delete(W, 3, axis=0).T)
    assert abs(rep_h.dlr - ref_h) < tol


def test_duplicated_logits_rank_float64_product_mode_from_float32():
    rng = np.random.default_rng(41)
    X = rng.normal(size=(300, 9)).astype(np.float32)
    F = X[:, :4].copy()
    F = np.concatenate([F, F[:, :2]], axis=1)  # two duplicated logits
    m = richness.Moments(precision="fp64")
    m.update(X, F)
    rep = m.compute()
    assert rep.precision == "fp64"
    assert rep.rank == 4
    ref, _ = dlr_naive(X, F[:, :4])
    assert abs(rep.dlr - ref) < 1e-12  # inputs are exact in float64, products in float64


# -- near-rich low-rank features ---------------------------------------------------------------

@pytest.mark.parametrize("noise", [0.0, 1e-4, 1e-2, 1e-1])
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 1e-6)])
def test_near_rich_low_rank_features(noise, dtype, tol):
    # Features of rank C (plus a little noise) read by a head close to their span.
    # The head is well conditioned on them: float32 products then hold DLR to 1e-6
    # (an ill-conditioned logit Gram amplifies fp32 product rounding, which is
    # the mode's intrinsic error, not the package's).
    rng = np.random.default_rng(7)
    n, p, C = 400, 24, 4
    L = np.linalg.qr(rng.normal(size=(p, C)))[0].T * 2.0  # orthonormal rows, scaled
    X = (rng.normal(size=(n, C)) @ L + noise * rng.normal(size=(n, p)) + 1.0).astype(dtype)
    W = (np.eye(C) + 0.3 * rng.normal(size=(C, C)) / np.sqrt(C)) @ L + 0.05 * rng.normal(size=(C, p))
    F = X.astype(np.float64) @ W.T
    m = richness.Moments()
    m.update(X)
    rep = m.compute(head_weights=W)
    ref, r = dlr_naive(X, F)
    assert rep.rank == r == C
    assert abs(rep.dlr - ref) < tol
    if noise <= 1e-2:
        assert rep.dlr < 0.05  # rich: the features live where the head reads
    ms = richness.Moments()
    ms.update(X, F.astype(dtype))
    ref_s, _ = dlr_naive(X, F.astype(dtype))
    assert abs(ms.compute().dlr - ref_s) < tol


def test_richer_features_give_lower_dlr():
    # DLR falls as the features concentrate on the head's span (reference values ordered too).
    rng = np.random.default_rng(8)
    n, p, C = 600, 20, 3
    Z = rng.normal(size=(n, C))
    L = rng.normal(size=(C, p))
    N = rng.normal(size=(n, p))
    W = rng.normal(size=(C, p))
    got, ref = [], []
    for noise in (1.0, 0.3, 0.1, 0.01):
        X = Z @ L + noise * N
        got.append(richness.dlr(X, head_weights=W))
        ref.append(dlr_naive(X, X @ W.T)[0])
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12)
    assert all(a > b for a, b in zip(got, got[1:]))


# -- many outputs (C > p) ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 1e-6)])
def test_more_outputs_than_features(dtype, tol):
    # The output span is the centered feature span (rank p): P projects onto it.
    rng = np.random.default_rng(13)
    n, p, C = 300, 10, 120
    X = (rng.normal(size=(n, p)) @ (np.eye(p) + 0.3 * rng.normal(size=(p, p)) / np.sqrt(p)) + 2.0).astype(dtype)
    W, b = rng.normal(size=(C, p)), rng.normal(size=C)
    F = X.astype(np.float64) @ W.T + b
    ref, r = dlr_naive(X, F)
    assert r == p
    m = richness.Moments()
    m.update(X)
    rep = m.compute(head_weights=(W, b))
    assert rep.rank == p
    assert abs(rep.dlr - ref) < tol
    ms = richness.Moments()
    ms.update(X, F.astype(dtype))
    rep_s = ms.compute()
    assert rep_s.rank == p
    assert abs(rep_s.dlr - dlr_naive(X, F.astype(dtype))[0]) < tol


# -- the rank cut -------------------------------------------------------------------------------

def test_rtol_sets_the_rank_and_matches_reference():
    rng = np.random.default_rng(14)
    n, p = 400, 8
    X = rng.normal(size=(n, p))
    F = X[:, :4] * np.array([1.0, 1.0, 1.0, 1e-4])  # last logit: variance ratio 1e-8
    m = richness.Moments()
    m.update(X, F)
    keep = m.compute()
    assert keep.rank == 4
    assert abs(keep.dlr - dlr_naive(X, F, rtol=1e-10)[0]) < 1e-12
    cut = m.compute(rtol=1e-6)
    assert cut.rank == 3 and cut.rtol == 1e-6
    ref_cut, r = dlr_naive(X, F, rtol=1e-6)
    assert r == 3 and abs(cut.dlr - ref_cut) < 1e-12
    assert abs(richness.dlr(X, F, rtol=1e-6) - ref_cut) < 1e-12
    # the kept direction carries almost no output variance but counts fully in the
    # projector (docs/MATH.md, "Rank cut": what makes DLR sensitive to the cut)
    assert abs(cut.dlr - keep.dlr) > 0.05
    ev = keep.logit_eigenvalues
    Fc = F - F.mean(axis=0)
    np.testing.assert_allclose(ev, np.sort(np.linalg.eigvalsh(Fc.T @ Fc))[::-1], rtol=1e-9)


def test_warning_when_an_eigenvalue_is_near_the_cut():
    rng = np.random.default_rng(15)
    X = rng.normal(size=(300, 6))
    F = X[:, :3] * np.array([1.0, 1.0, 3e-3])  # ratio 9e-6 against the fp64 cut 1e-10: far
    m = richness.Moments()
    m.update(X, F)
    assert not any("rank cut" in w for w in m.compute().warnings)
    near = m.compute(rtol=3e-6)  # within a decade of 9e-6
    assert near.rank == 3
    assert any("rank cut" in w for w in near.warnings)


def test_single_output():
    # One logit (a binary classifier's margin), given as a 1-D vector.
    rng = np.random.default_rng(16)
    X = correlated_features(rng, 250, 7)
    f = np.tanh(X @ rng.normal(size=7))
    m = richness.Moments()
    m.update(X, f)
    rep = m.compute()
    ref, r = dlr_naive(X, f[:, None])
    assert rep.rank == r == 1
    assert abs(rep.dlr - ref) < 1e-12
