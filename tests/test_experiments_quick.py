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
    assert data["data"].startswith("modular addition" if name == "grokking" else ("MNIST", "scikit-learn digits"))
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


def _grokking_series(data):
    """The measured values of a grokking history (wall-clock seconds dropped)."""
    return [{k: v for k, v in row.items() if k != "seconds"} for row in data["history"]]


def test_grokking_resume_continues_the_same_run(tmp_path, capsys):
    grok = load("grokking")
    whole = grok.main(["--quick", "--steps", "30", "--out", str(tmp_path / "whole")])
    first = grok.main(["--quick", "--steps", "20", "--out", str(tmp_path / "split")])
    assert first["step"] == 20 and first["history"][-1]["step"] == 20
    capsys.readouterr()
    resumed = grok.main(["--quick", "--steps", "30", "--resume", "--out", str(tmp_path / "split")])
    assert "resumed at step 20" in capsys.readouterr().out
    assert resumed["complete"] and [r["step"] for r in resumed["history"]] == list(range(0, 31, 5))
    # optimizer moments, schedule and the series carried over: the same values as one uninterrupted run
    assert _grokking_series(resumed) == _grokking_series(whole)
    assert resumed["rank_cuts"] == whole["rank_cuts"]
    on_disk = json.loads((tmp_path / "split" / "grokking.json").read_text())
    assert _grokking_series(on_disk) == _grokking_series(whole)


def test_grokking_resume_refuses_other_settings(tmp_path):
    grok = load("grokking")
    grok.main(["--quick", "--steps", "10", "--out", str(tmp_path)])
    before = (tmp_path / "checkpoints" / "grokking.pt").read_bytes()
    with pytest.raises(SystemExit, match="other settings.*'wd'"):
        grok.main(["--quick", "--steps", "20", "--wd", "2", "--resume", "--out", str(tmp_path)])
    assert (tmp_path / "checkpoints" / "grokking.pt").read_bytes() == before
    with pytest.raises(SystemExit, match="no checkpoint"):
        grok.main(["--quick", "--resume", "--out", str(tmp_path / "empty")])


def test_grokking_records_match_direct_computation(tmp_path):
    """The last record (the Monitor's probe emissions plus the script's
    accuracy and reference) against float64 n x n DLR, accuracy of
    alpha (f - f_0) and the isotropic formula, from the checkpointed model."""
    grok = load("grokking")
    data = grok.main(["--quick", "--steps", "20", "--alpha", "4", "--out", str(tmp_path)])
    ck = torch.load(tmp_path / "checkpoints" / "grokking.pt", weights_only=False)
    s = data["settings"]
    model = grok.transformer(s["P"], s["d"], s["heads"], s["ff"])
    model.load_state_dict(ck["model"])
    model.eval()
    P = s["P"]
    a, b = torch.meshgrid(torch.arange(P), torch.arange(P), indexing="ij")
    a, b = a.reshape(-1), b.reshape(-1)
    tokens = torch.stack([a, b, torch.full_like(a, P)], 1)
    labels = (a + b) % P
    perm = torch.randperm(P * P, generator=torch.Generator().manual_seed(0))
    tr, te = perm[:s["n_train"]], perm[s["n_train"]:]
    last = data["history"][-1]
    assert last["step"] == 20 and ck["step"] == 20
    for prefix, idx, f0 in (("", tr, ck["f0_tr"]), ("test_", te, ck["f0_te"])):
        with torch.no_grad():
            phi = model.body(tokens[idx]).double()
            out = model.head(model.body(tokens[idx]))
        assert last[prefix + "dlr"] == pytest.approx(dlr_gram(phi.numpy(), out.double().numpy()), abs=1e-5)
        acc = float(((4.0 * (out - f0)).argmax(1) == labels[idx]).float().mean())
        assert last["train_acc" if not prefix else "test_acc"] == acc
        n, p, r = len(idx), last[prefix + "active_features"], last[prefix + "rank"]
        assert p == s["d"] and r == P
        m = n - 1
        iso = 1 - math.sqrt(r) * (m + p - r) / math.sqrt(m * p * (m + p + 1))
        assert last[prefix + "dlr_isotropic"] == pytest.approx(iso, rel=1e-12)
        assert last[prefix + "dlr_normalized"] == pytest.approx(last[prefix + "dlr"] / iso, rel=1e-12)
    cuts = data["rank_cuts"][-1]
    assert cuts["step"] == 15 and len(cuts["cuts"]) == len(grok.RTOL_FACTORS)
    ranks = [c["rank"] for c in cuts["cuts"]]
    assert ranks == sorted(ranks, reverse=True)  # a coarser cut keeps fewer directions


def test_grokking_readings_of_a_series():
    """Memorisation, the last record before the test rise, the jump and its
    multiples are read from the series at the right records."""
    grok = load("grokking")
    test = [0.0, 0.2, 0.48, 0.49, 0.5, 0.62, 0.9, 0.96, 0.99, 1.0, 1.0, 1.0, 1.0, 1.0]
    hist = [{"step": 100 * i, "train_acc": min(1.0, 0.5 * i), "test_acc": t, "dlr": 0.5 - 0.03 * i,
             "dlr_normalized": 1.0 - 0.05 * i, "test_dlr": 0.4, "rank": 59 - i, "effective_dim": 50.0,
             "nc1": 1.0} for i, t in enumerate(test)]
    r = grok.readings({"settings": {}, "history": hist})
    assert (r["memorised_step"], r["test_jump_step"], r["last_step"]) == (200, 700, 1300)
    assert r["plateau_test_acc"] == 0.48
    pts = r["points"]
    assert [pts[k]["step"] for k in ("memorised", "before_rise", "jump", "last")] == [200, 400, 700, 1300]
    assert "2x_jump" not in pts and "3x_jump" not in pts  # the series ends before step 1,400
    assert r["plateau_dlr_range"] == [pytest.approx(0.5 - 0.03 * 4), pytest.approx(0.5 - 0.03 * 2)]
    assert pts["jump"]["dlr"] == pytest.approx(0.5 - 0.03 * 7) and pts["jump"]["rank"] == 52
    assert r["steps_over_jump"] == pytest.approx(1300 / 700, abs=0.01)


def test_grokking_scale_lr_divides_the_learning_rate_only():
    grok = load("grokking")
    cfg = grok.settings(grok.arguments(["--alpha", "8", "--scale-lr", "--lr", "1e-3", "--wd", "3"]))
    assert cfg["lr"] == pytest.approx(1e-3 / 8) and cfg["wd"] == 3.0 and cfg["alpha"] == 8.0
    cfg = grok.settings(grok.arguments(["--alpha", "8", "--lr", "1e-3"]))
    assert cfg["lr"] == pytest.approx(1e-3)
    with pytest.raises(SystemExit, match="multiple of --every"):
        grok.settings(grok.arguments(["--every", "7"]))


def test_grokking_overlay_plots_and_reads_the_runs(tmp_path):
    grok = load("grokking")
    runs = [grok.main(["--quick", "--steps", "60", "--seed", str(s), "--tag", f"s{s}", "--out", str(tmp_path)])
            for s in (0, 1)]
    out = grok.main(["--overlay", str(tmp_path / "grokking_s0.json"), str(tmp_path / "grokking_s1.json"),
                     "--tag", "both", "--out", str(tmp_path)])
    assert (tmp_path / "grokking_both.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out["overlay"] == ["grokking_s0.json", "grokking_s1.json"]
    on_disk = json.loads((tmp_path / "grokking_both.json").read_text())
    for run, read in zip(runs, on_disk["readings"]):
        assert read["settings"]["seed"] == run["settings"]["seed"]
        assert read["last_step"] == run["history"][-1]["step"] == 60
        mem = next(r for r in run["history"] if r["train_acc"] >= 0.99)  # memorised within 60 steps
        assert read["memorised_step"] == read["points"]["memorised"]["step"] == mem["step"]
        assert read["points"]["memorised"]["dlr"] == mem["dlr"]
        assert read["points"]["last"]["dlr"] == run["history"][-1]["dlr"]
