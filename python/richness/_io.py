"""Saved state: a NumPy .npz archive (no pickle), written atomically.

Layout: one array per state entry plus ``meta``, a UTF-8 JSON document with
the format name, version, scalar fields and a SHA-256 over every array's
bytes. Loading checks all of it, so a truncated, corrupted or foreign file
is rejected with a message naming the file and the problem.

Versions: a file records the ``VERSION`` that wrote it. A file of a newer
version is refused, naming both versions; members the schema does not know
are refused, never ignored. An older file still loads: a field it predates
is filled by the field's ``fill`` rule (``_state.Field``; the same rule
completes an older ``state_dict`` in ``load_state_dict``), and a change no
fill rule can express registers ``UPGRADES[v]``, which turns a version-``v``
state into version ``v + 1``'s. A field with neither is refused by name.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import tempfile
import zipfile

import numpy as np

from ._state import FIELDS, SCALARS, shape_of, widths_of
from ._state import FLOAT_FIELDS as FLOATS
from ._state import INT_FIELDS as INTS

FORMAT = "richness.moments"
VERSION = 1  # bumped by every change of the schema (docs/ARCHITECTURE.md, "Adding things")
UPGRADES: dict = {}  # version v -> function(state of version v) -> state of version v + 1


def _digest(arrays: dict, scalars: dict) -> str:
    """SHA-256 over the scalar fields and every array (key, shape, bytes)."""
    h = hashlib.sha256()
    h.update(json.dumps({k: scalars[k] for k in SCALARS}, sort_keys=True).encode())
    for key in arrays:  # in the order written (the schema's when it was written)
        a = np.ascontiguousarray(arrays[key])
        h.update(key.encode())
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _temp_prefix(path: str) -> str:
    # The target's name and this process's id: a save can tell its own
    # leftovers (from a process that was killed) from a concurrent save's.
    return f".{os.path.basename(path)}.richness-"


def _remove_stale_temps(path: str) -> None:
    """Remove temp files of earlier saves to ``path`` whose process is gone
    (a save killed between writing and renaming leaves one behind)."""
    folder = os.path.dirname(os.path.abspath(path))
    prefix = _temp_prefix(path)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        pid = name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # that process is alive: its save may still be under way
        except ProcessLookupError:
            pass
        except OSError:  # alive, someone else's
            continue
        try:
            os.unlink(os.path.join(folder, name))
        except OSError:
            pass


def save_state(state: dict, path: "os.PathLike | str") -> None:
    """Write ``state`` to ``path`` atomically: a temp file in the same folder,
    fsync, then rename over the target. A crash leaves the old file intact
    (and a temp file that the next save to the same path removes). The file
    gets the permissions ``open`` would give a new file under the umask."""
    path = os.fspath(path)
    arrays = {k: np.asarray(state[k]) for k in FLOATS + INTS}
    meta = {"format": FORMAT, "version": VERSION, **{k: state[k] for k in SCALARS},
            "sha256": _digest(arrays, state)}
    folder = os.path.dirname(os.path.abspath(path))
    _remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{_temp_prefix(path)}{os.getpid()}-", suffix=".tmp", dir=folder)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes it 0600
        with os.fdopen(fd, "wb") as f:
            np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


_META_MAX = 1 << 20  # bytes; a real meta entry is a few hundred


def _member_headers(raw: bytes) -> dict:
    """``{name: (shape, dtype)}`` of every .npy member, read from the headers
    alone (no array data is read or allocated). A header that claims more
    data than its member holds is rejected here."""
    out = {}
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        for info in zf.infolist():
            name = info.filename
            if not name.endswith(".npy"):
                raise ValueError(f"unexpected member {name!r}")
            with zf.open(info) as f:
                version = np.lib.format.read_magic(f)
                if version == (1, 0):
                    shape, _, dtype = np.lib.format.read_array_header_1_0(f)
                elif version == (2, 0):
                    shape, _, dtype = np.lib.format.read_array_header_2_0(f)
                else:
                    raise ValueError(f"member {name!r} has npy format version {version}")
                need = int(np.prod(shape, dtype=object)) * dtype.itemsize
                if need > info.file_size:
                    raise ValueError(f"member {name!r} claims shape {tuple(shape)} ({need} bytes) but holds "
                                     f"{info.file_size} bytes")
            out[name[:-4]] = (tuple(shape), dtype)
    return out


def load_state(path: "os.PathLike | str") -> dict:
    """Read and validate a file written by ``save_state``. Every array's shape
    is checked against the widths the file declares before any data is read,
    so a foreign or hostile archive cannot make it allocate."""
    path = os.fspath(path)

    def bad(why: str) -> ValueError:
        return ValueError(f"{path}: {why}")

    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no such file", path) from None
    except OSError as e:
        raise bad(f"cannot read ({e.strerror})") from None
    if raw[:6] == b"\x93NUMPY":
        raise bad("a single .npy array, not a richness state (an .npz archive written by Moments.save)")
    # A damaged zip header can also read as an unsupported compression method or
    # zip version (NotImplementedError) or as an encrypted member (RuntimeError).
    damaged = (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError, zipfile.LargeZipFile,
               NotImplementedError, RuntimeError)
    try:
        headers = _member_headers(raw)
    except damaged as e:
        raise bad(f"not a richness state, or truncated or corrupted ({e})") from None
    if "meta" not in headers:
        raise bad("not a richness state (no meta entry)")
    meta_shape, meta_dtype = headers["meta"]
    if meta_dtype != np.uint8 or len(meta_shape) != 1 or meta_shape[0] > _META_MAX:
        raise bad(f"not a richness state (meta entry of shape {meta_shape}, dtype {meta_dtype})")
    try:
        with np.load(io.BytesIO(raw), allow_pickle=False) as z:
            meta_raw = z["meta"]
    except damaged as e:
        raise bad(f"not a richness state, or truncated or corrupted ({e})") from None
    try:
        meta = json.loads(meta_raw.tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise bad("corrupted metadata") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise bad(f"not a richness state (format {meta.get('format') if isinstance(meta, dict) else None!r})")
    version = meta.get("version")
    known = isinstance(version, int) and not isinstance(version, bool)
    if not (known and 1 <= version <= VERSION):
        newer = " (written by a newer richness: update richness to read it)" if known and version > VERSION else ""
        raise bad(f"unsupported state version {version!r}{newer}; this richness reads versions 1 to {VERSION}")
    # An upgraded file's members are the upgrades' to map; the result is checked on loading (load_state_dict).
    upgraded = any(v in UPGRADES for v in range(version, VERSION))
    missing = [k for k in SCALARS + ("sha256",) if k not in meta] + [
        f.name for f in FIELDS if f.name not in headers and f.fill is None and not upgraded]
    if missing:
        raise bad(f"missing entries: {', '.join(missing)}")
    extra = sorted(set(headers) - set(FLOATS + INTS) - {"meta"})
    if extra and not upgraded:
        raise bad(f"unexpected entries: {', '.join(extra)}")
    try:
        widths = widths_of(meta)
    except (TypeError, ValueError) as e:
        raise bad(f"not a valid richness state ({e})") from None
    for f in (f for f in FIELDS if f.name in headers and not upgraded):
        shape, dtype = headers[f.name]
        want = shape_of(f, widths)
        if shape != want:
            raise bad(f"not a valid richness state (entry {f.name} has shape {shape}, but the file's widths "
                      f"give {want})")
        if dtype != np.dtype(f.dtype):
            raise bad(f"entry {f.name} has dtype {dtype}, expected {np.dtype(f.dtype)}")
    try:
        with np.load(io.BytesIO(raw), allow_pickle=False) as z:
            data = {k: z[k] for k in z.files if k != "meta"}  # in the order written
    except damaged as e:
        raise bad(f"not a richness state, or truncated or corrupted ({e})") from None
    if _digest(data, meta) != meta["sha256"]:
        raise bad("checksum mismatch: the file is corrupted")
    state = {k: meta[k] for k in SCALARS}
    state.update(data)
    for v in range(version, VERSION):
        state = UPGRADES[v](state) if v in UPGRADES else state
    return state
