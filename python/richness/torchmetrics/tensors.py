"""The metric's tensor plumbing: its state tensors to and from the state
schema's dict, the zero-padded all-gather of ranks' differently shaped
states, and deep-copy helpers."""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import numpy as np
import torch

from .. import _state

__all__ = []

_FIELDS = tuple(f.name for f in _state.FIELDS)
_STATES = _FIELDS + ("widths",)
_TORCH_DTYPE: Dict[type, Any] = {np.float64: torch.float64, np.int64: torch.int64}


def _widths_of(widths: Any) -> Dict[str, Any]:
    """The integer widths and the precision name from a ``widths`` tensor
    (the metric's ``_widths_tensor`` writes it)."""
    vals = torch.as_tensor(widths).tolist()
    return dict(zip(_state.WIDTHS, vals[:len(_state.WIDTHS)]), precision=_state.precisions()[vals[-1]])


def _from_tensors(tensors: Dict[str, Any], prefix: str = "") -> dict:
    """A numpy state dict from DLR state tensors under ``prefix``: ``widths``
    and the fields present (``_state.checked`` fills or refuses the others)."""
    st = _widths_of(tensors[prefix + "widths"])
    for f in _state.FIELDS:
        if prefix + f.name in tensors:
            st[f.name] = torch.as_tensor(tensors[prefix + f.name]).detach().cpu().numpy()
    return st


def _padded(sync_fn: Callable) -> Callable:
    """``sync_fn`` (an all-gather returning one tensor per rank), with every
    rank's tensor zero-padded to the largest shape: torchmetrics stacks the
    gathered tensors, and ranks differ in shape when one saw no data or fewer
    classes. ``widths`` says how much of each rank's arrays is real."""

    def gather(tensor: Any, group: Any = None) -> List[Any]:
        parts = sync_fn(tensor, group=group)
        shape = tuple(max(s) for s in zip(*(t.shape for t in parts))) if tensor.ndim else ()
        out = []
        for t in parts:
            if tuple(t.shape) != shape:
                big = t.new_zeros(shape)
                big[tuple(slice(0, s) for s in t.shape)] = t
                t = big
            out.append(t)
        return out

    return gather


def _host(x: Any) -> np.ndarray:
    """A CPU tensor (or array) as numpy, viewed where numpy has its dtype."""
    if isinstance(x, torch.Tensor):
        return x.numpy() if x.dtype in (torch.float32, torch.float64, torch.float16) else x.double().numpy()
    return np.asarray(x)


def _kept(obj: Any, memo: dict) -> Any:
    """``obj`` in a deep copy that keeps it by reference, unless the same deep
    copy has already copied it (then its copy): see ``DLR.__deepcopy__``."""
    if isinstance(obj, (tuple, list)):
        return type(obj)(_kept(o, memo) for o in obj)
    return memo.get(id(obj), obj)
