"""The benchmarks page: scaling, head-to-head with CKA libraries, precision, finishing.

One command (about 10 minutes on 2 cores):

    python benchmarks/compare.py                       # everything
    python benchmarks/compare.py --quick               # small sizes, a smoke test
    python benchmarks/compare.py --only scaling,h2h    # some sections

writes benchmarks/results/compare.json, PNG plots beside it, and a markdown
summary (--md; by default benchmarks/RESULTS_COMPARE.md). The summary of a
run worth keeping is folded into benchmarks/RESULTS.md, section "Scaling,
CKA libraries, precision, finishing", with its date and machine. Sections:

scaling    time and peak memory against n (memory-mapped float32 files, streamed
           in batches), p and C: richness (streamed outputs; head mode) against
           the idiomatic torch addmm_ loop (all products; X^T X only), the NumPy
           loop, and the naive n x n formula while it fits (n <= 8192).
h2h        linear CKA(features, orthonormalised centered outputs) = 1 - DLR,
           from the CKA libraries that are installed, across batch sizes: value,
           error against the exact float64 answer, time, peak memory.
precision  DLR error of each CPU precision mode against float64, against speed
           (and the raw-sum loops, on ordinary and on offset features).
finish     compute() time against p and C: DLR only (head, streamed) and the
           full report.

Times are medians of interleaved rounds in this process (ratios side by side);
peak memory is VmHWM of a fresh subprocess per case, above its own baseline
after imports. GPU rows are not measured here (benchmarks/gpu_check.py).
"""

from __future__ import annotations

import os
import sys


def _threads_from_argv(default: int = 1) -> int:
    # Before numpy, torch or richness load their BLAS: thread counts are read at load time.
    for i, a in enumerate(sys.argv):
        if a == "--threads" and i + 1 < len(sys.argv):
            return int(sys.argv[i + 1])
        if a.startswith("--threads="):
            return int(a.split("=", 1)[1])
    return default


THREADS = _threads_from_argv()
if THREADS > 0:  # workers inherit the environment
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_var] = str(THREADS)

import argparse
import importlib
import json
import subprocess
import time
import types
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from _common import (  # noqa: E402
    Stream, dlr_from_comoments, dlr_from_raw_sums, dlr_head_from_raw_sums, exact_comoments, generate,
    interleaved, median, naive_dlr, orthonormal_centered, proc_status_mb, warm_page_cache,
)
from cpu_side_by_side import machine  # noqa: E402

warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

BATCH = 4096
NAIVE_MAX_N = 8192

# -- streaming methods (scaling) ---------------------------------------------------

STREAM_METHODS = {
    "richness": "richness, streamed outputs (fp32 products)",
    "richness_head": "richness, head mode (features only)",
    "torch": "torch addmm_ loop, X^T X + X^T F + F^T F (fp32)",
    "torch_head": "torch addmm_ loop, X^T X only (fp32)",
    "numpy": "NumPy loop, X^T X + X^T F + F^T F (fp32)",
    "naive": "naive n x n formula (float64)",
}


def _head(meta):
    z = np.load(meta["head"])
    return z["W"], z["b"]


def run_stream_method(method: str, meta: dict, n: int, batch: int = BATCH) -> dict:
    """Stream the first n rows of a dataset through one method; time the
    accumulation and the finishing separately. Returns stream_s, finish_s, dlr."""
    W, b = _head(meta)
    p, c = meta["p"], meta["c"]
    use_f = method in ("richness", "torch", "numpy", "naive")
    stream = Stream(meta["x"], meta["f"] if use_f else None, meta["n"], p, c, n, batch)
    if method == "naive":
        t0 = time.perf_counter()
        X = np.array(stream.X[:n], dtype=np.float64)
        F = np.array(stream.F[:n], dtype=np.float64)
        d, _ = naive_dlr(X, F)
        return {"stream_s": time.perf_counter() - t0, "finish_s": 0.0, "dlr": d}
    if method.startswith("richness"):
        import richness

        m = richness.Moments()
        t0 = time.perf_counter()
        if method == "richness":
            for x, f in stream:
                m.update(x, f)
        else:
            for x, _ in stream:
                m.update(x)
        t1 = time.perf_counter()
        hwm = proc_status_mb("VmHWM")
        d = (m.compute() if method == "richness" else m.compute(head_weights=(W, b))).dlr
        return {"stream_s": t1 - t0, "finish_s": time.perf_counter() - t1, "dlr": d, "hwm_stream_mb": hwm}
    if method.startswith("torch"):
        import torch

        # The loop of cpu_side_by_side.run_torch, on batches from the memory map.
        S, sx = torch.zeros(p, p), torch.zeros(p)
        XF, FF, sf = torch.zeros(p, c), torch.zeros(c, c), torch.zeros(c)
        t0 = time.perf_counter()
        rows = 0
        for x, f in stream:
            xt = torch.from_numpy(x)
            S.addmm_(xt.T, xt)
            sx += xt.sum(0)
            if method == "torch":
                ft = torch.from_numpy(f)
                XF.addmm_(xt.T, ft)
                FF.addmm_(ft.T, ft)
                sf += ft.sum(0)
            rows += x.shape[0]
        t1 = time.perf_counter()
        hwm = proc_status_mb("VmHWM")
        if method == "torch":
            d = dlr_from_raw_sums(rows, sx.numpy(), sf.numpy(), S.numpy(), XF.numpy(), FF.numpy())
        else:
            d = dlr_head_from_raw_sums(rows, sx.numpy(), S.numpy(), W)
        return {"stream_s": t1 - t0, "finish_s": time.perf_counter() - t1, "dlr": d, "hwm_stream_mb": hwm}
    if method == "numpy":
        S, XF, FF = np.zeros((p, p), np.float32), np.zeros((p, c), np.float32), np.zeros((c, c), np.float32)
        sx, sf = np.zeros(p, np.float32), np.zeros(c, np.float32)
        t0 = time.perf_counter()
        rows = 0
        for x, f in stream:
            S += x.T @ x
            XF += x.T @ f
            FF += f.T @ f
            sx += x.sum(0)
            sf += f.sum(0)
            rows += x.shape[0]
        t1 = time.perf_counter()
        hwm = proc_status_mb("VmHWM")
        d = dlr_from_raw_sums(rows, sx, sf, S, XF, FF)
        return {"stream_s": t1 - t0, "finish_s": time.perf_counter() - t1, "dlr": d, "hwm_stream_mb": hwm}
    raise ValueError(method)


# -- head-to-head with CKA libraries ----------------------------------------------

def _load_submodules(package: str, names):
    """Import submodules of an installed package without running its __init__
    (which pulls plotting, seaborn/pandas or lightning: seconds of import and
    hundreds of MB that are not the estimator). The library code is unchanged."""
    if package not in sys.modules:
        spec = importlib.util.find_spec(package)
        if spec is None:
            raise ImportError(f"{package} is not installed")
        pkg = types.ModuleType(package)
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules[package] = pkg
    return [importlib.import_module(f"{package}.{name}") for name in names]


H2H_METHODS = {
    "richness": ("richness", "richness 0.1.0: streamed Moments, float32 inputs (fp32 products)"),
    "ckatorch_batch": ("ckatorch", "ckatorch 1.0.3: cka_batch (minibatch HSIC_1, Nguyen et al.)"),
    "ckatorch_base": ("ckatorch", "ckatorch 1.0.3: cka_base (full n x n Gram, float64)"),
    "pytorch_cka": ("pytorch-cka", "pytorch-cka 1.1.3: hsic per batch, summed (its CKA class)"),
    "cka_pytorch": ("cka-pytorch", "cka-pytorch 1.1.3: hsic1 per batch, summed, epsilon 1e-4 (CKACalculator)"),
    "torch_cka": ("torch-cka", "torch-cka 0.21: CKA._HSIC per batch, averaged"),
}


def h2h_available() -> dict:
    """Which libraries import here (and why not, for the others)."""
    out = {}
    for key, mods in (("ckatorch", ("ckatorch", ["core"])), ("pytorch-cka", ("cka", ["hsic"])),
                      ("cka-pytorch", ("cka_pytorch", ["hsic"])), ("torch-cka", ("torch_cka", ["cka"]))):
        try:
            _load_submodules(*mods)
            out[key] = "ok"
        except Exception as e:  # report, do not fail the page
            out[key] = f"{type(e).__name__}: {e}"
    return out


def run_h2h_method(method: str, X: np.ndarray, F: np.ndarray, Q: np.ndarray, batch: int) -> float:
    """Linear CKA between X and Q (= 1 - DLR) by one library over batches of ``batch`` rows."""
    n = X.shape[0]
    if method == "richness":
        import richness

        m = richness.Moments()
        for s in range(0, n, batch):
            m.update(X[s:s + batch], F[s:s + batch])
        return 1.0 - m.compute().dlr
    import torch

    Xt, Qt = torch.from_numpy(X), torch.from_numpy(Q)
    k = n // batch
    if method == "ckatorch_base":
        (core,) = _load_submodules("ckatorch", ["core"])
        return float(core.cka_base(Xt, Qt))
    if method == "ckatorch_batch":
        (core,) = _load_submodules("ckatorch", ["core"])
        return float(core.cka_batch(Xt[: k * batch].reshape(k, batch, -1), Qt[: k * batch].reshape(k, batch, -1)))
    if method == "pytorch_cka":
        (hs,) = _load_submodules("cka", ["hsic"])
        xy = xx = yy = torch.zeros(1, 1, dtype=Xt.dtype)
        for s in range(0, k * batch, batch):
            x, q = Xt[s:s + batch], Qt[s:s + batch]
            a, b_, c_ = hs.hsic((x @ x.T)[None], (q @ q.T)[None])
            xy, xx, yy = xy + a, xx + b_, yy + c_
        # CKA._compute_cka_matrix
        den = torch.sqrt(torch.clamp(xx * yy, min=0.0))
        den = torch.where(den == 0, 1e-6, den)
        return float(torch.clamp(xy / den, min=0.0, max=1.0))
    if method == "cka_pytorch":
        (hs,) = _load_submodules("cka_pytorch", ["hsic"])
        xy = xx = yy = 0.0
        for s in range(0, k * batch, batch):
            x, q = Xt[s:s + batch], Qt[s:s + batch]
            gx, gy = (x @ x.T)[None], (q @ q.T)[None]
            xx = xx + hs.hsic1(gx, gx)
            yy = yy + hs.hsic1(gy, gy)
            xy = xy + hs.hsic1(gx, gy)
        # CKACalculator._compute_final_cka with its default epsilon
        return float(xy / torch.sqrt(xx * yy + 1e-4))
    if method == "torch_cka":
        (mod,) = _load_submodules("torch_cka", ["cka"])
        this = types.SimpleNamespace(device="cpu")
        acc = [0.0, 0.0, 0.0]
        for s in range(0, k * batch, batch):
            x, q = Xt[s:s + batch], Qt[s:s + batch]
            K = x @ x.T
            K.fill_diagonal_(0.0)
            L = q @ q.T
            L.fill_diagonal_(0.0)
            acc[0] += mod.CKA._HSIC(this, K, K) / k
            acc[1] += mod.CKA._HSIC(this, K, L) / k
            acc[2] += mod.CKA._HSIC(this, L, L) / k
        return acc[1] / (np.sqrt(acc[0]) * np.sqrt(acc[2]))
    raise ValueError(method)


def h2h_data(n: int, p: int, c: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    mix = rng.normal(size=(p, p)) / np.sqrt(p)
    W = rng.normal(size=(c, p)) / np.sqrt(p)
    X = (rng.standard_normal((n, p)) @ mix + 0.5).astype(np.float32)
    F = (X.astype(np.float64) @ W.T + rng.normal(size=c)).astype(np.float32)
    Q = orthonormal_centered(F).astype(np.float32)
    return X, F, Q


# -- subprocess workers (peak memory) ------------------------------------------------

def _worker(spec: dict) -> dict:
    """One case in this (fresh) process: VmHWM above the VmRSS after imports."""
    kind = spec["kind"]
    if kind == "stream":
        m = spec["method"]
        if m.startswith("richness"):
            import richness  # noqa: F401
        elif m.startswith("torch"):
            import torch  # noqa: F401
        base = proc_status_mb("VmRSS")
        out = run_stream_method(m, spec["meta"], spec["n"], spec.get("batch", BATCH))
    elif kind == "h2h":
        z = np.load(spec["data"])
        X, F, Q = z["X"], z["F"], z["Q"]
        if spec["method"] == "richness":
            import richness  # noqa: F401
        else:
            import torch  # noqa: F401

            lib = {"ckatorch_base": ("ckatorch", ["core"]), "ckatorch_batch": ("ckatorch", ["core"]),
                   "pytorch_cka": ("cka", ["hsic"]), "cka_pytorch": ("cka_pytorch", ["hsic"]),
                   "torch_cka": ("torch_cka", ["cka"])}[spec["method"]]
            _load_submodules(*lib)
        base = proc_status_mb("VmRSS")
        out = {"value": run_h2h_method(spec["method"], X, F, Q, spec["batch"])}
    else:
        raise ValueError(kind)
    out["base_mb"] = base
    out["peak_mb"] = proc_status_mb("VmHWM")
    out["peak_above_base_mb"] = out["peak_mb"] - base
    if "hwm_stream_mb" in out:
        out["peak_stream_above_base_mb"] = out["hwm_stream_mb"] - base
    return out


def in_subprocess(spec: dict, timeout: float = 600) -> dict:
    try:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--threads", str(THREADS),
                            "--worker", json.dumps(spec)],
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": (r.stderr.strip().splitlines() or ["no output"])[-1][:300]}


# -- sections ----------------------------------------------------------------------

def log(*a):
    print(*a, flush=True)


def _dataset(data_dir: str, name: str, n: int, p: int, c: int, seed: int) -> dict:
    meta = generate(os.path.join(data_dir, name), n, p, c, seed)
    meta = dict(meta)
    return meta


def _reference(meta: dict, n: int, cache: dict) -> dict:
    """Exact float64 DLR of the first n rows, with the cut of float64 products
    (1e-10) and with the cut the float32 methods use (1e-5; docs/MATH.md, rank
    cut): where an
    eigenvalue of A lies between the two, the cut changes the answer itself."""
    key = f"{meta['x']}:{n}"
    if key not in cache:
        st = Stream(meta["x"], meta["f"], meta["n"], meta["p"], meta["c"], n, 16384)
        nn, M, B, A = exact_comoments(iter(st))
        cache[key] = {"1e-10": dlr_from_comoments(M, B, A, 1e-10), "1e-5": dlr_from_comoments(M, B, A, 1e-5)}
    return cache[key]


def _sweep(label, cases, methods, repeats, ref_cache):
    """cases: list of (value, meta, n). Times interleaved in this process; memory per case in a subprocess."""
    rows = []
    for value, meta, n in cases:
        ms = [m for m in methods if m != "naive" or n <= NAIVE_MAX_N]
        warm_page_cache([meta["x"], meta["f"]])
        ref = _reference(meta, n, ref_cache)
        results = {}
        fns = {m: (lambda m=m: results.setdefault(m, []).append(run_stream_method(m, meta, n)) or 0.0) for m in ms}
        interleaved(fns, repeats)
        for m in ms:
            mem = in_subprocess({"kind": "stream", "method": m, "meta": meta, "n": n})
            runs = results[m]
            row = {label: value, "n": n, "p": meta["p"], "C": meta["c"], "method": m, "repeats": repeats,
                   "stream_s": median([r["stream_s"] for r in runs]),
                   "finish_s": median([r["finish_s"] for r in runs]),
                   "dlr": runs[-1]["dlr"], "dlr_ref_fp64": ref["1e-10"], "dlr_ref_fp64_rtol_1e-5": ref["1e-5"],
                   # each method against the exact answer at its own cut (naive: an SVD at 1e-10)
                   "abs_err": abs(runs[-1]["dlr"] - ref["1e-10" if m == "naive" else "1e-5"]),
                   "abs_err_vs_rtol_1e-10": abs(runs[-1]["dlr"] - ref["1e-10"]),
                   "peak_above_base_mb": mem.get("peak_above_base_mb"), "peak_mb": mem.get("peak_mb"),
                   "peak_stream_above_base_mb": mem.get("peak_stream_above_base_mb"),
                   "base_mb": mem.get("base_mb"), "mem_error": mem.get("error")}
            row["total_s"] = row["stream_s"] + row["finish_s"]
            rows.append(row)
            log(f"  {label}={value:<8} {m:<14} stream {row['stream_s']:8.3f}s finish {row['finish_s']:7.3f}s "
                f"peak+{row['peak_above_base_mb'] or float('nan'):8.1f}MB err {row['abs_err']:.1e}")
    return rows


def section_scaling(args, ref_cache) -> dict:
    q = args.quick
    methods = list(STREAM_METHODS)
    out = {}
    ns = [1000, 4096, 8192, 65536] if q else [1000, 4096, 8192, 65536, 1_000_000]
    meta = _dataset(args.data, "n", ns[-1], 256, 10, 0)
    log(f"scaling with n (p={meta['p']}, C={meta['c']}, batch {BATCH})")
    out["n"] = _sweep("n", [(n, meta, n) for n in ns], methods, args.repeats, ref_cache)
    # p = 4096 is left to the finishing section: its O(p^3) compute() alone takes
    # tens of seconds per call on this machine, four calls per case here.
    ps = [128, 512, 1024] if q else [128, 256, 512, 1024, 2048]
    n_p = 8192
    log(f"scaling with p (n={n_p}, C=100)")
    cases = [(p, _dataset(args.data, f"p{p}", n_p, p, 100, 0), n_p) for p in ps]
    out["p"] = _sweep("p", cases, [m for m in methods if m != "naive"], args.repeats, ref_cache)
    cs = [10, 100, 1000] if not q else [10, 100]
    n_c = 16384 if not q else 8192
    log(f"scaling with C (n={n_c}, p=512)")
    cases = [(c, _dataset(args.data, f"c{c}", n_c, 512, c, 0), n_c) for c in cs]
    out["C"] = _sweep("C", cases, [m for m in methods if m != "naive"], args.repeats, ref_cache)
    return out


def section_h2h(args) -> dict:
    n, p, c = (4096, 256, 10) if not args.quick else (1024, 128, 10)
    X, F, Q = h2h_data(n, p, c)
    path = os.path.join(args.data, f"h2h_{n}_{p}_{c}.npz")
    np.savez(path, X=X, F=F, Q=Q)
    # exact answer: float64 co-moments of the float32 inputs, and the n x n oracle
    _, M, B, A = exact_comoments([(X, F)])
    dlr_exact = dlr_from_comoments(M, B, A)
    dlr_naive, _ = naive_dlr(X, F)
    import richness

    dlr_ours64 = richness.dlr(X.astype(np.float64), F.astype(np.float64))
    avail = h2h_available()
    identity = {"dlr_exact_comoments_fp64": dlr_exact, "dlr_naive_nxn_fp64": dlr_naive,
                "richness_fp64_inputs": dlr_ours64, "abs(naive - exact)": abs(dlr_naive - dlr_exact),
                "abs(richness_fp64 - exact)": abs(dlr_ours64 - dlr_exact)}
    if avail.get("ckatorch") == "ok":
        import torch

        (core,) = _load_submodules("ckatorch", ["core"])
        q64 = torch.from_numpy(orthonormal_centered(F))
        cka_base64 = float(core.cka_base(torch.from_numpy(X.astype(np.float64)), q64))
        identity["1 - ckatorch.cka_base(X, Q) fp64"] = 1.0 - cka_base64
        identity["abs(1 - ckatorch.cka_base - exact)"] = abs(1.0 - cka_base64 - dlr_exact)
    log(f"head-to-head (n={n}, p={p}, C={c}); libraries: {avail}")
    log("  identity CKA(X, Q) = 1 - DLR: " + ", ".join(f"{k} {v:.3e}" if "abs" in k else f"{k} {v:.6f}"
                                                     for k, v in identity.items()))
    lib_ok = {k: (avail.get(lib, "ok") == "ok") for k, (lib, _) in H2H_METHODS.items()}
    batches = [64, 256, 1024, n] if not args.quick else [64, 256, n]
    cases = []
    for b in batches:
        for m in H2H_METHODS:
            if not lib_ok[m] or (m == "ckatorch_base" and b != n):
                continue
            cases.append((m, b))
    results = {}
    fns = {}
    for m, b in cases:
        def fn(m=m, b=b):
            t0 = time.perf_counter()
            v = run_h2h_method(m, X, F, Q, b)
            dt = time.perf_counter() - t0
            results.setdefault((m, b), []).append((dt, v))
            return dt
        fns[(m, b)] = fn
    interleaved(fns, args.repeats)
    rows = []
    for m, b in cases:
        mem = in_subprocess({"kind": "h2h", "method": m, "batch": b, "data": path})
        ts = [t for t, _ in results[(m, b)]]
        v = results[(m, b)][-1][1]
        row = {"method": m, "library": H2H_METHODS[m][0], "what": H2H_METHODS[m][1], "batch": b,
               "n": n, "p": p, "C": c, "cka": v, "cka_exact": 1.0 - dlr_exact, "abs_err": abs(v - (1.0 - dlr_exact)),
               "time_s": median(ts), "repeats": len(ts), "peak_above_base_mb": mem.get("peak_above_base_mb"),
               "peak_mb": mem.get("peak_mb"), "mem_error": mem.get("error")}
        rows.append(row)
        log(f"  {m:<15} batch {b:>5}  CKA {v:.6f}  err {row['abs_err']:.2e}  {row['time_s']:.3f}s  "
            f"peak+{row['peak_above_base_mb'] or float('nan'):.1f}MB")
    return {"n": n, "p": p, "C": c, "libraries": avail, "identity": identity, "rows": rows}


def _torch_loop_dlr(X, F, batch, dtype):
    import torch

    p, c = X.shape[1], F.shape[1]
    S, XF, FF = torch.zeros(p, p, dtype=dtype), torch.zeros(p, c, dtype=dtype), torch.zeros(c, c, dtype=dtype)
    sx, sf = torch.zeros(p, dtype=dtype), torch.zeros(c, dtype=dtype)
    for s in range(0, X.shape[0], batch):
        x = torch.from_numpy(X[s:s + batch]).to(dtype)
        f = torch.from_numpy(F[s:s + batch]).to(dtype)
        S.addmm_(x.T, x)
        XF.addmm_(x.T, f)
        FF.addmm_(f.T, f)
        sx += x.sum(0)
        sf += f.sum(0)
    rtol = 1e-10 if dtype == torch.float64 else 1e-5
    return dlr_from_raw_sums(X.shape[0], sx.numpy(), sf.numpy(), S.numpy(), XF.numpy(), FF.numpy(), rtol)


def section_precision(args) -> dict:
    import torch

    import richness

    n, p, c = (32768, 512, 100) if not args.quick else (8192, 256, 50)
    rng = np.random.default_rng(2)
    mix = rng.normal(size=(p, p)) / np.sqrt(p)
    W = rng.normal(size=(c, p)) / np.sqrt(p)
    datasets = {}
    X64 = rng.standard_normal((n, p)) @ mix + 0.5
    datasets["mean 0.5, spread 1"] = (X64, X64 @ W.T + 0.1 * np.tanh(X64[:, :c]))
    Xo = 1e4 + 1e-2 * (rng.standard_normal((n, p)) @ mix)
    datasets["mean 1e4, spread 1e-2"] = (Xo, (Xo - 1e4) @ W.T * 100 + 0.1 * np.tanh(100 * (Xo[:, :c] - 1e4)))
    rows = []
    for dname, (X64, F64) in datasets.items():
        _, M, B, A = exact_comoments([(X64, F64)])
        ref = dlr_from_comoments(M, B, A)
        X32, F32 = X64.astype(np.float32), F64.astype(np.float32)
        X16, F16 = X64.astype(np.float16), F64.astype(np.float16)
        Xb, Fb = torch.from_numpy(X32).bfloat16(), torch.from_numpy(F32).bfloat16()

        def rounded_ref(x, f):
            x = x.float().numpy() if hasattr(x, "float") else x
            f = f.float().numpy() if hasattr(f, "float") else f
            _, M_, B_, A_ = exact_comoments([(x, f)])
            return dlr_from_comoments(M_, B_, A_)

        modes = {
            "fp64 (float64 inputs)": (X64, F64, None, "richness"),
            "fp64 products, float32 inputs": (X32, F32, "fp64", "richness"),
            "fp32 (float32 inputs)": (X32, F32, None, "richness"),
            "fp32, float16 inputs": (X16, F16, None, "richness"),
            "fp32, bfloat16 inputs": (Xb, Fb, None, "richness"),
            "torch addmm_ loop, float32 raw sums": (X32, F32, torch.float32, "torch"),
            "torch addmm_ loop, float64 raw sums": (X32, F32, torch.float64, "torch"),
        }
        if dname.startswith("mean 1e4"):  # float16/bfloat16 cannot represent these inputs (docs/MATH.md, streaming estimator): exempt
            modes.pop("fp32, float16 inputs")
            modes.pop("fp32, bfloat16 inputs")
        results = {}

        def make(name, x, f, prec, kind):
            def fn():
                t0 = time.perf_counter()
                if kind == "richness":
                    m = richness.Moments(precision=prec)
                    for s in range(0, n, BATCH):
                        m.update(x[s:s + BATCH], f[s:s + BATCH])
                    t1 = time.perf_counter()
                    d = m.compute().dlr
                else:
                    d = _torch_loop_dlr(x, f, BATCH, prec)
                    t1 = time.perf_counter()
                results.setdefault(name, []).append((t1 - t0, d))
                return t1 - t0
            return fn

        interleaved({k: make(k, *v) for k, v in modes.items()}, args.repeats)
        base_t = median([t for t, _ in results["fp64 (float64 inputs)"]])
        for name, (x, f, _, _) in modes.items():
            ts = [t for t, _ in results[name]]
            d = results[name][-1][1]
            rr = rounded_ref(x, f)
            row = {"data": dname, "mode": name, "n": n, "p": p, "C": c, "dlr": d, "dlr_ref_fp64": ref,
                   "abs_err_vs_fp64_data": abs(d - ref), "abs_err_vs_rounded_inputs": abs(d - rr),
                   "stream_s": median(ts), "speed_vs_fp64": base_t / median(ts), "repeats": len(ts)}
            rows.append(row)
            log(f"  [{dname}] {name:<38} {row['stream_s']:.3f}s x{row['speed_vs_fp64']:.2f}  "
                f"err {row['abs_err_vs_fp64_data']:.1e} (vs rounded inputs {row['abs_err_vs_rounded_inputs']:.1e})")
    return {"rows": rows, "gpu": "not measured here: tf32/bf16 products are CUDA-only; "
                                 "their rows come from benchmarks/gpu_check.py on an H200"}


def section_finish(args) -> dict:
    import richness
    from richness import finish as _finish

    ps = [128, 256, 512, 1024, 2048, 4096] if not args.quick else [128, 512]
    cs = [10, 100, 1000] if not args.quick else [10, 100]
    grid = [(p, 100) for p in ps] + [(512, c) for c in cs if c != 100]
    rows = []
    rng = np.random.default_rng(3)
    for p, c in grid:
        n = max(2 * p, 2 * c, 4096)
        scale = np.exp(-np.arange(p) / (p / 8)).astype(np.float32)
        X = rng.standard_normal((n, p), dtype=np.float32) * scale + np.float32(0.5)
        W = (rng.normal(size=(c, p)) / np.sqrt(p)).astype(np.float32)
        bias = rng.normal(size=c).astype(np.float32)
        F = X @ W.T + bias + np.float32(0.01) * rng.standard_normal((n, c), dtype=np.float32)
        m = richness.Moments()
        for s in range(0, n, BATCH):
            m.update(X[s:s + BATCH], F[s:s + BATCH])
        W64 = W.astype(np.float64)
        rtol = _finish.rtol_for("fp32")
        vals = {}

        def rec(name, fn):
            def run():
                t0 = time.perf_counter()
                v = fn()
                dt = time.perf_counter() - t0
                vals.setdefault(name, []).append((dt, v))
                return dt
            return run

        cases = {
            "dlr_only_head": rec("dlr_only_head", lambda: _finish.dlr_of_state(m.state_dict(), W64, rtol)[0]),
            "dlr_only_streamed": rec("dlr_only_streamed", lambda: _finish.dlr_of_state(m.state_dict(), None, rtol)[0]),
            "report_head": rec("report_head", lambda: m.compute(head_weights=(W, bias)).dlr),
            "report_streamed": rec("report_streamed", lambda: m.compute().dlr),
        }
        reps = args.repeats if p <= 2048 else 1  # an O(p^3) eigh at p = 4096 takes seconds on 2 cores
        interleaved(cases, reps)
        row = {"p": p, "C": c, "n": n, "repeats": reps}
        for k in cases:
            row[k + "_s"] = median([t for t, _ in vals[k]])
            row[k + "_dlr"] = vals[k][-1][1]
        rows.append(row)
        log(f"  p={p:<5} C={c:<5} " + "  ".join(f"{k} {row[k + '_s'] * 1e3:9.2f}ms" for k in cases))
    return {"rows": rows, "note": "dlr_only = state_dict() + _finish.dlr_of_state (the path Monitor and the "
                                  "jackknife use); report = Moments.compute() (DLR, spectrum, curves, NC1 if labels)"}


# -- plots and markdown --------------------------------------------------------------

def plots(res: dict, out_dir: str) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []

    def save(fig, name):
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)

    sc = res.get("scaling")
    if sc:
        for label in ("n", "p", "C"):
            rows = sc.get(label) or []
            if not rows:
                continue
            fig, axes = plt.subplots(1, 2, figsize=(11, 4))
            for m in STREAM_METHODS:
                rr = [r for r in rows if r["method"] == m]
                if not rr:
                    continue
                xs = [r[label] for r in rr]
                line, = axes[0].plot(xs, [r["stream_s"] for r in rr], "o-", label=m)
                if m != "naive":
                    axes[0].plot(xs, [r["total_s"] for r in rr], "x--", color=line.get_color(), alpha=0.6)
                axes[1].plot(xs, [r["peak_above_base_mb"] or np.nan for r in rr], "o-", label=m)
            values = sorted({r[label] for r in rows})
            for ax, yl in zip(axes, ("time (s): stream (solid), stream + finish (dashed)",
                                     "peak memory above baseline (MB)")):
                ax.set_xscale("log")
                ax.set_yscale("log")
                ax.set_xticks(values, [f"{v:,}" for v in values], fontsize=7)
                ax.minorticks_off()
                ax.set_xlabel(label)
                ax.set_ylabel(yl)
                ax.grid(True, which="both", alpha=0.3)
            axes[0].legend(fontsize=8)
            fig.suptitle(f"scaling with {label} (CPU, float32 inputs)")
            save(fig, f"scaling_{label}.png")
    h = res.get("h2h")
    if h:
        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        for m in H2H_METHODS:
            rr = [r for r in h["rows"] if r["method"] == m]
            if not rr:
                continue
            xs = [r["batch"] for r in rr]
            axes[0].plot(xs, [max(r["abs_err"], 1e-17) for r in rr], "o-", label=m)
            axes[1].plot(xs, [r["time_s"] for r in rr], "o-", label=m)
            axes[2].plot(xs, [r["peak_above_base_mb"] or np.nan for r in rr], "o-", label=m)
        for ax, yl in zip(axes, ("|CKA - exact| (1 - DLR, float64)", "time (s)", "peak memory above baseline (MB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch size")
            ax.set_ylabel(yl)
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.suptitle(f"linear CKA(features, orthonormalised centered outputs), n={h['n']}, p={h['p']}, C={h['C']}")
        save(fig, "h2h.png")
    pr = res.get("precision")
    if pr:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in pr["rows"]:
            mk = "o" if r["data"].startswith("mean 0.5") else "s"
            ax.scatter(r["stream_s"], max(r["abs_err_vs_fp64_data"], 1e-17), marker=mk)
            ax.annotate(r["mode"].replace(" (float", "\n(float"), (r["stream_s"], max(r["abs_err_vs_fp64_data"], 1e-17)),
                        fontsize=6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("time to stream + finish (s)")
        ax.set_ylabel("|DLR - float64 reference|")
        ax.set_title("precision vs speed (circles: mean 0.5; squares: mean 1e4, spread 1e-2)")
        ax.grid(True, which="both", alpha=0.3)
        save(fig, "precision.png")
    fi = res.get("finish")
    if fi:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        keys = ("dlr_only_head", "dlr_only_streamed", "report_head", "report_streamed")
        prow = [r for r in fi["rows"] if r["C"] == 100]
        crow = [r for r in fi["rows"] if r["p"] == 512]
        for k in keys:
            axes[0].plot([r["p"] for r in prow], [r[k + "_s"] for r in prow], "o-", label=k)
            crow_s = sorted(crow, key=lambda r: r["C"])
            axes[1].plot([r["C"] for r in crow_s], [r[k + "_s"] for r in crow_s], "o-", label=k)
        for ax, xl in zip(axes, ("p (C = 100)", "C (p = 512)")):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(xl)
            ax.set_ylabel("compute time (s)")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle("finishing: compute() time (float64, numpy BLAS)")
        save(fig, "finish.png")
    return made


def _f(x, spec=".3f"):
    return "-" if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, spec)


def headlines(res: dict) -> list:
    """The few ratios the README quotes, read from the results (nothing typed in by hand)."""
    H = []
    sc = res.get("scaling") or {}
    rows = sc.get("n") or []
    if rows:
        nmax = max(r["n"] for r in rows)
        at = {r["method"]: r for r in rows if r["n"] == nmax}
        if {"richness", "torch", "numpy"} <= set(at):
            o = at["richness"]
            H.append(f"Streaming n = {nmax:,} memory-mapped samples (p = {o['p']}, C = {o['C']}): richness "
                     f"{o['total_s']:.2f} s, torch addmm_ loop {at['torch']['total_s'] / o['total_s']:.2f}x that, "
                     f"NumPy loop {at['numpy']['total_s'] / o['total_s']:.2f}x; head mode "
                     f"{at['richness_head']['total_s']:.2f} s against {at['torch_head']['total_s']:.2f} s for a "
                     f"torch loop over X^T X alone. DLR error {o['abs_err']:.0e} (torch loop, float32 raw sums: "
                     f"{at['torch']['abs_err']:.0e}).")
        ours = [r for r in rows if r["method"] == "richness"]
        naive = [r for r in rows if r["method"] == "naive"]
        if ours and naive:
            a, b = min(ours, key=lambda r: r["n"]), max(ours, key=lambda r: r["n"])
            nv = max(naive, key=lambda r: r["n"])
            same = next((r for r in ours if r["n"] == nv["n"]), None)
            H.append(f"Peak memory does not grow with n: {_f(a['peak_above_base_mb'], '.0f')} MB at n = {a['n']:,}, "
                     f"{_f(b['peak_above_base_mb'], '.0f')} MB at n = {b['n']:,} (above the process after imports). "
                     f"The n x n formula needs {_f(nv['peak_above_base_mb'], '.0f')} MB and {nv['total_s']:.1f} s at "
                     f"n = {nv['n']:,}" + (f", where richness takes {same['total_s'] * 1e3:.0f} ms." if same else "."))
    h = res.get("h2h")
    if h:
        ours = [r for r in h["rows"] if r["method"] == "richness"]
        mini = [r for r in h["rows"] if r["method"] not in ("richness", "ckatorch_base")]
        base = [r for r in h["rows"] if r["method"] == "ckatorch_base"]
        if ours and mini:
            full = [r for r in mini if r["batch"] == h["n"]]
            H.append(f"CKA libraries (n = {h['n']}, p = {h['p']}, C = {h['C']}): the minibatch estimators are off "
                     f"by {min(r['abs_err'] for r in mini):.0e} to {max(r['abs_err'] for r in mini):.0e} and move "
                     f"with the batch size ({min(r['batch'] for r in mini)} to {h['n']}); richness is within "
                     f"{max(r['abs_err'] for r in ours):.0e} at every batch size, at "
                     f"{max(r['peak_above_base_mb'] or 0 for r in ours):.0f} MB or less"
                     + (f" (whole-set batches: {min(r['peak_above_base_mb'] or 0 for r in full):.0f} to "
                        f"{max(r['peak_above_base_mb'] or 0 for r in full):.0f} MB, "
                        f"{min(r['time_s'] for r in full):.2f} to {max(r['time_s'] for r in full):.1f} s)" if full else "")
                     + (f". ckatorch.cka_base (full n x n, float64) gets it right ({base[0]['abs_err']:.0e}) with "
                        f"{_f(base[0]['peak_above_base_mb'], '.0f')} MB and {base[0]['time_s']:.1f} s"
                        f" (richness: {ours[-1]['time_s'] * 1e3:.0f} ms)." if base else "."))
    pr = res.get("precision")
    if pr:
        get = {(r["data"], r["mode"]): r for r in pr["rows"]}
        a = get.get(("mean 0.5, spread 1", "fp32 (float32 inputs)"))
        b = get.get(("mean 1e4, spread 1e-2", "fp32 (float32 inputs)"))
        t = get.get(("mean 1e4, spread 1e-2", "torch addmm_ loop, float32 raw sums"))
        if a and b and t:
            H.append(f"Precision: fp32 products give DLR to {a['abs_err_vs_fp64_data']:.0e} at "
                     f"{a['speed_vs_fp64']:.1f}x the speed of fp64; on features with a mean of 1e4 and a spread of "
                     f"1e-2, {b['abs_err_vs_rounded_inputs']:.0e} against the exact answer for the same float32 "
                     f"inputs, where the float32 raw-sum loop is off by {t['abs_err_vs_rounded_inputs']:.2f}.")
    fi = res.get("finish")
    if fi:
        big = max(fi["rows"], key=lambda r: r["p"])
        H.append(f"Finishing at p = {big['p']}, C = {big['C']}: DLR alone {big['dlr_only_head_s'] * 1e3:.0f} ms "
                 f"(head) / {big['dlr_only_streamed_s'] * 1e3:.0f} ms (streamed); the full report "
                 f"{big['report_head_s']:.1f} s (its p x p eigendecomposition).")
    return H


def markdown(res: dict, md_path: str, results_dir: str) -> str:
    rel = os.path.relpath(results_dir, os.path.dirname(md_path))
    L = ["## Benchmarks: scaling, head-to-head with CKA libraries, precision, finishing", "",
         f"Measured {res['date']} on {res['machine']}. Command: `{res['command']}` "
         f"({res['wall_s'] / 60:.1f} min). Data: `{rel}/compare.json`; plots beside it.", "",
         "The machine's 2 cores were shared with other jobs, so absolute times are noisy: ratios come from "
         "the same run, with the methods interleaved in rounds and the median of "
         f"{res['repeats']} rounds reported. "
         + (f"Every library ran with {res['threads']} BLAS/OpenMP thread(s) (`--threads`; 0 = library defaults): "
            "on the oversubscribed cores, 2-thread BLAS made the same compute() (p = 256) take 0.16 to 2.6 s "
            "from call to call, against 0.03 to 0.06 s single-threaded. " if res.get("threads") else
            "Libraries ran with their default thread counts. ")
         + "Peak memory is VmHWM of a fresh subprocess per case, above that "
         "process's resident size after its imports (numpy, plus torch or richness as the method needs).", "",
         "Headlines (CPU, this run):", ""] + [f"- {h}" for h in headlines(res)] + [""]
    sc = res.get("scaling")
    if sc:
        for label, title in (("n", "n"), ("p", "p"), ("C", "C")):
            rows = sc.get(label)
            if not rows:
                continue
            r0 = rows[0]
            fixed = {"n": f"p = {r0['p']}, C = {r0['C']}", "p": f"n = {r0['n']}, C = {r0['C']}",
                     "C": f"n = {r0['n']}, p = {r0['p']}"}[label]
            L += [f"### Scaling with {title} ({fixed}, batch {BATCH}, float32 inputs)", ""]
            if label == "n":
                L += ["Features and outputs are memory-mapped float32 files streamed in batches (the pages of a "
                      "finished batch are dropped from the process, so the mapping itself does not count). "
                      "Stream = accumulation; finish = to DLR (richness: `compute()`, the full report; the loops: "
                      "float64 DLR from their raw sums). Naive = the n x n formula in float64, while n <= "
                      f"{NAIVE_MAX_N}.", ""]
            vals = sorted({r[label] for r in rows})
            L += [f"| {label} | method | stream (s) | finish (s) | stream vs richness | total vs richness | "
                  "peak above base, streaming / with finish (MB) | abs DLR error vs float64 |",
                  "|---|---|---|---|---|---|---|---|"]
            for v in vals:
                rr = [r for r in rows if r[label] == v]
                ours = {r["method"]: r for r in rr}
                for r in rr:
                    twin = ours.get("richness_head" if r["method"].endswith("_head") else "richness")
                    ratio = r["total_s"] / twin["total_s"] if twin else None
                    sratio = r["stream_s"] / twin["stream_s"] if twin and r["method"] != "naive" else None
                    L.append(f"| {v:,} | {r['method']} | {_f(r['stream_s'])} | {_f(r['finish_s'])} | "
                             f"{_f(sratio, '.2f')}x | {_f(ratio, '.2f')}x | {_f(r.get('peak_stream_above_base_mb'), '.1f')} / "
                             f"{_f(r['peak_above_base_mb'], '.1f')} | {r['abs_err']:.1e} |")
            L += ["", f"![scaling with {label}]({rel}/scaling_{label}.png)", ""]
        big = [r for r in sc.get("C", []) + sc.get("p", []) + sc.get("n", [])
               if abs(r["dlr_ref_fp64"] - r.get("dlr_ref_fp64_rtol_1e-5", r["dlr_ref_fp64"])) > 1e-6]
        if big:
            L += ["Errors are against the exact float64 DLR at the method's own eigenvalue cut (1e-5 for float32 "
                  "products, 1e-10 for the float64 naive formula). " + "; ".join(
                      f"At {r['n']:,} x {r['p']} with C = {r['C']} the cut itself moves the exact answer: "
                      f"{r['dlr_ref_fp64']:.6f} at 1e-10, {r['dlr_ref_fp64_rtol_1e-5']:.6f} at 1e-5"
                      for r in big if r["method"] == "richness") + " (A has eigenvalues between the two cuts; "
                  "richness reports this in `Report.warnings` and `dlr_rtol_range`).", ""]
        L += ["\"vs richness\" divides each method's time by its richness twin's (above 1: richness is faster): "
              "`torch_head` by `richness_head` (features only), the others by `richness` (streamed outputs). "
              "richness finishes with `compute()`, the full report, whose p x p eigendecomposition dominates the "
              "total at large p and small n; the loops finish DLR alone (see the finishing section for DLR alone "
              "in richness). Memory: richness keeps its state in float64, centers each batch in a copy before "
              "the product (docs/MATH.md, streaming estimator) and forms the product in a scratch p x p buffer before adding it (so that a "
              "rejected batch leaves the state as it was), so its streaming peak is about twice the float32 "
              "loops' at large p, and "
              "`compute()` adds p x p float64 work arrays. Every streaming peak includes the resident pages of "
              "the current memory-mapped batch (b x p x 4 bytes).", ""]
    h = res.get("h2h")
    if h:
        idt = h["identity"]
        L += [f"### Head-to-head: linear CKA(features, orthonormalised centered outputs) = 1 - DLR "
              f"(n = {h['n']}, p = {h['p']}, C = {h['C']})", "",
              "Q is an orthonormal basis of the centered outputs (float64 SVD of all n rows, then float32 for "
              "the libraries, which get float32 features as a user would pass them). The identity, checked "
              "numerically in float64:", ""]
        L += [f"- {k}: {v:.3e}" if "abs" in k else f"- {k}: {v:.10f}" for k, v in idt.items()]
        L += ["", "Libraries: " + "; ".join(f"{k}: {v}" for k, v in h["libraries"].items()) + ".", "",
              "| method | batch | CKA | abs error vs exact | time (s) | peak above base (MB) |",
              "|---|---|---|---|---|---|"]
        for r in h["rows"]:
            L.append(f"| {r['what']} | {r['batch']:,} | {r['cka']:.6f} | {r['abs_err']:.1e} | {_f(r['time_s'])} | "
                     f"{_f(r['peak_above_base_mb'], '.1f')} |")
        L += ["", "Why the libraries differ: the minibatch ones sum or average an unbiased HSIC estimator (HSIC_1, "
              "Nguyen et al. 2020) over batches. That is a different quantity from the plug-in CKA that defines "
              "DLR, and its value depends on the batch size; even one batch of all n samples gives the unbiased "
              "estimate, not 1 - DLR. cka-pytorch also adds its epsilon (1e-4) to the product of the self-HSICs "
              "before the square root, which matters when HSIC values are small (here the Gram of Q has entries "
              "of order C/n). Their time and memory grow with the batch: b x b Gram matrices, and a b x b x b "
              "product in hsic1 and _HSIC. ckatorch.cka_base computes the plug-in CKA exactly, with n x n float64 "
              "matrices.", "",
              f"Exact CKA = {1 - idt['dlr_exact_comoments_fp64']:.10f}. The minibatch libraries are called "
              "through their estimator functions (hsic, hsic1, _HSIC, cka_batch) with the accumulation their "
              "classes do, without their model-hook machinery; batches that do not divide n are dropped as "
              "cka_batch requires.", "", f"![head-to-head]({rel}/h2h.png)", ""]
    pr = res.get("precision")
    if pr:
        r0 = pr["rows"][0]
        L += [f"### Precision (CPU; n = {r0['n']}, p = {r0['p']}, C = {r0['C']}, batch {BATCH})", "",
              "Error of DLR against the float64 answer of the original float64 data, and against the float64 "
              "answer of the inputs as rounded to the dtype passed (the product precision alone). Time: stream "
              "+ finish, speed relative to fp64.", "",
              "| data | mode | DLR | abs err vs float64 data | abs err vs rounded inputs | time (s) | speed vs fp64 |",
              "|---|---|---|---|---|---|---|"]
        for r in pr["rows"]:
            L.append(f"| {r['data']} | {r['mode']} | {r['dlr']:.6f} | {r['abs_err_vs_fp64_data']:.1e} | "
                     f"{r['abs_err_vs_rounded_inputs']:.1e} | {_f(r['stream_s'])} | {r['speed_vs_fp64']:.2f}x |")
        L += ["", "GPU rows (tf32 and bf16 products, CUDA fp32/fp64): **not measured here** (this machine has no "
              "GPU). They come from `benchmarks/gpu_check.py` runs on an H200; `benchmarks/RESULTS.md`, section "
              "\"CUDA backend on an H200\", has them (this run adds no GPU rows).", "",
              f"![precision]({rel}/precision.png)", ""]
    fi = res.get("finish")
    if fi:
        L += ["### Finishing: compute() time against p and C", "",
              "DLR only = `state_dict()` + `_finish.dlr_of_state` (what `Monitor` and the jackknife use: an "
              "eigendecomposition of the C x C output Gram, or of p x p matrices in head mode when C > p); "
              "report = `Moments.compute()` (adds the p x p spectrum, curves, isotropic reference).", "",
              "| p | C | DLR only, head (ms) | DLR only, streamed (ms) | report, head (ms) | report, streamed (ms) |",
              "|---|---|---|---|---|---|"]
        for r in sorted(fi["rows"], key=lambda r: (r["C"] != 100, r["p"], r["C"])):
            L.append(f"| {r['p']:,} | {r['C']:,} | {r['dlr_only_head_s'] * 1e3:.2f} | "
                     f"{r['dlr_only_streamed_s'] * 1e3:.2f} | {r['report_head_s'] * 1e3:.1f} | "
                     f"{r['report_streamed_s'] * 1e3:.1f} |")
        L += ["", f"![finishing]({rel}/finish.png)", ""]
    text = "\n".join(L) + "\n"
    with open(md_path, "w") as fh:
        fh.write(text)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test, about a minute)")
    ap.add_argument("--only", default="scaling,h2h,precision,finish")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per timing (median reported)")
    ap.add_argument("--data", default=os.environ.get("RICHNESS_BENCH_DATA", "/tmp/richness_bench_data"),
                    help="where the generated memory-mapped files go (about 3 GB)")
    ap.add_argument("--out", default=None, help="default benchmarks/results (with --quick: DATA/quick)")
    ap.add_argument("--md", default=None, help="default benchmarks/results/compare.md (with --quick: in --out); fold a run into RESULTS.md by hand")
    ap.add_argument("--threads", type=int, default=1,
                    help="BLAS/OpenMP threads of every library (0: their defaults). 1 by default: on cores shared "
                         "with other jobs, multithreaded BLAS made compute() times swing 10-50x")
    ap.add_argument("--md-only", action="store_true", help="redraw plots and markdown from the saved JSON")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if THREADS > 0:
        import torch

        torch.set_num_threads(THREADS)
    if args.worker is not None:
        print("RESULT " + json.dumps(_worker(json.loads(args.worker))), flush=True)
        return 0
    if args.out is None:
        args.out = os.path.join(args.data, "quick") if args.quick else os.path.join(HERE, "results")
    if args.md is None:
        args.md = os.path.join(args.out, "compare.md") if args.quick else os.path.join(HERE, "results", "compare.md")
    os.makedirs(args.data, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    if args.md_only:
        with open(os.path.join(args.out, "compare.json")) as fh:
            res = json.load(fh)
        made = plots(res, args.out)
        markdown(res, args.md, args.out)
        log(f"wrote {args.md}, " + ", ".join(made))
        return 0
    t_start = time.perf_counter()
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    json_path = os.path.join(args.out, "compare.json")
    res = {}
    if os.path.exists(json_path) and set(sections) != {"scaling", "h2h", "precision", "finish"}:
        with open(json_path) as fh:  # a partial rerun keeps the other sections
            res = json.load(fh)
    res.update({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
                "repeats": args.repeats, "quick": args.quick, "threads": args.threads,
                "command": "python benchmarks/compare.py" + (" --quick" if args.quick else "")
                + ("" if args.only == ap.get_default("only") else f" --only {args.only}")
                + ("" if args.threads == 1 else f" --threads {args.threads}")})
    ref_cache = {}
    log(f"machine: {res['machine']}")
    for name in sections:
        t0 = time.perf_counter()
        if name == "scaling":
            res["scaling"] = section_scaling(args, ref_cache)
        elif name == "h2h":
            res["h2h"] = section_h2h(args)
        elif name == "precision":
            res["precision"] = section_precision(args)
        elif name == "finish":
            res["finish"] = section_finish(args)
        else:
            raise SystemExit(f"unknown section {name!r}")
        res.setdefault("section_wall_s", {})[name] = time.perf_counter() - t0
        log(f"[{name}: {time.perf_counter() - t0:.0f} s]")
        with open(json_path, "w") as fh:
            json.dump(res, fh, indent=1)
    res["wall_s"] = time.perf_counter() - t_start
    with open(json_path, "w") as fh:
        json.dump(res, fh, indent=1)
    made = plots(res, args.out)
    markdown(res, args.md, args.out)
    log(f"wrote {json_path}, {args.md}, " + ", ".join(made))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
