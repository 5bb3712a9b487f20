"""Linear CKA, biased and debiased, from the joint co-moments of k
representations side by side (docs/MATH.md, "Linear CKA, exact and streamed"),
and the minibatch estimator (``hsic1_batch``, ``cka_minibatch_matrix``).

The state is a ``Similarity``'s: the float64 ``mean`` and co-moment sum ``M``
over the columns ``[g_1 x_1 .. g_k x_k, a_1 .. a_k]``, each representation
``x_r`` (width p_r) at its power-of-two scale ``g_r`` followed by one column per
representation, ``a_r = ||g_r (x_r - c_r)||^2`` at the fixed shift ``c_r``. Every
block ``C_rs`` of ``M`` is a cross-covariance; the biased CKA needs only their
Frobenius norms, the debiased one (the unbiased HSIC estimator) also
``S = sum_i k_i l_i``, read off the norm columns' means and co-moments. Plain
numpy on the state's arrays, without the compiled core.

The minibatch estimator (Nguyen, Raghu and Kornblith 2021) is another
quantity: the unbiased HSIC (Song et al. 2012) of each batch's linear-kernel
Grams, summed over the batches, ``CKA_mb(r, s) = sum_b H_b(r, s) /
sqrt(sum_b H_b(r, r) sum_b H_b(s, s))``. It depends on how the rows are cut
into batches (and is not the CKA of all rows at once); a batch of fewer than 4
rows has no such HSIC.
"""

from __future__ import annotations

import math
from typing import Any, List, Sequence, Tuple, Union

import numpy as np

__all__ = ["cka_matrices", "hsic1_batch", "cka_minibatch_matrix", "MINIBATCH_MIN_ROWS"]

# Blocks whose mean squared norm lies within 2^-64 .. 2^64 are used as given;
# outside, a power-of-two scale brings it near 1 (exact: only the exponents change).
FINISH_LOG2 = 64

# HSIC_1 of a batch divides by n (n - 1) (n - 2) (n - 3): a batch needs at least 4 rows.
MINIBATCH_MIN_ROWS = 4
# For float64 products, a narrower representation is cast to float64 for its
# Gram in column blocks of at most this many bytes (rows x block width x 8).
_CAST_BYTES = 1 << 25
# A CPU tensor's float32 Gram is formed by blocks of rows (``_syrk_torch``) from
# this width on: measured on the 2-core EPYC at 256 rows, blocks took 0.84x
# (1.73 ms against 2.05 ms) the time of one product at width 3,072 and 0.9x at
# 768, 1.1x at 256.
_BLOCKED_WIDTH = 512


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


# -- the minibatch estimator -------------------------------------------------------


def _hsic1_of_grams(trace: Any, rowsum: Any, n: int, xp: Any) -> Any:
    """``HSIC_1`` of every pair from ``trace[r, s] = tr(K~_r K~_s)`` and the row
    sums ``rowsum[r] = K~_r 1`` (k x n), K~ a Gram with its diagonal zeroed."""
    total = rowsum.sum(1)
    cross = rowsum @ rowsum.T  # 1' K~_r K~_s 1
    h = (trace + xp.outer(total, total) / ((n - 1) * (n - 2)) - 2.0 / (n - 2) * cross) / (n * (n - 3))
    return (h + h.T) / 2  # exactly symmetric, whatever order the products summed in


def _gram_numpy(x: np.ndarray, out: np.ndarray, wide: bool) -> None:
    """``out`` = the Gram of ``x``'s rows centred by their batch mean: float64
    products (``x`` cast in column blocks) when ``wide``, else float32."""
    if not wide:
        xc = x.astype(np.float32)
        xc -= xc.mean(axis=0)
        out[...] = xc @ xc.T
        return
    step = max(1, _CAST_BYTES // (8 * max(1, x.shape[0])))
    for a in range(0, x.shape[1], step):
        block = x[:, a:a + step].astype(np.float64)
        block -= block.mean(axis=0)
        if a == 0:
            np.dot(block, block.T, out=out)
        else:
            out += block @ block.T


def _syrk_torch(xc: Any, out: Any) -> None:
    """``out = xc xc^T``. On the CPU, for rows wide enough that the products
    dominate, by blocks of rows: the two diagonal blocks and one off-diagonal
    block, mirrored (3/4 of the products of one matrix product; torch has no
    symmetric rank-k update)."""
    n, p = xc.shape
    if xc.device.type != "cpu" or p < _BLOCKED_WIDTH or n < 64:
        if out.dtype == xc.dtype and out.device == xc.device:
            import torch

            torch.mm(xc, xc.T, out=out)
        else:
            out.copy_(xc @ xc.T)
        return
    h = n // 2
    top, bottom = xc[:h], xc[h:]
    out[:h, :h] = top @ top.T
    out[h:, h:] = bottom @ bottom.T
    cross = bottom @ top.T
    out[h:, :h] = cross
    out[:h, h:] = cross.T


def _gram_torch(torch: Any, x: Any, out: Any, wide: bool) -> None:
    """``_gram_numpy`` for a tensor, on its device (``out``'s, where it differs)."""
    if not wide:
        xc = x - x.mean(dim=0) if x.dtype == torch.float32 else x.to(torch.float32)
        if x.dtype != torch.float32:
            xc -= xc.mean(dim=0)
        _syrk_torch(xc, out)
        return
    step = max(1, _CAST_BYTES // (8 * max(1, x.shape[0])))
    for a in range(0, x.shape[1], step):
        block = x[:, a:a + step].to(torch.float64)
        block = block - block.mean(dim=0)
        g = block @ block.T
        if a == 0:
            out.copy_(g)
        else:
            out += g.to(out.device)


def hsic1_batch(xs: Sequence[Any], wide: Union[None, bool, Sequence[bool]] = None) -> np.ndarray:
    """The k x k unbiased HSIC (Song et al. 2012) of one batch: for every pair
    of representations ``xs[r]`` (n x p_r, the same n >= 4 rows; numpy arrays,
    or torch tensors computed on their device) with linear-kernel Grams
    ``K = X X^T`` and ``K~`` = K with its diagonal zeroed,

        HSIC_1(K, L) = [tr(K~ L~) + (1'K~1)(1'L~1) / ((n-1)(n-2))
                        - 2/(n-2) 1'K~L~1] / (n (n-3)).

    HSIC_1 is unchanged when every row of X is shifted by one constant row
    (K changes by ``a 1' + 1 a'`` and a constant), so each Gram is taken of
    the rows centred by their batch mean, which keeps the digits that the
    raw Grams' common offset would cancel (the mean need not be exact: any
    constant shift leaves the value unchanged). The Grams' products are
    float64 for the representations that ``wide`` names (True: all; or one
    flag per representation; None: all when every input is float64), else
    float32 (the centred rows in float32); the sums over the Grams are float64
    (for torch tensors whose Grams are all float32, the trace terms are the
    float32 products of each Gram row, as accurate as the Grams' own entries,
    summed over the rows in float64).

    Memory: the k Grams, ``8 k n^2`` bytes. Returns a float64 numpy array
    (for CUDA tensors only this k x k result leaves the device). ValueError
    below 4 rows."""
    k = len(xs)
    n = int(xs[0].shape[0])
    if n < MINIBATCH_MIN_ROWS:
        raise ValueError(f"HSIC_1 needs at least {MINIBATCH_MIN_ROWS} rows, got {n}")
    if wide is None:
        wide = all(str(x.dtype) in ("float64", "torch.float64") for x in xs)
    flags = [wide] * k if isinstance(wide, bool) else [bool(w) for w in wide]
    if isinstance(xs[0], np.ndarray):
        G = np.empty((k, n, n))
        for r, x in enumerate(xs):
            _gram_numpy(np.asarray(x), G[r], flags[r])
        G.reshape(k, n * n)[:, ::n + 1] = 0.0  # every diagonal
        flat = G.reshape(k, n * n)
        return _hsic1_of_grams(flat @ flat.T, G.sum(axis=2), n, np)
    import torch

    if not any(flags):  # every Gram in float32: kept in float32, its sums taken in float64
        G32 = torch.empty((k, n, n), dtype=torch.float32, device=xs[0].device)
        for r, x in enumerate(xs):
            _gram_torch(torch, x, G32[r], False)
        G32.diagonal(dim1=1, dim2=2).zero_()
        rows = G32.transpose(0, 1)  # (n, k, n): row i of every Gram
        # tr(K~_r K~_s) = sum_i <row i of K~_r, row i of K~_s>: each row's k x k products in float32 (n terms,
        # as the Grams' own), summed over the rows in float64
        trace = torch.bmm(rows, rows.transpose(1, 2)).sum(dim=0, dtype=torch.float64)
        h = _hsic1_of_grams(trace, G32.sum(dim=2, dtype=torch.float64), n, torch)
        return h.cpu().numpy()
    Gt = torch.empty((k, n, n), dtype=torch.float64, device=xs[0].device)
    for r, x in enumerate(xs):
        _gram_torch(torch, x, Gt[r], flags[r])
    Gt.diagonal(dim1=1, dim2=2).zero_()
    flat_t = Gt.reshape(k, n * n)
    h = _hsic1_of_grams(flat_t @ flat_t.T, Gt.sum(dim=2), n, torch)
    return h.cpu().numpy()


def cka_minibatch_matrix(hsic: np.ndarray, batches: int, skipped: int,
                         names: Sequence[str]) -> Tuple[np.ndarray, List[str]]:
    """``(cka, notes)`` of the minibatch estimator from the sums over the
    batches of ``hsic1_batch`` (k x k): ``hsic[r, s] / sqrt(hsic[r, r]
    hsic[s, s])``. NaN for the pairs of a representation whose summed
    self-HSIC is not positive, all NaN when no batch entered; ``notes`` says
    so, and how many batches of fewer than 4 rows were left out."""
    k = len(names)
    notes: List[str] = []
    if skipped:
        notes.append(f"minibatch CKA: {skipped} batch{'es' if skipped != 1 else ''} of fewer than "
                     f"{MINIBATCH_MIN_ROWS} rows left out (HSIC_1 needs {MINIBATCH_MIN_ROWS}); {batches} entered")
    if batches == 0:
        notes.append(f"minibatch CKA needs a batch of at least {MINIBATCH_MIN_ROWS} rows; none entered: NaN")
        return np.full((k, k), np.nan), notes
    h = np.diag(hsic).copy()
    ok = h > 0
    if not ok.all():
        notes.append(f"minibatch CKA: the summed self-HSIC of {[names[r] for r in range(k) if not ok[r]]} is not "
                     f"positive over {batches} batches: NaN for their pairs")
    d = np.sqrt(np.where(ok, h, np.nan))
    with np.errstate(divide="ignore", invalid="ignore"):
        out = hsic / np.outer(d, d)
    return out, notes
