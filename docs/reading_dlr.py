"""Numbers for docs/READING_DLR.md: the four ways a raw DLR is misread.

    python docs/reading_dlr.py            # about a minute on 2 cores

Everything is generated data except the last section (scikit-learn digits).
"""

from __future__ import annotations

import time

import numpy as np

import richness
from richness.finish import isotropic_dlr


def isotropic(n, p, C, rng):
    X = rng.normal(size=(n, p))
    W = rng.normal(size=(C, p))
    m = richness.Moments()
    m.update(X)
    return m.compute(head=(W, None))


def finite_samples(rng):
    print("## 1. Finite samples: isotropic features, p = 512, C = 10 (lazy end 1 - sqrt(C/p) = 0.860)\n")
    print("| n | n / p | measured DLR (mean of 3) | isotropic reference | normalised |")
    print("|---|---|---|---|---|")
    for n in (128, 512, 2048, 8192, 32768):
        reps = [isotropic(n, 512, 10, rng) for _ in range(3)]
        d = np.mean([r.dlr for r in reps])
        print(f"| {n} | {n / 512:g} | {d:.3f} | {reps[0].dlr_isotropic:.3f} | "
              f"{np.mean([r.dlr_normalized for r in reps]):.3f} |")
    print()


def comparable_scale(rng):
    print("## 2. The lazy end depends on p and C: isotropic features, n = 20 p\n")
    print("| p | C | raw DLR | 1 - sqrt(C/p) | normalised |")
    print("|---|---|---|---|---|")
    for p, C in ((64, 10), (512, 10), (512, 100), (2048, 1000)):
        r = isotropic(20 * p, p, C, rng)
        print(f"| {p} | {C} | {r.dlr:.3f} | {1 - np.sqrt(C / p):.3f} | {r.dlr_normalized:.3f} |")
    print()


def error_bars(rng):
    print("## 3. Error bars: jackknife over 10 groups vs the spread over 50 independent draws\n")
    p, C, n = 32, 4, 4000
    L = rng.normal(size=(p, p)) / np.sqrt(p)
    W = rng.normal(size=(C, p))
    vals, ses = [], []
    for _ in range(50):
        m = richness.Moments(groups=10)
        for _ in range(20):
            X = rng.normal(size=(n // 20, p)) @ L
            m.update(X, X @ W.T)
        r = m.compute(uncertainty=True)
        vals.append(r.dlr)
        ses.append(r.dlr_stderr)
    print(f"p = {p}, C = {C}, n = {n}: spread of DLR over draws {np.std(vals):.4f}; "
          f"mean jackknife SE {np.mean(ses):.4f}; last draw: DLR {r.dlr:.4f}, "
          f"95% interval [{r.dlr_interval[0]:.4f}, {r.dlr_interval[1]:.4f}]\n")


def rank_cut(rng):
    print("## 4. The rank cut: a near-duplicate logit\n")
    X = rng.normal(size=(5000, 64))
    W = rng.normal(size=(9, 64))
    F = X @ W.T
    print("| extra logit = logit 0 + eps * noise | rank | DLR | DLR at rtol/10 .. rtol*10 | warning |")
    print("|---|---|---|---|---|")
    for eps in (1e-2, 1e-5, 3e-6, 0.0):
        G = np.column_stack([F, F[:, 0] + eps * F.std() * rng.normal(size=len(F))])
        m = richness.Moments()
        m.update(X, G)
        r = m.compute()
        lo, hi = r.dlr_rtol_range
        warn = "yes" if any("rank cut" in w for w in r.warnings) else "no"
        print(f"| eps = {eps:g} | {r.rank} | {r.dlr:.4f} | {lo:.4f} .. {hi:.4f} | {warn} |")
    print()


def real_model(rng):
    try:
        from sklearn.datasets import load_digits
        from sklearn.neural_network import MLPClassifier
    except ImportError:
        print("## 5. (scikit-learn not installed: real-model section skipped)\n")
        return
    print("## 5. A real model: scikit-learn digits, MLP 64-256-10 (Adam, 300 epochs)\n")
    d = load_digits()
    X, y = d.data / 16.0, d.target
    idx = rng.permutation(len(y))
    X, y = X[idx], y[idx]
    clf = MLPClassifier(hidden_layer_sizes=(256,), max_iter=300, random_state=0).fit(X[:1200], y[:1200])
    H = np.maximum(X @ clf.coefs_[0] + clf.intercepts_[0], 0.0)
    m = richness.Moments(num_classes=10, groups=10)
    for chunk in np.array_split(np.arange(len(y)), 20):
        m.update(H[chunk], labels=y[chunk])
    r = m.compute(head=(clf.coefs_[1].T, clf.intercepts_[1]), uncertainty=True)
    print(f"n = {r.n}, p = 256, C = 10: DLR {r.dlr:.3f} +- {r.dlr_stderr:.3f} (jackknife), "
          f"isotropic reference {r.dlr_isotropic:.3f}, normalised {r.dlr_normalized:.3f}, "
          f"NC1 {r.nc1:.3f}, Pi_hat(C) {r.utilization[9]:.3f}")
    for w in r.warnings:
        print(f"- warning: {w}")
    print()


def main() -> None:
    rng = np.random.default_rng(0)
    t0 = time.time()
    finite_samples(rng)
    comparable_scale(rng)
    error_bars(rng)
    rank_cut(rng)
    real_model(rng)
    print(f"({time.time() - t0:.0f} s)")
    assert abs(isotropic_dlr(10**9, 512, 10) - (1 - np.sqrt(10 / 512))) < 1e-4


if __name__ == "__main__":
    main()
