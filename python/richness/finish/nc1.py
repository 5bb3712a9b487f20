"""NC1 (within-class over between-class spread) from class means and the feature moments."""

from __future__ import annotations

from typing import Optional

import numpy as np

from .._state import precision_mode
from ._xp import eigh_desc, f64, kept, ns


def nc1_reliable(precision: str) -> bool:
    """Whether products of ``precision`` resolve NC1, from the core's precision
    table: NC1 subtracts nearly equal p x p matrices near collapse; tf32 and
    bf16 products were measured useless there, errors of 100% and more
    (docs/MATH.md, NC1)."""
    return precision_mode(precision).resolves_nc1


def _nc1_of_grams(DDt, DMD, counts, n, rtol: float) -> tuple:
    """(nc1, defined, scale) of ``nc1_from_grams``; ``scale`` is NC1 with
    Sigma_W replaced by the total spread M / n along each direction (about
    (K - 1) / K): a relative rounding error e of the products leaves about
    e * scale in NC1 (``nc1_floor``)."""
    xp = ns(DDt)
    s, U = eigh_desc((DDt + xp.swapaxes(DDt, -1, -2)) / 2)
    keep = kept(s, rtol)
    safe = xp.where(keep, s, 1.0)
    vmv = xp.einsum("...ij,...ij->...j", DMD @ U, U) / safe
    between = s * xp.einsum("...k,...ki->...i", counts, U * U)
    # v^T Sigma_W v = (v^T M v - sum_k n_k (d_k . v)^2) / n
    vwv = (vmv - between) / n
    K = f64((counts > 0).sum(axis=-1))
    kk = xp.clip(K, 1.0, None)
    value = xp.where(keep, vwv / (safe / kk[..., None]), 0.0).sum(axis=-1) / kk
    scale = xp.where(keep, (vmv / n) / (safe / kk[..., None]), 0.0).sum(axis=-1) / kk
    return xp.clip(value, 0.0, None), (K >= 2) & keep[..., 0], scale


def nc1_from_grams(DDt, DMD, counts, n, rtol: float) -> tuple:
    """NC1 = tr(Sigma_W Sigma_B^+) / K from K x K Grams of the centered class
    means D (rows d_k; rows of absent classes are 0): DDt = D D^T and
    DMD = D M D^T, with the class counts and n (docs/MATH.md, NC1). Sigma_B =
    D^T D / K has its eigenpairs from DDt: v_i = D^T u_i / sqrt(s_i), so
    v^T M v = u^T DMD u / s and (d_k . v_i)^2 = s_i u_ki^2. Leading axes
    batch stacked states. Returns (nc1 clipped at 0, defined): undefined with
    fewer than two classes present or Sigma_B = 0."""
    return _nc1_of_grams(DDt, DMD, counts, n, rtol)[:2]


def nc1_from_class_means(D, counts, n: float, M, rtol: float) -> tuple:
    """(NC1 or None, its rounding scale, see ``_nc1_of_grams``) of one state
    from the centered class means D (K x p, classes present), their counts, n
    and M. With K <= p from the K x K Grams (an SVD of D cost 3-9x more), else
    from the p x p between-class scatter."""
    xp = ns(D)
    K, p = D.shape
    if K <= p:
        value, defined, scale = _nc1_of_grams(D @ D.T, (D @ M) @ D.T, counts, n, rtol)
        return (float(value) if bool(defined) else None), float(scale)
    s, V = eigh_desc(D.T @ D)
    keep = s > rtol * s[0]
    if not bool(keep.any()):
        return None, 0.0
    Vt = V[:, keep].T
    dv = D @ Vt.T
    vmv = xp.einsum("ij,ij->i", Vt @ M, Vt)
    vwv = (vmv - (counts[:, None] * dv * dv).sum(axis=0)) / n
    scale = float(xp.sum((vmv / n) / (s[keep] / K))) / K
    return max(float(xp.sum(vwv / (s[keep] / K))) / K, 0.0), scale


# The relative rounding of one product's entries, by product precision. NC1
# is a difference of nearly equal matrices near collapse: errors of fp32
# products of float32 inputs measured up to 0.06 of 64 eps times NC1's scale,
# and 100% or more below it; 1024 eps times the scale is where NC1 is good to
# about 1% (docs/MATH.md, NC1).
PRODUCT_EPS = {"fp64": float(np.finfo(np.float64).eps), "fp32": float(np.finfo(np.float32).eps)}


def nc1_floor(precision: str, scale: float) -> float:
    """The smallest NC1 that products of ``precision`` give to about 1%, for a
    state whose NC1 rounding scale is ``scale`` (``nc1_from_class_means``)."""
    return 1024.0 * PRODUCT_EPS.get(precision, 1.0) * scale


def nc1_with_scale(st: dict, rtol: float) -> tuple:
    """(NC1 = tr(Sigma_W Sigma_B^+) / K or None, its rounding scale) (Papyan et
    al. 2020; docs/MATH.md, NC1); the classes present only."""
    if st["k"] <= 0:
        return None, 0.0
    counts = f64(st["class_counts"])
    present = counts > 0
    if int(present.sum()) < 2:
        return None, 0.0
    D = st["class_sums"][present] / counts[present, None] - st["mean"][None, :]
    return nc1_from_class_means(D, counts[present], float(st["n"]), st["M"], rtol)


def nc1(st: dict, rtol: float) -> Optional[float]:
    """NC1 = tr(Sigma_W Sigma_B^+) / K (Papyan et al. 2020; docs/MATH.md, NC1)."""
    return nc1_with_scale(st, rtol)[0]
