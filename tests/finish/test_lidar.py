"""LiDAR (Thilak et al., ICLR 2024) from the state, against a float64 oracle
written here from the definition on the raw rows: object means, their
covariance (1 / (N - 1)), the pooled within-object covariance plus delta I,
the eigenvalues of Sigma_w^-1/2 Sigma_b Sigma_w^-1/2 (and, as a second
oracle, scipy's generalized eigenvalues of (Sigma_b, Sigma_w)), and RankMe's
entropy with eps = 1e-7. reptrix's number, where reptrix installs, is shown
to be another quantity: the entropy of a PCA of that matrix's rows."""

import math
import warnings

import numpy as np
import pytest

import richness
from richness.finish.lidar import LIDAR_DELTA, LIDAR_EPS, lidar, lidar_with_reason


def lidar_parts(X, ids, delta):
    """(Sigma_b, Sigma_w + delta I) from the raw rows: each object's rows
    centred on its own mean; Sigma_w pools the objects of two or more rows
    (sum of their scatters over sum of n_o - 1)."""
    X = np.asarray(X, dtype=np.float64)
    ids = np.asarray(ids)
    objects = np.unique(ids)
    means = np.stack([X[ids == o].mean(axis=0) for o in objects])
    D = means - means.mean(axis=0)
    Sb = D.T @ D / (len(objects) - 1)
    p = X.shape[1]
    S, dof = np.zeros((p, p)), 0
    for o in objects:
        R = X[ids == o] - X[ids == o].mean(axis=0)
        if R.shape[0] >= 2:
            S += R.T @ R
            dof += R.shape[0] - 1
    return Sb, S / dof + delta * np.eye(p)


def entropy_rank(lam, eps=LIDAR_EPS):
    lam = np.clip(lam, 0.0, None)
    q = lam / lam.sum() + eps
    q = q[q > 0]  # 0 log 0 = 0 (eps = 0 only)
    return float(np.exp(-np.sum(q * np.log(q))))


def lidar_naive(X, ids, delta=LIDAR_DELTA, eps=LIDAR_EPS):
    """exp(-sum q log q), q = lambda / sum lambda + eps, lambda the p
    eigenvalues of Sigma_w^-1/2 Sigma_b Sigma_w^-1/2."""
    Sb, Sw = lidar_parts(X, ids, delta)
    w, U = np.linalg.eigh(Sw)
    T = U @ np.diag(w ** -0.5) @ U.T
    return entropy_rank(np.linalg.eigvalsh(T @ Sb @ T), eps)


def lidar_generalized(X, ids, delta=LIDAR_DELTA):
    """The same eigenvalues as the generalized problem Sigma_b v = lambda Sigma_w v (scipy)."""
    linalg = pytest.importorskip("scipy.linalg")
    Sb, Sw = lidar_parts(X, ids, delta)
    return entropy_rank(linalg.eigh(Sb, Sw, eigvals_only=True))


def augmented(seed, N, K, p, spread=2.0, noise=0.5, rank=None):
    """N objects x K augmentations (rows of one object together), ids 0..N-1."""
    rng = np.random.default_rng(seed)
    r = p if rank is None else rank
    centres = spread * rng.normal(size=(N, r)) @ rng.normal(size=(r, p)) / math.sqrt(r) + 1.5
    X = (centres[:, None, :] + noise * rng.normal(size=(N, K, p)) @ rng.normal(size=(p, p)) / math.sqrt(p))
    return X.reshape(N * K, p), np.repeat(np.arange(N), K)


def state_of(X, ids, batch=None):
    m = richness.Moments()
    step = len(X) if batch is None else batch
    for i in range(0, len(X), step):
        m.update(X[i:i + step], labels=ids[i:i + step])
    return m


def close(got, want, rel):
    assert got is not None
    assert abs(got - want) <= rel * abs(want), (got, want)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("N, K, p", [(40, 4, 12), (6, 5, 20), (25, 2, 25)])
def test_matches_the_definition(seed, N, K, p):
    X, ids = augmented(seed, N, K, p)
    got = state_of(X, ids).compute(measures=["lidar"]).lidar
    close(got, lidar_naive(X, ids), 1e-9)
    close(got, lidar_generalized(X, ids), 1e-8)
    assert 1.0 <= got <= min(N - 1, p) + 1e-3


def test_equal_counts_are_the_papers_normalisation():
    # K augmentations each: Sigma_w = 1 / (N (K - 1)) sum_o sum_i (z - mu_o)(z - mu_o)^T + delta I,
    # Sigma_b = 1 / (N - 1) sum_o (mu_o - mu)(mu_o - mu)^T, mu the mean of the object means
    N, K, p, delta = 30, 6, 10, 1e-3
    X, ids = augmented(7, N, K, p)
    Z = X.reshape(N, K, p)
    mu_o = Z.mean(axis=1)
    Sb = (mu_o - mu_o.mean(axis=0)).T @ (mu_o - mu_o.mean(axis=0)) / (N - 1)
    R = (Z - mu_o[:, None, :]).reshape(-1, p)
    Sw = R.T @ R / (N * (K - 1)) + delta * np.eye(p)
    L = np.linalg.cholesky(Sw)  # L^-1 Sb L^-T: the same eigenvalues as Sw^-1/2 Sb Sw^-1/2
    Li = np.linalg.inv(L)
    want = entropy_rank(np.linalg.eigvalsh(Li @ Sb @ Li.T))
    got = state_of(X, ids).compute(measures=["lidar"], measure_options={"lidar_delta": delta}).lidar
    close(got, want, 1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_unequal_counts_and_single_samples(seed):
    # objects of 1 to 7 rows, in shuffled order; objects of one row count in Sigma_b, not in Sigma_w
    rng = np.random.default_rng(100 + seed)
    p, N = 9, 35
    counts = rng.integers(1, 8, N)
    counts[:4] = 1
    centres = 2.0 * rng.normal(size=(N, p))
    ids = np.repeat(np.arange(N), counts)
    X = centres[ids] + 0.4 * rng.normal(size=(len(ids), p)) @ rng.normal(size=(p, p))
    order = rng.permutation(len(ids))
    X, ids = X[order], ids[order]
    got = state_of(X, ids, batch=17).compute(measures=["lidar"]).lidar
    close(got, lidar_naive(X, ids), 1e-9)
    close(got, lidar_generalized(X, ids), 1e-8)
    # the same rows without the single-row objects' spread: Sigma_w unchanged, Sigma_b not
    many = np.isin(ids, np.arange(N)[counts >= 2])
    Sb_all, Sw_all = lidar_parts(X, ids, LIDAR_DELTA)
    Sb_many, Sw_many = lidar_parts(X[many], ids[many], LIDAR_DELTA)
    assert np.allclose(Sw_all, Sw_many, rtol=1e-12, atol=0) and not np.allclose(Sb_all, Sb_many)
    # ids need not be contiguous: absent classes are not objects
    sparse = state_of(X, 3 * ids + 5).compute(measures=["lidar"]).lidar
    close(sparse, got, 1e-10)


def test_delta():
    N, K, p = 20, 3, 16
    X, ids = augmented(3, N, K, p, noise=0.05)
    m = state_of(X, ids)
    values = {}
    for delta in (0.0, 1e-6, 1e-4, 1e-2, 1.0):
        values[delta] = m.compute(measures=["lidar"], measure_options={"lidar_delta": delta}).lidar
        close(values[delta], lidar_naive(X, ids, delta), 1e-8)
    assert m.compute(measures=["lidar"]).lidar == values[LIDAR_DELTA]  # the default
    assert len({round(v, 6) for v in values.values()}) == len(values)  # delta moves the value
    # delta = 0 with fewer within-object degrees of freedom than features: Sigma_w singular
    X2, ids2 = augmented(3, 6, 2, p)
    value, why = lidar_with_reason(state_of(X2, ids2).state_dict(), delta=0.0)
    assert value is None and "singular" in why
    close(lidar(state_of(X2, ids2).state_dict(), delta=1e-3), lidar_naive(X2, ids2, 1e-3), 1e-8)
    for bad in (-1e-3, float("nan"), float("inf"), "1e-4", True):
        with pytest.raises(ValueError, match="lidar_delta"):
            m.compute(measures=["lidar"], measure_options={"lidar_delta": bad})


def test_eps():
    X, ids = augmented(5, 12, 4, 30)  # rank of Sigma_b <= 11 of 30: 19 zero eigenvalues take eps each
    st = state_of(X, ids).state_dict()
    for eps in (0.0, 1e-7, 1e-3):
        close(lidar(st, eps=eps), lidar_naive(X, ids, eps=eps), 1e-9)


def undefined(m, what):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rep = m.compute(measures=["lidar"])
    assert rep.lidar is None
    assert any(what in w for w in rep.warnings), rep.warnings
    return rep


def test_undefined_cases_say_why():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(20, 5))
    m = richness.Moments()
    m.update(X)
    undefined(m, "object ids")  # no labels
    one = richness.Moments()
    one.update(X, labels=np.zeros(20, dtype=int))
    undefined(one, "1 object(s)")
    single = richness.Moments()
    single.update(X, labels=np.arange(20))
    undefined(single, "no object has two or more samples")
    fixed = richness.Moments(num_classes=10)  # classes with no samples are not objects
    fixed.update(X, labels=np.full(20, 7))
    undefined(fixed, "1 object(s)")


def test_coarse_products_are_not_reported():
    X, ids = augmented(9, 10, 3, 5)
    st = state_of(X, ids).state_dict()
    for precision in ("tf32", "bf16"):
        value, why = lidar_with_reason(dict(st, precision=precision))
        assert value is None and precision in why
    assert lidar_with_reason(dict(st, precision="fp32"))[0] == lidar(st)


def test_constant_features():
    ids = np.repeat(np.arange(10), 3)
    X = np.full((30, 4), 2.5)
    value, why = lidar_with_reason(state_of(X, ids).state_dict())
    assert value is None and "coincide" in why
    # one constant column among varying ones: no spread there, within or between
    Y, ids = augmented(2, 15, 4, 6)
    Y = np.concatenate([Y, np.full((len(Y), 1), -3.0)], axis=1)
    close(state_of(Y, ids).compute(measures=["lidar"]).lidar, lidar_naive(Y, ids), 1e-9)


def test_streaming_and_merging_equal_one_pass():
    X, ids = augmented(11, 50, 4, 14)
    order = np.random.default_rng(0).permutation(len(X))  # an object's rows in several batches
    X, ids = X[order], ids[order]
    whole = state_of(X, ids).compute(measures=["lidar"]).lidar
    close(whole, lidar_naive(X, ids), 1e-9)
    for batch in (1, 7, 64):
        close(state_of(X, ids, batch).compute(measures=["lidar"]).lidar, whole, 1e-10)
    a, b = state_of(X[:90], ids[:90], 13), state_of(X[90:], ids[90:], 31)
    a.merge(b)
    close(a.compute(measures=["lidar"]).lidar, whole, 1e-10)


def test_torch_state():
    torch = pytest.importorskip("torch")
    X, ids = augmented(4, 30, 3, 10)
    st = state_of(X, ids).state_dict()
    tst = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in st.items()}
    close(lidar(tst), lidar_naive(X, ids), 1e-9)
    value, why = lidar_with_reason(dict(tst, k=-1))
    assert value is None and "object ids" in why


def test_where_it_appears():
    X, ids = augmented(6, 20, 3, 8)
    m = state_of(X, ids)
    plain = m.compute()
    assert plain.lidar is None and not any("LiDAR" in w for w in plain.warnings)  # opt-in only
    assert "lidar" in richness.finish.MEASURES
    rep = m.compute(measures="all")
    close(rep.lidar, lidar_naive(X, ids), 1e-9)
    assert "LiDAR" in str(rep) and rep.to_dict()["lidar"] == rep.lidar
    fast = m.compute(spectrum=False, measures=["lidar"])
    assert fast.lidar == m.compute(measures=["lidar"]).lidar and fast.rankme is None
    with pytest.raises(ValueError, match="unknown measures"):
        m.compute(measures=["LiDAR"])


def test_jackknife_lists_lidar():
    X, ids = augmented(8, 60, 4, 6)
    g = richness.Moments(groups=4)
    for i in range(0, len(X), 20):
        g.update(X[i:i + 20], labels=ids[i:i + 20])
    rep = g.compute(uncertainty=True, measures=["lidar"])
    close(rep.lidar, lidar_naive(X, ids), 1e-9)
    # the leave-one-group-out values, from the raw rows: updates go to the groups in turn
    group = (np.arange(len(X)) // 20) % 4
    theta = [lidar_naive(X[group != j], ids[group != j]) for j in range(4)]
    theta = np.array(theta)
    se = math.sqrt(3 / 4 * np.sum((theta - theta.mean()) ** 2))
    close(rep.measures_stderr["lidar"], se, 1e-7)


def test_against_reptrix():
    # reptrix.lidar.get_lidar builds the same Sigma_lidar up to scale (Sigma_b summed, not divided by
    # N - 1; Sigma_w the per-object scatter averaged over objects, not divided by K - 1: with its delta
    # equal to ours times K - 1 the matrix is ours times (N - 1) / (K - 1)), then takes a PCA of the
    # matrix's rows (explained-variance ratios: squared singular values of the column-centred matrix)
    # instead of its eigenvalues. Our value is the eigenvalue definition; reptrix's differs from it.
    torch = pytest.importorskip("torch")
    pytest.importorskip("reptrix")
    from reptrix.lidar import get_lidar

    N, K, p = 40, 5, 12
    for seed in range(3):
        X, ids = augmented(seed, N, K, p, rank=4)
        ours_delta = 1e-4
        theirs = float(get_lidar(torch.from_numpy(X.reshape(N, K, p)), N, K, del_sigma_augs=ours_delta * (K - 1)))
        ours = state_of(X, ids).compute(measures=["lidar"], measure_options={"lidar_delta": ours_delta}).lidar
        close(ours, lidar_naive(X, ids, ours_delta), 1e-9)
        # reptrix's number from the same matrix: entropy of the PCA explained-variance ratios of its rows
        Sb, Sw = lidar_parts(X, ids, ours_delta)
        w, U = np.linalg.eigh(Sw)
        T = U @ np.diag(w ** -0.5) @ U.T
        S = T @ Sb @ T
        s = np.linalg.svd(S - S.mean(axis=0), compute_uv=False)
        close(theirs, entropy_rank(s ** 2 / np.sum(s ** 2)), 1e-6)
        assert abs(theirs - ours) > 1e-2 * ours, (theirs, ours)  # a different quantity
