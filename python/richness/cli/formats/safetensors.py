"""``.safetensors``: named tensors; the header validated by the safetensors library,
the data read by offset in row chunks."""

from __future__ import annotations

import numpy as np

from ..._engine import bounded_io as _bounded_io
from .. import UserError, reason
from ..raw import c_strides, safetensors_offset
from .base import ArrayFile

__all__ = ["SafetensorsFile"]

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U8": np.uint8, "U16": np.uint16, "U32": np.uint32, "U64": np.uint64}


class SafetensorsFile(ArrayFile):
    """A ``.safetensors`` file: its header validated by the ``safetensors`` library
    (by pread where it can: no mapping), one tensor's data read by offset
    (bfloat16 as its bits, widened per chunk)."""

    def _open(self, path: str) -> None:
        st = self.require("safetensors")
        try:  # the library validates the header (by pread where it can: no mapping); RawRows reads the data
            try:
                handle = st.safe_open(path, framework="numpy", backend="pread")
            except TypeError:  # a safetensors without the pread backend
                handle = st.safe_open(path, framework="numpy")
        except st.SafetensorError as e:
            raise UserError(f"{path}: not a valid safetensors file ({reason(e)})") from None
        key = self._pick(list(handle.keys()), "tensor")
        sl = handle.get_slice(key)
        shape = tuple(int(s) for s in sl.get_shape())
        kind = sl.get_dtype()
        del sl, handle
        dtype: np.dtype
        if kind == "BF16":  # numpy has no bfloat16: the bits are read, widened per chunk
            self.bf16, dtype = True, np.dtype(np.uint16)
        elif kind in _ST_DTYPES:
            dtype = np.dtype(_ST_DTYPES[kind])
        else:
            raise UserError(f"{self.label}: unsupported dtype {kind}")
        with _bounded_io.open_regular(path) as f:
            self._raw(f, safetensors_offset(f, key, self.label), shape, c_strides(shape, dtype.itemsize), dtype)
