"""richness.torchmetrics.DLR on the CPU: update against Moments.update, and
forward against update, side by side in one run.

The metric's update is the accumulator's update plus argument handling, so the
two should cost the same. forward gives the batch's own DLR and adds the
batch: one product into a batch state, its DLR (no spectrum), one merge; it
should cost at most 2x an update. Both the streamed-outputs metric and the
linear-head metric (``DLR(head=fc)``, features from the head's hook) are
timed; the calls are interleaved (each function in turn on each batch) so
that load from other processes hits all alike, and the ratios are the numbers
to read.

    python benchmarks/bench_torchmetrics.py [--p 512] [--batch 256] [--outputs 10] [--reps 40] [--rounds 5]
"""

import argparse
import os
import statistics
import time

import torch

import richness
from richness.torchmetrics import DLR


def interleaved(fns, batches, reps):
    """Per function, the mean time of ``reps`` calls (ms), the functions
    called in turn on each batch, so that load from other processes hits
    all alike; the order rotates from batch to batch, so that no function
    always follows the same one (a call that wakes a thread pool slows the
    next)."""
    total = {k: 0.0 for k in fns}
    names = list(fns)
    for i in range(reps):
        b = batches[i % len(batches)]
        for j in range(len(names)):
            k = names[(i + j) % len(names)]
            fn = fns[k]
            t = time.perf_counter()
            fn(*b)
            total[k] += time.perf_counter() - t
    return {k: v / reps * 1e3 for k, v in total.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--p", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--outputs", type=int, default=10)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    fc = torch.nn.Linear(a.p, a.outputs)
    batches = []
    for _ in range(8):
        x = torch.randn(a.batch, a.p, generator=g)
        with torch.no_grad():
            batches.append((x, fc(x), torch.randint(0, a.outputs, (a.batch,), generator=g)))

    m = richness.Moments(a.outputs)
    upd, fwd = DLR(a.outputs), DLR(a.outputs)
    head_upd, head_fwd = DLR(a.outputs, head=fc), DLR(a.outputs, head=fc)

    def with_head(metric, call):
        def run(x, f, y):
            with torch.no_grad():
                fc(x)  # the model's forward: the hook keeps x for the metric
            call(metric, f, y)
        return run

    timed = {
        "Moments.update": lambda x, f, y: m.update(x, f, y),
        "DLR.update": lambda x, f, y: upd.update(f, y, features=x),
        "DLR.forward": lambda x, f, y: fwd(f, y, features=x),
        "DLR(head).update": with_head(head_upd, lambda mt, f, y: mt.update(f, y)),
        "DLR(head).forward": with_head(head_fwd, lambda mt, f, y: mt(f, y)),
    }
    for fn in timed.values():  # warm all (allocation of the states)
        for b in batches[:2]:
            fn(*b)
    times = {k: [] for k in timed}
    for _ in range(a.rounds):
        for k, v in interleaved(timed, batches, a.reps).items():
            times[k].append(v)
    med = {k: statistics.median(v) for k, v in times.items()}
    t = time.perf_counter()
    upd.compute()
    t_c = (time.perf_counter() - t) * 1e3
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"p={a.p} batch={a.batch} C={a.outputs} float32, torch threads={torch.get_num_threads()}, "
          f"median of {a.rounds} rounds of {a.reps} interleaved calls, load average {load:.1f}")
    for k, v in med.items():
        print(f"{k:18s} {v:8.3f} ms")
    print(f"DLR.update / Moments.update          {med['DLR.update'] / med['Moments.update']:.2f}x")
    print(f"DLR.forward / DLR.update             {med['DLR.forward'] / med['DLR.update']:.2f}x")
    print(f"DLR(head).forward / DLR(head).update {med['DLR(head).forward'] / med['DLR(head).update']:.2f}x")
    print(f"DLR.compute {t_c:.3f} ms")


if __name__ == "__main__":
    main()
