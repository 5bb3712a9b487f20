"""Files from elsewhere: arrays truncated while they are read, HDF5 data stored in other files,
ambiguous archives, permission bits and temp files of saves on shared folders, and one-line
messages for malformed inputs (the command line's readers, Moments.save/load, plot, evaluate)."""

import json
import os
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest

import richness
from richness._engine import statefile as _statefile
from richness.cli import UserError, main
from richness.cli.formats import open_array
from reference import dlr_naive, states_equal
from test_cli import run_error, run_json


def features(n=4000, p=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, p)) @ rng.normal(size=(p, p)) + 1.0


# -- arrays truncated by another process while they are read ---------------------------------

def _write(kind, folder, X):
    """Write ``X`` (n x p float64) as ``kind``; returns (path, spec, the array the spec holds)."""
    torch = pytest.importorskip("torch") if kind.startswith("pt") or kind == "st_bf16" else None
    if kind == "npy":
        path = folder / "x.npy"
        np.save(path, X)
    elif kind == "npy_f":  # column-major: read one column at a time
        path = folder / "xf.npy"
        np.save(path, np.asfortranarray(X))
    elif kind == "npz":  # a stored (uncompressed) member
        path = folder / "b.npz"
        np.savez(path, features=X, other=X[:3])
        return path, f"{path}:features", X
    elif kind == "pt":
        path = folder / "x.pt"
        torch.save({"features": torch.from_numpy(X), "labels": torch.zeros(len(X))}, path)
        return path, f"{path}:features", X
    elif kind == "pt_t":  # a transposed view: column-major strides in the file
        path = folder / "xt.pt"
        torch.save(torch.from_numpy(np.ascontiguousarray(X.T)).T, path)
    elif kind == "pt_slice":  # a view with a storage offset and a row stride wider than its rows
        path = folder / "xs.pt"
        big = torch.from_numpy(np.hstack([X, X[:, :5]]))
        torch.save(big[1:, 2:12], path)
        return path, str(path), np.hstack([X, X[:, :5]])[1:, 2:12]
    elif kind.startswith("st"):
        safetensors = pytest.importorskip("safetensors.numpy")
        path = folder / f"{kind}.safetensors"
        if kind == "st_bf16":
            from safetensors.torch import save_file

            t = torch.from_numpy(X).to(torch.bfloat16)
            save_file({"features": t}, str(path))
            return path, str(path), t.float().numpy()
        safetensors.save_file({"features": X.astype(np.float32)}, str(path))
        return path, str(path), X.astype(np.float32)
    return path, str(path), X


KINDS = ["npy", "npy_f", "npz", "pt", "pt_t", "pt_slice", "st", "st_bf16"]

# Runs ``richness eval`` and stops before its second chunk until the test process has truncated
# the file (a reader hook: the race made deterministic).
_TRUNCATED_CHILD = r"""
import sys
from richness.cli import main
from richness.cli.formats import ArrayFile
real = ArrayFile.chunk
calls = []
def chunk(self, a, b, **kw):
    calls.append(a)
    if len(calls) == 2:  # the first chunk was read and used
        print("ready", flush=True)
        assert sys.stdin.readline().strip() == "go"
    return real(self, a, b, **kw)
ArrayFile.chunk = chunk
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("kind", KINDS)
def test_file_truncated_while_it_is_read_is_one_line_error(tmp_path, kind):
    """Memory-mapped reads died with SIGBUS (exit -7) here; now exit 2 and one line naming the file."""
    path, spec, _ = _write(kind, tmp_path, features())
    proc = subprocess.Popen([sys.executable, "-c", _TRUNCATED_CHILD, "eval", spec, "--chunk", "500",
                             "--no-progress", "--json"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        ready = proc.stdout.readline().strip()
        assert ready == "ready", proc.communicate()[1]
        os.truncate(path, os.path.getsize(path) // 2)  # inside the array's data, past the first chunk
        out, err = proc.communicate("go\n", timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, (proc.returncode, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("richness: error:"), err
    assert str(path) in lines[0] and "truncated" in lines[0]
    assert out == ""  # no report from a partial read


@pytest.mark.parametrize("kind", KINDS)
def test_raw_reads_give_the_array(tmp_path, kind):
    """Chunks read by offset equal the array the file holds, in any order of ranges."""
    X = features(n=1000, p=7, seed=1)
    _, spec, want = _write(kind, tmp_path, X)
    with open_array(spec) as f:
        assert f.shape == want.shape
        for a, b in ((0, 1000 if kind != "pt_slice" else 999), (0, 1), (500, 733), (998, 999), (3, 400), (0, 0)):
            got = f.chunk(a, b)
            assert got.shape == want[a:b].shape
            assert np.array_equal(got, want[a:b])
            f.release(b)


def test_transposed_pt_file_gives_the_oracle_dlr(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    X = features(n=600, p=9, seed=2)
    F = X[:, :3] ** 2
    torch.save(torch.from_numpy(np.ascontiguousarray(X.T)).T, tmp_path / "x.pt")
    torch.save(torch.from_numpy(np.ascontiguousarray(F.T)).T, tmp_path / "f.pt")
    rep = run_json([str(tmp_path / "x.pt"), "--outputs", str(tmp_path / "f.pt"), "--chunk", "97"], capsys)
    want, rank = dlr_naive(X, F)
    assert rep["n"] == 600 and rep["rank"] == rank and abs(rep["dlr"] - want) < 1e-12


def test_big_endian_pt_file_is_read_in_its_byte_order(tmp_path):
    """torch swaps a big-endian file's tensors in its own copy; the bytes read from the file are
    the file's, read in the order the file records."""
    torch = pytest.importorskip("torch")
    X = features(n=300, p=5, seed=4)
    torch.save(torch.from_numpy(X), tmp_path / "le.pt")
    with zipfile.ZipFile(tmp_path / "le.pt") as zin, zipfile.ZipFile(tmp_path / "be.pt", "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("/byteorder"):
                data = b"big"
            elif "/data/" in info.filename and not info.filename.endswith("serialization_id"):
                data = np.frombuffer(data, "<f8").astype(">f8").tobytes()
            zout.writestr(info, data)
    assert np.array_equal(torch.load(tmp_path / "be.pt", weights_only=True).numpy(), X)  # the file is right
    with open_array(str(tmp_path / "be.pt")) as f:
        assert np.array_equal(f.chunk(0, 300), X) and np.array_equal(f.chunk(17, 99), X[17:99])


def test_file_truncated_inside_one_read(tmp_path, monkeypatch):
    """Truncated between the size check and the read: the short read is the same one-line error."""
    path, spec, _ = _write("npy", tmp_path, features(n=1000))
    with open_array(spec) as f:
        f.chunk(0, 100)
        os.truncate(path, os.path.getsize(path) - 800)
        monkeypatch.setattr(type(f._reader), "_check_size", lambda self, a, b: None)
        with pytest.raises(UserError, match=r"x\.npy: the file is shorter than its header promises \(truncated"):
            f.chunk(900, 1000)


def test_file_already_truncated_when_opened(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    torch.save(torch.from_numpy(features(n=1000)), tmp_path / "x.pt")
    os.truncate(tmp_path / "x.pt", os.path.getsize(tmp_path / "x.pt") - 4000)
    line = run_error(["eval", str(tmp_path / "x.pt"), "--no-progress"], capsys)
    assert "x.pt" in line


# -- HDF5 data stored in other files ----------------------------------------------------------

def test_hdf5_external_and_virtual_datasets_are_refused(tmp_path, capsys, monkeypatch):
    h5py = pytest.importorskip("h5py")
    monkeypatch.chdir(tmp_path)
    np.arange(400, dtype="<f8").tofile("secret.bin")
    with h5py.File("src.h5", "w") as f:
        f["x"] = features(n=50, p=4)
    with h5py.File("d.h5", "w") as f:
        f.create_dataset("ext", shape=(50, 4), dtype="<f8", external=[("secret.bin", 0, 1600)])
        layout = h5py.VirtualLayout(shape=(50, 4), dtype="f8")
        layout[:] = h5py.VirtualSource("src.h5", "x", shape=(50, 4))
        f.create_virtual_dataset("vds", layout)
        f.create_dataset("empty", data=h5py.Empty("f8"))
    with h5py.File("bundle.h5", "w") as f:  # the default key of a bundle is checked too
        f.create_dataset("features", shape=(50, 4), dtype="<f8", external=[("secret.bin", 0, 1600)])
    line = run_error(["eval", "d.h5:ext", "--no-progress"], capsys)
    assert "d.h5:ext" in line and "external files (secret.bin)" in line
    line = run_error(["eval", "d.h5:vds", "--no-progress"], capsys)
    assert "d.h5:vds" in line and "virtual dataset" in line and "src.h5" in line
    line = run_error(["eval", "bundle.h5", "--no-progress"], capsys)
    assert "bundle.h5:features" in line and "secret.bin" in line
    line = run_error(["eval", "d.h5:empty", "--no-progress"], capsys)
    assert "d.h5:empty" in line and "empty dataset" in line


def test_parquet_column_chunks_in_other_files_are_refused(tmp_path, capsys, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    monkeypatch.chdir(tmp_path)
    pq.write_table(pa.table({"features": [list(r) for r in features(n=50, p=3)]}), "data.parquet")
    md = pq.read_metadata("data.parquet")
    md.set_file_path("data.parquet")  # a metadata file whose column chunks point at another file
    md.write_metadata_file("meta.parquet")
    line = run_error(["eval", "meta.parquet", "--no-progress"], capsys)
    assert "meta.parquet:features" in line and "stored in other files (data.parquet)" in line


# -- ambiguous archives -----------------------------------------------------------------------

def _npy_bytes(a):
    import io

    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def test_npz_member_named_twice_is_refused(tmp_path, capsys):
    X = features(n=40, p=3)
    with pytest.warns(UserWarning, match="Duplicate name"), zipfile.ZipFile(tmp_path / "d.npz", "w") as z:
        z.writestr("features.npy", _npy_bytes(X))
        z.writestr("features.npy", _npy_bytes(X[:, :2]))  # zipfile would silently read this one
    line = run_error(["eval", str(tmp_path / "d.npz"), "--no-progress"], capsys)
    assert "d.npz" in line and "'features.npy' appears more than once" in line
    # a saved state with a second M
    m = richness.Moments()
    m.update(X, X[:, :2])
    m.save(tmp_path / "s.npz")
    with zipfile.ZipFile(tmp_path / "s.npz") as z:
        M = z.read("M.npy")
    with pytest.warns(UserWarning, match="Duplicate name"), zipfile.ZipFile(tmp_path / "s.npz", "a") as z:
        z.writestr("M.npy", M)
    with pytest.raises(ValueError, match=r"s\.npz.*'M\.npy' appears more than once"):
        richness.Moments.load(tmp_path / "s.npz")


def test_parquet_null_inside_a_list_is_named(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [list(r) for r in features(n=30, p=3)]
    rows[17][1] = None
    for name, typ in (("var.parquet", pa.list_(pa.float64())), ("fixed.parquet", pa.list_(pa.float64(), 3))):
        pq.write_table(pa.table({"features": pa.array(rows, type=typ)}), tmp_path / name)
        line = run_error(["eval", str(tmp_path / name), "--no-progress"], capsys)
        assert f"{name}:features: row 17 holds a null value inside its list" in line


# -- saves: permission bits, temp files of other writers --------------------------------------

def test_save_over_a_file_keeps_its_permission_bits(tmp_path):
    m = richness.Moments()
    m.update(features(n=30, p=3))
    old = os.umask(0o022)
    try:
        for mode in (0o600, 0o640, 0o444):
            path = tmp_path / f"s{mode:o}.npz"
            m.save(path)
            os.chmod(path, mode)
            m.save(path)  # over it
            assert path.stat().st_mode & 0o777 == mode
            assert states_equal(richness.Moments.load(path).state_dict(), m.state_dict())
        m.save(tmp_path / "new.npz")
        assert (tmp_path / "new.npz").stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(old)


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_save_keeps_other_writers_temp_files(tmp_path):
    """A temp file whose PID is not alive here may be a save in progress on another machine or in
    another container sharing the folder: kept while fresh, removed once a day old."""
    pid = _dead_pid()
    names = [f".richness-{pid}-abcd1234.tmp",  # the older naming: no host tag
             f".richness-0123456789ab-{pid}-abcd1234.tmp"]  # another host's tag
    for name in names:
        (tmp_path / name).write_bytes(b"partial")
    m = richness.Moments()
    m.update(features(n=30, p=3))
    m.save(tmp_path / "s.npz")
    assert sorted(os.listdir(tmp_path)) == sorted(names + ["s.npz"])
    old = time.time() - _statefile.STALE_TEMP_AGE - 60
    for name in names:
        os.utime(tmp_path / name, (old, old))
    m.save(tmp_path / "s.npz")
    assert os.listdir(tmp_path) == ["s.npz"]


def test_save_removes_this_hosts_dead_writer_temp_only(tmp_path):
    pid = _dead_pid()
    host = _statefile._host_tag()
    mine = tmp_path / f".richness-{host}-{pid}-zz.tmp"  # this host, writer gone: provably stale
    alive = tmp_path / f".richness-{host}-{os.getppid()}-zz.tmp"  # this host, writer alive
    for p in (mine, alive):
        p.write_bytes(b"partial")
    m = richness.Moments()
    m.update(features(n=30, p=3))
    m.save(tmp_path / "s.npz")
    assert sorted(os.listdir(tmp_path)) == sorted([alive.name, "s.npz"])


# -- one-line messages ------------------------------------------------------------------------

def test_evaluate_refuses_unbatched_samples():
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    dataset = [(torch.randn(4), torch.tensor(i % 3)) for i in range(20)]
    with pytest.raises(ValueError, match=r"head's input has shape \(8,\): the loader yields unbatched samples"):
        richness.evaluate(model, dataset, progress=False)
    batches = [(torch.randn(5, 4), torch.tensor(1)) for _ in range(3)]  # a batch with one label
    with pytest.raises(ValueError, match=r"the labels are one value \(shape \(\)\) but the head saw 5 samples"):
        richness.evaluate(model, batches, progress=False)


def test_rtol_of_any_real_type():
    X = features(n=200, p=6, seed=3)
    F = X[:, :2] ** 2
    m = richness.Moments()
    m.update(X, F)
    for rtol in (np.float32(1e-6), np.float64(1e-6), 1e-6):
        rep = m.compute(rtol=rtol)
        want, rank = dlr_naive(X, F, rtol=float(rtol))
        assert rep.rank == rank and abs(rep.dlr - want) < 1e-10
    for bad in (np.float32(2.0), np.float32("nan"), True, "1e-6"):
        with pytest.raises(ValueError, match="rtol must be a number in"):
            m.compute(rtol=bad)


def _log(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_plot_names_file_and_line_of_a_non_numeric_value(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _log(tmp_path / "a.jsonl", [{"step": 1, "dlr": 0.5}, {"step": 2, "dlr": "0.4"}])
    line = run_error(["plot", str(tmp_path / "a.jsonl")], capsys)
    assert f"{tmp_path / 'a.jsonl'}: line 2: dlr is not a number ('0.4')" in line
    (tmp_path / "b.csv").write_text("step,dlr,nc1\n1,0.5,0.1\n2,0.4,high\n")
    line = run_error(["plot", str(tmp_path / "b.csv")], capsys)
    assert f"{tmp_path / 'b.csv'}: line 3: nc1 is not a number ('high')" in line


def test_plot_warns_about_dlr_outside_the_unit_interval(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from richness import plot

    records = [{"step": 1, "dlr": 0.5}, {"step": 2, "dlr": 1.7}, {"step": 3, "dlr": float("nan")},
               {"step": 4, "dlr": None}, {"step": 5, "dlr": -0.2}]
    with pytest.warns(richness.RichnessWarning, match=r"2 DLR value\(s\) outside \[0, 1\] \(first at step 2: "
                                                      r"1\.7\).*1 NaN DLR value"):
        plot.history(records, tmp_path / "h")
    _log(tmp_path / "ok.jsonl", [{"step": 1, "dlr": 0.5}, {"step": 2, "dlr": None}])
    assert main(["plot", str(tmp_path / "ok.jsonl")]) == 0
    assert "warning" not in capsys.readouterr().err  # None (undefined at that step) is not warned about
    _log(tmp_path / "bad.jsonl", records)
    assert main(["plot", str(tmp_path / "bad.jsonl")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"richness: warning: {tmp_path / 'bad.jsonl'}: 2 DLR value(s)")


def test_plot_title_shows_a_file_name_with_dollars_as_written(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib import cbook

    from richness import plot

    titles = []
    real = plot.history
    monkeypatch.setattr(plot, "history", lambda *a, **k: titles.append(k["title"]) or real(*a, **k))
    name = r"run$\alpha^$.jsonl"  # not valid mathtext: the title failed to draw
    _log(tmp_path / name, [{"step": 1, "dlr": 0.5}, {"step": 2, "dlr": 0.4}])
    assert main(["plot", str(tmp_path / name)]) == 0
    assert not cbook.is_math_text(titles[0]) and titles[0].replace(r"\$", "$") == name
    assert os.path.getsize(tmp_path / r"run$\alpha^$_richness.png") > 0
