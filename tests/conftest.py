"""What the test files share: the tests folder and its subfolders on the import
path (for ``reference``, ``tiny_models``, this file's helpers and the helpers one
test file takes from another) and the data and ports several files need. The
subfolders mirror the package: ``engine/`` (richness._engine: Moments,
Similarity, inputs, state files, merges, the CUDA backend), ``finish/``,
``models/`` (richness.torch: hooks, evaluate, similarity over models),
``monitor/``, ``metric/`` (richness.torchmetrics) and ``cli/``; the top-level
modules' tests and the package-wide ones (layers, public surface, README, the
contract harness) sit here. No folder is named after a library (``torch``,
``torchmetrics``): with this folder on the import path it would stand in for
that library wherever the library is missing."""

import os
import socket
import sys

import numpy as np

TESTS = os.path.dirname(os.path.abspath(__file__))
TEST_DIRS = [TESTS] + sorted(
    os.path.join(TESTS, d) for d in os.listdir(TESTS)
    if os.path.isdir(os.path.join(TESTS, d)) and any(f.startswith("test_") for f in os.listdir(os.path.join(TESTS, d))))
sys.path[:0] = [d for d in TEST_DIRS if d not in sys.path]


def linear_data(n=300, p=10, c=3, seed=0, classes=None, shift=2.0, noise=0.3, head=False):
    """Seeded rows for the streaming tests: features (n, p) with correlated
    columns around ``shift``, outputs (n, c) a linear head ``W`` (c, p) of
    them plus ``noise``, labels in ``range(classes)`` (default ``c``).
    Returns ``(X, F, y)``, or ``(X, F, y, W)`` with ``head=True``."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, p)) @ rng.normal(size=(p, p)) + shift
    W = rng.normal(size=(c, p))
    F = X @ W.T + noise * rng.normal(size=(n, c))
    y = rng.integers(0, c if classes is None else classes, n)
    return (X, F, y, W) if head else (X, F, y)


def free_port():
    """A TCP port on 127.0.0.1 free at the time of the call (for a
    torch.distributed rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def torchrun(tmp_path, template, nproc=2, timeout=300):
    """Run ``template`` (a script formatted with ``tests``, this folder, and
    ``out``, the prefix of the files ``out.RANK`` it writes one JSON document
    to per rank) under ``torch.distributed.run`` with ``nproc`` processes of
    one thread each on a free port; the ranks' documents, in rank order."""
    import json
    import subprocess

    out = str(tmp_path / "rank")
    script = tmp_path / "run.py"
    script.write_text(template.format(tests=TESTS, out=out))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(TEST_DIRS + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                        f"--master_port={free_port()}", str(script)], capture_output=True, text=True,
                       timeout=timeout, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = []
    for i in range(nproc):
        with open(f"{out}.{i}") as f:
            ranks.append(json.load(f))
    return ranks
