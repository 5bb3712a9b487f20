"""The finishing policy every route shares: the rank cut's default, when NC1 is
reported, and which values are undefined (fewer than two samples, constant
features or outputs, an empty learned span).

``dlr_only`` is the monitoring route (DLR, rank and NC1, no spectrum);
``finish`` in this package builds the full report on the same rules;
``GramRows`` and ``finish_gram_rows`` finish stacked per-batch states given
as small Gram matrices (docs/MATH.md, per-batch sample-space form).
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple, Optional

import numpy as np

from ._xp import ns
from .dlr import default_rtol, dlr_of_state, dlr_values, span_of_grams
from .nc1 import NC1_RESOLVED, nc1_error, nc1_from_grams, nc1_reliable, nc1_with_scale

__all__ = ["DlrOnlyResult", "dlr_only", "rtol_for"]


def check_rtol(rtol: Optional[float]) -> Optional[float]:
    """``rtol`` as a float (any real number type: numpy scalars too); ValueError
    unless it is None or a number in (0, 1)."""
    if rtol is None:
        return None
    if isinstance(rtol, (bool, np.bool_)) or not isinstance(rtol, numbers.Real) or not 0.0 < float(rtol) < 1.0:
        raise ValueError(f"rtol must be a number in (0, 1), got {rtol!r}")
    return float(rtol)


def rtol_for(precision: str, rtol: Optional[float] = None) -> float:
    """The eigenvalue cut: ``rtol`` (checked), or by default the product
    precision's (docs/MATH.md, rank cut)."""
    rtol = check_rtol(rtol)
    return default_rtol(precision) if rtol is None else rtol


def too_few_samples(n: int) -> Optional[str]:
    """Why a covariance is undefined with ``n`` samples (n < 2), else None."""
    if n >= 2:
        return None
    return "no samples were added" if n == 0 else "one sample was added"


def nc1_reported(st: dict, rtol: float) -> tuple:
    """(NC1 or None, warning or None): NC1 only with labels, and only from
    products that resolve within-class spread (``nc1_reliable``); a value
    whose rounding bound (``nc1_error``) passes ``NC1_RESOLVED`` of it is
    given with a warning."""
    if st["k"] <= 0:
        return None, None
    if not nc1_reliable(st["precision"]):
        return None, (f"NC1 not reported: {st['precision']} products cannot resolve within-class spread; "
                      "precision='fp32' or 'fp64' measures it")
    value, rounding = nc1_with_scale(st, rtol)
    error = nc1_error(st["precision"], rounding)
    if value is not None and error > NC1_RESOLVED * value:
        remedy = "" if st["precision"] == "fp64" else "; float64 inputs or precision='fp64' resolve it"
        return value, (f"NC1 = {value:.3g} may be off by more than {NC1_RESOLVED:.0%}: {st['precision']} products "
                       f"leave a rounding error of up to about {error:.1g} in it here (the within-class spread is "
                       f"near their rounding level; NC1 is resolved to {NC1_RESOLVED:.0%} above about "
                       f"{error / NC1_RESOLVED:.1g}){remedy}")
    return value, None


class DlrOnlyResult(NamedTuple):
    """DLR without the spectrum. ``undefined``: why DLR is None (too few
    samples, constant features or outputs, no outputs or head), else None;
    ``warnings``: what else the caller may pass on."""

    n: int
    dlr: Optional[float]
    rank: Optional[int]
    nc1: Optional[float]
    undefined: Optional[str]
    warnings: tuple
    dlr_range: Optional[tuple] = None  # DLR at rtol / 10 and rtol * 10


def dlr_only(st: dict, W: Any = None, rtol: Optional[float] = None, with_nc1: bool = True) -> DlrOnlyResult:
    """DLR, rank and (``with_nc1``) NC1 of a state dict, no spectrum
    (O(p^2 C)), on the rules of the full report: the default ``rtol``, NC1's
    gating, None where a value is undefined (never an exception for data
    that merely does not define DLR). ``W``: a linear head's weights (C x p)
    in the state's namespace, used instead of the streamed outputs."""
    n = int(st["n"])
    few = too_few_samples(n)
    if few is not None:
        return DlrOnlyResult(n, None, None, None, f"until at least 2 samples are added ({few})", ())
    rtol = rtol_for(st["precision"], rtol)
    dlr = rank = undefined = dlr_range = None
    try:
        dlr, rank, dlr_range = dlr_of_state(st, W, rtol, with_range=True)
    except ValueError as e:  # constant features or outputs, no outputs or head
        undefined = f"for the samples added ({e})"
    value, warning = nc1_reported(st, rtol) if with_nc1 else (None, None)
    return DlrOnlyResult(n, dlr, rank, value, undefined, (warning,) if warning else (), dlr_range)


class GramRows(NamedTuple):
    """Stacked per-batch states as small float64 Gram matrices (leading axis:
    steps). With the centered features Xc (n x p), outputs Fc and class means
    D = Yn^T Xc: ``norm_m`` = ||Xc^T Xc||_F; ``A``, ``Q`` = Fc^T Fc,
    Fc^T G Fc (c = C), or Fc Fc^T, G in sample space (c = n); with labels
    (k class columns) ``counts``, ``DDt`` = D D^T, ``DMD`` = D M D^T and
    ``invalid`` (samples outside the classes); ``eig`` the eigenvalues of
    G (descending; the nonzero spectrum of M) when the representation
    diagnostics are asked for, ``eig_raw`` the min(n, p) largest of the
    uncentered Gram X X^T's (RankMe's). Without outputs (a features-only Monitor)
    ``A`` and ``Q`` are None (c = 0). ``pack`` lays them side by side in one
    (steps, m) array (one copy to the host), ``unpack`` reads them back by
    name."""

    norm_m: Any
    A: Any
    Q: Any
    counts: Any = None
    DDt: Any = None
    DMD: Any = None
    invalid: Any = None
    eig: Any = None
    eig_raw: Any = None

    @staticmethod
    def shapes(c: int, k: int, e: int = 0, r: int = 0) -> dict:
        """Each field's per-step shape, in packing order (labels only with k > 0,
        the ``e`` and ``r`` eigenvalues only when those are > 0)."""
        out = {"norm_m": (), "A": (c, c), "Q": (c, c)}
        if k:
            out.update(counts=(k,), DDt=(k, k), DMD=(k, k), invalid=())
        if e:
            out["eig"] = (e,)
        if r:
            out["eig_raw"] = (r,)
        return out

    def pack(self) -> Any:
        steps = self.norm_m.shape[0]
        parts = [v.reshape(steps, -1) for v in self if v is not None]
        xp = ns(parts[0])
        return xp.cat(parts, dim=1) if xp is not np else np.concatenate(parts, axis=1)

    @classmethod
    def unpack(cls, v: Any, c: int, k: int, e: int = 0, r: int = 0) -> "GramRows":
        steps, pos, fields = v.shape[0], 0, {}
        for name, shape in cls.shapes(c, k, e, r).items():
            size = int(np.prod(shape, dtype=np.int64))
            fields[name] = v[:, pos:pos + size].reshape((steps,) + shape)
            pos += size
        if pos != v.shape[1]:
            raise ValueError(f"packed rows have {v.shape[1]} columns, the layout for c={c}, k={k}, e={e}, r={r} "
                             f"has {pos}")
        return cls(**fields)


def finish_gram_rows(rows: GramRows, n: int, rtol: float, sample_space: bool) -> tuple:
    """DLR, rank and NC1 of each step of ``rows`` (float64, host), on the
    stacked matrices at once (no loop over steps): three lists, None where a
    value is undefined (constant features or outputs; fewer than two classes;
    labels outside the classes)."""
    steps = rows.norm_m.shape[0]
    # <G, P> over the kept eigenpairs (a_i, u_i) of A: ||B u_i||^2 / a_i = u_i^T Q u_i / a_i
    # (C-space), or u_i^T G u_i for eigenvectors of Fc Fc^T (sample space)
    a, terms = span_of_grams(rows.A, rows.Q, rtol, divide=not sample_space)
    dlr, rank = dlr_values(rows.norm_m, a, terms, rtol)
    ok = ~np.isnan(dlr)
    dlrs = [float(d) if good else None for d, good in zip(dlr, ok)]
    ranks = [int(r) if good else None for r, good in zip(rank, ok)]
    nc1s: list = [None] * steps
    if rows.counts is not None:
        value, defined = nc1_from_grams(rows.DDt, rows.DMD, rows.counts, n, rtol)
        nc1s = [float(x) if good else None for x, good in zip(value, defined & (rows.invalid == 0))]
    return dlrs, ranks, nc1s
