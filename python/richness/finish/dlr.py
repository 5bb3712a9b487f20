"""DLR from co-moments: the learned functions' span, the rank cut, the C >> p head route."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from .._state import precision_mode
from ._xp import eigh_desc, f64, kept, norm, ns

__all__ = ["Functions", "HeadFunctions", "dlr_from_span", "dlr_of_state"]


def default_rtol(precision: str) -> float:
    """The eigenvalue cut of products of ``precision``, from the core's
    precision table (docs/MATH.md, "Rank cut": the eigenvalue noise of a Gram
    matrix is about eps * a_max for the precision that formed it)."""
    return precision_mode(precision).rtol


# Rounding level of a feature's spread relative to its mean: centering on a
# float64 mean computed from n values leaves about sqrt(n) eps |mean| behind
# in every sample (docs/MATH.md, constant features). A covariance at this
# level is rounding, not signal.
CONSTANT_RTOL = 32 * np.finfo(np.float64).eps


def check_features(st: dict) -> float:
    """``||M||_F``, after raising ValueError when the features are constant:
    their covariance is zero or at the rounding level of their mean."""
    M, n = st["M"], float(st["n"])
    norm_m = norm(M)
    if not math.isfinite(norm_m):
        raise ValueError("the feature moments are not finite: the state is corrupt; stream the data again")
    xp = ns(M)
    diag = xp.diagonal(M)
    top = float(diag.max())
    spread = math.sqrt(top) * math.sqrt(float(xp.sum(diag / top)) / n) if top > 0.0 else 0.0
    size = norm(st["mean"])
    if not norm_m > 0.0 or spread <= CONSTANT_RTOL * math.sqrt(n) * size:
        tiny = norm_m == 0.0 and 0.0 < size < 1e-140
        raise ValueError(
            "features are constant (zero covariance, or one at the rounding level of their mean): DLR and the "
            "spectrum are undefined; check that the features vary"
            + ("; if they vary by less than 1e-154, their squares underflow float64: rescale them" if tiny else ""))
    return norm_m


def logits(a, a_scale: float):
    """A's eigenvalues in the units of the moments; FloatingPointError past float64."""
    with np.errstate(over="ignore", invalid="ignore"):  # checked just below
        a = a * a_scale
    if not bool(ns(a).isfinite(a).all()):
        raise FloatingPointError("the output covariance's eigenvalues overflow float64")
    return a


class Functions:
    """A family of streamed functions g with B_g (p x m) and A_g (m x m) given explicitly.

    Held divided by A's largest diagonal s (B by sqrt(s)): DLR and the curves
    do not depend on the functions' scale, and the products ||B u||^2 / a then
    stay within float64 even when outputs reach 1e150 or 1e-150. ``proj_sq``
    and ``trace`` share that unit (the curves are their ratio), and so do the
    eigenvalues ``span`` returns (DLR uses only their ratios): times
    ``a_scale`` they are A's, which may pass float64 where DLR does not."""

    def __init__(self, B, A, a_scale: float = 1.0) -> None:
        xp = ns(A)
        top = float(xp.diagonal(A).max()) if A.shape[0] else 0.0
        scale = top if top > 0.0 and math.isfinite(top) else 1.0
        self.B, self.A, self.a_scale = B / math.sqrt(scale), A / scale, a_scale * scale

    def proj_sq(self, V, lam):
        """||B_g^T v_k||^2 / lam_k for the columns v_k of V (lam_k > 0)."""
        P = (V.T @ self.B) / ns(lam).sqrt(lam)[:, None]
        return ns(P).sum(P * P, axis=1)

    def trace(self) -> float:
        return float(ns(self.A).trace(self.A))

    def span(self, M, floor: float) -> tuple:
        """Eigenvalues a (desc) of A / a_scale and the DLR numerator terms ||B u_i||^2 / a_i
        for every direction with a_i > floor * a_max (docs/MATH.md, feature-space form: tr(B A^+ B^T))."""
        a, U = eigh_desc(self.A)
        if not a[0] > 0.0:
            raise ValueError("outputs are constant (zero covariance): the learned function space is empty")
        xp = ns(a)
        m = int(xp.count_nonzero(a > floor * a[0]))
        BU = self.B @ U[:, :m]
        return a, xp.sum(BU * BU, axis=0) / a[:m]


class HeadFunctions(Functions):
    """Outputs of a linear head W (C x p) on features with second moment M, in
    p-space (docs/MATH.md, many outputs): B = M W^T and A = W M W^T are never
    formed, only W^T W (p x p). Used when C > p."""

    def __init__(self, M, WtW, a_scale: float = 1.0) -> None:
        self.M, self.WtW, self.a_scale = M, WtW, a_scale

    def proj_sq(self, V, lam):
        # M v / sqrt(lam) first: (M v)^T W^T W (M v) alone passes float64 once M passes 1e154
        MV = (self.M @ V) / ns(lam).sqrt(lam)[None, :]
        return ns(MV).einsum("ij,ij->j", self.WtW @ MV, MV)

    def trace(self) -> float:
        return float(ns(self.M).sum(self.M * self.WtW))

    def span(self, M, floor: float) -> tuple:
        # tr(B A^+ B^T) = tr(M^1/2 P M^1/2), P the projector onto the column span
        # of M^1/2 W^T; G = M^1/2 W^T W M^1/2 has A's nonzero eigenvalues.
        xp = ns(self.M)
        lam, V = eigh_desc(self.M)
        R = (V * xp.sqrt(lam)) @ V.T
        G = R @ self.WtW @ R
        a, U = eigh_desc((G + G.T) / 2)
        if not a[0] > 0.0:
            raise ValueError("outputs are constant (zero covariance): the learned function space is empty")
        m = int(xp.count_nonzero(a > floor * a[0]))
        U = U[:, :m]
        return a, xp.einsum("ij,ij->j", M @ U, U)


def span_of_grams(A, Q, floor: float, divide: bool = True) -> tuple:
    """A's eigenvalues (descending) and the DLR numerator terms from Gram
    matrices alone, for stacked matrices (leading batch axis): with A = Fc^T Fc
    and Q = B^T B, ||B u_i||^2 / a_i = u_i^T Q u_i / a_i; with A = Fc Fc^T and
    Q the features' n x n Gram (``divide=False``, docs/MATH.md, per-batch
    sample-space form), u_i^T Q u_i. Terms of directions at or below
    ``floor * a_max`` are 0."""
    xp = ns(A)
    a, U = eigh_desc((A + xp.swapaxes(A, -1, -2)) / 2)
    keep = kept(a, floor)
    uqu = xp.einsum("...ij,...ij->...j", Q @ U, U)
    if divide:
        uqu = uqu / xp.where(keep, a, 1.0)
    return a, xp.where(keep, uqu, 0.0)


def dlr_values(norm_m, a, terms, rtol: float) -> tuple:
    """DLR = 1 - tr(B A^+ B^T) / (||M||_F sqrt(r)), r = #{a_i > rtol a_max}, from
    A's eigenvalues ``a`` (descending) and the terms ||B u_i||^2 / a_i of its
    first directions (docs/MATH.md, feature-space form and rank cut). Leading
    axes batch stacked states. Returns (dlr, rank) arrays: DLR clipped to
    [0, 1] (CKA <= 1 by Cauchy-Schwarz: only rounding leaves it), NaN where it
    is undefined (||M|| = 0, no direction kept) or not finite."""
    xp = ns(a)
    keep = kept(a[..., :terms.shape[-1]], rtol)
    rank = keep.sum(axis=-1)
    ok = (norm_m > 0.0) & (rank > 0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        raw = 1.0 - xp.where(keep, terms, 0.0).sum(axis=-1) / (norm_m * xp.sqrt(f64(rank)))
    return xp.where(ok & xp.isfinite(raw), xp.clip(raw, 0.0, 1.0), math.nan), rank


def dlr_from_span(norm_m: float, a, terms, rtol: float) -> tuple:
    """(DLR, rank) of one state as Python numbers (see ``dlr_values``)."""
    dlr, rank = dlr_values(norm_m, a, terms, rtol)
    dlr = float(dlr)
    if not math.isfinite(dlr):
        raise FloatingPointError("the DLR numerator is not finite")
    return dlr, int(rank)


def dlr_with_range(fn: Functions, M, norm_m: float, rtol: float) -> tuple:
    """(DLR, rank, A's eigenvalues, DLR at rtol / 10 and rtol * 10, warning or
    None): the rank cut's sensitivity comes for free from the terms down to a
    decade below the cut (docs/MATH.md, rank cut)."""
    logit_eig, terms = fn.span(M, rtol / 10)
    dlr, rank = dlr_from_span(norm_m, logit_eig, terms, rtol)
    dlr_range = (dlr_from_span(norm_m, logit_eig, terms, rtol / 10)[0],
                 dlr_from_span(norm_m, logit_eig, terms, rtol * 10)[0])
    cut = rtol * logit_eig[0]
    dropped_near = rank < logit_eig.shape[0] and logit_eig[rank] > 0.1 * cut
    warning = None
    if dropped_near or logit_eig[rank - 1] < 10 * cut:
        warning = (f"a logit eigenvalue lies within a decade of the rank cut (rtol={rtol:g}): DLR moves "
                   f"from {dlr_range[0]:.4f} to {dlr_range[1]:.4f} over rtol x 0.1 .. x 10: quote that range "
                   "(dlr_rtol_range) with DLR, or pass an rtol that falls in a gap of logit_eigenvalues "
                   "(docs/READING_DLR.md)")
    return dlr, rank, logit_eig, dlr_range, warning


def function_moments(st: dict, W, M=None) -> Optional[Functions]:
    """The learned functions: a linear head if given (B = M W^T, A = W M W^T),
    else the streamed outputs."""
    if W is not None:
        M = st["M"] if M is None else M
        if W.shape[1] != M.shape[0]:
            raise ValueError(f"head weight has {W.shape[1]} input columns but the features have {M.shape[0]}")
        # W / max|W|: DLR does not depend on the head's scale, and W M W^T
        # then stays within float64 for any finite W (A's eigenvalues are
        # scaled back by the square).
        w = float(ns(W).abs(W).max())
        if not (w > 0.0 and math.isfinite(w)):
            w = 1.0
        W = W / w
        if W.shape[0] > W.shape[1]:
            return HeadFunctions(M, W.T @ W, w * w)
        B = M @ W.T
        A = W @ B
        return Functions(B, (A + A.T) / 2, w * w)
    if st["c"] > 0:
        return Functions(st["B"], st["A"])
    return None


class NumericFailureGuard:
    """Turns a numerical failure of the finishing math (an eigensolver that
    does not converge, an overflow to Inf or NaN) into a ValueError that says
    what to do: the moments span more than float64 holds."""

    def __init__(self, st: dict, W=None) -> None:
        self.st, self.W = st, W

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if kind is None:
            return False
        numeric = (issubclass(kind, (np.linalg.LinAlgError, FloatingPointError))
                   or kind.__name__ in ("LinAlgError", "_LinAlgError"))  # torch.linalg's
        if not numeric:
            return False
        sizes = [f"|{key}| up to {float(ns(self.st[key]).abs(self.st[key]).max()):.3g}"
                 for key in ("M", "A", "At") if self.st[key].shape[0]]
        if self.W is not None and self.W.shape[0]:
            sizes.append(f"head weights up to {float(ns(self.W).abs(self.W).max()):.3g}")
        raise ValueError(
            f"compute() failed in float64 ({err}); the moments are too large or too widely scaled "
            f"({', '.join(sizes)}): rescale the features, outputs or head weights (DLR does not depend on "
            "their scale) and stream again") from None


def dlr_of_state(st: dict, W, rtol: float, with_range: bool = False) -> tuple:
    """(DLR, rank) alone, no spectrum: for monitors and jackknife replicates;
    ``with_range``: (DLR, rank, DLR at rtol / 10 and rtol * 10), from the same
    eigendecomposition (``dlr_with_range``)."""
    if W is None and not st["c"] > 0:
        raise ValueError("DLR is undefined for this state (no outputs/head)")
    norm_m = check_features(st)
    with NumericFailureGuard(st, W):
        fn = function_moments(st, W)
        assert fn is not None  # outputs or a head, checked above
        if with_range:
            dlr, rank, _, dlr_range, _ = dlr_with_range(fn, st["M"], norm_m, rtol)
            return dlr, rank, dlr_range
        a, terms = fn.span(st["M"], rtol)
        return dlr_from_span(norm_m, a, terms, rtol)
