"""Error bars and the numbers around DLR: the jackknife groups (their routing
and validation included), the finite-sample isotropic reference, rank-cut
sensitivity, many outputs in p-space (docs/MATH.md, "Jackknife error bars",
"Finite-sample bias and the isotropic reference", "Many outputs")."""

import tracemalloc

import numpy as np
import pytest

import richness
from reference import dlr_naive


def population_dlr(Sigma, W):
    """DLR of the population: features ~ N(0, Sigma), outputs W phi."""
    B = Sigma @ W.T
    A = W @ Sigma @ W.T
    return 1 - np.trace(B @ np.linalg.solve(A, B.T)) / (np.linalg.norm(Sigma) * np.sqrt(W.shape[0]))


def test_jackknife_interval_covers_population_value():
    rng = np.random.default_rng(7)
    p, C = 6, 2
    L = rng.normal(size=(p, p))
    Sigma = L @ L.T / p + 0.1 * np.eye(p)
    W = rng.normal(size=(C, p))
    pop = population_dlr(Sigma, W)
    chol = np.linalg.cholesky(Sigma)
    draws, covered, errors, ses = 120, 0, [], []
    for _ in range(draws):
        m = richness.Moments(groups=10)
        for _ in range(20):
            X = rng.normal(size=(60, p)) @ chol.T
            m.update(X, X @ W.T)
        rep = m.compute(uncertainty=True)
        lo, hi = rep.dlr_interval
        covered += lo <= pop <= hi
        errors.append(rep.dlr - pop)
        ses.append(rep.dlr_stderr)
    assert covered / draws >= 0.90
    # The standard error estimates the actual spread of DLR across draws.
    assert 0.6 < np.mean(ses) / np.std(errors) < 1.5


def test_groups_do_not_change_the_answer():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(900, 12)) + 5.0
    F = X @ rng.normal(size=(12, 3))
    y = rng.integers(0, 4, 900)
    whole = richness.Moments()
    grouped = richness.Moments(groups=4)
    seeded = richness.Moments(groups=3, group_seed=0)
    for chunk in np.array_split(np.arange(900), 9):
        for m in (whole, grouped, seeded):
            m.update(X[chunk], F[chunk], labels=y[chunk])
    a = whole.state_dict()
    for m in (grouped, seeded):
        b = m.state_dict()
        assert b["n"] == a["n"] == m.n
        for key in ("mean", "M", "B", "A", "class_sums"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-12, atol=1e-9)
        assert abs(m.compute().dlr - whole.compute().dlr) < 1e-12


# The tests below read the groups' own states (``m._backend.group_states()``):
# which group a batch went to (the rotation) has no public view; the jackknife
# only reports what is computed from all of them.
def test_rejected_batch_leaves_grouped_state_and_rotation_unchanged():
    rng = np.random.default_rng(2)
    m = richness.Moments(groups=3)
    for _ in range(4):
        x = rng.normal(size=(20, 5))
        m.update(x, x[:, :2])
    before = m._backend.group_states()
    bad = rng.normal(size=(20, 5))
    bad[3, 1] = np.nan
    with pytest.raises(ValueError, match="1 non-finite"):
        m.update(bad, bad[:, :2])
    after = m._backend.group_states()
    for s0, s1 in zip(before, after):
        for key in ("mean", "M", "B", "A"):
            assert np.array_equal(s0[key], s1[key])
    assert [s["n"] for s in after] == [40, 20, 20]
    m.update(x, x[:, :2])  # the next accepted batch goes to the group after the last accepted one
    assert [s["n"] for s in m._backend.group_states()] == [40, 40, 20]


def _grouped_started():
    """Moments(groups=3) after one update: groups 2 and 3 are still empty."""
    rng = np.random.default_rng(4)
    m = richness.Moments(groups=3, num_classes=4)
    x = rng.normal(size=(30, 5))
    m.update(x, x[:, :2], labels=rng.integers(0, 4, 30))
    return m, rng


@pytest.mark.parametrize("case", ["width", "no_outputs", "no_labels", "targets", "output_width"])
def test_grouped_update_checked_against_the_whole(case):
    m, rng = _grouped_started()
    before = m._backend.group_states()
    x = rng.normal(size=(10, 5))
    y = rng.integers(0, 4, 10)
    kwargs = {"width": dict(features=x[:, :4], outputs=x[:, :2], labels=y),
              "no_outputs": dict(features=x, labels=y),
              "no_labels": dict(features=x, outputs=x[:, :2]),
              "targets": dict(features=x, outputs=x[:, :2], labels=y, targets=x[:, 0]),
              "output_width": dict(features=x, outputs=x[:, :3], labels=y)}[case]
    with pytest.raises(ValueError):
        m.update(**kwargs)
    after = m._backend.group_states()
    for s0, s1 in zip(before, after):
        assert s0["n"] == s1["n"] and s0["p"] == s1["p"] and s0["c"] == s1["c"] and s0["k"] == s1["k"]
    # the whole still finishes, saves and reports
    assert m.state_dict()["n"] == 30 and m.compute().dlr is not None


def test_grouped_merge_checked_against_the_whole():
    m, rng = _grouped_started()
    other = richness.Moments(num_classes=7)
    x = rng.normal(size=(10, 5))
    other.update(x, x[:, :2], labels=rng.integers(0, 7, 10))
    with pytest.raises(ValueError, match="num_classes"):
        m.merge(other)
    wide = richness.Moments()
    wide.update(rng.normal(size=(10, 6)), x[:, :2], labels=rng.integers(0, 4, 10))
    with pytest.raises(ValueError, match="feature widths"):
        m.merge(wide)
    assert [s["n"] for s in m._backend.group_states()] == [30, 0, 0]
    assert m.state_dict()["n"] == 30


def test_grouped_empty_update_keeps_the_rotation():
    m, rng = _grouped_started()
    m.update(np.zeros((0, 5)), np.zeros((0, 2)), labels=np.zeros(0, dtype=np.int64))
    x = rng.normal(size=(10, 5))
    m.update(x, x[:, :2], labels=rng.integers(0, 4, 10))
    assert [s["n"] for s in m._backend.group_states()] == [30, 10, 0]


def test_uncertainty_needs_groups_and_filled_groups():
    x = np.random.default_rng(3).normal(size=(50, 4))
    m = richness.Moments()
    m.update(x, x[:, :2])
    with pytest.raises(ValueError, match="groups"):
        m.compute(uncertainty=True)
    g = richness.Moments(groups=5)
    g.update(x, x[:, :2])
    with pytest.raises(ValueError, match="group sizes"):
        g.compute(uncertainty=True)


@pytest.mark.parametrize("p,C,n", [(64, 4, 20000), (64, 16, 256), (128, 64, 256), (32, 4, 64), (96, 8, 2000)])
def test_isotropic_reference_matches_monte_carlo(p, C, n):
    rng = np.random.default_rng(p * 1000 + n)
    values, refs = [], []
    for _ in range(6):
        X = rng.normal(size=(n, p))
        W = rng.normal(size=(C, p))
        rep = richness.Moments()
        rep.update(X)
        r = rep.compute(head_weights=(W, None))
        values.append(r.dlr)
        refs.append(r.dlr_isotropic)
        # for isotropic features the normalised value reads "lazy"
        assert abs(r.dlr_normalized - 1.0) < 0.08
    # Wishart moments give the expectation; its error is a ratio-of-means one.
    assert abs(np.mean(values) - np.mean(refs)) < 0.01 + 3 * np.std(values)


def test_spec_finite_sample_values():
    # docs/MATH.md, "Finite-sample bias and the isotropic reference": p = 512, C = 10, isotropic: 0.686 at n = 128,
    # 0.844 at n = 2048, 0.860 in the limit.
    from richness.finish import isotropic_dlr

    assert abs(isotropic_dlr(128, 512, 10) - 0.686) < 0.01
    assert abs(isotropic_dlr(2048, 512, 10) - 0.844) < 0.002
    assert abs(isotropic_dlr(10**9, 512, 10) - (1 - np.sqrt(10 / 512))) < 1e-4


def test_normalized_dlr_is_near_zero_for_collapse():
    rng = np.random.default_rng(4)
    K, p = 5, 40
    Q, _ = np.linalg.qr(rng.normal(size=(p, K)))
    means = 5 * (np.eye(K) - 1.0 / K) @ Q.T  # simplex ETF: the DLR = 0 case of docs/MATH.md
    y = np.repeat(np.arange(K), 400)
    X = means[y] + 0.01 * rng.normal(size=(len(y), p))
    W = means - means.mean(0)
    m = richness.Moments()
    m.update(X)
    r = m.compute(head_weights=(W, None))
    assert r.dlr_normalized < 0.01


def test_rank_cut_sensitivity_is_reported():
    rng = np.random.default_rng(5)
    X = rng.normal(size=(3000, 20))
    W = rng.normal(size=(4, 20))
    F = X @ W.T
    # a fifth output that is nearly a copy of the first: its extra variance sits
    # just below the fp64 cut of 1e-10 a_max
    F = np.column_stack([F, F[:, 0] + 3e-5 * np.std(F) * rng.normal(size=3000)])
    m = richness.Moments()
    m.update(X, F)
    r = m.compute()
    lo, hi = r.dlr_rtol_range
    want_lo, _ = dlr_naive(X, F, rtol=r.rtol / 10)
    want_hi, _ = dlr_naive(X, F, rtol=r.rtol * 10)
    assert abs(lo - want_lo) < 1e-6 and abs(hi - want_hi) < 1e-6
    assert abs(lo - hi) > 0.01
    assert any("rank cut" in w for w in r.warnings)
    clean = richness.Moments()
    clean.update(X, X @ W.T)
    rc = clean.compute()
    assert rc.dlr_rtol_range[0] == rc.dlr_rtol_range[1] == rc.dlr
    assert not any("rank cut" in w for w in rc.warnings)


def test_many_outputs_p_space_equals_direct_formula():
    rng = np.random.default_rng(6)
    n, p, C = 2500, 24, 60  # C > p: the head path works in p-space
    X = rng.normal(size=(n, p)) @ rng.normal(size=(p, p)) + 1.0
    W = rng.normal(size=(C, p))
    F = X @ W.T
    m = richness.Moments()
    m.update(X, F)
    streamed = m.compute()
    head = m.compute(head_weights=(W, None))
    want, r = dlr_naive(X, F)
    assert head.rank == streamed.rank == r == p
    assert abs(head.dlr - want) < 1e-9
    assert abs(streamed.dlr - want) < 1e-9
    np.testing.assert_allclose(head.utilization, streamed.utilization, rtol=0, atol=1e-9)
    # low-rank head: C > p but the span has rank 3
    W3 = rng.normal(size=(C, 3)) @ rng.normal(size=(3, p))
    want3, r3 = dlr_naive(X, X @ W3.T)
    h3 = m.compute(head_weights=(W3, None))
    assert h3.rank == r3 == 3
    assert abs(h3.dlr - want3) < 1e-9


def test_many_outputs_in_bounded_memory():
    rng = np.random.default_rng(8)
    p, C = 256, 32768
    m = richness.Moments()
    for _ in range(4):
        m.update(rng.normal(size=(2048, p)).astype(np.float32))
    W = rng.normal(size=(C, p)).astype(np.float32)
    tracemalloc.start()
    r = m.compute(head_weights=(W, None))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # A C x C float64 matrix would be 8.6 GB; W itself is 67 MB in float64.
    assert peak < 400e6
    assert r.rank == p and 0.0 <= r.dlr < 0.05
    assert r.utilization[-1] == pytest.approx(1.0, abs=1e-6)


def test_dlr_alone_without_spectrum_equals_full_report():
    rng = np.random.default_rng(9)
    X = rng.normal(size=(1500, 30)) @ rng.normal(size=(30, 30))
    F = X @ rng.normal(size=(30, 5))
    y = rng.integers(0, 4, 1500)
    m = richness.Moments()
    m.update(X, F, labels=y)
    full = m.compute()
    alone = m.compute(spectrum=False)
    want, r = dlr_naive(X, F)
    assert abs(alone.dlr - want) < 1e-10 and alone.rank == r
    assert alone.dlr == full.dlr and alone.nc1 == full.nc1 and alone.dlr_rtol_range == full.dlr_rtol_range
    assert alone.eigenvalues is None and alone.utilization is None and alone.effective_dim is None
    assert "n/a" in str(alone)
    test = richness.Moments()
    test.update(X[:100], F[:100], labels=y[:100])
    with pytest.raises(ValueError, match="need the spectrum"):
        m.compute(test=test, spectrum=False)
