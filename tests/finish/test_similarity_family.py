"""The similarity family from a joint co-moment sum (finish/cca.py, shape.py,
linreg.py) against references computed here from the raw n x p rows:
canonical correlations from QR bases of the centred representations and the
SVD of Qx^T Qy, SVCCA from the SVD of each centred representation, PWCCA from
the paper's weights on the orthonormal canonical variates, Procrustes from the
singular values of Xc^T Yc, the regression R^2 from lstsq; and against the
published implementations that install here (scipy's Procrustes, scikit-learn's
Ridge, repsim)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from reference import center_rows
from richness.finish.cca import CCA_MEASURES, cca_matrices
from richness.finish.linreg import linreg_matrix
from richness.finish.shape import SHAPE_MEASURES, shape_matrices

RTOL = 1e-10  # the rank cut (fp64's default)
TOL = 1e-9


# -- the state, as Similarity forms it ----------------------------------------------------------


def joint_state(reps, norm_columns=True):
    """``(M, n, widths)``: the centred co-moment sum of ``[x_1 .. x_k, a_1 .. a_k]``,
    ``a_r = ||x_r - c_r||^2`` about the first rows' mean ``c_r`` (Similarity's layout),
    or of the representations' columns alone."""
    reps = [np.asarray(x, dtype=np.float64) for x in reps]
    cols = list(reps)
    if norm_columns:
        cols += [np.sum((x - x[:16].mean(axis=0)) ** 2, axis=1, keepdims=True) for x in reps]
    Z = center_rows(np.concatenate(cols, axis=1))
    return Z.T @ Z, reps[0].shape[0], [x.shape[1] for x in reps]


def names_for(reps):
    return [f"r{i}" for i in range(len(reps))]


# -- references from the raw rows ---------------------------------------------------------------


def orth(X):
    """Orthonormal basis of the centred columns' span: QR when of full column
    rank, else the left singular vectors above a relative 1e-8."""
    Xc = center_rows(X)
    Q, R = np.linalg.qr(Xc)
    d = np.abs(np.diag(R))
    if d.min() > 1e-8 * d.max():
        return Q
    U, s, _ = np.linalg.svd(Xc, full_matrices=False)
    return U[:, s > 1e-8 * s[0]]


def rho_ref(X, Y):
    return np.linalg.svd(orth(X).T @ orth(Y), compute_uv=False)


def svcca_reduced(X, keep):
    """The centred rows on the fewest leading principal directions holding ``keep`` of the variance."""
    Xc = centred(X)
    _, s, Vt = np.linalg.svd(Xc, full_matrices=False)
    var = s**2
    m = int(np.argmax(np.cumsum(var) >= keep * var.sum() * (1 - 1e-12))) + 1
    return Xc @ Vt[:m].T


def svcca_ref(X, Y, keep=0.99):
    return float(np.mean(rho_ref(svcca_reduced(X, keep), svcca_reduced(Y, keep))))


def pwcca_side(X, Y):
    """Morcos et al.'s weighted mean with the weights of X's side: a_i = sum_j |<h_i, x_j>|,
    h_i = Qx u_i the orthonormal canonical variates, x_j the centred columns of X."""
    Qx, Qy = orth(X), orth(Y)
    U, rho, _ = np.linalg.svd(Qx.T @ Qy, full_matrices=False)
    h = Qx @ U
    a = np.abs(h.T @ center_rows(X)).sum(axis=1)
    return float(a @ rho / a.sum())


def pwcca_ref(X, Y):
    """The side with fewer neurons; X's on a tie."""
    return pwcca_side(X, Y) if X.shape[1] <= Y.shape[1] else pwcca_side(Y, X)


def centred(X):
    """The centred rows, divided by their largest magnitude (every measure is unchanged by it; squares of
    rows at 1e200 would overflow)."""
    Xc = center_rows(X)
    return Xc / np.abs(Xc).max()


def shape_ref(X, Y):
    Xc, Yc = centred(X), centred(Y)
    cos = np.linalg.svd(Xc.T @ Yc, compute_uv=False).sum() / (np.linalg.norm(Xc) * np.linalg.norm(Yc))
    return 2 - 2 * cos, float(np.arccos(min(cos, 1.0)))


def linreg_ref(X, Y, ridge=0.0):
    Xc, Yc = centred(X), centred(Y)
    if ridge == 0:
        B = np.linalg.lstsq(Xc, Yc, rcond=None)[0]
    else:
        mu = ridge * np.sum(Xc * Xc) / Xc.shape[1]
        B = np.linalg.solve(Xc.T @ Xc + mu * np.eye(Xc.shape[1]), Xc.T @ Yc)
    return 1 - np.sum((Yc - Xc @ B) ** 2) / np.sum(Yc**2)


def all_measures(M, n, names, widths, keep=0.99, ridge=0.0):
    out, notes = cca_matrices(M, n, names, widths, which=CCA_MEASURES, rtol=RTOL, keep=keep)
    shape, notes2 = shape_matrices(M, n, names, widths, which=SHAPE_MEASURES)
    lin, notes3 = linreg_matrix(M, n, names, widths, rtol=RTOL, ridge=ridge)
    out.update(shape)
    out["linreg_r2"] = lin
    return out, notes + notes2 + notes3


def references(reps, keep=0.99, ridge=0.0):
    k = len(reps)
    ref = {w: np.zeros((k, k)) for w in CCA_MEASURES + SHAPE_MEASURES + ("linreg_r2",)}
    for i in range(k):
        for j in range(k):
            rho = rho_ref(reps[i], reps[j])
            ref["cca_r2"][i, j] = np.mean(rho**2)
            ref["cca_rho"][i, j] = np.mean(rho)
            ref["svcca"][i, j] = svcca_ref(reps[i], reps[j], keep)
            lo, hi = min(i, j), max(i, j)
            ref["pwcca"][i, j] = pwcca_ref(reps[lo], reps[hi])
            if i != j:  # the diagonal is 0 by definition (arccos near 1 amplifies rounding to ~1e-8)
                ref["procrustes"][i, j], ref["shape_angular"][i, j] = shape_ref(reps[i], reps[j])
            ref["linreg_r2"][i, j] = linreg_ref(reps[i], reps[j], ridge)
    return ref


def related(seed, n=400, widths=(3, 8, 5)):
    """Representations sharing a latent of width 4 plus their own noise, at different
    offsets and column scales (a column of r2 carries a thousandth of the variance)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, 4))
    reps = []
    for r, p in enumerate(widths):
        x = z @ rng.normal(size=(4, p)) + (0.5 + r) * rng.normal(size=(n, p))
        x *= np.exp(rng.normal(size=p))
        reps.append(x + 10.0 * rng.normal(size=p))
    reps[-1][:, 0] *= 0.03
    return reps


def assert_family(reps, got, tol=TOL, keep=0.99, ridge=0.0):
    ref = references(reps, keep, ridge)
    for w, R in ref.items():
        np.testing.assert_allclose(got[w], R, rtol=tol, atol=tol, err_msg=w)


# -- values against the raw rows ----------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_measure_matches_the_rows(seed):
    reps = related(seed)
    M, n, widths = joint_state(reps)
    got, notes = all_measures(M, n, names_for(reps), widths)
    assert notes == []
    assert_family(reps, got)
    # the norm columns are not read: the representations' columns alone give the same numbers
    M2, _, _ = joint_state(reps, norm_columns=False)
    got2, _ = all_measures(M2, n, names_for(reps), widths)
    for w in got:
        np.testing.assert_array_equal(got[w], got2[w], err_msg=w)


def test_values_are_not_trivial():
    """The references separate the measures: the same pair gets different numbers."""
    reps = related(0)
    M, n, widths = joint_state(reps)
    got, _ = all_measures(M, n, names_for(reps), widths)
    vals = [got[w][0, 1] for w in ("cca_r2", "cca_rho", "pwcca", "procrustes", "shape_angular", "linreg_r2")]
    assert len({round(v, 6) for v in vals}) == len(vals)
    assert 0.1 < got["cca_r2"][0, 1] < 0.95
    assert got["linreg_r2"][0, 1] != pytest.approx(got["linreg_r2"][1, 0], rel=1e-3)


def test_rank_deficient_representation():
    """Duplicated and combined columns: the rank cut drops them, the count of
    correlations is min(rank_x, rank_y) and every value matches the rows."""
    rng = np.random.default_rng(3)
    n = 500
    reps = related(3, n=n, widths=(4, 6))
    x = reps[1]
    reps[1] = np.concatenate([x, x[:, :2], x[:, 2:3] - 2 * x[:, 4:5]], axis=1)  # width 9, rank 6
    reps.append(rng.normal(size=(n, 2)) @ rng.normal(size=(2, 5)))  # width 5, rank 2
    M, n, widths = joint_state(reps)
    got, notes = all_measures(M, n, names_for(reps), widths)
    assert notes == []
    assert_family(reps, got, tol=1e-8)
    # rank 2 against rank 4: two correlations, so cca_r2 = (rho_1^2 + rho_2^2) / 2
    rho = rho_ref(reps[0], reps[2])
    assert rho.size == 2
    assert got["cca_r2"][0, 2] == pytest.approx(np.mean(rho**2), rel=1e-9)
    assert got["linreg_r2"][1, 2] == pytest.approx(linreg_ref(reps[1], reps[2]), rel=1e-9)


@pytest.mark.parametrize("factor", [1e-100, 1e-30, 1e30, 1e100, 3.0])
def test_scaling_one_representation_changes_nothing(factor):
    reps = related(4)
    M, n, widths = joint_state(reps)
    base, _ = all_measures(M, n, names_for(reps), widths, ridge=0.1)
    scaled = list(reps)
    scaled[1] = reps[1] * factor
    M2, _, _ = joint_state(scaled, norm_columns=False)  # a norm column at 1e100 has co-moments past float64
    got, notes = all_measures(M2, n, names_for(reps), widths, ridge=0.1)
    assert notes == []
    for w in base:
        np.testing.assert_allclose(got[w], base[w], rtol=1e-9, atol=1e-12, err_msg=w)


def test_power_of_two_block_scales_are_exact():
    """``M`` as the state holds it (each block at a power of two) or after
    ``scale_blocks`` gives the same numbers bit for bit."""
    reps = related(5)
    M, n, widths = joint_state(reps)
    base, _ = all_measures(M, n, names_for(reps), widths, ridge=0.3)
    D = np.concatenate([np.repeat([2.0**-40, 2.0**7, 2.0**150], widths), [2.0**-80, 2.0**14, 2.0**300]])
    got, _ = all_measures(M * np.outer(D, D), n, names_for(reps), widths, ridge=0.3)
    for w in base:
        np.testing.assert_array_equal(got[w], base[w], err_msg=w)


def test_streamed_similarity_state():
    """A Similarity streamed in batches (one representation far from 1, held at a power-of-two scale in
    the state) hands its co-moments to the finish: the numbers of the rows."""
    import richness

    reps = related(6, n=600)
    reps[2] = reps[2] * 1e200
    sim = richness.Similarity()
    for lo in range(0, 600, 128):
        sim.update({nm: x[lo:lo + 128] for nm, x in zip(names_for(reps), reps)})
    st = sim.state_dict()
    assert st["scale"][2] != 1.0
    mom = st["moments"]
    got, notes = all_measures(mom["M"], mom["n"], st["names"], st["widths"])
    assert notes == []
    assert_family(reps, got, tol=1e-8)


# -- degenerate cases ---------------------------------------------------------------------------


def test_constant_representation_is_nan_with_a_note():
    reps = related(7)
    reps.insert(1, np.full((reps[0].shape[0], 3), 2.5))
    M, n, widths = joint_state(reps)
    names = names_for(reps)
    got, notes = all_measures(M, n, names, widths)
    for w, R in got.items():
        assert np.isnan(R[1]).all() and np.isnan(R[:, 1]).all(), w
        live = np.ix_([0, 2, 3], [0, 2, 3])
        assert np.isfinite(R[live]).all(), w
    assert len(notes) == 3 and all("constant" in t and "'r1'" in t for t in notes)
    ref = references([reps[i] for i in (0, 2, 3)])
    for w in ref:
        np.testing.assert_allclose(got[w][np.ix_([0, 2, 3], [0, 2, 3])], ref[w], rtol=TOL, atol=TOL, err_msg=w)


@pytest.mark.parametrize("n", [0, 1])
def test_fewer_than_two_samples(n):
    widths = [2, 3]
    M = np.zeros((7, 7))
    if n == 1:
        M[0, 0] = 0.0
    got, notes = all_measures(M, n, ["a", "b"], widths)
    for w, R in got.items():
        assert np.isnan(R).all(), w
    assert len(notes) == 3 and all("fewer than 2 samples" in t and f"n = {n}" in t for t in notes)


def test_correlations_one_by_construction():
    """rank_x + rank_y > n - 1: that many canonical correlations are exactly 1
    whatever the data (independent noise here); the value comes with a note."""
    rng = np.random.default_rng(8)
    n = 30
    reps = [rng.normal(size=(n, 18)), rng.normal(size=(n, 16))]
    M, n, widths = joint_state(reps)
    got, notes = cca_matrices(M, n, ["a", "b"], widths, which=CCA_MEASURES, rtol=RTOL)
    rho = rho_ref(*reps)
    assert np.sum(rho > 1 - 1e-8) == 18 + 16 - (n - 1)
    assert got["cca_r2"][0, 1] == pytest.approx(np.mean(rho**2), rel=1e-8)
    assert got["cca_r2"][0, 1] > 0.5
    text = [t for t in notes if "near 1 by construction" in t]
    assert len(text) == 2  # cca_r2, cca_rho, pwcca; svcca on its kept directions
    assert "a / b" in text[0] and "5 of 16 correlations are 1" in text[0]
    lin, lnotes = linreg_matrix(M, n, ["a", "b"], widths, rtol=RTOL)
    assert not any("by construction" in t for t in lnotes)  # rank 18 < n - 1 = 29
    assert any("biased toward 1" in t and "'a (independent level 0.621)'" in t for t in lnotes)
    wide = [rng.normal(size=(n, 29)), rng.normal(size=(n, 2))]
    M, n, widths = joint_state(wide)
    lin, lnotes = linreg_matrix(M, n, ["w", "v"], widths, rtol=RTOL)
    assert lin[0, 1] == pytest.approx(1.0, abs=1e-8)
    assert any("1 by construction" in t and "w (rank 29)" in t for t in lnotes)


def test_biased_toward_one_note_and_its_level():
    """Independent representations: cca_r2 is about max(p_x, p_y) / (n - 1), the
    level the note quotes; a note at 10% of it, none well below."""
    rng = np.random.default_rng(9)
    for n, note in [(4000, False), (200, True)]:
        vals = []
        for _ in range(5):
            reps = [rng.normal(size=(n, 20)), rng.normal(size=(n, 30))]
            M, n, widths = joint_state(reps)
            got, notes = cca_matrices(M, n, ["a", "b"], widths, which=["cca_r2"], rtol=RTOL)
            vals.append(got["cca_r2"][0, 1])
        level = 30 / (n - 1)
        assert 0.7 * level < np.mean(vals) < 1.3 * level
        assert any("biased toward 1" in t and "a / b" in t for t in notes) == note
        lin, lnotes = linreg_matrix(M, n, ["a", "b"], widths, rtol=RTOL)
        assert 0.5 * 20 / (n - 1) < lin[0, 1] < 1.5 * 20 / (n - 1)
        assert any("biased toward 1" in t for t in lnotes) == note


# -- known values and symmetry ------------------------------------------------------------------


def test_rotated_copy():
    """Y = X R, R orthogonal: Procrustes 0 and angle ~0, every correlation 1; Y = X A
    for an invertible A that is not orthogonal: correlations 1, Procrustes > 0."""
    rng = np.random.default_rng(10)
    X = rng.normal(size=(300, 6)) @ rng.normal(size=(6, 6)) + 3.0
    R = np.linalg.qr(rng.normal(size=(6, 6)))[0]
    A = rng.normal(size=(6, 6))
    reps = [X, X @ R, X @ A]
    M, n, widths = joint_state(reps)
    got, notes = all_measures(M, n, names_for(reps), widths, keep=1.0)
    assert notes == []
    for w in CCA_MEASURES:
        np.testing.assert_allclose(got[w], 1.0, atol=1e-9, err_msg=w)
    # SVCCA at 99% keeps the leading directions of each: equal spectra (X R) give 1, others need not
    sv, _ = cca_matrices(M, n, names_for(reps), widths, which="svcca", rtol=RTOL)
    assert sv["svcca"][0, 1] == pytest.approx(1.0, abs=1e-9)
    assert sv["svcca"][0, 2] == pytest.approx(svcca_ref(X, X @ A), rel=1e-9) and sv["svcca"][0, 2] < 1 - 1e-6
    np.testing.assert_allclose(got["linreg_r2"], 1.0, atol=1e-9)
    assert abs(got["procrustes"][0, 1]) < 1e-12
    assert got["shape_angular"][0, 1] < 1e-6
    assert got["procrustes"][0, 2] > 0.05
    assert got["shape_angular"][0, 2] == pytest.approx(shape_ref(X, X @ A)[1], rel=1e-9)


def test_symmetry_and_diagonals():
    reps = related(11, widths=(3, 8, 5, 2))
    M, n, widths = joint_state(reps)
    got, _ = all_measures(M, n, names_for(reps), widths)
    for w in CCA_MEASURES + SHAPE_MEASURES:
        np.testing.assert_array_equal(got[w], got[w].T, err_msg=w)
    for w in CCA_MEASURES:
        np.testing.assert_array_equal(np.diag(got[w]), 1.0, err_msg=w)
    for w in SHAPE_MEASURES:
        np.testing.assert_array_equal(np.diag(got[w]), 0.0, err_msg=w)
    np.testing.assert_array_equal(np.diag(got["linreg_r2"]), 1.0)
    assert not np.allclose(got["linreg_r2"], got["linreg_r2"].T, rtol=1e-3)


def test_pwcca_side():
    """The weights come from the representation with fewer neurons (the row one
    on a tie), whichever comes first; the two sides give different numbers."""
    reps = related(12, widths=(7, 3, 3))
    M, n, widths = joint_state(reps)
    got, _ = cca_matrices(M, n, names_for(reps), widths, which="pwcca", rtol=RTOL)
    assert set(got) == {"pwcca"}
    assert got["pwcca"][0, 1] == pytest.approx(pwcca_side(reps[1], reps[0]), rel=1e-9)
    assert got["pwcca"][1, 2] == pytest.approx(pwcca_side(reps[1], reps[2]), rel=1e-9)
    assert abs(pwcca_side(reps[0], reps[1]) - pwcca_side(reps[1], reps[0])) > 1e-3
    assert abs(pwcca_side(reps[1], reps[2]) - pwcca_side(reps[2], reps[1])) > 1e-4


def test_svcca_keep():
    """A representation whose last directions hold under 1% of its variance is
    reduced before the correlations; keep = 1 keeps every direction above the cut."""
    rng = np.random.default_rng(13)
    n = 500
    z = rng.normal(size=(n, 3))
    x = np.concatenate([z @ rng.normal(size=(3, 4)) * 10, rng.normal(size=(n, 4)) * 0.05], axis=1)
    y = z @ rng.normal(size=(3, 5)) + rng.normal(size=(n, 5))
    M, n, widths = joint_state([x, y])
    for keep in (0.99, 0.9, 0.5):
        got, _ = cca_matrices(M, n, ["x", "y"], widths, which=["svcca"], rtol=RTOL, keep=keep)
        assert got["svcca"][0, 1] == pytest.approx(svcca_ref(x, y, keep), rel=1e-9), keep
    assert svcca_reduced(x, 0.99).shape[1] == 3
    got, _ = cca_matrices(M, n, ["x", "y"], widths, which=["svcca", "cca_rho"], rtol=RTOL, keep=1.0)
    assert got["svcca"][0, 1] == pytest.approx(got["cca_rho"][0, 1], rel=1e-12)
    assert got["svcca"][0, 1] != pytest.approx(svcca_ref(x, y, 0.99), rel=1e-3)


@pytest.mark.parametrize("ridge", [1e-3, 0.1, 2.0])
def test_ridge(ridge):
    reps = related(14)
    M, n, widths = joint_state(reps)
    got, notes = linreg_matrix(M, n, names_for(reps), widths, rtol=RTOL, ridge=ridge)
    assert notes == []
    for i in range(3):
        for j in range(3):
            assert got[i, j] == pytest.approx(linreg_ref(reps[i], reps[j], ridge), rel=1e-9, abs=1e-12)
    plain, _ = linreg_matrix(M, n, names_for(reps), widths, rtol=RTOL)
    assert (got <= plain + 1e-12).all() and (np.diag(got) < 1).all()


def test_ridge_to_zero_is_the_plain_fit():
    reps = related(15)
    M, n, widths = joint_state(reps)
    plain, _ = linreg_matrix(M, n, names_for(reps), widths, rtol=RTOL)
    tiny, _ = linreg_matrix(M, n, names_for(reps), widths, rtol=RTOL, ridge=1e-13)
    np.testing.assert_allclose(tiny, plain, rtol=1e-9, atol=1e-12)


# -- published implementations ------------------------------------------------------------------


def test_scipy_procrustes():
    """scipy.spatial.procrustes (equal widths): disparity = 1 - (||Xc^T Yc||_* / (||Xc|| ||Yc||))^2."""
    procrustes = pytest.importorskip("scipy.spatial").procrustes

    rng = np.random.default_rng(16)
    X = rng.normal(size=(200, 5)) + 1.0
    Y = X @ rng.normal(size=(5, 5)) + rng.normal(size=(200, 5))
    M, n, widths = joint_state([X, Y])
    got, _ = shape_matrices(M, n, ["x", "y"], widths, which=["procrustes", "shape_angular"])
    cos = 1 - got["procrustes"][0, 1] / 2
    assert 1 - cos**2 == pytest.approx(procrustes(X, Y)[2], rel=1e-9)
    assert np.cos(got["shape_angular"][0, 1]) == pytest.approx(cos, rel=1e-12)


def test_sklearn_regression():
    """scikit-learn's LinearRegression and Ridge (alpha = ridge * ||Xc||_F^2 / p_x), R^2 weighted by the
    targets' variances."""
    sk = pytest.importorskip("sklearn.linear_model")
    from sklearn.metrics import r2_score

    reps = related(17)
    M, n, widths = joint_state(reps)
    for ridge in (0.0, 0.05):
        got, _ = linreg_matrix(M, n, names_for(reps), widths, rtol=RTOL, ridge=ridge)
        for i in range(3):
            for j in range(3):
                X, Y = reps[i], reps[j]
                alpha = ridge * np.sum(center_rows(X) ** 2) / X.shape[1]
                model = sk.Ridge(alpha=alpha) if ridge else sk.LinearRegression()
                pred = model.fit(X, Y).predict(X)
                assert got[i, j] == pytest.approx(r2_score(Y, pred, multioutput="variance_weighted"),
                                                  rel=1e-8, abs=1e-10)


def test_repsim():
    """repsim (Kisung You; C++): Yanai's summary = cca_r2, Pillai's = cca_rho. Its SVCCA applies the
    99% cut to an orthonormal basis of each representation (all singular values near 1), so below 100
    directions it keeps them all and gives cca_rho, not the SVCCA of the principal directions. Its PWCCA
    averages the weights of both sides, where ours takes the side with fewer neurons."""
    repsim = pytest.importorskip("repsim")
    rng = np.random.default_rng(18)
    n = 400
    z = rng.normal(size=(n, 3))
    reps = [np.concatenate([z @ rng.normal(size=(3, 4)) * 10, rng.normal(size=(n, 3)) * 0.05], axis=1),
            z @ rng.normal(size=(3, 5)) + rng.normal(size=(n, 5)), rng.normal(size=(n, 3)) + z[:, :1]]
    M, n, widths = joint_state(reps)
    got, _ = cca_matrices(M, n, names_for(reps), widths, which=CCA_MEASURES, rtol=RTOL)
    np.testing.assert_allclose(got["cca_r2"], repsim.cca(reps, "yanai"), rtol=1e-9)
    np.testing.assert_allclose(got["cca_rho"], repsim.cca(reps, "pillai"), rtol=1e-9)
    np.testing.assert_allclose(repsim.svcca(reps, "pillai"), got["cca_rho"], rtol=1e-9)
    assert np.abs(got["svcca"] - got["cca_rho"]).max() > 0.2  # rep 0 keeps 3 of its 6 directions
    for i in range(3):
        for j in range(i + 1, 3):
            both = (pwcca_side(reps[i], reps[j]) + pwcca_side(reps[j], reps[i])) / 2
            assert repsim.pwcca(reps)[i, j] == pytest.approx(both, rel=1e-9)
            assert got["pwcca"][i, j] == pytest.approx(pwcca_ref(reps[i], reps[j]), rel=1e-9)


# -- arguments ----------------------------------------------------------------------------------


def test_arguments():
    reps = related(19)
    M, n, widths = joint_state(reps)
    names = names_for(reps)
    with pytest.raises(ValueError, match="unknown measures"):
        cca_matrices(M, n, names, widths, which=["cca", "svcca"], rtol=RTOL)
    with pytest.raises(ValueError, match="unknown measures"):
        shape_matrices(M, n, names, widths, which=["cka"])
    for keep in (0, 1.5, True, "0.9", float("nan")):
        with pytest.raises(ValueError, match="keep"):
            cca_matrices(M, n, names, widths, which=["svcca"], rtol=RTOL, keep=keep)
    for rtol in (None, 0.0, 1.0, True):
        with pytest.raises(ValueError, match="rtol"):
            cca_matrices(M, n, names, widths, which=["cca_r2"], rtol=rtol)
        with pytest.raises(ValueError, match="rtol"):
            linreg_matrix(M, n, names, widths, rtol=rtol)
    for ridge in (-1e-3, float("inf"), float("nan"), True, None):
        with pytest.raises(ValueError, match="ridge"):
            linreg_matrix(M, n, names, widths, rtol=RTOL, ridge=ridge)
    with pytest.raises(ValueError, match="square of side 16 .* or 19"):
        shape_matrices(M[:-1, :-1], n, names, widths, which=["procrustes"])
    with pytest.raises(ValueError, match="names for"):
        shape_matrices(M, n, names[:2], widths, which=["procrustes"])
    bad = M.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="not finite"):
        linreg_matrix(bad, n, names, widths, rtol=RTOL)
    got, notes = cca_matrices(M, n, names, widths, which=[], rtol=RTOL)
    assert got == {} and notes == []
    got, _ = cca_matrices(M, n, names, widths, which=("pwcca", "cca_r2"), rtol=RTOL)
    assert list(got) == ["cca_r2", "pwcca"]


def test_without_the_compiled_core():
    """The three modules import and compute where richness._core cannot be imported."""
    child = r"""
import json, sys
sys.modules["richness._core"] = None
sys.modules["richness._cuda"] = None
import numpy as np
from richness.finish.cca import cca_matrices
from richness.finish.linreg import linreg_matrix
from richness.finish.shape import shape_matrices
rng = np.random.default_rng(0)
Z = rng.normal(size=(50, 5))
Z -= Z.mean(axis=0)
M = Z.T @ Z
a, _ = cca_matrices(M, 50, ["a", "b"], [2, 3], which=["cca_r2"], rtol=1e-10)
b, _ = shape_matrices(M, 50, ["a", "b"], [2, 3], which=["procrustes"])
c, _ = linreg_matrix(M, 50, ["a", "b"], [2, 3], rtol=1e-10)
print(json.dumps([a["cca_r2"][0, 1], b["procrustes"][0, 1], c[0, 1], "richness._core" in sys.modules
                  and sys.modules["richness._core"] is not None]))
"""
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True)
    vals = json.loads(out.stdout)
    rng = np.random.default_rng(0)
    Z = rng.normal(size=(50, 5))
    X, Y = Z[:, :2], Z[:, 2:]
    assert vals[0] == pytest.approx(np.mean(rho_ref(X, Y) ** 2), rel=1e-9)
    assert vals[1] == pytest.approx(shape_ref(X, Y)[0], rel=1e-9)
    assert vals[2] == pytest.approx(linreg_ref(X, Y), rel=1e-9)
    assert vals[3] is False
