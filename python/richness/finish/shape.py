"""Orthogonal Procrustes distance and the angular shape metric from the joint
co-moments of k representations side by side (docs/MATH.md, "The similarity
family").

With ``C_rs`` the blocks of the centred co-moment sum ``M`` (``Xc_r^T Xc_s``
summed over the n samples) and ``||.||_*`` the nuclear norm (sum of singular
values), the representations centred and scaled to unit Frobenius norm are as
close under an orthogonal map as

    procrustes(r, s)    = 2 - 2 ||C_rs||_* / sqrt(tr C_rr tr C_ss)       (Ding et al. 2021)
    shape_angular(r, s) = arccos(||C_rs||_* / sqrt(tr C_rr tr C_ss))     (Williams et al. 2021)

``min_Q ||Xc_r / ||Xc_r||_F - Xc_s Q / ||Xc_s||_F||_F^2`` over orthogonal (or,
for unequal widths, zero-padded orthogonal) Q is the first; the second is
Williams et al.'s angular Procrustes distance without whitening (alpha = 1).
Both are symmetric, 0 on the diagonal, unchanged by scaling either
representation, and need no rank cut. Plain numpy float64, without the
compiled core.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Sequence, Tuple, Union

import numpy as np

from .cca import JointBlocks, check_which

__all__ = ["shape_matrices", "SHAPE_MEASURES"]

SHAPE_MEASURES = ("procrustes", "shape_angular")


def shape_matrices(M: np.ndarray, n: int, names: Sequence[str], widths: Sequence[int], *,
                   which: Union[str, Iterable[str]]) -> Tuple[Dict[str, np.ndarray], List[str]]:
    """``(matrices, notes)``: for each name in ``which`` (a subset of
    ``SHAPE_MEASURES``: ``"procrustes"``, ``"shape_angular"``) its k x k float64
    matrix over the representations of a joint co-moment sum ``M`` of ``n``
    samples, and what the caller should warn about, one line each.

    M: the centred co-moment sum over ``[x_1 .. x_k]`` or ``[x_1 .. x_k, a_1 ..
        a_k]`` (the norm columns are not read), at any per-representation scale.
    names, widths: the representations and their column counts, in ``M``'s order.

    ``procrustes`` lies in [0, 2], ``shape_angular`` in [0, pi/2] (radians);
    both are symmetric with an exact 0 on the diagonal. NaN in the rows and
    columns of a constant representation and everywhere below 2 samples (with a
    note). Raises ValueError for unknown measures or an ``M`` whose shape does
    not match ``widths`` or that is not finite.
    """
    asked = check_which(which, SHAPE_MEASURES, "shape_matrices")
    J = JointBlocks(M, n, names, widths, "shape_matrices")
    out = J.nan_matrices(asked)
    if not asked:
        return out, []
    live, notes = J.defined(", ".join(asked))
    for i, r in enumerate(live):
        for w in asked:
            out[w][r, r] = 0.0
        for s in live[i + 1:]:
            nuclear = float(np.linalg.svd(J.block(r, s), compute_uv=False).sum())
            cos = min(max(nuclear / np.sqrt(J.trace[r] * J.trace[s]), 0.0), 1.0)
            if "procrustes" in out:
                out["procrustes"][r, s] = out["procrustes"][s, r] = 2.0 - 2.0 * cos
            if "shape_angular" in out:
                out["shape_angular"][r, s] = out["shape_angular"][s, r] = float(np.arccos(cos))
    return out, notes
