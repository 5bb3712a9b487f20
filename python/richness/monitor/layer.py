"""The features-only Monitor (``Monitor(model, layer="dotted.name")``): one
layer's output, pooled into rows, with no head and no labels, for
self-supervised training; and the measures a Monitor's records carry.

The Monitor's hook on the layer pools its output (``pooled_output``,
``torch.batches.layer_pooler``: mean over the positions of a feature map,
1-D or 2-D, or the tokens of a sequence, as the layer's module lays it out) and
records the rows as a head's input would be; the Window and EveryStep routes then add them without
outputs or labels, and the records carry RankMe, alpha-ReQ, the effective
dimension and the participation ratio of the layer's representation
(docs/MATH.md, representation diagnostics). Asked for ``"lidar"``, the
records carry LiDAR as well, from the object ids that ``step(labels=ids)``
gives (``object_ids``): the rows that share an id in one step are
augmentations of one input.
"""

from __future__ import annotations

from typing import Any, Callable

from ..finish.diagnostics import CLASS_MEANS, MEASURES, SPECTRAL, check_measures
from ..torch.batches import POOLS, label_kwargs, layer_layouts, layer_pooler, pool_rows
from ..torch.hooks import resolve_head

__all__ = []

# What a record carries besides step, mode, n, dlr, rank, nc1, effective_dim and time.
RECORD_MEASURES = MEASURES


def monitor_measures(measures: Any, layer: Any) -> tuple:
    """The measures a Monitor computes at each record: ``measures`` checked;
    by default the spectral ones for a features-only Monitor and none with a
    head (their p x p eigenvalues would cost more than DLR itself at each
    emission). A features-only Monitor has no class labels and no head:
    asking it for NC2 or NC3 is a ValueError; LiDAR reads the object ids
    given to ``step``."""
    wanted = check_measures(measures)
    if layer is None:
        return wanted or ()
    if wanted is None:
        return SPECTRAL
    no = [m for m in wanted if m in CLASS_MEANS]
    if no:
        raise ValueError(f"measures {no} need labels (and NC3 a head); Monitor(layer=...) records the "
                         f"features alone: choose from {SPECTRAL + ('lidar',)}")
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


def layer_rows(pending: list, ids: Any = None) -> tuple:
    """(features, None, label keyword arguments) of one step from the
    layer's captures since the last step (one per forward, concatenated):
    ``{}``, or ``{"labels": ids}`` with the step's object ids (``object_ids``)."""
    import torch

    rows = [x for x, _ in pending]
    feats = rows[0] if len(rows) == 1 else torch.cat(rows)
    return feats, None, ({} if ids is None else object_ids(ids, feats))


def object_ids(ids: Any, feats: Any) -> dict:
    """``{"labels": ids}`` of one step, checked: integers, one per row of
    ``feats`` (the step's captures together, so a step that runs the layer
    on two views gives the ids of both). ValueError naming what is wrong."""
    try:
        lk = label_kwargs(ids, int(feats.shape[0]), feats.device)
    except (ValueError, TypeError, RuntimeError) as e:
        raise ValueError(f"Monitor.step: the object ids for LiDAR do not fit the layer's rows ({e}). The step was "
                         "not counted and nothing was recorded: call step() again with one id per row") from None
    if "labels" not in lk:
        raise ValueError("Monitor.step: LiDAR's object ids must be integers (one per row; the augmentations of "
                         "one input share one). The step was not counted: call step() again with integer ids")
    return lk


def renumber(ids: Any, first: int) -> tuple:
    """(ids renumbered first, first + 1, ... in sorted order of their values,
    the number of distinct ids): a window's steps get objects of their own
    (the same id in two steps names two inputs), numbered from 0 in each
    window, so the window's class arrays hold its objects alone whatever
    the ids' range. One device sync on a GPU (the count)."""
    import torch

    distinct, inverse = torch.unique(ids, return_inverse=True)
    return inverse + first, int(distinct.shape[0])
