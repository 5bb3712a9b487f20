"""``.pt``/``.pth``: a tensor or a dict of tensors saved by ``torch.save``, opened
with ``weights_only=True`` (no pickled code runs) only to find the tensor's
offset in the file; the data is read by offset in row chunks."""

from __future__ import annotations

import os
import sys
import zipfile

import numpy as np

from ..._engine import bounded_io as _bounded_io
from .. import UserError
from ..raw import mapped_file_offset
from .base import ArrayFile

__all__ = ["TorchFile"]


class TorchFile(ArrayFile):
    """A ``.pt`` file: ``torch.load(weights_only=True, mmap=True)`` finds the tensor
    and its place in the file; the mapping is dropped before any data is read,
    which is then read by offset in the byte order the file records. A tensor
    whose mapping cannot be located, and a legacy (non-zip) file, are read
    whole after a memory check."""

    def _open(self, path: str) -> None:
        torch = self.require("torch")
        import pickle

        mapped = True
        try:
            try:  # mmap: nothing of the data is read here
                obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                mapped = False
                _bounded_io.check_memory(os.path.getsize(path), f"{path} (a legacy-format .pt file, read whole)")
                obj = torch.load(path, map_location="cpu", weights_only=True)  # the legacy (non-zip) format
        except pickle.UnpicklingError as e:
            raise UserError(f"{path}: not a file of tensors (torch.load with weights_only=True refused it: "
                            f"{str(e).splitlines()[0]})") from None
        if isinstance(obj, torch.Tensor):
            if self.key is not None:
                raise UserError(f"{self.label}: the file holds one tensor; drop ':{self.key}'")
            t = obj
        elif isinstance(obj, dict):
            tensors = {str(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}
            t = tensors[self._pick(list(tensors), "tensor")]
        else:
            raise UserError(f"{path}: holds a {type(obj).__name__}; expected a tensor or a dict of tensors")
        del obj
        t = t.detach()
        from ..._engine.adapt import refuse_unreadable

        try:
            refuse_unreadable(t, "it")
        except TypeError as e:
            raise UserError(f"{self.label}: {e}") from None
        self.bf16 = t.dtype == torch.bfloat16  # numpy has no bfloat16: keep the bits, widened per chunk
        try:
            dtype = np.dtype(np.uint16) if self.bf16 else torch.empty(0, dtype=t.dtype).numpy().dtype
        except TypeError as e:
            raise UserError(f"{self.label}: unsupported dtype ({e})") from None
        shape = tuple(int(s) for s in t.shape)
        start = mapped_file_offset(t.untyped_storage().data_ptr(), path) if mapped and t.numel() else None
        if start is not None:  # read from the file by offset; the mapping goes with t
            if _torch_byteorder(path) != sys.byteorder:  # torch swapped its copy; the file's bytes are read
                dtype = dtype.newbyteorder()
            strides = tuple(int(s) * dtype.itemsize for s in t.stride())
            offset = start + t.storage_offset() * dtype.itemsize
            del t
            with _bounded_io.open_regular(path) as f:
                self._raw(f, offset, shape, strides, dtype)
            return
        if mapped and t.numel():  # where the mapping cannot be located: the tensor read whole, now
            _bounded_io.check_memory(t.untyped_storage().nbytes(), f"{self.label} (read whole)")
            t = t.clone()
        self.array = (t.view(torch.int16) if self.bf16 else t).numpy().view(dtype)
        self.shape, self.dtype = shape, dtype


def _torch_byteorder(path: str) -> str:
    """The byte order a zip-format .pt file records for its tensors (native where it records none)."""
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            if name.count("/") == 1 and name.endswith("/byteorder"):
                order = z.read(name).decode(errors="replace")
                return order if order in ("little", "big") else sys.byteorder
    return sys.byteorder
