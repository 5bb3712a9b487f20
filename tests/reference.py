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
    """Exact equality of two state dicts (arrays compared bit for bit by value;
    nested dicts and lists, as a grouped state's ``groups`` entry, entry by entry)."""
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(states_equal(x, y) for x, y in zip(a, b)))
    if not isinstance(a, dict) or not isinstance(b, dict):
        return states_equal({"": a}, {"": b})
    if set(a) != set(b):
        return False
    for k in a:
        va, vb = a[k], b[k]
        if isinstance(va, (dict, list, tuple)) or isinstance(vb, (dict, list, tuple)):
            if not states_equal(va, vb):
                return False
        elif isinstance(va, np.ndarray) or isinstance(vb, np.ndarray):
            va, vb = np.asarray(va), np.asarray(vb)
            if va.shape != vb.shape or va.dtype != vb.dtype or not np.array_equal(va, vb):
                return False
        elif va != vb:
            return False
    return True


# -- representation diagnostics, from the raw matrices ----------------------------

def rankme_naive(Phi, eps=1e-7):
    """RankMe as published (Garrido et al. 2023, eq. 1): exp(-sum_k p_k log p_k) with
    p_k = s_k / ||s||_1 + eps, s the min(n, p) singular values of the embedding matrix
    AS GIVEN (not centered), by SVD; every singular value counts."""
    s = np.linalg.svd(np.asarray(Phi, dtype=np.float64), compute_uv=False)
    q = s / s.sum() + eps
    return float(np.exp(-np.sum(q * np.log(q))))


def rankme_centered_naive(Phi, rtol=0.0):
    """The centered variant the package reported before: exp of the entropy of s_k / sum s,
    s the singular values of the CENTERED matrix above the rank cut, no epsilon."""
    s = np.linalg.svd(center_rows(Phi), compute_uv=False)
    s = s[s**2 > rtol * s[0] ** 2]
    q = s / s.sum()
    q = q[q > 0]
    return float(np.exp(-np.sum(q * np.log(q))))


def alpha_req_naive(Phi, rtol=1e-10, first=11, last=100, weighted=True, floor=1e-2):
    """alpha-ReQ as the authors' code fits it (Agrawal et al. 2022; reptrix.alpha.get_powerlaw):
    lambda_k = s_k^2 of the centered matrix by SVD; weighted least squares (lstsq on rows
    scaled by sqrt(w), w = 1/k) of log lambda_k on (-log k, 1) over k = first..last, clipped to
    the eigenvalues above floor * rtol * lambda_1. Returns (alpha, R^2 as sklearn's r2_score of
    log lambda against the fitted line over those k, their count)."""
    s = np.linalg.svd(center_rows(Phi), compute_uv=False)
    lam = s**2
    k = np.arange(1, lam.size + 1)
    top = lam.size if last is None else last
    sel = (k >= first) & (k <= top) & (lam > floor * rtol * lam[0])
    kk, y = k[sel].astype(np.float64), np.log(lam[sel])
    if kk.size < 2:
        return None, None, int(kk.size)
    X = np.stack([-np.log(kk), np.ones_like(kk)], axis=1)
    w = 1.0 / kk if weighted else np.ones_like(kk)
    b = np.linalg.lstsq(X * np.sqrt(w)[:, None], y * np.sqrt(w), rcond=None)[0]
    yhat = X @ b
    r2 = 1.0 - np.sum((y - yhat) ** 2) / np.sum((y - y.mean()) ** 2)
    return float(b[0]), float(r2), int(kk.size)


def reptrix_powerlaw(eigen, first=11, last=100):
    """reptrix.alpha.get_powerlaw's fit written out from its code (reptrix 0.1.0): trange =
    np.arange(first - 1, last) indexes the eigenvalues; the normal equations solved with
    weights 1 / k in float32; R^2 of log |eigen| against log ypred over its indices
    trange[0] + 1 .. 99 (its `trange += 1` shifts the start: k = first + 1 .. 100). Returns
    (alpha, ypred, fit_R2_100)."""
    eigen = np.asarray(eigen, dtype=np.float64)
    logss = np.log(np.abs(eigen))
    trange = np.arange(first - 1, last)
    y = logss[trange][:, None]
    kr = trange + 1
    x = np.stack([-np.log(kr), np.ones(kr.size)], axis=1)
    w = (1.0 / kr.astype(np.float32))[:, None]
    b = np.linalg.solve(x.T @ (x * w), (w * x).T @ y).ravel()
    allk = np.arange(1, eigen.size + 1)
    ypred = np.exp(-np.log(allk) * b[0] + b[1])
    yt, yp = logss[kr[0]:100], np.log(np.abs(ypred))[kr[0]:100]
    r2_100 = 1.0 - np.sum((yt - yp) ** 2) / np.sum((yt - yt.mean()) ** 2)
    return float(b[0]), ypred, float(r2_100)


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


def nc_script_naive(Phi, y, W, C=None):
    """NC1, NC2 (equinorm, equiangle) and NC3 as the widely copied neural-collapse measurement
    script computes them (Papyan, Han and Donoho's published code): class means mu_c; muG the
    MEAN OF THE CLASS MEANS; M_ = mu_c - muG; Sw = sum_i (h_i - mu_c)(h_i - mu_c)^T / N;
    Sb = M_^T M_ / C; NC1 = tr(Sw Sb^+) with Sb^+ over Sb's top C - 1 singular pairs (svds,
    k = C - 1), NOT divided by C; equinorm = std(||M_c||, ddof=1) / mean; equiangle =
    sum_{c != c'} |cos + 1 / (C - 1)| / (C (C - 1)); NC3 = || W / ||W||_F - M_ / ||M_||_F ||_F^2."""
    Phi = np.asarray(Phi, dtype=np.float64)
    classes = np.unique(y)
    C = classes.size
    means = np.stack([Phi[y == c].mean(axis=0) for c in classes])
    M_ = means - means.mean(axis=0)
    Sw = sum((Phi[y == c] - means[i]).T @ (Phi[y == c] - means[i]) for i, c in enumerate(classes)) / len(y)
    Sb = M_.T @ M_ / C
    U, sv, _ = np.linalg.svd(Sb)
    inv_Sb = U[:, :C - 1] @ np.diag(1.0 / sv[:C - 1]) @ U[:, :C - 1].T
    nc1 = float(np.trace(Sw @ inv_Sb))
    norms = np.linalg.norm(M_, axis=1)
    equinorm = float(np.std(norms, ddof=1) / norms.mean())
    V = M_ / norms[:, None]
    G = V @ V.T + 1.0 / (C - 1)
    G -= np.diag(np.diag(G))
    equiangle = float(np.abs(G).sum() / (C * (C - 1)))
    Wc = np.asarray(W, dtype=np.float64)[classes]
    nc3 = float(np.sum((Wc / np.linalg.norm(Wc) - M_ / np.linalg.norm(M_)) ** 2))
    return {"nc1": nc1, "nc2_equinorm": equinorm, "nc2_equiangle": equiangle, "nc3": nc3}
