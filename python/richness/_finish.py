"""Finishing math: from float64 co-moments to DLR, spectrum, curves and NC1.

Everything here follows ../shared/SPEC.md and runs in float64 on p x p,
p x C and C x C matrices; n never appears as a dimension.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ._report import Report

# Eigenvalue cut by product precision (SPEC.md: eigenvalue noise of a Gram
# matrix is about eps * a_max for the precision that formed it).
DEFAULT_RTOL = {"fp64": 1e-10, "fp32": 1e-5, "tf32": 1e-3, "bf16": 1e-2}

# NC1 subtracts nearly equal p x p matrices near collapse; SPEC.md measured
# tf32 and bf16 products as useless there (errors of 100% and more).
NC1_RELIABLE = ("fp64", "fp32")


class _TorchNamespace:
    """The numpy functions used here, on torch tensors: ``compute()`` of a CUDA
    state runs this same math on the device, in float64. torch is imported
    only on that path (numpy stays the one hard dependency)."""

    def __init__(self, torch, device) -> None:
        self._torch, self.device, self.linalg = torch, device, torch.linalg

    def __getattr__(self, name: str):  # sum, einsum, outer, diag, trace, sqrt, exp, log, clip, flip, ...
        return getattr(self._torch, name)

    def cumsum(self, x):
        return self._torch.cumsum(x, 0)

    def empty(self, n: int):
        return self._torch.empty(n, dtype=self._torch.float64, device=self.device)

    def zeros(self, n: int):
        return self._torch.zeros(n, dtype=self._torch.float64, device=self.device)

    def asarray(self, x):
        return self._torch.as_tensor(x, device=self.device)


def _ns(a):
    """numpy for numpy arrays; the torch shim for torch tensors (CUDA compute)."""
    if isinstance(a, np.ndarray) or type(a).__module__.split(".")[0] != "torch":
        return np
    import torch

    return _TorchNamespace(torch, a.device)


def _f64(a):
    return a.astype(np.float64) if isinstance(a, np.ndarray) else a.double()


def _host(a):
    """A numpy copy of a torch result (Report fields are numpy); numpy passes through."""
    if a is None or isinstance(a, np.ndarray) or not hasattr(a, "detach"):
        return a
    return a.detach().cpu().numpy()


# Rounding level of a feature's spread relative to its mean: centering on a
# float64 mean computed from n values leaves about sqrt(n) eps |mean| behind
# in every sample (docs/MATH.md, constant features). A covariance at this
# level is rounding, not signal.
CONSTANT_RTOL = 32 * np.finfo(np.float64).eps


def _norm(a) -> float:
    """Frobenius norm, scaled first so that the squares neither overflow
    (entries above 1e154) nor underflow (below 1e-154)."""
    xp = _ns(a)
    scale = float(xp.abs(a).max()) if a.shape[0] else 0.0
    if not (scale > 0.0 and math.isfinite(scale)):
        return scale
    return scale * float(xp.linalg.norm(a / scale))


def check_features(st: dict) -> float:
    """``||M||_F``, after raising ValueError when the features are constant:
    their covariance is zero or at the rounding level of their mean."""
    M, n = st["M"], float(st["n"])
    norm_m = _norm(M)
    if not math.isfinite(norm_m):
        raise ValueError("the feature moments are not finite: the state is corrupt; stream the data again")
    xp = _ns(M)
    diag = xp.diagonal(M)
    top = float(diag.max())
    spread = math.sqrt(top) * math.sqrt(float(xp.sum(diag / top)) / n) if top > 0.0 else 0.0
    size = _norm(st["mean"])
    if not norm_m > 0.0 or spread <= CONSTANT_RTOL * math.sqrt(n) * size:
        tiny = norm_m == 0.0 and 0.0 < size < 1e-140
        raise ValueError(
            "features are constant (zero covariance, or one at the rounding level of their mean): DLR and the "
            "spectrum are undefined; check that the features vary"
            + ("; if they vary by less than 1e-154, their squares underflow float64: rescale them" if tiny else ""))
    return norm_m


def _eigh_desc(S: np.ndarray) -> tuple:
    xp = _ns(S)
    w, V = xp.linalg.eigh(S)
    return xp.clip(xp.flip(w, (0,)), 0.0, None), xp.flip(V, (1,))


def _logits(a, a_scale: float):
    """A's eigenvalues in the units of the moments; FloatingPointError past float64."""
    with np.errstate(over="ignore", invalid="ignore"):  # checked just below
        a = a * a_scale
    if not bool(_ns(a).isfinite(a).all()):
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

    def __init__(self, B: np.ndarray, A: np.ndarray, a_scale: float = 1.0) -> None:
        xp = _ns(A)
        top = float(xp.diagonal(A).max()) if A.shape[0] else 0.0
        scale = top if top > 0.0 and math.isfinite(top) else 1.0
        self.B, self.A, self.a_scale = B / math.sqrt(scale), A / scale, a_scale * scale

    def proj_sq(self, V: np.ndarray, lam) -> np.ndarray:
        """||B_g^T v_k||^2 / lam_k for the columns v_k of V (lam_k > 0)."""
        P = (V.T @ self.B) / _ns(lam).sqrt(lam)[:, None]
        return _ns(P).sum(P * P, axis=1)

    def trace(self) -> float:
        return float(_ns(self.A).trace(self.A))

    def span(self, M: np.ndarray, floor: float) -> tuple:
        """Eigenvalues a (desc) of A / a_scale and the DLR numerator terms ||B u_i||^2 / a_i
        for every direction with a_i > floor * a_max (SPEC: tr(B A^+ B^T))."""
        a, U = _eigh_desc(self.A)
        if not a[0] > 0.0:
            raise ValueError("outputs are constant (zero covariance): the learned function space is empty")
        xp = _ns(a)
        m = int(xp.count_nonzero(a > floor * a[0]))
        BU = self.B @ U[:, :m]
        return a, xp.sum(BU * BU, axis=0) / a[:m]


class HeadFunctions(Functions):
    """Outputs of a linear head W (C x p) on features with second moment M, in
    p-space (SPEC.md, "Many outputs"): B = M W^T and A = W M W^T are never
    formed, only W^T W (p x p). Used when C > p."""

    def __init__(self, M: np.ndarray, WtW: np.ndarray, a_scale: float = 1.0) -> None:
        self.M, self.WtW, self.a_scale = M, WtW, a_scale

    def proj_sq(self, V: np.ndarray, lam) -> np.ndarray:
        # M v / sqrt(lam) first: (M v)^T W^T W (M v) alone passes float64 once M passes 1e154
        MV = (self.M @ V) / _ns(lam).sqrt(lam)[None, :]
        return _ns(MV).einsum("ij,ij->j", self.WtW @ MV, MV)

    def trace(self) -> float:
        return float(_ns(self.M).sum(self.M * self.WtW))

    def span(self, M: np.ndarray, floor: float) -> tuple:
        # tr(B A^+ B^T) = tr(M^1/2 P M^1/2), P the projector onto the column span
        # of M^1/2 W^T; G = M^1/2 W^T W M^1/2 has A's nonzero eigenvalues.
        xp = _ns(self.M)
        lam, V = _eigh_desc(self.M)
        R = (V * xp.sqrt(lam)) @ V.T
        G = R @ self.WtW @ R
        a, U = _eigh_desc((G + G.T) / 2)
        if not a[0] > 0.0:
            raise ValueError("outputs are constant (zero covariance): the learned function space is empty")
        m = int(xp.count_nonzero(a > floor * a[0]))
        U = U[:, :m]
        return a, xp.einsum("ij,ij->j", M @ U, U)


def dlr_from_span(norm_m: float, a: np.ndarray, terms: np.ndarray, rtol: float) -> tuple:
    """DLR = 1 - tr(B A^+ B^T) / (||M||_F sqrt(r)) with r = #{a_i > rtol a_max}."""
    xp = _ns(a)
    r = int(xp.count_nonzero(a[: terms.shape[0]] > rtol * a[0]))
    dlr = 1.0 - float(xp.sum(terms[:r])) / (norm_m * math.sqrt(r))
    if not math.isfinite(dlr):
        raise FloatingPointError("the DLR numerator is not finite")
    # CKA <= 1 by Cauchy-Schwarz: only rounding can leave [0, 1].
    return min(max(dlr, 0.0), 1.0), r


def function_moments(st: dict, W: Optional[np.ndarray], M: Optional[np.ndarray] = None) -> Optional[Functions]:
    """The learned functions: a linear head if given (B = M W^T, A = W M W^T),
    else the streamed outputs."""
    if W is not None:
        M = st["M"] if M is None else M
        if W.shape[1] != M.shape[0]:
            raise ValueError(f"head weight has {W.shape[1]} input columns but the features have {M.shape[0]}")
        # W / max|W|: DLR does not depend on the head's scale, and W M W^T
        # then stays within float64 for any finite W (A's eigenvalues are
        # scaled back by the square).
        w = float(_ns(W).abs(W).max())
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


def dlr_of_state(st: dict, W: Optional[np.ndarray], rtol: float) -> tuple:
    """(DLR, rank) alone, no spectrum: for monitors and jackknife replicates."""
    if W is None and not st["c"] > 0:
        raise ValueError("DLR is undefined for this state (no outputs/head)")
    norm_m = check_features(st)
    with _finishing(st, W):
        a, terms = function_moments(st, W).span(st["M"], rtol)
        return dlr_from_span(norm_m, a, terms, rtol)


class _finishing:
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
        sizes = [f"|{key}| up to {float(_ns(self.st[key]).abs(self.st[key]).max()):.3g}"
                 for key in ("M", "A", "At") if self.st[key].shape[0]]
        if self.W is not None and self.W.shape[0]:
            sizes.append(f"head weights up to {float(_ns(self.W).abs(self.W).max()):.3g}")
        raise ValueError(
            f"compute() failed in float64 ({err}); the moments are too large or too widely scaled "
            f"({', '.join(sizes)}): rescale the features, outputs or head weights (DLR does not depend on "
            "their scale) and stream again") from None


def isotropic_dlr(n: int, p_eff: float, r: int) -> float:
    """Expected DLR of isotropic Gaussian features (n samples, p_eff features)
    with an r-dimensional linear output span: with m = n - 1 centered degrees of
    freedom, E tr(B A^+ B^T) = r (m + p - r) and E ||M||_F^2 = m p (m + p + 1)
    (Wishart moments), so DLR_iso = 1 - sqrt(r) (m + p - r) / sqrt(m p (m + p + 1)).
    Its n -> oo limit is SPEC.md's 1 - sqrt(C/p); docs/READING_DLR.md derives it."""
    m = max(n - 1, 1)
    p = max(p_eff, 1.0)
    r = min(r, m, p)
    value = 1.0 - math.sqrt(r) * (m + p - r) / math.sqrt(m * p * (m + p + 1))
    return min(max(value, 0.0), 1.0)


def label_moments(st: dict) -> tuple:
    """One-hot targets: B_y[:, k] = s_k - n_k mu, A_y = diag(n_k) - n pi pi^T."""
    xp = _ns(st["mean"])
    counts = _f64(st["class_counts"])
    B = st["class_sums"].T - xp.outer(st["mean"], counts)
    A = xp.diag(counts) - xp.outer(counts, counts) / st["n"]
    return B, A


def task_moments(st: dict) -> Optional[Functions]:
    """The task: float targets when streamed, else one-hot labels."""
    if st["t"] > 0:
        return Functions(st["Bt"], st["At"])
    if st["k"] > 0:
        return Functions(*label_moments(st))
    return None



def _curve(proj_sq: np.ndarray, denom: float, p: int) -> Optional[np.ndarray]:
    if not denom > 0.0:
        return None
    xp = _ns(proj_sq)
    q = proj_sq / denom
    out = xp.empty(p)
    r = q.shape[0]
    out[:r] = xp.cumsum(q)
    out[r:] = out[r - 1] if r else 0.0
    return out


def nc1_from_class_means(D, counts, n: float, vmv, rtol: float) -> Optional[float]:
    """NC1 = tr(Sigma_W Sigma_B^+) / K from the centered class means D (K x p,
    classes present), their counts, n, and ``vmv(Vt)`` giving v^T M v for the
    rows v of Vt. Sigma_B = D^T D / K has its eigenpairs from the smaller Gram
    (K x K when K <= p: v = D^T u / sqrt(s)); an SVD of D cost 3-9x more."""
    xp = _ns(D)
    K, p = D.shape
    if K <= p:
        s, U = _eigh_desc(D @ D.T)
        keep = s > rtol * s[0]  # all False when s[0] == 0
        if not bool(keep.any()):
            return None
        Vt = (U[:, keep].T @ D) / xp.sqrt(s[keep])[:, None]
    else:
        s, V = _eigh_desc(D.T @ D)
        keep = s > rtol * s[0]
        if not bool(keep.any()):
            return None
        Vt = V[:, keep].T
    sb = s[keep] / K
    # v^T Sigma_W v = (v^T M v - sum_k n_k (d_k . v)^2) / n
    dv = D @ Vt.T
    vwv = (vmv(Vt) - (counts[:, None] * dv * dv).sum(axis=0)) / n
    return max(float(xp.sum(vwv / sb)) / K, 0.0)


def nc1(st: dict, rtol: float) -> Optional[float]:
    """NC1 = tr(Sigma_W Sigma_B^+) / K (Papyan et al. 2020; SPEC.md)."""
    if st["k"] <= 0:
        return None
    xp = _ns(st["mean"])
    counts = _f64(st["class_counts"])
    present = counts > 0
    if int(present.sum()) < 2:
        return None
    D = st["class_sums"][present] / counts[present, None] - st["mean"][None, :]
    M = st["M"]
    return nc1_from_class_means(D, counts[present], float(st["n"]),
                                lambda Vt: xp.einsum("ij,ij->i", Vt @ M, Vt), rtol)


def finish(st: dict, *, W: Optional[np.ndarray] = None, test: Optional[dict] = None,
           rtol: Optional[float] = None, centered: bool = True, spectrum: bool = True) -> Report:
    """The report from a state dict (as ``Moments.state_dict()`` returns).
    ``spectrum=False`` skips the p x p eigendecomposition and everything built
    on it (eigenvalues, curves, held-out curves): DLR, its rank-cut range, the
    finite-sample reference and NC1 remain. O(p^2 C) instead of O(p^3)."""
    n, p = int(st["n"]), int(st["p"])
    if n == 0:
        raise ValueError("compute() on an empty Moments: no samples were added")
    if n < 2:
        raise ValueError(f"need at least 2 samples to measure a covariance, got n = {n}")
    precision = st["precision"]
    if rtol is None:
        rtol = DEFAULT_RTOL[precision]
    if not (isinstance(rtol, (int, float)) and 0.0 < rtol < 1.0):
        raise ValueError(f"rtol must be a number in (0, 1), got {rtol!r}")
    if test is not None and not spectrum:
        raise ValueError("held-out curves (test=) need the spectrum: drop spectrum=False")
    M = st["M"]
    xp = _ns(M)
    if xp is not np:  # CUDA state: head and held-out state join it on the device
        if W is not None:
            W = xp.asarray(W).double()
        if test is not None:
            test = {k: (xp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in test.items()}
    norm_m = check_features(st)
    with _finishing(st, W):
        return _finish(st, W, test, rtol, centered, spectrum, function_moments(st, W), norm_m)


def _finish(st, W, test, rtol, centered, spectrum, fn, norm_m) -> Report:
    n, p, M, precision = int(st["n"]), int(st["p"]), st["M"], st["precision"]
    xp = _ns(M)
    warnings = []
    dlr = rank = logit_eig = None
    dlr_range = None
    if fn is not None:
        # Terms down to a decade below the cut give the rtol sensitivity for free.
        logit_eig, terms = fn.span(M, rtol / 10)
        dlr, rank = dlr_from_span(norm_m, logit_eig, terms, rtol)
        dlr_range = (dlr_from_span(norm_m, logit_eig, terms, rtol / 10)[0],
                     dlr_from_span(norm_m, logit_eig, terms, rtol * 10)[0])
        cut = rtol * logit_eig[0]
        dropped_near = rank < logit_eig.shape[0] and logit_eig[rank] > 0.1 * cut
        if dropped_near or logit_eig[rank - 1] < 10 * cut:
            warnings.append(
                f"a logit eigenvalue lies within a decade of the rank cut (rtol={rtol:g}): DLR moves "
                f"from {dlr_range[0]:.4f} to {dlr_range[1]:.4f} over rtol x 0.1 .. x 10; see logit_eigenvalues")

    rho = quality = utilization = effective_dim = r_phi = None
    test_quality = test_utilization = test_norms = None
    if spectrum:
        # Spectrum of Sigma = M / n (or the uncentered operator, the paper's v1).
        S = M if centered else M + n * xp.outer(st["mean"], st["mean"])
        lam, V = _eigh_desc(S)
        if not bool(xp.isfinite(lam).all()):
            raise FloatingPointError("the feature spectrum is not finite")
        if not lam[0] > 0.0:
            raise ValueError("features are constant (zero covariance): the spectrum is undefined")
        rho = lam / n
        r_phi = int(xp.count_nonzero(lam > rtol * lam[0]))
        Vk, lk = V[:, :r_phi], lam[:r_phi]
        q = rho[rho > 0] / rho.sum()
        effective_dim = float(xp.exp(-xp.sum(q * xp.log(q))))

        def train_curve(g):
            return None if g is None else _curve(g.proj_sq(Vk, lk), g.trace(), p)

        task = task_moments(st)
        quality = train_curve(task)
        utilization = train_curve(fn)

        if test is not None:
            nt = int(test["n"])
            if nt < 2:  # first: an empty test state has no width (p = -1) to compare
                raise ValueError(f"the test state needs at least 2 samples, got n = {nt}")
            if int(test["p"]) != p:
                raise ValueError(f"test state has {test['p']} features, the training state {p}")

            def test_curve(g):
                # <e_k, g_j>_test = v_k^T B_test[:, j] / (n_test sqrt(rho_k)), rho_k from training.
                return None if g is None else _curve(g.proj_sq(Vk, rho[:r_phi] * nt), g.trace(), p)

            test_quality = test_curve(task_moments(test))
            test_utilization = test_curve(function_moments(test, W))
            shift = test["mean"] - (st["mean"] if centered else 0.0)
            second = test["M"] / nt + xp.outer(shift, shift)
            norms = xp.einsum("ij,ij->j", second @ Vk, Vk) / rho[:r_phi]
            test_norms = xp.zeros(p)
            test_norms[:r_phi] = norms

    nc1_value = None
    if st["k"] > 0:
        if precision in NC1_RELIABLE:
            nc1_value = nc1(st, rtol)
        else:
            warnings.append(f"NC1 not reported: {precision} products cannot resolve within-class spread")

    # Finite-sample reference: isotropic features of the same n, the same
    # number of active features (dead units excluded) and the same logit rank.
    var = xp.diagonal(M)
    p_active = int(xp.count_nonzero(var > rtol * var.max()))
    dlr_iso = dlr_norm = None
    if dlr is not None:
        dlr_iso = isotropic_dlr(n, p_active, rank)
        dlr_norm = dlr / dlr_iso if dlr_iso > 0 else None
    if n < 10 * p:
        warnings.append(f"n = {n} is below 10 p = {10 * p}: DLR is biased toward rich at this sample size"
                        + (f" (isotropic features here would give {dlr_iso:.3f})" if dlr_iso is not None else ""))

    return Report(
        dlr=dlr, rank=rank, n=n,
        logit_eigenvalues=None if fn is None else _host(_logits(logit_eig, fn.a_scale)), nc1=nc1_value,
        eigenvalues=_host(rho), relative_eigenvalues=None if rho is None else _host(rho / rho[0]),
        effective_dim=effective_dim,
        quality=_host(quality), utilization=_host(utilization), test_quality=_host(test_quality),
        test_utilization=_host(test_utilization), test_eigenfunction_norms=_host(test_norms),
        feature_rank=r_phi, rtol=float(rtol), precision=precision, centered=centered,
        dlr_rtol_range=dlr_range, active_features=p_active, dlr_isotropic=dlr_iso,
        dlr_normalized=dlr_norm, warnings=warnings)
