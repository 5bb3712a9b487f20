"""Linear CKA: richness.Similarity against ckatorch on the same data, side by side.

    python benchmarks/bench_cka.py [--quick] [--top-n N] [--json out.json]

1. The value against the exact float64 value as the batch size varies: ours
   streamed in batches of 64 / 256 / 1024 against ckatorch's minibatch CKA
   (cka_batch, HSIC_1 of Nguyen et al.) at the same batches, over shufflings.
2. Time and peak memory against n at 4 representations of width 256: ours
   streamed (each n in a fresh subprocess, peak resident set from VmHWM: ru_maxrss keeps the parent's peak across fork + exec), ckatorch's
   exact n x n route (cka_base) for one pair.
3. Targets at n = 65,536, 4 representations of width 512: ours against
   ckatorch's minibatch CKA at batch 1024 (all 6 pairs), and our error against
   the exact float64 value (cross-covariances of the centred data in numpy).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import print_and_save, proc_status_mb  # noqa: E402


def data(n: int, widths, seed: int = 0, dtype=np.float32):
    """Representations of the same samples sharing a 16-dimensional signal."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, 16))
    out = []
    for i, w in enumerate(widths):
        mix = rng.standard_normal((16, w)) / 4.0
        out.append((z @ mix + rng.standard_normal((n, w)) + 0.5 * i).astype(dtype))
    return out


def exact_pairs(xs):
    """Exact biased CKA of every pair: float64 cross-covariances of the centred data."""
    cs = [x.astype(np.float64) - x.astype(np.float64).mean(0) for x in xs]
    k = len(cs)
    out = np.eye(k)
    fro = [np.linalg.norm(c.T @ c) for c in cs]
    for i in range(k):
        for j in range(i + 1, k):
            out[i, j] = out[j, i] = np.linalg.norm(cs[i].T @ cs[j]) ** 2 / (fro[i] * fro[j])
    return out


def exact_debiased(x, y) -> float:
    """Exact debiased CKA of all n rows from the data itself (float64; docs/MATH.md):
    tr(K~L~) = ||Xc^T Yc||^2 - k.l, 1'K~1 = -||Xc||^2, 1'K~L~1 = k.l, k_i = ||x_i - mu||^2."""
    def hsic(a, b):
        n = a.shape[0]
        ka, kb = np.einsum("ij,ij->i", a, a), np.einsum("ij,ij->i", b, b)
        s = ka @ kb
        return (np.linalg.norm(a.T @ b) ** 2 - s + ka.sum() * kb.sum() / ((n - 1) * (n - 2))
                - 2.0 / (n - 2) * s) / (n * (n - 3))
    xc, yc = x.astype(np.float64) - x.astype(np.float64).mean(0), y.astype(np.float64) - y.astype(np.float64).mean(0)
    return float(hsic(xc, yc) / np.sqrt(hsic(xc, xc) * hsic(yc, yc)))


def ours(xs, batch: int, precision=None):
    import richness

    s = richness.Similarity(precision=precision)
    n = xs[0].shape[0]
    for a in range(0, n, batch):
        s.update({f"r{i}": x[a:a + batch] for i, x in enumerate(xs)})
    return s.compute()


def ckatorch_batch(x, y, batch: int) -> float:
    import torch
    from ckatorch.core import cka_batch

    k = x.shape[0] // batch
    xt = torch.from_numpy(x[:k * batch]).reshape(k, batch, -1)
    yt = torch.from_numpy(y[:k * batch]).reshape(k, batch, -1)
    return float(cka_batch(xt, yt))


def ckatorch_exact(x, y) -> float:
    import torch
    from ckatorch.core import cka_base

    return float(cka_base(torch.from_numpy(x).double(), torch.from_numpy(y).double()))


def batch_dependence(quick: bool) -> list:
    """ckatorch's minibatch CKA (a sum of per-batch unbiased HSIC_1) against the exact values over
    all n, three shufflings per batch size; ours streamed in the same batches (float32 data)."""
    n = 8192 if quick else 16384
    xs = data(n, [256, 256], seed=1)
    exact = exact_pairs(xs)[0, 1]
    exact_u = exact_debiased(*xs)
    rows = []
    rng = np.random.default_rng(2)
    for b in (64, 256, 1024):
        theirs, mine, mine_u = [], [], []
        for _ in range(3):
            perm = rng.permutation(n)
            x, y = xs[0][perm], xs[1][perm]
            theirs.append(ckatorch_batch(x, y, b))
            rep = ours([x, y], b)
            mine.append(float(rep.cka[0, 1]))
            mine_u.append(float(rep.cka_debiased[0, 1]))
        rows.append({"batch": b, "n": n, "exact_biased": exact, "exact_debiased": exact_u,
                     "ckatorch_mean_minus_exact_debiased": float(np.mean(theirs) - exact_u),
                     "ckatorch_spread": float(np.ptp(theirs)),
                     "ours_biased_max_err": float(np.max(np.abs(np.array(mine) - exact))),
                     "ours_debiased_max_err": float(np.max(np.abs(np.array(mine_u) - exact_u))),
                     "ours_spread": float(max(np.ptp(mine), np.ptp(mine_u)))})
    return rows


def _child(n: int, width: int, k: int) -> None:
    """Stream n samples of k representations in chunks of 8192, print time and peak RSS."""
    import richness

    s = richness.Similarity()
    t = 0.0
    chunk = 8192
    for a in range(0, n, chunk):
        xs = data(min(chunk, n - a), [width] * k, seed=a)
        t0 = time.perf_counter()
        s.update({f"r{i}": x for i, x in enumerate(xs)})
        t += time.perf_counter() - t0
    t0 = time.perf_counter()
    s.compute()
    t += time.perf_counter() - t0
    print(json.dumps({"n": n, "seconds": t, "peak_mb": proc_status_mb()}))


def sweep(ns, exact_ns) -> list:
    rows = []
    for n in ns:
        out = subprocess.run([sys.executable, __file__, "--child", str(n)], capture_output=True, text=True, check=True)
        rows.append({"route": "richness.Similarity (4 x 256, fp32)", **json.loads(out.stdout.strip().splitlines()[-1])})
    for n in exact_ns:
        code = ("import json,time,sys; sys.path.insert(0, %r); import bench_cka as b; "
                "xs = b.data(%d, [256, 256]); t0 = time.perf_counter(); b.ckatorch_exact(*xs); "
                "print(json.dumps({'n': %d, 'seconds': time.perf_counter() - t0, "
                "'peak_mb': b.proc_status_mb()}))"
                % (os.path.dirname(os.path.abspath(__file__)), n, n))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        rows.append({"route": "ckatorch cka_base (one pair, float64 n x n)", **json.loads(out.stdout.strip())})
    return rows


def targets(quick: bool) -> dict:
    n = 16384 if quick else 65536
    xs = data(n, [512] * 4, seed=3, dtype=np.float64)
    exact = exact_pairs(xs)
    t0 = time.perf_counter()
    rep = ours(xs, 4096)
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs = [ckatorch_batch(xs[i], xs[j], 1024) for i in range(4) for j in range(i + 1, 4)]
    t_theirs = time.perf_counter() - t0
    iu = np.triu_indices(4, 1)
    return {"n": n, "ours_s": t_ours, "ckatorch_batch1024_s": t_theirs,
            "ours_max_err": float(np.max(np.abs(rep.cka - exact))),
            "ckatorch_max_err": float(np.max(np.abs(np.array(theirs) - exact[iu])))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--child", type=int)
    p.add_argument("--top-n", type=int, default=262144)
    p.add_argument("--exact-top", type=int, default=16384)
    p.add_argument("--json")
    a = p.parse_args()
    if a.child:
        _child(a.child, 256, 4)
        return
    ns = [n for n in (4096, 16384, 65536, 262144, 1048576) if n <= a.top_n]
    exact_ns = [n for n in (4096, 8192, 16384) if n <= a.exact_top]
    res = {"load_before": os.getloadavg(), "batch": batch_dependence(a.quick), "sweep": sweep(ns, exact_ns),
           "targets": targets(a.quick)}
    res["load_after"] = os.getloadavg()
    print_and_save(res, a.json)


if __name__ == "__main__":
    main()
