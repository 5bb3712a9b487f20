"""CPU side-by-side: richness streaming vs the idiomatic PyTorch loop.

Same data, same precision (float32 products), same run:
    torch:  S.addmm_(X.T, X); XF.addmm_(X.T, F); FF.addmm_(F.T, F); column sums
    torch, one GEMM: S.addmm_(X.T, X) alone (the full p x p product a batch)
    ours:   Moments.update(X, F)            (streamed-outputs mode)
            Moments.update(X) + compute(head_weights=(W, b)) (head mode: only M is streamed)

Also: DLR error against a float64 reference at this size, and peak resident
memory at two n (each in a fresh subprocess, data generated per batch).

    python benchmarks/cpu_side_by_side.py [--n 65536 --p 1024 --c 100 --batch 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import dlr_from_comoments  # noqa: E402


def make_data(n_buffers: int, batch: int, p: int, c: int, seed: int = 0):
    """Rotating float32 buffers: correlated features with a nonzero mean, a linear head."""
    rng = np.random.default_rng(seed)
    mix = (rng.normal(size=(p, p)) / np.sqrt(p)).astype(np.float32)
    W = (rng.normal(size=(c, p)) / np.sqrt(p)).astype(np.float32)
    b = rng.normal(size=c).astype(np.float32)
    X = [(rng.normal(size=(batch, p)).astype(np.float32) @ mix + np.float32(0.5)) for _ in range(n_buffers)]
    F = [(x @ W.T + b).astype(np.float32) for x in X]
    return X, F, W, b


def run_torch_one(X, steps: int):
    """The single full GEMM a batch (both triangles): twice the symmetric product's arithmetic."""
    import torch

    Xt = [torch.from_numpy(x) for x in X]
    p = X[0].shape[1]
    S = torch.zeros(p, p)
    t0 = time.perf_counter()
    for i in range(steps):
        x = Xt[i % len(Xt)]
        S.addmm_(x.T, x)
    return time.perf_counter() - t0, S


def run_torch(X, F, steps: int):
    import torch

    Xt = [torch.from_numpy(x) for x in X]
    Ft = [torch.from_numpy(f) for f in F]
    p, c = X[0].shape[1], F[0].shape[1]
    S = torch.zeros(p, p)
    XF = torch.zeros(p, c)
    FF = torch.zeros(c, c)
    sx = torch.zeros(p)
    sf = torch.zeros(c)
    t0 = time.perf_counter()
    for i in range(steps):
        x, f = Xt[i % len(Xt)], Ft[i % len(Ft)]
        S.addmm_(x.T, x)
        XF.addmm_(x.T, f)
        FF.addmm_(f.T, f)
        sx += x.sum(0)
        sf += f.sum(0)
    return time.perf_counter() - t0, (S, XF, FF, sx, sf)


def run_ours(X, F, steps: int, with_outputs: bool):
    import richness

    m = richness.Moments()
    t0 = time.perf_counter()
    for i in range(steps):
        if with_outputs:
            m.update(X[i % len(X)], F[i % len(F)])
        else:
            m.update(X[i % len(X)])
    return time.perf_counter() - t0, m


def reference_dlr(X, F, steps: int) -> float:
    """float64 two-pass reference of the same stream (feature-space formula,
    exact in float64; the n x n oracle is checked against it in tests)."""
    Xs = np.concatenate([X[i % len(X)] for i in range(steps)]).astype(np.float64)
    Fs = np.concatenate([F[i % len(F)] for i in range(steps)]).astype(np.float64)
    Xc = Xs - Xs.mean(0)
    Fc = Fs - Fs.mean(0)
    return dlr_from_comoments(Xc.T @ Xc, Xc.T @ Fc, Fc.T @ Fc)


def peak_rss_mb(n: int, p: int, c: int, batch: int) -> float:
    """Peak RSS of a fresh process streaming n samples (batches generated on the fly)."""
    # VmHWM, not ru_maxrss: the latter keeps the parent's peak across fork+exec.
    code = f"""
import numpy as np, richness
rng = np.random.default_rng(0)
m = richness.Moments()
W = rng.normal(size=({c}, {p})).astype(np.float32)
for i in range({n} // {batch}):
    x = rng.standard_normal(size=({batch}, {p}), dtype=np.float32)
    m.update(x, x @ W.T)
r = m.compute()
print([int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")][0] / 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def machine() -> str:
    import richness

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import torch

    return (f"{cpu}, {os.cpu_count()} cores; torch {torch.__version__} "
            f"({torch.get_num_threads()} threads); richness BLAS: {richness.blas_info()}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--p", type=int, default=1024)
    ap.add_argument("--c", type=int, default=100)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--no-rss", action="store_true", help="skip the two peak-memory subprocesses")
    args = ap.parse_args()
    import torch

    import richness

    steps = args.n // args.batch
    X, F, W, b = make_data(4, args.batch, args.p, args.c)
    # warm up BLAS thread pools and page in the buffers
    run_torch(X, F, 2)
    run_ours(X, F, 2, True)
    times = {"torch": [], "torch_one": [], "ours_outputs": [], "ours_head": []}
    for _ in range(args.repeats):  # interleaved, so drifts in machine load hit all alike
        times["torch"].append(run_torch(X, F, steps)[0])
        times["torch_one"].append(run_torch_one(X, steps)[0])
        t, m_out = run_ours(X, F, steps, True)
        times["ours_outputs"].append(t)
        t, m_head = run_ours(X, F, steps, False)
        times["ours_head"].append(t)
    med = {k: float(np.median(v)) for k, v in times.items()}
    ref = reference_dlr(X, F, steps)
    d_out = m_out.compute().dlr
    d_head = m_head.compute(head_weights=(W, b)).dlr
    rss_small = float("nan") if args.no_rss else peak_rss_mb(16384, args.p, args.c, args.batch)
    rss_large = float("nan") if args.no_rss else peak_rss_mb(262144, args.p, args.c, args.batch)
    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": machine(),
        "n": args.n, "p": args.p, "C": args.c, "batch": args.batch, "repeats": args.repeats,
        "median_s": med,
        "speedup_outputs": med["torch"] / med["ours_outputs"],
        "speedup_head": med["torch"] / med["ours_head"],
        "speedup_head_vs_one_gemm": med["torch_one"] / med["ours_head"],
        "gemm_gflops": 2.0 * steps * args.batch * args.p ** 2 / med["torch_one"] / 1e9,
        "load_avg": os.getloadavg(),
        "dlr_ref_fp64": ref, "err_outputs": abs(d_out - ref), "err_head": abs(d_head - ref),
        "peak_rss_mb_n16k": rss_small, "peak_rss_mb_n262k": rss_large,
    }
    print(f"machine: {result['machine']}")
    print(f"n={args.n} p={args.p} C={args.c} batch={args.batch}, float32 products, median of {args.repeats}")
    print(f"load average {result['load_avg']}; torch's one GEMM: {result['gemm_gflops']:.0f} GFLOP/s")
    print(f"{'method':<34}{'time (s)':>10}{'vs torch':>10}{'vs 1 GEMM':>10}{'|DLR - fp64 ref|':>18}")
    print(f"{'torch one addmm_ (S only, fp32)':<34}{med['torch_one']:10.3f}{med['torch'] / med['torch_one']:10.2f}"
          f"{1.0:10.2f}{'-':>18}")
    print(f"{'torch three-GEMM loop (fp32)':<34}{med['torch']:10.3f}{1.0:10.2f}"
          f"{med['torch_one'] / med['torch']:10.2f}{'-':>18}")
    print(f"{'richness, streamed outputs':<34}{med['ours_outputs']:10.3f}"
          f"{result['speedup_outputs']:10.2f}{med['torch_one'] / med['ours_outputs']:10.2f}"
          f"{result['err_outputs']:18.2e}")
    print(f"{'richness, head mode':<34}{med['ours_head']:10.3f}{result['speedup_head']:10.2f}"
          f"{result['speedup_head_vs_one_gemm']:10.2f}{result['err_head']:18.2e}")
    print(f"peak RSS, streamed outputs: n=16,384: {rss_small:.0f} MB; n=262,144: {rss_large:.0f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
