"""Monitor every=1 at an ImageNet head: host cost per step, and what it goes to.

A head-only model (Linear p -> C, fed the features directly) at p = 2048,
C = 1000, batch 256 (float32), labels drawn from all 1000 classes; every=1,
lag=16. Per step: the whole Monitor (hook, copies, reduction and finishing,
amortized), and its two group parts, the reduction (Grams and small
products; on a GPU this is device work) and the host finishing (eigh of each
step's small matrices); the monitor's cost is the loop's time minus the
same forwards without it, in the same group. Side by side in one run, alternating by group:

- current: NC1 over each step's own classes, renumbered 0..n-1 (n x n);
- per-class: the head's 1,000 classes as columns (1000 x 1000 per step, the
  code before 2026-11-30 02:45 UTC), by setting the group's class columns.

The last record of each is checked against the n x n float64 oracle.

    python benchmarks/bench_monitor_head.py [--groups 4] [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

import richness
from richness.monitor import onebatch as _onebatch, routes as _routes

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from reference import dlr_naive, nc1_naive  # noqa: E402


class Timed:
    """Wall time spent in the group reduction and in the host finishing."""

    def __init__(self) -> None:
        self.reduce = self.finish = 0.0
        self._reduce = self._wrap(_onebatch.BatchGroup.reduce, "reduce")
        self._finish = self._wrap(_routes._WindowRun._finish_records, "finish")
        _onebatch.BatchGroup.reduce, _routes._WindowRun._finish_records = self._reduce, self._finish

    def _wrap(self, fn, field: str):
        def timed(*a):
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - t)
        return timed


def sync(x) -> None:
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)


def run_group(head, xs, ys, per_class: bool, lag: int, timed: Timed) -> dict:
    timed.reduce = timed.finish = 0.0
    init = _onebatch.BatchGroup.__init__

    def per_class_init(group, parts, lag_, classes):
        init(group, parts, lag_, classes)
        group.label_cols = classes

    sync(xs[0])
    t0 = time.perf_counter()
    for x in xs:  # the same forwards without a monitor
        head(x)
    sync(xs[0])
    off = time.perf_counter() - t0
    if per_class:
        _onebatch.BatchGroup.__init__ = per_class_init
    try:
        t0 = time.perf_counter()
        with richness.Monitor(head, richness.EveryStep(lag)) as mon:
            for x, y in zip(xs, ys):
                head(x)
                mon.step(labels=y)
            mon.flush()  # waits for the device's last group
        total = time.perf_counter() - t0
    finally:
        _onebatch.BatchGroup.__init__ = init
    steps = len(xs)
    return {"total_ms": (total - off) / steps * 1e3, "reduce_ms": timed.reduce / steps * 1e3,
            "finish_ms": timed.finish / steps * 1e3, "last": mon.history[-1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int, default=2048)
    ap.add_argument("--C", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lag", type=int, default=16)
    ap.add_argument("--groups", type=int, default=4, help="groups of `lag` steps per configuration")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (on a GPU, reduce is launch time: the device "
                    "work shows in the monitor column)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    head = torch.nn.Linear(args.p, args.C).to(dev)
    scale = torch.linspace(0.1, 2.0, args.p)
    xs = [(torch.randn(args.batch, args.p) * scale + 1.0).to(dev) for _ in range(args.lag)]
    ys = [torch.randint(0, args.C, (args.batch,)).to(dev) for _ in range(args.lag)]
    timed = Timed()
    runs: dict = {"current": [], "per-class": []}
    run_group(head, xs[:2], ys[:2], False, args.lag, timed)  # warm-up
    for g in range(args.groups):
        for name in (("current", "per-class") if g % 2 == 0 else ("per-class", "current")):
            runs[name].append(run_group(head, xs, ys, name == "per-class", args.lag, timed))
    # the last step's record against the oracle
    x, y = xs[-1].double().cpu().numpy(), ys[-1].cpu().numpy()
    with torch.no_grad():
        f = head(xs[-1]).double().cpu().numpy()
    (want_dlr, want_rank), want_nc1 = dlr_naive(x, f), nc1_naive(x, y)
    machine = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    out = {"machine": f"{machine}, {os.cpu_count()} cpus", "device": args.device, "torch":
           torch.__version__, "threads": args.threads, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "shape": {"p": args.p, "C": args.C, "batch": args.batch, "lag": args.lag, "groups": args.groups},
           "oracle": {"dlr": want_dlr, "nc1": want_nc1}, "configs": {}}
    print(f"Monitor every=1 at p={args.p}, C={args.C}, batch {args.batch}, labels over {args.C} classes, "
          f"lag {args.lag}, {out['machine']}, torch {args.threads} thread(s); median over {args.groups} groups")
    print(f"{'config':<11}{'monitor ms/step':>17}{'reduce':>9}{'finish':>9}{'|dDLR|':>10}{'|dNC1|/NC1':>12}")
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("total_ms", "reduce_ms", "finish_ms")}
        last = rs[-1]["last"]
        assert last["rank"] == want_rank, (last["rank"], want_rank)
        ddlr, dnc1 = abs(last["dlr"] - want_dlr), abs(last["nc1"] - want_nc1) / want_nc1
        out["configs"][name] = {**med, "dlr_error": ddlr, "nc1_rel_error": dnc1, "rank": last["rank"]}
        print(f"{name:<11}{med['total_ms']:>17.1f}{med['reduce_ms']:>9.1f}{med['finish_ms']:>9.1f}"
              f"{ddlr:>10.1e}{dnc1:>12.1e}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
