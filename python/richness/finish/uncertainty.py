"""Delete-one-group jackknife error bars for DLR (docs/MATH.md, jackknife error bars).

``Moments(groups=k)`` keeps k sub-states; the k leave-one-out states come from
merges alone, so the error bar costs no second pass over the data.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import numpy as np

from .._report import Report
from .._warnings import RichnessWarning
from .diagnostics import measure_values
from .dlr import dlr_of_state

__all__ = ["add_jackknife"]

# Two-sided 95% Student t quantiles, df = 1..30 (larger df: Cornish-Fisher).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom."""
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def jackknife_se(theta) -> float:
    """SE = sqrt((k-1)/k sum (theta_i - theta_bar)^2) over k leave-one-out values."""
    theta = np.asarray(theta, dtype=np.float64)
    k = theta.shape[0]
    return math.sqrt((k - 1) / k * float(np.sum((theta - theta.mean()) ** 2)))


def _replicates(report: Report, loo_states: list, value, what: str) -> Optional[list]:
    """``value(state)`` of each leave-one-out state, or None when one of them
    raises ValueError: the data without that group do not define the quantity
    (its features or outputs are constant there, say), so there is no error
    bar; the estimate from all samples stands. The warning names the group
    (numbered from 0 in the order the groups are filled) and the reason; it
    goes to ``report.warnings`` and is issued as a ``RichnessWarning``."""
    out = []
    for i, st in enumerate(loo_states):
        try:
            out.append(value(st))
        except ValueError as e:
            left = report.n - int(st["n"])
            message = (f"no error bars for {what}: with group {i} of {len(loo_states)} ({left} samples) left out, "
                       f"{e}; the estimate from all samples is given without them (fewer, larger groups, a smaller "
                       "Moments(groups=k), may give them)")
            report.warnings.append(message)
            warnings.warn(message, RichnessWarning, stacklevel=4)
            report._mark_issued([message])  # print(report) counts it instead of repeating it
            return None
    return out


def add_measure_jackknife(report: Report, loo_states: list, W, names: list, centered: bool = True,
                          options: Optional[dict] = None) -> None:
    """``report.measures_stderr``: the jackknife standard error of each named
    representation diagnostic over the leave-one-out states (one p x p
    eigenvalue decomposition per state for the spectral ones; the class-mean
    ones cost a K x K Gram each). A measure undefined on some leave-one-out
    state has no standard error (None)."""
    if not names:
        return
    values = [measure_values(st, W, report.rtol, tuple(names), centered=centered, options=options)[0]
              for st in loo_states]
    out = {}
    for name in names:
        theta = [v[name] for v in values]
        out[name] = None if any(t is None for t in theta) else jackknife_se(theta)
    report.measures_stderr = out


def add_jackknife(report: Report, loo_states: list, W) -> None:
    """Quenouille-Tukey jackknife over k leave-one-out states:
    SE^2 = (k-1)/k sum (theta_i - theta_bar)^2, bias-corrected
    theta_J = k theta - (k-1) theta_bar, 95% interval theta_J +- t_{k-1} SE.
    The interval is centred on theta_J: DLR's finite-sample bias is O(1/n),
    which the jackknife removes to first order. A leave-one-out state whose
    DLR is undefined (without that group the features or outputs are
    constant) leaves the three fields None, with a warning naming the group
    (``_replicates``)."""
    assert report.dlr is not None  # the caller adds the jackknife only to a defined DLR
    k = len(loo_states)
    values = _replicates(report, loo_states, lambda st: dlr_of_state(st, W, report.rtol)[0], "DLR")
    if values is None:
        return
    theta = np.array(values)
    bar = float(theta.mean())
    se = jackknife_se(theta)
    corrected = k * report.dlr - (k - 1) * bar
    half = t975(k - 1) * se
    report.dlr_stderr = se
    report.dlr_jackknife = corrected
    report.dlr_interval = (corrected - half, corrected + half)
