"""``richness.torchmetrics.DLR``: DLR as a torchmetrics ``Metric``.

Needs the optional dependency torchmetrics (``pip install torchmetrics``).

Why a list state: torchmetrics reduces each state on its own (sum, cat, ...),
but the Chan merge needs ``n``, the mean and the co-moments of a rank
together. So the whole float64 state of a rank is packed into one
self-describing 1-D float64 tensor (a header of widths, then the arrays), kept
in a ``dist_reduce_fx="cat"`` list state. Under DDP torchmetrics concatenates
the ranks' packed tensors; ``compute`` unpacks every block and merges them
exactly in float64 (SPEC.md). A rank that saw no data contributes nothing.
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

try:
    import torch
    from torchmetrics import Metric
except ImportError as _e:  # pragma: no cover - exercised only without the extra
    raise ImportError('richness.torchmetrics needs torch and torchmetrics: pip install "richness[torch]" torchmetrics '
                      f"({_e})") from None

from . import _adapt
from ._moments import Moments
from ._report import Report

_HEADER = 8  # magic, n, p, c, t, k, num_classes, precision
_MAGIC = 7.0  # guards against foreign tensors in the state list


def pack(state: dict) -> np.ndarray:
    """A state dict as one float64 vector: header then mean, M, out_mean, B, A,
    tgt_mean, Bt, At, class_counts, class_sums (row-major)."""
    head = [_MAGIC, state["n"], state["p"], state["c"], state["t"], state["k"], state["num_classes"],
            _adapt.PRECISIONS.index(state["precision"])]
    parts = [np.asarray(head, dtype=np.float64)]
    for key in ("mean", "M", "out_mean", "B", "A", "tgt_mean", "Bt", "At", "class_counts", "class_sums"):
        parts.append(np.asarray(state[key], dtype=np.float64).reshape(-1))
    return np.concatenate(parts)


def unpack(flat: np.ndarray) -> List[dict]:
    """Every state packed in ``flat`` (concatenated blocks), in order."""
    out, pos = [], 0
    flat = np.asarray(flat, dtype=np.float64)
    while pos < flat.shape[0]:
        h = flat[pos:pos + _HEADER]
        if h.shape[0] < _HEADER or h[0] != _MAGIC:
            raise ValueError("corrupted DLR metric state (bad block header)")
        n, p, c, t, k, nc, prec = (int(v) for v in h[1:])
        pos += _HEADER
        cw, tw, kw = max(c, 0), max(t, 0), max(k, 0)
        pw = max(p, 0)
        st = {"n": n, "p": p, "c": c, "t": t, "k": k, "num_classes": nc, "precision": _adapt.PRECISIONS[prec]}
        for key, shape in (("mean", (pw,)), ("M", (pw, pw)), ("out_mean", (cw,)), ("B", (pw, cw)), ("A", (cw, cw)),
                           ("tgt_mean", (tw,)), ("Bt", (pw, tw)), ("At", (tw, tw)), ("class_counts", (kw,)),
                           ("class_sums", (kw, pw))):
            size = int(np.prod(shape))
            a = flat[pos:pos + size].reshape(shape)
            st[key] = np.rint(a).astype(np.int64) if key == "class_counts" else a.copy()
            pos += size
        out.append(st)
    return out


class DLR(Metric):
    """DLR (0 = rich, 1 = lazy) of the features and outputs seen by ``update``.

    Args:
        num_classes: fix the label range (see ``Moments``); labels are optional.
        head: linear read-out (``nn.Linear``, ``W`` or ``(W, b)``): then only
            features are needed and DLR uses the head's weights at ``compute``
            time (SPEC.md linear-head shortcut).
        precision: precision of the products (``Moments``).
        rtol: eigenvalue cut (default by precision).
        **kwargs: torchmetrics ``Metric`` options.

    ``update(features, outputs=None, labels=None, targets=None)``;
    ``compute()`` returns a float64 scalar tensor and never changes the state;
    ``report()`` gives the full ``richness.Report`` of the (synced) state.
    Under DDP the ranks' states merge exactly in float64.
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    def __init__(self, num_classes: Optional[int] = None, *, head: Any = None, precision: Optional[str] = None,
                 rtol: Optional[float] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        Moments(num_classes, precision=precision)  # validates the arguments
        self.num_classes, self.precision, self.rtol = num_classes, precision, rtol
        # a plain attribute, not a registered submodule: the head belongs to the model
        object.__setattr__(self, "head", head)
        self.add_state("moments", default=[], dist_reduce_fx="cat")
        # torchmetrics fills an empty list state with a tensor of self.dtype before
        # gathering: float64 like ours, or the gather would mix dtypes.
        self.set_dtype(torch.float64)

    def _merged(self) -> Moments:
        m = Moments(self.num_classes, precision=self.precision)
        blocks = self.moments if isinstance(self.moments, list) else [self.moments]
        for t in blocks:
            for st in unpack(t.detach().to("cpu", torch.float64).numpy()):
                if st["n"] == 0:
                    continue
                one = Moments(self.num_classes, device="cpu")
                one.load_state_dict(st)
                m.merge(one)
        return m

    def update(self, features: Any, outputs: Any = None, labels: Any = None, targets: Any = None) -> None:
        """Add a batch (see ``Moments.update``); a bad batch raises and leaves the state unchanged."""
        if outputs is None and self.head is None:
            raise ValueError("DLR.update needs outputs, or construct DLR(head=...) for the linear-head shortcut")
        if isinstance(features, torch.Tensor) and features.is_cuda:
            # The CPU core is used here; the copy is the only host transfer.
            features = features.detach().cpu()
            outputs = outputs.detach().cpu() if isinstance(outputs, torch.Tensor) else outputs
            labels = labels.detach().cpu() if isinstance(labels, torch.Tensor) else labels
            targets = targets.detach().cpu() if isinstance(targets, torch.Tensor) else targets
        m = self._merged()
        m.update(features, outputs, labels, targets)
        dev = self.moments[0].device if isinstance(self.moments, list) and self.moments else self.device
        self.moments = [torch.from_numpy(pack(m.state_dict())).to(dev)]

    def report(self) -> Report:
        """The full report of the current state (after torchmetrics sync when called inside ``compute``)."""
        return self._merged().compute(head=self.head, rtol=self.rtol)

    def compute(self) -> torch.Tensor:
        """DLR as a float64 scalar tensor."""
        return torch.tensor(self.report().dlr, dtype=torch.float64)
