"""compute(uncertainty=True) when a leave-one-group-out state does not define DLR: the point estimate
is the one plain compute() gives, the error bars are None and a RichnessWarning names the group and why
(docs/MATH.md, "Jackknife error bars")."""

import warnings

import numpy as np
import pytest

import richness
from reference import dlr_naive


def _filled(k, batches):
    """A Moments(groups=k) fed ``batches`` (features, outputs) in turn: batch i goes to group i % k."""
    m = richness.Moments(groups=k)
    for X, F in batches:
        m.update(X, outputs=F)
    return m


def _one_group_varies(rng, k=4, p=6, C=3):
    """Group 2 holds all the variation of the features: the other groups are one constant row
    repeated, so leaving group 2 out leaves constant features."""
    W = rng.normal(size=(C, p))
    const = rng.normal(size=p)
    batches = []
    for g in range(k):
        X = rng.normal(size=(40, p)) if g == 2 else np.tile(const, (25, 1))
        batches.append((X, X @ W.T + rng.normal(size=(len(X), C)) * 0.1))
    return batches


def test_constant_features_without_one_group_give_the_estimate_without_error_bars():
    batches = _one_group_varies(np.random.default_rng(0))
    m = _filled(4, batches)
    Phi = np.concatenate([X for X, _ in batches])
    F = np.concatenate([F for _, F in batches])
    want = dlr_naive(Phi, F)[0]
    plain = m.compute()
    assert plain.dlr == pytest.approx(want, abs=1e-10)
    with pytest.warns(richness.RichnessWarning) as caught:
        rep = m.compute(uncertainty=True)
    assert rep.dlr == plain.dlr
    assert rep.dlr == pytest.approx(want, abs=1e-10)
    assert rep.dlr_stderr is None and rep.dlr_interval is None and rep.dlr_jackknife is None
    texts = [str(w.message) for w in caught if "error bars" in str(w.message)]
    assert len(texts) == 1
    assert "group 2 of 4 (40 samples) left out" in texts[0] and "features are constant" in texts[0]
    assert texts[0] in rep.warnings
    # the rest of the report is the plain one's
    assert rep.rank == plain.rank and rep.nc1 == plain.nc1
    np.testing.assert_array_equal(rep.eigenvalues, plain.eigenvalues)


def test_constant_outputs_without_one_group_name_it():
    rng = np.random.default_rng(1)
    p, C = 5, 2
    batches = []
    for g in range(3):
        X = rng.normal(size=(30, p))
        F = rng.normal(size=(30, C)) if g == 0 else np.ones((30, C))
        batches.append((X, F))
    m = _filled(3, batches)
    want = dlr_naive(np.concatenate([X for X, _ in batches]), np.concatenate([F for _, F in batches]))[0]
    with pytest.warns(richness.RichnessWarning, match=r"group 0 of 3 \(30 samples\) left out, outputs are constant"):
        rep = m.compute(uncertainty=True)
    assert rep.dlr == pytest.approx(want, abs=1e-10)
    assert rep.dlr_stderr is None and rep.dlr_interval is None


def test_error_bars_remain_when_every_group_defines_dlr():
    rng = np.random.default_rng(2)
    W = rng.normal(size=(2, 5))
    batches = [(X, X @ W.T) for X in (rng.normal(size=(50, 5)) for _ in range(4))]
    m = _filled(4, batches)
    with warnings.catch_warnings():
        warnings.simplefilter("error", richness.RichnessWarning)
        rep = m.compute(uncertainty=True, spectrum=False)
    assert rep.dlr_stderr is not None and rep.dlr_stderr > 0
    assert not any("error bars" in w for w in rep.warnings)
