"""The metric's tensor plumbing: its state tensors to and from the state
schema's dict, a batch's state added into them in place, the zero-padded
all-gather of ranks' differently shaped states, the head's capture hook and
deep-copy helpers."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

from .. import _state
from ..finish._xp import ns

_FIELDS = tuple(f.name for f in _state.FIELDS)
_STATES = _FIELDS + ("widths",)
_TORCH_DTYPE: Dict[type, Any] = {np.float64: torch.float64, np.int64: torch.int64}
_STATE_DTYPES: Dict[str, Any] = dict({f.name: _TORCH_DTYPE[f.dtype] for f in _state.FIELDS}, widths=torch.int64)


def _widths_of(widths: Any) -> Dict[str, Any]:
    """The integer widths and the precision name from a ``widths`` tensor
    (the metric's ``_widths_tensor`` writes it)."""
    vals = torch.as_tensor(widths).tolist()
    return dict(zip(_state.WIDTHS, vals[:len(_state.WIDTHS)]), precision=_state.PRECISIONS[vals[-1]])


def _from_tensors(tensors: Dict[str, Any], prefix: str = "") -> dict:
    """A numpy state dict from DLR state tensors under ``prefix``: ``widths``
    and the fields present (``_state.checked`` fills or refuses the others)."""
    st = _widths_of(tensors[prefix + "widths"])
    for f in _state.FIELDS:
        if prefix + f.name in tensors:
            st[f.name] = torch.as_tensor(tensors[prefix + f.name]).detach().cpu().numpy()
    return st


def _added(tensors: Dict[str, Any], n_a: int, batch: dict) -> Dict[str, Any]:
    """Add the state dict ``batch`` (float64; numpy arrays for CPU tensors,
    tensors on their device otherwise; n > 0) into the state ``tensors`` (the
    metric's, holding ``n_a`` > 0 samples, checked compatible with the
    batch): the pairwise merge of docs/MATH.md, "Merging states",
    ``mean += (n_b / n) d`` and ``X += X_b + (n_a n_b / n) d_u d_v^T`` with
    ``d = mean_b - mean_a`` per mean. The means and co-moments are written in
    place (the batch's co-moments take the shift in their own arrays: a fresh
    export, owned here); the class arrays, which grow with the class count,
    come back as new tensors for the caller to set (``widths`` is the
    caller's too).

    CPU tensors are written through numpy views: numpy's loops run on the
    calling thread, where torch's would wake its thread pool beside the
    core's on every batch and slow the next product several-fold
    (benchmarks/RESULTS.md, torchmetrics metric).

    Raises ValueError, before anything is written, when the merge would
    overflow float64: the co-moments are Grams (positive semi-definite, each
    cross-moment bounded by their diagonals), so finite merged means, class
    sums and diagonals of the symmetric ones make every merged tensor finite."""
    on_cpu = tensors["mean"].device.type == "cpu"
    a = {f.name: tensors[f.name].numpy() if on_cpu else tensors[f.name] for f in _state.FIELDS}
    b = {f.name: batch[f.name] for f in _state.FIELDS}
    xp = ns(a["mean"])
    n_b = int(batch["n"])
    n = n_a + n_b
    d = {f.name: b[f.name] - a[f.name] for f in _state.FIELDS if f.is_mean}
    means = {name: a[name] + d[name] * (n_b / n) for name in d}
    grown: Dict[str, Any] = {}
    shift: Dict[str, Any] = {}
    for f in _state.FIELDS:
        if f.shift is not None:
            u, v = (d[s].reshape(-1) for s in f.shift)
            if u.shape[0] and v.shape[0]:
                shift[f.name] = (u * (n_a * n_b / n), v)
        elif not f.is_mean:  # class counts and sums: padded to the larger class count, summed
            x, y = a[f.name], b[f.name]
            shape = tuple(max(i, j) for i, j in zip(x.shape, y.shape))
            out = np.zeros(shape, x.dtype) if on_cpu else x.new_zeros(shape)
            out[tuple(slice(0, s) for s in x.shape)] += x
            out[tuple(slice(0, s) for s in y.shape)] += y
            grown[f.name] = out
    checks = [*means.values(), grown["class_sums"]]
    checks += [xp.diagonal(a[f.name]) + xp.diagonal(b[f.name]) + (shift[f.name][0] * shift[f.name][1]
               if f.name in shift else 0.0) for f in _state.FIELDS if f.symmetric]
    if not all(bool(xp.isfinite(c).all()) for c in checks):
        raise ValueError("cannot merge: the merged co-moments overflow float64; rescale the features or outputs")
    for f in _state.FIELDS:
        if f.is_mean:
            a[f.name][...] = means[f.name]
        elif f.name in shift:  # a += b, then b = the shift, a += b: no temporary of the matrix's size
            a[f.name] += b[f.name]
            if on_cpu:
                np.multiply.outer(*shift[f.name], out=b[f.name])
            else:
                torch.outer(*shift[f.name], out=b[f.name])
            a[f.name] += b[f.name]
        elif f.shift is not None:
            a[f.name] += b[f.name]
    return {name: torch.from_numpy(t) if on_cpu else t for name, t in grown.items()}


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


class Capture:
    """Forward hook on the head: keeps its latest input (the features) for the
    next ``update`` without ``features=``. Holds the metric weakly (the head
    must not keep it alive); registered as a ``ModelHook``, so a deep-copied or
    saved model's copy of it captures nothing."""

    def __init__(self, metric: "Any") -> None:
        self.ref = weakref.ref(metric)

    def __call__(self, module: Any, args: tuple, out: Any) -> None:
        metric = self.ref()
        # only the metric's own head: a deep copy may have moved it to the copied head
        if metric is not None and metric.head is module and args and isinstance(args[0], torch.Tensor):
            metric.__dict__["_captured"] = args[0].detach()

    def copied(self, memo: dict) -> "Optional[Capture]":
        """The hook of the head's deep copy: when the same deep copy copied the
        metric before reaching its head (the model's modules list the metric
        first), the metric's copy is moved to the copied head and hooked there;
        else None (a copied model's forwards never reach a metric that was not
        copied with it)."""
        metric = self.ref()
        if metric is None:
            return None
        twin = memo.get(id(metric))
        head_copy = memo.get(id(metric.head))
        if twin is None or head_copy is None or twin.head is not metric.head:
            return None
        object.__setattr__(twin, "head", head_copy)
        return Capture(twin)


def _kept(obj: Any, memo: dict) -> Any:
    """``obj`` in a deep copy that keeps it by reference, unless the same deep
    copy has already copied it (then its copy): see ``DLR.__deepcopy__``."""
    if isinstance(obj, (tuple, list)):
        return type(obj)(_kept(o, memo) for o in obj)
    return memo.get(id(obj), obj)
