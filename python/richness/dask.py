"""richness over Dask: the state of dask arrays too big for one machine
(``pip install "richness[dask]"``).

``moments(features, outputs, labels, targets)`` is a tree reduction in the
shape of ``dask.array.reduction``: each group of consecutive row chunks
becomes a state on the worker that runs its task (a ``Moments`` updated by
the compiled core, returned as its ``state_dict()``: plain numpy arrays and
ints), groups of ``split_every`` states are merged by ``Moments.merge`` on
the workers, and the last state is loaded into a ``Moments`` where the call
was made. Nothing native is pickled; what travels is the O(p^2 + pC) state
dicts, never the rows.

Where each row chunk's blocks come from tasks of their own (a file read, a
slice of a store: no task serves two row chunks), the chunk task makes them
itself, one row chunk at a time, from that part of the arrays' graph: reading
and updating are one task, a block is never a result held by one worker and
sent to another, and a task holds one chunk however many it adds. By default
(``chunks_per_task=None``) the chunks are then grouped into about two tasks
per worker thread of the active scheduler, so that few states are exported,
sent and merged. Where a task serves several row chunks (a rechunk across
rows, a statistic every chunk uses) the blocks stay Dask's tasks, shared as
Dask shares them, and each task takes one chunk unless told otherwise.

The states are the reduction's own (exported by its tasks, carried by Dask,
which unpickles what it carries anyway): each is loaded with every check of
``load_state_dict`` but the O(p^3) semi-definiteness factorisations, which a
state built by updates and merges passes by construction
(``Moments._load_own_state_dict``); a saved file or a user's state dict
still gets them all. It runs on the active scheduler: threads (dask's
default), processes, or a ``distributed.Client``. The result equals one
``Moments`` over the same rows up to rounding (docs/MATH.md, "Merging
states"), and its sample count is checked against the rows given: a partial
result is an error, never returned. A task lost with its worker is Dask's to
run again; it made its own chunks, so it makes them again wherever it runs.

Inputs are chunked along rows only (one chunk spans all columns), with the
same row chunks in every array; anything else is refused before any work.

Recipes (``import dask, dask.array as da, numpy as np``), each read in the
chunk tasks::

    # a folder written by da.to_npy_stack (its "info" file gives the chunks)
    features = da.from_npy_stack("feats/")
    # a zarr array; rechunk when the store also splits the columns
    features = da.from_zarr("feats.zarr").rechunk({1: -1})
    # a list of .npy files (one per rank and part): each memory-mapped by the
    # worker that reads it (the core reads the mapped rows, no copy), never
    # sent through the scheduler
    heads = [np.load(p, mmap_mode="r") for p in paths]
    features = da.concatenate([da.from_delayed(dask.delayed(np.load)(p, mmap_mode="r"), h.shape, h.dtype)
                               for p, h in zip(paths, heads)])

A memory-mapped file truncated while a worker reads it ends that worker
(SIGBUS); Dask runs the task again elsewhere and, when the file stays short,
reports ``KilledWorker``: an error, never a partial state.

``similarity({"a": xa, "b": xb, ...})`` is the same reduction for the
``Similarity`` state (exact CKA between representations of the same rows).

Other engines (Ray Data's ``AggregateFnV2``, Spark's ``treeAggregate``) carry
the same state dicts and merge: README.md, "Data bigger than one machine".
"""

from __future__ import annotations

import os
import pickle
import threading
from typing import Any, Callable, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ._engine import kinds as _kinds
from ._checks import check_int
from ._engine.moments import Moments
from ._optional import _require

__all__ = ["moments", "similarity"]

SPLIT_EVERY = 8  # states merged per task of the tree: split_every * O(p^2) bytes in a combine


def _da():
    return _require("dask.array", "richness.dask", "Dask", "dask")


def _short(chunks: Sequence) -> str:
    c = tuple(int(x) for x in chunks)
    return str(c) if len(c) <= 6 else f"({', '.join(map(str, c[:3]))}, ..., {', '.join(map(str, c[-2:]))}; " \
                                      f"{len(c)} chunks)"


def _checked(features: Any, others: dict, first: str = "features") -> List[Optional[Any]]:
    """The arrays, checked for kind, dtype, shape and chunks (no data read);
    ``features`` (named ``first``) sets the row chunks the others must share."""
    da = _da()
    out = []
    for name, x, ndims, kinds in ((first, features, (2,), "f"),) + tuple(
            (n, x, nd, k) for n, (x, nd, k) in others.items()):
        if x is None:
            out.append(None)
            continue
        if not isinstance(x, da.Array):
            raise TypeError(f"{name} must be a dask array, got {type(x).__module__}.{type(x).__name__}; wrap it "
                            "with dask.array.from_array(x, chunks=(rows, -1))")
        if x.ndim not in ndims:
            raise ValueError(f"{name} must be {' or '.join(f'{d}-D' for d in ndims)}, got shape {x.shape}")
        if x.dtype.kind not in kinds:
            want = "integers" if kinds == "iu" else "floating point"
            raise TypeError(f"{name} must be {want}, got {x.dtype}")
        if any(np.isnan(c) for c in x.chunks[0]):
            raise ValueError(f"{name} has unknown row chunk sizes; call {name}.compute_chunk_sizes() first")
        if x.ndim == 2 and len(x.chunks[1]) != 1:
            raise ValueError(f"{name} is chunked along its columns too (column chunks {_short(x.chunks[1])}); "
                             f"chunk along rows only: {name}.rechunk({{1: -1}})")
        if name != first and x.chunks[0] != features.chunks[0]:
            raise ValueError(f"{name} has row chunks {_short(x.chunks[0])} ({x.shape[0]} rows), {first} "
                             f"{_short(features.chunks[0])} ({features.shape[0]} rows); chunk them alike: "
                             f"{name}.rechunk({{0: {first}.chunks[0]}})")
        out.append(x)
    return out


# Per worker thread, the accumulator of its last chunk task and the options it
# was made with: the core keeps a batch's scratch (rows x (p + C + T) float32
# or float64 values, and the products) in its accumulator, and a fresh one
# allocates and first touches it on its first update (0.04-0.05 s of 0.19 s
# for 15,000 x 1,024 float16 rows and 1,000 classes, measured). The next
# task's state starts from it, emptied by reset().
_WARM = threading.local()


def _emptied(kind: str, options: tuple, make: Callable[[], Any]) -> Any:
    """An empty state object for a chunk task: this thread's from its last
    task where the kind and options match, reset, else ``make()``."""
    held = getattr(_WARM, "held", None)
    if held is not None and held[0] == (kind, options):
        held[1].reset()
        return held[1]
    _WARM.held = None  # the old one (its scratch) goes before the new one allocates
    obj = make()
    _WARM.held = ((kind, options), obj)
    return obj


class _Rows:
    """Consecutive row chunks as the tasks that make them: per chunk, the
    part of the arrays' graph its blocks come from (no task of it shared
    with another chunk's) and the keys of its blocks. The chunk task
    evaluates one chunk's part at a time, so reading and updating are one
    task: the blocks are never results of their own (held by a worker,
    sent to the one that updates with them), and the task holds one chunk
    at a time however many it adds."""

    __slots__ = ("parts",)

    def __init__(self, parts: List[Tuple[dict, tuple]]) -> None:
        self.parts = parts  # per row chunk: (graph, keys of its blocks; None for an array not given)

    def __dask_tokenize__(self):
        return tuple(keys for _, keys in self.parts)

    def __len__(self) -> int:
        return len(self.parts)

    def __iter__(self) -> Iterator[tuple]:
        import dask

        for graph, keys in self.parts:
            given = [k for k in keys if k is not None]
            values = iter(dask.get(graph, given))  # the synchronous scheduler, inside this task
            yield tuple(None if k is None else next(values) for k in keys)


def _update_all(state: Any, start: int, blocks: Iterable[tuple], add: Callable[[Any, tuple], None]) -> None:
    """Add the row chunks ``blocks`` (made one at a time) to ``state``, a
    refusal naming its rows."""
    for block in blocks:
        rows = block[0].shape[0]
        if rows:
            try:
                add(state, block)
            except (ValueError, TypeError) as e:
                raise type(e)(f"rows {start}..{start + rows - 1}: {e}") from None
        start += rows


def _chunk(start: int, blocks: Iterable[tuple], num_classes, precision) -> dict:
    """The state of consecutive row chunks (each a tuple of the features'
    block and its partners', or a ``_Rows`` that makes them), on the worker
    that runs the task."""
    m = _emptied("moments", (num_classes, precision), lambda: Moments(num_classes, precision=precision))
    _update_all(m, start, blocks, lambda s, block: s.update(*block))
    return m.state_dict()


def _similarity_chunk(start: int, names: List[str], blocks: Iterable[tuple], precision,
                      estimator: str = "exact") -> dict:
    """The similarity state of consecutive row chunks (each a tuple of the
    representations' blocks, in ``names`` order, or a ``_Rows``), on the
    worker that runs the task; each row chunk is one batch of the minibatch
    estimator."""
    from ._engine.similarity import Similarity

    s = _emptied("similarity", (precision, estimator), lambda: Similarity(precision=precision, estimator=estimator))
    _update_all(s, start, blocks, lambda st, block: st.update(dict(zip(names, block))))
    return s.state_dict()


def _combine(kind: str, states: List[dict]) -> dict:
    """Several states of this reduction's own tasks merged into one, by the
    kind's own merge."""
    return _kinds.merge_own_dicts(kind, states)


def _per_task(chunks_per_task: Any) -> Optional[int]:
    return check_int(chunks_per_task, "chunks_per_task", low=1, allow_none=True)


SHARED_BYTES = 1 << 20  # a literal every row chunk needs (an opened store) is copied into each task up to this


def _copyable(node: Any, deps: set) -> bool:
    """Whether a node of the graph that several row chunks need may be
    copied into each of their tasks: literal data (no computation), small."""
    import dask.core

    spec: Any = None
    try:
        from dask import _task_spec as spec
    except ImportError:  # dask before 2024.12: graphs of tuples, literals as themselves
        pass
    data_node, graph_node = getattr(spec, "DataNode", ()), getattr(spec, "GraphNode", ())
    if deps:
        return False
    if isinstance(node, data_node):
        value = node.value
    elif isinstance(node, graph_node) or dask.core.istask(node):
        return False
    else:
        value = node
    if isinstance(value, np.ndarray):
        return value.nbytes <= SHARED_BYTES
    try:
        return len(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)) <= SHARED_BYTES
    except Exception:  # anything that does not pickle here is not copied
        return False


def _row_parts(arrays: List[Optional[Any]]) -> Optional[List[Tuple[dict, tuple]]]:
    """Per row chunk, the part of the arrays' graph that makes its blocks of
    every array, and their keys; None where a task is needed by several row
    chunks (a rechunk across rows, a statistic every chunk uses, a large
    array all chunks are sliced from): those blocks are then made by tasks of
    their own, whose results Dask shares. The graph is taken as built, not
    optimised: the optimiser fuses a task that several arrays share (one
    file read for the features and the labels) into each array's chain, and
    it would run once per array; here it runs once per chunk."""
    from dask.core import get_dependencies

    graph: dict = {}
    keys: List[Optional[list]] = []
    for x in arrays:
        if x is None:
            keys.append(None)
            continue
        graph.update(x.__dask_graph__())
        keys.append([k[0] if x.ndim == 2 else k for k in x.__dask_keys__()])  # one column chunk: one key per row
    owner: dict = {}
    deps: dict = {}
    copyable: dict = {}  # by key of a node several row chunks need: decided (and pickled to size it) once
    parts = []
    for j in range(len(arrays[0].chunks[0])):
        row = tuple(None if k is None else k[j] for k in keys)
        todo = [k for k in row if k is not None]
        mine = set(todo)
        while todo:
            key = todo.pop()
            if key not in deps:
                deps[key] = get_dependencies(graph, key)
            for d in deps[key]:
                if d not in mine:
                    mine.add(d)
                    todo.append(d)
        for key in mine:
            if owner.setdefault(key, j) == j:
                continue
            if key not in copyable:
                copyable[key] = _copyable(graph[key], deps[key])
            if not copyable[key]:
                return None
        parts.append(({k: graph[k] for k in mine}, row))
    return parts


def _threads() -> int:
    """Worker threads of the active scheduler: a distributed client's, 1
    for the synchronous one, else dask's ``num_workers`` or this machine's
    cores (threads and processes)."""
    import dask
    import dask.local

    get = dask.base.get_scheduler()
    nthreads = getattr(getattr(get, "__self__", None), "nthreads", None)
    if callable(nthreads):
        try:
            n = sum(nthreads().values())
        except Exception:  # a client that cannot answer now: the guess below
            n = 0
        if n > 0:
            return int(n)
    if get is dask.local.get_sync:
        return 1
    return int(dask.config.get("num_workers", None) or os.cpu_count() or 1)


def _groups(arrays: List[Optional[Any]], chunks_per_task: Optional[int]) -> List[Tuple[int, Any]]:
    """The chunk tasks: per task its first row and its consecutive row
    chunks, a ``_Rows`` (read in the task) where no task of the arrays'
    graph serves two row chunks, else tuples of the blocks as delayed
    values. ``chunks_per_task=None``: about two tasks per worker thread of
    the active scheduler when read in the task (one chunk in memory at a
    time either way), one chunk per task otherwise (a task then holds all
    its chunks at once)."""
    sizes = arrays[0].chunks[0]
    n = len(sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
    parts = _row_parts(arrays)
    per = chunks_per_task
    if per is None:
        per = 1 if parts is None else max(1, -(-n // (2 * _threads())))
    if parts is not None:
        return [(int(starts[i]), _Rows(parts[i:i + per])) for i in range(0, n, per)]
    blocks = [None if x is None else x.to_delayed().ravel() for x in arrays]
    return [(int(starts[i]), [tuple(None if b is None else b[j] for b in blocks) for j in range(i, min(i + per, n))])
            for i in range(0, n, per)]


def _tree(kind: str, states: list, split_every: Optional[int]):
    """The delayed merge of ``states`` (delayed state dicts) in a tree of
    fan-in ``split_every``."""
    import dask

    every = check_int(SPLIT_EVERY if split_every is None else split_every, "split_every", low=2,
                      what="an integer >= 2 (states merged per task)")
    combine = dask.delayed(_combine, pure=True)
    level = list(states)
    while len(level) > 1:
        level = [combine(kind, level[i:i + every]) for i in range(0, len(level), every)]
    return level[0]


def moments(features: Any, outputs: Any = None, labels: Any = None, targets: Any = None, *,
            num_classes: Optional[int] = None, precision: Optional[str] = None,
            split_every: Optional[int] = None, chunks_per_task: Optional[int] = None) -> Moments:
    """The ``Moments`` of dask arrays, computed on the active scheduler.

    Args:
        features: (n, p) floats, chunked along rows only.
        outputs: (n, C) or (n,) floats; labels: (n,) integers; targets: (n, T)
            or (n,) floats; each with the features' row chunks.
        num_classes, precision: as for ``Moments``.
        split_every: states merged per task of the tree (default 8); each
            merge task holds that many states.
        chunks_per_task: consecutive row chunks added to one state. Each
            state costs a fixed time to export, send, check and merge
            (0.05-0.1 s at p = 1024 with 1000 classes on a worker;
            benchmarks/RESULTS.md, "Sharded features"). Default (None):
            where the chunk tasks read their own chunks (the module's
            docstring), about two tasks per worker thread of the active
            scheduler, each holding one chunk at a time; else one chunk per
            task. Given where the blocks are Dask's own tasks, a task holds
            its chunks at once.

    A chunk refused by the core (NaN, labels out of range, ...) raises its
    ValueError/TypeError here, naming its rows; a worker lost mid-run is
    Dask's to retry, and a result whose sample count is not the rows' is
    refused (RuntimeError).
    """
    import dask

    Moments(num_classes, precision=precision)  # the options are checked before any work
    per = _per_task(chunks_per_task)
    arrays = _checked(features, {"outputs": (outputs, (1, 2), "f"), "labels": (labels, (1,), "iu"),
                                 "targets": (targets, (1, 2), "f")})
    chunk = dask.delayed(_chunk, pure=True)
    states = [chunk(start, rows, num_classes, precision) for start, rows in _groups(arrays, per)]
    (state,) = dask.compute(_tree("moments", states, split_every))
    m = Moments(num_classes, precision=precision)
    m._load_own_state_dict(state)
    rows = int(features.shape[0])
    if m.n != rows:
        raise RuntimeError(f"the reduction returned a state of {m.n} samples for {rows} rows: a partial result, "
                           "refused")
    return m


def similarity(representations: Mapping[str, Any], *, precision: Optional[str] = None,
               split_every: Optional[int] = None, chunks_per_task: Optional[int] = None,
               estimator: str = "exact") -> Any:
    """The ``Similarity`` (linear CKA: by default the exact biased and
    debiased estimators) of named dask arrays of the same rows, computed on
    the active scheduler.

    Args:
        representations: name (a string) -> (n, width) floats, chunked along rows only,
            every array with the first one's row chunks (at least one).
        precision, split_every, chunks_per_task: as for ``Similarity`` and
            ``moments``.
        estimator: as for ``Similarity``; for ``"minibatch"`` and ``"both"``
            each row chunk is one batch of the minibatch estimator (its value
            depends on the chunks).

    The same tree as ``moments``: a ``Similarity`` per group of row chunks on
    the worker that holds them, returned as its ``state_dict()``, merged by
    ``Similarity.merge`` (which re-expresses states taken at different
    shifts exactly), the sample count checked against the rows.
    """
    import dask

    from ._engine.similarity import Similarity, check_names

    Similarity(precision=precision, estimator=estimator)  # the options are checked before any work
    per = _per_task(chunks_per_task)
    if not isinstance(representations, Mapping) or not representations:
        raise TypeError("representations must be a non-empty mapping name -> dask array, got "
                        f"{type(representations).__name__}")
    names = check_names(representations, "similarity")  # the names Similarity.update takes, as given
    values = list(representations.values())
    arrays = _checked(values[0], {n: (x, (2,), "f") for n, x in zip(names[1:], values[1:])}, first=names[0])
    chunk = dask.delayed(_similarity_chunk, pure=True)
    states = [chunk(start, names, rows, precision, estimator) for start, rows in _groups(arrays, per)]
    (state,) = dask.compute(_tree("similarity", states, split_every))
    s = Similarity(precision=precision, estimator=estimator)
    s._load_own_state_dict(state)
    rows = int(arrays[0].shape[0])
    if s.n != rows:
        raise RuntimeError(f"the reduction returned a state of {s.n} samples for {rows} rows: a partial result, "
                           "refused")
    return s

