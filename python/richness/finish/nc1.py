"""NC1 (within-class over between-class spread) from class means and the feature moments."""

from __future__ import annotations

from typing import Optional

from .._state import PRECISION_MODES
from ._xp import eigh_desc, f64, kept, ns

# NC1 subtracts nearly equal p x p matrices near collapse; tf32 and bf16
# products were measured useless there, errors of 100% and more (docs/MATH.md, NC1).
NC1_RELIABLE = tuple(m.name for m in PRECISION_MODES if m.resolves_nc1)


def nc1_from_grams(DDt, DMD, counts, n, rtol: float) -> tuple:
    """NC1 = tr(Sigma_W Sigma_B^+) / K from K x K Grams of the centered class
    means D (rows d_k; rows of absent classes are 0): DDt = D D^T and
    DMD = D M D^T, with the class counts and n (docs/MATH.md, NC1). Sigma_B =
    D^T D / K has its eigenpairs from DDt: v_i = D^T u_i / sqrt(s_i), so
    v^T M v = u^T DMD u / s and (d_k . v_i)^2 = s_i u_ki^2. Leading axes
    batch stacked states. Returns (nc1 clipped at 0, defined): undefined with
    fewer than two classes present or Sigma_B = 0."""
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
    return xp.clip(value, 0.0, None), (K >= 2) & keep[..., 0]


def nc1_from_class_means(D, counts, n: float, M, rtol: float) -> Optional[float]:
    """NC1 of one state from the centered class means D (K x p, classes
    present), their counts, n and M. With K <= p from the K x K Grams
    (``nc1_from_grams``; an SVD of D cost 3-9x more), else from the p x p
    between-class scatter."""
    xp = ns(D)
    K, p = D.shape
    if K <= p:
        value, defined = nc1_from_grams(D @ D.T, (D @ M) @ D.T, counts, n, rtol)
        return float(value) if bool(defined) else None
    s, V = eigh_desc(D.T @ D)
    keep = s > rtol * s[0]
    if not bool(keep.any()):
        return None
    Vt = V[:, keep].T
    dv = D @ Vt.T
    vwv = (xp.einsum("ij,ij->i", Vt @ M, Vt) - (counts[:, None] * dv * dv).sum(axis=0)) / n
    return max(float(xp.sum(vwv / (s[keep] / K))) / K, 0.0)


def nc1(st: dict, rtol: float) -> Optional[float]:
    """NC1 = tr(Sigma_W Sigma_B^+) / K (Papyan et al. 2020; docs/MATH.md, NC1)."""
    if st["k"] <= 0:
        return None
    counts = f64(st["class_counts"])
    present = counts > 0
    if int(present.sum()) < 2:
        return None
    D = st["class_sums"][present] / counts[present, None] - st["mean"][None, :]
    return nc1_from_class_means(D, counts[present], float(st["n"]), st["M"], rtol)
