"""The feature spectrum, its eigenfunctions' projections, and the training and held-out curves."""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple, Optional

from ._xp import eigh_desc, f64, ns
from .dlr import Functions, function_moments

__all__ = ["LabelFunctions", "Spectrum", "curve", "spectrum"]

# RankMe's epsilon, added to each p_k inside and outside the log (Garrido et al. 2023, eq. 1); LiDAR
# takes RankMe's formula with it.
RANKME_EPS = 1e-7


def entropy_rank(w, eps: float = 0.0):
    """exp(-sum_k q_k log q_k), q_k = w_k / sum w + ``eps`` over the last axis
    (w >= 0; terms with q_k = 0 contribute 0): the effective rank, and with
    ``eps = RANKME_EPS`` RankMe's formula. NaN where sum w = 0."""
    xp = ns(w)
    total = w.sum(axis=-1)
    q = w / xp.where(total > 0.0, total, 1.0)[..., None] + eps
    value = xp.exp(-(q * xp.log(xp.where(q > 0.0, q, 1.0))).sum(axis=-1))
    return xp.where(total > 0.0, value, math.nan)


class Spectrum(NamedTuple):
    """Eigenpairs of the feature operator (docs/MATH.md, spectrum and eigenfunctions)."""

    rho: Any  # eigenvalues of Sigma = M / n, descending, all p
    rank: int  # eigenvalues above rtol * rho_1: the eigenfunctions the curves use
    V: Any  # their eigenvectors (p x rank)
    lam: Any  # their eigenvalues of M (rank)
    effective_dim: float  # exp(-sum q_k log q_k), q_k = rho_k / sum rho


def spectrum(st: dict, rtol: float, centered: bool = True) -> Spectrum:
    """Spectrum of Sigma = M / n, or of the uncentered operator (the paper's v1)."""
    n, M = int(st["n"]), st["M"]
    xp = ns(M)
    S = M if centered else M + n * xp.outer(st["mean"], st["mean"])
    lam, V = eigh_desc(S)
    if not bool(xp.isfinite(lam).all()):
        raise FloatingPointError("the feature spectrum is not finite")
    if not lam[0] > 0.0:
        raise ValueError("features are constant (zero covariance): the spectrum is undefined")
    rho = lam / n
    r_phi = int(xp.count_nonzero(lam > rtol * lam[0]))
    q = rho[rho > 0] / rho.sum()
    return Spectrum(rho, r_phi, V[:, :r_phi], lam[:r_phi], float(xp.exp(-xp.sum(q * xp.log(q)))))


class LabelFunctions(Functions):
    """One-hot labels of the classes present: B_y[:, k] = s_k - n_k mu for
    each class k with n_k > 0 (an absent class's column is 0 and adds
    nothing), A_y = diag(n_k) - n pi pi^T never formed (docs/MATH.md, one-hot
    labels): the curves need only B_y and tr A_y = sum n_k - sum n_k^2 / n, so
    their cost is K' x p for the K' <= min(K, n) classes present, whatever the
    largest label. Scaled like ``Functions`` (by A_y's largest diagonal)."""

    def __init__(self, st: dict) -> None:
        xp = ns(st["mean"])
        counts = f64(st["class_counts"])
        present = counts > 0
        c, n = counts[present], float(st["n"])
        diag = c - c * c / n
        top = float(diag.max()) if diag.shape[0] else 0.0
        scale = top if top > 0.0 else 1.0
        self.B = (st["class_sums"][present].T - xp.outer(st["mean"], c)) / math.sqrt(scale)
        self._trace, self.a_scale = float(diag.sum()) / scale, scale

    def trace(self) -> float:
        return self._trace

    def span(self, M, floor: float) -> tuple:
        raise NotImplementedError("labels are a task, not learned functions: their span is not needed")


def task_moments(st: dict) -> Optional[Functions]:
    """The task: float targets when streamed, else one-hot labels."""
    if st["t"] > 0:
        return Functions(st["Bt"], st["At"])
    if st["k"] > 0:
        return LabelFunctions(st)
    return None


def cumulative(proj_sq, denom: float, p: int):
    """Pi_g(k) = sum_{i<=k} Q_g(i), k = 1..p, from ||<e_i, g>||^2 (docs/MATH.md,
    projections and curves); constant past the rank. None when g is constant."""
    if not denom > 0.0:
        return None
    xp = ns(proj_sq)
    q = proj_sq / denom
    out = xp.empty(p)
    r = q.shape[0]
    out[:r] = xp.cumsum(q)
    out[r:] = out[r - 1] if r else 0.0
    return out


def curve(spec: Spectrum, g: Optional[Functions], p: int):
    """Cumulative quality (g = task) or utilization (g = learned functions) on the training state."""
    return None if g is None else cumulative(g.proj_sq(spec.V, spec.lam), g.trace(), p)


def held_out_mismatch(train: Mapping[str, Any], test: Mapping[str, Any], head: bool) -> Optional[tuple]:
    """The first width a held-out state must share with its training state and
    does not, as ``(stream, held-out width, training width)``, else None. Both
    are mappings of the widths ``p`` (features), ``t`` (targets) and ``c``
    (outputs), -1 where a stream is absent: the same functions of the same
    features, so features always match, and targets and outputs wherever the
    held-out state streamed them (its outputs are unused with a head). The one
    home of this rule: ``Moments.compute(test=)`` and ``richness eval
    --test-features`` (before reading any data) ask it."""
    checked = (("p", "features"), ("t", "targets")) + ((("c", "outputs"),) if not head else ())
    for key, what in checked:
        if int(test[key]) != int(train[key]) and (key == "p" or int(test[key]) >= 0):
            return what, int(test[key]), int(train[key])
    return None


def held_out(spec: Spectrum, st: dict, test: dict, W, centered: bool) -> tuple:
    """(quality, utilization, eigenfunction norms) on a held-out state, by the
    Nystrom extension of the training eigenfunctions (docs/MATH.md, held-out
    curves): monotone but not bounded by 1."""
    p = int(st["p"])
    nt = int(test["n"])
    if nt < 2:  # first: an empty test state has no width (p = -1) to compare
        raise ValueError(f"the test state needs at least 2 samples, got n = {nt}")
    bad = held_out_mismatch(st, test, head=W is not None)
    if bad is not None:
        what, have, want = bad
        raise ValueError(f"test state has {have} {what}, the training state {'no ' + what if want < 0 else want}")
    xp = ns(st["M"])
    rho_k = spec.rho[:spec.rank]

    def test_curve(g):
        # <e_k, g_j>_test = v_k^T B_test[:, j] / (n_test sqrt(rho_k)), rho_k from training.
        return None if g is None else cumulative(g.proj_sq(spec.V, rho_k * nt), g.trace(), p)

    shift = test["mean"] - (st["mean"] if centered else 0.0)
    second = test["M"] / nt + xp.outer(shift, shift)
    norms = xp.zeros(p)
    norms[:spec.rank] = xp.einsum("ij,ij->j", second @ spec.V, spec.V) / rho_k
    return test_curve(task_moments(test)), test_curve(function_moments(test, W)), norms
