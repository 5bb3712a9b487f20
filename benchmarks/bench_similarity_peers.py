"""Minibatch CKA over a loader: ``richness.similarity(..., estimator="minibatch")`` against ckatorch,
torch-cka and pytorch-cka on the same models, loader and batches.

Two setups, each two models of 5 hooked layers, float32, batches of 256 (the last one smaller):

* ``mlp``: two 5-layer MLPs (Linear 256 -> 256 + ReLU, the Linear outputs hooked), inputs 256-wide;
* ``cnn``: two small CNNs on 3 x 16 x 16 inputs, the flattened maps of conv1 (3,072), pool1 (768),
  conv2 (1,536), pool2 (384) and the fc output (512).

Routes (each gives the 5 x 5 map of model a's layers against model b's):

* ``richness``: ``richness.similarity({"a": ma, "b": mb}, loader, layers, estimator="minibatch")`` (all
  10 x 10 pairs; the a x b block is read), float32 Gram products of the batch-centred rows;
* ``richness_fp64``: the same with ``precision="fp64"`` (float64 Gram products);
* ``pytorch_cka``: ``cka.compute_cka`` (pytorch-cka 1.1.3; float32, the map clamped to [0, 1]);
* ``torch_cka``: ``torch_cka.CKA(...).compare(loader)`` (torch-cka 0.21; float32, its own loop, which
  runs the models without ``torch.no_grad``);
* ``ckatorch``: ckatorch 1.0.3's ``hsic1`` on float64 Grams of each batch, summed over the loader as
  its ``cka_batch`` sums over stacked batches (its ``CKA`` class keeps only the last batch's value).

Each (route, setup, round) runs in a fresh interpreter: time of the call (after a one-batch warm-up
on copies of the models); peak memory = the high-water resident set of the warm-up and the call
(VmHWM, reset through /proc/self/clear_refs once the models, the data and the route's library are
loaded) minus the resident set at that point. Rounds interleave the routes, their order rotated
each round. The values are compared with ckatorch's (float64 throughout).

    python benchmarks/bench_similarity_peers.py [--n 10000] [--rounds 3] [--out FILE]

cka-pytorch (1.1.3) is not run: it requires torchvision, lightning and seaborn (it imports seaborn).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import types
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import proc_status_mb  # noqa: E402

ROUTES = ["richness", "richness_fp64", "pytorch_cka", "torch_cka", "ckatorch"]
SETUPS = ["mlp", "cnn"]
BATCH = 256


# -- the setups ---------------------------------------------------------------------------------------

def build(setup: str, n: int):
    """``(model a, model b, loader, layer names)``, seeded."""
    import torch

    def mlp(seed):
        torch.manual_seed(seed)
        mods = []
        for _ in range(5):
            mods += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
        return torch.nn.Sequential(*mods)

    def cnn(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 12, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                   torch.nn.Conv2d(12, 24, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                   torch.nn.Flatten(), torch.nn.Linear(384, 512))

    g = torch.Generator().manual_seed(7)
    if setup == "mlp":
        ma, mb, layers = mlp(1), mlp(2), ["0", "2", "4", "6", "8"]
        X = torch.randn(n, 256, generator=g)
    else:
        ma, mb, layers = cnn(1), cnn(2), ["0", "2", "3", "5", "7"]
        X = torch.randn(n, 3, 16, 16, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X), batch_size=BATCH, shuffle=False)
    return ma.eval(), mb.eval(), loader, layers


# -- the routes ---------------------------------------------------------------------------------------

def run_richness(ma, mb, loader, layers, precision=None):
    import richness

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = richness.similarity({"a": ma, "b": mb}, loader, layers, estimator="minibatch", precision=precision,
                                  progress=False)
    return rep.between("a", "b").cka_minibatch


def run_richness_fp64(ma, mb, loader, layers):
    return run_richness(ma, mb, loader, layers, precision="fp64")


def run_pytorch_cka(ma, mb, loader, layers):
    import cka

    return cka.compute_cka(ma, mb, loader, layers=layers, device="cpu", progress=False)[0].numpy()


def run_torch_cka(ma, mb, loader, layers):
    import torch_cka

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = torch_cka.CKA(ma, mb, model1_name="a", model2_name="b", model1_layers=layers, model2_layers=layers,
                          device="cpu")
        c.compare(loader)
    return c.export()["CKA"].detach().numpy()


def ckatorch_hsic1():
    """ckatorch's ``hsic1``. Its package imports its plotting (seaborn) first; where that is missing, its
    hsic module (torch only) is loaded from the installed files."""
    try:
        from ckatorch.hsic import hsic1
        return hsic1
    except ImportError:
        pass
    spec = importlib.util.find_spec("ckatorch")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("ckatorch is not installed")
    pkg = types.ModuleType("_ckatorch_core")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["_ckatorch_core"] = pkg
    return importlib.import_module("_ckatorch_core.hsic").hsic1


def run_ckatorch(ma, mb, loader, layers):
    import torch

    hsic1 = ckatorch_hsic1()
    feats = {}
    hooks = [m.get_submodule(ln).register_forward_hook(
        lambda _m, _i, o, key=(t, ln): feats.__setitem__(key, o.detach().flatten(1)))
        for t, m in (("a", ma), ("b", mb)) for ln in layers]
    k = len(layers)
    xy, xx, yy = torch.zeros(k, k, dtype=torch.float64), torch.zeros(k, dtype=torch.float64), \
        torch.zeros(k, dtype=torch.float64)
    try:
        with torch.no_grad():
            for (x,) in loader:
                ma(x)
                mb(x)
                # as ckatorch's cka_batch: float64, Grams by bmm, HSIC_1 of each pair
                ga = [torch.bmm(f[None].double(), f[None].double().transpose(1, 2)) for f in
                      (feats[("a", ln)] for ln in layers)]
                gb = [torch.bmm(f[None].double(), f[None].double().transpose(1, 2)) for f in
                      (feats[("b", ln)] for ln in layers)]
                for i in range(k):
                    xx[i] += hsic1(ga[i], ga[i]).sum()
                    yy[i] += hsic1(gb[i], gb[i]).sum()
                    for j in range(k):
                        xy[i, j] += hsic1(ga[i], gb[j]).sum()
    finally:
        for h in hooks:
            h.remove()
    return (xy / torch.sqrt(torch.outer(xx, yy))).numpy()


# -- one run in a fresh interpreter -------------------------------------------------------------------

def load_library(route: str) -> None:
    """Import what the route runs (its plotting modules included), before memory is measured."""
    if route == "ckatorch":
        ckatorch_hsic1()
    else:
        modules = {"pytorch_cka": "cka", "torch_cka": "torch_cka"}
        importlib.import_module(modules.get(route, "richness.torch.similarity"))


def reset_peak() -> bool:
    """Reset VmHWM to the current resident set (Linux: 5 written to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(route: str, setup: str, n: int) -> dict:
    import gc

    import torch

    fn = globals()[f"run_{route}"]
    ma, mb, loader, layers = build(setup, n)
    one = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(next(iter(loader))[0]), batch_size=BATCH)
    load_library(route)
    gc.collect()
    before = proc_status_mb("VmRSS")
    reset = reset_peak()
    fn(copy.deepcopy(ma), copy.deepcopy(mb), one, layers)  # warm-up: thread pools, first calls
    t = time.perf_counter()
    value = fn(ma, mb, loader, layers)
    seconds = time.perf_counter() - t
    return {"route": route, "setup": setup, "n": n, "seconds": seconds, "peak_mb": proc_status_mb("VmHWM") - before,
            "peak_reset": reset, "rss_before_mb": before, "cka": np.asarray(value, dtype=np.float64).tolist(),
            "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", nargs=2, metavar=("ROUTE", "SETUP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.n)))
        return
    routes, setups = args.routes.split(","), args.setups.split(",")
    runs = []
    start = time.time()
    for r in range(args.rounds):
        order = routes[r % len(routes):] + routes[:r % len(routes)]
        for route in order:
            for setup in setups:
                out = subprocess.run([sys.executable, __file__, "--n", str(args.n), "--child", route, setup],
                                     capture_output=True, text=True)
                if out.returncode:
                    print(out.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"{route} on {setup} failed")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                res["round"] = r
                runs.append(res)
                print(f"round {r} {setup:4s} {route:14s} {res['seconds']:7.3f} s  peak +{res['peak_mb']:7.1f} MB",
                      file=sys.stderr, flush=True)
    table = {}
    for setup in setups:
        ref = next((np.array(x["cka"]) for x in runs if x["setup"] == setup and x["route"] == "ckatorch"), None)
        for route in routes:
            mine = [x for x in runs if x["setup"] == setup and x["route"] == route]
            secs = [x["seconds"] for x in mine]
            diff = None if ref is None else float(np.abs(np.array(mine[0]["cka"]) - ref).max())
            table[f"{setup}/{route}"] = {
                "min_s": min(secs), "median_s": statistics.median(secs), "peak_mb": max(x["peak_mb"] for x in mine),
                "max_abs_diff_to_ckatorch": diff,
                "same_value_every_round": all(x["cka"] == mine[0]["cka"] for x in mine)}
    result = {"n": args.n, "batch": BATCH, "rounds": args.rounds, "wall_s": time.time() - start,
              "load_average": os.getloadavg(), "table": table, "runs": runs}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
