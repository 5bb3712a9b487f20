"""Saved state: a NumPy .npz archive (no pickle), written atomically.

Layout: one array per state entry plus ``meta``, a UTF-8 JSON document with
the format name, version, scalar fields and a SHA-256 over every array's
bytes. Loading checks all of it, so a truncated, corrupted or foreign file
is rejected with a message naming the file and the problem.

Versions: a file records the ``VERSION`` that wrote it. A file of a newer
version is refused, naming both versions; members the schema does not know
are refused, never ignored. An older file loads when it holds every field of
the schema; a field it predates is refused by name.

Version 2 adds the groups of a ``Moments(groups=k)``: ``meta["groups"]``
holds the assignment (``next``, ``seed``, ``rng``) and each group's scalar
fields (``states``), and each group's arrays are members named
``group{i}.{field}``. A file without groups (every version-1 file) is the
state alone, read as before.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import stat
import tempfile
import time
import zipfile
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import numpy as np

from .._checks import is_int
from .bounded_io import check_memory, npz_members, open_regular, read_member
from .._state import FIELDS, MAX_GROUPS, SCALARS, shape_of, widths_of
from .._state import FLOAT_FIELDS as FLOATS
from .._state import INT_FIELDS as INTS

FORMAT = "richness.moments"
VERSION = 2  # bumped by every change of the schema (docs/ARCHITECTURE.md, "Adding things"); 2: groups


def _digest(arrays: dict, scalars: dict, extra: Optional[dict] = None) -> str:
    """SHA-256 over the scalar fields and every array (key, shape, bytes);
    a layout's ``extra`` metadata, when it has any, is hashed after them."""
    h = hashlib.sha256()
    h.update(json.dumps({k: scalars[k] for k in SCALARS}, sort_keys=True).encode())
    for key in arrays:  # in the order written (the schema's when it was written)
        a = np.ascontiguousarray(arrays[key])
        h.update(key.encode())
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    if not extra:
        return h.hexdigest()
    h = hashlib.sha256(h.hexdigest().encode())
    h.update(json.dumps(extra, sort_keys=True).encode())
    return h.hexdigest()


class Member(NamedTuple):
    """A further array of a layout: its shape and dtype (a plain shape tuple means float64)."""

    shape: Tuple[int, ...]
    dtype: type


class Layout(NamedTuple):
    """A kind of saved state: the Moments layout (its fields and scalars) plus
    ``extra`` metadata keys (covered by the checksum), ``optional`` ones (the
    same, where present) and ``members``, further arrays whose shapes (a
    ``Member`` where the dtype is not float64) follow from the metadata and
    widths."""

    format: str
    version: int
    noun: str
    writer: str
    extra: Tuple[str, ...] = ()
    members: Callable[[dict, Dict[str, int]], Dict[str, Any]] = lambda meta, widths: {}
    optional: Tuple[str, ...] = ()


GROUPS = "groups"


def _group_member(i: int, name: str) -> str:
    return f"group{i}.{name}"


def _group_members(meta: dict, widths: Dict[str, int]) -> Dict[str, Any]:
    """The members of a file's groups (``meta["groups"]``; none without it),
    from each group's widths."""
    if GROUPS not in meta:
        return {}
    entry = meta[GROUPS]
    if not isinstance(entry, dict) or sorted(entry) != ["next", "rng", "seed", "states"]:
        raise ValueError("its groups entry is not a dict of next, rng, seed and states")
    states = entry["states"]
    if not isinstance(states, list) or not 2 <= len(states) <= MAX_GROUPS:
        raise ValueError(f"its groups entry holds {len(states) if isinstance(states, list) else 'no list of'} "
                         f"states, not 2 to {MAX_GROUPS}")
    out = {}
    for i, st in enumerate(states):
        if not isinstance(st, dict) or sorted(st) != sorted(SCALARS):
            raise ValueError(f"group {i}'s entry does not hold the scalars {', '.join(SCALARS)}")
        w = widths_of(st)
        for f in FIELDS:
            out[_group_member(i, f.name)] = Member(shape_of(f, w), f.dtype)
    return out


def _nest_groups(state: dict) -> dict:
    """A read file's flat entries as a state dict: the groups' members and
    scalars gathered into the ``groups`` entry (``_state.GROUPS``)."""
    if GROUPS not in state:
        return state
    entry = state[GROUPS]
    states = []
    for i, scalars in enumerate(entry["states"]):
        st = dict(scalars)
        for f in FIELDS:
            st[f.name] = state.pop(_group_member(i, f.name))
        states.append(st)
    state[GROUPS] = {"states": states, "next": entry["next"], "seed": entry["seed"], "rng": entry["rng"]}
    return state


def moments_layout() -> Layout:
    """The layout of ``Moments.save`` files at this module's current version."""
    return Layout(FORMAT, VERSION, "richness state", "Moments.save", members=_group_members, optional=(GROUPS,))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Temp files are named ``.richness-HOST-PID-RANDOM.tmp``: short, so that any
# legal target name still leaves a legal temp name. HOST is a digest of this
# machine's name, boot and process-id namespace, PID the writer's process id: a
# process id means something only where HOST matches, since a folder may be
# shared by other machines or containers whose processes this one cannot see.
_TEMP_PREFIX = ".richness-"
_TEMP_SUFFIX = ".tmp"
# A temp file nothing has written to for this long is a dead writer's, wherever it ran.
STALE_TEMP_AGE = 24 * 3600.0  # seconds


def _host_tag() -> str:
    """12 hex digits naming this machine, its boot and this process's pid namespace."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        pass
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def _is_stale_temp(folder: str, name: str, host: str, now: float) -> bool:
    """Whether the temp file ``name`` is provably not a save in progress: its
    writer ran here and is gone, or it is older than ``STALE_TEMP_AGE``."""
    try:
        st = os.lstat(os.path.join(folder, name))
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode):
        return False
    if now - st.st_mtime > STALE_TEMP_AGE:
        return True
    tag, _, rest = name[len(_TEMP_PREFIX):-len(_TEMP_SUFFIX)].partition("-")
    pid = rest.split("-", 1)[0]
    if tag != host or not pid.isdigit() or int(pid) == os.getpid():
        return False  # another machine's or container's (or this process's own save in another thread)
    try:
        os.kill(int(pid), 0)
        return False  # that process is alive: its save may still be under way
    except ProcessLookupError:
        return True
    except OSError:  # alive, someone else's
        return False


def _remove_stale_temps(folder: str, host: str) -> None:
    """Remove the temp files in ``folder`` left by saves that were killed
    between writing and renaming (``_is_stale_temp``); never another writer's
    save in progress."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    now = time.time()
    for name in names:
        if name.startswith(_TEMP_PREFIX) and name.endswith(_TEMP_SUFFIX) and _is_stale_temp(folder, name, host, now):
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass


def file_path(path, what: str = "path") -> str:
    """``path`` (str, bytes or os.PathLike) as a str; TypeError for other
    types (an int would name a file descriptor), ValueError when empty."""
    if isinstance(path, bool) or not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"{what} must be a str, bytes or os.PathLike, got {type(path).__name__}")
    out = os.fsdecode(path)
    if not out:
        raise ValueError(f"{what} is empty")
    if "\0" in out:
        raise ValueError(f"{what} contains a NUL character: {out!r}")
    return out


def save_state(state: dict, path: "os.PathLike | str") -> None:
    """Write ``state`` to ``path`` atomically: a temp file in the same folder,
    fsync, then rename over the target. A crash leaves the old file intact
    (and a temp file that a later save into the same folder removes once it is
    provably stale). A file saved over keeps its permission bits; a new file
    gets the ones ``open`` would give it under the umask."""
    arrays = {k: np.asarray(state[k]) for k in FLOATS + INTS}
    extra = {}
    if GROUPS in state:  # a Moments(groups=k): each group's arrays, its scalars and the assignment in meta
        entry = state[GROUPS]
        for i, st in enumerate(entry["states"]):
            arrays.update({_group_member(i, k): np.asarray(st[k]) for k in FLOATS + INTS})
        extra[GROUPS] = {"next": entry["next"], "seed": entry["seed"], "rng": entry["rng"],
                         "states": [{k: st[k] for k in SCALARS} for st in entry["states"]]}
    meta = {"format": FORMAT, "version": VERSION, **{k: state[k] for k in SCALARS}, **extra,
            "sha256": _digest(arrays, state, extra)}
    write_archive(path, meta, arrays)


def write_archive(path: "os.PathLike | str", meta: dict, arrays: dict) -> None:
    """The atomic write of ``save_state``: ``meta`` (JSON) and ``arrays`` as one
    .npz at ``path`` (used by every kind of saved state)."""
    path = file_path(path)
    if path.endswith(os.sep) or os.path.basename(path) in (".", ".."):
        raise ValueError(f"{path}: names a folder; give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode) & 0o777
    except OSError:  # a new file
        mode = 0o666 & ~_umask()
    host = _host_tag()
    _remove_stale_temps(folder, host)
    fd, tmp = tempfile.mkstemp(prefix=f"{_TEMP_PREFIX}{host}-{os.getpid()}-", suffix=_TEMP_SUFFIX, dir=folder)
    try:
        os.fchmod(fd, mode)  # mkstemp makes it 0600
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


def state_bytes(widths: Dict[str, int]) -> int:
    """Bytes of a state's arrays at these widths (Python ints: no overflow)."""
    total = 0
    for f in FIELDS:
        count = 1
        for s in shape_of(f, widths):
            count *= s
        total += count * np.dtype(f.dtype).itemsize
    return total


def load_state(path: "os.PathLike | str", layout: Optional[Layout] = None) -> dict:
    """Read and validate a file written by ``save_state`` (or, with another
    ``layout``, by ``write_archive`` for that kind of state; its extra keys and
    members are returned beside the state's). Every array's shape is checked
    against the widths the file declares, and the whole state against this
    process's memory, before any data is read, so a foreign or hostile archive
    cannot make it allocate."""
    path = file_path(path)
    layout = moments_layout() if layout is None else layout
    noun = layout.noun

    def bad(why: str) -> ValueError:
        return ValueError(f"{path}: {why}")

    # A damaged zip header can also read as an unsupported compression method or
    # zip version (NotImplementedError) or as an encrypted member (RuntimeError).
    damaged = (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError, zipfile.LargeZipFile,
               NotImplementedError, RuntimeError)
    try:
        f = open_regular(path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no such file", path) from None
    except OSError as e:
        raise bad(f"cannot read ({e.strerror or type(e).__name__})") from None
    with f:
        if f.read(6) == b"\x93NUMPY":
            raise bad(f"a single .npy array, not a {noun} (an .npz archive written by {layout.writer})")
        f.seek(0)
        try:
            zf = zipfile.ZipFile(f)
        except damaged as e:
            raise bad(f"not a {noun}, or truncated or corrupted ({e})") from None
        with zf:
            return _read_state(zf, path, bad, damaged, layout)


def _read_state(zf: zipfile.ZipFile, path: str, bad, damaged, layout: Layout) -> dict:
    noun = layout.noun
    try:
        members = npz_members(zf, path)
    except damaged as e:
        msg = str(e)
        raise bad(f"not a {noun}, or truncated or corrupted "
                  f"({msg[len(path) + 2:] if msg.startswith(path) else msg})") from None
    if "meta" not in members:
        raise bad(f"not a {noun} (no meta entry)")
    meta_head = members["meta"].header
    if meta_head.dtype != np.uint8 or len(meta_head.shape) != 1 or meta_head.shape[0] > _META_MAX:
        raise bad(f"not a {noun} (meta entry of shape {meta_head.shape}, dtype {meta_head.dtype})")
    try:
        meta_raw = read_member(zf, members["meta"])
    except damaged as e:
        raise bad(f"not a {noun}, or truncated or corrupted ({e})") from None
    try:
        meta = json.loads(meta_raw.tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise bad("corrupted metadata") from None
    if not isinstance(meta, dict) or meta.get("format") != layout.format:
        raise bad(f"not a {noun} (format {meta.get('format') if isinstance(meta, dict) else None!r})")
    version = meta.get("version")
    known = version if is_int(version) else None
    if known is None or not 1 <= known <= layout.version:
        newer = " (written by a newer richness: update richness to read it)" \
            if known is not None and known > layout.version else ""
        raise bad(f"unsupported state version {version!r}{newer}; this richness reads versions 1 to {layout.version}")
    missing = [k for k in SCALARS + ("sha256",) + layout.extra if k not in meta] + [
        f.name for f in FIELDS if f.name not in members]
    if missing:
        raise bad(f"missing entries: {', '.join(missing)}")
    try:
        widths = widths_of(meta)
        more = layout.members(meta, widths)
    except (TypeError, ValueError) as e:
        raise bad(f"not a valid {noun} ({e})") from None
    more = {k: v if isinstance(v, Member) else Member(tuple(v), np.float64) for k, v in more.items()}
    missing = sorted(set(more) - set(members))
    if missing:
        raise bad(f"missing entries: {', '.join(missing)}")
    extra = sorted(set(members) - set(FLOATS + INTS) - set(more) - {"meta"})
    if extra:
        raise bad(f"unexpected entries: {', '.join(extra)}")
    for f in FIELDS:
        head = members[f.name].header
        want = shape_of(f, widths)
        if head.shape != want:
            raise bad(f"not a valid {noun} (entry {f.name} has shape {head.shape}, but the file's widths "
                      f"give {want})")
        if head.dtype != np.dtype(f.dtype):
            raise bad(f"entry {f.name} has dtype {head.dtype}, expected {np.dtype(f.dtype)}")
    for name, (want, dtype) in more.items():
        head = members[name].header
        if head.shape != want or head.dtype != np.dtype(dtype):
            raise bad(f"not a valid {noun} (entry {name} has shape {head.shape} and dtype {head.dtype}, the file's "
                      f"widths give {want} {np.dtype(dtype)})")
    further = sum(int(np.prod(m.shape, dtype=object)) * np.dtype(m.dtype).itemsize for m in more.values())
    check_memory(state_bytes(widths) + further, f"{path}: the state at p={widths['p']}")
    try:
        data = {k: read_member(zf, m) for k, m in members.items() if k != "meta"}  # in the order written
    except damaged as e:
        raise bad(f"not a {noun}, or truncated or corrupted ({e})") from None
    kept = {k: meta[k] for k in layout.extra + layout.optional if k in meta}
    if _digest(data, meta, kept) != meta["sha256"]:
        raise bad("checksum mismatch: the file is corrupted")
    state = {k: meta[k] for k in SCALARS}
    state.update(data)
    state.update(kept)
    return _nest_groups(state) if layout.format == FORMAT else state
