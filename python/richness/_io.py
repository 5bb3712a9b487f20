"""Saved state: a NumPy .npz archive (no pickle), written atomically.

Layout: one array per state entry plus ``meta``, a UTF-8 JSON document with
the format name, version, scalar fields and a SHA-256 over every array's
bytes. Loading checks all of it, so a truncated, corrupted or foreign file
is rejected with a message naming the file and the problem.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
import zipfile

import numpy as np

from ._state import FLOAT_FIELDS as FLOATS
from ._state import INT_FIELDS as INTS
from ._state import SCALARS

FORMAT = "richness.moments"
VERSION = 1


def _digest(arrays: dict, scalars: dict) -> str:
    """SHA-256 over the scalar fields and every array (key, shape, bytes)."""
    h = hashlib.sha256()
    h.update(json.dumps({k: scalars[k] for k in SCALARS}, sort_keys=True).encode())
    for key in FLOATS + INTS:
        a = np.ascontiguousarray(arrays[key])
        h.update(key.encode())
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def save_state(state: dict, path: "os.PathLike | str") -> None:
    """Write ``state`` to ``path`` atomically: a temp file in the same folder,
    fsync, then rename over the target. A crash leaves the old file intact."""
    path = os.fspath(path)
    arrays = {k: np.asarray(state[k]) for k in FLOATS + INTS}
    meta = {"format": FORMAT, "version": VERSION, **{k: state[k] for k in SCALARS},
            "sha256": _digest(arrays, state)}
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".richness-", suffix=".tmp", dir=folder)
    try:
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


def load_state(path: "os.PathLike | str") -> dict:
    """Read and validate a file written by ``save_state``."""
    path = os.fspath(path)

    def bad(why: str) -> ValueError:
        return ValueError(f"{path}: {why}")

    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise bad(f"cannot read ({e.strerror})") from None
    try:
        with np.load(io.BytesIO(raw), allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    # A damaged zip header can also read as an unsupported compression method or
    # zip version (NotImplementedError) or as an encrypted member (RuntimeError).
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError, zipfile.LargeZipFile,
            NotImplementedError, RuntimeError) as e:
        raise bad(f"not a richness state, or truncated or corrupted ({e})") from None
    if "meta" not in data:
        raise bad("not a richness state (no meta entry)")
    try:
        meta = json.loads(data["meta"].tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise bad("corrupted metadata") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise bad(f"not a richness state (format {meta.get('format') if isinstance(meta, dict) else None!r})")
    if meta.get("version") != VERSION:
        raise bad(f"unsupported state version {meta.get('version')!r}; this richness reads version {VERSION}")
    missing = [k for k in SCALARS + FLOATS + INTS + ("sha256",) if k not in meta and k not in data]
    if missing:
        raise bad(f"missing entries: {', '.join(missing)}")
    for k in FLOATS:
        if data[k].dtype != np.float64:
            raise bad(f"entry {k} has dtype {data[k].dtype}, expected float64")
    if data["class_counts"].dtype != np.int64:
        raise bad(f"entry class_counts has dtype {data['class_counts'].dtype}, expected int64")
    if _digest(data, meta) != meta["sha256"]:
        raise bad("checksum mismatch: the file is corrupted")
    state = {k: meta[k] for k in SCALARS}
    state.update({k: data[k] for k in FLOATS + INTS})
    return state
