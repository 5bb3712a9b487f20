"""Fingerprints of what the package computes, to show that a refactoring changed no number.

Runs a fixed set of seeded computations through the public API and prints one SHA-256 per route
of the exact bytes of every float it returns (reports, state arrays, merges, CKA). Run it on two
checkouts and compare the lines: equal hashes mean bit-identical results on that route, on that
machine and thread count (BLAS results may differ between processors).

    python benchmarks/fingerprint.py [--json OUT]
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
        out[f"moments_{name}_state"] = _digest(m.state_dict())
        out[f"moments_{name}_report"] = _digest(_report(m.compute()))
        out[f"moments_{name}_nospectrum"] = _digest(_report(m.compute(spectrum=False)))
        out[f"moments_{name}_head"] = _digest(_report(m.compute(head=W)))
        g = richness.Moments(groups=4, group_seed=3)
        g.update(X, F, labels=y)
        out[f"jackknife_{name}"] = _digest(_report(g.compute()))
        a, b = richness.Moments(), richness.Moments()
        a.update(X[:1000], F[:1000], labels=y[:1000])
        b.update(X[1000:], F[1000:], labels=y[1000:])
        a.merge(b)
        out[f"merge_two_{name}"] = _digest(a.state_dict())
        out[f"dlr_{name}"] = _digest(richness.dlr(X, F))
    X, F, y, _ = _data(2)
    s = richness.Similarity()
    for i in range(0, len(X), 700):
        s.update({"x": X[i:i + 700], "f": F[i:i + 700], "x2": np.tanh(X[i:i + 700])})
    rep = s.compute()
    out["similarity"] = _digest({"cka": rep.cka, "cka_debiased": rep.cka_debiased})
    out["cka"] = _digest([richness.cka(X, F), richness.cka(X, F, debiased=True)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the fingerprints here as well")
    args = ap.parse_args()
    fp = routes()
    for k, v in fp.items():
        print(f"{k:28s} {v}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(fp, fh, indent=1)


if __name__ == "__main__":
    main()
