"""The features-only Monitor (``Monitor(model, layer="dotted.name")``): one
layer's output, pooled into rows, with no head and no labels, for
self-supervised training; and the measures a Monitor's records carry.

A forward hook on the layer pools its output (``model.batches.pool_rows``:
mean over spatial positions or tokens) and hands the rows to the Monitor as a
head's input would be; the window and every=1 routes then add them without
outputs or labels, and the records carry RankMe, alpha-ReQ, the effective
dimension and the participation ratio of the layer's representation
(docs/MATH.md, representation diagnostics).
"""

from __future__ import annotations

from typing import Any, Optional

from ..finish.diagnostics import CLASS_MEANS, MEASURES, SPECTRAL, check_measures
from ..model.batches import POOLS, pool_rows
from ..model.hooks import hook_forward, resolve_head

# What a record carries besides step, mode, n, dlr, rank, nc1, effective_dim and time.
RECORD_MEASURES = MEASURES


def monitor_measures(measures: Any, layer: Any) -> tuple:
    """The measures a Monitor computes at each record: ``measures`` checked;
    by default the spectral ones for a features-only Monitor and none with a
    head (their p x p eigenvalues would cost more than DLR itself at each
    emission). A features-only Monitor has no labels and no head: asking it
    for NC2 or NC3 is a ValueError."""
    wanted = check_measures(measures)
    if layer is None:
        return wanted or ()
    if wanted is None:
        return SPECTRAL
    no = [m for m in wanted if m in CLASS_MEANS]
    if no:
        raise ValueError(f"measures {no} need labels (and NC3 a head); Monitor(layer=...) records the "
                         f"features alone: choose from {SPECTRAL}")
    return wanted


def resolve_layer(model: Any, layer: Any) -> tuple:
    """``(name, module)`` of ``layer`` (a dotted name or a submodule);
    ValueError listing candidates when the model has none of that name."""
    if isinstance(layer, str) and layer == "":
        raise ValueError("layer must name a submodule, got ''")
    resolved = resolve_head(model, layer)
    assert resolved is not None  # layer is not None
    return resolved


class LayerCapture:
    """Forward hook on the layer: the pooled rows of its training forwards
    during window steps go to the Monitor as ``(rows, None)`` captures (no
    outputs). A layer whose output is not a tensor (nor a tuple starting with
    one) raises a ValueError naming it, from the forward that made it."""

    def __init__(self, module: Any, name: str, mon: Any, pool: str) -> None:
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        self.mon, self.name, self.pool = mon, name, pool
        self.handle = hook_forward(module, self._hook)

    def _hook(self, mod: Any, args: Any, out: Any) -> None:
        import torch

        mon = self.mon
        if not torch.is_grad_enabled():
            return
        mon.head_ran()
        if mon.capturing:
            rows = pool_rows(out, self.name, self.pool)
            mon.record_head_output(rows.detach(), None)

    def remove(self) -> None:
        self.handle.remove()


def layer_rows(pending: list) -> Optional[tuple]:
    """(features, None, {}) of one step from the layer's captures since the
    last step (one per forward, concatenated); labels play no part."""
    import torch

    rows = [x for x, _ in pending]
    feats = rows[0] if len(rows) == 1 else torch.cat(rows)
    return feats, None, {}
