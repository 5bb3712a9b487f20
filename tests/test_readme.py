"""README.md's Python examples run as written, so they cannot drift from the API.

Each ```python block is executed statement by statement in a namespace holding
small generated data under the names the examples use (features, outputs, W,
b, batches, model, loader, ...). A statement whose lines carry ``# needs: X``
runs only where X is available (a GPU, an initialised torch.distributed,
tensorboard, lightning). Beyond "it runs", the first block's values are
checked against the float64 n x n reference.
"""

import ast
import importlib.util
import os
import re
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import richness  # noqa: E402
from reference import dlr_naive  # noqa: E402
from tiny_models import MLP, TinyLM  # noqa: E402

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
NEEDS = re.compile(r"#\s*needs:\s*([A-Za-z_]+(?:\.[A-Za-z_]+)*)")


def python_blocks():
    text = open(README, encoding="utf-8").read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def available(what: str) -> bool:
    if what == "cuda":
        return torch.cuda.is_available()
    if what == "torch.distributed":
        return torch.distributed.is_available() and torch.distributed.is_initialized()
    return importlib.util.find_spec(what) is not None


def run_block(src: str, ns: dict) -> list:
    """Execute ``src`` statement by statement in ``ns``; returns the statements skipped."""
    lines = src.splitlines()
    skipped = []
    for stmt in ast.parse(src).body:
        text = "\n".join(lines[stmt.lineno - 1:stmt.end_lineno])
        needs = NEEDS.findall(text)
        if any(not available(n) for n in needs):
            skipped.append(text)
            continue
        exec(compile(ast.Module(body=[stmt], type_ignores=[]), "README.md", "exec"), ns)
    return skipped


def numpy_namespace():
    rng = np.random.default_rng(0)
    n, p, C = 400, 12, 3
    features = rng.normal(size=(n, p)) @ rng.normal(size=(p, p)) + 2.0
    W, b = rng.normal(size=(C, p)), rng.normal(size=C)
    outputs = features @ W.T + b + 0.5 * np.tanh(features[:, :C])
    labels = rng.integers(0, 10, n)
    batches = [(features[i:i + 40], outputs[i:i + 40], labels[i:i + 40]) for i in range(0, n, 40)]
    other = richness.Moments(num_classes=10)
    other.update(features[:50], outputs=outputs[:50], labels=labels[:50])
    x_test = rng.normal(size=(100, p)) @ rng.normal(size=(p, p))
    return {"features": features, "outputs": outputs, "W": W, "b": b, "batches": batches, "other": other,
            "x_test": x_test, "f_test": x_test @ W.T + b, "y_test": rng.integers(0, 10, 100)}


def test_readme_has_the_examples():
    blocks = python_blocks()
    assert len(blocks) == 2
    assert "richness.dlr(features, outputs)" in blocks[0] and "richness.evaluate(model" in blocks[1]


def test_first_block_runs_and_agrees_with_the_reference(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example saves state.npz in the working directory
    ns = numpy_namespace()
    skipped = run_block(python_blocks()[0], ns)
    assert skipped == []
    want, _ = dlr_naive(ns["features"], ns["outputs"])
    assert abs(richness.dlr(ns["features"], ns["outputs"]) - want) < 1e-10
    head_want, _ = dlr_naive(ns["features"], ns["features"] @ ns["W"].T + ns["b"])
    assert abs(richness.dlr(ns["features"], head=(ns["W"], ns["b"])) - head_want) < 1e-10
    # the example's last lines: a saved and reloaded state, then reset
    assert os.path.exists("state.npz") and ns["m"].n == 0
    assert ns["r"].dlr_stderr is not None and ns["r"].dlr_stderr > 0


class _Net(torch.nn.Module):
    """A small network with the layer names the README's examples hook."""

    def __init__(self, d=12, h=16, c=10):
        super().__init__()
        self.layer1 = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.ReLU())
        self.layer2 = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.ReLU())
        self.layer3 = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.Tanh())
        self.layer4 = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.ReLU())
        self.fc = torch.nn.Linear(h, c)

    def forward(self, x):
        return self.fc(self.layer4(self.layer3(self.layer2(self.layer1(x)))))


def torch_namespace():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    X, y = torch.randn(256, 12, generator=g), torch.randint(0, 10, (256,), generator=g)
    model = _Net()
    ds = torch.utils.data.TensorDataset(X, y)
    lm = TinyLM()
    ids = torch.randint(0, 11, (24, 7), generator=g)
    lm_loader = [{"input_ids": ids[i:i + 8], "labels": ids[i:i + 8]} for i in range(0, 24, 8)]
    h = model.layer4(model.layer3(model.layer2(model.layer1(X[:64])))).detach()
    return {"model": model, "loader": torch.utils.data.DataLoader(ds, batch_size=32),
            "val_loader": torch.utils.data.DataLoader(ds, batch_size=64), "lm": lm, "lm_loader": lm_loader,
            "criterion": torch.nn.CrossEntropyLoss(), "opt": torch.optim.SGD(model.parameters(), lr=1e-2),
            "x_val": X[:64], "y_val": y[:64], "h": h, "logits": model.fc(h).detach(), "labels": y[:64]}


def test_second_block_runs(tmp_path, monkeypatch):
    pytest.importorskip("torchmetrics")
    monkeypatch.chdir(tmp_path)
    ns = torch_namespace()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # finite-n caveats of the tiny data, Lightning's notices
        skipped = run_block(python_blocks()[1], ns)
    # only what needs a GPU, a process group, tensorboard or lightning may be left out
    for text in skipped:
        assert NEEDS.search(text), text
    assert not torch.cuda.is_available() or not any("cuda" in t for t in skipped)
    report = ns["report"]
    assert set(report.layers) == {"layer2", "layer3", "layer4"}
    assert 0.0 <= report.layers["layer3"].dlr <= 1.0
    assert os.path.exists("richness.jsonl") and os.path.exists("depth.png")
    # the metric saw the example's (logits, labels, features=h) twice: update, then forward
    H, F = ns["h"].double().numpy(), ns["logits"].double().numpy()
    want, _ = dlr_naive(np.concatenate([H, H]), np.concatenate([F, F]))
    assert abs(float(ns["metric"].compute()) - want) < 1e-6
