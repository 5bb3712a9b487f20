"""Exact merge of ``Moments`` states across ``torch.distributed`` ranks.

The many-state merge of ``_state`` (docs/MATH.md, "Merging states") with the
sums done by collectives: every rank's co-moments are shifted to the global
mean and one SUM all-reduce of float64 buffers gives every rank the global
state. Three collectives: the widths (an all-gather of 7 integers a state),
the weighted means, the shifted moments. Every compatibility check runs on
every rank on the gathered widths, before any data moves, so all ranks raise
the same error (no rank hangs in a later collective). Works with gloo (CPU
tensors) and NCCL (tensors on the current CUDA device).
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

from .. import _state
from .._optional import pip_extra


def _dist():
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        raise ImportError(f"Moments.all_reduce needs PyTorch: {pip_extra('torch')}") from None
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("Moments.all_reduce needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group)")
    return torch, dist


def _comm_device(torch, dist, group) -> Any:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


INVALID = -1  # the precision index of a rank whose state failed validation


def all_reduce_states(states: List[dict], group: Optional[Any] = None) -> List[dict]:
    """State i of the result is the merge of every rank's state i (every rank
    gets the same list). Each rank passes the same number of states (one, or
    one a jackknife group).

    Raises ValueError on every rank when the ranks' states cannot merge
    (different feature widths, outputs streamed on some ranks only, different
    num_classes, ...) or when a rank's state is invalid (``_state.validate``).
    """
    torch, dist = _dist()
    dev = _comm_device(torch, dist, group)
    world = dist.get_world_size(group)
    nw = len(_state.WIDTHS)
    # Each rank validates its own states (_state.checked, the validator of
    # load and merge); an invalid one is announced with the precision index
    # INVALID, so that every rank refuses, not only the one that holds it.
    problem: Optional[Exception] = None
    valid = []
    for st in states:
        try:
            valid.append(_state.checked(st))
        except (TypeError, ValueError) as e:
            problem = problem or e
            valid.append(_state.empty())
    states = valid

    def widths(st):
        prec = INVALID if problem is not None else _state.precisions().index(st["precision"])
        return [*_state.widths_of(st).values(), prec]

    mine = torch.tensor([len(states)] + [v for st in states for v in widths(st)], dtype=torch.int64)
    # Ranks may hold different numbers of states: gather the counts first.
    count = torch.tensor([mine.numel()], dtype=torch.int64, device=dev)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    size = max(int(c.item()) for c in counts)
    padded = torch.full((size,), -2, dtype=torch.int64, device=dev)
    padded[:mine.numel()] = mine.to(dev)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    rows = [g.cpu().numpy() for g in gathered]
    sizes = sorted({int(r[0]) for r in rows})
    if len(sizes) > 1:
        raise ValueError(f"all_reduce: ranks hold different numbers of groups {sizes}; use the same "
                         "Moments(groups=k) on every rank")
    bad = [r for r, row in enumerate(rows) if int(row[nw + 1]) == INVALID]
    if bad:
        why = f" ({problem})" if problem is not None else ""
        raise ValueError(f"all_reduce: rank(s) {bad} hold an invalid state{why}; no rank's state changed")
    per_slot = []
    for i in range(len(states)):
        metas = []
        for r in rows:
            v = r[1 + i * (nw + 1): 1 + (i + 1) * (nw + 1)]
            metas.append(dict(zip(_state.WIDTHS, (int(x) for x in v[:nw]))) | {"prec": int(v[nw])})
        try:
            _state.check_compatible(metas)
            per_slot.append((metas, _state.merged_widths(metas)))
        except ValueError as e:
            raise ValueError(f"all_reduce across ranks: {e}") from None

    out = []
    for st, (metas, w) in zip(states, per_slot):
        if w["n"] == 0:
            out.append(st)
            continue
        wsum = torch.from_numpy(_state.weighted_means(st, w)).to(dev, torch.float64)
        dist.all_reduce(wsum, group=group)
        means = _state.split_means(wsum.cpu().numpy() / w["n"], w)
        with np.errstate(over="ignore", invalid="ignore"):
            flat = torch.from_numpy(_state.shifted_sums(st, means, w)).to(dev, torch.float64)
        dist.all_reduce(flat, group=group)
        flat = flat.cpu().numpy()
        _state.check_finite(flat, means)  # the same sums on every rank: all raise alike
        precision = _state.coarsest(_state.precisions()[m["prec"]] for m in metas if m["n"] > 0)
        out.append(_state.assemble(flat, means, w, precision))
    return out
