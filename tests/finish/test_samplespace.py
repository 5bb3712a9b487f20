"""The sample-space finish (``richness.finish.samplespace``) where the compiled core cannot be imported.

A child process blocks ``richness._core`` and ``richness._cuda`` before any
richness import, forms a batch's Gram rows in numpy as the one-batch routes
lay them out (docs/MATH.md, a single batch with fewer rows than features) and
finishes them with ``finish_steps``: DLR, rank, NC1 and the participation
ratio must equal the naive references, on a batch with fewer rows than
features and more outputs than rows (the n x n form) and on one with more
rows than features (the C x C form).
"""

import json
import subprocess
import sys

import numpy as np

from reference import dlr_naive, nc1_naive, participation_ratio_naive

RTOL = 1e-10

CHILD = r"""
import json, sys
sys.modules["richness._core"] = None
sys.modules["richness._cuda"] = None

import numpy as np

from richness.finish.samplespace import GramRows, finish_steps

rtol = float(sys.argv[2])
out = {"core": repr(sys.modules["richness._core"])}
with np.load(sys.argv[1]) as f:
    for name in ("narrow", "wide"):
        X, F, y = f[name + "_X"], f[name + "_F"], f[name + "_y"]
        n, p = X.shape
        Xc, Fc = X - X.mean(axis=0), F - F.mean(axis=0)
        G = Xc @ Xc.T
        sample_space = F.shape[1] > n
        A, Q = (Fc @ Fc.T, G) if sample_space else (Fc.T @ Fc, Fc.T @ G @ Fc)
        classes = np.unique(y)
        Y = (y[:, None] == classes[None, :]).astype(np.float64)
        counts = Y.sum(axis=0)
        Yn = Y / counts
        rows = GramRows(np.array([np.linalg.norm(G)]), A[None], Q[None], counts[None], (Yn.T @ G @ Yn)[None],
                        ((G @ Yn).T @ (G @ Yn))[None], np.zeros(1), np.linalg.eigvalsh(G)[::-1][None].copy())
        (dlr,), (rank,), (nc1,), extra = finish_steps(rows, n, rtol, sample_space, ("participation_ratio",),
                                                      active=np.array([float(p)]))
        out[name] = {"sample_space": sample_space, "dlr": dlr, "rank": rank, "nc1": nc1,
                     "participation_ratio": extra["participation_ratio"][0]}
print(json.dumps(out))
"""


def _batch(n, p, c, k, seed):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % k
    X = rng.standard_normal((n, p)) + 2.0 * rng.standard_normal((k, p))[y]
    F = X @ rng.standard_normal((p, c)) + 0.5 * rng.standard_normal((n, c))
    return X, F, y


def test_samplespace_finish_without_the_compiled_core(tmp_path):
    batches = {"narrow": _batch(12, 30, 20, 3, 1), "wide": _batch(400, 6, 3, 4, 2)}
    path = tmp_path / "batches.npz"
    np.savez(path, **{f"{name}_{key}": v for name, b in batches.items() for key, v in zip("XFy", b)})

    r = subprocess.run([sys.executable, "-c", CHILD, str(path), repr(RTOL)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["core"] == "None"
    assert out["narrow"]["sample_space"] and not out["wide"]["sample_space"]
    for name, (X, F, y) in batches.items():
        got = out[name]
        want_dlr, want_rank = dlr_naive(X, F, RTOL)
        assert 0.02 < want_dlr < 0.98, (name, want_dlr)  # a value that tells right from wrong
        assert abs(got["dlr"] - want_dlr) <= 1e-9, (name, got["dlr"], want_dlr)
        assert got["rank"] == want_rank == min(F.shape[1], len(y) - 1)
        want_nc1 = nc1_naive(X, y, RTOL)
        assert abs(got["nc1"] - want_nc1) <= 1e-9 * want_nc1, (name, got["nc1"], want_nc1)
        want_pr = participation_ratio_naive(X)
        assert abs(got["participation_ratio"] - want_pr) <= 1e-9 * want_pr, (name, got["participation_ratio"])
