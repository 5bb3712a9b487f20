"""Exact merge of ``Moments`` states across ``torch.distributed`` ranks.

SPEC.md: shift each rank's co-moments to the global mean, then sum. With
``d_r = mu_r - mu`` the identity

    M = sum_r (M_r + n_r d_r d_r^T)

is the Chan merge of all ranks at once (likewise ``B``, ``A`` with the output
shifts), so one SUM all-reduce of float64 buffers gives every rank the global
state. Three collectives: the shapes (all-gather of 7 integers), the weighted
means, the shifted moments. Works with gloo (CPU tensors) and NCCL (tensors on
the current CUDA device).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ._adapt import PRECISIONS

_META = ("n", "p", "c", "t", "k", "num_classes", "precision")


def _dist():
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        raise ImportError('Moments.all_reduce needs PyTorch: pip install "richness[torch]"') from None
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("Moments.all_reduce needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group)")
    return torch, dist


def _comm_device(torch, dist, group) -> Any:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_state(st: dict, group: Optional[Any] = None) -> dict:
    """The global state of all ranks of ``group``, as a state dict (every rank gets the same).

    Raises ValueError on every rank when the ranks' states cannot merge
    (different feature widths, outputs streamed on some ranks only, ...).
    """
    torch, dist = _dist()
    dev = _comm_device(torch, dist, group)
    world = dist.get_world_size(group)

    meta = torch.tensor([int(st["n"]), int(st["p"]), int(st["c"]), int(st["t"]), int(st["k"]),
                         int(st["num_classes"]), PRECISIONS.index(st["precision"])], dtype=torch.int64, device=dev)
    metas = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(metas, meta, group=group)
    metas = torch.stack(metas).cpu().numpy()
    live = metas[metas[:, 0] > 0]
    if live.shape[0] == 0:
        return st
    # Every rank sees the same metas, so every rank raises the same error (no hang).
    for j, what in ((1, "feature widths"), (2, "output widths"), (3, "target widths")):
        vals = sorted(set(live[:, j].tolist()))
        if len(vals) > 1:
            raise ValueError(f"all_reduce: ranks hold different {what} {vals} (-1 = not streamed)")
    if len(set((live[:, 4] >= 0).tolist())) > 1:
        raise ValueError("all_reduce: some ranks streamed labels and others did not")
    N = int(live[:, 0].sum())
    p, c, t = int(live[0, 1]), int(live[0, 2]), int(live[0, 3])
    has_k = bool(live[0, 4] >= 0)
    k = int(max(live[:, 4].max(), metas[:, 5].max())) if has_k else -1
    cw, tw, kw = max(c, 0), max(t, 0), max(k, 0)
    n = int(st["n"])
    f64 = torch.float64

    def arr(key, shape):
        return np.asarray(st[key], dtype=np.float64).reshape(shape) if n > 0 else np.zeros(shape)

    mean, out_mean, tgt_mean = arr("mean", (p,)), arr("out_mean", (cw,)), arr("tgt_mean", (tw,))

    # Global means: sum_r n_r mu_r / N (float64).
    wsum = torch.from_numpy(np.concatenate([mean, out_mean, tgt_mean]) * n).to(dev, f64)
    dist.all_reduce(wsum, group=group)
    g = wsum.cpu().numpy() / N
    gm, go, gt = g[:p], g[p:p + cw], g[p + cw:]

    # Shift to the global mean, then sum.
    d, e, u = mean - gm, out_mean - go, tgt_mean - gt
    parts = [arr("M", (p, p)) + n * np.outer(d, d)]
    if cw:
        parts += [arr("B", (p, cw)) + n * np.outer(d, e), arr("A", (cw, cw)) + n * np.outer(e, e)]
    if tw:
        parts += [arr("Bt", (p, tw)) + n * np.outer(d, u), arr("At", (tw, tw)) + n * np.outer(u, u)]
    if kw:
        counts = np.zeros(kw)
        sums = np.zeros((kw, p))
        if n > 0 and int(st["k"]) > 0:
            kk = int(st["k"])
            counts[:kk] = np.asarray(st["class_counts"], dtype=np.float64)  # exact below 2^53
            sums[:kk] = np.asarray(st["class_sums"], dtype=np.float64)
        parts += [counts, sums]
    flat = torch.from_numpy(np.concatenate([q.reshape(-1) for q in parts])).to(dev, f64)
    dist.all_reduce(flat, group=group)
    flat = flat.cpu().numpy()

    out = dict(st)
    pos = 0

    def take(shape):
        nonlocal pos
        size = int(np.prod(shape))
        a = flat[pos:pos + size].reshape(shape)
        pos += size
        return a

    out.update(n=N, p=p, c=c, t=t, k=k, precision=PRECISIONS[int(live[:, 6].max())],
               mean=gm.copy(), M=take((p, p)), out_mean=go.copy(), tgt_mean=gt.copy())
    out["B"] = take((p, cw)) if cw else np.zeros((p, 0))
    out["A"] = take((cw, cw)) if cw else np.zeros((0, 0))
    out["Bt"] = take((p, tw)) if tw else np.zeros((p, 0))
    out["At"] = take((tw, tw)) if tw else np.zeros((0, 0))
    if kw:
        out["class_counts"] = np.rint(take((kw,))).astype(np.int64)
        out["class_sums"] = take((kw, p))
    else:
        out["class_counts"] = np.zeros(0, dtype=np.int64)
        out["class_sums"] = np.zeros((0, p))
    for key in ("M", "A", "At"):  # symmetric up to rounding of the outer products
        out[key] = (out[key] + out[key].T) / 2
    return out
