import numpy as np
import pytest

import richness
from reference import dlr_naive


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 1e-6)])
def test_dlr_matches_naive_random_linear_head(dtype, tol):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(400, 24)) @ rng.normal(size=(24, 24)) + 3.0
    W, b = rng.normal(size=(5, 24)), rng.normal(size=5)
    F = X @ W.T + b
    want, r = dlr_naive(X, F)
    m = richness.Moments()
    for chunk in np.array_split(np.arange(400), 7):
        m.update(X[chunk].astype(dtype), F[chunk].astype(dtype))
    rep = m.compute()
    assert rep.rank == r == 5
    assert abs(rep.dlr - want) < tol
    assert abs(m.compute(head_weights=(W, b)).dlr - want) < tol
