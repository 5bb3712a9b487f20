"""The save-format policy: the stored version-1 file loads with its values, a
file written before a field existed is refused naming the field, and a file
from a newer richness is refused naming both versions.

tests/data/state_v1.npz was written by format version 1 from ``seeded_data()``
(``python tests/engine/test_save_format.py`` wrote it); it is never regenerated, so
that it stays a file of that version. The values are checked against a float64
computation from the same seeded data, not against what the code produced."""

import io
import json
import os
import zipfile

import numpy as np
import pytest

import richness
from richness import _state
from richness._engine import statefile as _statefile
from reference import dlr_naive

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "state_v1.npz")
SCHEMA = _state.FIELDS


def seeded_data():
    rng = np.random.default_rng(20261201)
    X = rng.normal(size=(10, 3)) + 1.5
    F = rng.normal(size=(10, 2))
    y = rng.permutation(np.arange(10) % 2)
    return X, F, y


def write_fixture(path):
    X, F, y = seeded_data()
    m = richness.Moments(precision="fp64")
    m.update(X[:6], F[:6], labels=y[:6])
    m.update(X[6:], F[6:], labels=y[6:])
    m.save(path)


def expected():
    """The state of ``seeded_data()`` in float64: means, centred co-moments, class counts and raw class sums."""
    X, F, y = seeded_data()
    Xc, Fc = X - X.mean(0), F - F.mean(0)
    return {"n": 10, "p": 3, "c": 2, "t": -1, "k": 2, "num_classes": -1, "precision": "fp64",
            "mean": X.mean(0), "M": Xc.T @ Xc, "out_mean": F.mean(0), "B": Xc.T @ Fc, "A": Fc.T @ Fc,
            "tgt_mean": np.zeros(0), "Bt": np.zeros((3, 0)), "At": np.zeros((0, 0)),
            "class_counts": np.bincount(y, minlength=2), "class_sums": np.stack([X[y == j].sum(0) for j in (0, 1)])}


def assert_matches_reference(state):
    want = expected()
    for key in want:
        if isinstance(want[key], (int, str)):
            assert state[key] == want[key], key
            continue
        assert state[key].shape == want[key].shape, key
        np.testing.assert_allclose(state[key], want[key], rtol=1e-12, atol=1e-12, err_msg=key)


def with_field(monkeypatch, field, version=_statefile.VERSION + 1):
    """The schema with ``field`` appended and the format version bumped, as a
    release that adds a field would have it (Python lists only: the core keeps
    its own, so these tests stay at the loader)."""
    fields = SCHEMA + (field,)
    for mod, names in ((_state, ("FIELDS", "FIELD_NAMES", "FLOAT_FIELDS", "INT_FIELDS")),
                       (_statefile, ("FIELDS", None, "FLOATS", "INTS"))):
        values = (fields, tuple(f.name for f in fields), tuple(f.name for f in fields if f.dtype == np.float64),
                  tuple(f.name for f in fields if f.dtype == np.int64))
        for name, value in zip(names, values):
            if name:
                monkeypatch.setattr(mod, name, value)
    monkeypatch.setattr(_statefile, "VERSION", version)


def test_the_stored_v1_file_loads_with_the_seeded_values():
    meta = json.loads(np.load(FIXTURE)["meta"].tobytes().decode())
    assert meta["version"] == 1
    m = richness.Moments.load(FIXTURE)
    assert_matches_reference(m.state_dict())
    X, F, _ = seeded_data()
    assert abs(m.compute().dlr - dlr_naive(X, F)[0]) < 1e-12


def test_a_field_added_later_refuses_the_older_file_by_name(monkeypatch):
    old_state_dict = _statefile.load_state(FIXTURE)
    with_field(monkeypatch, _state.Field("D", ("p", "c")))
    with pytest.raises(ValueError, match=r"state_v1\.npz: missing entries: D$"):
        _statefile.load_state(FIXTURE)
    with pytest.raises(ValueError, match=r"state_v1\.npz: missing entries: D$"):
        richness.Moments.load(FIXTURE)
    with pytest.raises(ValueError, match=r"state is missing entries: D$"):
        _state.checked(old_state_dict)


def test_a_file_written_under_a_new_field_holds_it_and_records_the_new_version(monkeypatch, tmp_path):
    st = _state.checked(_statefile.load_state(FIXTURE))
    # members the schema does not know are refused, not ignored
    with pytest.raises(ValueError, match="unknown entries: Z"):
        _state.checked(dict(st, Z=np.zeros(3)))
    with_field(monkeypatch, _state.Field("D", ("p", "c")))
    st["D"] = np.arange(6.0).reshape(3, 2)
    _statefile.save_state(st, tmp_path / "new_field.npz")
    again = _state.checked(_statefile.load_state(tmp_path / "new_field.npz"))
    assert_matches_reference(again)
    assert np.array_equal(again["D"], st["D"])
    assert json.loads(np.load(tmp_path / "new_field.npz")["meta"].tobytes().decode())["version"] == _statefile.VERSION


def test_a_torchmetrics_state_dict_from_before_a_field_is_refused_by_name(monkeypatch):
    torch = pytest.importorskip("torch")
    tm = pytest.importorskip("richness.torchmetrics")
    X, F, y = (torch.from_numpy(a) for a in seeded_data())
    old = tm.DLR()
    old.persistent(True)
    old.update(F, y, features=X)
    sd = old.state_dict()
    with_field(monkeypatch, _state.Field("D", ("p", "c")))
    with pytest.raises(ValueError, match=r"state is missing entries: D$"):
        tm.DLR().load_state_dict(dict(sd))


def with_version(raw, version):
    with np.load(io.BytesIO(raw), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays.pop("meta").tobytes().decode())
    meta["version"] = version  # outside the checksum: the file is otherwise intact
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    return buf.getvalue()


@pytest.mark.parametrize("version,pattern", [
    (3, r"unsupported state version 3 \(written by a newer richness: update richness to read it\); this richness "
        r"reads versions 1 to 2"),
    (0, r"unsupported state version 0; this richness reads versions 1 to 2"),
    ("1", r"unsupported state version '1'; this richness reads versions 1 to 2"),
    (True, r"unsupported state version True; this richness reads versions 1 to 2"),
])
def test_a_file_from_a_newer_or_unknown_version_is_refused(tmp_path, version, pattern):
    path = tmp_path / "future.npz"
    with open(FIXTURE, "rb") as f:
        path.write_bytes(with_version(f.read(), version))
    assert zipfile.is_zipfile(path)
    with pytest.raises(ValueError, match=pattern):
        richness.Moments.load(path)


if __name__ == "__main__":  # how tests/data/state_v1.npz was written (format version 1)
    write_fixture(FIXTURE)
