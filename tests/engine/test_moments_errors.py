"""Bad input: each raises a specific exception whose message names the problem,
and the state afterwards is exactly what it was before."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import richness
from reference import dlr_naive, states_equal

N, P, C, K = 30, 4, 2, 3


def batch(seed=0, n=N):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, P)), rng.normal(size=(n, C)), rng.integers(0, K, size=n)


def with_nonfinite(a, cells):
    a = a.copy()
    for (i, j), v in cells.items():
        a[i, j] = v
    return a


X, F, Y = batch(1)
XB = with_nonfinite(X, {(1, 2): np.nan, (3, 0): np.inf, (4, 1): -np.inf})
FB = with_nonfinite(F, {(0, 0): np.nan})

BAD_UPDATES = {
    # name: (kwargs of update, exception, message pattern)
    "nan/inf features": (dict(features=XB, outputs=F, labels=Y), ValueError, r"features contain 3 non-finite values"),
    "nan/inf features float32": (dict(features=XB.astype(np.float32), outputs=F, labels=Y), ValueError,
                                 r"features contain 3 non-finite"),
    "nan/inf features float16": (dict(features=XB.astype(np.float16), outputs=F, labels=Y), ValueError,
                                 r"features contain 3 non-finite"),
    "nan/inf features bfloat16": (dict(features=torch.from_numpy(XB).bfloat16(), outputs=F, labels=Y), ValueError,
                                  r"features contain 3 non-finite"),
    "nan outputs": (dict(features=X, outputs=FB, labels=Y), ValueError, r"outputs contain 1 non-finite value\b"),
    "float64 overflow": (dict(features=np.full((N, P), 1e308), outputs=F, labels=Y), ValueError, r"overflow"),
    "1-D features": (dict(features=X[:, 0], outputs=F, labels=Y), ValueError, r"features must be 2-D.*\(30,\)"),
    "3-D features": (dict(features=X[None], outputs=F, labels=Y), ValueError, r"features must be 2-D.*\(1, 30, 4\)"),
    "3-D outputs": (dict(features=X, outputs=F[None], labels=Y), ValueError, r"outputs must be .*2-D"),
    "zero-width features": (dict(features=X[:, :0], outputs=F, labels=Y), ValueError, r"at least one column"),
    "feature width changes": (dict(features=X[:, :3], outputs=F, labels=Y), ValueError,
                              r"features have 3 columns but earlier updates had 4"),
    "output width changes": (dict(features=X, outputs=F[:, :1], labels=Y), ValueError,
                             r"outputs have 1 columns but earlier updates had 2"),
    "negative label": (dict(features=X, outputs=F, labels=np.where(np.arange(N) == 7, -1, Y)), ValueError,
                       r"labels out of range: label -1 at row 7"),
    "float labels": (dict(features=X, outputs=F, labels=Y.astype(np.float64)), TypeError,
                     r"labels must be integers.*float64"),
    "torch float labels": (dict(features=X, outputs=F, labels=torch.from_numpy(Y).float()), TypeError,
                           r"labels must be integers"),
    "bool labels": (dict(features=X, outputs=F, labels=Y > 0), TypeError, r"labels must be integers"),
    "2-D labels": (dict(features=X, outputs=F, labels=Y[:, None]), ValueError, r"labels must be 1-D"),
    "outputs rows differ": (dict(features=X, outputs=F[:-1], labels=Y), ValueError,
                            r"outputs has 29 rows but features have 30"),
    "labels rows differ": (dict(features=X, outputs=F, labels=Y[:-2]), ValueError,
                           r"labels has 28 rows but features have 30"),
    "outputs stream missing": (dict(features=X, labels=Y), ValueError, r"streamed outputs before"),
    "labels stream missing": (dict(features=X, outputs=F), ValueError, r"streamed labels before"),
    "targets stream added": (dict(features=X, outputs=F, labels=Y, targets=F), ValueError,
                             r"started without targets"),
    "integer features": (dict(features=X.astype(np.int64), outputs=F, labels=Y), TypeError, r"features .*int64"),
    "complex features": (dict(features=X.astype(np.complex128), outputs=F, labels=Y), TypeError,
                         r"features has dtype complex128"),
    "uint8 features": (dict(features=np.abs(X).astype(np.uint8), outputs=F, labels=Y), TypeError,
                       r"features must be float32, float64, float16 or bfloat16, got uint8"),
    "uint64 label past int64": (dict(features=X, outputs=F, labels=np.where(np.arange(N) == 5, 2**64 - 1, Y)
                                     .astype(np.uint64)), ValueError,
                                r"labels out of range: label 18446744073709551615 at row 5"),
    # finite inputs whose products overflow: the state must not take an Inf
    "float32 products overflow": (dict(features=(X * 1e19).astype(np.float32), outputs=F, labels=Y), ValueError,
                                  r"features are too large: their co-moments overflow the float32 products "
                                  r"\(largest magnitude in the batch 2\.\d+e\+19\)"),
    "float64 products overflow": (dict(features=X * 1e160, outputs=F, labels=Y), ValueError,
                                  r"features are too large: their co-moments overflow float64 "
                                  r"\(largest magnitude in the batch 2\.\d+e\+160\)"),
    "outputs overflow": (dict(features=X, outputs=F * 1e160, labels=Y), ValueError,
                         r"outputs are too large: .*overflow float64"),
    # constant within the batch (X is lost beside 1e160), but 1e160 away from the state's mean
    "mean shift overflows": (dict(features=X + 1e160, outputs=F, labels=Y), ValueError,
                             r"features are too large: .*overflow float64 \(largest magnitude in the batch 1e\+160\)"),
    "float32 squares underflow": (dict(features=(X * 1e-30).astype(np.float32), outputs=F, labels=Y), ValueError,
                                  r"features vary by at most \S+e-30, too little for fp32 products: their squares "
                                  r"underflow float32.*precision='fp64'"),
    "float64 squares underflow": (dict(features=X * 1e-170, outputs=F, labels=Y), ValueError,
                                  r"features vary by at most \S+e-170, too little for fp64 products: their squares "
                                  r"underflow float64"),
}


def started():
    m = richness.Moments()
    Xs, Fs, Ys = batch(2)
    m.update(Xs, Fs, labels=Ys)
    return m


@pytest.mark.parametrize("name", sorted(BAD_UPDATES))
def test_bad_update_raises_and_leaves_state(name):
    kwargs, exc, pattern = BAD_UPDATES[name]
    m = started()
    before = m.state_dict()
    with pytest.raises(exc, match=pattern):
        m.update(**kwargs)
    assert states_equal(m.state_dict(), before)
    assert m.n == N
    # and the Moments still works: a good batch after the bad one is taken normally
    m.update(X, F, labels=Y)
    Xs, Fs, _ = batch(2)
    ref, _ = dlr_naive(np.vstack([Xs, X]), np.vstack([Fs, F]))
    assert abs(m.compute().dlr - ref) < 1e-12


def test_label_out_of_range_with_num_classes():
    m = richness.Moments(num_classes=K)
    m.update(X, labels=Y)
    before = m.state_dict()
    bad = Y.copy()
    bad[11] = K
    with pytest.raises(ValueError, match=r"labels out of range: label 3 at row 11 \(num_classes=3\)"):
        m.update(X, labels=bad)
    assert states_equal(m.state_dict(), before)


@pytest.mark.parametrize("name", ["nan/inf features", "negative label", "float labels", "outputs rows differ",
                                  "labels rows differ", "3-D outputs", "float32 products overflow",
                                  "float64 products overflow", "outputs overflow", "float64 squares underflow",
                                  "uint64 label past int64"])
def test_bad_first_update_leaves_moments_fresh(name):
    # A rejected first batch must not fix the widths or the streams.
    kwargs, exc, pattern = BAD_UPDATES[name]
    m = richness.Moments()
    fresh = m.state_dict()
    with pytest.raises(exc, match=pattern):
        m.update(**kwargs)
    assert states_equal(m.state_dict(), fresh)
    assert m.n == 0
    Z = np.random.default_rng(3).normal(size=(20, P + 2))  # another width, no labels: allowed
    m.update(Z, Z[:, :2] * 2 + Z[:, 2:4])
    assert m.n == 20
    assert abs(m.compute().dlr - dlr_naive(Z, Z[:, :2] * 2 + Z[:, 2:4])[0]) < 1e-12


# -- compute errors ----------------------------------------------------------------------

def test_compute_on_empty_state():
    m = richness.Moments()
    with pytest.raises(ValueError, match=r"empty"):
        m.compute()
    m.update(X)
    m.reset()
    with pytest.raises(ValueError, match=r"empty"):
        m.compute()
    assert m.n == 0


def test_compute_with_one_sample():
    m = richness.Moments()
    m.update(X[:1], F[:1], labels=Y[:1])
    before = m.state_dict()
    with pytest.raises(ValueError, match=r"at least 2 samples.*n = 1"):
        m.compute()
    assert states_equal(m.state_dict(), before)


def test_constant_features():
    m = richness.Moments()
    m.update(np.full((N, P), 3.25), F)
    before = m.state_dict()
    with pytest.raises(ValueError, match=r"features are constant"):
        m.compute()
    mo = richness.Moments()
    mo.update(np.full((N, P), -1.0))
    with pytest.raises(ValueError, match=r"features are constant"):
        mo.compute()
    assert states_equal(m.state_dict(), before)


@pytest.mark.parametrize("value", [0.1, 0.3, 1 / 3, 7.7, -2.2e5, 1e-100])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("rows", [[2000], [700, 1300], [3, 997, 1000]])
def test_constant_features_whatever_the_rounding(value, dtype, rows):
    # sum * (1/n) rounds: a constant column centered on it kept a false covariance (DLR 1.0 for 0.1)
    m = richness.Moments()
    rng = np.random.default_rng(len(rows))
    for n in rows:
        m.update(np.full((n, P), value, dtype=dtype), rng.normal(size=(n, C)))
    with pytest.raises(ValueError, match=r"features are constant"):
        m.compute()
    with pytest.raises(ValueError, match=r"features are constant"):
        m.compute(spectrum=False)


def test_constant_at_the_rounding_level_of_the_mean():
    # A state whose covariance is rounding residue (as a backend that does not snap its means to the
    # data leaves): spread 1e-15 of a mean of 1, n = 2000.
    m = richness.Moments()
    m.update(X, F)
    st = m.state_dict()
    n = st["n"]
    st["mean"] = np.full(P, 1.0)
    st["M"] = np.full((P, P), n * 1e-30) + np.eye(P) * n * 1e-31
    with pytest.raises(ValueError, match=r"features are constant \(zero covariance, or one at the rounding level"):
        richness.finish.finish(st)
    # the same spread about a mean of 0 is a tiny but real covariance
    st["mean"] = np.zeros(P)
    assert richness.finish.finish(st).dlr is not None


def test_tiny_and_huge_scales_give_the_unscaled_dlr():
    # DLR does not depend on the scales; the finishing keeps every product within float64
    rng = np.random.default_rng(4)
    Xs = rng.normal(size=(200, P))
    Fs = Xs @ rng.normal(size=(P, C)) + 0.3 * rng.normal(size=(200, C))
    W = rng.normal(size=(C, P))
    Wwide = rng.normal(size=(7, P))  # C > p: the p-space head path
    ref = dlr_naive(Xs, Fs)[0]
    ref_head = dlr_naive(Xs, Xs @ W.T)[0]
    ref_wide = dlr_naive(Xs, Xs @ Wwide.T)[0]
    unscaled = richness.Moments()
    unscaled.update(Xs, Fs)
    util = unscaled.compute().utilization
    for sx, sf, sw in [(1e-100, 1e-100, 1e-150), (1e150, 1e150, 1e-150), (1e-150, 1e150, 1e-300),
                       (1e77, 1.0, 1e-100), (1.0, 1.0, 1e100)]:
        m = richness.Moments()
        m.update(Xs * sx, Fs * sf)
        r = m.compute()
        assert abs(r.dlr - ref) < 1e-10, (sx, sf)
        np.testing.assert_allclose(r.utilization, util, rtol=1e-9)
        assert abs(m.compute(head_weights=W * sw).dlr - ref_head) < 1e-10, (sx, sw)
        rw = m.compute(head_weights=Wwide * sw)
        assert abs(rw.dlr - ref_wide) < 1e-10, (sx, sw)
        assert np.isfinite(rw.utilization).all()


def test_finishing_failures_are_value_errors():
    m = started()
    before = m.state_dict()
    # A's eigenvalues (W M W^T) pass float64: no LinAlgError, no "constant outputs"
    with pytest.raises(ValueError, match=r"compute\(\) failed in float64 .*head weights up to 1e\+300.*rescale"):
        m.compute(head_weights=np.full((C, P), 1e300))
    st = m.state_dict()
    st["M"] = np.full((P, P), 1e300) + np.diag(np.arange(1.0, P + 1) * 1e300)
    st["B"] = np.full((P, C), 1e300)
    with pytest.raises(ValueError, match=r"compute\(\) failed in float64 .*\|M\| up to .*rescale"):
        richness.finish.finish(st)
    assert states_equal(m.state_dict(), before)


def test_constant_outputs_and_zero_head():
    m = richness.Moments()
    m.update(X, np.tile([1.0, -2.0], (N, 1)))
    before = m.state_dict()
    with pytest.raises(ValueError, match=r"outputs are constant"):
        m.compute()
    assert states_equal(m.state_dict(), before)
    mh = richness.Moments()
    mh.update(X)
    with pytest.raises(ValueError, match=r"constant"):
        mh.compute(head_weights=(np.zeros((C, P)), np.ones(C)))


@pytest.mark.parametrize("head,exc,pattern", [
    (np.ones((C, P + 1)), ValueError, r"head weight has 5 input columns but the features have 4"),
    ((np.ones((C, P)), np.ones(C + 1)), ValueError, r"head bias has 3 entries but the weight has 2 rows"),
    (np.ones(P), ValueError, r"head weight must be 2-D"),
    (np.full((C, P), np.nan), ValueError, r"head weight contains NaN or Inf"),
    (np.ones((C, P)) + 1j, ValueError, r"head weight must be real, got complex128"),
    (torch.ones((C, P), dtype=torch.complex64), ValueError, r"head weight must be real, got torch.complex64"),
    (np.ones((0, P)), ValueError, r"head weight has no rows \(outputs\): shape \(0, 4\)"),
    ((np.ones((C, P)), np.array([np.nan, 1.0])), ValueError, r"head bias contains NaN or Inf"),
    ((np.ones((C, P)), np.array([1.0, np.inf])), ValueError, r"head bias contains NaN or Inf"),
    (torch.nn.Linear(P + 1, C), ValueError, r"head weight has 5 input columns"),
    ((np.ones((C, P)), np.ones(C), np.ones(C)), ValueError, r"head_weights must be \(W, b\)"),
    ("not a head", TypeError, r"head weight is not a float array"),
])
def test_bad_head(head, exc, pattern):
    m = richness.Moments()
    m.update(X, F)
    before = m.state_dict()
    with pytest.raises(exc, match=pattern):
        m.compute(head_weights=head)
    assert states_equal(m.state_dict(), before)


def test_bad_compute_arguments():
    m = richness.Moments()
    m.update(X, F)
    other = richness.Moments()
    other.update(X[:, :3])
    before, before_other = m.state_dict(), other.state_dict()
    with pytest.raises(ValueError, match=r"rtol must be a number in \(0, 1\)"):
        m.compute(rtol=2.0)
    with pytest.raises(ValueError, match=r"rtol"):
        m.compute(rtol=0.0)
    with pytest.raises(TypeError, match=r"test must be a Moments"):
        m.compute(test=X)
    with pytest.raises(ValueError, match=r"test state has 3 features, the training state 4"):
        m.compute(test=other)
    narrow = richness.Moments()
    narrow.update(X, F[:, :1])  # another output width: not the same learned functions
    with pytest.raises(ValueError, match=rf"test state has 1 outputs, the training state {F.shape[1]}"):
        m.compute(test=narrow)
    targets = richness.Moments()
    targets.update(X, F, targets=F[:, 0])  # targets the training state never streamed
    with pytest.raises(ValueError, match=r"test state has 1 targets, the training state no targets"):
        m.compute(test=targets)
    # head weights: the outputs are unused
    assert m.compute(test=narrow, head_weights=np.ones((2, X.shape[1]))).test_utilization is not None
    tiny = richness.Moments()
    tiny.update(X[:1], F[:1])
    with pytest.raises(ValueError, match=r"test state needs at least 2 samples"):
        m.compute(test=tiny)
    with pytest.raises(ValueError, match=r"test state needs at least 2 samples, got n = 0"):
        m.compute(test=richness.Moments())
    assert states_equal(m.state_dict(), before)
    assert states_equal(other.state_dict(), before_other)


def test_constructor_arguments():
    with pytest.raises(ValueError, match=r"num_classes"):
        richness.Moments(num_classes=0)
    with pytest.raises(ValueError, match=r"num_classes"):
        richness.Moments(num_classes=2.5)
    with pytest.raises(ValueError, match=r"precision"):
        richness.Moments(precision="fp16")
    with pytest.raises(ValueError, match=r"needs device='cuda'"):
        richness.Moments(device="cpu", precision="tf32")
    with pytest.raises(ValueError, match=r"device"):
        richness.Moments(device="tpu")


def test_stack_rows_is_a_cuda_option():
    # The CPU backend has no staging: a clear error, raised before any state exists.
    for bad in (-1, 2.5, True, "1024", 2**31):
        with pytest.raises(ValueError, match=r"stack_rows must be an integer"):
            richness.CudaOptions(stack_rows=bad)
    staged = richness.CudaOptions(stack_rows=1024)
    with pytest.raises(ValueError, match=r"CudaOptions\(stack_rows=...\) is an option of the CUDA backend"):
        richness.Moments(device="cpu", cuda=staged)
    m = richness.Moments(cuda=staged)  # device from the first batch
    with pytest.raises(ValueError, match=r"CudaOptions\(stack_rows=...\) is an option of the CUDA backend"):
        m.update(X, F)
    assert m.device is None and m.n == 0
    with pytest.raises(ValueError, match=r"CudaOptions\(stack_rows=...\) is an option of the CUDA backend"):
        m.load_state_dict(started().state_dict())
    assert m.n == 0
    off = richness.Moments(device="cpu", cuda=richness.CudaOptions(stack_rows=0))  # 0 = off, the default
    off.update(X, F)
    assert off.n == N


def test_dlr_needs_outputs_or_head():
    with pytest.raises(ValueError, match=r"needs outputs or head_weights"):
        richness.dlr(X)


# -- merge errors --------------------------------------------------------------------------

def test_bad_merges_leave_state():
    m = started()
    before = m.state_dict()
    narrow = richness.Moments()
    narrow.update(X[:, :3], F, labels=Y)
    no_outputs = richness.Moments()
    no_outputs.update(X, labels=Y)
    wide_out = richness.Moments()
    wide_out.update(X, np.hstack([F, F[:, :1] ** 2]), labels=Y)
    cases = [
        (narrow, ValueError, r"cannot merge: states hold different feature widths \[3, 4\] \(-1 = not streamed\)"),
        (no_outputs, ValueError, r"cannot merge: states hold different output widths \[-1, 2\]"),
        (wide_out, ValueError, r"cannot merge: states hold different output widths \[2, 3\]"),
        ("not a Moments", TypeError, r"merge expects a Moments"),
    ]
    for other, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            m.merge(other)
        assert states_equal(m.state_dict(), before)
    capped = richness.Moments(num_classes=2)
    capped.update(X, F, labels=Y % 2)
    capped_before = capped.state_dict()
    with pytest.raises(ValueError, match=r"class"):
        capped.merge(m)  # m has 3 classes
    assert states_equal(capped.state_dict(), capped_before)


# -- load_state_dict ------------------------------------------------------------------------

def mutated(state, **changes):
    s = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in state.items()}
    for k, v in changes.items():
        if v is None:
            del s[k]
        else:
            s[k] = v
    return s


def test_bad_state_dicts_leave_state():
    m = started()
    good = m.state_dict()
    nan_M = good["M"].copy()
    nan_M[0, 0] = np.nan
    counts = good["class_counts"].copy()
    counts[0] += 1
    cases = [
        (mutated(good, M=None), ValueError, r"missing entries: M"),
        (mutated(good, M=good["M"][:3, :3]), ValueError, r"'M' has shape \(3, 3\), expected \(4, 4\)"),
        (mutated(good, B=good["B"][:, :1]), ValueError, r"'B' has shape"),
        (mutated(good, M=nan_M), ValueError, r"'M' contains NaN or Inf"),
        (mutated(good, n=float(N)), TypeError, r"'n' must be an integer"),
        (mutated(good, p=True), TypeError, r"'p' must be an integer"),
        (mutated(good, class_counts=counts), ValueError, r"class counts do not add up to n"),
        (mutated(good, precision="fp8"), ValueError, r"precision"),
        ([("n", 3)], TypeError, r"state must be a dict"),
    ]
    for state, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            m.load_state_dict(state)
        assert states_equal(m.state_dict(), good)
    fixed = richness.Moments(num_classes=5)
    with pytest.raises(ValueError, match=r"num_classes"):
        fixed.load_state_dict(good)
    assert fixed.n == 0 and fixed.num_classes == 5


def test_load_state_dict_round_trip():
    m = started()
    other = richness.Moments()
    other.load_state_dict(m.state_dict())
    assert states_equal(other.state_dict(), m.state_dict())
    assert other.compute().dlr == m.compute().dlr


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, N - 1), st.integers(0, P - 1),
                          st.sampled_from([np.nan, np.inf, -np.inf])), min_size=1, max_size=12),
       st.sampled_from([np.float64, np.float32, np.float16]))
def test_nonfinite_count_is_exact(cells, dtype):
    bad = X.astype(dtype)
    for i, j, v in cells:
        bad[i, j] = v
    count = len({(i, j) for i, j, _ in cells})
    m = started()
    before = m.state_dict()
    word = "value" if count == 1 else "values"
    with pytest.raises(ValueError, match=rf"features contain {count} non-finite {word}\b"):
        m.update(bad, F, labels=Y)
    assert states_equal(m.state_dict(), before)


def test_state_dict_precision_must_be_a_known_name():
    m = started()
    good = m.state_dict()
    with pytest.raises(TypeError, match=r"'precision' must be a string"):
        m.load_state_dict(mutated(good, precision=1))
    with pytest.raises(ValueError, match=r"'precision' is 'fp8'"):
        m.load_state_dict(mutated(good, precision="fp8"))
    assert states_equal(m.state_dict(), good)


def test_state_dict_is_a_copy():
    m = started()
    st = m.state_dict()
    keep = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in st.items()}
    st["M"][:] = 0.0
    st["mean"][:] = np.nan
    st["class_counts"][:] = 0
    assert states_equal(m.state_dict(), keep)


def test_reset_keeps_num_classes():
    m = richness.Moments(num_classes=3)
    m.update(X, labels=Y)
    m.reset()
    assert m.n == 0 and m.num_classes == 3
    with pytest.raises(ValueError, match=r"labels out of range: label 3 .*num_classes=3"):
        m.update(X, labels=np.full(N, 3))
    assert m.n == 0


def test_huge_label_without_num_classes_is_refused_before_allocating():
    import numpy as np

    import richness

    m = richness.Moments()
    x = np.random.default_rng(0).normal(size=(3, 64))
    m.update(x, labels=np.array([0, 1, 2]))
    before = m.state_dict()
    with pytest.raises(ValueError, match=r"label 100000000 at row 1 would grow the class sums past 1 GiB"):
        m.update(x, labels=np.array([0, 10**8, 2]))
    after = m.state_dict()
    assert after["k"] == before["k"] == 3
    assert np.array_equal(after["class_sums"], before["class_sums"])
    # with num_classes given, a large class count is the user's choice
    big = richness.Moments(num_classes=3_000_000)
    big.update(np.ones((2, 1)) * [[1.0], [2.0]], labels=np.array([0, 2_999_999]))
    assert big.state_dict()["class_counts"][2_999_999] == 1


# -- memory ---------------------------------------------------------------------------------

def test_out_of_memory_first_batch_leaves_moments_fresh():
    # num_classes=10**12 asks for 3.2e13 bytes of class sums: refused before anything is recorded
    m = richness.Moments(num_classes=10**12)
    fresh = m.state_dict()
    with pytest.raises(MemoryError, match=r"class sums for 1000000000000 classes of 3\.2e\+13 bytes"):
        m.update(X, F, labels=Y)
    assert states_equal(m.state_dict(), fresh)
    assert m.n == 0
    m.update(X, F)  # the next update starts the state afresh
    assert abs(m.compute().dlr - dlr_naive(X, F)[0]) < 1e-12


@pytest.mark.skipif(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") > 4e11,
                    reason="this machine could hold a p = 200,000 state")
def test_too_wide_is_refused_with_its_byte_count():
    m = richness.Moments()
    with pytest.raises(MemoryError, match=r"p=200000 holds a p x p float64 matrix of 3\.2e\+11 bytes"):
        m.update(np.zeros((2, 200_000), np.float32))
    assert m.n == 0
    m.update(X, F)
    assert abs(m.compute().dlr - dlr_naive(X, F)[0]) < 1e-12


ALLOCATION_FAILS = """
import resource, numpy as np, richness
rng = np.random.default_rng(0)
m = richness.Moments()
m.update(rng.normal(size=(50, 3)), rng.normal(size=(50, 2)))
data = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmData")][0]
# ulimit -d: the memory check (MemAvailable, the address-space limit) passes, the allocation of the
# state at p = 12,000 (1.2 GB) fails
resource.setrlimit(resource.RLIMIT_DATA, (data + 300_000_000, resource.RLIM_INFINITY))
fresh = richness.Moments()
try:
    fresh.update(np.zeros((2, 12_000), np.float32) + np.arange(2.0)[:, None])
    print("allocated")
except MemoryError as e:
    print("MemoryError:", e)
assert fresh.n == 0 and fresh.state_dict()["p"] == -1
fresh.update(rng.normal(size=(20, 3)), rng.normal(size=(20, 2)))  # no segfault: widths were never recorded
assert fresh.n == 20 and fresh.state_dict()["p"] == 3
print("ok")
"""


def test_failed_allocation_records_no_width():
    # Under a ulimit -d the memory check passes and an allocation fails: p must not stay set without
    # arrays behind it (the next update used to segfault), and the MemoryError says what happened.
    out = subprocess.run([sys.executable, "-c", ALLOCATION_FAILS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "ok"
    assert lines[0].startswith("MemoryError: the core could not allocate memory although the memory check passed")


def test_cuda_options_are_checked():
    for bad in ("tiles:16x", "Tiles", 16, ("tiles", 16)):
        with pytest.raises(ValueError, match="product must be None or an algorithm's name"):
            richness.CudaOptions(product=bad)
    with pytest.raises(ValueError, match=r"CudaOptions\(product=...\) is an option of the CUDA backend"):
        richness.Moments(device="cpu", cuda=richness.CudaOptions(product="tiles:16"))
    m = richness.Moments(cuda=richness.CudaOptions(product="gemm"))  # device from the first batch: refused then
    with pytest.raises(ValueError, match=r"CudaOptions\(product=...\) is an option of the CUDA backend"):
        m.update(np.ones((4, 3)) * np.arange(4)[:, None])
    assert m.n == 0 and m.device is None and m.staged_rows == 0
