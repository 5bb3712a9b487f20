"""LiDAR, the effective rank of the linear discriminant matrix of objects and
their augmentations (Thilak et al., ICLR 2024; docs/MATH.md, LiDAR), from the
state's moments and class sums.

The labels name objects: the samples that share a label are augmentations of
one input (an object, the paper's "surrogate class"). With N objects present
(count n_o > 0), object means mu_o = (class sum) / n_o and their mean
mu_bar = sum_o mu_o / N (the mean over objects, not over samples):

    Sigma_b = 1/(N - 1) sum_o (mu_o - mu_bar)(mu_o - mu_bar)^T
    Sigma_w = W / (n - N) + delta I,  W = M - sum_o n_o (mu_o - mu)(mu_o - mu)^T
    Sigma_lidar = Sigma_w^-1/2 Sigma_b Sigma_w^-1/2,  eigenvalues lambda_1..lambda_p
    LiDAR = exp(-sum_k q_k log q_k),  q_k = lambda_k / sum_j lambda_j + eps

with mu the sample mean. W is the within-object scatter sum_o sum_i (z_oi -
mu_o)(z_oi - mu_o)^T, M less the between-object scatter, so no second pass
over the rows is needed. With K augmentations of every object, n - N =
N (K - 1) and Sigma_w is the paper's mean over objects of the unbiased
within-object covariance; with unequal counts it is the pooled within-object
covariance (each object weighted by its n_o - 1 degrees of freedom). An
object with one sample has a mean (it counts in Sigma_b) but no spread: it
adds nothing to W nor to n - N.

The eigenvalues are those of every one of the p directions (no rank cut):
Sigma_b has rank at most N - 1, and the p - min(N, p) eigenvalues that the
Gram below does not carry are exact zeros, each adding ``eps`` to the
entropy's terms as in RankMe. They come from the min(N, p)-sized Gram of the
whitened object means (Y = D U diag(w)^-1/2, D the rows mu_o - mu_bar, U w
U^T = Sigma_w): Y Y^T and Y^T Y have the nonzero eigenvalues of
Sigma_lidar (N - 1 times them), so one p x p eigendecomposition (Sigma_w's)
and one of the smaller Gram finish it. Numpy arrays or torch tensors
(``_xp.ns``).
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import numpy as np

from ._xp import f64, ns
from .nc1 import class_means, nc1_reliable
from .spectrum import RANKME_EPS, entropy_rank

__all__ = ["LIDAR_DELTA", "LIDAR_EPS", "lidar", "lidar_with_reason"]

# The ridge delta I added to Sigma_w: absolute, in the features' squared units, as in the paper.
LIDAR_DELTA = 1e-4
# RankMe's epsilon (Garrido et al. 2023, eq. 1), added to each q_k inside and outside the log.
LIDAR_EPS = RANKME_EPS

NO_LABELS = "LiDAR not reported: it needs object ids as labels (update(..., labels=ids), one id per input " \
            "shared by its augmentations)"


def check_delta(delta) -> float:
    """``delta`` as a float; ValueError unless a finite real number >= 0."""
    if isinstance(delta, (bool, np.bool_)) or not isinstance(delta, numbers.Real) or not (
            math.isfinite(float(delta)) and float(delta) >= 0.0):
        raise ValueError(f"lidar_delta must be a finite number >= 0, got {delta!r}")
    return float(delta)


def lidar_with_reason(st: dict, delta: float = LIDAR_DELTA, eps: float = LIDAR_EPS) -> Tuple[Optional[float],
                                                                                         Optional[str]]:
    """(LiDAR or None, why it is None or None) of a state dict whose labels
    are object ids (module docstring; docs/MATH.md, LiDAR). ``delta``: the
    ridge added to Sigma_w (>= 0); ``eps``: added to each normalised
    eigenvalue. None, with the reason, without labels, with fewer than two
    objects, when no object has two samples (no within-object spread), when
    the object means coincide (Sigma_b = 0), when Sigma_w is singular and
    ``delta`` is 0, and at product precisions that cannot resolve the
    within-object spread (tf32, bf16: it is M less the between-object
    scatter, as NC1's within-class spread)."""
    delta = check_delta(delta)
    if int(st["k"]) < 0:
        return None, NO_LABELS
    d, _, c = class_means(st)  # the objects present: their means less the sample mean, their counts
    N = int(d.shape[0])
    n, p = int(st["n"]), int(st["p"])
    if N < 2:
        return None, (f"LiDAR undefined: {N} object(s) with samples (the between-object covariance needs two or "
                      "more)")
    if n - N < 1:
        return None, ("LiDAR undefined: no object has two or more samples (the within-object covariance needs "
                      "augmentations of one input under one id)")
    if not nc1_reliable(st["precision"]):
        return None, (f"LiDAR not reported: {st['precision']} products cannot resolve the within-object spread; "
                      "precision='fp32' or 'fp64' measures it")
    xp = ns(st["M"])
    W = st["M"] - (d.T * c[None, :]) @ d
    Sw = (W + W.T) / (2.0 * (n - N))
    w, U = xp.linalg.eigh(Sw)
    w = xp.clip(w, 0.0, None) + delta  # W is semi-definite: what is below 0 is rounding
    if not bool((w > 0.0).all()):
        return None, ("LiDAR undefined: the within-object covariance is singular and lidar_delta is 0 "
                      "(measure_options={'lidar_delta': ...} > 0 regularises it)")
    D = d - d.mean(axis=0)[None, :]  # the object means less their mean
    Y = (D @ U) / xp.sqrt(w)[None, :]
    G = Y @ Y.T if N <= p else Y.T @ Y
    lam = xp.clip(f64(xp.linalg.eigvalsh((G + G.T) / 2.0)), 0.0, None) / (N - 1)
    if not float(lam.sum()) > 0.0:
        return None, "LiDAR undefined: the object means coincide (no between-object spread)"
    # the p - min(N, p) eigenvalues the Gram does not carry are exact zeros: each q_k = eps, a factor
    # exp(-eps log eps) of the effective rank
    zeros = p - int(lam.shape[0])
    return float(entropy_rank(lam, eps)) * eps ** (-zeros * eps), None


def lidar(st: dict, delta: float = LIDAR_DELTA, eps: float = LIDAR_EPS) -> Optional[float]:
    """LiDAR = exp(-sum_k q_k log q_k), q_k = lambda_k / sum lambda + eps, of
    the eigenvalues of Sigma_w^-1/2 Sigma_b Sigma_w^-1/2 (Thilak et al., ICLR
    2024) from a state dict labelled by object ids; None where undefined
    (``lidar_with_reason`` says why)."""
    return lidar_with_reason(st, delta, eps)[0]
