"""GPU check for an H200: build the CUDA backend if needed, run the
GPU tests, then time streaming at ImageNet shape, ours against the idiomatic
torch way, and compute(). Prints a table last; writes $OUT/gpu_check.json
when OUT is set. Meant to finish in under 5 minutes.

    python benchmarks/gpu_check.py            # everything
    python benchmarks/gpu_check.py --no-tests # timings only

Shape: n = 1,310,720 samples, p = 2048 features, C = 1000 outputs, batches of
4096 rows resident on the GPU, rotated among 16 buffers (so that no batch is
served from L2 after the first pass).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(*a):
    print(*a, flush=True)


def ensure_built() -> str:
    """Import richness._cuda; build and install the package with the CUDA backend if that fails."""
    probe = [sys.executable, "-c", "import torch, richness._cuda"]
    if subprocess.run(probe, cwd="/", capture_output=True).returncode == 0:
        return "already built"
    wheels = os.path.join(REPO, "build", "gpu_wheels")  # carried in when the machine has no index
    if os.path.isdir(wheels):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheels,
                        "scipy-openblas32", "pytest"], check=False)
    t0 = time.time()
    env = dict(os.environ, CMAKE_ARGS="-DRICHNESS_CUDA=ON " + os.environ.get("CMAKE_ARGS", ""),
               CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 4))
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-v", REPO],
                       env=env, capture_output=True, text=True)
    if r.returncode != 0:
        log(r.stdout[-6000:], r.stderr[-6000:])
        raise SystemExit("build failed")
    for line in r.stdout.splitlines():
        if "richness:" in line:
            log("  " + line.strip())
    if subprocess.run(probe, cwd="/", capture_output=True).returncode != 0:
        raise SystemExit("built, but richness._cuda does not import")
    return f"built in {time.time() - t0:.0f} s"


def run_tests() -> dict:
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/engine/test_cuda.py"],
                       cwd=REPO, capture_output=True, text=True, timeout=240)
    out = r.stdout.strip().splitlines()
    summary = out[-1] if out else r.stderr[-500:]
    failures = [ln for ln in out if ln.startswith(("FAILED", "ERROR"))]
    log(r.stdout[-8000:] if r.returncode else summary)
    return {"returncode": r.returncode, "summary": summary, "failures": failures,
            "seconds": round(time.time() - t0, 1)}


def environment(torch) -> dict:
    from richness import _cuda

    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name(0),
        "nvidia_smi": smi.stdout.strip(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "backend": _cuda.device_info(0),
    }


def timed(torch, fn, reps=2) -> float:
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def benchmark(torch, args) -> dict:
    import richness
    from richness import finish as _finish

    n, p, C, nb, nbuf = args.n, args.p, args.C, args.batch, 16
    steps = n // nb
    dev = "cuda:0"
    g = torch.Generator(device=dev).manual_seed(0)
    # Features with a decaying spectrum and an offset; outputs a noisy linear read-out.
    mix = torch.randn(p, p, device=dev, generator=g) / p**0.5 * torch.linspace(1.0, 0.05, p, device=dev)
    W = torch.randn(C, p, device=dev, generator=g) / p**0.5
    X32 = [torch.randn(nb, p, device=dev, generator=g) @ mix + 1.0 for _ in range(nbuf)]
    F32 = [x @ W.T + 0.1 * torch.randn(nb, C, device=dev, generator=g) for x in X32]
    Xbf = [x.bfloat16() for x in X32]
    Fbf = [f.bfloat16() for f in F32]
    torch.cuda.synchronize()
    results = {"shape": {"n": steps * nb, "p": p, "C": C, "batch": nb, "buffers": nbuf}, "torch": {}, "ours": {},
               "variants": {}, "compute": {}, "dlr": {}}

    def inputs(prec):
        return (Xbf, Fbf) if prec == "bf16" else (X32, F32)

    # -- torch: per batch addmm_ of X^T X, X^T F, F^T F ---------------------------
    for prec in ("fp32", "tf32", "bf16"):
        Xs, Fs = inputs(prec)
        dt = Xs[0].dtype
        M = torch.zeros(p, p, device=dev, dtype=dt)
        B = torch.zeros(p, C, device=dev, dtype=dt)
        A = torch.zeros(C, C, device=dev, dtype=dt)
        torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"

        def run_torch():
            for i in range(steps):
                x, f = Xs[i % nbuf], Fs[i % nbuf]
                M.addmm_(x.T, x)
                B.addmm_(x.T, f)
                A.addmm_(f.T, f)

        for i in range(4):  # warm-up (cuBLAS heuristics, workspace)
            M.addmm_(Xs[i].T, Xs[i])
        results["torch"][prec] = timed(torch, run_torch)
        torch.backends.cuda.matmul.allow_tf32 = False
        log(f"torch {prec}: {results['torch'][prec]:.4f} s")

    # -- ours: streamed outputs and head mode, each precision ------------------------
    def run_ours(prec, with_outputs, algo="auto", block=512, keep=False, stack=0, joint=True):
        Xs, Fs = inputs(prec)
        best, m = float("inf"), None
        for _ in range(2):
            m = richness.Moments(device="cuda", precision=prec,
                                 cuda=richness.CudaOptions(stack_rows=stack, stack_joint=joint,
                                                           product=f"{algo}:{block}"))

            def step(i):
                if with_outputs:
                    m.update(Xs[i % nbuf], Fs[i % nbuf])
                else:
                    m.update(Xs[i % nbuf])

            step(0)  # allocates the state and scratch: outside the timing
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(1, steps):
                step(i)
            if stack:
                _ = m.n  # merges the rows still staged: the last flush belongs to the stream's cost
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) * steps / (steps - 1))
        assert m.n == steps * nb
        return (best, m) if keep else best

    states = {}
    for prec in ("fp32", "tf32", "bf16"):
        t_out, m_out = run_ours(prec, True, keep=True)
        t_head, m_head = run_ours(prec, False, keep=True)
        results["ours"][prec] = {"outputs": t_out, "head": t_head}
        states[prec] = (m_out, m_head)
        log(f"ours  {prec}: outputs {t_out:.4f} s, head {t_head:.4f} s")

    # -- which product the automatic choice measured and kept, per shape (first batch of each shape) --
    from richness import _cuda

    results["measured_products"] = _cuda.measured_products()
    for mp in results["measured_products"]:
        times = ", ".join(f"{a} {ms * 1e3:.0f} us" for a, ms in mp["ms"].items())
        log(f"  measured {mp['precision']} n={mp['n']} rows={mp['rows']} block={mp['block']}: {times} -> {mp['product']}")

    # -- where the time goes (torch.profiler, 16 batches each): the ratios that missed their targets --
    results["breakdown"] = {}
    for prec, with_outputs, stack in (("fp32", True, 0), ("fp32", False, 0), ("tf32", False, 0),
                                      ("bf16", False, 0), ("fp32", True, STACK_ROWS[-1])):
        name = f"{prec} {'outputs' if with_outputs else 'head'}" + (f" staged {stack}" if stack else "")
        try:
            Xs, Fs = inputs(prec)
            m = richness.Moments(device="cuda", precision=prec, cuda=richness.CudaOptions(stack_rows=stack))

            def upd(i, m=m, Xs=Xs, Fs=Fs, with_outputs=with_outputs):
                m.update(Xs[i % nbuf], Fs[i % nbuf]) if with_outputs else m.update(Xs[i % nbuf])

            def flushed(i, upd=upd, m=m, stack=stack):
                upd(i)
                if stack and i % 8 == 0:
                    _ = m.n  # staged rows merged within the profiled window
            b = kernel_breakdown(torch, flushed)
            del m
        except Exception as e:  # diagnostics must not stop the run
            b = {"error": repr(e)}
        results["breakdown"][name] = b
        for line in (breakdown_lines(name, b) if "error" not in b else [f"breakdown {name}: {b['error']}"]):
            log(line)

    # -- product variants for X^T X (head mode) ----------------------------------------
    variants = {"fp32": [("syrk", 512), ("gemm", 512), ("block_rows", 512), ("tiles", 512)],
                "tf32": [("gemm", 512), ("syrk", 512), ("block_rows", 512), ("block_rows", 1024), ("tiles", 512),
                         ("tiles", 256)],
                "bf16": [("gemm", 512), ("block_rows", 512), ("block_rows", 1024), ("tiles", 512), ("tiles", 256)]}
    for prec, vs in variants.items():
        for algo, block in vs:
            try:
                t = run_ours(prec, False, algo, block)
            except Exception as e:  # a variant cuBLAS rejects must not stop the run
                t = f"error: {e}"
            results["variants"][f"{prec}/{algo}/{block}"] = t
            log(f"  head {prec} {algo}/{block}: {t if isinstance(t, str) else f'{t:.4f} s'}")

    # -- DLR of each state (agreement across precisions at scale) ------------------------
    Wd = W.double()
    for prec, (m_out, m_head) in states.items():
        results["dlr"][prec] = {"outputs": m_out.compute().dlr, "head": m_head.compute(head_weights=Wd).dlr}
        log(f"DLR {prec}: outputs {results['dlr'][prec]['outputs']:.6f}, head {results['dlr'][prec]['head']:.6f}")

    # -- staging: Moments(cuda=CudaOptions(stack_rows=N)), same stream; the time includes the last flush ---------
    # (opt-in, not the default path; each state's DLR is compared with the unstaged one above)
    results["stacked"], results["dlr_stacked"] = {}, {}
    for prec in ("fp32", "tf32", "bf16"):
        for mode, joint, rows_list in (("head", True, STACK_ROWS), ("outputs", True, STACK_ROWS),
                                       ("outputs_split", False, STACK_ROWS[-1:])):
            for rows in rows_list:
                key = f"{prec}/{mode}/{rows}"
                try:
                    t, m = run_ours(prec, mode != "head", keep=True, stack=rows, joint=joint)
                    d = m.compute(head_weights=Wd).dlr if mode == "head" else m.compute().dlr
                    results["dlr_stacked"][key] = d
                    del m
                except Exception as e:  # a failing variant must not stop the run
                    t = f"error: {e}"
                results["stacked"][key] = t
                log(f"  stacked {key}: {t if isinstance(t, str) else f'{t:.4f} s'}"
                    + (f", DLR {results['dlr_stacked'][key]:.6f}" if key in results["dlr_stacked"] else ""))

    # -- compute() timings -------------------------------------------------------------
    m_out, m_head = states["fp32"]
    rtol = _finish.rtol_for("fp32")
    m_out.compute()  # warm-up (cuSOLVER handles, kernels)

    def dlr_alone(m, Wm):
        st = m.device_state()
        return _finish.dlr_of_state(st, Wm, rtol)

    res = results["compute"]
    res["export_state"] = timed(torch, lambda: m_out.device_state(), reps=3)
    res["dlr_alone_outputs"] = timed(torch, lambda: dlr_alone(m_out, None), reps=3)
    res["dlr_alone_head"] = timed(torch, lambda: dlr_alone(m_head, Wd), reps=3)
    res["report_outputs"] = timed(torch, lambda: m_out.compute(), reps=3)
    # Full report with NC1: a state that streamed labels too (C classes).
    K = C
    m_lab = richness.Moments(K, device="cuda", precision="fp32")
    for i in range(32):
        y = torch.randint(0, K, (nb,), device=dev, generator=g)
        m_lab.update(X32[i % nbuf], F32[i % nbuf], y)
    m_lab.compute()
    res["report_full_with_nc1"] = timed(torch, lambda: m_lab.compute(), reps=3)
    res["nc1"] = m_lab.compute().nc1
    # pieces, to see where the time goes
    S = torch.randn(p, p, device=dev, dtype=torch.float64)
    S = S @ S.T
    res["torch_eigh_p"] = timed(torch, lambda: torch.linalg.eigh(S), reps=3)
    Ac = S[:C, :C].contiguous()
    res["torch_eigh_C"] = timed(torch, lambda: torch.linalg.eigh(Ac), reps=3)
    D = torch.randn(K, p, device=dev, dtype=torch.float64)
    res["torch_svd_Kxp"] = timed(torch, lambda: torch.linalg.svd(D, full_matrices=False), reps=3)
    for k, v in res.items():
        log(f"compute {k}: {v}")
    return results


STACK_ROWS = (16384, 32768)


def kernel_breakdown(torch, update, batches: int = 16, top: int = 10) -> dict:
    """Where one configuration's time goes: ``update(i)`` for ``batches``
    batches under torch.profiler; per kernel (device time on a GPU, CPU time
    without one), per batch, and the wall time of the same loop. Device time
    much below the wall time means the loop waits on the host (launches)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    update(0)  # warm (allocations, handles)
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for i in range(1, batches + 1):
            update(i)
        sync()
        wall = time.perf_counter() - t0
    rows = []
    for e in prof.key_averages():
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us > 0:
            rows.append((us / batches, e.count / batches, e.key))
    rows.sort(reverse=True)
    busy = sum(r[0] for r in rows) if cuda else None
    return {"wall_us_per_batch": wall / batches * 1e6, "device_us_per_batch": busy,
            "kernels": [{"us_per_batch": round(u, 1), "calls_per_batch": round(c, 2), "name": k[:90]}
                        for u, c, k in rows[:top]]}


def breakdown_lines(name: str, b: dict) -> list:
    dev = b["device_us_per_batch"]
    lines = [f"breakdown {name}: wall {b['wall_us_per_batch']:.0f} us/batch"
             + (f", device busy {dev:.0f} us/batch ({dev / b['wall_us_per_batch']:.0%})" if dev else "")]
    for k in b["kernels"]:
        lines.append(f"  {k['us_per_batch']:>9.1f} us  x{k['calls_per_batch']:<5g} {k['name']}")
    return lines


def stacked_table(results: dict) -> list:
    """Staging side by side with the unstaged rows of the same run (speedups against torch)."""
    st = results.get("stacked")
    if not st:
        return []
    cols = [(r, "joint") for r in STACK_ROWS]
    lines = ["staging (Moments(cuda=CudaOptions(stack_rows=N)); opt-in; times include the last flush; "
             "dDLR = |DLR staged - DLR unstaged| of the same stream)"]
    head = f"{'precision':<10}{'mode':<9}{'unstaged':>17}"
    for rows, _ in cols:
        head += f"{'N=' + str(rows):>17}"
    head += f"{'N=' + str(STACK_ROWS[-1]) + ' split':>19}{'max dDLR':>11}"
    lines.append(head)

    def cell(t, tt, width=17):
        if isinstance(t, str) or t is None:
            return f"{'error' if isinstance(t, str) else '-':>{width}}"
        return f"{t:>{width - 8}.4f}s {tt / t:>5.2f}x"

    for prec in ("fp32", "tf32", "bf16"):
        tt = results["torch"][prec]
        for mode in ("head", "outputs"):
            row = f"{prec:<10}{mode:<9}{cell(results['ours'][prec][mode], tt)}"
            for rows, _ in cols:
                row += cell(st.get(f"{prec}/{mode}/{rows}"), tt)
            row += cell(st.get(f"{prec}/outputs_split/{STACK_ROWS[-1]}"), tt, 19) if mode == "outputs" else " " * 19
            base = results["dlr"][prec][mode]
            diffs = [abs(d - base) for k, d in results.get("dlr_stacked", {}).items()
                     if k.startswith(f"{prec}/{mode}")]
            row += f"{max(diffs):>11.1e}" if diffs else f"{'-':>11}"
            lines.append(row)
    return lines


def table(results: dict) -> str:
    lines = []
    sh = results["shape"]
    lines.append(f"streaming n={sh['n']:,} p={sh['p']} C={sh['C']} batch={sh['batch']} ({sh['buffers']} GPU buffers)")
    lines.append(f"{'precision':<10}{'torch addmm_':>14}{'ours outputs':>14}{'speedup':>9}{'ours head':>12}{'speedup':>9}"
                 f"{'best head variant':>26}")
    for prec in ("fp32", "tf32", "bf16"):
        tt = results["torch"][prec]
        o = results["ours"][prec]
        best = [(v, k.split("/", 1)[1]) for k, v in results["variants"].items()
                if k.startswith(prec + "/") and not isinstance(v, str)]
        bt, bn = min(best) if best else (float("nan"), "-")
        lines.append(f"{prec:<10}{tt:>13.4f}s{o['outputs']:>13.4f}s{tt / o['outputs']:>8.2f}x{o['head']:>11.4f}s"
                     f"{tt / o['head']:>8.2f}x{bn:>16} {bt:.4f}s")
    c = results["compute"]
    lines.append(f"compute (fp32 state, p={sh['p']}, C={sh['C']}): DLR alone {c['dlr_alone_outputs'] * 1e3:.1f} ms "
                 f"(outputs), {c['dlr_alone_head'] * 1e3:.1f} ms (head); report {c['report_outputs'] * 1e3:.1f} ms; "
                 f"full report with NC1 {c['report_full_with_nc1'] * 1e3:.1f} ms")
    lines += stacked_table(results)
    lines += ceiling_table(results)
    return "\n".join(lines)


# H200 dense peaks (TFLOP/s) of the units each precision runs on: bf16 and tf32
# tensor cores, fp32 CUDA cores.
CEILING_TFLOPS = {"bf16": 731.0, "tf32": 393.0, "fp32": 50.0}


def ceiling_table(results: dict) -> list:
    """Each mode's rate as a fraction of its ceiling, counting n p^2 flops for M (the symmetric half
    of 2 n p^2) plus 2 n p C for B and n C^2 for A in outputs mode."""
    sh = results["shape"]
    n, p, C = sh["n"], sh["p"], sh["C"]
    lines = [f"fraction of the ceiling ({', '.join(f'{k} {v:.0f}' for k, v in CEILING_TFLOPS.items())} TFLOP/s; "
             f"M counted as n p^2 flops)",
             f"{'precision':<10}{'head TFLOP/s':>14}{'of ceiling':>12}{'outputs TFLOP/s':>17}{'of ceiling':>12}"]
    for prec, peak in CEILING_TFLOPS.items():
        o = results["ours"].get(prec)
        if not o:
            continue
        head = n * p * p / o["head"] / 1e12
        outs = (n * p * p + 2 * n * p * C + n * C * C) / o["outputs"] / 1e12
        lines.append(f"{prec:<10}{head:>14.1f}{head / peak:>11.1%}{outs:>17.1f}{outs / peak:>11.1%}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-tests", action="store_true")
    ap.add_argument("--n", type=int, default=1_310_720)
    ap.add_argument("--p", type=int, default=2048)
    ap.add_argument("--C", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=4096)
    args = ap.parse_args()
    t_start = time.time()
    out = {"build": ensure_built()}
    log("build:", out["build"])
    import torch

    out["environment"] = environment(torch)
    log(json.dumps(out["environment"], indent=1))
    if not args.no_tests:
        out["tests"] = run_tests()
    try:
        out["bench"] = benchmark(torch, args)
    except Exception as e:  # keep what we have
        import traceback

        traceback.print_exc()
        out["bench_error"] = repr(e)
    out["seconds"] = round(time.time() - t_start, 1)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_check.json"), "w") as fh:
            json.dump(out, fh, indent=1, default=str)
    log("")
    log(f"{out['environment']['gpu']} | {out['environment']['nvidia_smi']} | torch {out['environment']['torch']} "
        f"(CUDA {out['environment']['torch_cuda']}) | {out['environment']['date']}")
    log(f"backend: {out['environment']['backend']}")
    if "tests" in out:
        log(f"tests/engine/test_cuda.py: {out['tests']['summary']}")
    if "bench" in out:
        log(table(out["bench"]))
    return 0 if out.get("tests", {}).get("returncode", 0) == 0 and "bench" in out else 1


if __name__ == "__main__":
    sys.exit(main())
