"""richness.torchmetrics.DLR.update against Moments.update on the CPU.

The metric's update is the accumulator's update plus argument handling, so the
two should cost the same; also times forward (batch value + merge) and compute.

    python benchmarks/bench_torchmetrics.py [--p 512] [--batch 256] [--outputs 10] [--reps 60]
"""

import argparse
import statistics
import time

import torch

import richness
from richness.torchmetrics import DLR


def per_call(fn, batches, reps):
    """Median over 5 rounds of the mean time of ``reps`` calls (ms)."""
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for i in range(reps):
            fn(*batches[i % len(batches)])
        rounds.append((time.perf_counter() - t) / reps * 1e3)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--p", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--outputs", type=int, default=10)
    ap.add_argument("--reps", type=int, default=60)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(a.batch, a.p, generator=g), torch.randn(a.batch, a.outputs, generator=g),
                torch.randint(0, a.outputs, (a.batch,), generator=g)) for _ in range(8)]

    m = richness.Moments(a.outputs)
    metric = DLR(a.outputs)
    fwd = DLR(a.outputs)
    for x, f, y in batches[:2]:  # warm both (allocation of the state)
        m.update(x, f, y)
        metric.update(f, y, features=x)
        fwd(f, y, features=x)
    # interleaved rounds so that load from other processes hits both alike
    t_m, t_d = [], []
    for _ in range(3):
        t_m.append(per_call(lambda x, f, y: m.update(x, f, y), batches, a.reps))
        t_d.append(per_call(lambda x, f, y: metric.update(f, y, features=x), batches, a.reps))
    t_f = per_call(lambda x, f, y: fwd(f, y, features=x), batches, a.reps // 4 or 1)
    t = time.perf_counter()
    metric.compute()
    t_c = (time.perf_counter() - t) * 1e3
    tm, td = min(t_m), min(t_d)
    print(f"p={a.p} batch={a.batch} C={a.outputs} float32, torch threads={torch.get_num_threads()}")
    print(f"Moments.update   {tm:8.3f} ms")
    print(f"DLR.update       {td:8.3f} ms  ({td / tm:.3f}x)")
    print(f"DLR.forward      {t_f:8.3f} ms  (batch value, spectrum=False, + merge)")
    print(f"DLR.compute      {t_c:8.3f} ms")


if __name__ == "__main__":
    main()
