"""Linear CKA, biased and debiased, from the joint co-moments of k
representations side by side (docs/MATH.md, "Linear CKA, exact and streamed").

The state is a ``Similarity``'s: the float64 ``mean`` and co-moment sum ``M``
over the columns ``[g_1 x_1 .. g_k x_k, a_1 .. a_k]``, each representation
``x_r`` (width p_r) at its power-of-two scale ``g_r`` followed by one column per
representation, ``a_r = ||g_r (x_r - c_r)||^2`` at the fixed shift ``c_r``. Every
block ``C_rs`` of ``M`` is a cross-covariance; the biased CKA needs only their
Frobenius norms, the debiased one (the unbiased HSIC estimator) also
``S = sum_i k_i l_i``, read off the norm columns' means and co-moments. Plain
numpy on the state's arrays, without the compiled core.
"""

from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import numpy as np

__all__ = ["cka_matrices"]

# Blocks whose mean squared norm lies within 2^-64 .. 2^64 are used as given;
# outside, a power-of-two scale brings it near 1 (exact: only the exponents change).
FINISH_LOG2 = 64


def column_factors(widths: Sequence[int], factor: np.ndarray) -> np.ndarray:
    """Per joint column, the factor of a representation's columns (``factor``)
    and of its norm column (``factor^2``)."""
    return np.concatenate([np.repeat(factor, widths), factor * factor])


def scaled_shift(shift: np.ndarray, widths: Sequence[int], scale: np.ndarray) -> np.ndarray:
    """The shift in the joint state's units (each block times its scale)."""
    if (scale == 1.0).all():
        return shift
    return shift * np.repeat(scale, widths)


def _blocks(widths: Sequence[int]) -> Tuple[List[slice], int]:
    """The joint columns of each representation, and where the norm columns begin."""
    offs = np.cumsum([0] + list(widths))
    return [slice(offs[r], offs[r + 1]) for r in range(len(widths))], int(offs[-1])


def scale_blocks(mean: np.ndarray, M: np.ndarray, c: np.ndarray, n: int,
                 widths: Sequence[int]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``mean``, ``M`` and the shift ``c`` (in the state's units) with each
    block whose mean squared norm ``tr C_rr / n`` lies outside 2^-64 .. 2^64
    multiplied by a power of two (its norm column by the square), so that no
    term of degree 4 below over- or underflows; every CKA is a ratio of such
    terms and unchanged by it. The arrays as given when no block needs it."""
    sl, P = _blocks(widths)
    k = len(widths)
    tr = np.array([np.trace(M[s, s]) for s in sl])
    kbar = tr / n
    e = np.zeros(k)
    for r in range(k):
        if kbar[r] > 0 and math.isfinite(kbar[r]) and not -FINISH_LOG2 <= math.log2(kbar[r]) <= FINISH_LOG2:
            e[r] = math.floor(math.log2(kbar[r]) / 2)
    if e.any():
        D = column_factors(widths, np.ldexp(1.0, -e.astype(int)))
        mean, M, c = mean * D, M * np.outer(D, D), c * D[:P]
    return mean, M, c


def hsic_terms(mean: np.ndarray, M: np.ndarray, c: np.ndarray, n: int,
               widths: Sequence[int]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tr, F, S)``: ``tr[r] = tr C_rr`` (``= -1'K~1``), ``F[r, s] =
    ||C_rs||_F^2`` and ``S[r, s] = sum_i k_i l_i`` (the squared norms about the
    means, from the norm columns at shift ``c``), each k x k."""
    sl, P = _blocks(widths)
    k = len(widths)
    tr = np.array([np.trace(M[s, s]) for s in sl])
    d = [mean[s] - c[s] for s in sl]
    kbar = tr / n
    F = np.empty((k, k))
    S = np.empty((k, k))
    for r in range(k):
        for s in range(r, k):
            C = M[sl[r], sl[s]]
            F[r, s] = F[s, r] = float(np.sum(C * C))
            S[r, s] = S[s, r] = (n * kbar[r] * kbar[s] + M[P + r, P + s] - 2 * d[s] @ M[sl[s], P + r]
                                 - 2 * d[r] @ M[sl[r], P + s] + 4 * d[r] @ C @ d[s])
    return tr, F, S


def cka_matrices(mean: np.ndarray, M: np.ndarray, n: int, names: Sequence[str], widths: Sequence[int],
                 shift: np.ndarray, scale: np.ndarray) -> Tuple[np.ndarray, np.ndarray, List[str]]:
    """``(biased, debiased, notes)`` of a joint state of ``n`` samples: the
    k x k matrices of both estimators and what is undefined in them, one line
    each (the caller warns). Biased: ``||C_rs||_F^2 / (||C_rr||_F ||C_ss||_F)``,
    NaN for a constant representation. Debiased: the unbiased HSIC estimator,
    all NaN below 4 samples, NaN for the pairs of a representation whose
    self-HSIC is not positive."""
    k = len(widths)
    mean, M, c = scale_blocks(mean, M, scaled_shift(shift, widths, scale), n, widths)
    tr, F, S = hsic_terms(mean, M, c, n, widths)
    notes: List[str] = []
    diag = np.sqrt(np.diag(F))
    with np.errstate(divide="ignore", invalid="ignore"):
        biased = F / np.outer(diag, diag)
    if not np.isfinite(biased).all():
        bad = [names[r] for r in range(k) if not diag[r] > 0]
        notes.append(f"CKA is undefined for constant representations {bad}: NaN")
        biased = np.where(np.isfinite(biased), biased, np.nan)
    if n < 4:
        notes.append(f"debiased CKA needs at least 4 samples (n = {n}): NaN")
        deb = np.full((k, k), np.nan)
    else:
        H = (F - S + np.outer(tr, tr) / ((n - 1) * (n - 2)) - 2.0 / (n - 2) * S) / (n * (n - 3))
        h = np.diag(H)
        ok = h > 0
        if not ok.all():
            notes.append(f"debiased CKA: the unbiased self-HSIC of {[names[r] for r in range(k) if not ok[r]]} is "
                         f"not positive at n = {n}: NaN for their pairs")
        with np.errstate(divide="ignore", invalid="ignore"):
            deb = H / np.sqrt(np.outer(np.where(ok, h, np.nan), np.where(ok, h, np.nan)))
    return biased, deb, notes
