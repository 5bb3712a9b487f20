"""State invariants: the one validator (``_state.checked``) that load,
``load_state_dict`` and the merges share accepts every state real updates and
merges produce, in every product precision and with groups, and refuses
impossible ones (negative variances, class sums that disagree with the mean,
counts that do not add up to n or wrap around int64, non-integer counts) with a
clear error that leaves the object exactly as it was."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import richness
from richness import _state
from richness._engine import statefile as _statefile
from reference import states_equal

P, C, T, K = 6, 3, 2, 4


def _data(seed, n, dtype=np.float64, offset=0.0, spread=1.0):
    rng = np.random.default_rng(seed)
    X = offset + spread * (rng.normal(size=(n, P)) @ rng.normal(size=(P, P)))
    F = X @ rng.normal(size=(P, C)) + np.sin(X[:, :C])
    return X.astype(dtype), F.astype(dtype), rng.integers(0, K, n), rng.normal(size=(n, T)).astype(dtype)


def _streamed(seed=0, batches=5, rows=40, dtype=np.float64, device="cpu", precision=None, groups=None,
              offset=0.0, spread=1.0, constant=False, num_classes=None):
    m = richness.Moments(num_classes, device=device, precision=precision, groups=groups)
    X, F, y, Tt = _data(seed, batches * rows, dtype, offset, spread)
    if constant:
        X[:, 0] = X.dtype.type(offset + 0.1)  # a constant feature: its variance is 0
    if device != "cpu":
        import torch

        X, F, Tt, y = (torch.as_tensor(a, device=device) for a in (X, F, Tt, y))
    for i in range(batches):
        s = slice(i * rows, (i + 1) * rows)
        m.update(X[s], F[s], labels=y[s], targets=Tt[s])
    return m


def _legit_states(device="cpu", precisions=("fp64", "fp32")):
    """States of real updates and merges: each product precision, float32 and
    float64 inputs, large means, constant features, many one-row batches, groups."""
    out = {}
    for prec in precisions:
        dtypes = (np.float64, np.float32) if prec == "fp64" else (np.float32,)
        for dt in dtypes:
            tag = f"{prec}-{np.dtype(dt).name}"
            out[tag] = _streamed(1, dtype=dt, device=device, precision=prec)
            out[tag + "-mean1e4"] = _streamed(2, dtype=dt, device=device, precision=prec, offset=1e4, spread=1e-2)
            out[tag + "-constant"] = _streamed(3, dtype=dt, device=device, precision=prec, constant=True,
                                               offset=3e3)
            out[tag + "-rows1"] = _streamed(4, batches=600, rows=1, dtype=dt, device=device, precision=prec,
                                            offset=50.0)
            g = _streamed(5, batches=7, dtype=dt, device=device, precision=prec, groups=3, num_classes=K + 2)
            out[tag + "-groups"] = g
            merged = _streamed(6, dtype=dt, device=device, precision=prec, offset=-7.0)
            merged.merge(out[tag])
            merged.merge(merged)
            out[tag + "-merged"] = merged
    return out


def _all_states(m):
    # The groups' and leave-one-out states have no public view (the jackknife
    # only reports what is computed from them); the invariants must hold for each.
    states = [{k: v for k, v in m.state_dict().items() if k != "groups"}]  # the state of all samples
    if m._groups is not None:
        states += m._backend.group_states() + m._backend.leave_one_out_states()
    return states


def _check_accepted(name, m):
    for st in _all_states(m):
        host = {k: (v.cpu().numpy() if hasattr(v, "cpu") else v) for k, v in st.items()}
        _state.validate(host)  # raises on a false alarm
        fresh = richness.Moments()
        fresh.load_state_dict(host)
        assert states_equal(fresh.state_dict(), host), name
    # the many-state merge validates its inputs, then merges them
    merged = _state.merge([_all_states(m)[0], _all_states(m)[0]])
    _state.validate(merged)


def test_real_states_pass_in_every_cpu_precision():
    for name, m in _legit_states().items():
        _check_accepted(name, m)


def test_real_states_pass_in_every_cuda_precision():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for name, m in _legit_states("cuda", ("fp64", "fp32", "tf32", "bf16")).items():
        _check_accepted(name, m)


# -- impossible states ---------------------------------------------------------


def _set(key, value):
    def edit(st):
        st[key] = value(st) if callable(value) else value
    return edit


def _negative_diag(field):
    def edit(st):
        a = st[field].copy()
        a[1, 1] = -0.5 * abs(a[1, 1]) - 1e-3
        st[field] = a
    return edit


def _class_sum_off(rel):
    def edit(st):
        s = st["class_sums"].copy()
        s[2, 3] += rel * np.abs(s[:, 3]).sum()
        st["class_sums"] = s
    return edit


def _counts(make):
    def edit(st):
        st["class_counts"] = make(st["class_counts"], st["n"])
    return edit


def _wrapping(c, n):
    # int64 values whose sum wraps around 2**64 to exactly n
    big = 2**63 - 1
    return np.array([big, big, n + 2] + [0] * (len(c) - 3), dtype=np.int64)


def _asymmetric(st):
    a = st["M"].copy()
    a[0, 2] += 1e-3 * np.abs(a).max()
    st["M"] = a


def _emptied_class(st):
    c = st["class_counts"].copy()
    c[2] += c[3]
    c[3] = 0  # the counts still add up to n and the sums to n times the mean
    st["class_counts"] = c


IMPOSSIBLE = {
    "negative variance in M": (_negative_diag("M"), ValueError, r"'M' has the negative variance"),
    "negative variance in A": (_negative_diag("A"), ValueError, r"'A' has the negative variance"),
    "negative variance in At": (_negative_diag("At"), ValueError, r"'At' has the negative variance"),
    "asymmetric M": (_asymmetric, ValueError, r"'M' is not symmetric"),
    "class sums off the mean": (_class_sum_off(1e-6), ValueError, r"class sums add up to .* feature 3"),
    "mean off the class sums": (_set("mean", lambda st: st["mean"] * (1 + 1e-5)), ValueError,
                                r"class_sums and mean do not belong together"),
    "counts short of n": (_counts(lambda c, n: c - np.eye(len(c), dtype=np.int64)[0]), ValueError,
                          r"class counts do not add up to n: they sum to 199, n is 200"),
    "counts wrapping int64 to n": (_counts(_wrapping), ValueError, r"class counts do not add up to n"),
    "negative count": (_counts(lambda c, n: c + np.array([-c[0] - 1, c[0] + 1] + [0] * (len(c) - 2))),
                       ValueError, r"'class_counts' has a negative count \(-1\)"),
    "float counts": (_counts(lambda c, n: c.astype(np.float64)), TypeError, r"'class_counts' must hold integers"),
    "fractional counts": (_counts(lambda c, n: c + np.array([0.5, -0.5] + [0] * (len(c) - 2))), TypeError,
                          r"must hold integers"),
    "uint64 count beyond int64": (_counts(lambda c, n: np.array([2**64 - 1] + [0] * (len(c) - 1), np.uint64)),
                                  ValueError, r"count beyond 2\*\*63 - 1"),
    "n beyond int64": (_set("n", np.uint64(2**63)), ValueError, r"'n' is 9223372036854775808, outside int64"),
    "n negative": (_set("n", -200), ValueError, r"n is negative \(-200\)"),
    "no samples but values": (_set("n", 0), ValueError, r"n=0 samples but nonzero mean, M, out_mean"),
    "a class of no samples with a sum": (_emptied_class, ValueError, r"class 3 has no samples but a nonzero"),
    "n a float": (_set("n", 200.0), TypeError, r"'n' must be an integer, got float"),
    "n a bool array": (_set("n", np.bool_(True)), TypeError, r"'n' must be an integer"),
    "num_classes zero": (_set("num_classes", 0), ValueError, r"num_classes=0"),
    "string floats": (_set("M", lambda st: st["M"].astype(str)), TypeError, r"'M' must hold real numbers"),
}


@pytest.mark.parametrize("name", sorted(IMPOSSIBLE))
def test_impossible_state_is_refused_and_nothing_changes(name, tmp_path):
    edit, kind, pattern = IMPOSSIBLE[name]
    src = _streamed(11, num_classes=K)  # n = 200
    st = src.state_dict()
    edit(st)
    target = _streamed(12, batches=2)
    before = target.state_dict()
    with pytest.raises(kind, match=pattern):
        target.load_state_dict(st)
    assert states_equal(target.state_dict(), before) and target.num_classes is None
    # the load of the library's own states (richness.dask) leaves out only the factorisations: refused too
    with pytest.raises(kind, match=pattern):
        target._load_own_state_dict(st)
    assert states_equal(target.state_dict(), before) and target.num_classes is None
    # the many-state merge refuses it too, before any arithmetic
    with pytest.raises(kind, match=pattern):
        _state.merge([before, st])
    # and a file holding it (intact archive, valid checksum) is refused on load, naming the file
    if kind is ValueError:
        path = tmp_path / "tampered.npz"
        _statefile.save_state(dict(st, **{k: int(st[k]) for k in _state.WIDTHS if isinstance(st[k], np.integer)}),
                       path)
        with pytest.raises(ValueError, match=r"tampered\.npz: (not a valid richness state .*" + pattern
                           + "|entry class_counts has dtype uint64)"):  # the file format holds int64 only
            richness.Moments.load(path)


def test_grouped_load_refuses_and_keeps_its_groups():
    g = _streamed(13, batches=6, groups=3)
    before = g.compute(uncertainty=True)  # the jackknife reads every group's state
    st = g.state_dict()
    _negative_diag("M")(st)
    with pytest.raises(ValueError, match="negative variance"):
        g.load_state_dict(st)
    after = g.compute(uncertainty=True)
    assert (after.dlr, after.dlr_stderr, after.dlr_jackknife) == (before.dlr, before.dlr_stderr, before.dlr_jackknife)
    assert states_equal(g.state_dict(), _streamed(13, batches=6, groups=3).state_dict())


@pytest.mark.parametrize("itype", [np.uint64, np.int32, np.uint16, np.int64, int])
def test_integer_widths_of_any_type_load_cleanly(itype):
    src = _streamed(14)
    st = src.state_dict()
    typed = dict(st, **{k: itype(st[k]) for k in ("n", "p", "c", "t", "k")})
    m = richness.Moments()
    m.load_state_dict(typed)
    assert states_equal(m.state_dict(), st)
    assert m.compute().dlr == src.compute().dlr
    assert _state.merge([typed, typed])["n"] == 2 * st["n"]


def test_unsigned_counts_in_range_load_cleanly():
    src = _streamed(15)
    st = src.state_dict()
    st["class_counts"] = st["class_counts"].astype(np.uint32)
    m = richness.Moments()
    m.load_state_dict(st)
    assert np.array_equal(m.state_dict()["class_counts"], src.state_dict()["class_counts"])


def test_many_state_merge_refuses_a_count_beyond_int64():
    m = richness.Moments()
    X = np.random.default_rng(0).normal(size=(30, P))
    m.update(X, X[:, :C])
    st = m.state_dict()
    st["n"] = 2**62  # a legal count on its own; three of them overflow int64
    _state.validate(st)
    with pytest.raises(ValueError, match=r"the sample count would pass 2\*\*63 - 1 \(13835058055282163712\)"):
        _state.merge([st, st, st])


def test_groups_beyond_the_cap_are_refused_before_allocation():
    # Under a 1 GiB address-space limit, k = 10**8 groups used to be built one
    # by one until the allocator failed (a MemoryError, or an abort from the core).
    code = textwrap.dedent("""
        import resource
        import numpy as np
        import richness
        from richness._engine.moments import MAX_GROUPS
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        for k in (10**8, MAX_GROUPS + 1, 0, True, 2.5):
            try:
                richness.Moments(groups=k)
            except ValueError as e:
                print("refused", k, "|", e)
        m = richness.Moments(groups=MAX_GROUPS)
        m.update(np.random.default_rng(0).normal(size=(8, 3)))
        print("ok", m.n)
    """)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 6 and lines[-1] == "ok 8"
    assert all(line.startswith("refused") for line in lines[:5])
    assert "groups must be an integer in [2, 1024] or None, got 100000000" in lines[0]


def test_many_state_merge_refuses_counts_past_float64_exactness():
    # The shift-and-sum merge adds counts in float64: past 2**53 labelled samples it would round them.
    src = _streamed(16, num_classes=K)
    st = src.state_dict()
    scale = 2**51 // st["n"]
    big = dict(st, n=st["n"] * scale, class_counts=st["class_counts"] * scale, class_sums=st["class_sums"] * scale,
               M=st["M"] * scale, B=st["B"] * scale, A=st["A"] * scale, Bt=st["Bt"] * scale, At=st["At"] * scale)
    _state.validate(big)
    assert _state.merge([big, big])["n"] == 2 * big["n"]
    with pytest.raises(ValueError, match=r"past 2\*\*53"):
        _state.merge([big] * 5)
