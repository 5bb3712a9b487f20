"""The command line: eval / plot / info / demo, against the n x n oracles."""

import json
import subprocess
import sys

import numpy as np
import pytest

import richness
from richness.cli import main
from reference import dlr_naive, nc1_naive


def data(n=500, p=12, c=4, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, p)) @ rng.normal(size=(p, p)) + 2.0
    W = rng.normal(size=(c, p))
    F = X @ W.T + 0.2 * rng.normal(size=(n, c))
    y = rng.integers(0, c, n)
    return X, F, y, W


def run_json(argv, capsys):
    assert main(["eval"] + argv + ["--json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out)


def run_error(argv, capsys):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("richness: error:") and "Traceback" not in err
    return lines[0]


def test_eval_npy_files_in_chunks(tmp_path, capsys):
    X, F, y, _ = data()
    for name, a in (("x", X), ("f", F), ("y", y)):
        np.save(tmp_path / f"{name}.npy", a)
    rep = run_json([str(tmp_path / "x.npy"), "--outputs", str(tmp_path / "f.npy"), "--labels",
                    str(tmp_path / "y.npy"), "--chunk", "37"], capsys)
    want, r = dlr_naive(X, F)
    assert rep["n"] == 500 and rep["rank"] == r
    assert abs(rep["dlr"] - want) < 1e-12
    assert abs(rep["nc1"] - nc1_naive(X, y)) < 1e-9 * rep["nc1"]
    assert rep["precision"] == "fp64"


def test_eval_bundles_head_and_held_out(tmp_path, capsys):
    X, F, y, W = data(n=700)
    np.savez(tmp_path / "train.npz", features=X[:500], outputs=F[:500], labels=y[:500])
    np.savez_compressed(tmp_path / "test.npz", features=X[500:], outputs=F[500:], labels=y[500:])
    np.save(tmp_path / "w.npy", W)
    rep = run_json([str(tmp_path / "train.npz"), "--test-features", str(tmp_path / "test.npz")], capsys)
    m, t = richness.Moments(), richness.Moments()
    m.update(X[:500], F[:500], labels=y[:500])
    t.update(X[500:], F[500:], labels=y[500:])
    ref = m.compute(test=t)
    assert abs(rep["dlr"] - dlr_naive(X[:500], F[:500])[0]) < 1e-12
    np.testing.assert_allclose(rep["test_utilization"], ref.test_utilization, rtol=1e-9)
    np.testing.assert_allclose(rep["test_quality"], ref.test_quality, rtol=1e-9)
    # linear-head shortcut from a weight file, features only
    rep = run_json([f"{tmp_path / 'train.npz'}:features", "--head", str(tmp_path / "w.npy")], capsys)
    assert abs(rep["dlr"] - dlr_naive(X[:500], X[:500] @ W.T)[0]) < 1e-12


def test_eval_safetensors_float16_and_bfloat16(tmp_path, capsys):
    st = pytest.importorskip("safetensors.numpy")
    X, F, y, _ = data()
    X16, F16 = X.astype(np.float16), F.astype(np.float16)
    st.save_file({"features": X16, "outputs": F16, "labels": y.astype(np.int64)}, str(tmp_path / "d.safetensors"))
    rep = run_json([str(tmp_path / "d.safetensors"), "--chunk", "64"], capsys)
    want, _ = dlr_naive(X16.astype(np.float64), F16.astype(np.float64))
    assert rep["precision"] == "fp32" and abs(rep["dlr"] - want) < 1e-5
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    xb = torch.tensor(X).to(torch.bfloat16)
    save_file({"feats": xb, "logits": torch.tensor(F).to(torch.bfloat16)}, str(tmp_path / "b.safetensors"))
    rep = run_json([f"{tmp_path / 'b.safetensors'}:feats", "--outputs", f"{tmp_path / 'b.safetensors'}:logits"],
                   capsys)
    want, _ = dlr_naive(xb.double().numpy(), torch.tensor(F).to(torch.bfloat16).double().numpy())
    assert abs(rep["dlr"] - want) < 1e-5


def test_save_then_plot_state_and_log(tmp_path, capsys):
    X, F, y, _ = data()
    np.savez(tmp_path / "d.npz", features=X, outputs=F, labels=y)
    state = tmp_path / "state.npz"
    assert main(["eval", str(tmp_path / "d.npz"), "--save", str(state), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "DLR" in out and "state saved" in out
    m = richness.Moments.load(state)
    assert m.n == 500 and abs(m.compute().dlr - dlr_naive(X, F)[0]) < 1e-12
    pytest.importorskip("matplotlib")
    assert main(["plot", str(state), "-o", str(tmp_path / "fig")]) == 0
    for ext in (".png", ".svg"):
        assert (tmp_path / f"fig{ext}").stat().st_size > 1000
    svg = (tmp_path / "fig.svg").read_text()
    assert "Pi*(k)" in svg and "rho_k / rho_1" in svg
    log = tmp_path / "run.jsonl"
    log.write_text("".join(json.dumps({"step": s, "dlr": 0.5 - 0.01 * s, "nc1": 1.0 / s}) + "\n"
                           for s in range(1, 20)))
    assert main(["plot", str(log)]) == 0
    assert (tmp_path / "run_richness.png").exists() and (tmp_path / "run_richness.svg").exists()
    assert "DLR (0 = rich, 1 = lazy)" in (tmp_path / "run_richness.svg").read_text()


def test_monitor_csv_log_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    log = tmp_path / "m.csv"
    log.write_text("step,mode,n,dlr,rank,nc1,effective_dim,time\n100,window,1280,0.4,10,,,1.0\n"
                   "200,window,1280,0.3,10,,,2.0\n")
    assert main(["plot", str(log), "-o", str(tmp_path / "h")]) == 0
    assert (tmp_path / "h.svg").exists()


def test_user_errors_are_one_line_exit_2(tmp_path, capsys):
    X, F, y, _ = data(n=50)
    np.save(tmp_path / "x.npy", X)
    np.save(tmp_path / "f.npy", F[:40])
    np.save(tmp_path / "yf.npy", y.astype(np.float64))
    bad = X.copy()
    bad[33, 2] = np.nan
    np.save(tmp_path / "nan.npy", bad)
    np.savez(tmp_path / "b.npz", a=X, b=F)
    (tmp_path / "junk.npy").write_bytes(b"not numpy at all")
    (tmp_path / "x.txt").write_text("1 2 3")
    trunc = (tmp_path / "x.npy").read_bytes()
    (tmp_path / "trunc.npy").write_bytes(trunc[: len(trunc) // 2])
    x = str(tmp_path / "x.npy")
    cases = [
        (["eval", str(tmp_path / "missing.npy")], "missing.npy: no such file"),
        (["eval", x, "--outputs", str(tmp_path / "f.npy")], "f.npy: has 40 rows but"),
        (["eval", x, "--labels", str(tmp_path / "yf.npy")], "yf.npy: labels must be integers"),
        (["eval", str(tmp_path / "nan.npy"), "--outputs", str(tmp_path / "x.npy")], "nan.npy: rows 32..47"),
        (["eval", str(tmp_path / "b.npz")], "holds 2 arrays (a, b)"),
        (["eval", f"{tmp_path / 'b.npz'}:c"], "no array 'c'; it has a, b"),
        (["eval", str(tmp_path / "junk.npy")], "junk.npy: not a .npy array"),
        (["eval", str(tmp_path / "trunc.npy")], "trunc.npy: truncated file"),
        (["eval", str(tmp_path / "x.txt")], "x.txt: unknown file type"),
        (["plot", str(tmp_path / "x.npy")], "x.npy: unknown input"),
        (["plot", str(tmp_path / "b.npz")], "b.npz: not a richness state"),
        (["plot", str(tmp_path / "x.txt")], "x.txt: unknown input"),
    ]
    for argv, expect in cases:
        if "--no-progress" not in argv and argv[0] == "eval":
            argv = argv + ["--no-progress", "--chunk", "16"]
        line = run_error(argv, capsys)
        assert expect in line, (argv, line)


def test_info_and_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "richness", "info"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "richness 0.1.0" in r.stdout and "CPU backend" in r.stdout
    r = subprocess.run([sys.executable, "-m", "richness", "eval", "/nonexistent/f.npy"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == "richness: error: /nonexistent/f.npy: no such file"


def test_demo_small(tmp_path, capsys):
    pytest.importorskip("sklearn")
    assert main(["demo", "--epochs", "2", "--steps", "30", "--alphas", "0.1,10", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "full training (rich)" in out and "target-downscaled sweep" in out
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith(("0.1 ", "10 "))]
    assert len(rows) == 2
    assert all(0.0 <= float(r[1]) <= 1.0 for r in rows)
    if "plots skipped" not in out:
        assert (tmp_path / "curves.png").exists() and (tmp_path / "sweep.svg").exists()
