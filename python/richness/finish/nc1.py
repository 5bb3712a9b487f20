"""NC1 (within-class over between-class spread) from class means and the feature moments."""

from __future__ import annotations

from typing import Optional

import numpy as np

from .._state import precision_mode
from ._xp import eigh_desc, f64, kept, ns

__all__ = ["nc1"]


def nc1_reliable(precision: str) -> bool:
    """Whether products of ``precision`` resolve NC1, from the core's precision
    table: NC1 subtracts nearly equal p x p matrices near collapse; tf32 and
    bf16 products were measured useless there, errors of 100% and more
    (docs/MATH.md, NC1)."""
    return precision_mode(precision).resolves_nc1


def _nc1_of_grams(DDt, DMD, counts, n, rtol: float, DdD=None) -> tuple:
    """(nc1, defined, rounding) of ``nc1_from_grams``; with ``DdD`` =
    D diag(M) D^T, ``rounding`` is NC1's rounding scale (``nc1_with_scale``),
    else None."""
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
    rounding = None
    if DdD is not None:  # v^T diag(M) v = u^T D diag(M) D^T u / s
        vdv = xp.einsum("...ij,...ij->...j", DdD @ U, U) / safe
        rounding = xp.where(keep, (vdv / n) / (safe / kk[..., None]), 0.0).sum(axis=-1) / kk
    return xp.clip(value, 0.0, None), (K >= 2) & keep[..., 0], rounding


def nc1_from_grams(DDt, DMD, counts, n, rtol: float) -> tuple:
    """NC1 = tr(Sigma_W Sigma_B^+) / K from K x K Grams of the centered class
    means D (rows d_k; rows of absent classes are 0): DDt = D D^T and
    DMD = D M D^T, with the class counts and n (docs/MATH.md, NC1). Sigma_B =
    D^T D / K has its eigenpairs from DDt: v_i = D^T u_i / sqrt(s_i), so
    v^T M v = u^T DMD u / s and (d_k . v_i)^2 = s_i u_ki^2. Leading axes
    batch stacked states. Returns (nc1 clipped at 0, defined): undefined with
    fewer than two classes present or Sigma_B = 0."""
    return _nc1_of_grams(DDt, DMD, counts, n, rtol)[:2]


def class_means(st: dict) -> tuple:
    """(D, index of the classes present, counts): the globally centered class
    means of the classes with samples (C x p), as NC1 takes them."""
    counts = f64(st["class_counts"])
    present = counts > 0
    D = st["class_sums"][present] / counts[present, None] - st["mean"][None, :]
    return D, present, counts[present]


def nc1_from_class_means(D, counts, n: float, M, rtol: float) -> tuple:
    """(NC1 or None, its rounding scale, see ``nc1_with_scale``) of one state
    from the centered class means D (K x p, classes present), their counts, n
    and M. With K <= p from the K x K Grams (an SVD of D cost 3-9x more), else
    from the p x p between-class scatter."""
    xp = ns(D)
    K, p = D.shape
    diag = xp.diagonal(M)
    if K <= p:
        value, defined, rounding = _nc1_of_grams(D @ D.T, (D @ M) @ D.T, counts, n, rtol,
                                                 DdD=(D * diag[None, :]) @ D.T)
        return (float(value) if bool(defined) else None), float(rounding)
    s, V = eigh_desc(D.T @ D)
    keep = s > rtol * s[0]
    if not bool(keep.any()):
        return None, 0.0
    Vt = V[:, keep].T
    dv = D @ Vt.T
    vmv = xp.einsum("ij,ij->i", Vt @ M, Vt)
    vwv = (vmv - (counts[:, None] * dv * dv).sum(axis=0)) / n
    rounding = float(xp.sum((((Vt * Vt) @ diag) / n) / (s[keep] / K))) / K
    return max(float(xp.sum(vwv / (s[keep] / K))) / K, 0.0), rounding


# The relative rounding of one product's entries, by product precision.
PRODUCT_EPS = {"fp64": float(np.finfo(np.float64).eps), "fp32": float(np.finfo(np.float32).eps)}

# NC1's rounding error in units of eps times its rounding scale (``nc1_with_scale``).
# Only M comes from the products (the class means are float64 sums), and
# Sigma_W is M less the between-class scatter, so near collapse NC1 keeps
# M's rounding whole. An entry of M carries an error of about eps
# sqrt(M_jj M_ll) of random sign, so along a direction v of Sigma_B the error
# of v^T M v is about eps v^T diag(M) v: not eps v^T M v, which is p / K times
# larger for class means spread over the features, because the errors of
# the p^2 entries average out along such a v. Float32 inputs, fp32 products
# on the CPU against fp64 products of the same inputs, 429 random states (2
# to 71 classes, p = 4 to 64, 500 to 16000 samples in batches of 256 rows to
# all of them, class means along the axes or spread out): |error| / (eps
# scale) had median 0.23, 99th percentile 2.4 and maximum 3.0 where NC1 was
# resolved to 50%, so 4 bounds it. Inputs whose float32 values repeat within
# a class (a mean 1e3 or more times the within-class spread, features cast
# from bfloat16) round coherently: up to 6.1 in 213 such states, so a value
# given without a warning may be off by up to about 15% there rather than
# 10% (docs/MATH.md, NC1).
NC1_ROUNDING = 4.0

# NC1 is reported without a caveat while its rounding bound is at most this
# fraction of it.
NC1_RESOLVED = 0.1


def nc1_error(precision: str, rounding: float) -> float:
    """A bound on the rounding error of NC1 from products of ``precision``, for
    a state whose rounding scale is ``rounding`` (``nc1_with_scale``)."""
    return NC1_ROUNDING * PRODUCT_EPS.get(precision, 1.0) * rounding


def nc1_with_scale(st: dict, rtol: float) -> tuple:
    """(NC1 = tr(Sigma_W Sigma_B^+) / K or None, its rounding scale) (Papyan et
    al. 2020; docs/MATH.md, NC1); the classes present only. The rounding
    scale is sum_i (v_i^T diag(M) v_i / n) / lambda_i / K over the kept
    eigenpairs (lambda_i, v_i) of Sigma_B: NC1 with the within-class spread
    along v_i replaced by the total spread of the features that v_i weighs
    (``NC1_ROUNDING``)."""
    if st["k"] <= 0:
        return None, 0.0
    D, _, counts = class_means(st)
    if D.shape[0] < 2:
        return None, 0.0
    return nc1_from_class_means(D, counts, float(st["n"]), st["M"], rtol)


def nc1(st: dict, rtol: float) -> Optional[float]:
    """NC1 = tr(Sigma_W Sigma_B^+) / K (Papyan et al. 2020; docs/MATH.md, NC1)."""
    return nc1_with_scale(st, rtol)[0]
