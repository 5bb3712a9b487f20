"""Fingerprints of what the package computes, to show that a refactoring changed no number.

Runs a fixed set of seeded computations through the public API and prints one SHA-256 per route
of the exact bytes of every float it returns (reports, state arrays, merges, CKA; where torch and
torchmetrics are installed also the torchmetrics metric, the Monitor's two routes and evaluate, on
2 torch threads). Run it on two checkouts and compare the lines: equal hashes mean bit-identical
results on that route, on that machine and thread count (BLAS results may differ between
processors).

    python benchmarks/fingerprint.py [--json OUT] [--fields]

With --fields it also prints a digest per field of each report, record list and state dict, so
that a change of one definition shows as that field alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import numpy as np

import richness


def _digest(values) -> str:
    h = hashlib.sha256()

    def add(v):
        if isinstance(v, dict):
            for k in sorted(v):
                h.update(str(k).encode())
                add(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                add(x)
        elif isinstance(v, np.ndarray):
            h.update(str(v.dtype).encode() + str(v.shape).encode())
            h.update(np.ascontiguousarray(v).tobytes())
        elif v is None or isinstance(v, (str, bool)):
            h.update(repr(v).encode())
        else:
            h.update(np.float64(v).tobytes())
    add(values)
    return h.hexdigest()


# Per-field digests of the routes whose value is a report, a record list or a state dict
# (filled only with --fields): they show which fields a change moved.
_FIELDS: dict | None = None


def _put(out: dict, name: str, values) -> None:
    out[name] = _digest(values)
    if _FIELDS is None:
        return
    if isinstance(values, dict):
        _FIELDS[name] = {str(k): _digest(v) for k, v in values.items()}
    elif isinstance(values, list) and values and all(isinstance(v, dict) for v in values):
        keys = sorted({str(k) for v in values for k in v})
        _FIELDS[name] = {k: _digest([v.get(k) for v in values]) for k in keys}


def _data(seed: int, n: int = 3000, p: int = 48, C: int = 7, dtype=np.float32):
    rng = np.random.default_rng(seed)
    X = (rng.standard_normal((n, 8)) @ rng.standard_normal((8, p)) + 0.3 * rng.standard_normal((n, p)) + 2.0)
    W = rng.standard_normal((C, p))
    y = rng.integers(0, C, n)
    return X.astype(dtype), (X @ W.T).astype(dtype), y, W


def _report(rep) -> dict:
    return {k: (np.asarray(v) if isinstance(v, list) else v) for k, v in rep.to_dict().items()
            if not isinstance(v, str) and k != "time"}


def routes() -> dict:
    out = {}
    for name, dtype in (("fp32", np.float32), ("fp64", np.float64)):
        X, F, y, W = _data(1, dtype=dtype)
        m = richness.Moments()
        for i in range(0, len(X), 512):
            m.update(X[i:i + 512], F[i:i + 512], labels=y[i:i + 512])
        _put(out, f"moments_{name}_state", m.state_dict())
        _put(out, f"moments_{name}_report", _report(m.compute()))
        _put(out, f"moments_{name}_nospectrum", _report(m.compute(spectrum=False)))
        _put(out, f"moments_{name}_head", _report(m.compute(head_weights=W)))
        g = richness.Moments(groups=4, group_seed=3)
        g.update(X, F, labels=y)
        _put(out, f"jackknife_{name}", _report(g.compute()))
        a, b = richness.Moments(), richness.Moments()
        a.update(X[:1000], F[:1000], labels=y[:1000])
        b.update(X[1000:], F[1000:], labels=y[1000:])
        a.merge(b)
        _put(out, f"merge_two_{name}", a.state_dict())
        _put(out, f"dlr_{name}", richness.dlr(X, F))
    X, F, y, _ = _data(2)
    s = richness.Similarity()
    for i in range(0, len(X), 700):
        s.update({"x": X[i:i + 700], "f": F[i:i + 700], "x2": np.tanh(X[i:i + 700])})
    rep = s.compute()
    _put(out, "similarity", {"cka": rep.cka, "cka_debiased": rep.cka_debiased})
    _put(out, "cka", [richness.cka(X, F), richness.cka(X, F, debiased=True)])
    out.update(torch_routes())
    return out


def _record(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k not in ("time", "wall_time")}


def torch_routes() -> dict:
    """The routes through torch (skipped without torch and torchmetrics):
    the torchmetrics metric (update, forward's per-batch values at 128 and
    512 rows, a linear head), the Monitor's every=1 and window routes, and
    evaluate over a loader."""
    try:
        import torch
        import torchmetrics  # noqa: F401
    except ImportError:
        return {}
    from richness.torchmetrics import DLR

    out = {}
    torch.manual_seed(0)
    torch.set_num_threads(2)
    for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64)):
        X, F, y, W = (torch.from_numpy(np.ascontiguousarray(a)) for a in _data(3, n=2048, p=320, C=10))
        X, F = X.to(dtype), F.to(dtype)
        values = {}
        for rows in (128, 512):  # one-batch Grams: below and above the two-thread split
            metric = DLR(num_classes=10)
            values[rows] = [metric(F[i:i + rows], y[i:i + rows], features=X[i:i + rows])
                            for i in range(0, len(X), rows)]
            values[f"{rows}_compute"] = metric.compute()
            values[f"{rows}_state"] = {k: v for k, v in metric.metric_state.items()}
        _put(out, f"torchmetrics_{name}", {str(k): [np.asarray(t) for t in v] if isinstance(v, list)
                                           else {a: np.asarray(b) for a, b in v.items()} if isinstance(v, dict)
                                           else np.asarray(v) for k, v in values.items()})
        head = torch.nn.Linear(320, 10).to(dtype)
        metric = DLR(num_classes=10, head=head)
        vals = []
        for i in range(0, len(X), 256):
            head(X[i:i + 256])
            vals.append(np.asarray(metric(target=y[i:i + 256])))
        _put(out, f"torchmetrics_head_{name}", vals + [np.asarray(metric.compute())])

    def mlp():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.ReLU(), torch.nn.Linear(300, 10))

    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(256, 40, generator=g), torch.randint(0, 10, (256,), generator=g)) for _ in range(40)]
    for name, route in (("every1", richness.EveryStep()), ("window", richness.Window(every=10, window=5))):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        mon = richness.Monitor(model, route)
        for x, t in batches:
            loss = torch.nn.functional.cross_entropy(model(x), t)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(labels=t)
        mon.close()
        _put(out, f"monitor_{name}", [_record(r) for r in mon.history])
    rep = richness.evaluate(mlp(), batches, progress=False)
    _put(out, "evaluate", _report(rep))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the fingerprints here as well")
    ap.add_argument("--fields", action="store_true",
                    help="also a digest per field of each report, record list and state dict")
    args = ap.parse_args()
    global _FIELDS
    if args.fields:
        _FIELDS = {}
    fp = routes()
    for k, v in fp.items():
        print(f"{k:28s} {v}")
    if _FIELDS:
        for route, fields in _FIELDS.items():
            for k, v in fields.items():
                print(f"{route}.{k:40s} {v}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**fp, "fields": _FIELDS} if _FIELDS else fp, fh, indent=1)


if __name__ == "__main__":
    main()
