"""Independent float64 oracles written from SPEC.md's n x n formulas.

Nothing here imports richness: these are the numbers the package must match.
"""

import numpy as np


def center_rows(X):
    X = np.asarray(X, dtype=np.float64)
    return X - X.mean(axis=0, keepdims=True)


def projector(F, rtol):
    """Projector onto span(H F) (n x n), rank by the eigenvalue cut of A = F_c^T F_c."""
    Fc = center_rows(F)
    # Orthonormal basis of the centered output span via SVD: singular values
    # squared are A's eigenvalues, so the same cut applies.
    U, s, _ = np.linalg.svd(Fc, full_matrices=False)
    keep = s**2 > rtol * s[0] ** 2
    Q = U[:, keep]
    return Q @ Q.T, int(keep.sum())


def dlr_naive(Phi, F, rtol=1e-10):
    """DLR = 1 - <K, P>_F / (||K||_F ||P||_F) with K = H Phi Phi^T H (n x n)."""
    Pc = center_rows(Phi)
    K = Pc @ Pc.T
    P, r = projector(F, rtol)
    return 1.0 - np.sum(K * P) / (np.linalg.norm(K) * np.linalg.norm(P)), r


def spectrum_naive(Phi, rtol=1e-10):
    """Eigenpairs of Sigma = Phi_c^T Phi_c / n, descending, with the cut."""
    Pc = center_rows(Phi)
    n = Pc.shape[0]
    rho, V = np.linalg.eigh(Pc.T @ Pc / n)
    rho, V = rho[::-1], V[:, ::-1]
    keep = rho > rtol * rho[0]
    return rho, V, int(keep.sum())


def eigenfunctions(Phi, mu, V, rho):
    """e_k(x) = (phi(x) - mu)^T v_k / sqrt(rho_k), evaluated on the rows of Phi (n x r)."""
    return (np.asarray(Phi, dtype=np.float64) - mu) @ V / np.sqrt(rho)


def cumulative_curve(E, G):
    """Pi_g(k) from explicit eigenfunction values E (n x r) and function values G (n x m):
    <e_k, g_j> = mean_i e_k(x_i) (g_j(x_i) - mean g_j), ||g_j||^2 = mean (g_j - mean)^2."""
    Gc = center_rows(G)
    n = Gc.shape[0]
    inner = E.T @ Gc / n  # r x m
    norms = np.sum(Gc * Gc) / n
    return np.cumsum(np.sum(inner**2, axis=1) / norms)


def one_hot(y, k):
    return np.eye(k)[np.asarray(y)]


def nc1_naive(Phi, y, rtol=1e-10):
    """NC1 = tr(Sigma_W Sigma_B^+) / K, Papyan et al., loop over classes."""
    Phi = np.asarray(Phi, dtype=np.float64)
    mu = Phi.mean(axis=0)
    classes = np.unique(y)
    K = len(classes)
    p = Phi.shape[1]
    SW = np.zeros((p, p))
    SB = np.zeros((p, p))
    for c in classes:
        Xc = Phi[y == c]
        m = Xc.mean(axis=0)
        D = Xc - m
        SW += D.T @ D
        SB += np.outer(m - mu, m - mu)
    SW /= Phi.shape[0]
    SB /= K
    w, U = np.linalg.eigh(SB)
    keep = w > rtol * w.max()
    SBp = (U[:, keep] / w[keep]) @ U[:, keep].T
    return max(np.trace(SW @ SBp) / K, 0.0)
