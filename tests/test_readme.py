"""The Python examples of README.md and of every page of the documentation
(docs/**/*.md) run as written, so they cannot drift from the API.

Each example block runs, statement by statement, after the latest setup block
shown above it on the same page (``# setup`` on its first line), in a fresh
namespace: exactly the text a reader pastes, no names injected. A statement
whose lines carry ``# needs: X`` (or a block whose first line does) runs only
where X is available (a GPU, an initialised torch.distributed, tensorboard,
lightning, wandb, mlflow, transformers, torchmetrics, distributed, zarr).
Beyond "it runs", the values of the main examples are checked against the
float64 n x n reference (``CHECKS``).
"""

import ast
import glob
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
from reference import (  # noqa: E402
    cka_debiased_naive, cka_naive, dlr_naive, nc1_naive, participation_ratio_naive, rankme_naive)

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), os.pardir))
README = os.path.join(ROOT, "README.md")
NEEDS = re.compile(r"#\s*needs:\s*([A-Za-z_]+(?:\.[A-Za-z_]+)*)")


def pages() -> list:
    """README.md and every Markdown page of docs/, as paths relative to the repository."""
    docs = sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    return ["README.md"] + [os.path.relpath(p, ROOT).replace(os.sep, "/") for p in docs]


def python_blocks(page: str = "README.md"):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def available(what: str) -> bool:
    if what == "cuda":
        return torch.cuda.is_available()
    if what == "torch.distributed":
        return torch.distributed.is_available() and torch.distributed.is_initialized()
    return importlib.util.find_spec(what) is not None


def run_block(src: str, ns: dict, page: str = "README.md") -> list:
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
        exec(compile(ast.Module(body=[stmt], type_ignores=[]), page, "exec"), ns)
    return skipped


def sections(page: str = "README.md") -> list:
    """``(setup, example)`` pairs of a page: each example with the latest setup block shown above
    it on that page (a block whose first line is ``# setup``), or with none."""
    out, setup = [], None
    for block in python_blocks(page):
        if block.startswith("# setup"):
            setup = block
            continue
        out.append((setup, block))
    return out


def run_section(i: int, page: str = "README.md") -> tuple:
    """Run section i's setup, then its example, in a fresh namespace, as a reader would paste them."""
    setup, example = sections(page)[i]
    ns: dict = {"__name__": "__readme__"}
    if setup is not None:
        assert run_block(setup, ns, page) == []
    return ns, run_block(example, ns, page)


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



# -- what the main examples must compute (each found by a text only its example holds) ----------


def jsonl_steps(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["step"] for line in f]


def check_quickstart_evaluate(ns):
    """README: a trained model's DLR is the n x n formula's on its head's input and output, and
    the README shows the value it prints."""
    model, X = ns["model"], ns["X"]
    with torch.no_grad():
        H, F = model[:-1](X).double().numpy(), model(X).double().numpy()
    want, _ = dlr_naive(H, F, rtol=1e-5)  # float32 inputs: fp32 products and their cut
    assert abs(ns["report"].dlr - want) < 1e-6
    with open(README, encoding="utf-8") as f:
        shown = re.search(r"```text\nDLR (\d\.\d+)", f.read())
    assert shown and abs(float(shown.group(1)) - ns["report"].dlr) < 0.01


def check_quickstart_similarity(ns):
    """README: the CKA of two models' layers is the n x n formula's on their outputs."""
    X = ns["loader"].dataset
    with torch.no_grad():
        a, b = ns["models"]["narrow"][:5](X).double().numpy(), ns["models"]["wide"][:4](X).double().numpy()
    assert abs(ns["report"].pair("narrow.4", "wide.3").cka - cka_naive(a, b)) < 1e-6
    assert os.path.exists("cka_map.png") and os.path.exists("cka_map.svg")


def check_quickstart_monitor(ns):
    """README: a record every 50 steps, in the history and the JSONL file; DLR/iso falls as the
    README says."""
    history = ns["mon"].history
    assert [r["step"] for r in history] == [50, 100, 150, 200]
    assert jsonl_steps("richness.jsonl") == [50, 100, 150, 200]
    first, last = history[0]["dlr_normalized"], history[-1]["dlr_normalized"]  # README: 0.55 -> 0.23
    assert abs(first - 0.55) < 0.03 and abs(last - 0.23) < 0.03


def check_arrays(ns):
    """guide/evaluating: one shot, head shortcut, save and reset, error bars."""
    want, _ = dlr_naive(ns["features"], ns["outputs"])
    assert abs(richness.dlr(ns["features"], ns["outputs"]) - want) < 1e-10
    head_want, _ = dlr_naive(ns["features"], ns["features"] @ ns["W"].T + ns["b"])
    assert abs(richness.dlr(ns["features"], head_weights=(ns["W"], ns["b"])) - head_want) < 1e-10
    # the example's last lines: a saved and reloaded state, then reset
    assert os.path.exists("state.npz") and ns["m"].n == 0
    assert ns["r"].dlr_stderr is not None and ns["r"].dlr_stderr > 0


def check_evaluate(ns):
    report = ns["report"]
    assert set(report.layers) == {"layer2", "layer3", "layer4"}
    assert 0.0 <= report.layers["layer3"].dlr <= 1.0
    assert sorted(os.listdir(".")) == ["depth.png", "depth.svg"]


def check_baselines(ns):
    """guide/evaluating: S_init is the CKA of the trained and the initial features on the same rows."""
    X = ns["X"]
    with torch.no_grad():
        now, init = ns["model"][:-1](X).double().numpy(), ns["init"][:-1](X).double().numpy()
    assert abs(ns["s_init"].compute() - cka_naive(now, init)) < 1e-6


def check_metric(ns):
    """The metric saw the example's (logits, labels, features=h) twice: update, then forward."""
    H, F = ns["h"].double().numpy(), ns["logits"].double().numpy()
    # float32 inputs: fp32 products and their eigenvalue cut, rtol 1e-5 (guide/precision)
    want, _ = dlr_naive(np.concatenate([H, H]), np.concatenate([F, F]), rtol=1e-5)
    assert abs(float(ns["metric"].compute()) - want) < 1e-6


def check_monitor(ns):
    assert jsonl_steps("richness.jsonl") == [4, 8]
    assert [r["step"] for r in ns["mon"].history] == [4, 8]


def check_loggers(ns):
    # the trackers wrote to the example's own temporary folder, not into the current one
    assert sorted(os.listdir(".")) == ["richness.csv"] + (["richness.jsonl"] if available("tensorboard") else [])
    with open("richness.csv", encoding="utf-8") as f:
        rows = f.read().splitlines()
    assert rows[0].startswith("step,") and [r.split(",")[0] for r in rows[1:]] == ["4", "8"]
    assert [r["step"] for r in ns["records"]] == [4, 8]
    if available("tensorboard"):
        assert jsonl_steps("richness.jsonl") == [4, 8]
        assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(ns["runs"], "exp1")))


def check_hugging_face(ns):
    assert os.listdir(".") == []  # the Trainer's output folder is a temporary one
    logged = [e for e in ns["trainer"].state.log_history if "richness/dlr" in e]
    assert [e["step"] for e in logged] == [2, 4]
    assert all(0.0 <= e["richness/dlr"] <= 1.0 and e["richness/nc1"] > 0 for e in logged)


def check_dask(ns):
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


def check_cka(ns):
    x, y = ns["x"], ns["y"]
    assert abs(richness.cka(x, y) - cka_naive(x, y)) < 1e-10
    assert abs(ns["r"].pair("x", "z").cka_debiased - cka_debiased_naive(x, np.tanh(y))) < 1e-10
    assert ns["t"].n == 1000 and abs(ns["t"].compute().cka[0, 1] - cka_naive(x, y)) < 1e-10


def check_layer_map(ns):
    assert ns["report"].names == ["cnn.0", "cnn.2", "cnn.5", "mlp.1", "mlp.3"] and ns["report"].n == 128


def check_diagnostics(ns):
    """guide/self-supervised: RankMe and the participation ratio of the streamed features."""
    X = ns["features"]
    assert abs(ns["report"].rankme - rankme_naive(X)) < 1e-8 * rankme_naive(X)
    assert abs(ns["report"].participation_ratio - participation_ratio_naive(X)) < 1e-8 * participation_ratio_naive(X)


def check_metric_measures(ns):
    want, _ = dlr_naive(ns["h"].double().numpy(), ns["logits"].double().numpy(), rtol=1e-5)
    assert abs(float(ns["values"]["dlr"]) - want) < 1e-6
    assert abs(float(ns["values"]["rankme"]) - rankme_naive(ns["h"].double().numpy())) < 1e-4


# (text only that example holds, its check)
CHECKS = [
    ("load_digits(return_X_y=True)", check_quickstart_evaluate),
    ("richness.similarity(models, loader", check_quickstart_similarity),
    ("Window(every=50, window=10)", check_quickstart_monitor),
    ("richness.dlr(features, outputs)", check_arrays),
    ('layers=["layer2", "layer3", "layer4"]', check_evaluate),
    ("metric = DLR()", check_metric),
    ("s_init.compute()", check_baselines),
    ('Window(every=4), log="richness.jsonl") as mon', check_monitor),
    ("SummaryWriter(os.path.join(runs", check_loggers),
    ("RichnessCallback(trainer, Window(every=2))", check_hugging_face),
    ("richness.dask.moments(stack(", check_dask),
    ("richness.cka(x, y)", check_cka),
    ('{"cnn": cnn, "mlp": mlp}', check_layer_map),
    ("m.update(features[i:i + 250])", check_diagnostics),
    ('values = metric.compute()', check_metric_measures),
]

EXAMPLES = [(page, i) for page in pages() for i in range(len(sections(page)))]


def test_readme_quickstarts():
    """Three quickstarts, each self-contained (no setup block) and under 15 lines."""
    secs = sections("README.md")
    assert len(secs) == 3 and all(setup is None for setup, _ in secs)
    assert all(len(example.strip().splitlines()) < 15 for _, example in secs)
    for (_, example), what in zip(secs, ("richness.evaluate(", "richness.plot.similarity(", "richness.Monitor(")):
        assert what in example


def test_every_check_has_its_example():
    """Each check runs on exactly one example, so that no check is silently lost."""
    for marker, _ in CHECKS:
        found = [(page, i) for page, i in EXAMPLES if marker in sections(page)[i][1]]
        assert len(found) == 1, (marker, found)


@pytest.mark.parametrize("page,i", EXAMPLES, ids=[f"{page}:{i}" for page, i in EXAMPLES])
def test_example_runs(page, i, trackers_offline):
    example = sections(page)[i][1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # finite-n caveats of the tiny data, the trackers' notices
        ns, skipped = run_section(i, page)
    # only what needs something missing here (a GPU, a process group, an optional package) is left out
    for text in skipped:
        needs = NEEDS.findall(text)
        assert needs and not all(available(n) for n in needs), text
    for marker, check in CHECKS:
        if marker in example:
            check(ns)
