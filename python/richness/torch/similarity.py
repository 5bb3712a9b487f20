"""``richness.similarity``: one pass of one or more models over a loader, linear
CKA between their layers (exact, the minibatch estimator, or both).

Forward hooks (``HeadHook``) on the named layers capture each output under
``torch.no_grad()``, each model's in its own forward (a module shared by two
models is captured once for each); ``layer_pooler`` turns it into one row per
sample (flattened by default, as in the CKA literature); every batch's rows
go into one ``Similarity`` as ``"model.layer"``. No activation outlives its
batch, and the hooks are removed when the pass ends (also after an error).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Union

from .._optional import require_torch
from .._engine.similarity import Similarity, SimilarityReport
from .batches import FLATTEN_LIMIT, batch_size_of, call_model, layer_layouts, layer_pooler, split_batch, to_device
from .common import eval_mode, merge_ranks, model_device, progress_bar
from .hooks import HeadHook, resolve_layers

__all__ = ["similarity"]


def _as_models(models: Any) -> Dict[str, Any]:
    if isinstance(models, Mapping):
        if not models:
            raise ValueError("similarity: models is empty")
        bad = [k for k in models if not isinstance(k, str)]
        if bad:
            raise TypeError(f"similarity: model names must be strings, got {bad!r}")
        out = dict(models)
    else:
        out = {"model": models}
    for name, m in out.items():
        if not (hasattr(m, "named_modules") and callable(m)):
            raise TypeError(f"similarity: model {name!r} is a {type(m).__name__}, not a torch.nn.Module")
    return out


def _as_layers(layers: Any, names: List[str]) -> Dict[str, Sequence]:
    if isinstance(layers, Mapping):
        missing = [n for n in names if n not in layers]
        extra = [n for n in layers if n not in names]
        if missing or extra:
            raise ValueError(f"similarity: layers must name the layers of every model {names}; "
                             f"missing {missing}, unknown {extra}")
        out = {n: layers[n] for n in names}
    elif isinstance(layers, (list, tuple)):
        out = {n: layers for n in names}
    else:
        raise TypeError(f"similarity: layers must be a list of layer names (or a dict model -> list), got "
                        f"{type(layers).__name__}")
    for n, ls in out.items():
        if isinstance(ls, str) or not ls:
            raise ValueError(f"similarity: model {n!r} needs a non-empty list of layers, got {ls!r}")
    return out


def _resolve(model_name: str, model: Any, layers: Sequence) -> List[tuple]:
    try:
        return resolve_layers(model, layers)
    except ValueError as e:
        names = [n for n, _ in model.named_modules() if n]
        shown = ", ".join(repr(n) for n in names[:24]) + (f", ... ({len(names) - 24} more)" if len(names) > 24
                                                         else "")
        raise ValueError(f"model {model_name!r}: {e}; its submodules: {shown or 'none'}") from None


def _input_fns(inputs: Any, names: List[str]) -> Dict[str, Optional[Callable]]:
    if inputs is None or callable(inputs):
        return {n: inputs for n in names}
    if isinstance(inputs, Mapping):
        bad = [n for n in inputs if n not in names]
        if bad:
            raise ValueError(f"similarity: inputs names unknown models {bad}; the models are {names}")
        for n, f in inputs.items():
            if not callable(f):
                raise TypeError(f"similarity: inputs[{n!r}] is a {type(f).__name__}, not a callable")
        return {n: inputs.get(n) for n in names}
    raise TypeError(f"similarity: inputs must be None, a callable or a dict model -> callable, "
                    f"got {type(inputs).__name__}")


def similarity(models: Any, loader: Iterable, layers: Union[Sequence, Mapping], *, pool: str = "flatten",
               layout: Union[None, str, Mapping[str, str]] = None,
               inputs: Union[None, Callable, Mapping[str, Callable]] = None, distributed: Optional[bool] = None,
               precision: Optional[str] = None, progress: bool = True, estimator: str = "exact",
               measures: Any = None) -> SimilarityReport:
    """Linear CKA between layers of one or more models over ``loader``.

    Args:
        models: a ``torch.nn.Module`` (named ``"model"``) or a dict name -> module.
            Models may share modules: each model's layers are captured in its
            own forward.
        loader: batches as ``evaluate`` reads them (a tensor, ``(x, y)``, or a dict
            of keyword arguments); labels are ignored.
        layers: dotted module names (or submodules), one list for every model or
            a dict model name -> list. A name that does not exist raises a
            ValueError listing the model's submodules.
        pool: how an output becomes one row per sample (``pool_rows``):
            ``"flatten"`` (default: every value of a feature map or sequence
            in one row, the representation of the CKA literature, Kornblith
            et al. 2019, and of CKA libraries; refused past the width limit,
            the message giving the memory it would need, except with
            ``estimator="minibatch"``, whose state is k x k at any width), ``"mean"`` over
            positions / tokens (another quantity: the CKA of the averaged
            maps), ``"first"`` / ``"last"`` position.
        layout: how a 3-D output is laid out where its module does not say
            (``module_layout``: convolutions, pooling and normalisation of 1-D
            maps are ``(batch, channels, positions)``; Linear, Embedding,
            LayerNorm, attention and transformer layers ``(batch, tokens,
            width)``): ``"tokens"`` or ``"channels"`` for every layer, or a
            dict layer name (or ``"model.layer"``) -> layout. Only ``"mean"``,
            ``"first"`` and ``"last"`` need it.
        inputs: what each model is fed: None (every model gets the batch's
            inputs), a callable ``batch -> inputs`` for all models, or a dict
            model name -> callable (a ViT and a CNN at different resolutions).
        distributed: merge the states of all ranks (torch.distributed); None
            merges when a process group is initialised.
        precision: as ``Similarity``.
        progress: a tqdm bar in samples.
        estimator: as ``Similarity``: ``"exact"`` (default; ``cka`` and
            ``cka_debiased`` over all samples), ``"minibatch"`` (only
            ``cka_minibatch``, the estimator of Nguyen, Raghu and Kornblith
            2021 that ckatorch, torch-cka and pytorch-cka report: the unbiased
            HSIC of each batch's Grams summed over the loader's batches; it
            depends on the batch size and order, and batches of fewer than 4
            samples are left out) or ``"both"``.
        measures: the measures to finish, as ``Similarity.compute``: default
            those of the estimator; ``"all"``, or names such as ``"cca_r2"``,
            ``"svcca"``, ``"pwcca"``, ``"procrustes"``, ``"shape_angular"``,
            ``"linreg_r2"`` (every one from the same pass).

    Returns a ``SimilarityReport`` whose names are ``"model.layer"``, in the
    order the models and layers were given. Runs in eval mode under
    ``torch.no_grad()``; every hook is removed on return or on error.
    """
    torch = require_torch("richness.similarity")
    sim = Similarity(precision=precision, estimator=estimator)  # the options are checked before any work
    merge = merge_ranks(distributed, "similarity")
    mods = _as_models(models)
    names = list(mods)
    per_model = _as_layers(layers, names)
    feeds = _input_fns(inputs, names)
    resolved = {n: _resolve(n, mods[n], per_model[n]) for n in names}
    order = [f"{n}.{ln}" for n in names for ln, _ in resolved[n]]
    if len(set(order)) != len(order):
        raise ValueError(f"similarity: a layer is named twice: {order}")
    hooked = [(n, ln, mod) for n in names for ln, mod in resolved[n]]
    given = layer_layouts(layout, [(ln, f"{n}.{ln}") for n, ln, _ in hooked], "similarity")
    limit = None if estimator == "minibatch" else FLATTEN_LIMIT  # minibatch: a k x k state at any width
    poolers = {f"{n}.{ln}": layer_pooler(f"{n}.{ln}", mod, pool, g, model=mods[n], path=ln, limit=limit)
               for (n, ln, mod), g in zip(hooked, given)}
    captured: Dict[str, Any] = {}
    widths: Dict[str, int] = {}
    state: Dict[str, Any] = {"n": 0, "model": None}

    def tap(model_name: str, key: str):
        def fn(_inputs, out):
            if state["model"] != model_name:  # a module shared with the model running now
                return
            if key in captured:
                raise ValueError(f"similarity: layer {key!r} ran twice in one forward pass of model "
                                 f"{model_name!r}; hook a module that runs once per sample")
            captured[key] = poolers[key](out, state["n"]).detach()
        return fn

    hooks = []
    batches = 0
    bar = progress_bar(loader, "richness similarity") if progress else None
    try:
        for n, ln, mod in hooked:
            hooks.append(HeadHook(tap(n, f"{n}.{ln}"), mod))
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for m in mods.values():
                stack.enter_context(eval_mode(m))
            for batch in loader:
                batches += 1
                captured.clear()
                for n in names:
                    feed = feeds[n]
                    x = feed(batch) if feed is not None else split_batch(batch)[0]
                    state["n"], state["model"] = batch_size_of(x), n
                    try:
                        call_model(mods[n], to_device(x, model_device(mods[n])))
                    finally:
                        state["model"] = None
                missing = [k for k in order if k not in captured]
                if missing:
                    raise ValueError(f"similarity: layers {missing} did not run in the forward pass")
                rows = {k: captured[k] for k in order}
                if pool == "flatten":
                    _check_widths(rows, widths)
                dev = rows[order[0]].device
                sim.update({k: v.to(dev) for k, v in rows.items()})
                captured.clear()
                if bar is not None:
                    bar.update(state["n"])
    finally:
        for h in hooks:
            h.remove()
        captured.clear()
        if bar is not None:
            bar.close()
    if merge:
        sim.all_reduce()
        if sim.n == 0:
            raise ValueError("similarity: the loaders of all ranks gave no samples")
    elif batches == 0:
        raise ValueError("similarity: the loader gave no batches")
    elif sim.n == 0:
        raise ValueError(f"similarity: the loader gave {batches} batches of no samples")
    return sim.compute(measures)


def _check_widths(rows: Dict[str, Any], widths: Dict[str, int]) -> None:
    """A flattened layer whose width changes between batches (sequences padded
    to each batch's length) is a ValueError naming it, before the update."""
    for k, v in rows.items():
        w = int(v.shape[1])
        if widths.setdefault(k, w) != w:
            raise ValueError(f"similarity: layer {k!r} flattened to {w:,} columns in this batch and "
                             f"{widths[k]:,} before: pool='flatten' needs outputs of one shape in every batch "
                             "(sequences padded to each batch's length are not); pool='mean' or pool='last' "
                             "gives one width")
