"""``richness.evaluate``: one pass of a model over a loader, DLR from its head.

Forward hooks on the head (``torch/hooks.py``) capture its input, the features
``phi(x)``, and its output, the logits ``f(x)``, under ``torch.no_grad()``;
each batch becomes rows (``torch/batches.py``) that go straight into a ``Moments``,
and no reference to an activation outlives its batch. ``collect`` is that
pass; ``evaluate`` finishes it into a ``Report``.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Tuple, Union

from .._engine.moments import Moments
from .._report import Report
from .._warnings import RichnessWarning
from .batches import (UNSHIFTED, TokensSpec, batch_size_of, call_model, check_tokens, label_kwargs,
                       labels_are_inputs, layer_layouts, layer_pooler, layer_rows, select_rows,
                       shift_for_next_token, split_batch, to_device)
from .common import eval_mode, merge_ranks, model_device, progress_bar
from .hooks import HeadHook, Latest, pooled_rows, resolve_head, resolve_layers
from .._optional import require_torch
from .threads import BlasThreads

__all__ = ["evaluate"]

log = logging.getLogger("richness")


def _is_linear(mod: Any) -> bool:
    import torch.nn as nn

    return isinstance(mod, nn.Linear)


def collect(model: Any, loader: Iterable, *, head: Any = None, device: Any = None, precision: Optional[str] = None,
            progress: bool = True, batch_fn: Optional[Callable] = None, tokens: TokensSpec = "all",
            desc: str = "richness", allow_empty: bool = False,
            layers: Optional[Sequence] = None, shift_labels: bool = False,
            layout: Union[None, str, Mapping[str, str]] = None) -> Tuple[Moments, Any]:
    """One pass over ``loader``: ``(Moments, head module)``. With an ``nn.Linear``
    head only features (and labels) are streamed: DLR then uses the head's
    weights (docs/MATH.md, linear-head shortcut); other heads stream their outputs.
    With ``layers``, the second item is ``(head module, {name: Moments})``: each
    listed layer's activations streamed against the model's outputs, each
    averaged over its positions in the layout its module decides or
    ``layout`` gives (``layer_pooler``)."""
    torch = require_torch("richness.evaluate")
    check_tokens(tokens)
    resolved = resolve_head(model, head)
    dev = torch.device(device) if device is not None else model_device(model)
    named_layers = resolve_layers(model, layers)
    if layout is not None and not named_layers:
        raise ValueError("evaluate: layout= tells how the outputs of layers= are laid out; give layers= or drop "
                         "layout=")
    given = layer_layouts(layout, [(name,) for name, _ in named_layers], "evaluate")
    poolers = {name: layer_pooler(name, mod, "mean", g, model=model) for (name, mod), g in zip(named_layers, given)}
    bar = progress_bar(loader, desc) if progress else None
    moments = Moments(precision=precision)
    layer_moments = {name: Moments(precision=precision) for name, _ in named_layers}
    layer_io = [(name, Latest()) for name, _ in named_layers]
    layer_hooks = [HeadHook(io, mod) for (_, io), (_, mod) in zip(layer_io, named_layers)]
    head_io = Latest()
    tap = None
    with_labels: Optional[bool] = None
    try:
        with torch.no_grad(), eval_mode(model), BlasThreads() as threads:
            # the head given, or found on the first batch and hooked from then on
            tap = HeadHook(head_io, None if resolved is None else resolved[1], model=model)
            for batch in loader:
                inputs, labels, amask = split_batch(batch, batch_fn)
                if with_labels is None and not shift_labels and labels_are_inputs(inputs, labels):
                    warnings.warn(UNSHIFTED.format(fix="pass shift_labels=True"), UserWarning, stacklevel=3)
                inputs = to_device(inputs, dev)
                searching = tap.module is None
                out = call_model(model, inputs)
                x, y = head_io.take()
                if x is None and searching:  # the head, found now, ran before another Linear: run the batch again
                    call_model(model, inputs)
                    x, y = head_io.take()
                x, y = pooled_rows(x, y, out)  # a head pooled after it ran
                head_mod = tap.module
                if isinstance(x, torch.Tensor) and x.ndim < 2:
                    raise ValueError(f"the head's input has shape {tuple(x.shape)}: the loader yields unbatched "
                                     "samples; evaluate needs batches (pass DataLoader(dataset, batch_size=...), "
                                     "not the dataset)")
                del out
                tok = tokens
                if shift_labels:
                    x, y, labels, amask, tok = shift_for_next_token(x, y, labels, amask, tokens)
                feats, outs, labels = select_rows(x, y, labels, tokens=tok, batch=batch, attention_mask=amask)
                del x, y
                lk = label_kwargs(labels, feats.shape[0], feats.device)
                if with_labels is None:
                    with_labels = bool(lk)
                elif with_labels != bool(lk):
                    raise ValueError("some batches carry labels and others do not; use batch_fn to make them agree")
                threads.set_for(feats)
                if _is_linear(head_mod):
                    moments.update(feats, **lk)
                else:
                    if outs is None:
                        raise ValueError(f"the head {type(head_mod).__name__} did not return a tensor")
                    moments.update(feats, outs, **lk)
                for name, io in layer_io:
                    act = layer_rows(io.take()[1], feats.shape[0], name, poolers[name])
                    layer_moments[name].update(act, outs, **lk)
                del feats, outs, lk
                if bar is not None:
                    bar.update(batch_size_of(inputs))
    finally:
        for hook in layer_hooks:
            hook.remove()
        if tap is not None:
            tap.remove()
        if bar is not None:
            bar.close()
    if moments.n == 0 and not allow_empty:
        raise ValueError("the loader yielded no samples")
    head_mod = tap.module
    if named_layers:
        return moments, (head_mod, layer_moments)
    return moments, head_mod


def evaluate(model: Any, loader: Iterable, *, head: Any = None, test_loader: Optional[Iterable] = None,
             device: Any = None, precision: Optional[str] = None, progress: bool = True,
             batch_fn: Optional[Callable] = None, tokens: TokensSpec = "all", distributed: Optional[bool] = None,
             rtol: Optional[float] = None, layers: Optional[Sequence] = None, shift_labels: bool = False,
             layout: Union[None, str, Mapping[str, str]] = None) -> Report:
    """DLR, spectrum, curves and NC1 of ``model`` on the samples of ``loader``.

    Args:
        model: a ``torch.nn.Module`` ending in a read-out (the head). It is put
            in eval mode for the pass and every module's mode is restored after.
        loader: an iterable of batches (a ``DataLoader``): a tensor, ``(x, y)``
            or a dict of keyword arguments (``labels`` taken out, ``attention_mask``
            used as the padding mask). Integer ``y`` are class labels (NC1,
            quality curve); float ``y`` are regression targets.
        head: the module whose input are the features and whose output are the
            logits, as a submodule or a dotted name (``"fc"``, ``"lm_head"``).
            Default: the last ``nn.Linear`` whose output is the model's output.
            (``Moments.compute`` takes read-out weights as ``head_weights``.)
        test_loader: held-out batches: adds the Nystrom-extended test curves.
        device: where batches are sent (default: the model's device). The model
            is not moved.
        precision: precision of the products (``Moments``); default by dtype.
        progress: show a tqdm bar with samples/s.
        batch_fn: ``batch -> inputs`` or ``batch -> (inputs, labels)``.
        tokens: for 3-D head inputs ``(batch, tokens, features)``: ``"all"``
            positions (minus padding), ``"last"`` (the last kept position of each
            sequence), a boolean mask ``(tokens,)`` or ``(batch, tokens)``, or a
            callable ``batch -> mask``.
        shift_labels: causal-LM labels (HF style, ``labels=input_ids``): the
            class of position i is the token at i + 1; the last position of
            each sequence (no next token), labels of -100 and padding are
            dropped. Default False: labels are used as given, unshifted.
        distributed: merge the states of all ranks (``torch.distributed``; e.g.
            ``DistributedSampler``-sharded loaders) before finishing: every rank
            gets the global report. Default None: merge when a process group is
            initialised (torchrun, ``accelerate launch``, an ``Accelerator`` with
            several processes) and stay local otherwise, so one script serves
            both; True requires a process group, False never merges.
        rtol: eigenvalue cut (default by precision, docs/MATH.md, rank cut).
        layers: modules (dotted names or submodules) whose activations are also
            measured, in the same pass, against the span of the model's outputs:
            ``report.layers`` maps each name to its Report (DLR by depth; the
            paper reports the strongest low-rank bias at the last layer).
            Each output is averaged over its positions: feature maps
            (batch, C, H, W) and the (batch, C, L) maps of 1-D convolutions
            over positions, (batch, T, D) sequences over tokens, as the
            layer's module decides (``richness.torch.batches.module_layout``).
        layout: for a layer whose module does not say how its 3-D output is
            laid out (a custom block): ``"tokens"`` (batch, tokens, width) or
            ``"channels"`` (batch, channels, positions), for every layer or as
            a dict layer name -> layout. Without it such a layer is a
            ValueError naming it.

    Runs under ``torch.no_grad()``; hooks are removed on exit, also after an
    exception; the core's BLAS uses at most ``torch.get_num_threads()``
    threads (one for small batches; see ``BlasThreads``).
    """
    distributed = merge_ranks(distributed, "evaluate")
    moments, head_mod = collect(model, loader, head=head, device=device, precision=precision, progress=progress,
                                batch_fn=batch_fn, tokens=tokens, allow_empty=distributed, layers=layers,
                                shift_labels=shift_labels, layout=layout)
    layer_moments = {}
    if layers:
        head_mod, layer_moments = head_mod
    test = None
    if test_loader is not None:
        test, _ = collect(model, test_loader, head=head_mod, device=device, precision=precision,
                          progress=progress, batch_fn=batch_fn, tokens=tokens, desc="richness (held-out)",
                          allow_empty=distributed, shift_labels=shift_labels)
    if distributed:
        moments.all_reduce()
        for lm in layer_moments.values():
            lm.all_reduce()
        if test is not None:
            test.all_reduce()
        if moments.n == 0:
            raise ValueError("the loaders of all ranks yielded no samples")
    w = head_mod if _is_linear(head_mod) else None
    report = moments.compute(head_weights=w, test=test, rtol=rtol)
    if layers:
        report.layers = {name: lm.compute(rtol=rtol) for name, lm in layer_moments.items()}
    log.info("evaluate: %d samples, head %s, DLR %s", report.n, type(head_mod).__name__,
             "n/a" if report.dlr is None else f"{report.dlr:.4f}")
    # a returned report's caveats are easy to miss: also through warnings (RichnessWarning)
    for msg in report.warnings:
        warnings.warn(msg, RichnessWarning, stacklevel=2)
    report._mark_issued(report.warnings)  # print(report) then counts them instead of repeating them
    return report
