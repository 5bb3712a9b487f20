"""The registry of file formats the command line reads: the six built in, the
refusal of a suffix none reads, and a format added by one register call that
``richness eval`` then reads with no other change."""

import json

import numpy as np
import pytest

from richness.cli import main
from richness.cli import formats
from richness.cli.formats import ArrayFile
from reference import dlr_naive
from conftest import linear_data

SUFFIXES = ".npy, .npz, .safetensors, .pt, .h5/.hdf5 or .parquet"


def run_json(argv, capsys):
    assert main(["eval"] + argv + ["--json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out)


def run_error(argv, capsys):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    return lines[0]


def test_the_registry_holds_the_six_formats_with_their_suffixes():
    got = [(f.name, f.suffixes, f.needs) for f in formats.formats()]
    assert got == [("npy", (".npy",), None), ("npz", (".npz",), None),
                   ("safetensors", (".safetensors",), "safetensors"), ("pt", (".pt", ".pth"), "torch"),
                   ("h5", (".h5", ".hdf5"), "h5py"), ("parquet", (".parquet",), "pyarrow")]
    for f in formats.formats():
        assert issubclass(f.reader, ArrayFile)
        assert f.install is None if f.needs is None else f.install == f'pip install "richness[{f.needs}]"'
    assert formats.suffix_list() == SUFFIXES
    assert formats.find("a/b.NPY").name == "npy" and formats.find("w.pth").name == "pt"
    assert formats.find("x.hdf5").name == "h5" and formats.find("x.txt") is None


def test_an_unknown_suffix_is_the_same_one_line_error(tmp_path, capsys):
    (tmp_path / "x.txt").write_text("1 2 3\n")
    line = run_error(["eval", str(tmp_path / "x.txt"), "--no-progress"], capsys)
    assert line == f"richness: error: {tmp_path / 'x.txt'}: unknown file type; use {SUFFIXES}"
    line = run_error(["eval", str(tmp_path), "--no-progress"], capsys)  # a directory holding it
    assert line == f"richness: error: {tmp_path / 'x.txt'}: unknown file type; use {SUFFIXES}"


def test_a_suffix_already_read_is_refused():
    with pytest.raises(ValueError, match=r"\.npy: already read as 'npy'"):
        formats.register("other", ArrayFile, [".NPY"])
    with pytest.raises(ValueError, match="already registered"):
        formats.register("npy", ArrayFile, [".unused"])
    assert [f.name for f in formats.formats()][-1] == "parquet"


class ToyFile(ArrayFile):
    """A made-up format: one line of JSON naming each array's rows, columns and
    byte offset after the line, then the arrays' float64 data, row-major."""

    def _open(self, path):
        with open(path, "rb") as f:
            header = json.loads(f.readline())
            start = f.tell()
            key = self._pick(list(header), "array")
            rows, cols, offset = header[key]
            shape = (rows, cols) if cols else (rows,)
            strides = (8 * max(cols, 1), 8) if cols else (8,)
            self._raw(f, start + offset, shape, strides[:len(shape)], "<f8")


def write_toy(path, **arrays):
    header, parts, offset = {}, [], 0
    for name, a in arrays.items():
        a = np.ascontiguousarray(a, dtype="<f8")
        header[name] = [a.shape[0], a.shape[1] if a.ndim == 2 else 0, offset]
        parts.append(a.tobytes())
        offset += a.nbytes
    with open(path, "wb") as f:
        f.write(json.dumps(header).encode() + b"\n")
        for p in parts:
            f.write(p)


@pytest.fixture
def toy():
    fmt = formats.register("toy", ToyFile, [".toy"])
    try:
        yield fmt
    finally:
        formats.unregister("toy")
    assert formats.find("a.toy") is None and formats.suffix_list() == SUFFIXES


def test_a_registered_format_is_read_by_eval_end_to_end(tmp_path, capsys, toy):
    assert formats.find("A.TOY") is toy and formats.suffix_list() == SUFFIXES.replace(" or ", ", ") + " or .toy"
    X, F, _ = linear_data(n=500, p=12, c=4, noise=0.2)
    want, rank = dlr_naive(X, F)
    write_toy(tmp_path / "x.toy", X=X)
    write_toy(tmp_path / "f.toy", F=F)
    rep = run_json([str(tmp_path / "x.toy"), "--outputs", str(tmp_path / "f.toy"), "--chunk", "37"], capsys)
    assert rep["n"] == 500 and rep["rank"] == rank and abs(rep["dlr"] - want) < 1e-12
    # a bundle: features and outputs of one file, taken by name, and shards of it
    write_toy(tmp_path / "d.toy", features=X, outputs=F)
    rep = run_json([str(tmp_path / "d.toy"), "--chunk", "64"], capsys)
    assert rep["n"] == 500 and rep["rank"] == rank and abs(rep["dlr"] - want) < 1e-12
    (tmp_path / "parts").mkdir()
    write_toy(tmp_path / "parts" / "a.toy", features=X[:200], outputs=F[:200])
    write_toy(tmp_path / "parts" / "b.toy", features=X[200:], outputs=F[200:])
    rep = run_json([str(tmp_path / "parts"), "--chunk", "64"], capsys)
    assert rep["n"] == 500 and rep["rank"] == rank and abs(rep["dlr"] - want) < 1e-12
    # the base class's refusals come with it
    line = run_error(["eval", f"{tmp_path / 'd.toy'}:nope", "--no-progress"], capsys)
    assert line == f"richness: error: {tmp_path / 'd.toy'}: no array 'nope'; it has features, outputs"
    with open(tmp_path / "x.toy", "r+b") as f:
        f.truncate(1000)
    line = run_error(["eval", str(tmp_path / "x.toy"), "--no-progress"], capsys)
    assert f"{tmp_path / 'x.toy'}:X: the file is shorter than its header promises" in line
