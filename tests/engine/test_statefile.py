"""save / load: exact round trip, atomic replacement, and rejection of bad files
with a ValueError naming the file and the problem."""

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import zipfile

import numpy as np
import pytest

import richness
from reference import dlr_naive, states_equal


def filled(num_classes=None, targets=True, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    X = (rng.normal(size=(120, 5)) + 2.0).astype(dtype)
    F = (X.astype(np.float64) @ rng.normal(size=(5, 3))).astype(dtype)
    y = rng.integers(0, 4, size=120)
    T = rng.normal(size=(120, 2)).astype(dtype)
    m = richness.Moments(num_classes=num_classes)
    for idx in np.array_split(np.arange(120), 3):
        m.update(X[idx], F[idx], labels=y[idx], targets=T[idx] if targets else None)
    return m, X, F


@pytest.mark.parametrize("num_classes,targets,dtype", [(None, True, np.float64), (6, False, np.float32)])
def test_round_trip_is_exact(tmp_path, num_classes, targets, dtype):
    m, X, F = filled(num_classes, targets, dtype)
    path = tmp_path / "state.npz"
    m.save(path)
    loaded = richness.Moments.load(path)
    assert states_equal(loaded.state_dict(), m.state_dict())
    assert loaded.num_classes == num_classes
    assert loaded.n == m.n
    a, b = m.compute(), loaded.compute()
    assert a.dlr == b.dlr and a.precision == b.precision and a.nc1 == b.nc1
    assert np.array_equal(a.quality, b.quality)
    assert abs(b.dlr - dlr_naive(X, F)[0]) < (1e-12 if dtype == np.float64 else 1e-6)
    # a loaded state keeps streaming exactly like the original
    rng = np.random.default_rng(9)
    Xn = rng.normal(size=(10, 5)).astype(dtype)
    kw = dict(labels=rng.integers(0, 4, 10), targets=rng.normal(size=(10, 2)).astype(dtype) if targets else None)
    m.update(Xn, Xn[:, :3], **kw)
    loaded.update(Xn, Xn[:, :3], **kw)
    assert states_equal(loaded.state_dict(), m.state_dict())


def test_round_trip_str_path_and_empty_state(tmp_path):
    m = richness.Moments(num_classes=3)
    path = str(tmp_path / "empty.npz")
    m.save(path)
    loaded = richness.Moments.load(path)
    assert loaded.n == 0 and loaded.num_classes == 3
    assert states_equal(loaded.state_dict(), m.state_dict())
    with pytest.raises(ValueError, match=r"empty"):
        loaded.compute()


def test_file_needs_no_pickle(tmp_path):
    m, _, _ = filled()
    path = tmp_path / "s.npz"
    m.save(path)
    with np.load(path, allow_pickle=False) as z:
        assert "meta" in z.files
        meta = json.loads(z["meta"].tobytes().decode())
    assert meta["format"] == "richness.moments" and meta["version"] == 2
    assert meta["n"] == 120


# -- atomic save --------------------------------------------------------------------------

def test_save_replaces_the_file_by_rename(tmp_path):
    m, _, _ = filled()
    path = tmp_path / "s.npz"
    m.save(path)
    inode = os.stat(path).st_ino
    m2, _, _ = filled(seed=1)
    m2.save(path)
    # a new file took the old one's name (written elsewhere, renamed over it)
    assert os.stat(path).st_ino != inode
    assert states_equal(richness.Moments.load(path).state_dict(), m2.state_dict())
    assert sorted(os.listdir(tmp_path)) == ["s.npz"]  # no temp files left


def test_failing_save_leaves_old_file_valid(tmp_path, monkeypatch):
    old, _, _ = filled()
    path = tmp_path / "s.npz"
    old.save(path)
    old_bytes = path.read_bytes()
    new, _, _ = filled(seed=2)

    real_savez = np.savez

    def savez_then_fail(file, *args, **kwargs):
        real_savez(file, *args, **kwargs)  # part of the data reaches the disk ...
        file.write(b"garbage")
        raise OSError("disk full (simulated)")  # ... and then the write fails

    monkeypatch.setattr(np, "savez", savez_then_fail)
    with pytest.raises(OSError, match="simulated"):
        new.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == old_bytes
    assert states_equal(richness.Moments.load(path).state_dict(), old.state_dict())
    assert sorted(os.listdir(tmp_path)) == ["s.npz"]  # the temp file was removed


def test_failing_save_before_any_file(tmp_path, monkeypatch):
    m, _, _ = filled()
    path = tmp_path / "never.npz"

    def fail(*args, **kwargs):
        raise OSError("simulated")

    monkeypatch.setattr(np, "savez", fail)
    with pytest.raises(OSError):
        m.save(path)
    assert os.listdir(tmp_path) == []


# -- bad files ----------------------------------------------------------------------------

def saved_bytes(tmp_path):
    m, _, _ = filled()
    path = tmp_path / "good.npz"
    m.save(path)
    return path.read_bytes()


def rewrite(raw, change_meta=None, change_arrays=None, resign=False):
    """Rebuild an archive after editing its meta document and/or arrays.
    resign=True recomputes the checksum, as a buggy writer would: the file is
    then intact, and what is tested is the validation behind the checksum."""
    with np.load(io.BytesIO(raw), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays.pop("meta").tobytes().decode())
    if change_meta:
        change_meta(meta)
    if change_arrays:
        change_arrays(arrays)
    if resign:
        from richness._engine.statefile import _digest

        meta["sha256"] = _digest(arrays, meta)
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    return buf.getvalue()


def member_payload(raw, name):
    """(start, end) byte offsets of an archive member's stored data."""
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        info = zf.getinfo(name)
    with io.BytesIO(raw) as f:  # the local header's own name/extra lengths
        f.seek(info.header_offset + 26)
        name_len, extra_len = np.frombuffer(f.read(4), dtype="<u2")
    start = info.header_offset + 30 + int(name_len) + int(extra_len)
    return start, start + info.compress_size


def flip_middle(raw):
    # The middle byte of the largest array's payload (the file's literal middle can
    # fall in zip header fields Python's zipfile ignores; the sweep below covers those).
    start, end = member_payload(raw, "M.npy")
    b = bytearray(raw)
    b[(start + end) // 2] ^= 0xFF
    return bytes(b)


def resign(raw, change_meta):
    return rewrite(raw, change_meta, resign=True)


def drop(key):
    return lambda d: d.pop(key)


def set_(key, value):
    return lambda d: d.__setitem__(key, value)


def array_tweak(arrays):
    arrays["M"] = arrays["M"].copy()
    arrays["M"][0, 0] += 1.0  # valid archive, stale checksum


def array_dtype(arrays):
    arrays["M"] = arrays["M"].astype(np.float32)


def array_shape(arrays):
    arrays["mean"] = arrays["mean"][:-1]


def foreign_npz(_raw):
    buf = io.BytesIO()
    np.savez(buf, x=np.arange(3))
    return buf.getvalue()


def pickled_npz(_raw):
    buf = io.BytesIO()
    np.savez(buf, meta=np.array([{"format": "richness.moments"}], dtype=object))
    return buf.getvalue()


BAD_FILES = {
    "byte flipped in the middle": (flip_middle, r"corrupted|checksum"),
    "truncated to half": (lambda raw: raw[: len(raw) // 2], r"truncated or corrupted"),
    "truncated by one byte": (lambda raw: raw[:-1], r"truncated or corrupted"),
    "empty file": (lambda raw: b"", r"truncated or corrupted"),
    "not a zip": (lambda raw: b"this is a text file, not a richness state\n" * 20, r"not a richness state"),
    "foreign npz": (foreign_npz, r"not a richness state \(no meta entry\)"),
    "pickled object array": (pickled_npz, r"not a richness state"),
    "wrong version": (lambda raw: rewrite(raw, set_("version", 3)), r"unsupported state version 3"),
    "wrong format": (lambda raw: rewrite(raw, set_("format", "other.tool")), r"not a richness state.*other\.tool"),
    "meta missing n": (lambda raw: rewrite(raw, drop("n")), r"missing entries: n"),
    "meta missing checksum": (lambda raw: rewrite(raw, drop("sha256")), r"missing entries: sha256"),
    "array missing": (lambda raw: rewrite(raw, change_arrays=drop("A")), r"missing entries: A"),
    "array edited": (lambda raw: rewrite(raw, change_arrays=array_tweak), r"checksum mismatch"),
    "array dtype": (lambda raw: rewrite(raw, change_arrays=array_dtype), r"entry M has dtype float32"),
    "array shape": (lambda raw: rewrite(raw, change_arrays=array_shape), r"checksum mismatch|shape"),
    "bad meta json": (None, r"corrupted metadata"),
    "meta n edited": (lambda raw: rewrite(raw, set_("n", 121)), r"checksum mismatch"),
    # intact archives whose entries do not form a valid state
    "meta n not an integer": (lambda raw: resign(raw, set_("n", "120")), r"not a valid richness state.*'n'"),
    "meta n negative": (lambda raw: resign(raw, set_("n", -3)), r"not a valid richness state.*n is negative"),
    "meta n disagrees with class counts": (lambda raw: resign(raw, set_("n", 121)),
                                           r"not a valid richness state.*class counts do not add up"),
    "meta p disagrees with arrays": (lambda raw: resign(raw, set_("p", 6)), r"not a valid richness state.*shape"),
    "meta num_classes not an integer": (lambda raw: resign(raw, set_("num_classes", "x")),
                                        r"not a valid richness state.*num_classes"),
    "meta num_classes too small": (lambda raw: resign(raw, set_("num_classes", 2)),
                                   r"not a valid richness state.*more classes than num_classes"),
    "meta unknown precision": (lambda raw: resign(raw, set_("precision", "fp8")),
                               r"not a valid richness state.*precision"),
    "meta precision null": (lambda raw: resign(raw, set_("precision", None)),
                            r"not a valid richness state.*precision"),
}


def bad_meta_json(raw):
    with np.load(io.BytesIO(raw), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["meta"] = np.frombuffer(b"{not json", dtype=np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_file_is_rejected(tmp_path, name):
    make, pattern = BAD_FILES[name]
    make = make or bad_meta_json
    raw = saved_bytes(tmp_path)
    path = tmp_path / "bad.npz"
    path.write_bytes(make(raw))
    keep, _, _ = filled(seed=3)
    before = keep.state_dict()
    with pytest.raises(ValueError, match=pattern) as info:
        richness.Moments.load(path)
    assert str(path) in str(info.value)  # the message names the file
    assert states_equal(keep.state_dict(), before)


def test_every_single_byte_flip_is_rejected(tmp_path):
    # A sweep over the whole file: wherever a byte flips, load raises ValueError
    # (never another exception) or, for a flip in zip header fields that carry no
    # data (timestamps, the local zip64 extra field), loads the identical state.
    raw = saved_bytes(tmp_path)
    good = richness.Moments.load(tmp_path / "good.npz").state_dict()
    path = tmp_path / "flip.npz"
    rejected = tried = 0
    for mask in (0x01, 0xFF):
        for pos in range(mask % 7, len(raw), 7):
            b = bytearray(raw)
            b[pos] ^= mask
            path.write_bytes(bytes(b))
            tried += 1
            try:
                state = richness.Moments.load(path).state_dict()
            except ValueError as e:
                assert str(path) in str(e)
                rejected += 1
                continue
            assert states_equal(state, good), (pos, mask)
    assert rejected > tried // 2  # most bytes matter


def test_file_middle_byte_flip(tmp_path):
    raw = saved_bytes(tmp_path)
    b = bytearray(raw)
    b[len(b) // 2] ^= 0xFF
    path = tmp_path / "mid.npz"
    path.write_bytes(bytes(b))
    good = richness.Moments.load(tmp_path / "good.npz").state_dict()
    try:
        state = richness.Moments.load(path).state_dict()
    except ValueError as e:
        assert "corrupted" in str(e) or "not a richness state" in str(e)
    else:
        assert states_equal(state, good)


def test_every_payload_byte_flip_is_rejected(tmp_path):
    # Inside any member's stored data, every flip is caught (zip CRC or the SHA-256).
    raw = saved_bytes(tmp_path)
    path = tmp_path / "flip.npz"
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        names = zf.namelist()
    for name in names:
        start, end = member_payload(raw, name)
        for pos in range(start, end, 7):
            b = bytearray(raw)
            b[pos] ^= 0x10
            path.write_bytes(bytes(b))
            with pytest.raises(ValueError, match=r"corrupted|checksum|not a richness state"):
                richness.Moments.load(path)


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(ValueError, match=r"not a regular file \(a directory\)"):
        richness.Moments.load(tmp_path)


# -- file system behaviour and hostile archives ----------------------------------------------

def test_saved_file_follows_the_umask(tmp_path):
    m, _, _ = filled()
    old = os.umask(0o022)
    try:
        m.save(tmp_path / "a.npz")
        os.umask(0o077)
        m.save(tmp_path / "b.npz")
    finally:
        os.umask(old)
    assert (tmp_path / "a.npz").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "b.npz").stat().st_mode & 0o777 == 0o600


def test_next_save_removes_temp_files_of_a_killed_save(tmp_path):
    import subprocess
    import sys

    m, _, _ = filled()
    path = tmp_path / "s.npz"
    # a save killed between writing and renaming: its temp file stays behind
    code = ("import os, numpy as np, richness, richness._engine.statefile as io_\n"
            "m = richness.Moments(); m.update(np.random.default_rng(0).normal(size=(50, 4)))\n"
            "os.replace = lambda *a: os.kill(os.getpid(), 9)\n"
            f"m.save({str(path)!r})\n")
    subprocess.run([sys.executable, "-c", code], check=False)
    left = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert len(left) == 1 and left[0].startswith(".richness-")
    other = tmp_path / ".other.npz.richness-1-x.tmp"  # another target's: not ours to remove
    other.write_bytes(b"")
    m.save(path)
    assert sorted(os.listdir(tmp_path)) == sorted(["s.npz", other.name])
    assert states_equal(richness.Moments.load(path).state_dict(), m.state_dict())


@pytest.mark.parametrize("declared", [False, True])
def test_archive_claiming_a_huge_array_is_rejected_before_reading(tmp_path, declared):
    """A foreign archive whose M.npy header claims a (1e7, 1e7) float64 array
    (728 TiB), with or without meta declaring p = 1e7: rejected from the
    headers, nothing allocated."""
    raw = saved_bytes(tmp_path)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False,
                                                  "shape": (10**7, 10**7)})
    path = tmp_path / "huge.npz"
    with zipfile.ZipFile(io.BytesIO(raw)) as zin, zipfile.ZipFile(path, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename == "M.npy":
                data = header.getvalue() + b"\0" * 64
            if info.filename == "meta.npy" and declared:
                meta = json.loads(np.load(io.BytesIO(data)).tobytes().decode())
                meta["p"] = 10**7
                buf = io.BytesIO()
                np.save(buf, np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
                data = buf.getvalue()
            zout.writestr(info.filename, data)
    with pytest.raises(ValueError, match=r"huge.npz.*(claims shape|has shape)"):
        richness.Moments.load(path)


def test_missing_file_npy_file_and_extra_member(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        richness.Moments.load(tmp_path / "nothere.npz")
    np.save(tmp_path / "plain.npy", np.zeros(3))
    with pytest.raises(ValueError, match=r"plain.npy.*single .npy array"):
        richness.Moments.load(tmp_path / "plain.npy")
    raw = saved_bytes(tmp_path)
    extra = rewrite(raw, change_arrays=lambda a: a.update(extra=np.zeros(2)))
    (tmp_path / "extra.npz").write_bytes(extra)
    with pytest.raises(ValueError, match=r"extra.npz.*unexpected entries: extra"):
        richness.Moments.load(tmp_path / "extra.npz")


def test_saved_state_survives_kill_between_saves(tmp_path):
    path = tmp_path / "state.npz"
    script = textwrap.dedent(f"""
        import numpy as np, richness, sys
        rng = np.random.default_rng(0)
        m = richness.Moments()
        m.update(rng.normal(size=(50, 8)), rng.normal(size=(50, 3)))
        m.save({str(path)!r})
        print("first", m.n, flush=True)
        big = richness.Moments()
        big.update(rng.normal(size=(2000, 700)))
        while True:  # second save, killed somewhere inside it
            big.save({str(path)!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().split() == ["first", "50"]
    time.sleep(0.4)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    m = richness.Moments.load(path)  # still valid: the old state or a complete new one
    assert m.n in (50, 2000)
    if m.n == 50:
        rng = np.random.default_rng(0)
        X, F = rng.normal(size=(50, 8)), rng.normal(size=(50, 3))
        assert abs(m.compute().dlr - dlr_naive(X, F)[0]) < 1e-12
    leftovers = [f for f in os.listdir(tmp_path) if f != "state.npz"]
    assert all(f.startswith(".richness-") for f in leftovers)  # only a temp file can remain


# -- bounded reading and path handling ------------------------------------------------------

NOT_REGULAR = """
import resource, sys, time, richness
vm = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize")][0]
resource.setrlimit(resource.RLIMIT_AS, (vm + 200_000_000, resource.RLIM_INFINITY))
t = time.time()
try:
    richness.Moments.load(sys.argv[1])
except ValueError as e:
    print(f"{time.time() - t:.3f}", e)
"""


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo"])
def test_load_refuses_endless_or_blocking_sources_at_once(tmp_path, kind):
    # reading a symlink to /dev/zero never ends (and fills memory); opening a FIFO blocks for ever
    path = tmp_path / "state.npz"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink(kind, path)
    out = subprocess.run([sys.executable, "-c", NOT_REGULAR, str(path)], capture_output=True, text=True, timeout=60)
    seconds, msg = out.stdout.strip().split(" ", 1)
    what = "a pipe" if kind == "fifo" else "a character device"
    assert msg == f"{path}: not a regular file ({what}); give a file on disk" and float(seconds) < 1.0


STATE_TOO_LARGE = """
import resource, sys, richness
vm = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize")][0]
resource.setrlimit(resource.RLIMIT_AS, (vm + 100_000_000, resource.RLIM_INFINITY))
try:
    richness.Moments.load(sys.argv[1])
except MemoryError as e:
    print(e)
"""


def test_a_state_larger_than_memory_is_refused_with_its_size(tmp_path):
    # p = 5,000: a 200 MB Gram of zeros compresses to 200 kB; under a limit of 100 MB more than
    # the process has, loading refuses from the headers with the state's size
    p = 5000
    state = dict(richness._state.empty(), n=10, p=p)
    for f in richness._state.FIELDS:
        state[f.name] = np.zeros(richness._state.shape_of(f, state), f.dtype)
    meta = {"format": "richness.moments", "version": 1, **{k: state[k] for k in richness._state.SCALARS},
            "sha256": richness._engine.statefile._digest(state, state)}
    path = tmp_path / "big.npz"
    np.savez_compressed(path, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
                        **{k: state[k] for k in richness._state.FIELD_NAMES})
    assert path.stat().st_size < 2_000_000
    # one BLAS thread: each thread's buffers would count against the child's 100 MB margin
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", STATE_TOO_LARGE, str(path)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.stdout.strip().startswith(f"{path}: the state at p=5000 needs 2e+08 bytes; this process has "), \
        out.stdout + out.stderr


def test_state_member_claiming_more_than_it_holds_is_refused(tmp_path):
    raw = saved_bytes(tmp_path)
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        members = {n: z.read(n) for n in z.namelist()}
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<f8", "fortran_order": False, "shape": (5, 6)})
    old = members["mean.npy"]
    members["mean.npy"] = head.getvalue() + old[len(old) - 40:]  # 5 floats held, 30 claimed
    path = tmp_path / "s.npz"
    with zipfile.ZipFile(path, "w") as z:
        for n, b in members.items():
            z.writestr(n, b)
    with pytest.raises(ValueError, match=r"member 'mean.npy' claims shape \(5, 6\) \(240 bytes\) but holds 40"):
        richness.Moments.load(path)


def test_save_takes_any_legal_path_and_refuses_empty_ones(tmp_path, monkeypatch):
    m, _, _ = filled()
    longest = tmp_path / ("s" * 240 + ".npz")  # 244 characters: legal, under NAME_MAX = 255
    m.save(longest)
    assert states_equal(richness.Moments.load(longest).state_dict(), m.state_dict())
    m.save(os.fsencode(tmp_path / "b.npz"))  # bytes
    assert states_equal(richness.Moments.load(os.fsencode(tmp_path / "b.npz")).state_dict(), m.state_dict())
    sub = tmp_path / "sub"
    sub.mkdir()
    monkeypatch.chdir(sub)
    for bad, err, why in (("", ValueError, "path is empty"), (b"", ValueError, "path is empty"),
                          ("folder/", ValueError, "names a folder"), (".", ValueError, "names a folder"),
                          (3, TypeError, "must be a str, bytes or os.PathLike, got int"),
                          (None, TypeError, "got NoneType")):
        with pytest.raises(err, match=why):
            m.save(bad)
        with pytest.raises((OSError, ValueError, TypeError)):
            richness.Moments.load(bad)
    assert os.listdir(sub) == [] and sorted(os.listdir(tmp_path)) == sorted([longest.name, "b.npz", "sub"])


def test_state_widths_outside_int64_and_boolean_class_counts_are_named():
    m, _, _ = filled()
    st = m.state_dict()
    st["n"] = np.uint64(2**64 - 1)
    fresh = richness.Moments()
    with pytest.raises(ValueError, match=r"state entry 'n' is 18446744073709551615, outside int64"):
        fresh.load_state_dict(st)
    assert fresh.n == 0
    for bad in (True, np.bool_(True), 2**63, 0):
        with pytest.raises(ValueError, match=r"num_classes must be an integer from 1 to 2\*\*63 - 1"):
            richness.Moments(num_classes=bad)
