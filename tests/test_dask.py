"""richness.dask: the tree reduction on threads, processes and a real
distributed.LocalCluster (two worker processes), against the float64 n x n
oracles and a plain Moments; refusals before any work; a worker killed
mid-run."""

import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")
distributed = pytest.importorskip("distributed")
cloudpickle = pytest.importorskip("cloudpickle")

import richness  # noqa: E402
import richness.dask as rd  # noqa: E402
from reference import cka_debiased_naive, cka_naive, dlr_naive, nc1_naive, states_equal  # noqa: E402

ROWS, P, C, T = 2400, 16, 5, 2
STEP = 200  # rows per chunk: 12 chunks


def rows(i: int, n: int = STEP, delay: float = 0.0, die: bool = False):
    """Chunk i of the data set (the same rows wherever it is made); ``delay``
    slows it down, ``die`` ends the worker process that makes it."""
    if die:
        os._exit(1)
    if delay:
        time.sleep(delay)
    rng = np.random.default_rng(1000 + i)
    X = rng.normal(size=(n, P)) @ np.random.default_rng(7).normal(size=(P, P)) + 2.0
    F = X @ np.random.default_rng(8).normal(size=(P, C)) + 0.5 * rng.normal(size=(n, C))
    y = rng.integers(0, C, n)
    Y = rng.normal(size=(n, T))
    return np.hstack([X, F, y[:, None], Y])


def full(nchunks: int):
    a = np.vstack([rows(i) for i in range(nchunks)])
    return a[:, :P], a[:, P:P + C], a[:, P + C].astype(np.int64), a[:, P + C + 1:]


def as_dask(nchunks: int, delay: float = 0.0, die_at: int = -1):
    """The four streams as dask arrays of row chunks, each chunk made by a task."""
    blocks = [da.from_delayed(dask.delayed(rows)(i, STEP, delay, i == die_at), (STEP, P + C + 1 + T), np.float64)
              for i in range(nchunks)]
    a = da.concatenate(blocks)
    return a[:, :P], a[:, P:P + C], a[:, P + C].astype(np.int64), a[:, P + C + 1:]


def check(m, nchunks):
    X, F, y, Y = full(nchunks)
    assert m.n == X.shape[0]
    rep = m.compute()
    want, rank = dlr_naive(X, F)
    assert rep.rank == rank and abs(rep.dlr - want) <= 1e-12 * abs(want)
    assert abs(rep.nc1 - nc1_naive(X, y)) <= 1e-9 * rep.nc1
    st = m.state_dict()
    assert np.array_equal(st["class_counts"], np.bincount(y, minlength=C))
    Yc, Xc = Y - Y.mean(0), X - X.mean(0)
    assert np.abs(st["Bt"] - Xc.T @ Yc).max() <= 1e-10 * np.abs(Xc.T @ Yc).max()
    one = richness.Moments()
    one.update(X, F, labels=y, targets=Y)
    ref = one.state_dict()
    for key in ("mean", "M", "B", "A", "class_sums"):
        assert np.abs(st[key] - ref[key]).max() <= 1e-10 * max(np.abs(ref[key]).max(), 1.0), key


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this file
    # dask's scratch folders (the workers', the locks') in pytest's temporary tree, not a
    # dask-scratch-space left in the system's
    scratch = dask.config.set({"temporary-directory": str(tmp_path_factory.mktemp("dask"))})
    cluster = distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None,
                                       silence_logs=40)
    c = distributed.Client(cluster)
    yield c
    c.close()
    cluster.close()
    scratch.__exit__(None, None, None)
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.mark.parametrize("scheduler", ["sync", "threads", "processes"])
def test_local_schedulers_equal_the_reference(scheduler):
    X, F, y, Y = full(6)
    with dask.config.set(scheduler=scheduler):
        m = rd.moments(da.from_array(X, chunks=(STEP, -1)), da.from_array(F, chunks=(STEP, -1)),
                       da.from_array(y, chunks=STEP), da.from_array(Y, chunks=(STEP, -1)), split_every=2)
    check(m, 6)


def test_local_cluster_equals_the_reference_and_uses_both_workers(client):
    features, outputs, labels, targets = as_dask(12, delay=0.05)
    with distributed.get_task_stream(client) as ts:
        m = rd.moments(features, outputs, labels, targets, split_every=3, chunks_per_task=1)
    check(m, 12)
    chunk_workers = {t["worker"] for t in ts.data if str(t["key"]).startswith("('_chunk") or
                     str(t["key"]).startswith("_chunk")}
    assert len(chunk_workers) == 2 == len(client.scheduler_info()["workers"])
    # the tree: 12 chunk states, merged 3 at a time (4, then 2, then 1 merge task)
    combines = [t for t in ts.data if str(t["key"]).startswith("_combine")]
    assert len(combines) == 4 + 2 + 1


def test_grouped_chunks_give_the_same_state_from_fewer_tasks(client):
    features, outputs, labels, targets = as_dask(7)
    with distributed.get_task_stream(client) as ts:
        m = rd.moments(features, outputs, labels, targets, chunks_per_task=3, split_every=2)
    check(m, 7)
    assert len([t for t in ts.data if str(t["key"]).startswith("_chunk")]) == 3  # 3 + 3 + 1 chunks
    with pytest.raises(ValueError, match="chunks_per_task must be a positive integer"):
        rd.moments(features, chunks_per_task=0)


def test_fixed_classes_and_precision_pass_through(client):
    X, F, y, _ = full(3)
    m = rd.moments(da.from_array(X.astype(np.float32), chunks=(STEP, -1)), da.from_array(F, chunks=(STEP, -1)),
                   da.from_array(y, chunks=STEP), num_classes=9, precision="fp64")
    st = m.state_dict()
    assert st["num_classes"] == 9 and st["k"] == 9 and st["precision"] == "fp64"
    assert np.array_equal(st["class_counts"], np.bincount(y, minlength=9))
    want, _ = dlr_naive(X.astype(np.float32).astype(np.float64), F)
    assert abs(m.compute().dlr - want) <= 1e-12 * abs(want)


def test_misaligned_or_misshapen_inputs_are_refused_before_any_work():
    ran = []

    def touch(block):
        ran.append(block.shape)
        return block

    X, F, y, _ = full(2)
    feats = da.from_array(X, chunks=(STEP, -1)).map_blocks(touch, meta=np.empty((0, 0)))
    cases = [
        (dict(outputs=da.from_array(F, chunks=(150, -1))), ValueError, "outputs has row chunks (150, 150, 100)"),
        (dict(labels=da.from_array(y, chunks=100)), ValueError, "labels.rechunk({0: features.chunks[0]})"),
        (dict(outputs=F), TypeError, "outputs must be a dask array, got numpy.ndarray"),
        (dict(labels=da.from_array(y.astype(float), chunks=STEP)), TypeError, "labels must be integers"),
        (dict(outputs=da.from_array(F[:, :, None], chunks=(STEP, -1, -1))), ValueError, "outputs must be 1-D or 2-D"),
        (dict(split_every=1), ValueError, "split_every must be an integer >= 2"),
        (dict(num_classes=0), ValueError, "num_classes"),
    ]
    for kwargs, error, words in cases:
        with pytest.raises(error, match=None) as e:
            rd.moments(feats, **kwargs)
        assert words in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="chunked along its columns too"):
        rd.moments(da.from_array(X, chunks=(STEP, 8)).map_blocks(touch, meta=np.empty((0, 0))))
    unknown = da.from_array(X, chunks=(STEP, -1))
    unknown = unknown[unknown[:, 0] > -1e9]  # unknown row chunk sizes
    with pytest.raises(ValueError, match="compute_chunk_sizes"):
        rd.moments(unknown)
    assert ran == []


def test_a_bad_chunk_is_refused_naming_its_rows():
    X, F, _, _ = full(3)
    X = X.copy()
    X[450, 3] = np.nan
    with dask.config.set(scheduler="threads"), pytest.raises(ValueError, match="rows 400..599: .*NaN"):
        rd.moments(da.from_array(X, chunks=(STEP, -1)), da.from_array(F, chunks=(STEP, -1)))


def test_a_state_lost_in_the_tree_is_refused(monkeypatch):
    X, F, _, _ = full(4)
    real = rd._combine
    monkeypatch.setattr(rd, "_combine", lambda kind, states: real(kind, states[:-1]))  # drops a state
    with dask.config.set(scheduler="sync"), pytest.raises(RuntimeError, match="600 samples for 800 rows"):
        rd.moments(da.from_array(X, chunks=(STEP, -1)), da.from_array(F, chunks=(STEP, -1)), split_every=4,
                   chunks_per_task=1)


def test_the_reductions_own_states_skip_only_the_factorisations(monkeypatch):
    from richness import _state

    calls = {"gram": 0, "invariants": 0}
    real_gram, real_invariants = _state.check_gram, _state.check_invariants

    def gram(st):
        calls["gram"] += 1
        real_gram(st)

    def invariants(st, **kw):
        calls["invariants"] += 1
        real_invariants(st, **kw)

    monkeypatch.setattr(_state, "check_gram", gram)
    monkeypatch.setattr(_state, "check_invariants", invariants)
    X, F, y, Y = full(6)
    with dask.config.set(scheduler="sync"):
        m = rd.moments(da.from_array(X, chunks=(STEP, -1)), da.from_array(F, chunks=(STEP, -1)),
                       da.from_array(y, chunks=STEP), da.from_array(Y, chunks=(STEP, -1)), split_every=2,
                       chunks_per_task=1)
    # every chunk's state and the result were loaded through the O(p^2) checks, none factorised
    assert calls["gram"] == 0 and calls["invariants"] >= 7
    check(m, 6)
    # the same state handed in from outside gets the full check
    richness.Moments().load_state_dict(m.state_dict())
    assert calls["gram"] == 1


def test_a_thread_reuses_its_accumulator_and_each_state_is_its_own_rows():
    X, F, y, Y = full(3)
    parts = [slice(0, 200), slice(200, 600), slice(600, 650)]

    def alone(sl, **kw):
        one = richness.Moments(**kw)
        one.update(X[sl], F[sl], labels=y[sl], targets=Y[sl])
        return one.state_dict()

    held = []
    for sl in parts:  # a bigger chunk, then a smaller one, into the same accumulator
        st = rd._chunk(sl.start, [(X[sl], F[sl], y[sl], Y[sl])], None, None)
        assert states_equal(st, alone(sl))
        held.append(rd._WARM.held[1])
    assert held[0] is held[1] is held[2]
    bad = X[parts[0]].copy()
    bad[7, 1] = np.nan
    with pytest.raises(ValueError, match="rows 0..199: .*NaN"):
        rd._chunk(0, [(bad, F[parts[0]], y[parts[0]], Y[parts[0]])], None, None)
    sl = parts[1]  # a refused chunk leaves nothing behind for the next task
    assert states_equal(rd._chunk(200, [(X[sl], F[sl], y[sl], Y[sl])], None, None), alone(sl))
    # other options: another accumulator, made with them
    st = rd._chunk(200, [(X[sl], F[sl], y[sl], Y[sl])], 9, "fp64")
    assert st["num_classes"] == 9 and st["precision"] == "fp64"
    assert states_equal(st, alone(sl, num_classes=9, precision="fp64"))
    assert rd._WARM.held[1] is not held[0]


def test_chunks_are_read_in_their_tasks_one_at_a_time(monkeypatch):
    X, F, y, Y = full(6)
    log = []

    def logged_rows(i):
        log.append(("read", i))
        return rows(i)

    blocks = [da.from_delayed(dask.delayed(logged_rows)(i), (STEP, P + C + 1 + T), np.float64) for i in range(6)]
    a = da.concatenate(blocks)
    real_update, real_chunk = richness.Moments.update, rd._chunk
    tasks = []

    def update(self, *args, **kw):
        log.append(("update", args[0].shape[0]))
        return real_update(self, *args, **kw)

    def chunk(start, rows_, *args):
        tasks.append((start, type(rows_).__name__, len(rows_)))
        return real_chunk(start, rows_, *args)

    monkeypatch.setattr(richness.Moments, "update", update)
    monkeypatch.setattr(rd, "_chunk", chunk)
    with dask.config.set(scheduler="sync"):  # one worker thread: two tasks of three chunks
        m = rd.moments(a[:, :P], a[:, P:P + C], a[:, P + C].astype(np.int64), a[:, P + C + 1:])
    assert sorted(tasks) == [(0, "_Rows", 3), (600, "_Rows", 3)]
    # each chunk read once (all four arrays from one read), then added, before the next is read
    assert log[1::2] == [("update", STEP)] * 6 and sorted(log[0::2]) == [("read", i) for i in range(6)]
    reads = [i for _, i in log[0::2]]
    assert reads in ([0, 1, 2, 3, 4, 5], [3, 4, 5, 0, 1, 2])  # a task's chunks in order, one task after the other
    monkeypatch.undo()
    check(m, 6)


def test_blocks_shared_between_row_chunks_stay_dask_tasks(monkeypatch):
    X, F, _, _ = full(4)
    x = da.from_array(X, chunks=(STEP, -1))
    centered = x - x.mean(axis=0)  # every chunk needs the mean of all rows
    real_chunk = rd._chunk
    tasks = []

    def chunk(start, rows_, *args):
        tasks.append((start, type(rows_).__name__, len(rows_)))
        return real_chunk(start, rows_, *args)

    monkeypatch.setattr(rd, "_chunk", chunk)
    with dask.config.set(scheduler="sync"):
        m = rd.moments(centered, da.from_array(F, chunks=(STEP, -1)))
        assert [t[1:] for t in tasks] == [("list", 1)] * 4  # one chunk per task: a task would hold them all
        want, _ = dlr_naive(X - X.mean(0), F)
        assert m.n == 800 and abs(m.compute().dlr - want) <= 1e-12 * abs(want)
        tasks.clear()
        made = as_dask(4)[0]  # chunks made by tasks, then a rechunk across rows: the same
        rd.moments(made.rechunk((300, -1)))
        assert [t[1] for t in tasks] == ["list"] * 3
        tasks.clear()
        rd.moments(x.rechunk((300, -1)))  # across the slices of one small array: those are copied
        assert [t[1] for t in tasks] == ["_Rows"] * 2


class Store:
    """An array-like store (dask reads it by slices, through one node of the
    graph that every chunk's slice uses)."""

    def __init__(self, a):
        self.a, self.shape, self.dtype, self.ndim = a, a.shape, a.dtype, a.ndim

    def __getitem__(self, key):
        return self.a[key]


def test_a_small_store_every_chunk_slices_is_copied_into_the_tasks_a_large_one_is_not():
    X, F, _, _ = full(4)
    small = da.from_array(Store(X), chunks=(STEP, -1), inline_array=False)
    big = da.from_array(Store(np.vstack([X] * 90)[:, :P]), chunks=(STEP * 90, -1), inline_array=False)
    assert X.nbytes * 90 > rd.SHARED_BYTES > X.nbytes
    with dask.config.set(scheduler="sync"):
        groups = rd._groups([small], 1)
        assert [type(r).__name__ for _, r in groups] == ["_Rows"] * 4
        assert [type(r).__name__ for _, r in rd._groups([big], 1)] == ["list"] * 4
        m = rd.moments(small, da.from_array(F, chunks=(STEP, -1)))
    want, _ = dlr_naive(X, F)
    assert m.n == 800 and abs(m.compute().dlr - want) <= 1e-12 * abs(want)


def test_a_chunk_that_cannot_be_read_raises_the_readers_error():
    def unreadable(i):
        if i == 1:
            raise OSError(f"part {i}: no such file")
        return rows(i)[:, :P]

    x = da.concatenate([da.from_delayed(dask.delayed(unreadable)(i), (STEP, P), np.float64) for i in range(3)])
    with dask.config.set(scheduler="sync"), pytest.raises(OSError, match="part 1: no such file"):
        rd.moments(x)


def test_chunks_per_task_by_default_two_tasks_per_worker_thread(client):
    features, outputs, labels, targets = as_dask(12, delay=0.05)
    with distributed.get_task_stream(client) as ts:
        m = rd.moments(features, outputs, labels, targets)
    check(m, 12)
    keys = [str(t["key"]) for t in ts.data]
    chunks = [t for t in ts.data if str(t["key"]).startswith("_chunk")]
    assert len(chunks) == 4 == 2 * sum(client.nthreads().values())  # 12 chunks, 3 per task
    assert len({t["worker"] for t in chunks}) == 2
    # the chunks were made in the tasks that added them: no other task ran, nothing but states moved
    assert all(k.startswith(("_chunk", "_combine")) for k in keys), keys
    transfers = [s for t in ts.data for s in t["startstops"] if s["action"] == "transfer"]
    assert len(transfers) <= 3


# -- faults on the LocalCluster (last: they restart workers) ----------------------------


def test_a_worker_killed_mid_run_is_retried_to_the_same_answer(client):
    features, outputs, labels, targets = as_dask(12, delay=0.3)
    pids = client.run(os.getpid)
    out: dict = {}

    def run():
        try:
            out["m"] = rd.moments(features, outputs, labels, targets, split_every=3)
        except BaseException as e:  # reported below
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    deadline = time.time() + 30
    while time.time() < deadline and not any(client.processing().values()):
        time.sleep(0.05)
    time.sleep(0.5)  # chunks under way on both workers, some done
    victim = next(iter(pids))
    assert t.is_alive()  # the run is under way
    os.kill(pids[victim], signal.SIGKILL)
    t.join(120)
    assert not t.is_alive()
    assert "error" not in out, out.get("error")
    check(out["m"], 12)  # n is the rows given, the state that of all of them
    client.wait_for_workers(2, timeout=60)
    assert pids[victim] not in client.run(os.getpid).values()  # that worker did die (the nanny started another)


def test_a_chunk_that_keeps_killing_workers_is_a_clear_error(client):
    client.wait_for_workers(2, timeout=60)
    scheduler = client.cluster.scheduler
    old = scheduler.allowed_failures
    scheduler.allowed_failures = 1  # two deaths of the same task end the run
    try:
        features, outputs, _, _ = as_dask(4, die_at=2)
        with pytest.raises(distributed.KilledWorker, match="died"):
            rd.moments(features, outputs)
    finally:
        scheduler.allowed_failures = old
    client.wait_for_workers(2, timeout=60)


def check_similarity(s, arrays):
    names = list(arrays)
    assert s.n == arrays[names[0]].shape[0] and s.names == names
    rep = s.compute()
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            assert abs(rep.cka[i, j] - cka_naive(arrays[a], arrays[b])) < 1e-10
            assert abs(rep.cka_debiased[i, j] - cka_debiased_naive(arrays[a], arrays[b])) < 1e-10


@pytest.mark.parametrize("scheduler", ["sync", "processes"])
def test_similarity_on_local_schedulers_equals_the_reference(scheduler):
    X, F, _, Y = full(6)
    arrays = {"x": X + 1e3, "f": F, "y": np.tanh(Y)}   # a large offset: the chunks' shifts differ
    with dask.config.set(scheduler=scheduler):
        s = rd.similarity({k: da.from_array(v, chunks=(STEP, -1)) for k, v in arrays.items()}, split_every=2)
    check_similarity(s, arrays)


def test_similarity_on_the_local_cluster_uses_both_workers(client):
    features, outputs, _, targets = as_dask(12, delay=0.05)
    with distributed.get_task_stream(client) as ts:
        s = rd.similarity({"features": features, "outputs": outputs, "targets": targets}, split_every=3,
                          chunks_per_task=2)
    X, F, _, Y = full(12)
    check_similarity(s, {"features": X, "outputs": F, "targets": Y})
    workers = {t["worker"] for t in ts.data if "_similarity_chunk" in str(t["key"])}
    assert len(workers) == 2


def test_similarity_refusals_before_any_work():
    x = da.zeros((400, 3), chunks=(200, -1))
    with pytest.raises(ValueError, match=r"b has row chunks .* a \(200, 200\) \(400 rows\)"):
        rd.similarity({"a": x, "b": da.zeros((400, 2), chunks=(100, -1))})
    with pytest.raises(TypeError, match="non-empty mapping"):
        rd.similarity({})
    with pytest.raises(TypeError, match="must be a dask array"):
        rd.similarity({"a": x, "b": np.zeros((400, 2))})
    bad = np.zeros((400, 2))
    bad[250, 1] = np.nan
    with pytest.raises(ValueError, match=r"rows 200..399: .*'b' contains 1 NaN"):
        with dask.config.set(scheduler="sync"):
            rd.similarity({"a": x, "b": da.from_array(bad, chunks=(200, -1))})
