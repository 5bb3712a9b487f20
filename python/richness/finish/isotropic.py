"""The finite-sample reference: DLR of isotropic features at the same n, active features and rank."""

from __future__ import annotations

import math

from ._xp import ns

__all__ = ["isotropic_dlr"]

# Below this many samples per feature (n < 10 p) DLR is read with a warning:
# biased toward rich at that sample size (docs/MATH.md, finite-sample bias).
SAMPLES_PER_FEATURE = 10


def undersampled(n: int, p: int) -> bool:
    """Whether ``n`` samples of ``p`` features are too few to read DLR
    without its finite-sample bias (n < ``SAMPLES_PER_FEATURE`` p)."""
    return n < SAMPLES_PER_FEATURE * p


def isotropic_dlr(n: int, p_eff: float, r: int) -> float:
    """Expected DLR of isotropic Gaussian features (n samples, p_eff features)
    with an r-dimensional linear output span: with m = n - 1 centered degrees of
    freedom, E tr(B A^+ B^T) = r (m + p - r) and E ||M||_F^2 = m p (m + p + 1)
    (Wishart moments), so DLR_iso = 1 - sqrt(r) (m + p - r) / sqrt(m p (m + p + 1)).
    Its n -> oo limit is 1 - sqrt(C/p) (docs/MATH.md, finite-sample bias and the
    isotropic reference); docs/READING_DLR.md derives it."""
    m = max(n - 1, 1)
    p = max(p_eff, 1.0)
    span = min(r, m, p)
    value = 1.0 - math.sqrt(span) * (m + p - span) / math.sqrt(m * p * (m + p + 1))
    return min(max(value, 0.0), 1.0)


def reference(st: dict, rtol: float, dlr, rank) -> tuple:
    """(active features, DLR_iso, DLR / DLR_iso, warning or None): isotropic
    features of the same n, the same number of active features (dead units
    excluded) and the same logit rank."""
    n, p, M = int(st["n"]), int(st["p"]), st["M"]
    xp = ns(M)
    var = xp.diagonal(M)
    p_active = int(xp.count_nonzero(var > rtol * var.max()))
    dlr_iso, dlr_norm = normalized(dlr, n, p_active, rank)
    warning = None
    if undersampled(n, p):
        warning = (f"n = {n} is below {SAMPLES_PER_FEATURE} x p = {SAMPLES_PER_FEATURE * p} (p = {p}): DLR is "
                   "biased toward rich at this sample size"
                   + (f" (isotropic features here would give {dlr_iso:.3f})" if dlr_iso is not None else "")
                   + ": read it against that reference (dlr_normalized), or add samples")
    return p_active, dlr_iso, dlr_norm, warning


def normalized(dlr, n: int, p_active: float, rank) -> tuple:
    """(DLR_iso, DLR / DLR_iso): the isotropic reference at ``n`` samples,
    ``p_active`` active features and ``rank``, and DLR read against it (None
    where DLR is None, or the reference is 0); both None without DLR."""
    if dlr is None:
        return None, None
    dlr_iso = isotropic_dlr(n, p_active, rank)
    return dlr_iso, (dlr / dlr_iso if dlr_iso > 0 else None)
