"""``.npy``: one array, its data read by offset in row chunks."""

from __future__ import annotations

import os

from ..._engine import bounded_io as _bounded_io
from .. import UserError
from ..raw import c_strides
from .base import ArrayFile

__all__ = ["NpyFile"]


def npy_data(af: ArrayFile, f, offset: int, header: "_bounded_io.NpyHeader") -> None:
    """Read ``af``'s .npy array, whose data starts at ``offset`` of the open file ``f``
    (a .npy file, or a stored .npz member), by chunks of rows."""
    size = os.fstat(f.fileno()).st_size
    if offset + header.nbytes > size:
        raise UserError(f"{af.label}: truncated file ({size} bytes, the header promises "
                        f"{offset + header.nbytes})")
    af._raw(f, offset, header.shape, c_strides(header.shape, header.dtype.itemsize, header.fortran), header.dtype)


class NpyFile(ArrayFile):
    """A ``.npy`` file: its header read and checked, its data read a chunk of rows
    at a time by ordinary reads at its offset."""

    def _open(self, path: str) -> None:
        if self.key is not None:
            raise UserError(f"{self.label}: a .npy file holds one array; drop ':{self.key}'")
        with _bounded_io.open_regular(path) as f:
            try:
                header = _bounded_io.read_npy_header(f, self.label)
            except ValueError as e:
                msg = str(e)
                raise UserError(msg if "impossible shape" in msg or "object arrays" in msg
                                else f"{self.label}: not a .npy array ({msg})") from None
            npy_data(self, f, header.header_bytes, header)
