"""NC1's precision caveat follows the data: float32 inputs (fp32 products) give NC1 without a warning
exactly where its rounding bound is within 10% of it, and every value off by more than 10% carries the
warning (docs/MATH.md, NC1)."""

import numpy as np
import pytest

import richness
from reference import nc1_naive

SPREADS = (1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6)


def _data(p, K, size, spread, n=2000, seed=0):
    """K Gaussian class means with entries of standard deviation ``size``, within-class spread
    ``spread``, as float32 values."""
    rng = np.random.default_rng([p, K, int(size), int(round(-np.log10(spread))), seed])
    y = rng.integers(0, K, n)
    X = (size * rng.normal(size=(K, p)))[y] + spread * rng.normal(size=(n, p))
    return X.astype(np.float32), y


def _nc1(X, y, dtype=None, batch=None):
    m = richness.Moments()
    batch = batch or len(X)
    for i in range(0, len(X), batch):
        m.update(X[i:i + batch] if dtype is None else X[i:i + batch].astype(dtype), labels=y[i:i + batch])
    rep = m.compute(spectrum=False)
    return rep.nc1, [w for w in rep.warnings if w.startswith("NC1 = ")]


@pytest.mark.parametrize("p,K", [(16, 4), (64, 10)])
@pytest.mark.parametrize("size", [1, 4, 100])
def test_float32_nc1_is_within_10_percent_or_warned(p, K, size):
    outcomes = []
    for spread in SPREADS:
        X, y = _data(p, K, size, spread)
        want = nc1_naive(X, y)  # float64 from the same float32 values, centred per class
        got, warned = _nc1(X, y)
        rel = abs(got - want) / want if want > 0 else float(got != want)
        if not warned:
            assert rel <= 0.1, (spread, got, want)
        else:
            assert "fp32 products" in warned[0] and "may be off by more than 10%" in warned[0]
        if rel > 0.1:
            assert warned, (spread, got, want)
        outcomes.append(bool(warned))
    # the caveat starts at one spread and stays below it; the smallest spread is never resolved, the largest
    # is where the class means are not 1e3 times the spread
    assert outcomes == sorted(outcomes) and outcomes[-1]
    assert outcomes[0] == (size == 100)


def test_resolvable_near_collapse_value_has_no_warning():
    # within-class spread 1e-2 around class means of size 4: fp32 products resolve NC1 to about 1%
    for p, K in [(8, 4), (16, 4), (64, 10)]:
        X, y = _data(p, K, 4, 1e-2)
        want = nc1_naive(X, y)
        for batch in (None, 256):
            got, warned = _nc1(X, y, batch=batch)
            assert warned == [], (p, K, batch, warned)
            assert got == pytest.approx(want, rel=2e-2)


def test_unresolvable_value_is_warned_and_names_the_floor():
    X, y = _data(16, 4, 4, 1e-6)
    got, warned = _nc1(X, y)
    want = nc1_naive(X, y)
    assert abs(got - want) > 0.5 * want  # fp32 products cannot see this spread at all
    assert len(warned) == 1 and "fp32 products" in warned[0] and "precision='fp64'" in warned[0]


def test_float64_products_of_the_same_values_resolve_it():
    for spread in (1e-2, 1e-4):
        X, y = _data(16, 4, 4, spread)
        got, warned = _nc1(X, y, dtype=np.float64)
        assert warned == []
        assert got == pytest.approx(nc1_naive(X, y), rel=1e-6)
