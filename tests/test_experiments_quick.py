"""Each experiments/ script runs end to end in --quick mode and writes a
well-formed JSON and a PNG; the measurement helper they share agrees with a
direct n x n computation of DLR. (The science is in the full runs,
docs/REPRODUCTION.md; quick numbers are only checked for form.)"""

import importlib.util
import json
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

EXPERIMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments")
SCRIPTS = ["rich_lazy", "target_scale", "grokking", "label_shuffle", "batchnorm", "lr_sweep"]


def load(name):
    spec = importlib.util.spec_from_file_location(f"experiments_{name}", os.path.join(EXPERIMENTS, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def all_values(obj, key):
    """Every value stored under ``key`` anywhere in a JSON tree."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key:
                yield v
            yield from all_values(v, key)
    elif isinstance(obj, list):
        for v in obj:
            yield from all_values(v, key)


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", SCRIPTS)
def test_quick_mode_writes_results(name, tmp_path):
    payload = load(name).main(["--quick", "--out", str(tmp_path)])
    path = tmp_path / f"{name}.json"
    png = tmp_path / f"{name}.png"
    assert png.exists() and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(path.read_text())  # strict JSON: no NaN
    assert data["experiment"] == name and data["mode"] == "quick"
    assert data["machine"]["date_utc"] and data["seconds"] >= 0
    assert data["data"].startswith(("MNIST", "scikit-learn digits")) or name == "grokking"
    added = {k: data[k] for k in ("experiment", "mode", "args", "machine", "seconds", "data") if k in data}
    assert data == json.loads(json.dumps(payload | added))  # the file holds what main() returned
    dlrs = [v for v in all_values(data, "dlr") if not isinstance(v, dict)]
    measured = [v for v in dlrs if v is not None]
    assert len(measured) >= 2, dlrs
    for v in measured:
        assert isinstance(v, float) and math.isfinite(v) and 0.0 <= v <= 1.0
    for key in ("test_acc", "train_acc", "s_init", "utilization_at_C"):
        for v in all_values(data, key):
            if v is not None and not isinstance(v, dict):
                assert 0.0 <= v <= 1.0 + 1e-9, (key, v)


def dlr_gram(features, outputs):
    """DLR from n x n matrices: 1 - <K, P> / (||K|| ||P||), K = H Phi Phi^T H,
    P = projector onto span(H F) (docs/MATH.md, "Which projector"), in float64."""
    phi = np.asarray(features, np.float64)
    f = np.asarray(outputs, np.float64)
    n = len(phi)
    H = np.eye(n) - 1.0 / n
    K = H @ phi @ phi.T @ H
    u, s, _ = np.linalg.svd(H @ f, full_matrices=False)
    q = u[:, s > 1e-10 * s[0]]
    P = q @ q.T
    return 1.0 - np.sum(K * P) / (np.linalg.norm(K) * np.linalg.norm(P))


def test_digits_stand_in_has_mnist_layout():
    import sys

    sys.path.insert(0, EXPERIMENTS)
    import common as C
    from sklearn.datasets import load_digits

    X, y = C._digits_as_mnist()
    d = load_digits()
    assert X.shape == (1797, 784) and y.shape == (1797,)
    img = X.reshape(-1, 28, 28)
    # nearest-neighbour 3x upsampling of the 8x8 image, rescaled 0..16 -> 0..255, 2-pixel border
    np.testing.assert_allclose(img[:, 2:26:3, 2:26:3], d.images * 255.0 / 16.0)
    np.testing.assert_array_equal(img[:, :2], 0.0)
    np.testing.assert_array_equal(y, d.target)


def test_measure_matches_gram_dlr():
    import sys

    sys.path.insert(0, EXPERIMENTS)
    import common as C

    torch.manual_seed(0)
    model = C.mlp([20, 16, 12], classes=5).double()
    x = torch.randn(150, 20, dtype=torch.float64)
    y = torch.randint(0, 5, (150,))
    rep = C.measure(model, x, y, batch=40)
    with torch.no_grad():
        want = dlr_gram(model.body(x).numpy(), model(x).numpy())
    assert rep.dlr == pytest.approx(want, rel=1e-9, abs=1e-12)
    s = C.summary(rep, 5)
    assert s["dlr"] == rep.dlr and s["n"] == 150 and s["rank"] == 5
    assert s["utilization_at_C"] == pytest.approx(float(rep.utilization[4]))
