"""The finishing policy every route shares: the rank cut's default, when NC1 is
reported, and which values are undefined (fewer than two samples, constant
features or outputs, an empty learned span).

``dlr_only`` is the monitoring route (DLR, rank and NC1, no spectrum);
``finish`` in this package builds the full report on the same rules, and
``samplespace`` the one-batch routes' values.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple, Optional

import numpy as np

from .dlr import default_rtol, dlr_of_state
from .nc1 import NC1_RESOLVED, nc1_error, nc1_reliable, nc1_with_scale

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
