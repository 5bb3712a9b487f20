"""The compiled core under hostile conditions: a fork while another thread
updates, allocation failures under a memory limit, counters at the int64
limit, inputs changed by another thread during an update, and constructor
arguments out of range. Each refusal leaves the state as it was."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import richness
from richness import _core

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and RLIMIT_AS: Linux")


def run_script(code: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


FORK_WHILE_UPDATING = """
    import os, sys, threading, time
    import numpy as np
    import richness
    from richness import _core
    _core.blas_set_num_threads(2)
    m = richness.Moments()
    x = np.random.default_rng(0).standard_normal((4096, 96))
    y = np.random.default_rng(1).integers(0, 5, 4096)
    m.update(x[:10], labels=y[:10])
    stop = False
    def hammer():
        while not stop:
            m.update(x, labels=y)
    th = threading.Thread(target=hammer)
    th.start()
    time.sleep(0.2)
    children = []
    for _ in range(8):
        pid = os.fork()
        if pid == 0:  # the child: the object must take one more batch and stay whole
            n = m.n
            m.update(x[:100], labels=y[:100])
            st = m.state_dict()
            ok = m.n == n + 100 and int(st["class_counts"].sum()) == m.n and np.isfinite(st["M"]).all()
            os._exit(0 if ok else 1)
        children.append(pid)
        time.sleep(0.05)
    stop = True
    th.join()
    codes = []
    deadline = time.monotonic() + 30
    for pid in children:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes.append(os.waitstatus_to_exitcode(status))
                break
            if time.monotonic() > deadline:  # hung: the mutex was copied locked
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                codes.append("hung")
                break
            time.sleep(0.05)
    print("codes", codes)
    sys.exit(0 if codes == [0] * len(children) else 3)
"""


def test_fork_while_another_thread_updates_leaves_a_usable_object_in_the_child():
    r = run_script(FORK_WHILE_UPDATING, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "codes [0, 0, 0, 0, 0, 0, 0, 0]" in r.stdout


UNDER_A_MEMORY_LIMIT = """
    import resource, sys
    import numpy as np
    import richness
    from richness import _core
    _core.blas_set_num_threads(4)  # worker threads: each must start, or fail, without ending the process
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((4096, p)) for p in (64, 256, 768, 1536)]
    labels = rng.integers(0, 7, 4096)
    def vm():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm() + {margin}, resource.RLIM_INFINITY))
    refused = 0
    for x in inputs:
        for groups in (None, 3):
            m = richness.Moments(groups=groups)
            try:
                m.update(x[:64], labels=labels[:64])
            except MemoryError:
                refused += 1
                continue
            try:
                m.update(x, labels=labels)
            except MemoryError as e:
                refused += 1
                assert m.n == 64, m.n  # a refused batch changes nothing
    try:  # the most groups allowed, each a whole p = 1536 state: far past the limit
        richness.Moments(groups=1024).update(inputs[3])
    except MemoryError:
        refused += 1
    print("MemoryError", refused)
"""


@pytest.mark.parametrize("margin_mb", [24, 48, 96])
def test_allocation_failures_become_memory_error(margin_mb):
    for _ in range(2):
        r = run_script(UNDER_A_MEMORY_LIMIT.replace("{margin}", str(margin_mb << 20)), timeout=240)
        assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
        assert "MemoryError" in r.stdout
        assert int(r.stdout.split("MemoryError")[1].split()[0]) >= 1


def _arrays(st):
    return {k: np.array(v) for k, v in st.items() if isinstance(v, np.ndarray)}


def test_sample_count_refuses_to_wrap_around_int64():
    m = richness.Moments()
    rng = np.random.default_rng(3)
    m.update(rng.standard_normal((8, 3)), labels=rng.integers(0, 2, 8))
    with pytest.raises(ValueError, match=r"sample count would pass 2\*\*63 - 1") as info:
        for _ in range(64):
            before = _arrays(m.state_dict())
            n = m.n
            m.merge(m)
    assert "nothing was merged" in str(info.value)
    assert m.n == n > 2**61  # the last merge that fitted was applied, the refused one not
    after = _arrays(m.state_dict())
    for k, v in before.items():
        assert np.array_equal(v, after[k]), k
    assert int(after["class_counts"].sum()) == m.n


def test_an_update_past_the_int64_count_is_refused():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1024, 3))
    acc, d = richness.Moments(), richness.Moments()
    d.update(x)  # 2**10 samples, doubled below: acc ends at 2**10 + ... + 2**62 = 2**63 - 2**10
    for k in range(10, 63):
        acc.merge(d)
        if k < 62:
            d.merge(d)
    assert acc.n == 2**63 - 2**10
    before = _arrays(acc.state_dict())
    with pytest.raises(ValueError, match="sample count would pass.*the batch was not added"):
        acc.update(x)
    assert acc.n == 2**63 - 2**10
    for k, v in _arrays(acc.state_dict()).items():
        assert np.array_equal(v, before[k]), k
    acc.update(x[:1023])  # the last batch that fits
    assert acc.n == 2**63 - 1


def test_the_many_state_merge_refuses_a_count_past_int64():
    from richness import _state

    m = richness.Moments()
    rng = np.random.default_rng(7)
    m.update(rng.standard_normal((16, 3)))  # no labels: labelled merges stop at 2**53 (test_state_checks)
    for _ in range(58):
        m.merge(m)  # n = 2**62
    st = m.state_dict()
    with pytest.raises(ValueError, match=r"sample count would pass 2\*\*63 - 1.*nothing was merged"):
        _state.merge([st, st])
    half = _state.merge([st, _state.empty()])
    assert half["n"] == 2**62


@contextlib.contextmanager
def _flipping(x):
    """Another thread flips one value of ``x`` between 1.0 and NaN: each read
    of it sees either, independently."""
    stop = threading.Event()

    def flip():
        while not stop.is_set():
            x[12345, 2] = np.nan
            x[12345, 2] = 1.0

    th = threading.Thread(target=flip)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()


def test_labels_and_features_changed_by_another_thread_never_reach_the_state(tmp_path):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((40000, 8))
    y = rng.integers(0, 4, 40000)
    m = richness.Moments(num_classes=4)
    accepted = refused = 0
    deadline = time.monotonic() + 120
    with _flipping(x):  # until both outcomes were seen (the flipping thread may be starved for a while)
        while (accepted < 20 or refused == 0) and time.monotonic() < deadline:
            try:
                m.update(x, labels=y)
                accepted += 1
            except ValueError:
                refused += 1
    st = m.state_dict()
    for k, v in _arrays(st).items():
        assert np.isfinite(v).all(), k
    assert accepted > 0 and refused > 0
    assert int(st["class_counts"].sum()) == m.n == 40000 * accepted
    path = tmp_path / "raced.npz"
    m.save(path)
    back = richness.Moments.load(path)
    assert np.array_equal(back.state_dict()["class_sums"], st["class_sums"])


def test_a_first_batch_changed_by_another_thread_never_reaches_the_state():
    """The first batch of a state (its width not yet set) is checked like the
    others: class sums formed from a value another thread turned into NaN are
    refused, not merged into the new state."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((40000, 8))
    y = rng.integers(0, 4, 40000)
    accepted = refused = 0
    bad = []
    deadline = time.monotonic() + 120
    with _flipping(x):
        while (accepted < 200 or refused == 0) and time.monotonic() < deadline:
            m = richness.Moments(num_classes=4)
            try:
                m.update(x, labels=y)
            except ValueError:
                refused += 1
                assert m.n == 0
                continue
            accepted += 1
            bad += [k for k, v in _arrays(m.state_dict()).items() if not np.isfinite(v).all()]
    assert accepted >= 200 and refused > 0
    assert bad == []


def test_class_sums_are_the_float64_sums_of_each_class():
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((3000, 5)) * 10 + 3).astype(np.float32)
    y = rng.integers(0, 6, 3000)
    m = richness.Moments()
    m.update(x[:1000], labels=y[:1000])
    m.update(x[1000:], labels=y[1000:])
    ref = np.zeros((6, 5))
    np.add.at(ref, y, x.astype(np.float64))
    st = m.state_dict()
    np.testing.assert_allclose(st["class_sums"], ref, rtol=1e-13, atol=1e-10)
    assert list(st["class_counts"]) == list(np.bincount(y, minlength=6))


@pytest.mark.parametrize("bad", [2**63, 0, -2, True, 1.5, "3"])
def test_num_classes_out_of_range_is_named(bad):
    with pytest.raises(ValueError, match=r"num_classes must be an integer from 1 to 2\*\*63 - 1"):
        _core.CpuMoments(bad)
    with pytest.raises(ValueError, match=r"num_classes must be an integer from 1 to 2\*\*63 - 1"):
        richness.Moments(num_classes=bad)


def test_num_classes_accepts_numpy_integers():
    assert richness.Moments(num_classes=np.int64(2**63 - 1)).num_classes == 2**63 - 1
    assert _core.CpuMoments(np.int32(7)).shape()["num_classes"] == 7
