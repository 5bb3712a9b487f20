"""The representation diagnostics as published, against independent float64 implementations of
the published formulas (reference.py) on features with a NONZERO mean: RankMe of the embeddings
as given (Garrido et al. 2023, eq. 1), alpha-ReQ as the authors' code fits it (reptrix: k = 11..100,
weights 1/k) with its R^2, NC1-NC3 of Papyan et al. and, as an option, as the widely copied
measurement script computes them; the effective dimension, the participation ratio and CKA with
a nonzero mean. Moments with float64 and float32 inputs and merged states (the Monitor, torchmetrics
and CLI routes are in test_diagnostics_routes.py, on the same oracles)."""

import warnings

import numpy as np
import pytest
import richness
from reference import (
    alpha_req_naive,
    cka_debiased_naive,
    cka_naive,
    effective_dim_naive,
    nc1_naive,
    nc2_naive,
    nc3_naive,
    nc_script_naive,
    participation_ratio_naive,
    rankme_centered_naive,
    rankme_naive,
    reptrix_powerlaw,
    spectrum_naive,
)


def power_law(rng, n, p, alpha, mean=3.0):
    """n x p features with covariance eigenvalues ~ k^-alpha in a random basis, plus noise, and a
    nonzero mean (a common offset and a per-feature one)."""
    lam = np.arange(1, p + 1, dtype=np.float64) ** -alpha
    Q, _ = np.linalg.qr(rng.normal(size=(p, p)))
    X = (rng.normal(size=(n, p)) * np.sqrt(lam)) @ Q.T
    return X + mean + rng.normal(size=p) * mean / 3


def moments_of(X, chunks=3, **kw):
    m = richness.Moments(**kw)
    for idx in np.array_split(np.arange(len(X)), chunks):
        m.update(X[idx])
    return m


# -- RankMe -------------------------------------------------------------------------------

def test_rankme_is_the_published_uncentered_value_on_every_input():
    rng = np.random.default_rng(0)
    X = power_law(rng, 3000, 40, 1.0)
    want = rankme_naive(X)
    assert abs(want - rankme_centered_naive(X)) > 1.0  # the centered value is another quantity
    rep = moments_of(X).compute()
    assert rep.rankme == pytest.approx(want, rel=1e-10)
    a, b = moments_of(X[:1000]), moments_of(X[1000:])
    a.merge(b)
    assert a.compute().rankme == pytest.approx(want, rel=1e-10)
    assert a.compute(spectrum=False, measures="rankme").rankme == pytest.approx(want, rel=1e-10)
    X32 = X.astype(np.float32)
    rep32 = moments_of(X32).compute()
    assert rep32.precision == "fp32"
    # fp32 products of float32 inputs: the last digits move (docs/MATH.md, representation diagnostics)
    assert rep32.rankme == pytest.approx(rankme_naive(X32.astype(np.float64)), rel=1e-6)


def test_rankme_counts_min_n_p_singular_values_with_eps():
    rng = np.random.default_rng(1)
    X = power_law(rng, 30, 50, 0.5)  # n < p: 30 singular values, each p_k gets eps
    rep = moments_of(X).compute()
    assert rep.rankme == pytest.approx(rankme_naive(X), rel=1e-9)
    Z = np.zeros((10, 4))
    Z[:, 0] = rng.normal(size=10)  # one nonzero singular value: p = (1 + eps, eps, eps, eps)
    q = np.array([1.0, 0.0, 0.0, 0.0]) + 1e-7
    m = richness.Moments()
    m.update(Z)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = m.compute(spectrum=False, measures="rankme").rankme
    assert got == pytest.approx(np.exp(-np.sum(q * np.log(q))), rel=1e-7)


# -- alpha-ReQ ----------------------------------------------------------------------------

def test_alpha_req_is_the_reference_fit_with_its_r2():
    rng = np.random.default_rng(2)
    X = power_law(rng, 4000, 150, 1.3)
    rep = moments_of(X).compute()
    alpha, r2, count = alpha_req_naive(X)
    assert count == 90 and rep.alpha_req_range == (11, 100)
    assert rep.alpha_req == pytest.approx(alpha, rel=1e-9)
    assert rep.alpha_req_r2 == pytest.approx(r2, rel=1e-9)
    assert 0.5 < r2 < 1.0
    # the options: the range and the weights, one place (compute(measure_options=...))
    opts = {"alpha_req_range": (1, None), "alpha_req_weights": "uniform"}
    wide = moments_of(X).compute(measure_options=opts)
    a2, r22, c2 = alpha_req_naive(X, first=1, last=None, weighted=False)
    assert wide.alpha_req == pytest.approx(a2, rel=1e-9) and wide.alpha_req_r2 == pytest.approx(r22, rel=1e-9)
    assert wide.alpha_req_range == (1, 150) and c2 == 150
    assert abs(wide.alpha_req - rep.alpha_req) > 1e-3
    # the jackknife takes the same options
    g = richness.Moments(groups=3)
    for idx in np.array_split(np.arange(len(X)), 6):
        g.update(X[idx])
    assert g.compute(uncertainty=True, measure_options=opts).alpha_req == pytest.approx(a2, rel=1e-9)


def test_alpha_req_matches_reptrix_code():
    """reference.reptrix_powerlaw is reptrix.alpha.get_powerlaw written out; the real one below."""
    rng = np.random.default_rng(3)
    X = power_law(rng, 2000, 160, 0.9)
    s = np.linalg.svd(X - X.mean(0), compute_uv=False)
    eigen = s**2 / np.sum(s**2)  # what reptrix's PCA gives: explained_variance_ratio_
    alpha, ypred, _ = reptrix_powerlaw(eigen)
    rep = moments_of(X).compute()
    assert rep.alpha_req == pytest.approx(alpha, rel=1e-6)
    y, yp = np.log(eigen[10:100]), np.log(ypred[10:100])
    assert rep.alpha_req_r2 == pytest.approx(1 - np.sum((y - yp) ** 2) / np.sum((y - y.mean()) ** 2), rel=1e-6)


def test_alpha_req_matches_installed_reptrix():
    reptrix_alpha = pytest.importorskip("reptrix.alpha")  # imports torch and sklearn, not torchvision
    from reptrix import utils as reptrix_utils
    from sklearn.metrics import r2_score

    rng = np.random.default_rng(4)
    X = power_law(rng, 2000, 160, 0.9)
    eigen = reptrix_utils.get_eigenspectrum(X, max_eigenvals=2048)
    alpha, ypred, _, r2_100 = reptrix_alpha.get_powerlaw(eigen, np.arange(10, 100))
    rep = moments_of(X).compute()
    assert rep.alpha_req == pytest.approx(alpha, rel=1e-6)
    # reptrix's R^2 definition (r2_score of log lambda against log ypred) over the fit's own k
    assert rep.alpha_req_r2 == pytest.approx(r2_score(np.log(eigen[10:100]), np.log(ypred[10:100])), rel=1e-6)
    # its own fit_R2_100 starts one later (its trange += 1): the oracle written from its code agrees
    mine = reptrix_powerlaw(eigen)
    assert mine[0] == pytest.approx(alpha, rel=1e-9) and mine[2] == pytest.approx(r2_100, rel=1e-9)


def test_alpha_req_keeps_real_eigenvalues_below_the_fp32_rank_cut():
    rng = np.random.default_rng(5)
    X = power_law(rng, 20000, 120, 3.0, mean=1.0)  # lambda_100 ~ 1e-6 lambda_1: below fp32's cut of 1e-5
    r64 = moments_of(X).compute()
    r32 = moments_of(X.astype(np.float32), chunks=10).compute()
    assert r32.precision == "fp32" and r32.feature_rank < 100
    assert r32.alpha_req_range == r64.alpha_req_range == (11, 100)
    assert r32.alpha_req == pytest.approx(r64.alpha_req, rel=1e-4)
    assert r64.alpha_req == pytest.approx(alpha_req_naive(X)[0], rel=1e-8)


def test_alpha_req_with_few_eigenvalues_warns_or_is_none():
    rng = np.random.default_rng(6)
    rep = moments_of(power_law(rng, 500, 25, 1.0)).compute()
    assert rep.alpha_req_range == (11, 25)
    assert any("fitted on 15 eigenvalues" in w and "fewer than 20" in w for w in rep.warnings)
    rep = moments_of(power_law(rng, 500, 8, 1.0)).compute()
    assert rep.alpha_req is None and rep.alpha_req_r2 is None and rep.alpha_req_range is None
    assert any("alpha-ReQ undefined: 0 eigenvalue(s) in its range k = 11..100" in w for w in rep.warnings)


def test_measure_options_checked():
    m = moments_of(np.random.default_rng(7).normal(size=(50, 4)))
    for bad, match in (({"alpha_req_range": (0, 10)}, "alpha_req_range"), ({"alpha_req_range": (5, 5)}, "alpha_req"),
                       ({"alpha_req_weights": "1/k^2"}, "alpha_req_weights"), ({"nc_convention": "x"}, "nc_conv"),
                       ({"alpha": 1}, "unknown measure_options")):
        with pytest.raises(ValueError, match=match):
            m.compute(measure_options=bad)
    with pytest.raises(TypeError, match="measure_options"):
        m.compute(measure_options=[("nc_convention", "paper")])


# -- neural collapse ------------------------------------------------------------------------

def unequal_classes(rng, n=1200, p=16, C=5):
    means = rng.normal(size=(C, p)) * 2.0
    y = rng.choice(C, size=n, p=[0.4, 0.3, 0.15, 0.1, 0.05])
    X = means[y] + rng.normal(size=(n, p)) @ np.diag(np.linspace(1.5, 0.3, p)) + 4.0
    return X, y, rng.normal(size=(C, p))


def test_nc_paper_and_script_conventions():
    rng = np.random.default_rng(8)
    X, y, W = unequal_classes(rng)
    m = richness.Moments(5)
    for idx in np.array_split(np.arange(len(y)), 4):
        m.update(X[idx], labels=y[idx])
    paper = m.compute(head_weights=W)
    equinorm, equiangle = nc2_naive(X, y)
    assert paper.nc1 == pytest.approx(nc1_naive(X, y), rel=1e-9)
    assert paper.nc2_equinorm == pytest.approx(equinorm, rel=1e-10)
    assert paper.nc2_equiangle == pytest.approx(equiangle, rel=1e-10)
    assert paper.nc3 == pytest.approx(nc3_naive(X, y, W), rel=1e-10)
    script = m.compute(head_weights=W, measure_options={"nc_convention": "papyan_script"})
    want = nc_script_naive(X, y, W)
    for name in ("nc1", "nc2_equinorm", "nc2_equiangle", "nc3"):
        assert getattr(script, name) == pytest.approx(want[name], rel=1e-8), name
        assert abs(getattr(script, name) - getattr(paper, name)) > 1e-3 * abs(want[name]), name
    assert script.dlr == paper.dlr and script.rankme == paper.rankme  # nothing else moves


def test_nc_asked_without_head_or_labels_warns():
    rng = np.random.default_rng(9)
    X, y, _ = unequal_classes(rng)
    m = richness.Moments(5)
    m.update(X, labels=y)
    rep = m.compute(measures=["nc3"])
    assert rep.nc3 is None and any("NC3 not reported" in w and "head" in w for w in rep.warnings)
    assert not any("NC3" in w for w in m.compute().warnings)  # not asked: the default set stays quiet
    bare = moments_of(X)
    rep = bare.compute(measures=["nc2_equinorm", "nc3"])
    assert any("nc2_equinorm, nc3 not reported: they need labels" in w for w in rep.warnings)


# -- the other published names, with a nonzero mean -------------------------------------------

def test_effective_dim_participation_ratio_and_cka_with_a_nonzero_mean():
    rng = np.random.default_rng(10)
    X = power_law(rng, 2000, 30, 1.0, mean=5.0)
    rep = moments_of(X).compute()
    assert rep.effective_dim == pytest.approx(effective_dim_naive(spectrum_naive(X)[0]), rel=1e-10)
    assert rep.participation_ratio == pytest.approx(participation_ratio_naive(X), rel=1e-10)
    Y = np.tanh(X @ rng.normal(size=(30, 12)) * 0.2) + 7.0
    assert richness.cka(X, Y) == pytest.approx(cka_naive(X, Y), rel=1e-10)
    assert richness.cka(X, Y, debiased=True) == pytest.approx(cka_debiased_naive(X, Y), rel=1e-9)
