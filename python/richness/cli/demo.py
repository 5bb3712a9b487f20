"""``richness demo``: rich and lazy networks trained on built-in data (scikit-learn's digits, or
generated clusters without scikit-learn), their DLR, NC1 and curves, and a target-downscaled sweep."""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from . import UserError

__all__ = []

# The sweep's alphas scale the targets by 1/alpha. Below about 0.03 the SGD
# step (lr 0.05) on targets that large kills every ReLU (alpha 0.01: constant
# features); above 1000 the network no longer moves (DLR at 100 and 1000 agree).
ALPHA_RANGE = (0.05, 1e3)


def _load_digits(seed: int):
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        return None
    d = load_digits()
    X = d.data.astype(np.float64) / 16.0
    y = d.target.astype(np.int64)
    idx = np.random.default_rng(seed).permutation(len(y))
    return X[idx], y[idx], "scikit-learn digits (1,797 real 8x8 images)"


def _synthetic(seed: int):
    rng = np.random.default_rng(seed)
    n, d, k = 2000, 64, 10
    centers = rng.normal(size=(k, d)) * 0.6
    y = rng.integers(0, k, n)
    X = centers[y] + rng.normal(size=(n, d))
    return X, y, "generated Gaussian clusters (scikit-learn not installed)"


def _train_mlp(X, y, *, width: int, epochs: int, train_features: bool, seed: int, lr: float = 0.05,
               batch: int = 128, tick=None):
    """A ReLU network with two hidden layers (d -> width -> width -> classes) on
    standardised inputs, minibatch SGD with momentum on cross-entropy, float32.
    train_features=False freezes everything but the head at initialisation
    (lazy). (Full-batch training of one hidden layer on digits barely moved
    the features: DLR 0.256 rich vs 0.258 lazy.)"""
    rng = np.random.default_rng(seed)
    shift, scale = X.mean(0), X.std(0) + 1e-8
    Xs = ((X - shift) / scale).astype(np.float32)
    n, d = Xs.shape
    k = int(y.max()) + 1
    dims = [d, width, width, k]
    Ws = [(rng.normal(size=(i, o)) * np.sqrt(2.0 / i)).astype(np.float32) for i, o in zip(dims[:-1], dims[1:])]
    Ws[-1] *= np.float32(np.sqrt(0.5))
    bs = [np.zeros(o, np.float32) for o in dims[1:]]
    params = Ws + bs
    vel = [np.zeros_like(q) for q in params]
    Y = np.eye(k, dtype=np.float32)[y]
    L = len(Ws)
    trained = range(L) if train_features else [L - 1]
    for _ in range(epochs):
        perm = rng.permutation(n)
        for s0 in range(0, n, batch):
            idx = perm[s0:s0 + batch]
            acts, pre = [Xs[idx]], []
            for layer in range(L):
                z = acts[-1] @ Ws[layer] + bs[layer]
                pre.append(z)
                acts.append(np.maximum(z, 0.0) if layer < L - 1 else z)
            P = np.exp(acts[-1] - acts[-1].max(axis=1, keepdims=True))
            P /= P.sum(axis=1, keepdims=True)
            G = (P - Y[idx]) / len(idx)
            grads = {}
            for layer in range(L - 1, -1, -1):
                grads[layer] = (acts[layer].T @ G, G.sum(0))
                if layer == min(trained):
                    break
                G = (G @ Ws[layer].T) * (pre[layer - 1] > 0)
            for layer in trained:
                for i, g in ((layer, grads[layer][0]), (L + layer, grads[layer][1])):
                    vel[i] = 0.9 * vel[i] - lr * g
                    params[i] += vel[i]
        if tick is not None:
            tick(1)

    W64 = [w.astype(np.float64) for w in Ws]
    b64 = [v.astype(np.float64) for v in bs]

    def forward(A):
        H = (np.asarray(A, dtype=np.float64) - shift) / scale
        for layer in range(L - 1):
            H = np.maximum(H @ W64[layer] + b64[layer], 0.0)
        return H, H @ W64[-1] + b64[-1]

    return forward, (W64[-1].T, b64[-1])


def _train_mse(X, y, *, alpha: float, width: int, steps: int, seed: int, lr: float = 0.05, tick=None):
    """Target-downscaled training (Chizat et al.'s laziness knob): squared error
    toward centered one-hot targets divided by ``alpha``, on the change of the
    network since initialisation, f - f_0. Larger alpha: the weights need to
    move less, training is lazier. Returns forward(A) -> (features, f - f_0)."""
    rng = np.random.default_rng(seed)
    n, d = X.shape
    k = int(y.max()) + 1
    P0 = [(rng.normal(size=(d, width)) * np.sqrt(2.0 / d)).astype(np.float32), np.zeros(width, np.float32),
          (rng.normal(size=(width, k)) * np.sqrt(1.0 / width)).astype(np.float32), np.zeros(k, np.float32)]
    P = [q.copy() for q in P0]
    Y = ((np.eye(k)[y] - 1.0 / k) / alpha).astype(np.float32)
    Xf = X.astype(np.float32)  # float32 training; forward() below evaluates in float64

    def net(A, Q):
        H = np.maximum(A @ Q[0] + Q[1], 0.0)
        return H, H @ Q[2] + Q[3]

    F0 = net(Xf, P0)[1]
    vel = [np.zeros_like(q) for q in P]
    for step in range(steps):
        Z = Xf @ P[0] + P[1]
        H = np.maximum(Z, 0.0)
        G = (H @ P[2] + P[3] - F0 - Y) / n
        GZ = (G @ P[2].T) * (Z > 0)
        for i, g in enumerate((Xf.T @ GZ, GZ.sum(0), H.T @ G, G.sum(0))):
            vel[i] = 0.9 * vel[i] - lr * g
            P[i] += vel[i]
        if tick is not None and (step + 1) % 10 == 0:
            tick(10)

    def forward(A):
        A = np.asarray(A, dtype=np.float64)
        H, F = net(A, [q.astype(np.float64) for q in P])
        return H, F - net(A, [q.astype(np.float64) for q in P0])[1]

    return forward


def _measure(forward, Xtr, ytr, Xte, yte):
    from .. import Moments

    Htr, Ftr = forward(Xtr)
    Hte, Fte = forward(Xte)
    m = Moments(num_classes=10)
    m.update(Htr, Ftr, labels=ytr)
    test = Moments(num_classes=10)
    test.update(Hte, Fte, labels=yte)
    return m.compute(test=test), float((Fte.argmax(1) == yte).mean())


def _demo_bar(total: int, desc: str, unit: str, enabled: bool):
    """A tqdm bar on stderr (nothing when tqdm is missing or progress is off)."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True, file=sys.stderr)


def _with_bar(fn, total: int, desc: str, unit: str, enabled: bool, **kw):
    bar = _demo_bar(total, desc, unit, enabled)
    try:
        return fn(**kw, tick=bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()


def demo(args: argparse.Namespace) -> int:
    from .. import Moments

    t0 = time.time()
    alphas = args.alphas
    progress = not args.no_progress
    data = _load_digits(args.seed) or _synthetic(args.seed)
    X, y, source = data
    split = int(0.7 * len(y))
    Xtr, ytr, Xte, yte = X[:split], y[:split], X[split:], y[split:]
    print(f"data: {source}; {len(ytr)} train / {len(yte)} test samples")
    print("network: 64 -> 256 -> 256 -> 10 ReLU, minibatch SGD with momentum, cross-entropy; "
          "lazy = only the head trained")
    if args.no_plots:
        print("plots: off (--no-plots)\n")
    else:
        print(f"plots go to {os.path.join(args.out, '')} (curves.png/.svg, sweep.png/.svg; --out to change)\n")
    rows, reports = [], {}
    for name, train_features in (("full training (rich)", True), ("last layer only (lazy)", False)):
        forward, head = _with_bar(_train_mlp, args.epochs, name, "epoch", progress, X=Xtr, y=ytr, width=256,
                                  epochs=args.epochs, train_features=train_features, seed=args.seed)
        rep, acc = _measure(forward, Xtr, ytr, Xte, yte)
        Htr, _ = forward(Xtr)
        mh = Moments(num_classes=10)
        mh.update(Htr, labels=ytr)
        assert abs(rep.dlr - mh.compute(head_weights=head).dlr) < 1e-8  # linear head: streamed == shortcut
        reports[name] = rep
        rows.append((name, rep.dlr, rep.dlr_normalized, rep.nc1, acc, rep.effective_dim, rep.utilization[9]))
    print(f"{'setting':<24} {'DLR':>7} {'DLR/iso':>8} {'NC1':>8} {'test acc':>9} {'eff. dim':>9} {'Pi_hat(C)':>10}")
    for name, d, dn, nc, acc, eff, u in rows:
        print(f"{name:<24} {d:7.3f} {dn:8.3f} {nc:8.3f} {acc:9.3f} {eff:9.1f} {u:10.3f}")
    print("how to read: DLR 0 = rich (features collapse onto the learned functions), 1 = lazy (kernel regime);")
    print(f"  DLR/iso 1 = as lazy as isotropic features (DLR {1 - np.sqrt(10 / 256):.3f} as n grows); "
          "NC1 lower = classes more collapsed (docs/READING_DLR.md)")

    sweep = []
    if alphas:
        print("\ntarget-downscaled sweep: squared error toward y / alpha on f - f_0 (larger alpha = lazier)")
        print(f"{'alpha':>8} {'DLR':>7} {'NC1':>8} {'test acc':>9} {'eff. dim':>9}")
        for a in alphas:
            forward = _with_bar(_train_mse, args.steps, f"alpha {a:g}", "step", progress, X=Xtr, y=ytr, alpha=a,
                                width=256, steps=args.steps, seed=args.seed)
            rep, acc = _measure(forward, Xtr, ytr, Xte, yte)
            sweep.append((a, rep.dlr, rep.nc1, acc, rep.dlr_isotropic))
            print(f"{a:8g} {rep.dlr:7.3f} {rep.nc1:8.3f} {acc:9.3f} {rep.effective_dim:9.1f}")
    if not args.no_plots:
        try:
            from .. import plot

            paths = plot.curves(reports, os.path.join(args.out, "curves"),
                                title="digits, 64-256-256-10 MLP: rich vs lazy (dashed: held-out)")
            if sweep:
                a, d, nc, acc, iso = zip(*sweep)
                dlr_name = "DLR (0 = rich, 1 = lazy)"
                paths += plot.sweep(a, {dlr_name: d, "NC1": nc, "test accuracy": acc},
                                    os.path.join(args.out, "sweep"), xlabel="alpha (targets y / alpha)",
                                    title="target-downscaled sweep", references={dlr_name: iso})
            print("\nplots: " + ", ".join(paths))
        except ImportError as e:
            print(f"\nplots skipped: {e}")
        except OSError as e:
            raise UserError(f"{args.out}: cannot write the plots ({e.strerror or e})") from None
    print(f"done in {time.time() - t0:.1f} s")
    return 0
