"""Sharded inputs of `richness eval` and `richness merge`, against the float64 n x n oracles."""

import functools
import json
import os
from pathlib import Path

import numpy as np
import pytest

import richness
from richness.cli import main
from reference import dlr_naive, nc1_naive
from conftest import linear_data

data = functools.partial(linear_data, n=400, p=10, c=4, shift=3.0)

# uneven shards, one of a single row (a shard need not have 2)
CUTS = (0, 130, 131, 290, 400)




def write_shards(folder, name, a, cuts=CUTS, ext="npy"):
    os.makedirs(folder, exist_ok=True)
    for i in range(len(cuts) - 1):
        part = a[cuts[i]:cuts[i + 1]]
        path = os.path.join(folder, f"{name}-{i:05d}.{ext}")
        np.save(path, part) if ext == "npy" else np.savez(path, **{name: part})


def run_json(argv, capsys):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def run_error(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("richness: error:") and "Traceback" not in err, err
    return lines[0]


def check_report(rep, X, F, y):
    want, rank = dlr_naive(X, F)
    assert rep["n"] == X.shape[0] and rep["rank"] == rank
    assert abs(rep["dlr"] - want) <= 1e-12 * max(abs(want), 1.0)
    assert abs(rep["nc1"] - nc1_naive(X, y)) < 1e-9 * rep["nc1"]


def test_shards_equal_the_concatenated_file_and_the_reference(tmp_path, capsys):
    X, F, y = data()
    write_shards(tmp_path / "f", "x", X)
    write_shards(tmp_path / "o", "o", F)
    write_shards(tmp_path / "y", "y", y)
    np.save(tmp_path / "x.npy", X), np.save(tmp_path / "o.npy", F), np.save(tmp_path / "y.npy", y)
    whole = run_json(["eval", str(tmp_path / "x.npy"), "--outputs", str(tmp_path / "o.npy"), "--labels",
                      str(tmp_path / "y.npy"), "--no-progress", "--save", str(tmp_path / "whole.npz")], capsys)
    # a directory, a quoted glob, a glob with a key-less .npy: all three forms in one call
    sharded = run_json(["eval", str(tmp_path / "f"), "--outputs", str(tmp_path / "o" / "o-*.npy"), "--labels",
                        str(tmp_path / "y"), "--chunk", "47", "--no-progress", "--save",
                        str(tmp_path / "sharded.npz")], capsys)
    check_report(sharded, X, F, y)
    assert sharded["n"] == whole["n"] and abs(sharded["dlr"] - whole["dlr"]) < 1e-12
    a = richness.Moments.load(tmp_path / "sharded.npz").state_dict()
    Xc = X - X.mean(0)
    assert np.array_equal(a["class_counts"], np.bincount(y, minlength=4))
    assert np.abs(a["M"] - Xc.T @ Xc).max() < 1e-10 * np.abs(Xc.T @ Xc).max()


def test_bundle_shards_with_held_out_shards(tmp_path, capsys):
    X, F, y = data(n=600)
    for i, (a, b) in enumerate(((0, 150), (150, 400))):
        np.savez(tmp_path / f"train-{i}.npz", features=X[a:b], outputs=F[a:b], labels=y[a:b])
    for i, (a, b) in enumerate(((400, 480), (480, 600))):
        np.savez_compressed(tmp_path / f"test-{i}.npz", features=X[a:b], outputs=F[a:b], labels=y[a:b])
    rep = run_json(["eval", str(tmp_path / "train-*.npz"), "--test-features", str(tmp_path / "test-*.npz"),
                    "--no-progress"], capsys)
    m, t = richness.Moments(), richness.Moments()
    m.update(X[:400], F[:400], labels=y[:400])
    t.update(X[400:], F[400:], labels=y[400:])
    want = m.compute(test=t)
    check_report(rep, X[:400], F[:400], y[:400])
    assert np.allclose(rep["test_quality"], want.test_quality, rtol=1e-10, atol=1e-12)


def test_progress_counts_rows_over_all_shards(tmp_path, capsys):
    pytest.importorskip("tqdm")
    X, F, _ = data()
    write_shards(tmp_path / "f", "x", X)
    write_shards(tmp_path / "o", "o", F)
    assert main(["eval", str(tmp_path / "f"), "--outputs", str(tmp_path / "o"), "--chunk", "50"]) == 0
    err = capsys.readouterr().err
    assert "400/400" in err and "/130" not in err  # one bar over the 400 rows, not one per shard


@pytest.mark.parametrize("case", ["count", "rows", "width", "dtype", "nomatch", "mixed", "stream"])
def test_bad_shards_are_one_line_naming_the_shard_and_nothing_saved(tmp_path, capsys, case):
    X, F, y = data()
    write_shards(tmp_path / "f", "x", X)
    write_shards(tmp_path / "o", "o", F)
    out = tmp_path / "state.npz"
    feats, outs = str(tmp_path / "f"), str(tmp_path / "o" / "*.npy")
    extra = []
    if case == "count":
        os.remove(tmp_path / "o" / "o-00003.npy")
        want = "x-00003.npy: shard 4 of features has no partner in --outputs"
    elif case == "rows":
        np.save(tmp_path / "o" / "o-00002.npy", F[131:289])
        want = "o-00002.npy: has 158 rows but"
    elif case == "width":
        np.save(tmp_path / "f" / "x-00002.npy", X[131:290, :9])
        want = "x-00002.npy: features of width 9, but shard 1"
    elif case == "dtype":
        write_shards(tmp_path / "y", "y", y)
        np.save(tmp_path / "y" / "y-00001.npy", y[130:131].astype(np.float64))
        extra, want = ["--labels", str(tmp_path / "y")], "y-00001.npy: labels must be integers"
    elif case == "nomatch":
        outs, want = str(tmp_path / "o" / "*.npz"), "no file matches"
    elif case == "mixed":
        np.savez(tmp_path / "f" / "x-00009.npz", features=X[:5])
        want = "holds files of several formats"
    else:
        for i, (a, b) in enumerate(((0, 200), (200, 400))):
            arrays = {"features": X[a:b], "outputs": F[a:b]} if i == 0 else {"features": X[a:b]}
            np.savez(tmp_path / f"b-{i}.npz", **arrays)
        feats, outs, want = str(tmp_path / "b-*.npz"), None, "b-1.npz:features: shard 2 lacks outputs, unlike shard 1"
    argv = ["eval", feats] + (["--outputs", outs] if outs else []) + extra + ["--save", str(out), "--no-progress"]
    line = run_error(argv, capsys)
    assert want in line, line
    assert not out.exists()


def test_save_into_a_shard_is_refused(tmp_path, capsys):
    X, F, _ = data()
    write_shards(tmp_path / "f", "x", X)
    target = tmp_path / "f" / "x-00001.npy"
    before = target.read_bytes()
    line = run_error(["eval", str(tmp_path / "f"), "--save", str(target), "--no-progress"], capsys)
    assert "is an input file" in line and target.read_bytes() == before


# -- richness merge --------------------------------------------------------------------


def saved_thirds(tmp_path, X, F, y, num_classes=None):
    paths = []
    for i, (a, b) in enumerate(((0, 120), (120, 250), (250, X.shape[0]))):
        m = richness.Moments(num_classes)
        m.update(X[a:b], F[a:b], labels=y[a:b])
        paths.append(str(tmp_path / f"third-{i}.npz"))
        m.save(paths[-1])
    return paths


def test_merge_of_thirds_equals_the_whole(tmp_path, capsys):
    X, F, y = data()
    paths = saved_thirds(tmp_path, X, F, y)
    out = tmp_path / "merged.npz"
    rep = run_json(["merge", str(out)] + paths, capsys)
    check_report(rep, X, F, y)
    st = richness.Moments.load(out).state_dict()
    Xc, Fc = X - X.mean(0), F - F.mean(0)
    assert st["n"] == 400 and np.array_equal(st["class_counts"], np.bincount(y, minlength=4))
    assert np.abs(st["B"] - Xc.T @ Fc).max() < 1e-10 * np.abs(Xc.T @ Fc).max()
    # a glob and a plain run print one line, and give the same file
    assert main(["merge", str(tmp_path / "again.npz"), str(tmp_path / "third-*.npz")]) == 0
    assert "merged 3 moments states (400 samples)" in capsys.readouterr().out
    again = richness.Moments.load(tmp_path / "again.npz").state_dict()
    assert np.abs(again["M"] - Xc.T @ Xc).max() < 1e-10 * np.abs(Xc.T @ Xc).max()


@pytest.mark.parametrize("case", ["width", "classes", "corrupt", "twice", "out_is_input", "not_a_state"])
def test_merge_refusals_name_the_files_and_write_nothing(tmp_path, capsys, case):
    X, F, y = data()
    paths = saved_thirds(tmp_path, X, F, y)
    out = tmp_path / "merged.npz"
    if case == "width":
        m = richness.Moments()
        m.update(X[:50, :9], F[:50], labels=y[:50])
        m.save(tmp_path / "narrow.npz")
        paths.append(str(tmp_path / "narrow.npz"))
        want = [f"{paths[0]} and {paths[-1]} cannot be merged", "feature widths [9, 10]"]
    elif case == "classes":
        m = richness.Moments(7)
        m.update(X[:50], F[:50], labels=y[:50])
        m.save(tmp_path / "fixed7.npz")
        n = richness.Moments(9)
        n.update(X[50:90], F[50:90], labels=y[50:90])
        n.save(tmp_path / "fixed9.npz")
        paths = [paths[0], str(tmp_path / "fixed7.npz"), str(tmp_path / "fixed9.npz")]
        want = [f"{paths[1]} and {paths[2]} cannot be merged", "num_classes [7, 9]"]
    elif case == "corrupt":
        raw = bytearray(Path(paths[1]).read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        Path(paths[1]).write_bytes(bytes(raw))
        want = [paths[1]]
    elif case == "twice":
        paths.append(paths[0])
        want = ["the same file as", "would count twice"]
    elif case == "out_is_input":
        out = tmp_path / "third-2.npz"
        want = ["is an input file", "would overwrite it"]
    else:
        np.save(tmp_path / "plain.npy", X)
        paths.append(str(tmp_path / "plain.npy"))
        want = [f"{paths[-1]}: ", "not a richness state"]
    before = out.read_bytes() if out.exists() else None
    line = run_error(["merge", str(out)] + paths + ["--json"], capsys)
    assert all(w in line for w in want), line
    assert (out.read_bytes() == before) if before is not None else not out.exists()
