"""The features-only Monitor (``Monitor(model, layer="dotted.name")``): one
layer's output, pooled into rows, with no head and no labels, for
self-supervised training; and the measures a Monitor's records carry.

The Monitor's hook on the layer pools its output (``pooled_output``,
``torch.batches.layer_pooler``: mean over the positions of a feature map,
1-D or 2-D, or the tokens of a sequence, as the layer's module lays it out) and
records the rows as a head's input would be; the Window and EveryStep routes then add them without
outputs or labels, and the records carry RankMe, alpha-ReQ, the effective
dimension and the participation ratio of the layer's representation
(docs/MATH.md, representation diagnostics).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..finish.diagnostics import CLASS_MEANS, MEASURES, SPECTRAL, check_measures
from ..torch.batches import POOLS, layer_layouts, layer_pooler, pool_rows
from ..torch.hooks import resolve_head

__all__ = []

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


def pooled_output(name: str, pool: str, module: Any = None, layout: Any = None,
                  model: Any = None) -> Callable[[Any], Any]:
    """What the features-only Monitor records of its layer's output: its
    pooled rows (``layer_pooler``: in the layout ``module``, ``model``'s
    submodule ``name``, decides, else in
    ``layout``, ``"tokens"`` or ``"channels"`` or a dict ``{name: layout}``),
    detached, with no outputs. A layer whose output is not a tensor (nor a
    tuple starting with one), or a 3-D one whose layout neither its module
    nor ``layout`` gives, raises a ValueError naming it, from the forward
    that made it; an unknown ``pool`` or ``layout``, or a layout that
    contradicts the module's, raises one here."""
    given = layer_layouts(layout, [(name,)], "Monitor")[0]
    if module is None:
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        return lambda out: pool_rows(out, name, pool, layout=given).detach()
    rows = layer_pooler(name, module, pool, given, model=model)
    return lambda out: rows(out).detach()


def layer_rows(pending: list) -> Optional[tuple]:
    """(features, None, {}) of one step from the layer's captures since the
    last step (one per forward, concatenated); labels play no part."""
    import torch

    rows = [x for x, _ in pending]
    feats = rows[0] if len(rows) == 1 else torch.cat(rows)
    return feats, None, {}
