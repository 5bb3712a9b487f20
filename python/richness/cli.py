"""Command line: ``richness demo`` and ``richness info``."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional

import numpy as np


class UserError(Exception):
    """An error in what the user asked for: one line, exit code 2."""


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


def _train_mlp(X, y, Xte, *, width: int, steps: int, train_features: bool, seed: int, lr: float = 0.05):
    """A 2-layer ReLU network, full-batch gradient descent with momentum on
    cross-entropy. train_features=False freezes the first layer (lazy)."""
    rng = np.random.default_rng(seed)
    n, d = X.shape
    k = int(y.max()) + 1
    W1 = rng.normal(size=(d, width)) * np.sqrt(2.0 / d)
    b1 = np.zeros(width)
    W2 = rng.normal(size=(width, k)) * np.sqrt(1.0 / width)
    b2 = np.zeros(k)
    Y = np.eye(k)[y]
    params = [W1, b1, W2, b2]
    vel = [np.zeros_like(q) for q in params]
    for _ in range(steps):
        Z = X @ W1 + b1
        H = np.maximum(Z, 0.0)
        F = H @ W2 + b2
        P = np.exp(F - F.max(axis=1, keepdims=True))
        P /= P.sum(axis=1, keepdims=True)
        G = (P - Y) / n
        gW2, gb2 = H.T @ G, G.sum(0)
        grads = [None, None, gW2, gb2]
        if train_features:
            GZ = (G @ W2.T) * (Z > 0)
            grads[0], grads[1] = X.T @ GZ, GZ.sum(0)
        for i, g in enumerate(grads):
            if g is None:
                continue
            vel[i] = 0.9 * vel[i] - lr * g
            params[i] += vel[i]

    def forward(A):
        H = np.maximum(A @ W1 + b1, 0.0)
        return H, H @ W2 + b2

    return forward, (W2.T, b2)


def demo(args: argparse.Namespace) -> int:
    from . import Moments

    t0 = time.time()
    data = _load_digits(args.seed) or _synthetic(args.seed)
    X, y, source = data
    split = int(0.7 * len(y))
    Xtr, ytr, Xte, yte = X[:split], y[:split], X[split:], y[split:]
    print(f"data: {source}; {len(ytr)} train / {len(yte)} test samples")
    print("network: 64 -> 256 ReLU -> 10, full-batch gradient descent with momentum, cross-entropy\n")
    rows = []
    for name, train_features in (("full training (rich)", True), ("last layer only (lazy)", False)):
        forward, head = _train_mlp(Xtr, ytr, Xte, width=256, steps=args.steps, train_features=train_features,
                                   seed=args.seed)
        Htr, Ftr = forward(Xtr)
        Hte, Fte = forward(Xte)
        m = Moments(num_classes=10)
        m.update(Htr, Ftr, labels=ytr)
        test = Moments(num_classes=10)
        test.update(Hte, Fte, labels=yte)
        rep = m.compute(test=test)
        rep_head = m.compute(head=head)
        assert abs(rep.dlr - rep_head.dlr) < 1e-8
        acc = float((Fte.argmax(1) == yte).mean())
        util_c = rep.utilization[9]
        rows.append((name, rep.dlr, rep.nc1, acc, rep.effective_dim, util_c))
    print(f"{'setting':<24} {'DLR':>7} {'NC1':>8} {'test acc':>9} {'eff. dim':>9} {'Pi_hat(C)':>10}")
    for name, d, nc, acc, eff, u in rows:
        print(f"{name:<24} {d:7.3f} {nc:8.3f} {acc:9.3f} {eff:9.1f} {u:10.3f}")
    print(f"\nDLR: 0 = rich (features collapse onto the learned functions), 1 = lazy (kernel regime).")
    print(f"isotropic reference 1 - sqrt(C/p) = {1 - np.sqrt(10 / 256):.3f}; done in {time.time() - t0:.1f} s")
    return 0


def info(args: argparse.Namespace) -> int:
    from . import __version__, _core

    print(f"richness {__version__}")
    print(f"CPU backend: {_core.blas_info()}")
    try:
        from . import _cuda  # noqa: F401

        print(f"CUDA backend: {_cuda.info()}")
    except ImportError as e:
        print(f"CUDA backend: not available ({e})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="richness", description="Measure how rich or lazy training was (DLR).")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="rich vs lazy networks on built-in data, with a DLR table")
    d.add_argument("--steps", type=int, default=400, help="training steps per network")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=demo)
    i = sub.add_parser("info", help="version and backends")
    i.set_defaults(func=info)
    return p


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        print(f"richness: error: {e}", file=sys.stderr)
        return 2
