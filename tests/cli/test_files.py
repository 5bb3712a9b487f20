"""The rules every command of the command line applies to its files: a file it writes is never one
of its inputs and replaces an existing one only with --force; an input reached twice (a link,
another spelling) is refused; a file changed between the first check and its read is an error;
directories of shards skip _SUCCESS markers and other _- or .-names. Values against the float64
oracles of tests/reference.py."""

import functools
import gc
import json
import os
import warnings

import numpy as np
import pytest

import richness
from conftest import linear_data
from reference import cka_naive, dlr_naive
from richness.cli import main

data = functools.partial(linear_data, n=300, p=6, c=3, shift=2.0)
PARTS = ((0, 100), (100, 200), (200, 300))


def run(argv, capsys):
    """(exit code, stdout, stderr) of one command."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def run_error(argv, capsys):
    code, out, err = run(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("richness: error:") and "Traceback" not in err, err
    return lines[0]


def write_parts(folder, name, a):
    os.makedirs(folder, exist_ok=True)
    paths = []
    for i, (lo, hi) in enumerate(PARTS):
        paths.append(str(folder / f"{name}-{i}.npy"))
        np.save(paths[-1], a[lo:hi])
    return paths


def saved_parts(tmp_path, X, F=None):
    paths = []
    for i, (lo, hi) in enumerate(PARTS):
        m = richness.Moments()
        m.update(X[lo:hi], None if F is None else F[lo:hi])
        paths.append(str(tmp_path / f"part{i}.npz"))
        m.save(paths[-1])
    return paths


# -- a file written is never an input ------------------------------------------------------


def test_cka_save_onto_an_input_is_refused_before_anything_is_read(tmp_path, capsys):
    X, F, _ = data()
    np.save(tmp_path / "a.npy", X)
    np.save(tmp_path / "b.npy", F)
    before = (tmp_path / "a.npy").read_bytes()
    os.symlink(tmp_path / "a.npy", tmp_path / "link.npy")
    for target in ("a.npy", "link.npy", "sub/../a.npy"):
        line = run_error(["cka", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"), "--no-progress",
                          "--save", str(tmp_path / target)], capsys)
        assert "is an input file" in line and "would overwrite it" in line, line
    assert (tmp_path / "a.npy").read_bytes() == before
    # a shard a glob matches
    write_parts(tmp_path / "x", "x", X)
    write_parts(tmp_path / "f", "f", F)
    shard = tmp_path / "x" / "x-1.npy"
    before = shard.read_bytes()
    line = run_error(["cka", str(tmp_path / "x" / "x-*.npy"), str(tmp_path / "f"), "--no-progress",
                      "--save", str(shard)], capsys)
    assert str(shard) in line and "is an input file" in line
    assert shard.read_bytes() == before


def test_plot_onto_an_input_through_a_link_is_refused(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    X, F, _ = data()
    m = richness.Moments()
    m.update(X, F)
    state = tmp_path / "s.npz"
    m.save(state)
    before = state.read_bytes()
    os.symlink(state, tmp_path / "out.png")  # PREFIX.png is the state itself
    line = run_error(["plot", str(state), "-o", str(tmp_path / "out")], capsys)
    assert "out.png" in line and "is an input file" in line
    assert state.read_bytes() == before


def test_merge_output_that_is_the_head_file_is_refused(tmp_path, capsys):
    X, _, _, W = linear_data(n=300, p=6, c=3, head=True)
    paths = saved_parts(tmp_path, X)
    np.save(tmp_path / "w.npy", W)
    before = (tmp_path / "w.npy").read_bytes()
    line = run_error(["merge", str(tmp_path / "w.npy"), *paths, "--json", "--head", str(tmp_path / "w.npy"),
                      "--force"], capsys)
    assert "is an input file" in line and (tmp_path / "w.npy").read_bytes() == before


# -- an existing output only with --force ---------------------------------------------------


def test_merge_with_the_output_forgotten_keeps_the_first_part(tmp_path, capsys):
    X, F, _ = data()
    paths = saved_parts(tmp_path, X, F)
    before = (tmp_path / "part0.npz").read_bytes()
    line = run_error(["merge", *paths], capsys)
    assert line.startswith(f"richness: error: {paths[0]}: exists")
    assert "richness merge OUT IN [IN ...]" in line and "--force" in line
    assert (tmp_path / "part0.npz").read_bytes() == before
    # asked for: the first part replaced by the merge of the other two
    code, out, _ = run(["merge", *paths, "--force"], capsys)
    assert code == 0
    st = richness.Moments.load(paths[0]).state_dict()
    Xs = X[100:]
    Xc = Xs - Xs.mean(0)
    assert st["n"] == 200 and np.abs(st["M"] - Xc.T @ Xc).max() < 1e-10 * np.abs(Xc.T @ Xc).max()


@pytest.mark.parametrize("command", ["eval", "eval-test", "cka", "plot"])
def test_every_write_refuses_an_existing_file_without_force(tmp_path, capsys, command):
    X, F, _ = data()
    np.save(tmp_path / "x.npy", X)
    np.save(tmp_path / "f.npy", F)
    target = tmp_path / "old.npz"
    if command == "eval":
        argv = ["eval", str(tmp_path / "x.npy"), "--outputs", str(tmp_path / "f.npy"), "--save", str(target)]
    elif command == "eval-test":
        argv = ["eval", str(tmp_path / "x.npy"), "--test-features", str(tmp_path / "x.npy"),
                "--save-test", str(target)]
    elif command == "cka":
        argv = ["cka", str(tmp_path / "x.npy"), str(tmp_path / "f.npy"), "--save", str(target)]
    else:
        pytest.importorskip("matplotlib")
        m = richness.Moments()
        m.update(X, F)
        m.save(tmp_path / "s.npz")
        target = tmp_path / "old.png"
        argv = ["plot", str(tmp_path / "s.npz"), "-o", str(tmp_path / "old")]
    target.write_bytes(b"precious")
    line = run_error(argv + ["--no-progress"] * (command != "plot"), capsys)
    assert str(target) in line and "exists" in line and "--force" in line
    assert target.read_bytes() == b"precious"
    code, _, _ = run(argv + ["--no-progress"] * (command != "plot") + ["--force"], capsys)
    assert code == 0 and target.read_bytes() != b"precious"
    if command != "plot":
        kind = richness.Similarity if command == "cka" else richness.Moments
        assert kind.load(target).n == 300


# -- a file reached twice -------------------------------------------------------------------


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_a_shard_reached_twice_is_refused_by_eval_and_cka(tmp_path, capsys, how):
    X, F, _ = data()
    write_parts(tmp_path / "x", "x", X)
    write_parts(tmp_path / "f", "f", F)
    (os.symlink if how == "symlink" else os.link)(tmp_path / "x" / "x-2.npy", tmp_path / "x" / "x-latest.npy")
    (os.symlink if how == "symlink" else os.link)(tmp_path / "f" / "f-2.npy", tmp_path / "f" / "f-latest.npy")
    for argv in (["eval", str(tmp_path / "x"), "--outputs", str(tmp_path / "f"), "--json"],
                 ["cka", str(tmp_path / "x"), str(tmp_path / "f")]):
        line = run_error(argv + ["--no-progress"], capsys)
        assert "x-latest.npy" in line and "x-2.npy" in line and "count twice" in line, line


def test_merge_refuses_a_state_given_twice_by_two_spellings(tmp_path, capsys, monkeypatch):
    X, F, _ = data()
    saved_parts(tmp_path, X, F)
    monkeypatch.chdir(tmp_path)
    line = run_error(["merge", str(tmp_path / "m.npz"), "part0.npz", "./part0.npz", "part1.npz"], capsys)
    assert "count twice" in line and not (tmp_path / "m.npz").exists()


# -- a file changed between the scan and the read -------------------------------------------


def test_eval_refuses_a_shard_rewritten_after_the_scan(tmp_path, capsys, monkeypatch):
    from richness.cli import commands

    X, F, _ = data()
    write_parts(tmp_path / "x", "x", X)
    write_parts(tmp_path / "f", "f", F)
    scan = commands.scan

    def scan_then_rewrite(*a, **k):
        layout = scan(*a, **k)
        np.save(tmp_path / "x" / "x-1.npy", X[100:150])  # the dump still being written: fewer rows now
        return layout

    monkeypatch.setattr(commands, "scan", scan_then_rewrite)
    line = run_error(["eval", str(tmp_path / "x"), "--outputs", str(tmp_path / "f"), "--no-progress", "--json"],
                     capsys)
    assert "x-1.npy" in line and "changed since it was first read" in line, line


def test_cka_refuses_a_shard_rewritten_after_the_scan(tmp_path, capsys, monkeypatch):
    from richness.cli import cka

    X, F, _ = data()
    write_parts(tmp_path / "x", "x", X)
    write_parts(tmp_path / "f", "f", F)
    opened = []
    real = cka._open

    def open_and_rewrite(spec):
        opened.append(spec)
        if len(opened) == 7:  # the scan opened all six files: a shard grows before it is read
            np.save(tmp_path / "f" / "f-2.npy", np.concatenate([F[200:], F[:50]]))
        return real(spec)

    monkeypatch.setattr(cka, "_open", open_and_rewrite)
    line = run_error(["cka", str(tmp_path / "x"), str(tmp_path / "f"), "--no-progress", "--json"], capsys)
    assert "f-2.npy" in line and "changed since it was first read" in line, line


def test_merge_refuses_a_state_replaced_between_its_two_reads(tmp_path, capsys, monkeypatch):
    X, F, _ = data()
    paths = saved_parts(tmp_path, X, F)
    load = richness.Moments.load.__func__
    calls = []

    def load_and_replace(cls, path):
        calls.append(path)
        if len(calls) == len(paths) + 1:  # every input validated; another process replaces one
            m = richness.Moments()
            m.update(X[:100] * 2.0, F[:100])
            m.save(paths[1])
        return load(cls, path)

    monkeypatch.setattr(richness.Moments, "load", classmethod(load_and_replace))
    line = run_error(["merge", str(tmp_path / "m.npz"), *paths, "--json"], capsys)
    assert paths[1] in line and "changed since it was first read" in line, line
    assert not (tmp_path / "m.npz").exists()


# -- richness cka: each representation once, at least two, some samples ----------------------


def test_cka_refuses_one_representation_given_twice(tmp_path, capsys, monkeypatch):
    X, F, _ = data()
    np.savez(tmp_path / "bundle.npz", x=X)
    np.save(tmp_path / "a.npy", X)
    np.save(tmp_path / "f.npy", F)
    monkeypatch.chdir(tmp_path)
    for args in (["bundle.npz", "bundle.npz:x", "f.npy"], ["a.npy", "./a.npy"], ["a.npy", "f.npy", "a.npy"]):
        line = run_error(["cka", *args, "--no-progress"], capsys)
        assert "the same" in line and "twice" in line, line
    line = run_error(["cka", "a.npy", "--no-progress"], capsys)
    assert "a.npy" in line and "at least two" in line
    # distinct representations still give the oracle's value
    code, out, _ = run(["cka", "bundle.npz:x", "f.npy", "--no-progress", "--json", "--precision", "fp64"], capsys)
    assert code == 0 and abs(json.loads(out)["cka"][0][1] - cka_naive(X, F)) < 1e-12


def test_cka_of_files_with_no_rows_names_them(tmp_path, capsys):
    np.save(tmp_path / "a.npy", np.zeros((0, 3)))
    np.save(tmp_path / "b.npy", np.zeros((0, 2)))
    line = run_error(["cka", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"), "--no-progress"], capsys)
    assert str(tmp_path / "a.npy") in line and "no samples" in line and "update it first" not in line


# -- directories of shards skip _ and . names ------------------------------------------------


def test_shard_directory_skips_success_markers(tmp_path, capsys):
    X, F, _ = data()
    write_parts(tmp_path / "x", "x", X)
    write_parts(tmp_path / "f", "f", F)
    for folder in ("x", "f"):
        (tmp_path / folder / "_SUCCESS").write_bytes(b"")
        (tmp_path / folder / "_metadata.json").write_text("{}")
        (tmp_path / folder / "_temporary").mkdir()
        np.save(tmp_path / folder / "_temporary" / "x-9.npy", X[:5])
    want, rank = dlr_naive(X, F)
    for x, f in ((tmp_path / "x", tmp_path / "f"), (tmp_path / "x" / "*", tmp_path / "f" / "**" / "*.npy")):
        code, out, err = run(["eval", str(x), "--outputs", str(f), "--no-progress", "--json"], capsys)
        assert code == 0, err
        rep = json.loads(out)
        assert rep["n"] == 300 and rep["rank"] == rank and abs(rep["dlr"] - want) < 1e-10


# -- richness merge of head-mode states ------------------------------------------------------


def test_merge_of_head_mode_states_says_why_dlr_is_null_and_takes_a_head(tmp_path, capsys):
    X, _, _, W = linear_data(n=300, p=6, c=3, head=True)
    paths = saved_parts(tmp_path, X)
    np.save(tmp_path / "w.npy", W)
    code, out, err = run(["merge", str(tmp_path / "m.npz"), *paths, "--json"], capsys)
    assert code == 0 and json.loads(out)["dlr"] is None
    assert "warning" in err and "--head" in err and "no outputs" in err
    code, out, err = run(["merge", str(tmp_path / "m2.npz"), *paths, "--json", "--head", str(tmp_path / "w.npy")],
                         capsys)
    assert code == 0, err
    assert abs(json.loads(out)["dlr"] - dlr_naive(X, X @ W.T)[0]) < 1e-10


# -- no file handle left open ----------------------------------------------------------------


def test_plot_with_a_head_leaves_no_file_open(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    X, _, _, W = linear_data(n=300, p=6, c=3, head=True)
    m = richness.Moments()
    m.update(X)
    m.save(tmp_path / "s.npz")
    np.save(tmp_path / "w.npy", W)
    code, out, err = run(["plot", str(tmp_path / "s.npz"), "--head", str(tmp_path / "w.npy"),
                          "-o", str(tmp_path / "p")], capsys)
    assert code == 0 and "unclosed" not in err and "warning" not in err, err


@pytest.mark.parametrize("command", ["eval", "cka", "refused"])
def test_commands_leave_no_file_open(tmp_path, capsys, command):
    X, F, _, W = linear_data(n=300, p=6, c=3, head=True)
    np.save(tmp_path / "x.npy", X)
    np.save(tmp_path / "f.npy", F)
    np.save(tmp_path / "w.npy", W)
    np.save(tmp_path / "int.npy", np.ones((300, 2), dtype=np.int64))
    argv = {"eval": ["eval", str(tmp_path / "x.npy"), "--head", str(tmp_path / "w.npy"), "--json"],
            "cka": ["cka", str(tmp_path / "x.npy"), str(tmp_path / "f.npy"), "--json"],
            "refused": ["cka", str(tmp_path / "x.npy"), str(tmp_path / "int.npy")]}[command]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        run(argv + ["--no-progress"], capsys)
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]
