"""The command line: eval / plot / info / demo, against the n x n oracles."""

import functools
import io
import json
import os
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest

import richness
from richness.cli import main
from reference import dlr_naive, nc1_naive
from conftest import linear_data

data = functools.partial(linear_data, n=500, p=12, c=4, noise=0.2)




def run_json(argv, capsys):
    assert main(["eval"] + argv + ["--json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out)


def run_error(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # a usage error found by argparse
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("richness: error:") and "Traceback" not in err
    return lines[0]


def test_eval_npy_files_in_chunks(tmp_path, capsys):
    X, F, y = data()
    for name, a in (("x", X), ("f", F), ("y", y)):
        np.save(tmp_path / f"{name}.npy", a)
    rep = run_json([str(tmp_path / "x.npy"), "--outputs", str(tmp_path / "f.npy"), "--labels",
                    str(tmp_path / "y.npy"), "--chunk", "37"], capsys)
    want, r = dlr_naive(X, F)
    assert rep["n"] == 500 and rep["rank"] == r
    assert abs(rep["dlr"] - want) < 1e-12
    assert abs(rep["nc1"] - nc1_naive(X, y)) < 1e-9 * rep["nc1"]
    assert rep["precision"] == "fp64"


def test_chunks_reuse_one_buffer_only_when_asked(tmp_path):
    from richness.cli.formats import open_array

    X = np.arange(60, dtype=np.float32).reshape(20, 3)
    np.save(tmp_path / "x.npy", X)
    f = open_array(str(tmp_path / "x.npy"))
    a = f.chunk(0, 8, reuse=True)
    np.testing.assert_array_equal(a, X[:8])
    b = f.chunk(8, 13, reuse=True)  # a shorter chunk, in the same buffer
    np.testing.assert_array_equal(b, X[8:13])
    assert np.shares_memory(a, b)
    c, d = f.chunk(13, 20), f.chunk(0, 2)  # without reuse: a buffer each
    np.testing.assert_array_equal(c, X[13:])
    np.testing.assert_array_equal(d, X[:2])
    assert not np.shares_memory(c, d) and not np.shares_memory(c, b)
    f.close()


def test_eval_bundles_head_and_held_out(tmp_path, capsys):
    X, F, y, W = data(n=700, head=True)
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
    X, F, y = data()
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
    X, F, y = data()
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


def test_eval_prints_dlr_beside_its_isotropic_reference(tmp_path, capsys):
    # a fully lazy case: isotropic random features, outputs a random linear map of them.
    # Its DLR at this n is well below 1; against the isotropic reference it reads as lazy.
    rng = np.random.default_rng(4)
    X = rng.normal(size=(200, 40))
    F = X @ rng.normal(size=(40, 10))
    np.savez(tmp_path / "lazy.npz", features=X, outputs=F)
    rep = run_json([str(tmp_path / "lazy.npz")], capsys)
    assert main(["eval", str(tmp_path / "lazy.npz"), "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    want = dlr_naive(X, F)[0]
    line = [ln for ln in out if "isotropic reference" in ln]
    assert line == [f"isotropic reference {rep['dlr_isotropic']:.4f}   DLR/iso {want / rep['dlr_isotropic']:.3f}"]
    assert [ln for ln in out if ln.startswith("DLR ")] == [  # DLR printed once, on the report's first line
        f"DLR {want:.4f}  (0 = rich, 1 = lazy)   rank {rep['rank']}   n 200"]
    assert want < 0.8 and abs(want / rep["dlr_isotropic"] - 1) < 0.05
    assert any(ln.startswith("how to read: DLR/iso near 1 = as lazy as isotropic") for ln in out)


def test_monitor_csv_log_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    log = tmp_path / "m.csv"
    log.write_text("step,mode,n,dlr,rank,nc1,effective_dim,time\n100,window,1280,0.4,10,,,1.0\n"
                   "200,window,1280,0.3,10,,,2.0\n")
    assert main(["plot", str(log), "-o", str(tmp_path / "h")]) == 0
    assert (tmp_path / "h.svg").exists()


def test_user_errors_are_one_line_exit_2(tmp_path, capsys):
    X, F, y = data(n=50)
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
    assert f"plots go to {os.path.join(str(tmp_path), '')} " in out
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith(("0.1 ", "10 "))]
    assert len(rows) == 2
    assert all(0.0 <= float(r[1]) <= 1.0 for r in rows)
    if "plots skipped" not in out:
        assert (tmp_path / "curves.png").exists() and (tmp_path / "sweep.svg").exists()


# -- version, typing, logging ---------------------------------------------------

def test_version_flag_prints_the_installed_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"richness {version('richness')}"
    assert richness.__version__ == version("richness")


def test_stubs_ship_and_cover_the_compiled_modules():
    import ast
    import os

    from richness import _core

    pkg = os.path.dirname(richness.__file__)
    for name in ("py.typed", "_core.pyi", "_cuda.pyi"):
        assert os.path.isfile(os.path.join(pkg, name)), name
    # every public name of the compiled CPU module is typed in its stub
    with open(os.path.join(pkg, "_core.pyi")) as f:
        tree = ast.parse(f.read())
    stubbed = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    stubbed |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)}
    public = {n for n in dir(_core) if not n.startswith("_")}
    assert public <= stubbed, public - stubbed
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CpuMoments")
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    assert {n for n in dir(_core.CpuMoments) if not n.startswith("_")} <= methods


def test_mypy_finds_the_types_of_a_user_script(tmp_path):
    api = pytest.importorskip("mypy.api")
    script = tmp_path / "user.py"
    script.write_text("import numpy as np\nimport richness\nfrom richness import _core\n"
                      "m = richness.Moments(num_classes=3)\nm.update(np.zeros((4, 2)))\n"
                      "r: richness.Report = m.compute()\ns: str = _core.blas_info()\n"
                      "n: int = _core.CpuMoments(3).n\nbad: str = _core.CpuMoments(3).n\n")
    # a user's script, checked under mypy's defaults, not this repository's [tool.mypy]
    out, err, code = api.run([str(script), "--config-file", os.devnull, "--cache-dir", str(tmp_path / "cache"),
                              "--no-error-summary"])
    assert "import-untyped" not in out and "missing library stubs" not in out, out
    # the stub is read: the one wrong annotation is found, nothing else
    lines = [ln for ln in out.splitlines() if ": error:" in ln]
    assert len(lines) == 1 and "user.py:9:" in lines[0], out


def test_verbose_logs_what_is_read_and_json_warnings_go_to_stderr(tmp_path, capsys):
    X, F, y = data(n=60)  # n < 10 p: the finite-n caveat
    np.savez(tmp_path / "d.npz", features=X, outputs=F, labels=y)
    assert main(["-v", "eval", str(tmp_path / "d.npz"), "--json", "--no-progress"]) == 0
    cap = capsys.readouterr()
    rep = json.loads(cap.out)
    assert abs(rep["dlr"] - dlr_naive(X, F)[0]) < 1e-12
    assert f"richness: features: {tmp_path / 'd.npz'}:features, shape (60, 12)" in cap.err
    assert "richness: warning: n = 60 is below 10 x p = 120 (p = 12)" in cap.err
    # without -v: the warning, not the info
    assert main(["eval", str(tmp_path / "d.npz"), "--json", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "below 10 x p" in err and "features:" not in err


# -- file formats -----------------------------------------------------------------

def _expect(rep, X, F, y):
    assert rep["n"] == X.shape[0]
    assert abs(rep["dlr"] - dlr_naive(X, F)[0]) < 1e-12
    assert abs(rep["nc1"] - nc1_naive(X, y)) < 1e-9 * rep["nc1"]


def test_eval_torch_pt_bundle_and_single_tensor(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    X, F, y = data()
    torch.save({"features": torch.from_numpy(X), "outputs": torch.from_numpy(F), "labels": torch.from_numpy(y),
                "epoch": 3}, tmp_path / "b.pt")
    _expect(run_json([str(tmp_path / "b.pt"), "--chunk", "37"], capsys), X, F, y)
    torch.save(torch.from_numpy(F), tmp_path / "f.pt")
    torch.save({"x": torch.from_numpy(X).to(torch.bfloat16)}, tmp_path / "x.pt")
    rep = run_json([str(tmp_path / "x.pt"), "--outputs", str(tmp_path / "f.pt")], capsys)
    xb = torch.from_numpy(X).to(torch.bfloat16).double().numpy()
    assert abs(rep["dlr"] - dlr_naive(xb, F)[0]) < 1e-5
    # weights_only=True: a pickled object is refused, no code runs
    torch.save({"features": torch.from_numpy(X), "obj": _Pickled()}, tmp_path / "evil.pt")
    line = run_error(["eval", str(tmp_path / "evil.pt"), "--no-progress"], capsys)
    assert "evil.pt: not a file of tensors" in line
    assert "no tensor 'nope'; it has features, outputs, labels" in run_error(
        ["eval", f"{tmp_path / 'b.pt'}:nope", "--no-progress"], capsys)


class _Pickled:
    pass


def test_eval_hdf5_read_by_chunks(tmp_path, capsys, monkeypatch):
    h5py = pytest.importorskip("h5py")
    X, F, y = data()
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["features"] = X
        f["outputs"] = F.astype(np.float32)
        f.create_group("meta")["labels"] = y
    slices = []
    real = h5py.Dataset.__getitem__

    def spy(self, idx):
        slices.append(idx)
        return real(self, idx)

    monkeypatch.setattr(h5py.Dataset, "__getitem__", spy)
    rep = run_json([str(tmp_path / "d.h5"), "--labels", f"{tmp_path / 'd.h5'}:meta/labels", "--chunk", "100",
                    "--precision", "fp64"], capsys)
    _expect(rep, X, F.astype(np.float32).astype(np.float64), y)
    # three datasets, five chunks of 100 rows each, never the whole array at once
    assert len(slices) == 15 and all(s.stop - s.start <= 100 for s in slices)


def test_eval_parquet_list_columns(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    X, F, y = data()
    table = pa.table({"features": pa.FixedSizeListArray.from_arrays(pa.array(X.ravel()), X.shape[1]),
                      "outputs": pa.array(list(F)),  # variable-length list type, equal lengths
                      "labels": pa.array(y)})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=90)
    _expect(run_json([str(tmp_path / "d.parquet"), "--chunk", "64"], capsys), X, F, y)
    bad = pa.table({"features": pa.array([list(r) for r in X[:3]] + [list(X[3, :5])])})
    pq.write_table(bad, tmp_path / "bad.parquet")
    assert "row 3 has 5 values, row 0 has 12" in run_error(["eval", str(tmp_path / "bad.parquet"),
                                                            "--no-progress"], capsys)


@pytest.mark.parametrize("suffix,module,package", [(".h5", "h5py", "h5py"), (".parquet", "pyarrow", "pyarrow"),
                                                    (".safetensors", "safetensors", "safetensors"),
                                                    (".pt", "torch", "torch")])
def test_missing_optional_reader_names_the_package_and_its_extra(tmp_path, capsys, monkeypatch, suffix, module,
                                                                 package):
    (tmp_path / f"d{suffix}").write_bytes(b"x")
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    line = run_error(["eval", str(tmp_path / f"d{suffix}"), "--no-progress"], capsys)
    assert line == f'richness: error: reading {suffix} files needs {package}: pip install "richness[{package}]"'


# -- robustness -------------------------------------------------------------------

def test_save_to_a_missing_folder_keeps_the_report(tmp_path, capsys):
    X, F, y = data()
    np.savez(tmp_path / "d.npz", features=X, outputs=F, labels=y)
    bad = str(tmp_path / "nodir" / "s.npz")
    code = main(["eval", str(tmp_path / "d.npz"), "--save", bad, "--no-progress"])
    cap = capsys.readouterr()
    assert code == 2 and "Traceback" not in cap.err
    assert f"DLR {dlr_naive(X, F)[0]:.4f}" in cap.out  # the report came first
    assert cap.err.strip().splitlines() == [f"richness: error: {bad}: cannot write the state (No such file or "
                                            "directory)"]


def test_plot_into_a_missing_folder_is_an_error_like_save(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    X, F, y = data(n=200)
    m = richness.Moments()
    m.update(X, F, labels=y)
    m.save(tmp_path / "s.npz")
    bad = str(tmp_path / "nodir" / "fig")
    line = run_error(["plot", str(tmp_path / "s.npz"), "-o", bad], capsys)
    assert line == f"richness: error: {bad}: cannot write the plots (No such file or directory)"
    assert not (tmp_path / "nodir").exists()


def test_missing_bundle_says_no_such_file(tmp_path, capsys):
    for name in ("nothere.npz", "nothere.safetensors", "nothere.h5"):
        line = run_error(["eval", str(tmp_path / name), "--no-progress"], capsys)
        assert line == f"richness: error: {tmp_path / name}: no such file"


def test_held_out_outputs_of_another_width_are_rejected(tmp_path, capsys):
    X, F, y = data(n=300)
    np.savez(tmp_path / "tr.npz", features=X[:200], outputs=F[:200], labels=y[:200])
    np.savez(tmp_path / "te.npz", features=X[200:], outputs=np.hstack([F[200:], F[200:, :1]]), labels=y[200:])
    line = run_error(["eval", str(tmp_path / "tr.npz"), "--test-features", str(tmp_path / "te.npz"),
                      "--no-progress"], capsys)
    assert "te.npz:outputs: held-out outputs have 5 columns but the training outputs" in line
    assert "have 4" in line


# -- plots and demo ---------------------------------------------------------------

def test_depth_plot_takes_a_report_and_held_out_axis_says_unbounded(tmp_path):
    pytest.importorskip("matplotlib")
    from richness import plot

    X, F, y = data()
    m, t = richness.Moments(), richness.Moments()
    m.update(X[:400], F[:400], labels=y[:400])
    t.update(X[400:], F[400:], labels=y[400:])
    rep = m.compute(test=t)
    with pytest.raises(ValueError, match="no layers"):
        plot.depth(rep, tmp_path / "none")
    rep.layers = {"a": m.compute(), "b": t.compute()}
    for arg, name in ((rep, "r"), (rep.layers, "d")):  # a Report, or its .layers as before
        paths = plot.depth(arg, tmp_path / name)
        assert [os.path.basename(p) for p in paths] == [f"{name}.png", f"{name}.svg"]
    plot.curves(rep, tmp_path / "c")
    assert "can exceed 1" in (tmp_path / "c.svg").read_text()
    plot.curves(m.compute(), tmp_path / "c2")
    assert "can exceed 1" not in (tmp_path / "c2.svg").read_text()
    with pytest.raises(ValueError, match="'short' was computed with spectrum=False"):
        plot.curves({"full": rep, "short": m.compute(spectrum=False)}, tmp_path / "c3")


def test_demo_says_where_it_writes_and_how_to_read(tmp_path, capsys):
    pytest.importorskip("sklearn")
    assert main(["demo", "--epochs", "1", "--alphas", "", "--out", str(tmp_path / "o"), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "plots: off" in out
    lines = out.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith("last layer only (lazy)"))
    assert lines[i + 1].startswith("how to read: DLR 0 = rich") and lines[i + 2].startswith("  DLR/iso 1 =")
    pytest.importorskip("tqdm")
    assert main(["demo", "--epochs", "1", "--alphas", "", "--out", str(tmp_path / "o"), "--no-plots"]) == 0
    assert "epoch" in capsys.readouterr().err  # tqdm bars on stderr


# -- evaluate: causal-LM labels, warnings -----------------------------------------

class _TinyLM:
    """Embedding -> tanh Linear -> lm_head over a vocabulary of 5, float64."""

    def __new__(cls, vocab=5, p=8):
        torch = pytest.importorskip("torch")

        class LM(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = torch.nn.Embedding(vocab, p)
                self.body = torch.nn.Linear(p, p)
                self.lm_head = torch.nn.Linear(p, vocab)

            def hidden(self, input_ids):
                return torch.tanh(self.body(self.emb(input_ids)))

            def forward(self, input_ids, attention_mask=None):
                return self.lm_head(self.hidden(input_ids))

        torch.manual_seed(0)
        return LM().double()


def _lm_batches(b=6, T=7, nb=4, seed=0):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(nb):
        ids = torch.randint(0, 5, (b, T), generator=g)
        mask = torch.ones(b, T, dtype=torch.long)
        mask[0, -2:] = 0  # right padding
        mask[1, :1] = 0  # left padding
        labels = ids.clone()
        labels[mask == 0] = -100
        labels[2, 3] = -100  # an ignored token
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _shifted_reference(model, batches, last=False):
    """Rows of a hand-built next-token selection: position i (< T-1) with
    class ids[i+1], kept when i and i+1 are real tokens and labels[i+1] != -100."""
    import torch

    H, Y = [], []
    with torch.no_grad():
        for bt in batches:
            h = model.hidden(bt["input_ids"]).numpy()
            ids, mask, lab = bt["input_ids"].numpy(), bt["attention_mask"].numpy(), bt["labels"].numpy()
            for s in range(ids.shape[0]):
                keep = [i for i in range(ids.shape[1] - 1) if mask[s, i] and mask[s, i + 1] and lab[s, i + 1] != -100]
                for i in (keep[-1:] if last else keep):
                    H.append(h[s, i])
                    Y.append(ids[s, i + 1])
    return np.array(H), np.array(Y)


def test_evaluate_shift_labels_matches_hand_built_next_token_rows():
    model = _TinyLM()
    batches = _lm_batches()
    W, b = model.lm_head.weight.detach().numpy(), model.lm_head.bias.detach().numpy()
    for last in (False, True):
        rep = richness.evaluate(model, batches, head="lm_head", shift_labels=True, progress=False,
                                tokens="last" if last else "all")
        H, Y = _shifted_reference(model, batches, last=last)
        assert rep.n == len(Y)
        assert abs(rep.dlr - dlr_naive(H, H @ W.T + b)[0]) < 1e-10
        assert abs(rep.nc1 - nc1_naive(H, Y)) < 1e-8 * rep.nc1
    # default: labels as given, unshifted: each position's own token, which its
    # features are a function of (NC1 = 0, full collapse)
    plain = [{k: v for k, v in bt.items() if k != "attention_mask"} for bt in batches]
    for bt in plain:
        bt["labels"] = bt["input_ids"]
    rep = richness.evaluate(model, plain, head="lm_head", progress=False)
    import torch

    with torch.no_grad():
        H = torch.cat([model.hidden(bt["input_ids"]).reshape(-1, 8) for bt in plain]).numpy()
    Y = torch.cat([bt["input_ids"].reshape(-1) for bt in plain]).numpy()
    assert rep.n == len(Y) and abs(rep.nc1 - nc1_naive(H, Y)) < 1e-10
    with pytest.raises(ValueError, match="shift_labels=True needs labels"):
        richness.evaluate(model, [{"input_ids": bt["input_ids"]} for bt in plain], head="lm_head",
                          shift_labels=True, progress=False)


def test_evaluate_emits_report_caveats_as_warnings():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
    X = torch.randn(40, 6, dtype=torch.float64)  # n = 40 < 10 p = 160
    with pytest.warns(richness.RichnessWarning, match=r"n = 40 is below 10 x p = 160 \(p = 16\)") as rec:
        rep = richness.evaluate(model, [X[:20], X[20:]], progress=False)
    assert [str(w.message) for w in rec if w.category is richness.RichnessWarning] == rep.warnings
    assert rec[0].filename == __file__  # points at the caller's line


# -- hostile and mistaken files: one bounded reader per format --------------------------------


def _npy_bytes(a, shape=None):
    """``a`` as .npy bytes, its header optionally claiming ``shape`` instead."""
    b = io.BytesIO()
    np.save(b, a)
    raw = b.getvalue()
    if shape is None:
        return raw
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": np.lib.format.dtype_to_descr(a.dtype),
                                               "fortran_order": False, "shape": shape})
    return head.getvalue() + raw[len(raw) - a.nbytes:]


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_npz_member_claiming_more_rows_than_it_holds_is_refused(tmp_path, capsys, compression):
    # the member holds 10 rows but claims 20: the next member's bytes would be read as its data
    X = np.random.default_rng(0).normal(size=(10, 4))
    with zipfile.ZipFile(tmp_path / "c.npz", "w", compression) as z:
        z.writestr("features.npy", _npy_bytes(X, (20, 4)))
        z.writestr("outputs.npy", _npy_bytes(np.random.default_rng(1).normal(size=(40, 3))))
    line = run_error(["eval", str(tmp_path / "c.npz"), "--no-progress"], capsys)
    assert "'features.npy' claims shape (20, 4) (640 bytes) but holds 320 bytes" in line


def test_npz_member_claiming_more_than_deflate_can_produce_is_refused(tmp_path, capsys):
    X = np.random.default_rng(0).normal(size=(10, 4))
    path = tmp_path / "f.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("features.npy", _npy_bytes(X))
    raw = bytearray(path.read_bytes())  # both directories now declare 2 GiB uncompressed
    struct.pack_into("<I", raw, raw.rfind(b"PK\x01\x02") + 24, 2**31)
    struct.pack_into("<I", raw, raw.find(b"PK\x03\x04") + 22, 2**31)
    path.write_bytes(bytes(raw))
    line = run_error(["eval", str(path), "--no-progress"], capsys)
    assert "claims 2147483648 bytes from" in line and "more than deflate can produce" in line
    # methods with no such bound (bzip2 expands far more) are not what numpy writes: refused
    with zipfile.ZipFile(path, "w", zipfile.ZIP_BZIP2) as z:
        z.writestr("features.npy", _npy_bytes(X))
    line = run_error(["eval", str(path), "--no-progress"], capsys)
    assert "uses zip compression method 12; richness reads stored or deflated members" in line


def test_non_regular_inputs_are_refused_without_reading(tmp_path):
    # a symlink to /dev/zero is endless and a FIFO blocks for ever: both refused from stat
    os.symlink("/dev/zero", tmp_path / "zero.npz")
    os.symlink("/dev/zero", tmp_path / "zero.npy")
    os.mkfifo(tmp_path / "fifo.npz")
    os.symlink("/dev/zero", tmp_path / "zero.jsonl")
    os.mkfifo(tmp_path / "fifo.csv")
    for argv in (["eval", "zero.npz"], ["eval", "zero.npy"], ["eval", "fifo.npz"], ["plot", "zero.npz"],
                 ["plot", "fifo.npz"], ["plot", "zero.jsonl"], ["plot", "fifo.csv"]):
        out = subprocess.run([sys.executable, "-m", "richness", *argv], capture_output=True, text=True,
                             timeout=60, cwd=tmp_path)
        assert out.returncode == 2, (argv, out.stderr)
        kind = "a pipe" if "fifo" in argv[1] else "a character device"
        assert out.stderr.strip() == f"richness: error: {argv[1]}: not a regular file ({kind}); give a file on disk"


@pytest.mark.parametrize("header,why", [
    ({"a": {"dtype": "F32", "shape": [4.5, 4], "data_offsets": [0, 64]}}, "floating point `4.5`"),
    ({"a": [1, 2]}, "expected string or map"),
    ([1, 2], "invalid type: sequence"),
    ({"a": {"dtype": "F32", "shape": [4, 4], "data_offsets": [-8, 56]}}, "integer `-8`"),
    ({"a": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]},
      "b": {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 32]}}, "invalid offset"),
    ({"a": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 80]}}, "offset for tensor"),
])
def test_malformed_safetensors_are_refused_by_the_library(tmp_path, capsys, header, why):
    pytest.importorskip("safetensors")
    payload = np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32).tobytes()
    js = json.dumps(header).encode()
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", len(js)) + js + payload)
    line = run_error(["eval", f"{tmp_path / 'm.safetensors'}:a", "--no-progress"], capsys)
    assert "not a valid safetensors file" in line and why in line


def test_impossible_or_empty_files_get_their_own_message(tmp_path, capsys):
    X = np.random.default_rng(0).normal(size=(10, 4))
    (tmp_path / "neg.npy").write_bytes(_npy_bytes(X, (-2, 4)))
    assert "impossible shape (-2, 4)" in run_error(["eval", str(tmp_path / "neg.npy")], capsys)
    with zipfile.ZipFile(tmp_path / "neg.npz", "w") as z:
        z.writestr("features.npy", _npy_bytes(X, (4, -10)))
    assert "impossible shape (4, -10)" in run_error(["eval", str(tmp_path / "neg.npz")], capsys)
    (tmp_path / "empty.pt").write_bytes(b"")
    assert run_error(["eval", str(tmp_path / "empty.pt")], capsys).endswith("empty.pt: empty file (0 bytes)")
    torch = pytest.importorskip("torch")
    torch.save({"features": torch.empty(5, 3, device="meta")}, tmp_path / "meta.pt")
    assert "a tensor on the meta device" in run_error(["eval", str(tmp_path / "meta.pt")], capsys)
    torch.save({"features": torch.eye(5).to_sparse()}, tmp_path / "sparse.pt")
    assert "sparse torch tensor" in run_error(["eval", str(tmp_path / "sparse.pt")], capsys)


def test_a_state_too_large_for_memory_is_refused_before_reading(tmp_path, capsys):
    # a sparse 16 MB file of 4 x 10^6 float32 features: the state would hold a 10^6 x 10^6 matrix
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<f4", "fortran_order": False, "shape": (4, 10**6)})
    with open(tmp_path / "wide.npy", "wb") as f:
        f.write(head.getvalue())
        f.truncate(len(head.getvalue()) + 16 * 10**6)
    line = run_error(["eval", str(tmp_path / "wide.npy"), "--no-progress"], capsys)
    assert "the state at p=1000000 needs 8e+12 bytes" in line
    X, F, y = data(n=50)
    np.save(tmp_path / "x.npy", X)
    np.save(tmp_path / "y.npy", y)
    line = run_error(["eval", str(tmp_path / "x.npy"), "--labels", str(tmp_path / "y.npy"), "--num-classes",
                      str(10**12), "--no-progress"], capsys)
    assert f"with {10**12} classes needs {8 * 10**12 * 13:.3g} bytes" in line
    line = run_error(["eval", str(tmp_path / "x.npy"), "--num-classes", str(2**63)], capsys)
    assert "argument --num-classes: expected a positive number of classes" in line


@pytest.mark.parametrize("alphas", ["abc", "inf", "nan", "1e-300", "0.01", "1,-1", "1e6"])
def test_demo_alphas_outside_the_working_range_are_one_line(capsys, alphas):
    line = run_error(["demo", "--alphas", alphas, "--no-plots"], capsys)
    assert "argument --alphas: expected alphas in [0.05, 1000]" in line


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_plot_to_an_unwritable_place_is_one_line(tmp_path, capsys):
    X, F, y = data(n=60)
    m = richness.Moments()
    m.update(X, F)
    m.save(tmp_path / "s.npz")
    line = run_error(["plot", str(tmp_path / "s.npz"), "-o", "/proc/out"], capsys)
    assert "/proc/out" in line


def test_unforeseen_failures_are_one_line_too(tmp_path, capsys, monkeypatch):
    from richness.cli import commands

    for exc, want in ((RuntimeError("a reader's own failure"),
                       "RuntimeError: a reader's own failure (richness -v ... shows where)"),
                      (MemoryError(), "out of memory"),
                      (PermissionError(13, "Permission denied", "/x/out.png"), "/x/out.png: Permission denied")):
        def broken(args, exc=exc):
            raise exc
        monkeypatch.setattr(commands, "info", broken)
        assert run_error(["info"], capsys) == f"richness: error: {want}"


def test_eval_refuses_to_overwrite_its_inputs(tmp_path, capsys):
    X, F, y = data(n=60)
    bundle = tmp_path / "d.npz"
    np.savez(bundle, features=X, outputs=F, labels=y)
    before = bundle.read_bytes()
    os.link(bundle, tmp_path / "hard.npz")
    for save in (["--save", str(bundle)], ["--save", str(tmp_path / "sub" / ".." / "d.npz")],
                 ["--save", str(tmp_path / "hard.npz")],
                 ["--test-features", str(tmp_path / "t.npy"), "--save-test", str(bundle)]):
        np.save(tmp_path / "t.npy", X)
        line = run_error(["eval", str(bundle), "--no-progress", *save], capsys)
        assert "is an input file" in line and "would overwrite it" in line
    assert bundle.read_bytes() == before
    np.save(tmp_path / "t.npy", X)
    line = run_error(["eval", str(bundle), "--no-progress", "--test-features", str(tmp_path / "t.npy"),
                      "--save", str(tmp_path / "s.npz"), "--save-test", str(tmp_path / "s.npz")], capsys)
    assert "--save and --save-test name the same file" in line
    assert not (tmp_path / "s.npz").exists()


def test_held_out_streams_the_training_set_lacks_are_errors(tmp_path, capsys):
    X, F, y = data(n=60)
    np.save(tmp_path / "x.npy", X)
    np.save(tmp_path / "y.npy", y)
    line = run_error(["eval", str(tmp_path / "x.npy"), "--test-features", str(tmp_path / "x.npy"),
                      "--test-labels", str(tmp_path / "y.npy"), "--no-progress"], capsys)
    assert "--test-labels" in line and "the training set has no labels (give --labels)" in line
    line = run_error(["eval", str(tmp_path / "x.npy"), "--test-labels", str(tmp_path / "y.npy")], capsys)
    assert line == "richness: error: --test-labels needs --test-features"


def test_compressed_npz_is_streamed_and_matches_the_oracle(tmp_path, capsys):
    X, F, y = data(n=300)
    np.savez_compressed(tmp_path / "c.npz", features=X, outputs=F, labels=y)
    rep = run_json([str(tmp_path / "c.npz"), "--chunk", "37"], capsys)
    assert abs(rep["dlr"] - dlr_naive(X, F)[0]) < 1e-10
    assert abs(rep["nc1"] - nc1_naive(X, y)) < 1e-8
    # column-major compressed arrays are read whole, with the same result
    np.savez_compressed(tmp_path / "f.npz", features=np.asfortranarray(X), outputs=np.asfortranarray(F))
    rep = run_json([str(tmp_path / "f.npz"), "--chunk", "37"], capsys)
    assert abs(rep["dlr"] - dlr_naive(X, F)[0]) < 1e-10


ZIP_BOMB = """
import os, resource, sys, zipfile
import numpy as np
from richness.cli import main
path = sys.argv[1]
with open("/proc/self/status") as f:
    vm = [int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize")][0]
resource.setrlimit(resource.RLIMIT_AS, (vm + 200_000_000, resource.RLIM_INFINITY))
sys.exit(main(["eval", path, "--no-progress", "--json"]))
"""


def test_compressed_member_larger_than_memory_is_streamed(tmp_path):
    # 800 k rows x 100 float32 (320 MB) compress to under 1 MB: a process limited to 200 MB more
    # than it has reads it chunk by chunk (reading the member whole would need the 320 MB)
    rng = np.random.default_rng(0)
    block = rng.normal(size=(4, 100)).astype(np.float32)
    rows, path = 800_000, tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        with z.open("features.npy", "w", force_zip64=True) as f:
            head = io.BytesIO()
            np.lib.format.write_array_header_1_0(head, {"descr": "<f4", "fortran_order": False,
                                                       "shape": (rows, 100)})
            f.write(head.getvalue())
            piece = np.tile(block, (25_000, 1)).tobytes()
            for _ in range(rows // 100_000):
                f.write(piece)
    assert path.stat().st_size < 5_000_000
    out = subprocess.run([sys.executable, "-c", ZIP_BOMB, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["n"] == rows and rep["feature_rank"] == 3  # four repeated rows, centered: rank 3


@pytest.mark.parametrize("bad, file", [("labels", "y.npy"), ("outputs", "f.npy"), ("features", "x.npy")])
def test_eval_names_the_file_of_a_chunk_the_adapter_refuses(tmp_path, capsys, bad, file):
    # refused before the core sees the chunk: a label past int64 (uint64 labels), an element type the core
    # does not read (float128 passes the floating-point check of the files); the file comes from the
    # error's stream, not from its message
    if not hasattr(np, "float128"):
        pytest.skip("no float128 on this platform")
    rng = np.random.default_rng(26)
    x, f = rng.standard_normal((40, 3)), rng.standard_normal((40, 2))
    y = rng.integers(0, 3, 40).astype(np.uint64)
    if bad == "labels":
        y[7] = 2**63 + 5
    elif bad == "outputs":
        f = f.astype(np.float128)
    else:
        x = x.astype(np.float128)
    for name, a in (("x.npy", x), ("f.npy", f), ("y.npy", y)):
        np.save(tmp_path / name, a)
    line = run_error(["eval", str(tmp_path / "x.npy"), "--outputs", str(tmp_path / "f.npy"),
                      "--labels", str(tmp_path / "y.npy"), "--no-progress"], capsys)
    what = "labels out of range" if bad == "labels" else f"{bad} has dtype float128"
    assert line.startswith(f"richness: error: {tmp_path / file}: rows 0..39: {what}"), line


@pytest.mark.parametrize("cmd", ["eval", "cka"])
def test_precision_names_come_from_the_precision_table(tmp_path, capsys, cmd):
    """--precision is checked by the precision table's one rule: an unknown name lists the table's modes;
    a GPU-only mode reaches the core, whose refusal on the CPU is one error line."""
    rng = np.random.default_rng(0)
    np.save(tmp_path / "a.npy", rng.normal(size=(20, 3)))
    np.save(tmp_path / "b.npy", rng.normal(size=(20, 2)))
    files = [str(tmp_path / "a.npy")] + ([str(tmp_path / "b.npy")] if cmd == "cka" else [])
    line = run_error([cmd, *files, "--precision", "fp16", "--no-progress"], capsys)
    assert "unknown precision 'fp16'" in line and "'fp64', 'fp32'" in line
    line = run_error([cmd, *files, "--precision", "tf32", "--no-progress"], capsys)
    assert "tf32" in line and "cuda" in line
