"""The array-namespace switch: the finishing math runs on numpy arrays or on torch tensors."""

from __future__ import annotations

import math

import numpy as np

from .._checks import is_torch


class _TorchNamespace:
    """The numpy functions used here, on torch tensors: ``compute()`` of a CUDA
    state runs this same math on the device, in float64. torch is imported
    only on that path (numpy stays the one hard dependency)."""

    def __init__(self, torch, device) -> None:
        self._torch, self.device, self.linalg = torch, device, torch.linalg

    def __getattr__(self, name: str):  # sum, einsum, outer, diag, trace, sqrt, exp, log, clip, flip, where, ...
        return getattr(self._torch, name)

    def cumsum(self, x):
        return self._torch.cumsum(x, 0)

    def count_nonzero(self, x, axis=None):
        return self._torch.count_nonzero(x) if axis is None else self._torch.count_nonzero(x, axis)

    def swapaxes(self, x, a: int, b: int):
        return x.transpose(a, b)

    def empty(self, n: int):
        return self._torch.empty(n, dtype=self._torch.float64, device=self.device)

    def zeros(self, n: int):
        return self._torch.zeros(n, dtype=self._torch.float64, device=self.device)

    def asarray(self, x):
        return self._torch.as_tensor(x, device=self.device)


def ns(a):
    """numpy for numpy arrays; the torch shim for torch tensors (CUDA compute)."""
    if isinstance(a, np.ndarray) or not is_torch(a):
        return np
    import torch

    return _TorchNamespace(torch, a.device)


def f64(a):
    return a.astype(np.float64) if isinstance(a, (np.ndarray, np.generic)) else a.double()


def host(a):
    """A numpy copy of a torch result (Report fields are numpy); numpy passes through."""
    if a is None or isinstance(a, np.ndarray) or not hasattr(a, "detach"):
        return a
    return a.detach().cpu().numpy()


def norm(a) -> float:
    """Frobenius norm, scaled first so that the squares neither overflow
    (entries above 1e154) nor underflow (below 1e-154).

    On numpy arrays the sum of squares is numpy's own loop (``einsum``), not
    ``linalg.norm``: that calls a threaded BLAS dot, whose thread pool wakes
    beside the core's and torch's on every per-batch finishing and slows the
    next update several-fold (benchmarks/RESULTS.md, torchmetrics metric)."""
    xp = ns(a)
    if not a.shape[0]:
        return 0.0
    # One pass first: the plain sum of squares is exact enough wherever it
    # lands well inside float64's range (no square can then have overflowed,
    # and those that underflowed are below 1e-308 of a sum above 1e-280);
    # only outside it (or for NaN and Inf) the scaled pass below. At p = 512
    # this is a third of the finishing time of a Monitor window.
    sq = float(np.einsum("i,i->", a.reshape(-1), a.reshape(-1))) if xp is np else float(
        xp.linalg.vector_norm(a)) ** 2
    if 1e-280 < sq < 1e280:
        return math.sqrt(sq)
    scale = float(xp.abs(a).max())
    if not (scale > 0.0 and math.isfinite(scale)):
        return scale
    b = a / scale
    if xp is np:
        flat = b.reshape(-1)
        return scale * math.sqrt(float(np.einsum("i,i->", flat, flat)))
    return scale * float(xp.linalg.norm(b))


def eigh_desc(S) -> tuple:
    """Eigenvalues (descending, clipped at 0) and eigenvectors of symmetric S;
    a leading batch axis is allowed (stacked matrices)."""
    xp = ns(S)
    w, V = xp.linalg.eigh(S)
    return xp.clip(xp.flip(w, (-1,)), 0.0, None), xp.flip(V, (-1,))


def kept(a, rtol: float):
    """Mask of the eigenvalues above the rank cut, ``a_i > rtol * a_max``, over
    the last axis of descending ``a``; all False where ``a_max`` is 0
    (docs/MATH.md, rank cut)."""
    top = a[..., :1]
    return (a > rtol * top) & (top > 0.0)
