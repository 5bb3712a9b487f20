"""Independent float64 oracles written from the n x n formulas of docs/MATH.md ("Finite-sample form").

Nothing here imports richness: these are the numbers the package must match.
"""

import numpy as np


def _pin_numpy_blas():
    """One thread for numpy's own BLAS: the oracle's matrices are small, and two
    spinning BLAS thread pools (numpy's and the package's) on a 2-core machine
    starve each other (a 0.01 s reference took 1 s). The package's BLAS is left alone."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # threadpoolctl comes with scikit-learn (test extras)
        return
    for lib in ThreadpoolController().lib_controllers:
        if "numpy" in lib.filepath:
            lib.set_num_threads(1)


_pin_numpy_blas()


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


def dlr_thin(Phi, F, rtol=1e-10):
    """The same n x n DLR as dlr_naive, for large n without forming n x n matrices:
    <K, P>_F = ||Q^T Phi_c||_F^2 with Q an orthonormal basis of span(H F) (thin SVD
    of the n x C matrix), ||K||_F = ||Phi_c^T Phi_c||_F (the nonzero spectrum of
    Phi_c Phi_c^T equals that of Phi_c^T Phi_c)."""
    Pc = center_rows(Phi)
    U, s, _ = np.linalg.svd(center_rows(F), full_matrices=False)
    keep = s**2 > rtol * s[0] ** 2
    Q = U[:, keep]
    r = int(keep.sum())
    inner = np.sum((Q.T @ Pc) ** 2)
    return 1.0 - inner / (np.linalg.norm(Pc.T @ Pc) * np.sqrt(r)), r


def spectrum_uncentered_naive(Phi, rtol=1e-10):
    """The paper's v1 operator: eigenpairs of Sigma_u = Phi^T Phi / n (no centering), descending."""
    Phi = np.asarray(Phi, dtype=np.float64)
    n = Phi.shape[0]
    rho, V = np.linalg.eigh(Phi.T @ Phi / n)
    rho, V = rho[::-1], V[:, ::-1]
    keep = rho > rtol * rho[0]
    return rho, V, int(keep.sum())


def effective_dim_naive(rho):
    """exp(-sum q log q), q = rho / sum rho (zero eigenvalues contribute nothing)."""
    rho = np.clip(np.asarray(rho, dtype=np.float64), 0.0, None)
    q = rho / rho.sum()
    q = q[q > 0]
    return float(np.exp(-np.sum(q * np.log(q))))


def pad_curve(curve, p):
    """A curve over the kept eigenfunctions, extended flat to all p (Report curves have length p)."""
    out = np.empty(p)
    out[: len(curve)] = curve
    out[len(curve):] = curve[-1]
    return out


def simplex_etf(K, p, rng, scale=1.0):
    """K class means on a simplex equiangular tight frame in R^p (p >= K), randomly rotated."""
    Q, _ = np.linalg.qr(rng.normal(size=(p, p)))
    E = np.eye(K) - 1.0 / K
    return scale * E @ Q[:K] * np.sqrt(K / (K - 1.0))


# -- test helpers (no richness import) -------------------------------------------

def states_equal(a, b):
    """Exact equality of two state dicts (arrays compared bit for bit by value)."""
    if set(a) != set(b):
        return False
    for k in a:
        va, vb = a[k], b[k]
        if isinstance(va, np.ndarray) or isinstance(vb, np.ndarray):
            va, vb = np.asarray(va), np.asarray(vb)
            if va.shape != vb.shape or va.dtype != vb.dtype or not np.array_equal(va, vb):
                return False
        elif va != vb:
            return False
    return True


# -- representation diagnostics, from the raw matrices ----------------------------

def rankme_naive(Phi, centered=True, rtol=0.0):
    """RankMe (Garrido et al. 2023): exp of the entropy of q_k = s_k / sum s, s the
    singular values of the (centered) feature matrix, by SVD; singular values with
    s^2 <= rtol s_1^2 count as 0."""
    X = center_rows(Phi) if centered else np.asarray(Phi, dtype=np.float64)
    s = np.linalg.svd(X, compute_uv=False)
    s = s[s**2 > rtol * s[0] ** 2]
    q = s / s.sum()
    q = q[q > 0]
    return float(np.exp(-np.sum(q * np.log(q))))


def alpha_req_naive(Phi, rtol):
    """alpha-ReQ (Agrawal et al. 2022): minus the least-squares slope of log lambda_k
    against log k, k = 1..K, lambda_k = s_k^2 of the centered matrix above the cut."""
    s = np.linalg.svd(center_rows(Phi), compute_uv=False)
    lam = s**2
    lam = lam[lam > rtol * lam[0]]
    k = np.arange(1, lam.size + 1)
    slope = np.polyfit(np.log(k), np.log(lam), 1)[0]
    return float(-slope), int(lam.size)


def participation_ratio_naive(Phi):
    """(sum lambda)^2 / sum lambda^2 = tr(C)^2 / ||C||_F^2 of the covariance C."""
    Xc = center_rows(Phi)
    C = Xc.T @ Xc
    return float(np.trace(C) ** 2 / np.sum(C * C))


def centered_class_means(Phi, y):
    """Class means of the classes present minus the global (sample-weighted) mean, rows in class order."""
    Phi = np.asarray(Phi, dtype=np.float64)
    mu = Phi.mean(axis=0)
    return np.stack([Phi[y == c].mean(axis=0) - mu for c in np.unique(y)]), np.unique(y)


def nc2_naive(Phi, y):
    """(equinorm, equiangle) of Papyan et al. 2020 by a loop over class pairs."""
    U, _ = centered_class_means(Phi, y)
    norms = np.linalg.norm(U, axis=1)
    C = U.shape[0]
    terms = [abs(U[i] @ U[j] / (norms[i] * norms[j]) + 1.0 / (C - 1))
             for i in range(C) for j in range(i + 1, C)]
    return float(norms.std() / norms.mean()), float(np.mean(terms))


def nc3_naive(Phi, y, W):
    """|| W / ||W||_F - U / ||U||_F ||_F^2, W's rows of the classes present."""
    U, classes = centered_class_means(Phi, y)
    Wc = np.asarray(W, dtype=np.float64)[classes]
    return float(np.sum((Wc / np.linalg.norm(Wc) - U / np.linalg.norm(U)) ** 2))


def cka_naive(X, Y):
    """Biased linear CKA from the n x n centred Grams: <HKH, HLH>_F / (||HKH||_F ||HLH||_F), K = X X^T."""
    X, Y = np.asarray(X, np.float64), np.asarray(Y, np.float64)
    n = X.shape[0]
    H = np.eye(n) - 1.0 / n
    Kc, Lc = H @ (X @ X.T) @ H, H @ (Y @ Y.T) @ H
    return float(np.sum(Kc * Lc) / (np.linalg.norm(Kc) * np.linalg.norm(Lc)))


def hsic_unbiased_naive(K, L):
    """Song et al. (2012) unbiased HSIC of two n x n Grams, their diagonals zeroed."""
    n = K.shape[0]
    Kt, Lt = K - np.diag(np.diag(K)), L - np.diag(np.diag(L))
    one = np.ones(n)
    return float((np.sum(Kt * Lt) + (one @ Kt @ one) * (one @ Lt @ one) / ((n - 1) * (n - 2))
                  - 2.0 / (n - 2) * (one @ Kt @ Lt @ one)) / (n * (n - 3)))


def cka_debiased_naive(X, Y, center=True):
    """Debiased linear CKA: HSIC_u(K, L) / sqrt(HSIC_u(K, K) HSIC_u(L, L)) on n x n
    Grams K = X X^T. The estimator is unchanged by shifting X or Y by a constant
    row; ``center`` subtracts the column means first (for data far from the
    origin, where the raw Grams would lose float64 digits)."""
    X, Y = np.asarray(X, np.float64), np.asarray(Y, np.float64)
    if center:
        X, Y = X - X.mean(0), Y - Y.mean(0)
    K, L = X @ X.T, Y @ Y.T
    return hsic_unbiased_naive(K, L) / np.sqrt(hsic_unbiased_naive(K, K) * hsic_unbiased_naive(L, L))
