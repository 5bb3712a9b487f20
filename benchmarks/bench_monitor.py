"""Monitor overhead on a CPU training step, measured side by side in one run.

MLP 784-512-512-10, batch 128, SGD, cross-entropy, random MNIST-sized data.
Configurations take turns one step at a time (the order rotates), so that
load from other processes falls on all of them alike. Two numbers per
configuration: the median step time, and the median over 100-step cycles of
the mean step time. The second is the honest one for subsampled settings
(the default Monitor works on 10 steps of every 100, so its median step is
an idle one); for every=1 the two agree.

    python benchmarks/bench_monitor.py [--steps 600] [--threads N] [--json out.json]

Overhead = time(on) / time(off) - 1. Targets: every=1 in fp32 <= 10%,
default settings <= 3% (benchmarks/RESULTS.md, "Monitor overhead, CPU").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn as nn

import richness


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


# name -> (Monitor settings or None for no monitor, pass labels to step())
CONFIGS = {
    "off": (None, False),
    "every=1, no labels": (dict(route=richness.EveryStep()), False),
    "every=1, labels (DLR + NC1)": (dict(route=richness.EveryStep()), True),
    "every=10, window=10, labels": (dict(route=richness.Window(10, 10)), True),
    "default (every=100, window=10), labels": (dict(), True),
}
# More every / window settings (--all): every window shape the Monitor takes.
MORE = {
    "every=10, window=1, labels": (dict(route=richness.Window(10, 1)), True),
    "every=10, window=5, labels": (dict(route=richness.Window(10, 5)), True),
    "every=100, window=100, labels": (dict(route=richness.Window(100, 100)), True),
    "every=10, window=10, no labels": (dict(route=richness.Window(10, 10)), False),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600, help="measured steps per configuration (>= 200)")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--all", action="store_true", help="also the settings in MORE")
    args = ap.parse_args()
    configs = {**CONFIGS, **MORE} if args.all else CONFIGS
    if args.threads:
        torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(128, 784, generator=g), torch.randint(0, 10, (128,), generator=g)) for _ in range(50)]
    models = {name: make_model() for name in configs}
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for name, m in models.items()}
    mons = {name: (richness.Monitor(models[name], **cfg) if cfg is not None else None)
            for name, (cfg, _) in configs.items()}
    times = {name: [] for name in configs}
    counters = {name: 0 for name in configs}

    def step(name: str) -> float:
        model, opt, mon = models[name], opts[name], mons[name]
        x, y = data[counters[name] % len(data)]
        counters[name] += 1
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if mon is not None:
            mon.step(labels=y if configs[name][1] else None)
        return time.perf_counter() - t0

    for name in configs:  # warm-up (allocators, BLAS threads, first emission)
        for _ in range(args.warmup):
            step(name)
    for name in configs:  # align every configuration at the start of a 100-step cycle
        while counters[name] % 100:
            step(name)
    # Round-robin, one step per configuration in turn (the order rotates), so
    # that load from other processes falls on all configurations alike.
    names = list(configs)
    for i in range(args.steps):
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            times[name].append(step(name))
    for mon in mons.values():
        if mon is not None:
            mon.close()

    def cycles(ts):  # total time of each full 100-step cycle (the default Monitor's period)
        return [sum(ts[j:j + 100]) / 100 for j in range(0, len(ts) - 99, 100)]

    base = statistics.median(times["off"])
    base_cyc = statistics.median(cycles(times["off"]))
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        cyc = statistics.median(cycles(ts))
        rows.append({"config": name, "steps": len(ts), "median_ms": med * 1e3, "cycle_ms": cyc * 1e3,
                     "overhead_median": med / base - 1.0, "overhead_cycle": cyc / base_cyc - 1.0,
                     "emissions": len(mons[name].history) if mons[name] is not None else 0})
    info = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "blas": richness.blas_info(),
            "load_avg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(info))
    print(f"{'config':<40} {'steps':>6} {'median ms':>10} {'per-step ms, cycle median':>26} "
          f"{'overhead (median step)':>23} {'overhead (cycles)':>18}")
    for r in rows:
        print(f"{r['config']:<40} {r['steps']:6d} {r['median_ms']:10.3f} {r['cycle_ms']:26.3f} "
              f"{100 * r['overhead_median']:22.1f}% {100 * r['overhead_cycle']:17.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
