"""Finishing math: from float64 co-moments to DLR, spectrum, curves, NC1 and error bars.

One module per quantity (docs/MATH.md names each): ``dlr`` (the span of the
learned functions, the rank cut, the C >> p head route), ``spectrum`` (feature
eigenpairs, projections, training and held-out curves), ``nc1``,
``isotropic`` (the finite-sample reference), ``diagnostics`` and ``lidar``
(representation diagnostics) and ``uncertainty`` (jackknife);
``policy`` holds the rules every route shares (the default rank cut, NC1's
gating, undefined values) and the DLR-only routes built on them;
``samplespace`` finishes one-batch states given as n x n Grams (n < p) with
the same formulas. Everything else runs in float64 on p x p, p x C and C x C
matrices (n never is a dimension), on numpy arrays or on torch tensors alike
(``_xp.ns`` picks the namespace from the state), and ``finish`` assembles the
Report.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .._report import Report
from ._xp import host, ns
from .diagnostics import DEFAULT_MEASURES, MEASURES, check_measures, check_options, measure_values, nc1_script
from .dlr import NumericFailureGuard, check_features, dlr_of_state, dlr_with_range, function_moments, logits
from .isotropic import isotropic_dlr, reference
from .policy import dlr_only, nc1_reported, rtol_for, too_few_samples
from .spectrum import curve, held_out, spectrum as feature_spectrum, task_moments

__all__ = ["MEASURES", "dlr_of_state", "dlr_only", "finish", "isotropic_dlr", "rtol_for"]


def _checked_rtol(st: dict, rtol: Optional[float]) -> float:
    n = int(st["n"])
    if n == 0:
        raise ValueError("compute() on an empty Moments: no samples were added")
    if too_few_samples(n) is not None:
        raise ValueError(f"need at least 2 samples to measure a covariance, got n = {n}")
    return rtol_for(st["precision"], rtol)


def finish(st: dict, *, W: Optional[np.ndarray] = None, test: Optional[dict] = None,
           rtol: Optional[float] = None, centered: bool = True, spectrum: bool = True,
           measures: Any = None, measure_options: Any = None) -> Report:
    """The report from a state dict (as ``Moments.state_dict()`` returns).
    ``spectrum=False`` skips the p x p eigendecomposition and everything built
    on it (eigenvalues, curves, held-out curves): DLR, its rank-cut range, the
    finite-sample reference and NC1 remain. O(p^2 C) instead of O(p^3).
    ``measures``: the representation diagnostics to compute (names from
    ``MEASURES``, or ``"all"``); default all of them but LiDAR with the
    spectrum (``DEFAULT_MEASURES``), none without (a spectral one then costs
    the p x p eigenvalues alone). LiDAR reads the labels as object ids and is
    computed only where named.
    ``measure_options``: alpha-ReQ's range and weights, the neural-collapse
    convention, LiDAR's ridge (``diagnostics.check_options``; default: as
    published)."""
    wanted = check_measures(measures)
    asked = wanted is not None
    options = check_options(measure_options)
    rtol = _checked_rtol(st, rtol)
    if test is not None and not spectrum:
        raise ValueError("held-out curves (test=) need the spectrum: drop spectrum=False")
    xp = ns(st["M"])
    if xp is not np:  # a torch state (CUDA): head and held-out state join it on its device
        if W is not None:
            W = xp.asarray(W).double()
        if test is not None:
            test = {k: (xp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in test.items()}
    norm_m = check_features(st)
    with NumericFailureGuard(st, W):
        report = _report(st, W, test, rtol, centered, spectrum, norm_m)
        if wanted is None:
            wanted = DEFAULT_MEASURES if spectrum else ()
        if wanted:
            rho = None if report.eigenvalues is None else ns(st["M"]).asarray(report.eigenvalues)
            values, warnings = measure_values(st, W, rtol, wanted, lam=rho, centered=centered, options=options,
                                              asked=asked)
            for name, v in values.items():
                setattr(report, name, v)
            report.warnings += warnings
        if options["nc_convention"] == "papyan_script" and report.nc1 is not None:
            report.nc1 = nc1_script(st, rtol)  # the script's NC1, where the products resolve NC1 at all
        return report


def _report(st: dict, W, test: Optional[dict], rtol: float, centered: bool, spectrum: bool,
            norm_m: float) -> Report:
    n, p, precision = int(st["n"]), int(st["p"]), st["precision"]
    warnings = []
    fn = function_moments(st, W)
    dlr = rank = logit_eig = dlr_range = None
    if fn is not None:
        dlr, rank, eig, dlr_range, warning = dlr_with_range(fn, st["M"], norm_m, rtol)
        logit_eig = logits(eig, fn.a_scale)
        warnings += [warning] if warning else []

    spec = None
    quality = utilization = test_quality = test_utilization = test_norms = None
    if spectrum:
        spec = feature_spectrum(st, rtol, centered)
        quality, utilization = curve(spec, task_moments(st), p), curve(spec, fn, p)
        if test is not None:
            test_quality, test_utilization, test_norms = held_out(spec, st, test, W, centered)

    nc1_value, warning = nc1_reported(st, rtol)
    warnings += [warning] if warning else []

    p_active, dlr_iso, dlr_norm, warning = reference(st, rtol, dlr, rank)
    warnings += [warning] if warning else []

    rho = None if spec is None else spec.rho
    return Report(
        dlr=dlr, rank=rank, n=n, logit_eigenvalues=host(logit_eig), nc1=nc1_value,
        eigenvalues=host(rho), relative_eigenvalues=None if rho is None else host(rho / rho[0]),
        effective_dim=None if spec is None else spec.effective_dim,
        quality=host(quality), utilization=host(utilization), test_quality=host(test_quality),
        test_utilization=host(test_utilization), test_eigenfunction_norms=host(test_norms),
        feature_rank=None if spec is None else spec.rank, rtol=float(rtol), precision=precision,
        centered=centered, dlr_rtol_range=dlr_range, active_features=p_active, dlr_isotropic=dlr_iso, p=p,
        num_outputs=None if fn is None else (int(W.shape[0]) if W is not None else int(st["c"])),
        dlr_normalized=dlr_norm, warnings=warnings)
