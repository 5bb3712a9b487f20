"""Baseline measures the paper compares DLR against (docs/MATH.md, "S_init
baseline" and "NC1").

* ``InitSimilarity``: kernel similarity to initialisation,
  ``S_init = CKA(K_t, K_0) = ||Phi_t,c^T Phi_0,c||_F^2 / (||M_t||_F ||M_0||_F)``,
  streamed from the p_t x p_0 cross-moment of current and initial features on
  the same inputs (never an n x n matrix).
* ``parameter_norm``: the Euclidean norm of all parameters, or of their
  distance to a reference (the initial parameters).
* NC1 is ``Report.nc1`` (``richness.Moments`` with labels).

``InitSimilarity`` is a ``richness.Similarity`` of two representations: the
core's streamed float64 co-moments (batch centering, Chan merges), so the
answer does not depend on how the samples are split into batches. numpy is
the only requirement; torch tensors are accepted.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Tuple

import numpy as np

from ._checks import is_torch

__all__ = ["InitSimilarity", "init_similarity", "parameter_norm"]


class InitSimilarity:
    """Streamed kernel similarity to initialisation, S_init (linear CKA).

    ``update(features_now, features_init)`` takes the penultimate features of
    the current and of the initial network on the same batch of inputs (rows
    paired). The state is a ``richness.Similarity`` of the two (float64
    products: float32 inputs are widened); ``compute()`` returns its biased
    CKA ``||X||_F^2 / (||M_t||_F ||M_0||_F)`` in [0, 1] (1 = the kernel has not
    moved, up to scale), with ``X = sum (phi_t - mu_t)(phi_0 - mu_0)^T``.
    ``cross``, ``M_now``, ``M_init``, ``mean_now`` and ``mean_init`` read those
    blocks of the state as float64 numpy arrays. Invalid input (NaN or Inf
    included) raises and leaves the state as it was.
    """

    _NAMES = ("now", "init")

    def __init__(self) -> None:
        from ._engine.similarity import Similarity

        self._sim = Similarity(precision="fp64")

    def reset(self) -> None:
        """Forget all samples (widths are free again)."""
        self._sim.reset()

    @property
    def n(self) -> int:
        return self._sim.n

    @property
    def widths(self) -> Optional[Tuple[int, int]]:
        """``(p_t, p_0)`` once a batch has been seen, else None."""
        w = self._sim.widths
        return None if not w else (w[0], w[1])

    def update(self, features_now: Any, features_init: Any) -> None:
        """Add a batch: ``features_now`` (n, p_t) and ``features_init`` (n, p_0)
        on the same n inputs. Invalid input raises and leaves the state as it was."""
        a, b = features_now, features_init
        if is_torch(a) != is_torch(b):  # one framework per batch: the numpy side follows the tensor
            import torch

            dev = (a if is_torch(a) else b).device
            a, b = (x if is_torch(x) else torch.as_tensor(np.asarray(x), device=dev) for x in (a, b))
        shapes = [tuple(getattr(x, "shape", np.shape(x))) for x in (a, b)]
        if all(len(s) == 2 for s in shapes):
            if shapes[0][0] != shapes[1][0]:
                raise ValueError(f"features_now has {shapes[0][0]} rows but features_init has {shapes[1][0]}; "
                                 "they must be the same inputs")
            if self.widths is not None and (shapes[0][1], shapes[1][1]) != self.widths:
                raise ValueError(f"feature widths changed: this state has (p_t, p_0) = {self.widths}, "
                                 f"the batch has ({shapes[0][1]}, {shapes[1][1]})")
        self._sim.update(dict(zip(self._NAMES, (a, b))))

    def merge(self, other: "InitSimilarity") -> None:
        """Add another state (Chan et al. pairwise merge)."""
        if not isinstance(other, InitSimilarity):
            raise TypeError(f"merge expects an InitSimilarity, got {type(other).__name__}")
        if other.n and self.n and other.widths != self.widths:
            raise ValueError(f"cannot merge states of widths {self.widths} and {other.widths}")
        self._sim.merge(other._sim)

    def _block(self, i: Optional[int], j: int) -> Optional[np.ndarray]:
        if self.n == 0:
            return None
        st = self._sim.state_dict()["moments"]
        offs = np.cumsum([0, *self._sim.widths])
        cols = slice(offs[j], offs[j + 1])
        return st["mean"][cols] if i is None else st["M"][offs[i]:offs[i + 1], cols]

    cross = property(lambda self: self._block(0, 1), doc="The cross-moment X (p_t x p_0).")
    M_now = property(lambda self: self._block(0, 0), doc="M_t (p_t x p_t).")
    M_init = property(lambda self: self._block(1, 1), doc="M_0 (p_0 x p_0).")
    mean_now = property(lambda self: self._block(None, 0), doc="The mean of the current features.")
    mean_init = property(lambda self: self._block(None, 1), doc="The mean of the initial features.")

    def compute(self) -> float:
        """S_init = ||X||_F^2 / (||M_t||_F ||M_0||_F) in [0, 1]; the state is not modified."""
        if self.n < 2:
            raise ValueError(f"S_init needs at least 2 samples, this state has {self.n}")
        for name, i in zip(("features_now", "features_init"), (0, 1)):
            if not np.any(self._block(i, i)):
                raise ValueError(f"{name} are constant over the samples: the kernel is zero and CKA is undefined")
        return float(self._sim.compute(measures=["cka"]).values["cka"][0, 1])

    def __repr__(self) -> str:
        return "InitSimilarity(empty)" if self.n == 0 else f"InitSimilarity(n={self.n}, widths={self.widths})"


def init_similarity(features_now: Any, features_init: Any) -> float:
    """S_init of one set of samples: ``CKA(K_t, K_0)`` from (n, p_t) and (n, p_0) features."""
    s = InitSimilarity()
    s.update(features_now, features_init)
    return s.compute()


def _arrays_of(obj: Any) -> list:
    if hasattr(obj, "parameters") and callable(obj.parameters):
        return [p.detach() for p in obj.parameters()]
    if is_torch(obj) or isinstance(obj, np.ndarray):
        return [obj]
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, Iterable):
        return list(obj)
    raise TypeError(f"expected a module (with .parameters()), an array or an iterable of arrays, "
                    f"got {type(obj).__name__}")


def _sumsq(x: Any) -> float:
    if is_torch(x):
        import torch

        return float(torch.sum(x.detach().to(torch.float64) ** 2).item())
    a = np.asarray(x, dtype=np.float64)
    return float(np.sum(a * a))


def parameter_norm(model_or_arrays: Any, reference: Any = None) -> float:
    """Euclidean norm of all parameters, accumulated in float64.

    Args:
        model_or_arrays: a ``torch.nn.Module`` (its ``parameters()``), an array,
            or an iterable (or dict) of arrays/tensors.
        reference: the same structure (e.g. the initial model): then the norm of
            the difference ``||theta - theta_ref||`` is returned.
    """
    xs = _arrays_of(model_or_arrays)
    if reference is None:
        return float(np.sqrt(sum(_sumsq(x) for x in xs)))
    rs = _arrays_of(reference)
    if len(rs) != len(xs):
        raise ValueError(f"reference has {len(rs)} parameter arrays, the model has {len(xs)}")
    total = 0.0
    for i, (x, r) in enumerate(zip(xs, rs)):
        if tuple(x.shape) != tuple(r.shape):
            raise ValueError(f"parameter {i} has shape {tuple(x.shape)} but the reference has {tuple(r.shape)}")
        if is_torch(x) or is_torch(r):
            import torch

            xt = torch.as_tensor(x).detach().to(torch.float64).cpu()
            rt = torch.as_tensor(r).detach().to(torch.float64).cpu()
            total += float(torch.sum((xt - rt) ** 2).item())
        else:
            total += _sumsq(np.asarray(x, dtype=np.float64) - np.asarray(r, dtype=np.float64))
    return float(np.sqrt(total))
