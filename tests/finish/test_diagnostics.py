"""RankMe, alpha-ReQ, the participation ratio, NC2 and NC3 (docs/MATH.md, representation
diagnostics) against float64 oracles from the raw arrays (reference.py: SVDs of the centered
matrix, loops over classes), on known cases, over batch splits, merges, float32 inputs, a torch
state, the jackknife and the edges."""

import warnings

import numpy as np
import pytest
import richness
from reference import (
    alpha_req_naive,
    center_rows,
    nc2_naive,
    nc3_naive,
    participation_ratio_naive,
    rankme_naive,
    simplex_etf,
)
from richness import finish as fin
from richness.finish import diagnostics as dg

NAMES = ("rankme", "alpha_req", "participation_ratio", "nc2_equinorm", "nc2_equiangle", "nc3")


def class_clusters(rng, n=900, p=12, K=5):
    """Features clustered around K class means with an anisotropic spread, their labels and a head W (K, p)."""
    means = rng.normal(size=(K, p)) * 1.5
    y = rng.integers(0, K, size=n)
    mix = np.diag(np.linspace(2.0, 0.2, p)) @ (np.eye(p) + 0.3 * rng.normal(size=(p, p)))
    X = means[y] + rng.normal(size=(n, p)) @ mix + 2.0
    W = rng.normal(size=(K, p))
    return X, y, W


def oracle(X, y, W, rtol=1e-10):
    equinorm, equiangle = nc2_naive(X, y)
    return {"rankme": rankme_naive(X), "alpha_req": alpha_req_naive(X, rtol)[0],
            "participation_ratio": participation_ratio_naive(X), "nc2_equinorm": equinorm,
            "nc2_equiangle": equiangle, "nc3": nc3_naive(X, y, W)}


def check(rep, want, rtol):
    for name in NAMES:
        np.testing.assert_allclose(getattr(rep, name), want[name], rtol=rtol, err_msg=name)


@pytest.mark.parametrize("splits", [1, 7])
def test_fields_match_oracle_over_batch_splits(splits):
    rng = np.random.default_rng(0)
    X, y, W = class_clusters(rng)
    m = richness.Moments()
    for idx in np.array_split(np.arange(len(y)), splits):
        m.update(X[idx], labels=y[idx])
    rep = m.compute(head_weights=W)
    check(rep, oracle(X, y, W), 1e-9)
    assert rep.alpha_req_range == (11, X.shape[1])  # the reference range k = 11..100, clipped to p
    d = rep.to_dict()
    assert all(d[name] == getattr(rep, name) for name in NAMES)
    assert d["alpha_req_range"] == [11, X.shape[1]]
    assert "RankMe" in str(rep) and "NC3" in str(rep)


def test_merge_and_float32_inputs():
    rng = np.random.default_rng(1)
    X, y, W = class_clusters(rng)
    a, b = richness.Moments(), richness.Moments()
    a.update(X[:400], labels=y[:400])
    b.update(X[400:], labels=y[400:])
    a.merge(b)
    check(a.compute(head_weights=W), oracle(X, y, W), 1e-9)
    X32 = X.astype(np.float32)
    m = richness.Moments()
    m.update(X32, labels=y)
    rep = m.compute(head_weights=W)
    assert rep.precision == "fp32"
    check(rep, oracle(X32.astype(np.float64), y, W, rtol=rep.rtol), 2e-4)


def test_spectrum_false_only_when_asked():
    rng = np.random.default_rng(2)
    X, y, W = class_clusters(rng)
    m = richness.Moments()
    m.update(X, labels=y)
    full = m.compute(head_weights=W)
    quick = m.compute(head_weights=W, spectrum=False)
    assert all(getattr(quick, name) is None for name in NAMES)
    asked = m.compute(head_weights=W, spectrum=False, measures=("rankme", "nc3"))
    assert asked.rankme == pytest.approx(full.rankme, rel=1e-12)
    assert asked.nc3 == pytest.approx(full.nc3, rel=1e-12)
    assert asked.alpha_req is None and asked.nc2_equinorm is None
    every = m.compute(head_weights=W, spectrum=False, measures="all")
    for name in NAMES:
        assert getattr(every, name) == pytest.approx(getattr(full, name), rel=1e-10)
    with pytest.raises(ValueError, match="unknown measures"):
        m.compute(measures=("rankme", "rank_me"))


def test_rankme_is_uncentered_whatever_centered_says():
    rng = np.random.default_rng(3)
    X, y, _ = class_clusters(rng)
    m = richness.Moments()
    m.update(X)
    for centered in (True, False):
        rep = m.compute(centered=centered)
        assert rep.rankme == pytest.approx(rankme_naive(X), rel=1e-9)
        assert rep.alpha_req == pytest.approx(alpha_req_naive(X)[0], rel=1e-9)  # centered, as published
    assert rep.nc2_equinorm is None and rep.nc3 is None  # no labels


def test_torch_state_matches_numpy():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    X, y, W = class_clusters(rng)
    m = richness.Moments()
    m.update(X, labels=y)
    st = m.state_dict()
    tst = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in st.items()}
    a = fin.finish(st, W=W)
    b = fin.finish(tst, W=torch.from_numpy(W))
    for name in NAMES:
        assert getattr(b, name) == pytest.approx(getattr(a, name), rel=1e-10)


# -- known cases -------------------------------------------------------------------

def orthonormal_centered(rng, n, r):
    """n x r orthonormal columns orthogonal to the ones vector (centered already)."""
    Q, _ = np.linalg.qr(center_rows(rng.normal(size=(n, r))))
    return Q


def test_isotropic_features_give_rankme_near_p():
    rng = np.random.default_rng(5)
    p = 16
    m = richness.Moments()
    m.update(rng.normal(size=(200_000, p)))
    rep = m.compute(measure_options={"alpha_req_range": (1, None)})
    assert p * 0.995 < rep.rankme <= p * (1 + 1e-5)
    assert p * 0.99 < rep.participation_ratio <= p
    assert abs(rep.alpha_req) < 0.02


def test_exact_rank_equal_singular_values():
    rng = np.random.default_rng(6)
    n, p, r = 500, 20, 7
    Q = orthonormal_centered(rng, n, r)
    V, _ = np.linalg.qr(rng.normal(size=(p, r)))
    X = 3.0 * Q @ V.T  # singular values all 3 (centered, mean 0), rank r
    m = richness.Moments()
    m.update(X)
    rep = m.compute(measure_options={"alpha_req_range": (1, None)})
    # the p - r zero singular values add eps = 1e-7 each: p_k = 1/r + eps, r times, and eps, p - r times
    q = np.r_[np.full(r, 1.0 / r), np.zeros(p - r)] + 1e-7
    assert rep.rankme == pytest.approx(np.exp(-np.sum(q * np.log(q))), rel=1e-6)
    assert rep.rankme == pytest.approx(r, rel=1e-4)
    assert rep.participation_ratio == pytest.approx(r, rel=1e-9)
    assert rep.alpha_req == pytest.approx(0.0, abs=1e-6)
    assert rep.alpha_req_range == (1, r)
    assert m.compute().alpha_req is None  # the reference range starts at k = 11


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0])
def test_power_law_gives_its_exponent(alpha):
    rng = np.random.default_rng(7)
    n, p = 400, 32
    lam = np.arange(1, p + 1, dtype=np.float64) ** -alpha
    X = orthonormal_centered(rng, n, p) * np.sqrt(lam) @ np.linalg.qr(rng.normal(size=(p, p)))[0]
    m = richness.Moments()
    m.update(X)
    rep = m.compute()
    assert rep.alpha_req == pytest.approx(alpha, rel=1e-8)
    s = np.sqrt(lam)  # mean 0: the uncentered singular values are these
    q = s / s.sum() + 1e-7
    assert rep.rankme == pytest.approx(np.exp(-np.sum(q * np.log(q))), rel=1e-8)


def test_simplex_etf_gives_nc2_zero_and_head_equal_means_nc3_zero():
    rng = np.random.default_rng(8)
    K, p, per = 6, 10, 40
    means = simplex_etf(K, p, rng, scale=4.0)
    y = np.repeat(np.arange(K), per)
    X = means[y] + 1.0  # collapsed onto the ETF, balanced classes
    m = richness.Moments()
    m.update(X, labels=y)
    rep = m.compute(head_weights=2.5 * means)  # any positive multiple of the class means
    assert rep.nc2_equinorm == pytest.approx(0.0, abs=1e-12)
    assert rep.nc2_equiangle == pytest.approx(0.0, abs=1e-12)
    assert rep.nc3 == pytest.approx(0.0, abs=1e-12)
    # unbalanced classes on a non-ETF: both nonzero and still the oracle's
    X2, y2, W2 = class_clusters(rng)
    m2 = richness.Moments()
    m2.update(X2, labels=y2)
    r2 = m2.compute(head_weights=W2)
    assert r2.nc2_equiangle > 0.01 and r2.nc3 > 0.1


def test_jackknife_standard_errors_match_leave_one_group_out_oracle():
    rng = np.random.default_rng(9)
    X, y, W = class_clusters(rng, n=800)
    k = 4
    m = richness.Moments(groups=k)
    chunks = np.array_split(np.arange(len(y)), 8)
    for idx in chunks:  # updates go to the groups in turn
        m.update(X[idx], X[idx] @ W.T, labels=y[idx])
    rep = m.compute(head_weights=W, uncertainty=True)
    groups = [np.concatenate([chunks[i] for i in range(len(chunks)) if i % k == g]) for g in range(k)]
    for name in NAMES:
        theta = []
        for g in range(k):
            keep = np.concatenate([groups[j] for j in range(k) if j != g])
            theta.append(oracle(X[keep], y[keep], W)[name])
        theta = np.array(theta)
        se = np.sqrt((k - 1) / k * np.sum((theta - theta.mean()) ** 2))
        assert rep.measures_stderr[name] == pytest.approx(se, rel=1e-6), name


def test_features_only_jackknife_without_outputs():
    rng = np.random.default_rng(10)
    X, _, _ = class_clusters(rng)
    m = richness.Moments(groups=3)
    for idx in np.array_split(np.arange(len(X)), 6):
        m.update(X[idx])
    rep = m.compute(uncertainty=True)
    assert rep.dlr is None and rep.dlr_stderr is None
    assert set(rep.measures_stderr) == {"rankme", "alpha_req", "participation_ratio"}


# -- edges -------------------------------------------------------------------------

def test_all_zero_spectrum_is_none_with_warning():
    out, warns = dg.spectral_report(np.zeros(5), 1e-10)
    assert out["rankme"] is None and out["alpha_req"] is None and out["participation_ratio"] is None
    assert warns and "all zero" in warns[0]
    lam = np.array([[0.0, 0.0], [2.0, 1.0]])
    stacked = dg.spectral_values(lam, 1e-10, lam_u=lam)
    assert np.isnan(stacked["rankme"][0]) and np.isfinite(stacked["rankme"][1])
    m = richness.Moments()
    m.update(np.ones((10, 3)))
    with pytest.raises(ValueError, match="constant"):  # the whole report: features must vary
        m.compute()


def test_one_eigenvalue_leaves_alpha_undefined():
    rng = np.random.default_rng(11)
    X = np.outer(rng.normal(size=50), rng.normal(size=4))
    m = richness.Moments()
    m.update(X)
    rep = m.compute()
    assert rep.alpha_req is None and rep.alpha_req_range is None
    assert rep.rankme == pytest.approx(rankme_naive(X), rel=1e-6)
    assert rep.rankme == pytest.approx(1.0, rel=1e-5)
    assert any("alpha-ReQ undefined" in w for w in rep.warnings)


def test_one_class_gives_none_with_warning():
    rng = np.random.default_rng(12)
    X = rng.normal(size=(100, 5))
    m = richness.Moments()
    m.update(X, labels=np.full(100, 2))
    rep = m.compute(head_weights=rng.normal(size=(3, 5)))
    assert rep.nc2_equinorm is None and rep.nc2_equiangle is None and rep.nc3 is None
    assert any("1 class" in w for w in rep.warnings)
    m1 = richness.Moments(num_classes=1)
    m1.update(X, labels=np.zeros(100, dtype=np.int64))
    assert m1.compute().nc2_equinorm is None


def test_head_width_and_rows():
    rng = np.random.default_rng(13)
    X, y, W = class_clusters(rng)
    m = richness.Moments()
    m.update(X, labels=y)
    with pytest.raises(ValueError, match="input columns"):
        m.compute(head_weights=rng.normal(size=(5, X.shape[1] + 1)))
    rep = m.compute(head_weights=W[:3])  # fewer rows than classes: NC3 undefined, DLR still there
    assert rep.nc3 is None and rep.dlr is not None
    assert any("NC3 not reported" in w for w in rep.warnings)


def test_measures_argument_checked():
    with pytest.raises(ValueError, match="unknown measures"):
        dg.check_measures(["rankme", "nc4"])
    with pytest.raises(TypeError):
        dg.check_measures(3)
    assert dg.check_measures("all") == dg.MEASURES
    assert dg.check_measures("nc3") == ("nc3",)


def test_no_warning_noise_for_defined_values():
    rng = np.random.default_rng(14)
    X, y, W = class_clusters(rng)
    m = richness.Moments()
    m.update(X, labels=y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rep = m.compute(head_weights=W)
    assert not [w for w in rep.warnings if "undefined" in w or "not reported" in w]
