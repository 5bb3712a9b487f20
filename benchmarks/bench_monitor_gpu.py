"""Monitor overhead on a GPU, and evaluate/Monitor correctness on the device.

ResNet-18-like network (CIFAR stem, BasicBlocks 64-128-256-512, global pool,
Linear 512 -> 10) on random CIFAR-size data (3 x 32 x 32), batch 256, SGD,
cross-entropy. Steps are timed in blocks with one synchronisation at the end
of each block (so the monitor's own synchronisation at emission is counted);
configurations alternate block by block; the number per configuration is the
median over blocks of the mean step time. Target: every=1 at most 1%
(benchmarks/RESULTS.md, "Monitor overhead, H200").

Checks first (printed as PASS/FAIL): evaluate() on the GPU against
evaluate() of the same model on the CPU, and the first every=1 record against
the n x n oracle on the captured activations.

    python benchmarks/bench_monitor_gpu.py [--blocks 12] [--block 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

import richness

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from reference import dlr_naive  # noqa: E402


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        return torch.relu(self.b2(self.c2(y)) + self.skip(x))


class ResNet18(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        h = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(h, 1), 1))


def checks(dev: torch.device) -> dict:
    out = {}
    torch.manual_seed(0)
    model = ResNet18().to(dev)
    g = torch.Generator().manual_seed(0)
    X = torch.randn(1024, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (1024,), generator=g)
    loader = [(X[i:i + 256], y[i:i + 256]) for i in range(0, 1024, 256)]
    rep_dev = richness.evaluate(model, loader, progress=False, precision="fp32")
    rep_cpu = richness.evaluate(model.cpu(), loader, progress=False, precision="fp32")
    model.to(dev)
    out["evaluate_dlr_device"] = rep_dev.dlr
    out["evaluate_dlr_cpu"] = rep_cpu.dlr
    out["evaluate_nc1_device"] = rep_dev.nc1
    out["evaluate_nc1_cpu"] = rep_cpu.nc1
    out["evaluate_ok"] = abs(rep_dev.dlr - rep_cpu.dlr) < 1e-4 and abs(rep_dev.nc1 - rep_cpu.nc1) < 1e-3 * rep_cpu.nc1
    grabbed = []
    h = model.fc.register_forward_hook(lambda m, a, o: grabbed.append((a[0].detach().double().cpu().numpy(),
                                                                        o.detach().double().cpu().numpy())))
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with richness.Monitor(model, richness.EveryStep()) as mon:
        xb, yb = X[:256].to(dev), y[:256].to(dev)
        loss = nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mon.step(labels=yb)
    h.remove()
    want, r = dlr_naive(*grabbed[0])
    out["monitor_dlr"] = mon.history[0]["dlr"]
    out["monitor_oracle"] = want
    out["monitor_ok"] = abs(mon.history[0]["dlr"] - want) < 1e-4 and mon.history[0]["rank"] == r
    # the Moments path on the device (window of 2 batches: n = 512 >= p)
    with richness.Monitor(model, richness.Window(2, 2)) as mon2:
        for s in range(2):
            loss = nn.functional.cross_entropy(model(X[s * 256:(s + 1) * 256].to(dev)), y[s * 256:(s + 1) * 256].to(dev))
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon2.step(labels=y[s * 256:(s + 1) * 256].to(dev))
    out["monitor_window_record"] = mon2.history[0]
    if dev.type == "cuda":
        # Host synchronisations inside Monitor.step (the training loop's side):
        # the one-batch path (every=1; lag=2 so that steps 2 and 4 also reduce a
        # group) and the Moments path's update (window=10).
        for name, cfg in (("every=1", dict(route=richness.EveryStep(2))),
                          ("window update", dict(route=richness.Window(10, 10)))):
            with richness.Monitor(model, **cfg) as mon3:
                msg = "none"
                for s in range(4):
                    xb, yb = X[s * 256:(s + 1) * 256].to(dev), y[s * 256:(s + 1) * 256].to(dev)
                    loss = nn.functional.cross_entropy(model(xb), yb)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    if s == 0:
                        mon3.step(labels=yb)  # the first step may sync once (setup)
                        continue
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        mon3.step(labels=yb)
                    except RuntimeError as e:
                        msg = str(e).splitlines()[0][:200]
                        break
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
            out[f"sync_in_step[{name}]"] = msg
            out[f"records[{name}]"] = len(mon3.history)
    return out


CONFIGS = {"off": None, "every=1 (DLR + NC1)": dict(route=richness.EveryStep()),
           "every=10, window=10": dict(route=richness.Window(10, 10)),
           "default (every=100, window=10)": dict()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=12, help="timed blocks per configuration")
    ap.add_argument("--block", type=int, default=20, help="steps per block")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-checks", action="store_true")
    args = ap.parse_args()
    dev = torch.device(args.device)
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if not args.no_checks:
        t0 = time.time()
        res["checks"] = checks(dev)
        res["checks_s"] = round(time.time() - t0, 1)
        print(json.dumps(res["checks"], default=float), flush=True)
    torch.backends.cudnn.benchmark = True
    g = torch.Generator(device="cpu").manual_seed(1)
    data = [(torch.randn(args.batch, 3, 32, 32, generator=g).to(dev), torch.randint(0, 10, (args.batch,), generator=g).to(dev))
            for _ in range(8)]
    models, opts, mons = {}, {}, {}
    for name, cfg in CONFIGS.items():
        torch.manual_seed(0)
        models[name] = ResNet18().to(dev).to(memory_format=torch.channels_last)
        opts[name] = torch.optim.SGD(models[name].parameters(), lr=0.05, momentum=0.9)
        mons[name] = richness.Monitor(models[name], **cfg) if cfg is not None else None
    counters = dict.fromkeys(CONFIGS, 0)

    def block(name: str, steps: int) -> float:
        model, opt, mon = models[name], opts[name], mons[name]
        torch.cuda.synchronize(dev) if dev.type == "cuda" else None
        t0 = time.perf_counter()
        for _ in range(steps):
            x, y = data[counters[name] % len(data)]
            counters[name] += 1
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if mon is not None:
                mon.step(labels=y)
        torch.cuda.synchronize(dev) if dev.type == "cuda" else None
        return (time.perf_counter() - t0) / steps

    for name in CONFIGS:
        block(name, 30)  # warm-up: cudnn autotuning, allocator, first emissions
    times = {name: [] for name in CONFIGS}
    names = list(CONFIGS)
    for i in range(args.blocks):
        for name in names[i % len(names):] + names[:i % len(names)]:
            times[name].append(block(name, args.block))
    for m in mons.values():
        if m is not None:
            m.close()
    base = statistics.median(times["off"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"config": name, "steps": len(ts) * args.block, "median_step_ms": med * 1e3,
                     "min_block_ms": min(ts) * 1e3, "overhead": med / base - 1.0})
    res["rows"] = rows
    print(f"{res['device']}, torch {res['torch']}, batch {args.batch}, {args.blocks} blocks of {args.block} steps")
    print(f"{'config':<34} {'steps':>6} {'median step ms':>15} {'best block ms':>14} {'overhead':>9}")
    for r in rows:
        print(f"{r['config']:<34} {r['steps']:6d} {r['median_step_ms']:15.3f} {r['min_block_ms']:14.3f} "
              f"{100 * r['overhead']:8.2f}%")
    out = args.json or (os.path.join(os.environ["OUT"], "bench_monitor_gpu.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1, default=float)


if __name__ == "__main__":
    main()
