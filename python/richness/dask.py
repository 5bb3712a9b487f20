"""richness over Dask: the state of dask arrays too big for one machine
(``pip install "richness[dask]"``).

``moments(features, outputs, labels, targets)`` is a tree reduction in the
shape of ``dask.array.reduction``: each row chunk becomes a state on the
worker that holds it (a ``Moments`` updated by the compiled core, returned as
its ``state_dict()``: plain numpy arrays and ints), groups of ``split_every``
states are merged by ``Moments.merge`` on the workers, and the last state is
loaded into a ``Moments`` where the call was made. Nothing native is pickled;
what travels is the O(p^2 + pC) state dicts, never the rows. Those states are
the reduction's own (exported by its tasks, carried by Dask, which unpickles
what it carries anyway): each is loaded with every check of
``load_state_dict`` but the O(p^3) semi-definiteness factorisations, which a
state built by updates and merges passes by construction
(``Moments._load_own_state_dict``); a saved file or a user's state dict
still gets them all. It runs on the
active scheduler: threads (dask's default), processes, or a
``distributed.Client``. The result equals one ``Moments`` over the same rows
up to rounding (docs/MATH.md, "Merging states"), and its sample count is
checked against the rows given: a partial result is an error, never returned.

Inputs are chunked along rows only (one chunk spans all columns), with the
same row chunks in every array; anything else is refused before any work.

Recipes (``import dask, dask.array as da, numpy as np``)::

    # a folder written by da.to_npy_stack (its "info" file gives the chunks)
    features = da.from_npy_stack("feats/")
    # a zarr array; rechunk when the store also splits the columns
    features = da.from_zarr("feats.zarr").rechunk({1: -1})
    # a list of .npy files (one per rank and part): each memory-mapped by the
    # worker that reads it, never sent through the scheduler
    heads = [np.load(p, mmap_mode="r") for p in paths]
    features = da.concatenate([da.from_delayed(dask.delayed(np.load)(p, mmap_mode="r"), h.shape, h.dtype)
                               for p, h in zip(paths, heads)])

``similarity({"a": xa, "b": xb, ...})`` is the same reduction for the
``Similarity`` state (exact CKA between representations of the same rows).

Other engines (Ray Data's ``AggregateFnV2``, Spark's ``treeAggregate``) carry
the same state dicts and merge: README.md, "Data bigger than one machine".
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Mapping, Optional, Sequence

import numpy as np

from . import _kinds
from ._moments import Moments
from ._optional import _require

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


def _chunk(start: int, blocks: list, num_classes, precision) -> dict:
    """The state of consecutive row chunks (each a tuple of the features'
    block and its partners'), on the worker that holds them."""
    m = _emptied("moments", (num_classes, precision), lambda: Moments(num_classes, precision=precision))
    for block in blocks:
        rows = block[0].shape[0]
        if rows:
            try:
                m.update(*block)
            except (ValueError, TypeError) as e:
                raise type(e)(f"rows {start}..{start + rows - 1}: {e}") from None
        start += rows
    return m.state_dict()


def _similarity_chunk(start: int, names: List[str], blocks: list, precision) -> dict:
    """The similarity state of consecutive row chunks (each a tuple of the
    representations' blocks, in ``names`` order), on the worker that holds them."""
    from ._similarity import Similarity

    s = _emptied("similarity", (precision,), lambda: Similarity(precision=precision))
    for block in blocks:
        rows = block[0].shape[0]
        if rows:
            try:
                s.update(dict(zip(names, block)))
            except (ValueError, TypeError) as e:
                raise type(e)(f"rows {start}..{start + rows - 1}: {e}") from None
        start += rows
    return s.state_dict()


def _combine(kind: str, states: List[dict]) -> dict:
    """Several states of this reduction's own tasks merged into one, by the
    kind's own merge."""
    return _kinds.merge_own_dicts(kind, states)


def _per_task(chunks_per_task: Any) -> int:
    if (isinstance(chunks_per_task, (bool, np.bool_)) or not isinstance(chunks_per_task, (int, np.integer))
            or chunks_per_task < 1):
        raise ValueError(f"chunks_per_task must be a positive integer, got {chunks_per_task!r}")
    return int(chunks_per_task)


def _tree(kind: str, states: list, split_every: Optional[int]):
    """The delayed merge of ``states`` (delayed state dicts) in a tree of
    fan-in ``split_every``."""
    import dask

    every = SPLIT_EVERY if split_every is None else split_every
    if isinstance(every, (bool, np.bool_)) or not isinstance(every, (int, np.integer)) or every < 2:
        raise ValueError(f"split_every must be an integer >= 2 (states merged per task), got {split_every!r}")
    combine = dask.delayed(_combine, pure=True)
    level = list(states)
    while len(level) > 1:
        level = [combine(kind, level[i:i + every]) for i in range(0, len(level), every)]
    return level[0]


def moments(features: Any, outputs: Any = None, labels: Any = None, targets: Any = None, *,
            num_classes: Optional[int] = None, precision: Optional[str] = None,
            split_every: Optional[int] = None, chunks_per_task: int = 1) -> Moments:
    """The ``Moments`` of dask arrays, computed on the active scheduler.

    Args:
        features: (n, p) floats, chunked along rows only.
        outputs: (n, C) or (n,) floats; labels: (n,) integers; targets: (n, T)
            or (n,) floats; each with the features' row chunks.
        num_classes, precision: as for ``Moments``.
        split_every: states merged per task of the tree (default 8); each
            merge task holds that many states.
        chunks_per_task: consecutive row chunks added to one state (default
            1). Each state costs a fixed time to export, send, check and
            merge (about 0.05 s at p = 1024 with 1000 classes in
            one process, more on a busy worker; benchmarks/RESULTS.md,
            "Sharded features"), so many small chunks
            are better grouped; a task holds its chunks at once.

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
    blocks = [None if x is None else x.to_delayed().ravel() for x in arrays]
    chunk = dask.delayed(_chunk, pure=True)
    starts = np.concatenate([[0], np.cumsum(features.chunks[0])[:-1]]).astype(int)
    states = [chunk(int(starts[i]), [tuple(None if b is None else b[j] for b in blocks)
                                     for j in range(i, min(i + per, len(starts)))], num_classes, precision)
              for i in range(0, len(starts), per)]
    (state,) = dask.compute(_tree("moments", states, split_every))
    m = Moments(num_classes, precision=precision)
    m._load_own_state_dict(state)
    rows = int(features.shape[0])
    if m.n != rows:
        raise RuntimeError(f"the reduction returned a state of {m.n} samples for {rows} rows: a partial result, "
                           "refused")
    return m


def similarity(representations: Mapping[str, Any], *, precision: Optional[str] = None,
               split_every: Optional[int] = None, chunks_per_task: int = 1) -> Any:
    """The ``Similarity`` (exact linear CKA, both estimators) of named dask
    arrays of the same rows, computed on the active scheduler.

    Args:
        representations: name -> (n, width) floats, chunked along rows only,
            every array with the first one's row chunks (at least one).
        precision, split_every, chunks_per_task: as for ``Similarity`` and
            ``moments``.

    The same tree as ``moments``: a ``Similarity`` per group of row chunks on
    the worker that holds them, returned as its ``state_dict()``, merged by
    ``Similarity.merge`` (which re-expresses states taken at different
    shifts exactly), the sample count checked against the rows.
    """
    import dask

    from ._similarity import Similarity

    Similarity(precision=precision)  # the option is checked before any work
    per = _per_task(chunks_per_task)
    if not isinstance(representations, Mapping) or not representations:
        raise TypeError("representations must be a non-empty mapping name -> dask array, got "
                        f"{type(representations).__name__}")
    names = [str(k) for k in representations]
    values = list(representations.values())
    arrays = _checked(values[0], {n: (x, (2,), "f") for n, x in zip(names[1:], values[1:])}, first=names[0])
    blocks = [x.to_delayed().ravel() for x in arrays]
    chunk = dask.delayed(_similarity_chunk, pure=True)
    starts = np.concatenate([[0], np.cumsum(arrays[0].chunks[0])[:-1]]).astype(int)
    states = [chunk(int(starts[i]), names, [tuple(b[j] for b in blocks) for j in range(i, min(i + per, len(starts)))],
                    precision)
              for i in range(0, len(starts), per)]
    (state,) = dask.compute(_tree("similarity", states, split_every))
    s = Similarity(precision=precision)
    s._load_own_state_dict(state)
    rows = int(arrays[0].shape[0])
    if s.n != rows:
        raise RuntimeError(f"the reduction returned a state of {s.n} samples for {rows} rows: a partial result, "
                           "refused")
    return s

