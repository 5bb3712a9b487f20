"""Canonical-correlation similarities (mean squared and mean canonical
correlation, SVCCA, PWCCA) from the joint co-moments of k representations
side by side (docs/MATH.md, "The similarity family").

The state is a ``Similarity``'s co-moment sum ``M`` over the columns
``[x_1 .. x_k, a_1 .. a_k]`` (each representation's block of width p_r, then one
norm column per representation, not read here; ``M`` may also hold the
representations' columns alone). With ``C_rs`` its blocks (``Xc_r^T Xc_s``,
centred, summed over the n samples) and, per representation, the eigenpairs
``(lambda_i, v_i)`` of ``C_rr`` kept by the rank cut ``lambda_i > rtol *
lambda_1``, the whitening ``W_r = V diag(lambda^-1/2)`` (rank_r columns) gives the
canonical correlations of r and s as the singular values ``rho_1 >= rho_2 >=
..`` of ``T = W_r^T C_rs W_s``, min(rank_r, rank_s) of them; they are the
singular values of ``Qr^T Qs`` for orthonormal bases of the centred column
spaces.

- ``cca_r2``: mean rho_i^2 (Yanai's mean squared canonical correlation, R^2_CCA
  of Kornblith et al. 2019, Table 1); ``cca_rho``: mean rho_i.
- ``svcca`` (Raghu et al. 2017): each representation reduced to its m_r leading
  principal directions, the fewest whose eigenvalues sum to at least ``keep``
  times ``tr C_rr`` (at most rank_r), then the mean rho over min(m_r, m_s).
- ``pwcca`` (Morcos et al. 2018): ``sum_i a_i rho_i / sum_i a_i``, ``a_i =
  sum_j |<h_i, x_j>|`` with h_i the unit-norm canonical variates (sample space)
  of the representation with fewer neurons (the lower-indexed one of a pair on
  a tie, so the matrix is symmetric) and x_j its centred neurons:
  ``<h_i, x_j> = (C_rr w_i)_j / sqrt(w_i^T C_rr w_i)``.

Every value is unchanged by scaling one representation; each block is taken
at a power-of-two scale (exact) that brings its trace near 1, so ``M`` may be
passed as the state holds it or after ``cka.scale_blocks``, with the same
result. Plain numpy float64, without the compiled core.
"""

from __future__ import annotations

import math
import numbers
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from .cka import _blocks
from .policy import check_rtol

__all__ = ["cca_matrices", "CCA_MEASURES", "NULL_NOTE"]

CCA_MEASURES = ("cca_r2", "cca_rho", "svcca", "pwcca")

# A pair gets a note when representations independent of each other would give
# cca_r2 = max(rank_r, rank_s) / (n - 1) at or above this (docs/MATH.md,
# "The similarity family", degenerate cases).
NULL_NOTE = 0.1


def check_which(which: Union[str, Iterable[str]], allowed: Sequence[str], where: str) -> List[str]:
    """``which`` (one name or an iterable of names) as a list in ``allowed``'s
    order; ValueError naming what is not in ``allowed``."""
    names = [which] if isinstance(which, str) else list(which)
    bad = [w for w in names if not isinstance(w, str) or w not in allowed]
    if bad:
        raise ValueError(f"{where}: unknown measures {bad!r}; choose from {list(allowed)}")
    return [w for w in allowed if w in names]


def check_fraction(value: object, name: str) -> float:
    """``value`` as a float in (0, 1]; ValueError otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not 0.0 < float(value) <= 1.0:
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    return float(value)


class JointBlocks:
    """The blocks of a joint co-moment sum, each representation at a power of
    two that brings ``tr C_rr`` into [1/2, 2): ``block(r, s)`` is ``C_rs`` in
    those units; ``trace[r]`` the trace there (0 for a constant
    representation), ``constant[r]`` whether ``tr C_rr`` is 0."""

    def __init__(self, M: np.ndarray, n: int, names: Sequence[str], widths: Sequence[int], where: str) -> None:
        names = list(names)
        widths = [int(w) for w in widths]
        if len(names) != len(widths) or not widths:
            raise ValueError(f"{where}: {len(names)} names for {len(widths)} widths; give one name per "
                             "representation, at least one")
        if any(w <= 0 for w in widths):
            raise ValueError(f"{where}: widths must be positive, got {widths}")
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"{where}: n must be a non-negative integer, got {n!r}")
        M = np.asarray(M, dtype=np.float64)
        sl, P = _blocks(widths)
        k = len(widths)
        if M.ndim != 2 or M.shape[0] != M.shape[1] or M.shape[0] not in (P, P + k):
            raise ValueError(f"{where}: M must be square of side {P} (the representations' columns) or {P + k} "
                             f"(with one norm column each), got shape {M.shape}")
        if not np.isfinite(M[:P, :P]).all():
            raise ValueError(f"{where}: the co-moments are not finite")
        self.M: np.ndarray = M
        self.sl: List[slice] = sl
        self.n: int = int(n)
        self.names: List[str] = names
        self.widths: List[int] = widths
        self.k: int = k
        raw = np.array([float(np.trace(M[s, s])) for s in sl])
        self.constant: np.ndarray = ~(raw > 0)
        # tr = f 2^e with f in [1/2, 1): scaling the block by 2^-2floor(e/2) brings the trace into [1/2, 2)
        self.factor: np.ndarray = np.array([math.ldexp(1.0, -(math.frexp(t)[1] // 2)) if t > 0 else 1.0
                                            for t in raw])
        self.trace: np.ndarray = np.array([0.0 if c else float(np.trace(self.block(r, r)))
                                           for r, c in enumerate(self.constant)])

    def block(self, r: int, s: int) -> np.ndarray:
        """``C_rs`` at the blocks' power-of-two scales."""
        return self.M[self.sl[r], self.sl[s]] * (self.factor[r] * self.factor[s])

    def eig(self, r: int) -> Tuple[np.ndarray, np.ndarray]:
        """Eigenvalues of ``C_rr`` (descending, clipped at 0) and their eigenvectors (columns)."""
        C = self.block(r, r)
        lam, V = np.linalg.eigh((C + C.T) / 2)
        return np.maximum(lam[::-1], 0.0), V[:, ::-1]

    def defined(self, what: str) -> Tuple[List[int], List[str]]:
        """The representations a measure ``what`` is defined for (the others'
        rows and columns stay NaN), and the notes for too few samples or
        constant representations."""
        k = self.k
        if self.n < 2:
            return [], [f"{what}: undefined with fewer than 2 samples (n = {self.n}): NaN"]
        bad = self.constant
        live = [r for r in range(k) if not bad[r]]
        if bad.any():
            const = [self.names[r] for r in range(k) if bad[r]]
            return live, [f"{what}: undefined for constant representations {const}: NaN in their rows and columns"]
        return live, []

    def nan_matrices(self, which: Sequence[str]) -> Dict[str, np.ndarray]:
        """A k x k matrix of NaN for each measure of ``which``, to be filled where defined."""
        return {w: np.full((self.k, self.k), np.nan) for w in which}


def kept_count(lam: np.ndarray, rtol: float) -> int:
    """How many eigenvalues (descending) pass the rank cut ``lambda > rtol * lambda_1``."""
    return int(np.count_nonzero(lam > rtol * lam[0])) if lam.size and lam[0] > 0 else 0


def leading_count(lam: np.ndarray, keep: float, rank: int) -> int:
    """The fewest leading eigenvalues whose sum reaches ``keep`` of the total
    (at most ``rank``, the directions the rank cut keeps)."""
    cum = np.cumsum(lam)
    m = int(np.searchsorted(cum, keep * cum[-1], side="left")) + 1
    return max(1, min(m, rank))


def _pair_list(pairs: List[Tuple[str, str, str]]) -> str:
    return "; ".join(f"{a} / {b} ({why})" for a, b, why in pairs)


def degenerate_notes(what: str, pairs_forced: List[Tuple[str, str, str]],
                     pairs_biased: List[Tuple[str, str, str]], n: int) -> List[str]:
    """The notes of the pairs whose CCA-type value is near 1 by construction or biased toward 1
    (dimensions d_r, d_s: the ranks, or SVCCA's kept directions)."""
    notes = []
    if pairs_forced:
        notes.append(f"{what}: near 1 by construction for {_pair_list(pairs_forced)}: the centred samples span "
                     f"n - 1 = {n - 1} dimensions, so at least d_r + d_s - (n - 1) canonical correlations of "
                     "representations of dimensions d_r, d_s are 1 whatever the data; more samples are needed")
    if pairs_biased:
        notes.append(f"{what}: biased toward 1 for {_pair_list(pairs_biased)}: representations independent of "
                     f"each other give a mean squared canonical correlation of about max(d_r, d_s) / (n - 1) "
                     f"(n = {n}); compare values against that level or add samples")
    return notes


def _classify(a: str, b: str, dx: int, dy: int, n: int, forced: list, biased: list) -> None:
    if dx + dy > n - 1:
        forced.append((a, b, f"dimensions {dx} + {dy}: {dx + dy - (n - 1)} of {min(dx, dy)} correlations are 1"))
    elif max(dx, dy) / (n - 1) >= NULL_NOTE:
        biased.append((a, b, f"dimensions {dx}, {dy}: independent level {max(dx, dy) / (n - 1):.3f}"))


def cca_matrices(M: np.ndarray, n: int, names: Sequence[str], widths: Sequence[int], *,
                 which: Union[str, Iterable[str]], rtol: float,
                 keep: float = 0.99) -> Tuple[Dict[str, np.ndarray], List[str]]:
    """``(matrices, notes)``: for each name in ``which`` (a subset of
    ``CCA_MEASURES``: ``"cca_r2"``, ``"cca_rho"``, ``"svcca"``, ``"pwcca"``) its
    k x k float64 matrix over the representations of a joint co-moment sum
    ``M`` of ``n`` samples, and what the caller should warn about, one line each.

    M: the centred co-moment sum over ``[x_1 .. x_k]`` or ``[x_1 .. x_k, a_1 ..
        a_k]`` (the norm columns are not read), at any per-representation scale.
    names, widths: the representations and their column counts, in ``M``'s order.
    rtol: the rank cut on each ``C_rr``'s eigenvalues (``policy.rtol_for``), in (0, 1).
    keep: SVCCA's fraction of each representation's variance, in (0, 1].

    Every matrix is symmetric with 1 on the diagonal. NaN in the rows and
    columns of a constant representation and everywhere below 2 samples (with
    a note). A pair whose dimensions (ranks; SVCCA: the kept directions) sum past
    n - 1 has correlations equal to 1 by construction; one where independent
    representations would give ``cca_r2 >= NULL_NOTE`` is biased toward 1: both
    values are returned, with a note naming the pairs.

    Raises ValueError for unknown measures, a ``keep`` or ``rtol`` out of range,
    or an ``M`` whose shape does not match ``widths`` or that is not finite.
    """
    asked = check_which(which, CCA_MEASURES, "cca_matrices")
    rtol_c: Optional[float] = check_rtol(rtol)
    if rtol_c is None:
        raise ValueError("cca_matrices: rtol must be a number in (0, 1), got None (policy.rtol_for gives the default)")
    keep = check_fraction(keep, "keep")
    J = JointBlocks(M, n, names, widths, "cca_matrices")
    out = J.nan_matrices(asked)
    if not asked:
        return out, []
    live, notes = J.defined(", ".join(asked))
    eig = {r: J.eig(r) for r in live}
    rank = {r: kept_count(eig[r][0], rtol_c) for r in live}
    # W_r = V diag(lambda^-1/2) over the kept eigenpairs (columns in descending order)
    W = {r: eig[r][1][:, :rank[r]] / np.sqrt(eig[r][0][:rank[r]]) for r in live}
    lead = {r: leading_count(eig[r][0], keep, rank[r]) for r in live} if "svcca" in asked else {}
    full = [w for w in asked if w != "svcca"]
    forced: list = []
    biased: list = []
    sv_forced: list = []
    sv_biased: list = []
    for r in live:
        for w in asked:
            out[w][r, r] = 1.0
    for i, r in enumerate(live):
        for s in live[i + 1:]:
            T = W[r].T @ J.block(r, s) @ W[s]
            a, b = J.names[r], J.names[s]
            if full:
                _classify(a, b, rank[r], rank[s], J.n, forced, biased)
                if "pwcca" in asked:
                    U, rho, Vt = np.linalg.svd(T, full_matrices=False)
                else:
                    rho = np.linalg.svd(T, compute_uv=False)
                rho = np.clip(rho, 0.0, 1.0)
                if "cca_r2" in asked:
                    out["cca_r2"][r, s] = out["cca_r2"][s, r] = float(np.mean(rho * rho))
                if "cca_rho" in asked:
                    out["cca_rho"][r, s] = out["cca_rho"][s, r] = float(np.mean(rho))
                if "pwcca" in asked:
                    # the representation with fewer neurons; the lower-indexed one on a tie
                    side, dirs = (r, U) if J.widths[r] <= J.widths[s] else (s, Vt.T)
                    lam, V = eig[side]
                    # <h_i, x_j> = (C w_i)_j / sqrt(w_i' C w_i) = (V diag(lambda^1/2) u_i)_j for w_i = W u_i
                    proj = (V[:, :rank[side]] * np.sqrt(lam[:rank[side]])) @ dirs
                    weight = np.abs(proj).sum(axis=0)
                    out["pwcca"][r, s] = out["pwcca"][s, r] = float(weight @ rho / weight.sum())
            if "svcca" in asked:
                mr, ms = lead[r], lead[s]
                _classify(a, b, mr, ms, J.n, sv_forced, sv_biased)
                rho_sv = np.clip(np.linalg.svd(T[:mr, :ms], compute_uv=False), 0.0, 1.0)
                out["svcca"][r, s] = out["svcca"][s, r] = float(np.mean(rho_sv))
    notes += degenerate_notes(", ".join(full), forced, biased, J.n) if full else []
    notes += degenerate_notes(f"svcca (keep = {keep:g})", sv_forced, sv_biased, J.n) if "svcca" in asked else []
    return out, notes
