"""One Moments shared by several threads: updates from 4 threads give the serial state, and a
reader sees only whole batches."""

import threading

import numpy as np

import richness
from reference import center_rows, one_hot

P, C, K = 6, 2, 5


def batches(rng, count=16):
    out = []
    for n in rng.integers(1, 1500, size=count):
        X = rng.normal(size=(n, P)) * 3.0 + rng.normal(size=P)
        out.append((X, X[:, :C] ** 2 + rng.normal(size=(n, C)), rng.integers(0, K, size=n)))
    return out


def run_threads(fns):
    start = threading.Barrier(len(fns))
    errors = []

    def wrap(fn):
        def go():
            start.wait()
            try:
                fn()
            except Exception as e:  # reported in the main thread
                errors.append(e)
        return go

    threads = [threading.Thread(target=wrap(fn)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_four_threads_give_the_serial_state():
    rng = np.random.default_rng(0)
    for _ in range(50):
        data = batches(rng)
        # device given: the backend exists before the threads start (its lazy creation on a first
        # update is Python-side and not locked)
        m = richness.Moments(device="cpu")

        def feed(part):
            def go():
                for X, F, y in part:
                    m.update(X, F, labels=y)
            return go

        run_threads([feed(data[i::4]) for i in range(4)])
        X = np.vstack([b[0] for b in data])
        F = np.vstack([b[1] for b in data])
        y = np.concatenate([b[2] for b in data])
        st = m.state_dict()
        # independent float64 reference from all rows at once (merge order moves only rounding)
        Xc, Fc = center_rows(X), center_rows(F)
        assert st["n"] == X.shape[0]
        np.testing.assert_allclose(st["mean"], X.mean(0), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(st["M"], Xc.T @ Xc, rtol=1e-12, atol=1e-12 * np.abs(Xc.T @ Xc).max())
        np.testing.assert_allclose(st["B"], Xc.T @ Fc, rtol=1e-12, atol=1e-12 * np.abs(Xc.T @ Fc).max())
        np.testing.assert_allclose(st["A"], Fc.T @ Fc, rtol=1e-12, atol=1e-12 * np.abs(Fc.T @ Fc).max())
        assert np.array_equal(st["class_counts"], np.bincount(y, minlength=st["k"]))
        np.testing.assert_allclose(st["class_sums"], one_hot(y, st["k"]).T @ X, rtol=1e-12, atol=1e-9)


def test_reader_sees_whole_batches():
    rng = np.random.default_rng(1)
    data = batches(rng, count=64)
    sizes = {0}
    m = richness.Moments(num_classes=K, device="cpu")
    done = threading.Event()
    seen = []

    def feed(part):
        def go():
            for X, F, y in part:
                m.update(X, F, labels=y)
        return go

    def read():
        while True:
            finished = done.is_set()  # then this read comes after the last update
            st = m.state_dict()
            n = st["n"]
            # a snapshot between whole batches: counts, class sums and the mean agree with n
            assert st["class_counts"].sum() == n
            if n:
                np.testing.assert_allclose(st["class_sums"].sum(0) / n, st["mean"], rtol=1e-9, atol=1e-9)
                assert (np.diag(st["M"]) >= 0).all()
            seen.append(n)
            if finished and len(seen) >= 5:
                return

    reader_errors = []

    def guarded_read():
        try:
            read()
        except Exception as e:  # reported in the main thread
            reader_errors.append(e)

    reader = threading.Thread(target=guarded_read)
    reader.start()
    try:
        run_threads([feed(data[i::4]) for i in range(4)])
    finally:
        done.set()
        reader.join()
    assert not reader_errors, reader_errors
    total = sum(b[0].shape[0] for b in data)
    assert m.n == total and seen[-1] == total
    # every n the reader saw is a sum of whole batches
    for X, _, _ in data:
        sizes |= {s + X.shape[0] for s in sizes}
    assert set(seen) <= sizes


def test_objects_updated_from_several_threads_at_once_keep_their_serial_bits():
    # Two core workers per update: one caller at a time holds the core's worker pool, the others
    # start threads of their own; either way the rows are split by the worker count alone, so
    # every object's state must equal, bit for bit, the one it gets when updated alone.
    from richness import _core

    rng = np.random.default_rng(1)
    data = [[(rng.standard_normal((1024, 300)).astype(np.float32) + 1.0,
              rng.standard_normal((1024, 4)).astype(np.float32), rng.integers(0, 5, 1024)) for _ in range(3)]
            for _ in range(4)]
    threads = _core.blas_get_num_threads()
    _core.blas_set_num_threads(2)
    try:
        def feed(m, part):
            for X, F, y in part:
                m.update(X, F, labels=y)

        serial = []
        for part in data:
            m = richness.Moments(device="cpu")
            feed(m, part)
            serial.append(m.state_dict())
        for _ in range(10):
            ms = [richness.Moments(device="cpu") for _ in data]
            run_threads([lambda m=m, part=part: feed(m, part) for m, part in zip(ms, data)])
            for m, want in zip(ms, serial):
                got = m.state_dict()
                assert all(np.array_equal(got[k], want[k]) for k in want if isinstance(want[k], np.ndarray))
    finally:
        _core.blas_set_num_threads(threads)


def test_updates_alternating_worker_counts_keep_each_counts_bits():
    # The core's worker pool grows to the widest job and runs narrower ones on some of its
    # threads: each worker count must give its own bits, whatever ran before it.
    from richness import _core

    rng = np.random.default_rng(2)
    X = rng.standard_normal((1024, 300)).astype(np.float32) + 1.0
    F = rng.standard_normal((1024, 4)).astype(np.float32)
    threads = _core.blas_get_num_threads()
    try:
        want = {}
        for w in (2, 3, 4):
            _core.blas_set_num_threads(w)
            m = richness.Moments()
            m.update(X, F)
            want[w] = m.state_dict()
        for i in range(90):
            w = (4, 2, 3, 2, 4, 3)[i % 6]
            _core.blas_set_num_threads(w)
            m = richness.Moments()
            m.update(X, F)
            got = m.state_dict()
            assert all(np.array_equal(got[k], want[w][k]) for k in got if isinstance(got[k], np.ndarray)), (i, w)
    finally:
        _core.blas_set_num_threads(threads)


def test_first_updates_from_several_threads_create_one_backend():
    """A Moments without a device creates its backend on the first batch: threads
    racing on that first batch must all land in one state (and groups keep every
    batch)."""
    import sys

    rng = np.random.default_rng(11)
    batches = [rng.normal(size=(int(rng.integers(1, 40)), 3)) for _ in range(8)]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: the race shows within a few repetitions
    try:
        _race(batches)
    finally:
        sys.setswitchinterval(old)


def _race(batches):
    for reps in range(30):
        for kw in ({}, {"groups": 3}):
            m = richness.Moments(**kw)
            start = threading.Barrier(len(batches))

            def work(x, m=m, start=start):
                start.wait()
                m.update(x)

            threads = [threading.Thread(target=work, args=(x,)) for x in batches]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            X = np.concatenate(batches)
            assert m.n == X.shape[0]
            Xc = X - X.mean(0)
            np.testing.assert_allclose(m.state_dict()["M"], Xc.T @ Xc, rtol=1e-12, atol=1e-12)


# -- inputs whose values a conversion would silently change or cannot reach ---------------------


def _unreadable_kinds():
    """(what, make(dense array) -> the input, expected message)."""
    out = [("numpy masked array", lambda a: np.ma.masked_array(a, mask=np.zeros(a.shape, bool)),
            "numpy masked array; its mask would be ignored")]
    try:
        import scipy.sparse as sp

        out.append(("scipy.sparse", lambda a: sp.csr_matrix(a.reshape(len(a), -1)),
                    "scipy.sparse csr_matrix; pass a dense array"))
    except ImportError:
        pass
    try:
        import torch

        out.append(("meta tensor", lambda a: torch.tensor(a).to("meta"), "tensor on the meta device"))
        out.append(("sparse tensor", lambda a: torch.tensor(a).to_sparse(), "sparse torch tensor"))
    except ImportError:
        pass
    return out


def test_unreadable_inputs_are_refused_and_change_nothing():
    import pytest

    rng = np.random.default_rng(1)
    X, F = rng.normal(size=(30, P)), rng.normal(size=(30, C))
    y = rng.integers(0, K, 30)
    W = rng.normal(size=(C, P))
    for what, make, why in _unreadable_kinds():
        m = richness.Moments(num_classes=K)
        m.update(X, F, labels=y)
        before = m.state_dict()
        for call in (lambda: m.update(make(X)), lambda: m.update(X, make(F)),
                     lambda: m.update(X, F, labels=make(y)), lambda: m.compute(head_weights=make(W))):
            with pytest.raises(TypeError, match=why):
                call()
        after = m.state_dict()
        assert all(np.array_equal(before[k], after[k]) for k in before), what
