"""Linear-regression R^2 between representations from the joint co-moments of
k representations side by side (docs/MATH.md, "The similarity family").

Entry [i, j] is the fraction of representation j's variance that a linear map
from representation i explains (least squares on the centred samples, the
intercept absorbed by the centring). With ``C_rs`` the blocks of the centred
co-moment sum ``M`` and the eigenpairs ``(lambda_m, v_m)`` of ``C_ii`` kept by
the rank cut ``lambda_m > rtol * lambda_1``, ``g_m = ||v_m^T C_ij||^2``:

    ridge = 0:  R^2 = ||Qi^T Yc||_F^2 / ||Yc||_F^2 = tr(C_ji C_ii^+ C_ij) / tr C_jj
                    = sum_m g_m / lambda_m / tr C_jj
    ridge > 0:  B = (C_ii + mu I)^-1 C_ij,  mu = ridge * tr(C_ii) / p_i,
                R^2 = 1 - ||Yc - Xc B||_F^2 / ||Yc||_F^2
                    = sum_m g_m (lambda_m + 2 mu) / (lambda_m + mu)^2 / tr C_jj

(the ridge is relative to the mean eigenvalue of ``C_ii``, so R^2 does not
depend on either representation's scale; both sums run over the kept
directions, so ridge -> 0 gives the plain fit). Not symmetric: regressing
j on i is not regressing i on j. The plain fit's diagonal is 1. Plain numpy
float64, without the compiled core.
"""

from __future__ import annotations

import math
import numbers
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .cca import NULL_NOTE, JointBlocks, kept_count
from .policy import check_rtol

__all__ = ["linreg_matrix"]


def check_ridge(ridge: object) -> float:
    """``ridge`` as a float, ValueError unless it is a finite number >= 0."""
    if isinstance(ridge, (bool, np.bool_)) or not isinstance(ridge, numbers.Real) \
            or not (math.isfinite(float(ridge)) and float(ridge) >= 0.0):
        raise ValueError(f"ridge must be a finite number >= 0, got {ridge!r}")
    return float(ridge)


def linreg_matrix(M: np.ndarray, n: int, names: Sequence[str], widths: Sequence[int], *,
                  rtol: float, ridge: float = 0.0) -> Tuple[np.ndarray, List[str]]:
    """``(R2, notes)``: the k x k float64 matrix whose entry [i, j] is the
    fraction of representation j's variance explained by a linear map from
    representation i (least squares, or ridge regression with penalty ``ridge *
    tr(C_ii) / p_i``, i.e. ``ridge`` times the mean eigenvalue of i's
    co-moments), over a joint co-moment sum ``M`` of ``n`` samples, and what
    the caller should warn about, one line each.

    M: the centred co-moment sum over ``[x_1 .. x_k]`` or ``[x_1 .. x_k, a_1 ..
        a_k]`` (the norm columns are not read), at any per-representation scale.
    names, widths: the representations and their column counts, in ``M``'s order.
    rtol: the rank cut on each ``C_ii``'s eigenvalues (``policy.rtol_for``), in (0, 1).
    ridge: a finite number >= 0; 0 is the plain least-squares fit (diagonal 1).

    Values lie in [0, 1]; the matrix is not symmetric. NaN in the rows and
    columns of a constant representation and everywhere below 2 samples (with
    a note). A source whose rank reaches n - 1 fits every target exactly (1 by
    construction); one where independent targets would give an R^2 of
    ``NULL_NOTE`` or more (``rank / (n - 1)`` for the plain fit) is biased
    toward 1: both values are returned, with a note naming the sources.

    Raises ValueError for an ``rtol`` or ``ridge`` out of range, or an ``M``
    whose shape does not match ``widths`` or that is not finite.
    """
    rtol_c: Optional[float] = check_rtol(rtol)
    if rtol_c is None:
        raise ValueError("linreg_matrix: rtol must be a number in (0, 1), got None (policy.rtol_for gives the default)")
    ridge = check_ridge(ridge)
    J = JointBlocks(M, n, names, widths, "linreg_matrix")
    k = J.k
    out = np.full((k, k), np.nan)
    what = "linreg_r2" + (f" (ridge = {ridge:g})" if ridge > 0 else "")
    live, notes = J.defined(what)
    forced, biased = [], []
    for i in live:
        lam, V = J.eig(i)
        rank = kept_count(lam, rtol_c)
        lam, V = lam[:rank], V[:, :rank]
        mu = ridge * J.trace[i] / J.widths[i]
        # per kept direction: its share of the fit, and of the fit to an independent isotropic target
        gain = (lam + 2 * mu) / (lam + mu) ** 2
        null = float(np.sum(lam * gain)) / (J.n - 1)
        if ridge == 0 and rank >= J.n - 1:
            forced.append(f"{J.names[i]} (rank {rank})")
        elif null >= NULL_NOTE:
            biased.append(f"{J.names[i]} (independent level {null:.3f})")
        for j in live:
            if j == i and ridge == 0:
                out[i, j] = 1.0
                continue
            G = V.T @ J.block(i, j)
            out[i, j] = min(max(float(np.sum(G * G, axis=1) @ gain) / J.trace[j], 0.0), 1.0)
    if forced:
        notes.append(f"{what}: 1 by construction from sources {forced}: a source of rank n - 1 = {J.n - 1} or more "
                     "fits any target exactly; more samples are needed")
    if biased:
        notes.append(f"{what}: biased toward 1 from sources {biased}: a target independent of the source gets "
                     f"about that R^2 (rank / (n - 1) for the plain fit, n = {J.n}); compare values against it or "
                     "add samples")
    return out, notes
