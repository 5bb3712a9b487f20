"""Bounded reading of files of unknown origin: regular files only (a device,
pipe or socket could be endless or block for ever), sizes taken from the
file's own directory and headers and checked against each other before any
data is read, and allocations checked against the memory this process can
have. Every reader of a file goes through these: ``Moments.load`` and the
other saved states (``_statefile``), the command line's array files
(``cli/formats/``), the Monitor logs that ``plot`` reads.
"""

from __future__ import annotations

import os
import stat
import zipfile
from typing import IO, BinaryIO, Dict, NamedTuple, Tuple

import numpy as np

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a pipe"), (stat.S_ISSOCK, "a socket"))
# Deflate cannot expand more than 1032:1; a member that claims more is forged.
_DEFLATE_RATIO = 1032


def _not_regular(path: str, mode: int) -> ValueError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a plain file")
    return ValueError(f"{path}: not a regular file ({kind}); give a file on disk")


def stat_regular(path: str) -> os.stat_result:
    """``os.stat`` of ``path``, which must be a regular file (symlinks to one
    are fine): a device, pipe or socket could be endless or block for ever."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, st.st_mode)
    return st


def check_regular(path: str) -> int:
    """The size of ``path``, which must be a regular file (``stat_regular``)."""
    return stat_regular(path).st_size


def open_regular(path: str) -> BinaryIO:
    """Open ``path`` for reading if it is a regular file. Checked again on the
    open descriptor (the path may have changed in between); opened
    non-blocking so that a pipe cannot stall the open itself."""
    check_regular(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def available_memory() -> float:
    """Bytes this process can still allocate now: the memory the system
    reports available (physical memory where it does not say), and under a
    limit on the address space, what is left of it. The compiled core's
    ``available_memory`` (csrc/cpu/cpu_moments.hpp), the model every update
    checks its allocations against."""
    from .._native import _core

    return float(_core.available_memory())


def check_memory(need: float, what: str) -> None:
    """MemoryError naming ``what`` and its size when ``need`` bytes cannot fit."""
    avail = available_memory()
    if need > avail:
        raise MemoryError(f"{what} needs {need:.3g} bytes; this process has {avail:.3g} bytes available")


class NpyHeader(NamedTuple):
    shape: Tuple[int, ...]
    fortran: bool
    dtype: np.dtype
    header_bytes: int  # where the data starts, from the start of the .npy

    @property
    def nbytes(self) -> int:
        count = 1
        for s in self.shape:
            count *= s
        return count * self.dtype.itemsize


def read_npy_header(f: IO[bytes], name: str) -> NpyHeader:
    """The header of the .npy that starts at ``f``'s position (nothing after
    it is read). Refuses object dtypes and negative or non-integer shapes."""
    start = f.tell()
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    else:
        raise ValueError(f"{name}: npy format version {version}; richness reads versions 1.0 and 2.0")
    if dtype.hasobject:
        raise ValueError(f"{name}: object arrays are not supported")
    if not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ValueError(f"{name}: the header gives an impossible shape {shape}")
    return NpyHeader(tuple(shape), bool(fortran), dtype, f.tell() - start)


class NpzMember(NamedTuple):
    info: zipfile.ZipInfo
    header: NpyHeader


def npz_members(zf: zipfile.ZipFile, label: str) -> Dict[str, NpzMember]:
    """``{name: member}`` of an .npz archive, from the archive's directory and
    each member's .npy header alone (no array data is read). A name that
    appears twice is refused (the archive is ambiguous). A member whose
    header claims more data than the directory says it holds, or that claims
    more than its compression can produce, is refused here."""
    out = {}
    for info in zf.infolist():
        name = info.filename
        if not name.endswith(".npy"):
            raise ValueError(f"{label}: unexpected member {name!r} (not a .npy array)")
        if name[:-4] in out:  # zipfile would silently keep the last of them
            raise ValueError(f"{label}: member {name!r} appears more than once; which one is meant is ambiguous")
        if info.compress_type == zipfile.ZIP_DEFLATED:
            if info.file_size > _DEFLATE_RATIO * info.compress_size + 1024:
                raise ValueError(f"{label}: member {name!r} claims {info.file_size} bytes from "
                                 f"{info.compress_size} compressed, more than deflate can produce")
        elif info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"{label}: member {name!r} uses zip compression method {info.compress_type}; "
                             "richness reads stored or deflated members (what numpy.savez writes)")
        elif info.compress_size != info.file_size:
            raise ValueError(f"{label}: member {name!r} is stored but its sizes differ "
                             f"({info.compress_size} vs {info.file_size})")
        with zf.open(info) as f:
            header = read_npy_header(f, f"{label}: member {name!r}")
        held = info.file_size - header.header_bytes
        if header.nbytes > held:
            raise ValueError(f"{label}: member {name!r} claims shape {header.shape} ({header.nbytes} bytes) but "
                             f"holds {max(held, 0)} bytes")
        out[name[:-4]] = NpzMember(info, header)
    return out


def stored_data_offset(f: BinaryIO, member: NpzMember, size: int, label: str) -> int:
    """File offset of an uncompressed member's array data, checked to lie
    inside the member and the file."""
    info = member.info
    f.seek(info.header_offset)
    head = f.read(30)
    if len(head) < 30 or head[:4] != b"PK\x03\x04":
        raise ValueError(f"{label}: corrupted zip entry for {info.filename!r}")
    start = info.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
    if start + info.compress_size > size:
        raise ValueError(f"{label}: member {info.filename!r} runs past the end of the file (truncated)")
    return start + member.header.header_bytes


def read_member(zf: zipfile.ZipFile, member: NpzMember) -> np.ndarray:
    """One whole member, allocated at the size its header declares (checked
    by ``npz_members`` against the archive's directory)."""
    with zf.open(member.info) as f:
        return np.lib.format.read_array(f, allow_pickle=False)
