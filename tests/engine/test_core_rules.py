"""The rules the compiled core and Python must both know, checked on
generated cases: which states merge (one home, the core's
``Moments::check_compatible_for_merge``, which ``_state.check_compatible``
and both backends ask), which states the core imports (``State::check_consistent``
against Python's validator ``_state.checked``, on the rules both check), the
memory model (one home, ``_core.available_memory``), and the structured input
errors the command line reads (``_core.InputError``)."""

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest

import richness
from richness import _state
from richness._engine import bounded_io as _bounded_io
from richness._native import _core

WIDTH_KEYS = ("n", "p", "c", "t", "k", "num_classes")
INT64_MAX = 2**63 - 1


def _spec_compatible(metas):
    """The merge rule as specified (docs/MATH.md, "Merging states"): None when
    states of widths ``metas`` merge, else the reason."""
    fixed = sorted({m["num_classes"] for m in metas if m["num_classes"] >= 0})
    if len(fixed) > 1:
        return "num_classes"
    live = [m for m in metas if m["n"] > 0]
    for key in ("p", "c", "t"):
        if len({m[key] for m in live}) > 1:
            return key
    if len({m["k"] >= 0 for m in live}) > 1:
        return "labels"
    if fixed and max(m["k"] for m in metas) > fixed[0]:
        return "classes"
    if sum(m["n"] for m in live) > INT64_MAX:
        return "count"
    return None


def _random_widths(rng):
    n = int(rng.choice([0, 0, 1, 7, 2**62, INT64_MAX]))
    empty = n == 0 and rng.random() < 0.5
    w = {"n": n,
         "p": -1 if empty else int(rng.choice([1, 2, 3])),
         "c": -1 if empty else int(rng.choice([-1, -1, 2, 3])),
         "t": -1 if empty else int(rng.choice([-1, -1, 1, 2])),
         "k": -1 if empty else int(rng.choice([-1, -1, 1, 2, 4])),
         "num_classes": int(rng.choice([-1, -1, -1, 2, 3, 4]))}
    if empty and rng.random() < 0.3:  # a state without samples may still record classes
        w["k"] = int(rng.choice([0, 2, 5]))
    if w["num_classes"] >= 0 and w["k"] > w["num_classes"] and rng.random() < 0.8:
        w["k"] = w["num_classes"]  # mostly states that could exist; some that could not
    return w


def _refused(fn, *args):
    try:
        fn(*args)
    except ValueError as e:
        return str(e)
    return None


def test_generated_merge_cases_follow_the_one_rule():
    rng = np.random.default_rng(20)
    seen = {"accept": 0, "refuse": 0}
    for _ in range(4000):
        metas = [_random_widths(rng) for _ in range(int(rng.integers(1, 5)))]
        want = _spec_compatible(metas)
        core = _refused(_core.check_compatible_for_merge, metas)
        python = _refused(_state.check_compatible, metas)
        assert (core is None) == (want is None), (metas, want, core)
        assert python == core, metas  # one rule, one wording
        seen["accept" if want is None else "refuse"] += 1
    assert min(seen.values()) > 500, seen


def _state_of(w):
    """A state dict of widths ``w`` the core imports: zero co-moments, the
    samples in class 0."""
    st = {key: w[key] for key in WIDTH_KEYS}
    st["precision"] = "fp64"
    for f in _state.FIELDS:
        st[f.name] = np.zeros(_state.shape_of(f, w), dtype=f.dtype)
    if w["k"] > 0:
        st["class_counts"][0] = w["n"]
    return st


def test_both_cpu_merges_ask_the_rule_before_anything_changes():
    """CpuMoments.merge (State::merge) and merge_into refuse exactly the pairs
    the rule refuses, in its words, and change nothing then."""
    rng = np.random.default_rng(21)
    tried = 0
    while tried < 400:
        a, b = _random_widths(rng), _random_widths(rng)
        if any(w["n"] > 0 and w["k"] == 0 for w in (a, b)) or any(
                w["num_classes"] >= 0 and w["k"] > w["num_classes"] for w in (a, b)):
            continue  # no such state exists
        tried += 1
        want = _refused(_core.check_compatible_for_merge, [a, b])
        x, y = _core.CpuMoments(), _core.CpuMoments()
        x.set_state(_state_of(a))
        y.set_state(_state_of(b))
        got = _refused(x.merge, y)
        assert got == want or (want is None and got is not None and "overflow" not in got), (a, b, want, got)
        if got is not None:
            assert x.n == a["n"]


def _random_state(rng):
    """A state dict with zero co-moments (so Python's rules on values hold)
    whose widths, sizes and class counts may be off, as files and hand-made
    dicts are."""
    w = {"n": int(rng.choice([-1, 0, 0, 3, 10])),
         "p": int(rng.choice([-2, -1, 0, 1, 3])),
         "c": int(rng.choice([-2, -1, -1, 0, 2])),
         "t": int(rng.choice([-2, -1, -1, 0, 1])),
         "k": int(rng.choice([-2, -1, -1, 0, 2, 3])),
         "num_classes": int(rng.choice([-2, -1, -1, 0, 2, 4]))}
    st = {key: w[key] for key in WIDTH_KEYS}
    st["precision"] = "fp64"
    for f in _state.FIELDS:
        st[f.name] = np.zeros(_state.shape_of(f, w), dtype=f.dtype)
    if w["k"] > 0:
        counts = st["class_counts"]
        split = rng.random()
        if split < 0.6:
            counts[0] = max(w["n"], 0)
        elif split < 0.8:
            counts[:] = rng.integers(0, 4, counts.shape[0])
        else:
            counts[-1] = -1
    if rng.random() < 0.15:  # an array of another size
        f = _state.FIELDS[int(rng.integers(len(_state.FIELDS)))]
        st[f.name] = np.zeros([s + 1 for s in _state.shape_of(f, w)], dtype=f.dtype)
    return st


def test_generated_states_the_core_imports_are_those_python_accepts():
    """On the structural rules (widths in range, sizes, class counts adding up
    to n) both validators decide alike; Python's adds the rules on values."""
    rng = np.random.default_rng(22)
    seen = {"accept": 0, "refuse": 0}
    for _ in range(3000):
        st = _random_state(rng)
        try:
            _state.checked(st)
            python_ok = True
        except (TypeError, ValueError):
            python_ok = False
        core_ok = _refused(_core.check_state, st) is None
        assert core_ok == python_ok, {k: st[k] for k in WIDTH_KEYS}
        seen["accept" if python_ok else "refuse"] += 1
        if core_ok:  # and a backend takes it
            _core.CpuMoments().set_state(st)
    assert min(seen.values()) > 100, seen


@pytest.mark.parametrize("field, value", [("n", -1), ("p", 0), ("c", 0), ("num_classes", 0), ("k", -2)])
def test_set_state_refuses_an_inconsistent_state(field, value):
    st = _state_of({"n": 0, "p": -1, "c": -1, "t": -1, "k": -1, "num_classes": -1})
    st[field] = value
    m = _core.CpuMoments()
    with pytest.raises(ValueError, match="inconsistent state"):
        m.set_state(st)
    assert m.n == 0


def test_python_and_the_core_measure_memory_alike():
    assert _bounded_io.available_memory() == pytest.approx(_core.available_memory(), rel=0.05)
    assert _core.available_memory() > 0


@pytest.mark.parametrize("case", ["label_range", "label_growth", "nan_outputs", "nan_features", "wrong_width",
                                  "dtype", "stream_added"])
def test_input_errors_name_stream_row_and_limit(case):
    rng = np.random.default_rng(23)
    x, f = rng.standard_normal((6, 3)), rng.standard_normal((6, 2))
    y = np.array([0, 1, 2, 1, 0, 1])
    m = richness.Moments(num_classes=3 if case == "label_range" else None)
    if case in ("wrong_width", "stream_added"):
        m.update(x, f)
    expect = {"label_range": (_core.InputError, "labels", 4, "num_classes"),
              "label_growth": (_core.InputError, "labels", 2, "class growth"),
              "nan_outputs": (_core.InputError, "outputs", None, "finite"),
              "nan_features": (_core.InputError, "features", None, "finite"),
              "wrong_width": (_core.InputError, "outputs", None, None),
              "dtype": (_core.DTypeError, "outputs", None, None),
              "stream_added": (_core.InputError, "labels", None, None)}[case]
    with pytest.raises(expect[0]) as info:
        if case == "label_range":
            m.update(x, f, labels=np.array([0, 1, 2, 1, 3, 1]))
        elif case == "label_growth":
            m.update(x, f, labels=np.array([0, 1, 2**40, 1, 0, 1]))
        elif case == "nan_outputs":
            m.update(x, np.where(np.arange(2) == 1, np.nan, f))
        elif case == "nan_features":
            m.update(np.where(np.arange(3) == 0, np.inf, x), f)
        elif case == "wrong_width":
            m.update(x, np.hstack([f, f]))
        elif case == "dtype":
            batch = (x.ctypes.data, 6, 3, 3, "float64")
            _core.CpuMoments().update(batch, outputs=(y.ctypes.data, 6, 1, 1, "int64"))
        else:
            m.update(x, f, labels=y)
    e = info.value
    assert isinstance(e, ValueError if expect[0] is _core.InputError else TypeError)
    assert (e.stream, e.row, e.limit) == expect[1:], str(e)
    assert m.n == (6 if case in ("wrong_width", "stream_added") else 0)


def test_errors_of_the_batch_as_a_whole_name_no_stream():
    big = richness.Moments()
    x = np.ones((1, 2))
    st = _state_of({"n": INT64_MAX, "p": 2, "c": -1, "t": -1, "k": -1, "num_classes": -1})
    big.load_state_dict(st)
    with pytest.raises(_core.InputError) as info:
        big.update(x)
    assert (info.value.stream, info.value.row, info.value.limit) == (None, None, "int64")
    for cls in (_core.InputError, _core.DTypeError):  # the class has them too
        assert (cls.stream, cls.row, cls.limit) == (None, None, None)


def test_the_rule_refuses_any_order_of_the_same_states():
    rng = np.random.default_rng(24)
    for _ in range(300):
        metas = [_random_widths(rng) for _ in range(3)]
        verdicts = {_refused(_core.check_compatible_for_merge, list(p)) is None
                    for p in itertools.permutations(metas)}
        assert len(verdicts) == 1, metas


@pytest.mark.parametrize("bad, file", [("growth", "y.npy"), ("nan_outputs", "f.npy"), ("nan_features", "x.npy")])
def test_the_command_line_names_the_file_of_the_stream_the_core_names(tmp_path, capsys, bad, file):
    from richness.cli import main

    rng = np.random.default_rng(25)
    x, f = rng.standard_normal((40, 3)), rng.standard_normal((40, 2))
    y = rng.integers(0, 3, 40)
    if bad == "growth":
        y[30] = 2**40  # "label ... would grow the class sums": the labels' file, though the text starts "label "
    elif bad == "nan_outputs":
        f[12, 1] = np.nan
    else:
        x[5, 0] = np.inf
    for name, a in (("x.npy", x), ("f.npy", f), ("y.npy", y)):
        np.save(tmp_path / name, a)
    code = main(["eval", str(tmp_path / "x.npy"), "--outputs", str(tmp_path / "f.npy"),
                 "--labels", str(tmp_path / "y.npy")])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar
    assert code == 2
    assert err.startswith(f"richness: error: {tmp_path / file}: rows 0..39: "), err


HELD_SCRATCH = """
import resource
import numpy as np, richness
rng = np.random.default_rng(0)
X = rng.normal(size=(512, 1500)).astype(np.float32)
F = rng.normal(size=(512, 10)).astype(np.float32)
m = richness.Moments()
m.update(X, outputs=F)
m.update(X, outputs=F)
vm = [int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize")][0]
resource.setrlimit(resource.RLIMIT_AS, (vm + 4_000_000, resource.RLIM_INFINITY))
try:
    m.update(X, outputs=F)
    print("added", m.n)
except MemoryError as e:
    print("refused", e)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc: Linux")
def test_a_batch_that_reuses_the_scratch_it_holds_is_not_refused_for_it():
    """The memory model counts only the scratch a batch adds: a third batch of the same shape reuses
    the 12 MB the first allocated, so 4 MB of address space left is enough (it was refused, the held
    scratch counted as if it were new)."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", HELD_SCRATCH], capture_output=True, text=True, timeout=120, env=env)
    assert out.stdout.strip() == "added 1536", out.stdout + out.stderr
