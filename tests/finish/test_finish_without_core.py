"""The finishing math where the compiled core cannot be imported.

A child process blocks ``richness._core`` and ``richness._cuda`` before any
richness import (``sys.modules[name] = None`` makes every import of them fail).
There ``import richness`` and ``import richness.finish`` must work, the
finishing math given explicit cuts must compute DLR, NC1 and the spectral
measures of a real state (streamed here by ``richness.Moments``) and both CKA
estimators of a joint state formed in numpy, and what
needs the core's precision table or accumulators must raise one clear
ImportError.
"""

import json
import subprocess
import sys

import numpy as np

import richness
from reference import (center_rows, cka_debiased_naive, cka_naive, dlr_naive, nc1_naive, participation_ratio_naive,
                       rankme_naive)

RTOL = 1e-10
MESSAGE = ("richness: the precision table and the accumulators come from the compiled core richness._core, "
           "which cannot be imported (")

CHILD = r"""
import json, sys
sys.modules["richness._core"] = None
sys.modules["richness._cuda"] = None

import numpy as np

import richness
import richness.finish as finish
from richness.finish.cka import cka_matrices
from richness.finish.diagnostics import eigenvalues_of_state, spectral_values
from richness.finish.dlr import dlr_values, span_of_grams
from richness.finish.nc1 import nc1_with_scale

rtol = float(sys.argv[2])
with np.load(sys.argv[1]) as f:
    data = {k: f[k] for k in f.files}
Phi, F = data.pop("Phi"), data.pop("F")
st = {k: (v.item() if v.ndim == 0 else v) for k, v in data.items()}

out = {"version": richness.__version__, "core": repr(sys.modules["richness._core"])}
out["dlr_state"], out["rank_state"] = (float(v) for v in finish.dlr_of_state(st, None, rtol))

# the same DLR from Gram matrices alone: A = Fc^T Fc, Q = B^T B with B = Phic^T Fc
Pc, Fc = Phi - Phi.mean(axis=0), F - F.mean(axis=0)
B = Pc.T @ Fc
a, terms = span_of_grams(Fc.T @ Fc, B.T @ B, rtol)
dlr, rank = dlr_values(float(np.linalg.norm(Pc.T @ Pc)), a, terms, rtol)
out["dlr_grams"], out["rank_grams"] = float(dlr), int(rank)

out["nc1"] = float(nc1_with_scale(st, rtol)[0])
spec = spectral_values(eigenvalues_of_state(st), rtol,
                      lam_u=eigenvalues_of_state(st, centered=False)[:min(int(st["n"]), int(st["p"]))])
out["rankme"], out["participation_ratio"] = float(spec["rankme"]), float(spec["participation_ratio"])

# CKA of Phi and F from their joint co-moments in a Similarity's layout: both blocks, then each one's
# squared norms about its first row
J = np.hstack([Phi, F, ((Phi - Phi[0]) ** 2).sum(axis=1, keepdims=True), ((F - F[0]) ** 2).sum(axis=1, keepdims=True)])
Jc = J - J.mean(axis=0)
biased, debiased, notes = cka_matrices(J.mean(axis=0), Jc.T @ Jc, len(J), ["Phi", "F"], [Phi.shape[1], F.shape[1]],
                                       np.concatenate([Phi[0], F[0]]), np.ones(2))
out["cka"], out["cka_debiased"], out["cka_notes"] = float(biased[0, 1]), float(debiased[0, 1]), notes

errors = {}
for name, call in (("finish", lambda: finish.finish(st)), ("default_rtol", lambda: finish.rtol_for("fp64")),
                   ("Moments", lambda: richness.Moments), ("blas_info", lambda: richness.blas_info)):
    try:
        call()
        errors[name] = None
    except ImportError as e:
        errors[name] = str(e)
out["errors"] = errors
print(json.dumps(out))
"""


def _data(n=400, p=6, c=3, k=4, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, k, n)
    Phi = rng.standard_normal((n, p)) @ rng.standard_normal((p, p)) + 2.0 * rng.standard_normal((k, p))[y]
    F = Phi @ rng.standard_normal((p, c)) + 0.5 * rng.standard_normal((n, c))
    return Phi, F, y


def test_finish_imports_and_computes_without_the_compiled_core(tmp_path):
    Phi, F, y = _data()
    m = richness.Moments()
    for rows in np.array_split(np.arange(len(y)), 3):
        m.update(Phi[rows], F[rows], y[rows])
    st = m.state_dict()
    assert st["precision"] == "fp64"
    path = tmp_path / "state.npz"
    np.savez(path, Phi=Phi, F=F, **{k: np.asarray(v) for k, v in st.items()})

    r = subprocess.run([sys.executable, "-c", CHILD, str(path), repr(RTOL)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["version"] == richness.__version__ and out["core"] == "None"

    want_dlr, want_rank = dlr_naive(Phi, F, RTOL)
    for key in ("state", "grams"):
        assert abs(out[f"dlr_{key}"] - want_dlr) <= 1e-9, (key, out[f"dlr_{key}"], want_dlr)
        assert out[f"rank_{key}"] == want_rank == 3
    assert 0.05 < want_dlr < 0.95  # a value that tells right from wrong
    want_nc1 = nc1_naive(Phi, y, RTOL)
    assert abs(out["nc1"] - want_nc1) <= 1e-9 * want_nc1, (out["nc1"], want_nc1)
    want_rankme = rankme_naive(Phi)  # as published: the features as given
    assert abs(out["rankme"] - want_rankme) <= 1e-9 * want_rankme
    want_pr = participation_ratio_naive(Phi)
    assert abs(out["participation_ratio"] - want_pr) <= 1e-9 * want_pr
    assert 1.0 < want_pr < 6.0 and 1.0 < want_rankme < 6.0
    assert np.linalg.matrix_rank(center_rows(Phi)) == 6
    want_cka, want_deb = cka_naive(Phi, F), cka_debiased_naive(Phi, F)
    assert abs(out["cka"] - want_cka) <= 1e-9 and abs(out["cka_debiased"] - want_deb) <= 1e-9, (out, want_cka)
    assert 0.05 < want_deb < want_cka < 0.95 and out["cka_notes"] == []

    # what needs the core's precision table or its accumulators: one clear line naming it
    for name, err in out["errors"].items():
        assert err is not None, f"{name} did not raise ImportError without the core"
        assert err.startswith(MESSAGE) and err.endswith("); reinstall richness") and "\n" not in err, (name, err)
