"""README.md's Python examples run as written, so they cannot drift from the API.

Each example block runs, statement by statement, after the setup block shown
above it (``# setup`` on its first line), in a fresh namespace: exactly the text
a reader pastes, no names injected. A statement whose lines carry
``# needs: X`` (or a block whose first line does) runs only where X is
available (a GPU, an initialised torch.distributed, tensorboard, lightning,
wandb, mlflow, transformers). Beyond "it runs", the values are checked against
the float64 n x n reference.
"""

import ast
import json
import importlib.util
import os
import re
import sys
import tempfile
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import richness  # noqa: E402
from reference import cka_debiased_naive, cka_naive, dlr_naive, nc1_naive  # noqa: E402

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
NEEDS = re.compile(r"#\s*needs:\s*([A-Za-z_]+(?:\.[A-Za-z_]+)*)")


def python_blocks():
    with open(README, encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def available(what: str) -> bool:
    if what == "cuda":
        return torch.cuda.is_available()
    if what == "torch.distributed":
        return torch.distributed.is_available() and torch.distributed.is_initialized()
    return importlib.util.find_spec(what) is not None


def run_block(src: str, ns: dict) -> list:
    """Execute ``src`` statement by statement in ``ns``; returns the statements skipped.
    A ``# needs: X`` on the block's first line holds for the whole block."""
    lines = src.splitlines()
    block_needs = NEEDS.findall(lines[0]) if lines else []
    if any(not available(n) for n in block_needs):
        return [src]
    skipped = []
    for stmt in ast.parse(src).body:
        text = "\n".join(lines[stmt.lineno - 1:stmt.end_lineno])
        needs = NEEDS.findall(text)
        if any(not available(n) for n in needs):
            skipped.append(text)
            continue
        exec(compile(ast.Module(body=[stmt], type_ignores=[]), "README.md", "exec"), ns)
    return skipped


def sections():
    """``(setup, example)`` pairs: each example with the setup block shown above it (a block
    whose first line is ``# setup``), or with none."""
    out, setup = [], None
    for block in python_blocks():
        if block.startswith("# setup"):
            setup = block
            continue
        out.append((setup, block))
        setup = None
    return out


def run_section(i: int) -> tuple:
    """Run section i's setup, then its example, in a fresh namespace, as a reader would paste them."""
    setup, example = sections()[i]
    ns: dict = {"__name__": "__readme__"}
    if setup is not None:
        assert run_block(setup, ns) == []
    return ns, run_block(example, ns)


@pytest.fixture
def trackers_offline(tmp_path, tmp_path_factory, monkeypatch):
    """The examples as pasted: no environment variable the README does not show
    (those of the trackers are cleared; W&B runs offline and MLflow's store is a
    temporary folder because the README says so), in a folder of their own."""
    monkeypatch.chdir(tmp_path)  # the examples write state.npz, richness.jsonl, depth.png here
    # and their temporary folders (tempfile.mkdtemp: the trackers' runs, the Trainer's output, the
    # shards; the LocalCluster's dask-scratch-space) in pytest's temporary tree, which pytest removes
    scratch = str(tmp_path_factory.mktemp("readme-tmp"))
    monkeypatch.setattr(tempfile, "tempdir", scratch)
    monkeypatch.setenv("TMPDIR", scratch)  # the LocalCluster's worker processes
    for name in list(os.environ):
        if name.startswith(("WANDB_", "MLFLOW_")):
            monkeypatch.delenv(name)
    yield tmp_path
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()  # stops W&B's service process
    if "mlflow" in sys.modules:
        sys.modules["mlflow"].set_tracking_uri(None)
    os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)  # set by the MLflow example itself


def test_readme_has_the_examples():
    secs = sections()
    assert len(secs) == 5 and all(setup is not None for setup, _ in secs[:2]) and secs[2][0] is None
    assert "richness.dlr(features, outputs)" in secs[0][1] and "richness.evaluate(model" in secs[1][1]
    assert "RichnessCallback(trainer" in secs[2][1]
    assert "richness.dask.moments(" in secs[3][1] and secs[3][0] is None


def test_first_block_runs_and_agrees_with_the_reference(trackers_offline):
    ns, skipped = run_section(0)
    assert skipped == []
    want, _ = dlr_naive(ns["features"], ns["outputs"])
    assert abs(richness.dlr(ns["features"], ns["outputs"]) - want) < 1e-10
    head_want, _ = dlr_naive(ns["features"], ns["features"] @ ns["W"].T + ns["b"])
    assert abs(richness.dlr(ns["features"], head_weights=(ns["W"], ns["b"])) - head_want) < 1e-10
    # the example's last lines: a saved and reloaded state, then reset
    assert os.path.exists("state.npz") and ns["m"].n == 0
    assert ns["r"].dlr_stderr is not None and ns["r"].dlr_stderr > 0


def test_second_block_runs(trackers_offline):
    pytest.importorskip("torchmetrics")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # finite-n caveats of the tiny data, Lightning's notices
        ns, skipped = run_section(1)
    # only what needs a GPU, a process group, tensorboard, lightning, wandb or mlflow may be left out
    for text in skipped:
        assert NEEDS.search(text), text
    for tracker in ("wandb", "mlflow"):
        assert not available(tracker) or not any(f"needs: {tracker}" in t for t in skipped)
    assert not torch.cuda.is_available() or not any("cuda" in t for t in skipped)
    report = ns["report"]
    assert set(report.layers) == {"layer2", "layer3", "layer4"}
    assert 0.0 <= report.layers["layer3"].dlr <= 1.0
    assert os.path.exists("richness.jsonl") and os.path.exists("depth.png")
    # the trackers wrote to the example's own temporary folder, not into the current one
    assert sorted(os.listdir(".")) == ["depth.png", "depth.svg", "richness.jsonl"]
    if available("tensorboard"):
        assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(ns["runs"], "exp1")))
        assert [r["step"] for r in map(json.loads, open("richness.jsonl"))][:2] == [4, 8]
    # the metric saw the example's (logits, labels, features=h) twice: update, then forward
    H, F = ns["h"].double().numpy(), ns["logits"].double().numpy()
    # float32 inputs: fp32 products and their eigenvalue cut, rtol 1e-5 (README, Precision)
    want, _ = dlr_naive(np.concatenate([H, H]), np.concatenate([F, F]), rtol=1e-5)
    assert abs(float(ns["metric"].compute()) - want) < 1e-6


def test_hugging_face_block_runs(trackers_offline):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # finite-n caveats of the tiny data
        ns, skipped = run_section(2)
    assert skipped == []
    assert os.listdir(".") == []  # the Trainer's output folder is a temporary one
    logged = [e for e in ns["trainer"].state.log_history if "richness/dlr" in e]
    assert [e["step"] for e in logged] == [2, 4]
    assert all(0.0 <= e["richness/dlr"] <= 1.0 and e["richness/nc1"] > 0 for e in logged)


def test_data_bigger_than_one_machine_block_runs(trackers_offline):
    pytest.importorskip("distributed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the LocalCluster's notices (a dashboard port in use)
        ns, skipped = run_section(3)
    for text in skipped:  # only the zarr lines may be left out, where zarr is missing
        assert "needs: zarr" in text and not available("zarr"), text
    folder = ns["folder"]
    X = np.vstack([np.load(f"{folder}/features-{i:05d}.npy") for i in range(4)]).astype(np.float64)
    y = np.concatenate([np.load(f"{folder}/labels-{i:05d}.npy") for i in range(4)])
    assert ns["m"].n == 2000 and np.array_equal(ns["m"].state_dict()["class_counts"], np.bincount(y, minlength=10))
    want, _ = dlr_naive(X, X @ ns["W"].T, rtol=1e-5)  # float32 features: fp32 products and their cut
    assert abs(ns["report"].dlr - want) < 1e-6
    assert abs(ns["report"].nc1 - nc1_naive(X, y, rtol=1e-5)) < 1e-5 * ns["report"].nc1
    assert richness.Moments.load(f"{folder}/state.npz").n == 2000
    Xc = X - X.mean(0)
    for name in ("s", "z") if available("zarr") else ("s",):
        M = ns[name].state_dict()["M"]
        assert ns[name].n == 2000 and np.abs(M - Xc.T @ Xc).max() < 1e-5 * np.abs(Xc.T @ Xc).max()


def test_similarity_section_runs_and_agrees_with_the_reference(trackers_offline):
    setup, example = sections()[4]
    assert setup is None and "richness.similarity(" in example
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ns, skipped = run_section(4)
    for text in skipped:
        assert NEEDS.search(text), text
    x, y = ns["x"], ns["y"]
    assert abs(richness.cka(x, y) - cka_naive(x, y)) < 1e-10
    r = ns["r"]
    z = np.tanh(y)
    assert abs(r.pair("x", "z").cka_debiased - cka_debiased_naive(x, z)) < 1e-10
    assert ns["t"].n == 1000 and abs(ns["t"].compute().cka[0, 1] - cka_naive(x, y)) < 1e-10
    assert ns["report"].names == ["cnn.0", "cnn.2", "cnn.5", "mlp.1", "mlp.3"] and ns["report"].n == 128
