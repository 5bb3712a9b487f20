"""``.npz``: named arrays in a zip; stored members read by offset, compressed ones
decompressed forward, chunk by chunk."""

from __future__ import annotations

import os
import zipfile
from typing import IO, Optional

import numpy as np

from ..._engine import bounded_io as _bounded_io
from .base import ArrayFile
from .npy import npy_data

__all__ = ["NpzFile"]


class NpzFile(ArrayFile):
    """A ``.npz`` file: one member (``FILE:KEY``, the default key, or the only one)
    after the archive's directory and every member's header are checked. A stored
    member is read by offset like a ``.npy`` file; a compressed one is decompressed
    forward, chunk by chunk (a compressed column-major array is read whole)."""

    def _open(self, path: str) -> None:
        f = _bounded_io.open_regular(path)
        kept = False
        try:
            zf = zipfile.ZipFile(f)
            members = _bounded_io.npz_members(zf, path)
            member = members[self._pick(list(members), "array")]
            if member.info.compress_type == zipfile.ZIP_STORED:
                size = os.fstat(f.fileno()).st_size
                npy_data(self, f, _bounded_io.stored_data_offset(f, member, size, self.label), member.header)
                return
            header = member.header
            self.shape, self.dtype = header.shape, header.dtype
            if header.fortran and len(header.shape) == 2 and header.shape[1] > 1:
                # column-major data cannot be read by rows: read it whole
                _bounded_io.check_memory(header.nbytes, f"{self.label} (a compressed column-major array)")
                self.array = _bounded_io.read_member(zf, member)
                return
            self._reader = _NpzRows(zf, member)
            self._keep, kept = f, True
        finally:
            if not kept:
                f.close()


class _NpzRows:
    """Rows a..b-1 of a compressed .npz member, decompressed forward (a chunk
    before the cursor restarts). The member's size was checked against its
    header, so a read never goes past it: a short member raises EOFError."""

    def __init__(self, zf: zipfile.ZipFile, member: "_bounded_io.NpzMember") -> None:
        self.zf, self.member = zf, member
        h = member.header
        self.row_shape = h.shape[1:]
        width = 1
        for s in self.row_shape:
            width *= s
        self.row_bytes = width * h.dtype.itemsize
        self.f: Optional[IO[bytes]] = None
        self._restart()

    def _restart(self) -> None:
        if self.f is not None:
            self.f.close()
        self.f = self.zf.open(self.member.info)
        self._read(self.member.header.header_bytes)
        self.pos = 0

    def _read(self, n: int) -> bytes:
        assert self.f is not None  # opened by _restart
        parts, left = [], n
        while left:
            piece = self.f.read(min(left, 1 << 24))
            if not piece:
                raise EOFError(f"the member ends {left} bytes early")
            parts.append(piece)
            left -= len(piece)
        return b"".join(parts)

    def __call__(self, a: int, b: int) -> np.ndarray:
        if a < self.pos:
            self._restart()
        while self.pos < a:  # skip forward without holding the skipped rows
            step = max(1, min(a - self.pos, (1 << 24) // max(self.row_bytes, 1)))
            self._read(step * self.row_bytes)
            self.pos += step
        data = self._read((b - a) * self.row_bytes)
        self.pos = b
        h = self.member.header
        return np.frombuffer(data, dtype=h.dtype).reshape((b - a,) + self.row_shape)
