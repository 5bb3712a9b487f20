"""richness cka against the n x n float64 oracles of tests/reference.py."""

import json

import numpy as np
import pytest

from reference import cka_debiased_naive, cka_naive
from richness.cli import main
from richness import Similarity


def representations(n=150, offset=0.0, seed=0):
    """Three representations of the same n rows: a and b share a 4-dimensional base, c is independent."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(n, 4))
    a = base @ rng.normal(size=(4, 6)) + rng.normal(size=(n, 6)) + offset
    b = base @ rng.normal(size=(4, 3)) + 2 * rng.normal(size=(n, 3)) - offset
    c = rng.normal(size=(n, 5))
    return a, b, c


@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_cka_json_matches_oracle_in_chunks(tmp_path, capsys, offset):
    a, b, c = representations(offset=offset)
    np.save(tmp_path / "a.npy", a)
    np.savez(tmp_path / "bc.npz", b=b, c=c.astype(np.float32))
    args = ["cka", str(tmp_path / "a.npy"), f"{tmp_path / 'bc.npz'}:b", f"{tmp_path / 'bc.npz'}:c", "--json",
            "--chunk", "37", "--precision", "fp64", "--no-progress", "--save", str(tmp_path / "s.npz")]
    assert main(args) == 0
    rep = json.loads(capsys.readouterr().out)
    assert set(rep) == {"names", "cka", "cka_debiased", "n", "widths"}
    assert rep["n"] == 150 and rep["widths"] == [6, 3, 5]
    xs = [a, b, c.astype(np.float32).astype(np.float64)]
    for i in range(3):
        for j in range(3):
            tol = 1e-9
            assert rep["cka"][i][j] == pytest.approx(cka_naive(xs[i], xs[j]), abs=tol)
            assert rep["cka_debiased"][i][j] == pytest.approx(cka_debiased_naive(xs[i], xs[j]), abs=tol)
    s = Similarity.load(tmp_path / "s.npz")
    assert s.n == 150 and s.compute().cka[0, 1] == pytest.approx(rep["cka"][0][1], rel=1e-12)


def test_cka_text_table(tmp_path, capsys):
    a, b, _ = representations()
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    assert main(["cka", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"), "--measures", "cka_debiased",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "debiased" in out and f"{cka_debiased_naive(a, b):9.5f}" in out


def test_cka_refusals(tmp_path, capsys):
    a, b, _ = representations()
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "short.npy", b[:100])
    np.save(tmp_path / "int.npy", np.ones((150, 2), dtype=np.int64))
    bad = a.copy()
    bad[120, 1] = np.nan
    np.save(tmp_path / "nan.npy", bad)
    for args, msg in ((["short.npy"], "different numbers of samples"), (["int.npy"], "floating point"),
                      (["nan.npy"], "NaN"), (["a.npy"], "twice")):
        assert main(["cka", str(tmp_path / "a.npy"), *[str(tmp_path / x) for x in args], "--no-progress",
                     "--save", str(tmp_path / "never.npz")]) == 2
        assert msg in capsys.readouterr().err
        assert not (tmp_path / "never.npz").exists()


def test_richness_merge_of_similarity_states(tmp_path, capsys):
    from richness._engine import kinds as _kinds
    from richness._engine.similarity import FORMAT

    assert _kinds.get("similarity").format == FORMAT
    a, b, c = representations(offset=300.0)
    halves = []
    for i, rows in enumerate((slice(0, 40), slice(40, 150))):
        s = Similarity()
        s.update({"a": a[rows], "b": b[rows]})
        halves.append(tmp_path / f"h{i}.npz")
        s.save(halves[-1])
    assert main(["merge", str(tmp_path / "m.npz"), *map(str, halves), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["n"] == 150
    assert rep["cka"][0][1] == pytest.approx(cka_naive(a, b), rel=1e-9)
    assert rep["cka_debiased"][0][1] == pytest.approx(cka_debiased_naive(a, b), rel=1e-9)
    other = Similarity()
    other.update({"a": a, "c": c})
    other.save(tmp_path / "o.npz")
    assert main(["merge", str(tmp_path / "x.npz"), str(halves[0]), str(tmp_path / "o.npz")]) == 2
    assert "different representations" in capsys.readouterr().err and not (tmp_path / "x.npz").exists()


def test_cka_shards_equal_the_whole_and_the_oracle(tmp_path, capsys):
    a, b, _ = representations(n=210, offset=50.0)
    (tmp_path / "b").mkdir()
    for i, (lo, hi) in enumerate([(0, 70), (70, 71), (71, 210)]):   # uneven, one a single row
        np.save(tmp_path / f"a-{i:05d}.npy", a[lo:hi])
        np.save(tmp_path / "b" / f"part-{i}.npy", b[lo:hi])
    args = ["cka", str(tmp_path / "a-*.npy"), str(tmp_path / "b"), "--json", "--chunk", "16", "--no-progress"]
    assert main(args) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["n"] == 210 and rep["names"] == [str(tmp_path / "a-*.npy"), str(tmp_path / "b")]
    assert rep["cka"][0][1] == pytest.approx(cka_naive(a, b), abs=1e-9)
    assert rep["cka_debiased"][0][1] == pytest.approx(cka_debiased_naive(a, b), abs=1e-9)


def test_cka_shard_refusals_are_one_line(tmp_path, capsys):
    a, b, _ = representations(n=60)
    for i in range(2):
        np.save(tmp_path / f"a-{i}.npy", a[30 * i:30 * (i + 1)])
    np.save(tmp_path / "b-0.npy", b)
    assert main(["cka", str(tmp_path / "a-*.npy"), str(tmp_path / "b-*.npy"), "--no-progress"]) == 2
    assert "different numbers of files" in capsys.readouterr().err
    np.save(tmp_path / "b-0.npy", b[:30])
    np.save(tmp_path / "b-1.npy", b[30:, :2])
    assert main(["cka", str(tmp_path / "a-*.npy"), str(tmp_path / "b-*.npy"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "b-1.npy: width 2, but shard 1" in err
