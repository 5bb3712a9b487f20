"""``richness.evaluate``: one pass of a model over a loader, DLR from its head.

The head is the module whose input are the features ``phi(x)`` and whose
output are the logits ``f(x)``. Forward hooks capture both under
``torch.no_grad()``; batches go straight into a ``Moments`` and no reference
to an activation outlives its batch. The helpers here (head discovery, token
selection, batch splitting, BLAS thread matching) are shared with
``richness.Monitor``.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from typing import Sequence, Any, Callable, Iterable, List, Optional, Tuple, Union

from ._moments import Moments
from ._report import Report

log = logging.getLogger("richness")


class RichnessWarning(UserWarning):
    """A caveat of a report (finite n, rank cut, NC1 precision), also in ``report.warnings``."""


def require_torch(what: str):
    """Import torch or fail with the extra to install."""
    try:
        import torch
    except ImportError:
        raise ImportError(f'{what} needs PyTorch: pip install "richness[torch]"') from None
    return torch


def require_tqdm(what: str):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        raise ImportError(f'{what} with progress=True needs tqdm: pip install "richness[demo]" '
                          "(or pass progress=False)") from None
    return tqdm


# -- threads ------------------------------------------------------------------

class BlasThreads:
    """The core's thread count for each update, restored on exit.

    Never more threads than torch's intra-op pool (``torch.get_num_threads()``):
    the core's count (``_core.blas_set_num_threads``: its own workers, each
    calling single-threaded BLAS) starts at the number of cores regardless of
    ``torch.set_num_threads``. And one thread for small products (below 2^27
    multiply-adds, e.g. a 128 x 512 training batch: half a millisecond on one
    core), where a second thread gains nothing beside a training step that
    wants the cores back at once. benchmarks/bench_monitor.py measures this.
    """

    SMALL = 2 ** 27

    def __init__(self, small: int = SMALL) -> None:
        from . import _core

        self.small = small
        self._core = _core
        self.old = _core.blas_get_num_threads()
        self.now = self.old

    def set_for(self, feats: Any) -> None:
        """Pick the count for an update of ``feats`` (rows x p) on the CPU."""
        if getattr(feats, "device", None) is not None and feats.device.type != "cpu":
            return
        self.set_for_work(int(feats.shape[0]) * int(feats.shape[-1]) ** 2)

    def set_for_work(self, work: int) -> None:
        """Pick the count for ``work`` multiply-adds of core products on the CPU."""
        import torch

        want = 1 if work < self.small else max(1, int(torch.get_num_threads()))
        if want != self.now:
            self._core.blas_set_num_threads(want)
            self.now = want

    def restore(self) -> None:
        if self.now != self.old:
            self._core.blas_set_num_threads(self.old)
            self.now = self.old

    def __enter__(self) -> "BlasThreads":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


# -- head discovery -----------------------------------------------------------

def _module_line(name: str, mod: Any) -> str:
    import torch.nn as nn

    if isinstance(mod, nn.Linear):
        return f"{name!r} (Linear {mod.in_features} -> {mod.out_features})"
    return f"{name!r} ({type(mod).__name__})"


def candidate_list(model: Any, limit: int = 12) -> str:
    """A one-line list of modules that could be the head (Linear first)."""
    import torch.nn as nn

    named = [(n, m) for n, m in model.named_modules() if n]
    linears = [(n, m) for n, m in named if isinstance(m, nn.Linear)]
    pool = linears[::-1] if linears else [(n, m) for n, m in named if not list(m.children())][::-1]
    if not pool:
        return "none (the model has no submodules)"
    words = [_module_line(n, m) for n, m in pool[:limit]]
    more = f", ... ({len(pool) - limit} more)" if len(pool) > limit else ""
    return ", ".join(words) + more


def resolve_head(model: Any, head: Any) -> Optional[Tuple[str, Any]]:
    """``head`` (None, a dotted name or a submodule) as ``(name, module)``; None = auto-detect."""
    torch = require_torch("richness")
    if head is None:
        return None
    if isinstance(head, str):
        mods = dict(model.named_modules())
        if head not in mods or head == "":
            raise ValueError(f"the model has no submodule named {head!r}; candidates: {candidate_list(model)}")
        return head, mods[head]
    if isinstance(head, torch.nn.Module):
        for name, mod in model.named_modules():
            if mod is head:
                return name, mod
        raise ValueError(f"head {type(head).__name__} is not a submodule of the model; "
                         f"candidates: {candidate_list(model)}")
    raise TypeError(f"head must be a submodule or its dotted name (str), got {type(head).__name__}; "
                    "(weights go to Moments.compute(head=...), not here)")


def output_tensors(out: Any) -> List[Any]:
    """The tensors a model returned: a tensor, a tuple/list, a dict, or an object with ``.logits``."""
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        vals = list(out.values())
    elif isinstance(out, (tuple, list)):
        vals = list(out)
    elif hasattr(out, "logits"):
        vals = [out.logits]
    else:
        return []
    res = []
    for v in vals:
        res.extend(output_tensors(v) if not isinstance(v, torch.Tensor) else [v])
    return res


class HeadFinder:
    """Hooks on every ``nn.Linear`` for one forward pass; afterwards names the
    last one whose output object is (one of) the model's output(s).

    Only the latest call's input and output are referenced, so finding the
    head costs no more memory than one head activation.
    """

    def __init__(self, model: Any) -> None:
        import torch.nn as nn

        self.model = model
        self.calls: List[Tuple[str, Any]] = []
        self.last: Optional[Tuple[str, Any, Any, Any]] = None
        self.handles = []
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear):
                self.handles.append(mod.register_forward_hook(self._hook(name)))

    def _hook(self, name: str):
        def hook(mod, args, out):
            # a weak reference: a freed output cannot be mistaken for a later
            # tensor that happens to get its address (id)
            try:
                self.calls.append((name, weakref.ref(out)))
            except TypeError:
                return
            self.last = (name, mod, args[0] if args else None, out)
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def result(self, model_out: Any) -> Tuple[str, Any, Any, Any]:
        """``(name, module, input, output)``; input/output are None when the head
        was not the last Linear called (the caller must run the batch again)."""
        outs = output_tensors(model_out)
        found = [name for name, ref in self.calls if any(ref() is t for t in outs)]
        last, self.last, self.calls = self.last, None, []
        if not found:
            if last is None:
                raise ValueError("could not find the head: the model has no nn.Linear; pass head= the module whose "
                                 f"input are the features, one of: {candidate_list(self.model)}")
            raise ValueError("could not find the head: no nn.Linear's output is the model's output (is it "
                             "post-processed?); pass head= one of: " + candidate_list(self.model))
        name = found[-1]
        mod = dict(self.model.named_modules())[name]
        if last is not None and last[0] == name and any(last[3] is t for t in outs):
            return name, mod, last[2], last[3]
        return name, mod, None, None


class Capture:
    """A forward hook that keeps the latest input and output of one module."""

    def __init__(self, module: Any, active: Callable[[], bool] = lambda: True) -> None:
        self.inp = self.out = None
        self.active = active
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, mod, args, out):
        if self.active():
            self.inp = args[0] if args else None
            self.out = out

    def take(self) -> Tuple[Any, Any]:
        x, y = self.inp, self.out
        self.inp = self.out = None
        return x, y

    def remove(self) -> None:
        self.handle.remove()


# -- batches ------------------------------------------------------------------

def split_batch(batch: Any, batch_fn: Optional[Callable] = None) -> Tuple[Any, Any, Any]:
    """``(inputs, labels_or_targets, attention_mask)`` of one loader batch.

    Default: a tensor is the input; ``(x, y)`` / ``[x, y]`` gives input and
    labels (``(x,)`` no labels); a dict is passed as keyword arguments with
    ``labels``/``label`` taken out as labels and ``attention_mask`` used as
    the padding mask. ``batch_fn(batch)`` may return ``inputs`` or
    ``(inputs, labels)``.
    """
    mask = None
    if batch_fn is not None:
        res = batch_fn(batch)
        if isinstance(res, tuple) and len(res) == 2:
            inputs, labels = res
        else:
            inputs, labels = res, None
    elif isinstance(batch, dict):
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "label")}
        labels = batch.get("labels", batch.get("label"))
    elif isinstance(batch, (tuple, list)):
        if len(batch) == 0:
            raise ValueError("the loader yielded an empty batch")
        inputs = batch[0]
        labels = batch[1] if len(batch) >= 2 else None
    else:
        inputs, labels = batch, None
    if isinstance(inputs, dict):
        mask = inputs.get("attention_mask")
    return inputs, labels, mask


def to_device(x: Any, device: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(v, device) for v in x)
    return x


def call_model(model: Any, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def batch_size_of(inputs: Any) -> int:
    import torch

    if isinstance(inputs, torch.Tensor):
        return int(inputs.shape[0]) if inputs.ndim else 1
    if isinstance(inputs, dict):
        for v in inputs.values():
            if isinstance(v, torch.Tensor) and v.ndim:
                return int(v.shape[0])
    if isinstance(inputs, (tuple, list)):
        for v in inputs:
            if isinstance(v, torch.Tensor) and v.ndim:
                return int(v.shape[0])
    return 0


TokensSpec = Union[str, Any, Callable]


def check_tokens(tokens: Any) -> None:
    import torch

    if isinstance(tokens, str):
        if tokens not in ("all", "last"):
            raise ValueError(f"tokens must be 'all', 'last', a boolean mask or a callable, got {tokens!r}")
    elif not (callable(tokens) or isinstance(tokens, torch.Tensor)):
        raise TypeError(f"tokens must be 'all', 'last', a boolean mask tensor or a callable, got {type(tokens).__name__}")
    elif isinstance(tokens, torch.Tensor) and tokens.dtype != torch.bool:
        raise TypeError(f"a tokens mask must be a boolean tensor, got dtype {tokens.dtype}")


def select_rows(feats: Any, outs: Any, labels: Any, *, tokens: TokensSpec, batch: Any = None,
                attention_mask: Any = None) -> Tuple[Any, Any, Any]:
    """Flatten head activations to rows: 2-D passes through; 3-D ``(b, T, p)``
    keeps the positions ``tokens`` selects (padding, by ``attention_mask``,
    excluded). Labels of shape ``(b, T)`` follow the same selection; labels
    that do not line up with the rows raise."""
    import torch

    if feats is None or not isinstance(feats, torch.Tensor):
        raise ValueError(f"the head's input is not a tensor (got {type(feats).__name__})")
    if isinstance(outs, torch.Tensor) is False:
        outs = None
    if feats.ndim == 2:
        if labels is not None and labels.shape[0] != feats.shape[0]:
            raise ValueError(f"labels have {labels.shape[0]} rows but the head saw {feats.shape[0]} samples")
        return feats, outs, labels
    if feats.ndim == 1:
        return feats.reshape(1, -1), (outs.reshape(1, -1) if outs is not None else None), labels
    if feats.ndim != 3:
        raise ValueError(f"head input of shape {tuple(feats.shape)}: expected (batch, features) or "
                         "(batch, tokens, features)")
    b, T, p = feats.shape
    mask = None
    if callable(tokens) and not isinstance(tokens, torch.Tensor):
        mask = tokens(batch)
    elif isinstance(tokens, torch.Tensor):
        mask = tokens
    if mask is not None:
        mask = mask.to(feats.device)
        if mask.dtype != torch.bool:
            raise TypeError(f"a tokens mask must be boolean, got dtype {mask.dtype}")
        if mask.ndim == 1 and mask.shape[0] == T:
            mask = mask.expand(b, T)
        if tuple(mask.shape) != (b, T):
            raise ValueError(f"tokens mask has shape {tuple(mask.shape)}, the head input has (batch, tokens) = {(b, T)}")
    if attention_mask is not None and tuple(attention_mask.shape) == (b, T):
        # padding is never counted, whatever else selects the positions
        pad = attention_mask.to(feats.device).bool()
        mask = pad if mask is None else mask & pad
    if isinstance(tokens, str) and tokens == "last":
        if mask is None:
            idx = torch.full((b,), T - 1, dtype=torch.long, device=feats.device)
        else:  # last position the padding mask keeps (left or right padding)
            pos = torch.arange(T, device=feats.device).expand(b, T)
            idx = torch.where(mask, pos, torch.full_like(pos, -1)).amax(dim=1).clamp_min(0)
        rows = torch.arange(b, device=feats.device)
        f2 = feats[rows, idx]
        o2 = outs[rows, idx] if outs is not None and outs.ndim == 3 else outs
        if labels is not None:
            if labels.ndim == 2 and tuple(labels.shape) == (b, T):
                labels = labels.to(feats.device)[rows, idx]
            elif labels.shape[0] != b:
                raise ValueError(f"labels of shape {tuple(labels.shape)} do not match {b} sequences")
        return f2, o2, labels
    if mask is None:
        f2 = feats.reshape(b * T, p)
        o2 = outs.reshape(b * T, -1) if outs is not None and outs.ndim == 3 else outs
        if labels is not None:
            if tuple(labels.shape[:2]) != (b, T):
                raise ValueError(f"labels of shape {tuple(labels.shape)} do not line up with the {b} x {T} "
                                 "token positions; give per-token labels or tokens='last'")
            labels = labels.reshape(b * T, *labels.shape[2:])
        return f2, o2, labels
    f2 = feats[mask]  # boolean indexing: a device sync on CUDA (documented)
    o2 = outs[mask] if outs is not None and outs.ndim == 3 else outs
    if labels is not None:
        if tuple(labels.shape[:2]) != (b, T):
            raise ValueError(f"labels of shape {tuple(labels.shape)} do not line up with the {b} x {T} "
                             "token positions; give per-token labels or tokens='last'")
        labels = labels.to(mask.device)[mask]
    return f2, o2, labels


def shift_for_next_token(feats: Any, outs: Any, labels: Any, attention_mask: Any, tokens: TokensSpec
                         ) -> Tuple[Any, Any, Any, Any, TokensSpec]:
    """Causal-LM labels (HF style, ``labels=input_ids``): the class of position
    i is the token at i + 1. Positions 0..T-2 are kept with labels[:, 1:]; the
    last position has no label. A position is dropped when its label is
    negative (HF's ignore index -100) or when it or the next one is padding.
    A tokens mask (or callable) of shape (b, T) is cut to the kept positions."""
    import torch

    if labels is None:
        raise ValueError("shift_labels=True needs labels (labels=input_ids for a causal LM)")
    if feats is None or not isinstance(feats, torch.Tensor) or feats.ndim != 3:
        shape = tuple(feats.shape) if isinstance(feats, torch.Tensor) else type(feats).__name__
        raise ValueError(f"shift_labels=True needs a (batch, tokens, features) head input, got {shape}")
    b, T, _ = feats.shape
    if not isinstance(labels, torch.Tensor):
        labels = torch.as_tensor(labels)
    if tuple(labels.shape) != (b, T):
        raise ValueError(f"shift_labels=True needs labels of shape (batch, tokens) = {(b, T)}, got "
                         f"{tuple(labels.shape)}")
    if labels.is_floating_point():
        raise ValueError("shift_labels=True needs integer token labels, got floating point")
    nxt = labels[:, 1:].to(feats.device)
    keep = nxt >= 0
    if attention_mask is not None and tuple(attention_mask.shape) == (b, T):
        pad = attention_mask.to(feats.device).bool()
        keep = keep & pad[:, :-1] & pad[:, 1:]
    o = outs[:, :-1] if isinstance(outs, torch.Tensor) and outs.ndim == 3 else outs
    if isinstance(tokens, torch.Tensor) and tokens.ndim >= 1 and tokens.shape[-1] == T:
        tokens = tokens[..., :-1]
    elif callable(tokens) and not isinstance(tokens, (str, torch.Tensor)):
        user_tokens = tokens

        def tokens(batch, _f=user_tokens):
            mask = _f(batch)
            return mask[..., :-1] if mask.shape[-1] == T else mask
    return feats[:, :-1], o, nxt, keep, tokens


def label_kwargs(labels: Any, n: int, device: Any) -> dict:
    """``{"labels": y}`` for integers, ``{"targets": t}`` for floats, ``{}`` for None."""
    import torch

    if labels is None:
        return {}
    if not isinstance(labels, torch.Tensor):
        labels = torch.as_tensor(labels)
    if labels.shape[0] != n:
        raise ValueError(f"labels have {labels.shape[0]} rows but the head saw {n} samples")
    labels = labels.to(device, non_blocking=True)
    if labels.is_floating_point():
        return {"targets": labels}
    if labels.ndim != 1:
        raise ValueError(f"integer labels must be 1-D (one class per sample), got shape {tuple(labels.shape)}")
    return {"labels": labels}


# -- evaluate -----------------------------------------------------------------

def _model_device(model: Any) -> Any:
    import torch

    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


@contextlib.contextmanager
def eval_mode(model: Any):
    """Eval mode for the duration; every module's own training flag restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, t in modes:
            m.training = t


def _is_linear(mod: Any) -> bool:
    import torch.nn as nn

    return isinstance(mod, nn.Linear)


def resolve_layers(model: Any, layers: Optional[Sequence]) -> List[Tuple[str, Any]]:
    """``(name, module)`` for each entry of ``layers`` (dotted names or submodules)."""
    if not layers:
        return []
    names = {m: n for n, m in model.named_modules()}
    out = []
    for entry in layers:
        if isinstance(entry, str):
            try:
                out.append((entry, model.get_submodule(entry)))
            except AttributeError:
                raise ValueError(f"layers: the model has no submodule {entry!r}") from None
        elif entry in names:
            out.append((names[entry] or type(entry).__name__, entry))
        else:
            raise ValueError(f"layers: {type(entry).__name__} is not a submodule of the model")
    return out


def layer_rows(act: Any, n: int, name: str) -> Any:
    """A layer's output as one row per sample: (batch, C, ...) feature maps are
    averaged over their spatial positions (channels stay), other shapes are
    flattened. Layers are profiled per sample, so their batch size must match
    the head's rows (2-D head inputs)."""
    if isinstance(act, (tuple, list)):
        act = act[0]
    if act.shape[0] != n:
        raise ValueError(f"layer {name!r} gave {act.shape[0]} rows but the head saw {n} samples "
                         "(layer profiles need one head row per sample: 2-D head inputs)")
    if act.ndim > 2:
        act = act.flatten(2).mean(dim=2)
    return act.reshape(n, -1)


def collect(model: Any, loader: Iterable, *, head: Any = None, device: Any = None, precision: Optional[str] = None,
            progress: bool = True, batch_fn: Optional[Callable] = None, tokens: TokensSpec = "all",
            desc: str = "richness", allow_empty: bool = False,
            layers: Optional[Sequence] = None, shift_labels: bool = False) -> Tuple[Moments, Any]:
    """One pass over ``loader``: ``(Moments, head module)``. With an ``nn.Linear``
    head only features (and labels) are streamed: DLR then uses the head's
    weights (SPEC.md linear-head shortcut); other heads stream their outputs.
    With ``layers``, the second item is ``(head module, {name: Moments})``: each
    listed layer's activations streamed against the model's outputs."""
    torch = require_torch("richness.evaluate")
    check_tokens(tokens)
    resolved = resolve_head(model, head)
    dev = torch.device(device) if device is not None else _model_device(model)
    total = None
    ds = getattr(loader, "dataset", None)
    if ds is not None:
        try:
            total = len(ds)
        except TypeError:
            total = None
    bar = None
    if progress:
        bar = require_tqdm("richness.evaluate")(total=total, unit="sample", unit_scale=True, desc=desc,
                                                 dynamic_ncols=True, leave=False)
    moments = Moments(precision=precision)
    named_layers = resolve_layers(model, layers)
    layer_moments = {name: Moments(precision=precision) for name, _ in named_layers}
    layer_caps = [(name, Capture(mod)) for name, mod in named_layers]
    finder = capture = None
    head_mod = None
    with_labels: Optional[bool] = None
    try:
        with torch.no_grad(), eval_mode(model), BlasThreads() as threads:
            if resolved is not None:
                head_mod = resolved[1]
                capture = Capture(head_mod)
            else:
                finder = HeadFinder(model)
            for batch in loader:
                inputs, labels, amask = split_batch(batch, batch_fn)
                inputs = to_device(inputs, dev)
                out = call_model(model, inputs)
                if finder is not None:
                    name, head_mod, x, y = finder.result(out)
                    finder.remove()
                    finder = None
                    capture = Capture(head_mod)
                    if x is None:  # the head ran before another Linear: run the batch again
                        call_model(model, inputs)
                        x, y = capture.take()
                else:
                    x, y = capture.take()
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
                for name, cap in layer_caps:
                    act = layer_rows(cap.take()[1], feats.shape[0], name)
                    layer_moments[name].update(act, outs, **lk)
                del feats, outs, lk
                if bar is not None:
                    bar.update(batch_size_of(inputs))
    finally:
        for _, cap in layer_caps:
            cap.remove()
        if finder is not None:
            finder.remove()
        if capture is not None:
            capture.remove()
        if bar is not None:
            bar.close()
    if moments.n == 0 and not allow_empty:
        raise ValueError("the loader yielded no samples")
    if named_layers:
        return moments, (head_mod, layer_moments)
    return moments, head_mod


def evaluate(model: Any, loader: Iterable, *, head: Any = None, test_loader: Optional[Iterable] = None,
             device: Any = None, precision: Optional[str] = None, progress: bool = True,
             batch_fn: Optional[Callable] = None, tokens: TokensSpec = "all", distributed: bool = False,
             rtol: Optional[float] = None, layers: Optional[Sequence] = None, shift_labels: bool = False) -> Report:
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
            (In ``Moments.compute``, ``head`` means weights instead.)
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
            gets the global report.
        rtol: eigenvalue cut (default by precision, SPEC.md).
        layers: modules (dotted names or submodules) whose activations are also
            measured, in the same pass, against the span of the model's outputs:
            ``report.layers`` maps each name to its Report (DLR by depth; the
            paper reports the strongest low-rank bias at the last layer).
            Feature maps (batch, C, H, W) are averaged over positions.

    Runs under ``torch.no_grad()``; hooks are removed on exit, also after an
    exception; the core's BLAS uses at most ``torch.get_num_threads()``
    threads (one for small batches; see ``BlasThreads``).
    """
    moments, head_mod = collect(model, loader, head=head, device=device, precision=precision, progress=progress,
                                batch_fn=batch_fn, tokens=tokens, allow_empty=distributed, layers=layers,
                                shift_labels=shift_labels)
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
    report = moments.compute(head=w, test=test, rtol=rtol)
    if layers:
        report.layers = {name: lm.compute(rtol=rtol) for name, lm in layer_moments.items()}
    log.info("evaluate: %d samples, head %s, DLR %s", report.n, type(head_mod).__name__,
             "n/a" if report.dlr is None else f"{report.dlr:.4f}")
    # a returned report's caveats are easy to miss: also through warnings (RichnessWarning)
    for msg in report.warnings:
        warnings.warn(msg, RichnessWarning, stacklevel=2)
    return report


def _warn(msg: str) -> None:
    warnings.warn(msg, stacklevel=3)
