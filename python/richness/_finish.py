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


def _eigh_desc(S: np.ndarray) -> tuple:
    w, V = np.linalg.eigh(S)
    return np.clip(w[::-1], 0.0, None), V[:, ::-1]


def dlr_from_moments(M: np.ndarray, B: np.ndarray, A: np.ndarray, rtol: float) -> tuple:
    """DLR = 1 - tr(B A^+ B^T) / (||M||_F sqrt(r)); returns (dlr, r, logit eigenvalues desc)."""
    norm_m = float(np.linalg.norm(M))
    if not norm_m > 0.0:
        raise ValueError("features are constant (zero covariance): DLR is undefined")
    a, U = _eigh_desc(A)
    if not a[0] > 0.0:
        raise ValueError("outputs are constant (zero covariance): the learned function space is empty")
    r = int(np.count_nonzero(a > rtol * a[0]))
    BU = B @ U[:, :r]
    inner = float(np.sum(np.sum(BU * BU, axis=0) / a[:r]))
    dlr = 1.0 - inner / (norm_m * math.sqrt(r))
    # CKA <= 1 by Cauchy-Schwarz: only rounding can leave [0, 1].
    return min(max(dlr, 0.0), 1.0), r, a


def head_moments(M: np.ndarray, W: np.ndarray) -> tuple:
    """Linear-head shortcut (SPEC.md): B = M W^T, A = W M W^T."""
    if W.shape[1] != M.shape[0]:
        raise ValueError(f"head weight has {W.shape[1]} input columns but the features have {M.shape[0]}")
    B = M @ W.T
    A = W @ B
    return B, (A + A.T) / 2


def label_moments(st: dict) -> tuple:
    """One-hot targets: B_y[:, k] = s_k - n_k mu, A_y = diag(n_k) - n pi pi^T."""
    counts = st["class_counts"].astype(np.float64)
    B = st["class_sums"].T - np.outer(st["mean"], counts)
    A = np.diag(counts) - np.outer(counts, counts) / st["n"]
    return B, A


def task_moments(st: dict) -> Optional[tuple]:
    """(B, A) of the task: float targets when streamed, else one-hot labels."""
    if st["t"] > 0:
        return st["Bt"], st["At"]
    if st["k"] > 0:
        return label_moments(st)
    return None


def function_moments(st: dict, W: Optional[np.ndarray]) -> Optional[tuple]:
    """(B, A) of the learned function: from the head if given, else streamed outputs."""
    if W is not None:
        return head_moments(st["M"], W)
    if st["c"] > 0:
        return st["B"], st["A"]
    return None


def _curve(proj_sq: np.ndarray, denom: float, p: int) -> Optional[np.ndarray]:
    if not denom > 0.0:
        return None
    q = proj_sq / denom
    out = np.empty(p)
    r = q.shape[0]
    out[:r] = np.cumsum(q)
    out[r:] = out[r - 1] if r else 0.0
    return out


def nc1(st: dict, rtol: float) -> Optional[float]:
    """NC1 = tr(Sigma_W Sigma_B^+) / K (Papyan et al. 2020; SPEC.md)."""
    if st["k"] <= 0:
        return None
    counts = st["class_counts"].astype(np.float64)
    present = counts > 0
    K = int(present.sum())
    if K < 2:
        return None
    n = float(st["n"])
    D = st["class_sums"][present] / counts[present, None] - st["mean"][None, :]
    # Sigma_B = D^T D / K: its eigenvectors are D's right singular vectors.
    _, S, Vt = np.linalg.svd(D, full_matrices=False)
    keep = S * S > rtol * S[0] * S[0] if S[0] > 0 else np.zeros_like(S, dtype=bool)
    if not keep.any():
        return None
    Vt = Vt[keep]
    sb = S[keep] ** 2 / K
    # v^T Sigma_W v = (v^T M v - sum_k n_k (d_k . v)^2) / n
    vmv = np.einsum("ij,ij->i", Vt @ st["M"], Vt)
    dv = D @ Vt.T
    vwv = (vmv - (counts[present, None] * dv * dv).sum(axis=0)) / n
    return max(float(np.sum(vwv / sb)) / K, 0.0)


def finish(st: dict, *, W: Optional[np.ndarray] = None, test: Optional[dict] = None,
           rtol: Optional[float] = None, centered: bool = True) -> Report:
    """The full report from a state dict (as ``Moments.state_dict()`` returns)."""
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
    M = st["M"]
    warnings = []

    fn = function_moments(st, W)
    dlr = rank = logit_eig = None
    if fn is not None:
        dlr, rank, logit_eig = dlr_from_moments(M, fn[0], fn[1], rtol)
        cut = rtol * logit_eig[0]
        dropped_near = rank < logit_eig.shape[0] and logit_eig[rank] > 0.1 * cut
        if dropped_near or logit_eig[rank - 1] < 10 * cut:
            warnings.append(
                f"a logit eigenvalue lies within a decade of the rank cut (rtol={rtol:g}): "
                "DLR depends on the cut; see logit_eigenvalues")
    elif not float(np.linalg.norm(M)) > 0.0:
        raise ValueError("features are constant (zero covariance): the spectrum is undefined")

    # Spectrum of Sigma = M / n (or the uncentered operator, the paper's v1).
    S = M if centered else M + n * np.outer(st["mean"], st["mean"])
    lam, V = _eigh_desc(S)
    if not lam[0] > 0.0:
        raise ValueError("features are constant (zero covariance): the spectrum is undefined")
    rho = lam / n
    r_phi = int(np.count_nonzero(lam > rtol * lam[0]))
    Vk, lk = V[:, :r_phi], lam[:r_phi]
    q = rho[rho > 0] / rho.sum()
    effective_dim = float(np.exp(-np.sum(q * np.log(q))))

    def train_curve(moments):
        if moments is None:
            return None
        Bg, Ag = moments
        proj = Vk.T @ Bg
        return _curve(np.sum(proj * proj, axis=1) / lk, float(np.trace(Ag)), p)

    task = task_moments(st)
    quality = train_curve(task)
    utilization = train_curve(fn)

    test_quality = test_utilization = test_norms = None
    if test is not None:
        if int(test["p"]) != p:
            raise ValueError(f"test state has {test['p']} features, the training state {p}")
        nt = int(test["n"])
        if nt < 2:
            raise ValueError(f"the test state needs at least 2 samples, got n = {nt}")

        def test_curve(moments):
            if moments is None:
                return None
            Bg, Ag = moments
            proj = Vk.T @ Bg
            # <e_k, g_j>_test = v_k^T B_test[:, j] / (n_test sqrt(rho_k)), rho_k from training.
            return _curve(np.sum(proj * proj, axis=1) / (rho[:r_phi] * nt), float(np.trace(Ag)), p)

        test_quality = test_curve(task_moments(test))
        test_utilization = test_curve(function_moments(test, W))
        shift = test["mean"] - (st["mean"] if centered else 0.0)
        second = test["M"] / nt + np.outer(shift, shift)
        norms = np.einsum("ij,ij->j", second @ Vk, Vk) / rho[:r_phi]
        test_norms = np.zeros(p)
        test_norms[:r_phi] = norms

    nc1_value = None
    if st["k"] > 0:
        if precision in NC1_RELIABLE:
            nc1_value = nc1(st, rtol)
        else:
            warnings.append(f"NC1 not reported: {precision} products cannot resolve within-class spread")

    if n < 10 * p:
        warnings.append(f"n = {n} is below 10 p = {10 * p}: DLR is biased toward rich at this sample size")

    return Report(
        dlr=dlr, rank=rank, logit_eigenvalues=logit_eig, n=n, nc1=nc1_value,
        eigenvalues=rho, relative_eigenvalues=rho / rho[0], effective_dim=effective_dim,
        quality=quality, utilization=utilization, test_quality=test_quality,
        test_utilization=test_utilization, test_eigenfunction_norms=test_norms,
        feature_rank=r_phi, rtol=float(rtol), precision=precision, centered=centered,
        warnings=warnings)
