"""Adapters from numpy arrays, torch tensors and DLPack objects to the core.

The core takes ``(pointer, rows, cols, row_stride, dtype_name)``; this module
is the only place that knows about frameworks. Nothing here copies unless the
layout forces it (columns not unit-strided, or a dtype numpy cannot view).

A batch refused here raises the core's own classes, ``_core.InputError`` (a
ValueError) and ``_core.DTypeError`` (a TypeError), with the same attributes
``stream``, ``row`` and ``limit`` the core sets: a caller reads which input
is at fault, and where, from one kind of error whichever side refused it,
never from the message. The core's classes rather than Python twins: this
module sits above the compiled core in the layers and imports it (through
``_native``, which names the reason where it cannot be loaded) as the
accumulators do, and one class per refusal lets ``except _core.InputError``
catch both sides.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .._checks import is_torch
from .._native import _core

InputError, DTypeError = _core.InputError, _core.DTypeError  # the core's classes of a refused input

# Element types by the names the core knows (csrc/common/types.hpp, RICHNESS_DTYPES).
F32, F64, F16, BF16, I32, I64 = "float32", "float64", "float16", "bfloat16", "int32", "int64"
FLOAT_CODES = {np.dtype(np.float32): F32, np.dtype(np.float64): F64, np.dtype(np.float16): F16}
INT_CODES = {np.dtype(np.int32): I32, np.dtype(np.int64): I64}
STREAMS = ("features", "outputs", "labels", "targets")  # a batch's inputs, as the core names them


def _refused(cls: type, message: str, name: str, row: Any = None, limit: Any = None) -> Exception:
    """A refusal of input ``name`` as the core raises it: ``cls`` (InputError
    or DTypeError) with ``stream`` (``name`` when it is one of a batch's
    inputs, else None), ``row`` and ``limit``."""
    e = cls(message)
    e.stream = name if name in STREAMS else None
    e.row = row
    e.limit = limit
    return e


class Matrix(NamedTuple):
    """A row-major view the core can read, plus the object that owns it."""

    ptr: int
    rows: int
    cols: int
    ld: int
    dtype: str  # F32 ... I64
    owner: Any  # keeps the memory alive while the core reads it
    device: str  # "cpu" or "cuda:N"

    def arg(self) -> tuple:
        return (self.ptr, self.rows, self.cols, self.ld, self.dtype)


def _describe(x: Any) -> str:
    shape = getattr(x, "shape", None)
    return f"{type(x).__name__} of shape {tuple(shape)}" if shape is not None else type(x).__name__


def refuse_unreadable(x: Any, name: str) -> None:
    """TypeError for inputs whose values an array conversion would silently
    change or cannot reach: numpy masked arrays (the mask would be dropped),
    scipy.sparse matrices (they convert to a 0-d object array), sparse torch
    tensors and tensors on the meta device (no data)."""
    if isinstance(x, np.ma.MaskedArray):
        raise _refused(DTypeError, f"{name} is a numpy masked array; its mask would be ignored. Pass the rows to use "
                       "(x[~np.ma.getmaskarray(x).any(axis=1)].data) or x.filled(value)", name)
    module = type(x).__module__
    if module.startswith("scipy.sparse"):
        raise _refused(DTypeError, f"{name} is a scipy.sparse {type(x).__name__}; pass a dense array (x.toarray(), "
                       "a block of rows at a time if it is large)", name)
    if is_torch(x) and hasattr(x, "layout"):
        import torch

        if x.layout != torch.strided:
            raise _refused(DTypeError, f"{name} is a sparse torch tensor ({x.layout}); pass x.to_dense()", name)
        if x.device.type == "meta":
            raise _refused(DTypeError, f"{name} is a tensor on the meta device: it has a shape but no data", name)


def _torch_view(x: Any, name: str, ndim_ok: tuple) -> Matrix:
    import torch

    x = x.detach()
    if x.ndim not in ndim_ok:
        raise _refused(InputError, f"{name} must be {_ndim_words(ndim_ok)}, got a tensor of shape {tuple(x.shape)}",
                       name)
    if x.ndim == 1:
        x = x.reshape(-1, 1)
    if x.is_complex():
        raise _refused(DTypeError, f"{name} must be real, got {x.dtype}", name)
    codes = {torch.float32: F32, torch.float64: F64, torch.float16: F16, torch.bfloat16: BF16,
             torch.int32: I32, torch.int64: I64}
    if x.dtype not in codes:
        raise _refused(DTypeError, f"{name} has dtype {x.dtype}; expected float32, float64, float16, bfloat16"
                       " (features, outputs, targets) or int32/int64 (labels)", name)
    if x.shape[0] > 0 and (x.stride(1) != 1 or x.stride(0) < x.shape[1]):
        x = x.contiguous()
    ld = x.stride(0) if x.shape[0] > 1 else x.shape[1]
    dev = "cpu" if x.device.type == "cpu" else f"{x.device.type}:{x.device.index or 0}"
    return Matrix(x.data_ptr(), x.shape[0], x.shape[1], ld, codes[x.dtype], x, dev)


def _ndim_words(ndim_ok: tuple) -> str:
    return "2-D (n, width)" if ndim_ok == (2,) else "1-D (n,) or 2-D (n, width)"


def as_matrix(x: Any, name: str, *, allow_1d: bool = False) -> Matrix:
    """View ``x`` (numpy, torch, DLPack, or array-like) as a core Matrix."""
    ndim_ok = (1, 2) if allow_1d else (2,)
    refuse_unreadable(x, name)
    if is_torch(x) and hasattr(x, "data_ptr"):
        return _torch_view(x, name, ndim_ok)
    if not isinstance(x, np.ndarray):
        if hasattr(x, "__dlpack__"):
            try:
                x = np.from_dlpack(x)
            except (TypeError, BufferError, RuntimeError) as e:
                raise _refused(DTypeError, f"{name}: could not read {_describe(x)} through DLPack ({e})",
                               name) from None
        else:
            x = np.asarray(x)
    if x.ndim not in ndim_ok:
        raise _refused(InputError, f"{name} must be {_ndim_words(ndim_ok)}, got shape {x.shape}", name)
    if x.ndim == 1:
        x = x.reshape(-1, 1)
    if not x.dtype.isnative:  # before the dtype lookup: '>f8' does not compare equal to float64
        x = x.astype(x.dtype.newbyteorder("="))
    dt = x.dtype
    if dt.name == "bfloat16":  # ml_dtypes
        code = BF16
    elif dt in FLOAT_CODES:
        code = FLOAT_CODES[dt]
    elif dt in INT_CODES:
        code = INT_CODES[dt]
    elif dt.kind in "iu" and name == "labels":
        # other integer widths: widen to int64, which holds every valid label
        if dt.kind == "u" and dt.itemsize >= 8 and x.size and (x > np.iinfo(np.int64).max).any():
            row = int(np.argmax(x.reshape(-1) > np.iinfo(np.int64).max))
            raise _refused(InputError, f"labels out of range: label {int(x.reshape(-1)[row])} at row {row} "
                                       "(larger than any class index)", "labels", row=row, limit="int64")
        x, code = x.astype(np.int64), I64
    elif dt.kind in "iub":
        raise _refused(DTypeError, f"{name} must be float32, float64, float16 or bfloat16, got {dt}", name)
    else:
        raise _refused(DTypeError, f"{name} has dtype {dt}; expected float32, float64, float16, bfloat16"
                       " (features, outputs, targets) or int32/int64 (labels)", name)
    item = x.dtype.itemsize
    if x.shape[0] > 0 and (x.strides[1] != item or x.strides[0] % item or x.strides[0] < x.shape[1] * item):
        x = np.ascontiguousarray(x)
    ld = x.strides[0] // item if x.shape[0] > 1 else x.shape[1]
    return Matrix(x.__array_interface__["data"][0], x.shape[0], x.shape[1], ld, code, x, "cpu")


def as_labels(y: Any) -> Matrix:
    """Labels: a 1-D vector of integers (int32/int64; other integer types widen)."""
    refuse_unreadable(y, "labels")
    if is_torch(y) and hasattr(y, "data_ptr"):
        if y.ndim != 1:
            raise _refused(InputError, f"labels must be 1-D (n,), got a tensor of shape {tuple(y.shape)}", "labels")
        if y.is_floating_point() or y.is_complex() or y.dtype not in _torch_int_dtypes():
            y = _torch_int(y)
        m = _torch_view(y, "labels", (1,))
    else:
        a = y if isinstance(y, np.ndarray) else (np.from_dlpack(y) if hasattr(y, "__dlpack__") else np.asarray(y))
        if a.ndim != 1:
            raise _refused(InputError, f"labels must be 1-D (n,), got shape {a.shape}", "labels")
        if a.dtype.kind not in "iu":
            raise _refused(DTypeError, f"labels must be integers, got dtype {a.dtype}", "labels")
        m = as_matrix(a, "labels", allow_1d=True)
    if m.dtype not in (I32, I64):
        raise _refused(DTypeError, "labels must be integers (int32 or int64)", "labels")
    return m


def _torch_int_dtypes():
    import torch

    return (torch.int32, torch.int64)


def _torch_int(y: Any) -> Any:
    import torch

    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise _refused(DTypeError, f"labels must be integers, got dtype {y.dtype}", "labels")
    if y.dtype == getattr(torch, "uint64", None) and y.numel():
        # int64 wraps 2**63 and above to negative values: name the real label
        big = y.cpu().numpy() > np.iinfo(np.int64).max
        if big.any():
            row = int(np.argmax(big))
            raise _refused(InputError, f"labels out of range: label {int(y[row])} at row {row} "
                                       "(larger than any class index)", "labels", row=row, limit="int64")
    return y.to(torch.int64)


def weights_of(weights: Any) -> tuple:
    """Read-out weights (``head_weights=``) as float64 numpy ``(W, b)``: a
    ``(W, b)`` / ``(W,)`` pair, a bare ``W`` (C x p), or any module with
    ``weight`` and ``bias`` (``torch.nn.Linear``)."""
    if hasattr(weights, "weight"):
        w = weights.weight
        b = getattr(weights, "bias", None)
    elif isinstance(weights, (tuple, list)):
        if not 1 <= len(weights) <= 2:
            raise ValueError(f"head_weights must be (W, b) or (W,), got a sequence of length {len(weights)}")
        w, b = weights[0], (weights[1] if len(weights) == 2 else None)
    else:
        w, b = weights, None
    w = to_numpy64(w, "head weight")
    if w.ndim != 2:
        raise ValueError(f"head weight must be 2-D (C, p), got shape {w.shape}")
    if w.shape[0] == 0 or w.shape[1] == 0:
        raise ValueError(f"head weight has no {'rows (outputs)' if w.shape[0] == 0 else 'columns'}: "
                         f"shape {w.shape}; a head needs shape (C, p) with C, p >= 1")
    if not np.isfinite(w).all():
        raise ValueError("head weight contains NaN or Inf")
    if b is not None:
        b = to_numpy64(b, "head bias").reshape(-1)
        if b.shape[0] != w.shape[0]:
            raise ValueError(f"head bias has {b.shape[0]} entries but the weight has {w.shape[0]} rows")
        if not np.isfinite(b).all():
            raise ValueError("head bias contains NaN or Inf")
    return w, b


def to_numpy64(x: Any, name: str) -> np.ndarray:
    """A float64 numpy copy of any array-like (torch tensors on any device)."""
    refuse_unreadable(x, name)
    if is_torch(x) and hasattr(x, "detach"):
        if x.is_complex():  # .double() would drop the imaginary part
            raise ValueError(f"{name} must be real, got {x.dtype}")
        x = x.detach().to("cpu").double().numpy()
    if np.iscomplexobj(x):  # np.array(..., float64) would drop the imaginary part
        raise ValueError(f"{name} must be real, got {np.asarray(x).dtype}")
    try:
        return np.array(x, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} is not a float array ({e})") from None
