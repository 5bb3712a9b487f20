"""richness.baselines against direct float64 n x n computations."""

import numpy as np
import pytest

from richness.baselines import InitSimilarity, init_similarity, parameter_norm


def cka_gram(a: np.ndarray, b: np.ndarray) -> float:
    """Linear CKA from full centred n x n Gram matrices (the test oracle)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    n = a.shape[0]
    H = np.eye(n) - np.ones((n, n)) / n
    Ka = H @ a @ a.T @ H
    Kb = H @ b @ b.T @ H
    return float(np.sum(Ka * Kb) / (np.linalg.norm(Ka) * np.linalg.norm(Kb)))


def pair(seed, n=60, pt=7, p0=5, mix=0.5):
    rng = np.random.default_rng(seed)
    x0 = rng.normal(size=(n, p0)) + rng.normal(size=p0) * 3
    x1 = mix * x0 @ rng.normal(size=(p0, pt)) + rng.normal(size=(n, pt)) + 2.0
    return x1, x0


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("shape", [(60, 7, 5), (40, 3, 12), (25, 30, 30)])
def test_matches_gram_cka(seed, shape):
    n, pt, p0 = shape
    x1, x0 = pair(seed, n, pt, p0)
    want = cka_gram(x1, x0)
    assert 0.0 < want < 1.0
    assert init_similarity(x1, x0) == pytest.approx(want, rel=1e-12, abs=1e-14)


def test_identical_and_scaled_features_give_one():
    x1, _ = pair(0)
    assert init_similarity(x1, x1) == pytest.approx(1.0, abs=1e-14)
    # CKA is invariant to isotropic scaling, constant shifts and rotations of either side.
    rng = np.random.default_rng(1)
    q, _ = np.linalg.qr(rng.normal(size=(x1.shape[1], x1.shape[1])))
    assert init_similarity(3.5 * x1 @ q + 7.0, x1) == pytest.approx(1.0, abs=1e-13)


def test_independent_features_are_near_zero():
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=(600, 4)), rng.normal(size=(600, 4))
    got = init_similarity(a, b)
    assert got == pytest.approx(cka_gram(a, b), rel=1e-12)
    assert got < 0.05  # E[CKA] ~ p/n for independent isotropic features


@pytest.mark.parametrize("seed", range(4))
def test_batch_split_and_merge_order_invariance(seed):
    x1, x0 = pair(seed, n=97)
    whole = init_similarity(x1, x0)
    rng = np.random.default_rng(seed + 10)
    cuts = np.sort(rng.choice(np.arange(1, 97), size=6, replace=False))
    parts = [(a, b) for a, b in zip(np.split(x1, cuts), np.split(x0, cuts))]
    s = InitSimilarity()
    for a, b in parts:
        s.update(a, b)
    assert s.n == 97
    assert s.compute() == pytest.approx(whole, rel=1e-12)
    # merge the parts in a random order as separate states
    states = []
    for a, b in parts:
        t = InitSimilarity()
        t.update(a, b)
        states.append(t)
    total = InitSimilarity()
    for i in rng.permutation(len(states)):
        total.merge(states[i])
    assert total.compute() == pytest.approx(whole, rel=1e-12)
    # single-row batches too
    one = InitSimilarity()
    for i in range(97):
        one.update(x1[i:i + 1], x0[i:i + 1])
    assert one.compute() == pytest.approx(whole, rel=1e-11)


def test_state_matches_direct_moments():
    x1, x0 = pair(3, n=50)
    s = InitSimilarity()
    s.update(x1[:20], x0[:20])
    s.update(x1[20:], x0[20:])
    c1, c0 = x1 - x1.mean(0), x0 - x0.mean(0)
    np.testing.assert_allclose(s.cross, c1.T @ c0, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.M_now, c1.T @ c1, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.M_init, c0.T @ c0, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.mean_now, x1.mean(0), rtol=1e-14)


def test_compute_does_not_mutate_and_repeats():
    x1, x0 = pair(4)
    s = InitSimilarity()
    s.update(x1, x0)
    before = s.cross.copy()
    assert s.compute() == s.compute()
    np.testing.assert_array_equal(s.cross, before)


def test_float32_far_from_origin():
    # float32 features with a mean of 1e4 and a spread of 1e-2: centring on the
    # float64 batch mean keeps the answer (the oracle sees the same float32 values).
    rng = np.random.default_rng(5)
    base = rng.normal(size=(200, 4))
    a = (1e4 + 1e-2 * (base @ rng.normal(size=(4, 6)) + 0.3 * rng.normal(size=(200, 6)))).astype(np.float32)
    b = (1e4 + 1e-2 * base).astype(np.float32)
    want = cka_gram(a.astype(np.float64), b.astype(np.float64))
    s = InitSimilarity()
    for i in range(0, 200, 32):
        s.update(a[i:i + 32], b[i:i + 32])
    assert s.compute() == pytest.approx(want, rel=1e-10)


def test_torch_tensors_match_numpy():
    torch = pytest.importorskip("torch")
    x1, x0 = pair(6)
    s = InitSimilarity()
    s.update(torch.tensor(x1[:30], dtype=torch.float32), torch.tensor(x0[:30], dtype=torch.float32))
    s.update(torch.tensor(x1[30:], dtype=torch.float32), x0[30:].astype(np.float32))
    want = cka_gram(x1.astype(np.float32), x0.astype(np.float32))
    assert s.compute() == pytest.approx(want, rel=1e-9)
    t = InitSimilarity()
    t.update(x1[:10], x0[:10])
    t.merge(s)  # numpy state absorbs a torch state
    assert isinstance(t.cross, np.ndarray)


def test_bad_input_errors_leave_state_unchanged():
    x1, x0 = pair(7)
    s = InitSimilarity()
    s.update(x1[:20], x0[:20])
    ref = s.compute()
    with pytest.raises(ValueError, match="rows"):
        s.update(x1[:5], x0[:6])
    with pytest.raises(ValueError, match="widths changed"):
        s.update(x1[:5, :3], x0[:5])
    bad = x1[:5].copy()
    bad[1, 2] = np.nan
    bad[3, 0] = np.inf
    with pytest.raises(ValueError, match="2 NaN or Inf"):
        s.update(bad, x0[:5])
    with pytest.raises(ValueError, match="2-D"):
        s.update(x1[:, 0], x0[:, 0])
    with pytest.raises(TypeError, match="floating"):
        s.update(np.ones((5, 7), dtype=np.int64), x0[:5])
    with pytest.raises(TypeError, match="InitSimilarity"):
        s.merge(object())
    other = InitSimilarity()
    other.update(x1[:5, :2], x0[:5])
    with pytest.raises(ValueError, match="merge states of widths"):
        s.merge(other)
    assert s.n == 20
    assert s.compute() == ref


def test_compute_errors():
    s = InitSimilarity()
    with pytest.raises(ValueError, match="at least 2"):
        s.compute()
    s.update(np.ones((1, 3)), np.ones((1, 3)))
    with pytest.raises(ValueError, match="at least 2"):
        s.compute()
    s.update(np.ones((4, 3)), np.random.default_rng(0).normal(size=(4, 3)))
    with pytest.raises(ValueError, match="features_now are constant"):
        s.compute()
    s.reset()
    assert s.n == 0 and s.widths is None


def test_parameter_norm_arrays_and_reference():
    rng = np.random.default_rng(8)
    arrs = [rng.normal(size=(3, 4)), rng.normal(size=5).astype(np.float32)]
    want = np.sqrt(sum(float(np.sum(np.asarray(a, np.float64) ** 2)) for a in arrs))
    assert parameter_norm(arrs) == pytest.approx(want, rel=1e-14)
    assert parameter_norm(arrs[0]) == pytest.approx(np.linalg.norm(arrs[0]), rel=1e-14)
    ref = [a * 0.5 for a in arrs]
    assert parameter_norm(arrs, reference=ref) == pytest.approx(want / 2, rel=1e-6)
    assert parameter_norm({"w": arrs[0]}) == pytest.approx(np.linalg.norm(arrs[0]), rel=1e-14)
    with pytest.raises(ValueError, match="shape"):
        parameter_norm(arrs, reference=[arrs[0], arrs[0]])
    with pytest.raises(ValueError, match="parameter arrays"):
        parameter_norm(arrs, reference=arrs[:1])
    with pytest.raises(TypeError, match="expected a module"):
        parameter_norm(3.0)


def test_parameter_norm_module():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    flat = np.concatenate([p.detach().double().numpy().ravel() for p in net.parameters()])
    assert parameter_norm(net) == pytest.approx(np.linalg.norm(flat), rel=1e-14)
    import copy

    init = copy.deepcopy(net)
    with torch.no_grad():
        net[0].weight.add_(1.0)
    assert parameter_norm(net, reference=init) == pytest.approx(np.sqrt(24.0), rel=1e-6)
