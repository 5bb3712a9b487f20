"""Baseline measures the paper compares DLR against (docs/MATH.md, "S_init
baseline" and "NC1").

* ``InitSimilarity``: kernel similarity to initialisation,
  ``S_init = CKA(K_t, K_0) = ||Phi_t,c^T Phi_0,c||_F^2 / (||M_t||_F ||M_0||_F)``,
  streamed from the p_t x p_0 cross-moment of current and initial features on
  the same inputs (never an n x n matrix).
* ``parameter_norm``: the Euclidean norm of all parameters, or of their
  distance to a reference (the initial parameters).
* NC1 is ``Report.nc1`` (``richness.Moments`` with labels).

Streaming follows the core's discipline: each batch is centred on its own
float64 mean before its product is formed, products are float64, and states
merge with Chan's pairwise update, so the answer does not depend on how the
samples are split into batches. numpy is the only requirement; torch tensors
are accepted (state kept as float64 tensors on their device, imported lazily).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Tuple

import numpy as np

__all__ = ["InitSimilarity", "init_similarity", "parameter_norm"]


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _as_f64(x: Any, name: str, like: Any = None) -> Any:
    """``x`` as a 2-D float64 array: numpy, or a torch tensor on its device.

    ``like``: an existing state array; the batch follows its framework/device."""
    if _is_torch(x):
        import torch

        x = x.detach()
        if x.is_complex() or not (x.is_floating_point()):
            raise TypeError(f"{name} must be a real floating tensor, got {x.dtype}")
        x = x.to(torch.float64)
        if like is not None and not _is_torch(like):
            x = x.cpu().numpy()
        elif like is not None and x.device != like.device:
            raise ValueError(f"{name} is on {x.device} but this state lives on {like.device}")
    else:
        arr = np.asarray(x)
        if arr.dtype.kind not in "f":
            raise TypeError(f"{name} must be a floating array, got dtype {arr.dtype}")
        x = arr.astype(np.float64, copy=False)
        if like is not None and _is_torch(like):
            import torch

            x = torch.as_tensor(x, device=like.device)
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D (n, width), got shape {tuple(x.shape)}")
    return x


def _frob(x: Any) -> float:
    if _is_torch(x):
        return float(x.norm().item())
    return float(np.linalg.norm(x))


class InitSimilarity:
    """Streamed kernel similarity to initialisation, S_init (linear CKA).

    ``update(features_now, features_init)`` takes the penultimate features of
    the current and of the initial network on the same batch of inputs (rows
    paired). The state is ``n``, the two float64 means, ``M_t`` (p_t x p_t),
    ``M_0`` (p_0 x p_0) and the cross-moment ``X = sum (phi_t - mu_t)(phi_0 - mu_0)^T``
    (p_t x p_0); ``compute()`` returns ``||X||_F^2 / (||M_t||_F ||M_0||_F)`` in
    [0, 1] (1 = the kernel has not moved, up to scale).

    numpy inputs are checked for NaN/Inf on ``update``; torch tensors are not
    (that would synchronise a GPU every batch): a non-finite value poisons the
    state and ``compute`` raises.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget all samples (widths are free again)."""
        self.n = 0
        self.mean_now: Any = None
        self.mean_init: Any = None
        self.M_now: Any = None
        self.M_init: Any = None
        self.cross: Any = None

    @property
    def widths(self) -> Optional[Tuple[int, int]]:
        """``(p_t, p_0)`` once a batch has been seen, else None."""
        return None if self.cross is None else (int(self.cross.shape[0]), int(self.cross.shape[1]))

    def update(self, features_now: Any, features_init: Any) -> None:
        """Add a batch: ``features_now`` (n, p_t) and ``features_init`` (n, p_0)
        on the same n inputs. Invalid input raises and leaves the state as it was."""
        a = _as_f64(features_now, "features_now", self.cross)
        b = _as_f64(features_init, "features_init", self.cross if self.cross is not None else a)
        if a.shape[0] != b.shape[0]:
            raise ValueError(f"features_now has {a.shape[0]} rows but features_init has {b.shape[0]}; "
                             "they must be the same inputs")
        if self.widths is not None and (a.shape[1], b.shape[1]) != self.widths:
            raise ValueError(f"feature widths changed: this state has (p_t, p_0) = {self.widths}, "
                             f"the batch has ({a.shape[1]}, {b.shape[1]})")
        nb = int(a.shape[0])
        if nb == 0:
            return
        if not _is_torch(a):
            bad = int(np.count_nonzero(~np.isfinite(a))) + int(np.count_nonzero(~np.isfinite(b)))
            if bad:
                raise ValueError(f"the batch contains {bad} NaN or Inf values")
        # Centre on the batch's own float64 mean before any product (no E[xx^T] - E[x]E[x]^T).
        ma, mb = a.mean(0), b.mean(0)
        ac, bc = a - ma, b - mb
        Ma, Mb, Xab = ac.T @ ac, bc.T @ bc, ac.T @ bc
        self._merge(nb, ma, mb, Ma, Mb, Xab)

    def _merge(self, nb: int, ma: Any, mb: Any, Ma: Any, Mb: Any, Xab: Any) -> None:
        if self.n == 0:
            self.n, self.mean_now, self.mean_init = nb, ma, mb
            self.M_now, self.M_init, self.cross = Ma, Mb, Xab
            return
        na = self.n
        n = na + nb
        da, db = ma - self.mean_now, mb - self.mean_init
        w = na * nb / n
        # Chan et al.: the cross terms take the outer product of the two mean shifts.
        if _is_torch(da):
            import torch

            outer = torch.outer
        else:
            outer = np.outer
        self.M_now = self.M_now + Ma + outer(da, da) * w
        self.M_init = self.M_init + Mb + outer(db, db) * w
        self.cross = self.cross + Xab + outer(da, db) * w
        self.mean_now = self.mean_now + da * (nb / n)
        self.mean_init = self.mean_init + db * (nb / n)
        self.n = n

    def merge(self, other: "InitSimilarity") -> None:
        """Add another state (Chan et al. pairwise merge)."""
        if not isinstance(other, InitSimilarity):
            raise TypeError(f"merge expects an InitSimilarity, got {type(other).__name__}")
        if other.n == 0:
            return
        if self.widths is not None and other.widths != self.widths:
            raise ValueError(f"cannot merge states of widths {self.widths} and {other.widths}")
        def like(x: Any) -> Any:
            if self.cross is None:
                return x.clone() if _is_torch(x) else np.array(x, dtype=np.float64)
            if _is_torch(self.cross):
                import torch

                return torch.as_tensor(x, dtype=torch.float64, device=self.cross.device)
            return x.detach().cpu().numpy() if _is_torch(x) else np.asarray(x, dtype=np.float64)

        self._merge(other.n, like(other.mean_now), like(other.mean_init), like(other.M_now),
                    like(other.M_init), like(other.cross))

    def compute(self) -> float:
        """S_init = ||X||_F^2 / (||M_t||_F ||M_0||_F) in [0, 1]; the state is not modified."""
        if self.n < 2:
            raise ValueError(f"S_init needs at least 2 samples, this state has {self.n}")
        x, mt, m0 = _frob(self.cross), _frob(self.M_now), _frob(self.M_init)
        if not all(np.isfinite(v) for v in (x, mt, m0)):
            raise ValueError("the state contains NaN or Inf (a non-finite feature was streamed)")
        if mt == 0.0 or m0 == 0.0:
            which = "features_now" if mt == 0.0 else "features_init"
            raise ValueError(f"{which} are constant over the samples: the kernel is zero and CKA is undefined")
        return float(x * x / (mt * m0))

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
    if _is_torch(obj) or isinstance(obj, np.ndarray):
        return [obj]
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, Iterable):
        return list(obj)
    raise TypeError(f"expected a module (with .parameters()), an array or an iterable of arrays, "
                    f"got {type(obj).__name__}")


def _sumsq(x: Any) -> float:
    if _is_torch(x):
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
        if _is_torch(x) or _is_torch(r):
            import torch

            xt = torch.as_tensor(x).detach().to(torch.float64).cpu()
            rt = torch.as_tensor(r).detach().to(torch.float64).cpu()
            total += float(torch.sum((xt - rt) ** 2).item())
        else:
            total += _sumsq(np.asarray(x, dtype=np.float64) - np.asarray(r, dtype=np.float64))
    return float(np.sqrt(total))
