"""Raw array data at a known offset of a file, read by ordinary reads, never memory-mapped.

A memory-mapped file that another process truncates kills the reading process with SIGBUS
as soon as a page past the new end is touched, and Python cannot catch that signal safely.
So every raw array ``richness eval`` streams (``.npy``, stored ``.npz`` members,
``.safetensors`` tensors, ``.pt`` tensors) is read through :class:`RawRows`: each chunk of
rows is read into a fresh buffer, and a file shorter than its header promised, before or
during a read, is a one-line :class:`~richness.cli.UserError` naming the file.
"""

from __future__ import annotations

import json
import mmap
import os
from typing import BinaryIO, Optional, Tuple

import numpy as np

from . import UserError

__all__ = []

_PAGE = mmap.PAGESIZE
_SAFETENSORS_HEADER_MAX = 100_000_000  # bytes; the safetensors format's own limit


class RawRows:
    """Rows ``a..b-1`` of a 1-D or 2-D array whose element ``[i, j]`` lies at byte
    ``offset + i * strides[0] + j * strides[1]`` of the open file ``f`` (its
    descriptor is duplicated, so ``f`` may be closed). Row-major data is read one
    span per chunk; column-major data one span per column. A chunk read with
    ``reuse=True`` lies in a buffer the next such read overwrites: a pass that
    consumes each chunk before asking for the next one then allocates (and the
    system faults in) one chunk's memory, not one per chunk."""

    def __init__(self, f: BinaryIO, label: str, offset: int, shape: Tuple[int, ...],
                 strides: Tuple[int, ...], dtype: np.dtype) -> None:
        self.label, self.offset, self.dtype = label, offset, np.dtype(dtype)
        self.shape, self.strides = tuple(shape), tuple(strides)
        item = self.dtype.itemsize
        self.end = offset + (item + sum((s - 1) * st for s, st in zip(self.shape, self.strides))
                             if all(self.shape) else 0)
        self.raw = os.fdopen(os.dup(f.fileno()), "rb", buffering=0)
        self.row_major = len(self.shape) == 1 or self.strides[1] <= self.strides[0] or self.shape[1] == 1
        self._released = 0
        self._scratch: Optional[np.ndarray] = None
        try:
            self._check_size(0, self.shape[0])
        except BaseException:
            self.raw.close()  # refused: the duplicated descriptor goes with it
            raise

    def _check_size(self, a: int, b: int) -> None:
        size = os.fstat(self.raw.fileno()).st_size
        if size < self.end:
            self._truncated(a, b, size)

    def _truncated(self, a: int, b: int, size: Optional[int] = None):
        if size is None:
            size = os.fstat(self.raw.fileno()).st_size
        raise UserError(f"{self.label}: the file is shorter than its header promises (truncated, or being "
                        f"rewritten by another process?): it has {size} bytes, the array ends at byte {self.end} "
                        f"(rows {a}..{b - 1} not read)")

    def _read(self, pos: int, length: int, a: int, b: int, into: Optional[np.ndarray] = None) -> np.ndarray:
        """``length`` bytes from ``pos`` (into ``into``'s memory when given)."""
        buf = np.empty(length, np.uint8) if into is None else into
        view = memoryview(buf.view(np.uint8))  # type: ignore[arg-type]  # numpy's stubs give arrays the buffer protocol from Python 3.12
        got = 0
        while got < length:
            self.raw.seek(pos + got)
            k = self.raw.readinto(view[got:])
            if not k:
                self._truncated(a, b)
            got += k
        return buf

    def _buffer(self, length: int, reuse: bool) -> Optional[np.ndarray]:
        """The reused buffer's first ``length`` bytes (grown when short), or None: a new one."""
        if not reuse:
            return None
        if self._scratch is None or self._scratch.size < length:
            self._scratch = None  # the old buffer goes before the new one is allocated
            self._scratch = np.empty(length, np.uint8)
        return self._scratch[:length]

    def __call__(self, a: int, b: int, reuse: bool = False) -> np.ndarray:
        self._check_size(a, b)
        n, item = b - a, self.dtype.itemsize
        if n <= 0 or not all(self.shape):
            return np.empty((max(n, 0),) + self.shape[1:], self.dtype)
        s0 = self.strides[0]
        if len(self.shape) == 1:
            buf = self._read(self.offset + a * s0, (n - 1) * s0 + item, a, b)
            x = np.ndarray((n,), self.dtype, buffer=buf, strides=(s0,))
            return x if s0 == item else np.ascontiguousarray(x)
        p, s1 = self.shape[1], self.strides[1]
        if self.row_major:
            length = (n - 1) * s0 + (p - 1) * s1 + item
            buf = self._read(self.offset + a * s0, length, a, b, into=self._buffer(length, reuse))
            self._prefetch(self.offset + b * s0, n * s0)  # the next chunk, read ahead while this one is used
            x = np.ndarray((n, p), self.dtype, buffer=buf, strides=(s0, s1))
            return x if (s0, s1) == (p * item, item) else np.ascontiguousarray(x)
        out = np.empty((p, n), self.dtype)  # one column at a time, returned transposed
        for j in range(p):
            pos = self.offset + j * s1 + a * s0
            if s0 == item:
                self._read(pos, n * item, a, b, into=out[j])
            else:
                buf = self._read(pos, (n - 1) * s0 + item, a, b)
                out[j] = np.ndarray((n,), self.dtype, buffer=buf, strides=(s0,))
        return out.T

    def close(self) -> None:
        """Close the duplicated descriptor (chunks already read are their own buffers)."""
        self.raw.close()

    def _prefetch(self, pos: int, length: int) -> None:
        """Start reading ``length`` bytes from ``pos`` into the page cache in the background
        (posix_fadvise WILLNEED), where the system can."""
        if hasattr(os, "posix_fadvise") and pos < self.end:
            try:
                os.posix_fadvise(self.raw.fileno(), pos, min(length, self.end - pos), os.POSIX_FADV_WILLNEED)
            except OSError:
                pass

    def release(self, b: int) -> None:
        """Tell the kernel the rows before ``b`` of row-major data will not be read again
        (posix_fadvise DONTNEED): a single pass over a large file then does not crowd
        the page cache."""
        if not self.row_major or not hasattr(os, "posix_fadvise"):
            return
        end = (self.offset + b * self.strides[0]) // _PAGE * _PAGE
        if end <= self._released:
            return
        try:
            os.posix_fadvise(self.raw.fileno(), self._released, end - self._released, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        self._released = end


def c_strides(shape: Tuple[int, ...], itemsize: int, fortran: bool = False) -> Tuple[int, ...]:
    """Byte strides of a contiguous array of ``shape`` (column-major when ``fortran``)."""
    out, step = [], itemsize
    for s in (shape if fortran else reversed(shape)):
        out.append(step)
        step *= max(int(s), 1)
    return tuple(out) if fortran else tuple(reversed(out))


def safetensors_offset(f: BinaryIO, key: str, label: str) -> int:
    """File offset of tensor ``key``'s data in a .safetensors file (already validated by
    the safetensors library): an 8-byte header length, the JSON header, then the data."""
    f.seek(0)
    n = int.from_bytes(f.read(8), "little")
    if n > _SAFETENSORS_HEADER_MAX:
        raise UserError(f"{label}: a safetensors header of {n} bytes, past the format's limit")
    try:
        begin = int(json.loads(f.read(n))[key]["data_offsets"][0])
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as e:
        raise UserError(f"{label}: not a valid safetensors header ({e})") from None
    return 8 + n + begin


def mapped_file_offset(ptr: int, path: str) -> Optional[int]:
    """The offset in the file ``path`` of address ``ptr``, when ``ptr`` lies in a mapping
    of that file (/proc/self/maps: device and inode, or the path); None where it
    cannot tell (no /proc, another file, anonymous memory)."""
    try:
        st = os.stat(path)
        real = os.path.realpath(path)
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) < 5:
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if not lo <= ptr < hi:
                    continue
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                same = (int(parts[4]) == st.st_ino and (major, minor) == (os.major(st.st_dev), os.minor(st.st_dev)))
                named = len(parts) == 6 and parts[5].strip() == real
                return int(parts[2], 16) + ptr - lo if same or named else None
    except (OSError, ValueError):
        pass
    return None
