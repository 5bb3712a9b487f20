"""Rows from a loader's batches: splitting a batch into inputs, labels and
padding mask, calling the model, selecting token positions of sequence
models (``tokens``), shifting causal-LM labels (``shift_labels``), labels as
``Moments.update`` keyword arguments, and layer activations as one row per
sample. Shared by ``richness.evaluate`` and ``richness.Monitor``.
"""

from __future__ import annotations

from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = []


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
        raise TypeError("tokens must be 'all', 'last', a boolean mask tensor or a callable, "
                        f"got {type(tokens).__name__}")
    elif isinstance(tokens, torch.Tensor) and tokens.dtype != torch.bool:
        raise TypeError(f"a tokens mask must be a boolean tensor, got dtype {tokens.dtype}")


def refuse_scalar_labels(labels: Any, n: int) -> None:
    """ValueError for a single label (shape ()) given with a batch: it cannot be matched to rows."""
    if getattr(labels, "ndim", None) == 0:
        raise ValueError(f"the labels are one value (shape ()) but the head saw {n} samples: give one label per "
                         "sample (a batch of labels)")


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
    refuse_scalar_labels(labels, feats.shape[0] if feats.ndim > 1 else 1)
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
            raise ValueError(f"tokens mask has shape {tuple(mask.shape)}, "
                             f"the head input has (batch, tokens) = {(b, T)}")
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
        if mask is not None:  # a sequence with no position kept (all padding) is no sample
            keep = mask.any(dim=1)  # boolean indexing below: a device sync on CUDA (documented)
            f2 = f2[keep]
            o2 = o2[keep] if o2 is not None and o2.shape[:1] == (b,) else o2
            labels = labels.to(keep.device)[keep] if labels is not None else None
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
    nxt, keep = next_token_labels(labels.to(feats.device), attention_mask)
    o = outs[:, :-1] if isinstance(outs, torch.Tensor) and outs.ndim == 3 else outs
    if isinstance(tokens, torch.Tensor) and tokens.ndim >= 1 and tokens.shape[-1] == T:
        tokens = tokens[..., :-1]
    elif callable(tokens) and not isinstance(tokens, (str, torch.Tensor)):
        user_tokens = tokens

        def tokens(batch, _f=user_tokens):
            mask = _f(batch)
            return mask[..., :-1] if mask.shape[-1] == T else mask
    return feats[:, :-1], o, nxt, keep, tokens


def next_token_labels(labels: Any, attention_mask: Any = None) -> Tuple[Any, Any]:
    """``(labels[:, 1:], keep)`` of causal-LM labels ``(b, T)``: position i's class is
    token i + 1; ``keep`` (b, T - 1) drops negative labels (HF's ignore index -100) and
    positions where this or the next token is padding (``attention_mask``)."""
    nxt = labels[:, 1:]
    keep = nxt >= 0
    if attention_mask is not None and tuple(attention_mask.shape) == tuple(labels.shape):
        pad = attention_mask.to(labels.device).bool()
        keep = keep & pad[:, :-1] & pad[:, 1:]
    return nxt, keep


def labels_are_inputs(inputs: Any, labels: Any) -> bool:
    """Whether per-token labels are the ``input_ids`` themselves: a causal LM's labels
    in Hugging Face's convention, shifted inside the model (so used unshifted, position
    i would be labelled with its own token)."""
    import torch

    ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
    return (isinstance(labels, torch.Tensor) and isinstance(ids, torch.Tensor) and labels.ndim == 2
            and labels.shape == ids.shape and bool(torch.equal(labels.to(ids.device), ids)))


UNSHIFTED = ("the labels equal the input_ids (a causal LM's labels, which the model shifts inside): used "
             "unshifted, each position is labelled with its own token; {fix}")


def label_kwargs(labels: Any, n: int, device: Any) -> dict:
    """``{"labels": y}`` for integers, ``{"targets": t}`` for floats, ``{}`` for None."""
    import torch

    if labels is None:
        return {}
    if not isinstance(labels, torch.Tensor):
        labels = torch.as_tensor(labels)
    refuse_scalar_labels(labels, n)
    if labels.shape[0] != n:
        raise ValueError(f"labels have {labels.shape[0]} rows but the head saw {n} samples")
    labels = labels.to(device, non_blocking=True)
    if labels.is_floating_point():
        return {"targets": labels}
    if labels.ndim != 1:
        raise ValueError(f"integer labels must be 1-D (one class per sample), got shape {tuple(labels.shape)}")
    return {"labels": labels}


# Pooling policies of a layer's output into one row per sample (``pool_rows``).
POOLS = ("mean", "flatten", "first", "last")

# ``pool="flatten"`` past this many columns is refused: a similarity state over
# k such layers holds a float64 (sum of widths)^2 matrix (8 GiB at 32,768).
FLATTEN_LIMIT = 16_384

# How a layer's output of three or more dimensions is laid out: where its
# channels (the width of a row) are and where its positions (pixels, time
# steps, tokens) are. "sequence" is torch's (tokens, batch, width) of modules
# built with batch_first=False; callers name only the first two.
LAYOUTS = ("tokens", "channels")
_SHAPES = {"tokens": "(batch, tokens, width)", "channels": "(batch, channels, *positions)",
           "sequence": "(tokens, batch, width) (batch_first=False)"}
_SAME = "same"  # elementwise modules: the output is laid out as their input


def _module_types() -> Tuple[tuple, tuple, tuple]:
    """(channels-first, channels-last, layout-preserving) module classes of torch.nn."""
    import inspect

    import torch.nn as nn

    mods = nn.modules

    def named(module: Any, *names: str) -> list:
        return [c for c in (getattr(module, n, None) for n in names) if c is not None]

    channels = tuple(
        named(mods.conv, "_ConvNd")  # Conv1d/2d/3d, ConvTranspose*, the Lazy ones
        + named(mods.batchnorm, "_BatchNorm")  # BatchNorm1d on (N, C, L), SyncBatchNorm
        + named(mods.instancenorm, "_InstanceNorm")
        + named(nn, "GroupNorm", "LocalResponseNorm", "CrossMapLRN2d", "Upsample", "PixelShuffle",
                "PixelUnshuffle", "ChannelShuffle", "Fold", "Unfold", "FractionalMaxPool2d", "FractionalMaxPool3d")
        + named(mods.pooling, "_MaxPoolNd", "_AvgPoolNd", "_AdaptiveAvgPoolNd", "_AdaptiveMaxPoolNd", "_LPPoolNd",
                "_MaxUnpoolNd")
        + named(mods.padding, "_ConstantPadNd", "_ReflectionPadNd", "_ReplicationPadNd", "_CircularPadNd"))
    tokens = tuple(named(nn, "Linear", "Bilinear", "Embedding", "EmbeddingBag", "LayerNorm", "RMSNorm"))
    same = tuple([c for c in vars(mods.activation).values()
                  if inspect.isclass(c) and issubclass(c, nn.Module) and c.__module__ == mods.activation.__name__
                  and c is not nn.MultiheadAttention]
                 + named(mods.dropout, "_DropoutNd") + [nn.Identity])
    return channels, tokens, same


_TYPES: Optional[Tuple[tuple, tuple, tuple]] = None


def _batch_first(module: Any) -> Optional[bool]:
    """``batch_first`` of torch's attention, recurrent and transformer modules (None for others)."""
    import torch.nn as nn

    if isinstance(module, (nn.MultiheadAttention, nn.RNNBase, nn.Transformer)):
        return bool(module.batch_first)
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return bool(module.self_attn.batch_first)
    if isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)):
        return bool(module.layers[0].self_attn.batch_first) if len(module.layers) else None
    return None


def _own_layout(module: Any) -> Optional[str]:
    global _TYPES
    if _chains(module):  # its output is its last child's that says
        for child in reversed(list(module)):
            kind = _own_layout(child)
            if kind != _SAME:
                return kind
        return _SAME
    first = _batch_first(module)
    if first is not None:
        return "tokens" if first else "sequence"
    if _TYPES is None:
        _TYPES = _module_types()
    channels, tokens, same = _TYPES
    if isinstance(module, channels):
        return "channels"
    if isinstance(module, tokens):
        return "tokens"
    if isinstance(module, same):
        return _SAME
    return None


def _chains(module: Any) -> bool:
    """Whether ``module`` is an ``nn.Sequential`` that runs its children in a chain (its forward not overridden)."""
    import torch.nn as nn

    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def _input_layout(model: Any, name: str, module: Any) -> Optional[str]:
    """The layout of what ``module`` (``model``'s submodule ``name``) is given,
    where a chaining ``nn.Sequential`` says: its previous child's output, or
    the Sequential's own input."""
    parent_name, _, child = name.rpartition(".")
    try:
        parent = model.get_submodule(parent_name)
    except AttributeError:
        return None
    if not _chains(parent) or parent._modules.get(child) is not module:
        return None
    children = list(parent._modules.items())
    at = [k for k, _ in children].index(child)
    for _, sibling in reversed(children[:at]):
        kind = _own_layout(sibling)
        if kind != _SAME:
            return kind
    return _input_layout(model, parent_name, parent) if parent_name else None


def module_layout(module: Any, model: Any = None, name: Optional[str] = None) -> Optional[str]:
    """How ``module`` lays out an output of three or more dimensions, or None
    where the module does not say (a custom module, an elementwise one).

    ``"channels"`` (N, C, *positions): convolutions and transposed ones,
    batch, instance and group normalisation, pooling, padding, upsampling.
    ``"tokens"`` (N, *positions, D): Linear, Embedding, LayerNorm, RMSNorm, and
    torch's attention, recurrent and transformer modules built with
    ``batch_first=True``; ``"sequence"`` (T, N, D) those built without it.
    An ``nn.Sequential`` is laid out as its last child that says; activations,
    dropout and Identity keep their input's layout, which ``model`` tells
    where the module (its submodule ``name``) follows others in an
    ``nn.Sequential``."""
    kind = _own_layout(module)
    if kind == _SAME:
        kind = _input_layout(model, name, module) if model is not None and name else None
    return None if kind == _SAME else kind


def check_layout(layout: Any, what: str = "layout") -> None:
    """ValueError unless ``layout`` is None or one of ``LAYOUTS``."""
    if layout is not None and (not isinstance(layout, str) or layout not in LAYOUTS):
        raise ValueError(f"{what} must be one of {LAYOUTS} or None, got {layout!r}")


def layer_layouts(layout: Any, keys: Sequence[Sequence[str]], caller: str) -> List[Optional[str]]:
    """The layout given for each layer: ``layout`` is None (the modules
    decide), one of ``LAYOUTS`` for every layer, or a mapping from a layer's
    name (any of its ``keys``) to one. A name that is no layer's, or a
    layer named twice, is a ValueError."""
    if layout is None or isinstance(layout, str):
        check_layout(layout)
        return [layout] * len(keys)
    if not isinstance(layout, Mapping):
        raise TypeError(f"{caller}: layout must be {LAYOUTS[0]!r}, {LAYOUTS[1]!r}, None or a dict layer -> layout, "
                        f"got {type(layout).__name__}")
    out: List[Optional[str]] = []
    used: List[Any] = []
    for ks in keys:
        hits = [k for k in ks if k in layout]
        if len(hits) > 1:
            raise ValueError(f"{caller}: layout names one layer twice: {hits}")
        value = layout[hits[0]] if hits else None
        check_layout(value, f"{caller}: layout[{hits[0]!r}]" if hits else "layout")
        out.append(value)
        used.extend(hits)
    unknown = [k for k in layout if k not in used]
    if unknown:
        names = [ks[0] for ks in keys]
        raise ValueError(f"{caller}: layout names {unknown}, which are not among the layers {names}")
    return out


def layer_pooler(name: str, module: Any, pool: str, layout: Optional[str] = None, *, model: Any = None,
                 path: Optional[str] = None, limit: Optional[int] = FLATTEN_LIMIT) -> Callable[..., Any]:
    """``rows(output, n=None)``: ``pool_rows`` of ``module``'s output in the
    layout its module decides (``module_layout``, ``module`` being ``model``'s
    submodule ``path``, by default ``name``), else in ``layout`` (what the
    caller gave for this layer); a layout given that contradicts the
    module's is a ValueError here, as is an unknown ``pool``. ``limit``: as
    ``pool_rows``."""
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    check_layout(layout)
    kind = module_layout(module, model, name if path is None else path)
    source = type(module).__name__
    if layout is not None and kind is not None and layout != kind:
        raise ValueError(f"layout={layout!r} for layer {name!r}, but its module ({source}) gives "
                         f"{_SHAPES[kind]}: drop the layout for that layer")
    resolved = kind if kind is not None else layout

    def rows(act: Any, n: Optional[int] = None) -> Any:
        return pool_rows(act, name, pool, n, layout=resolved, source=source, limit=limit)
    return rows


def pool_rows(act: Any, name: str, pool: str = "mean", n: Optional[int] = None, *, layout: Optional[str] = None,
              source: str = "", limit: Optional[int] = FLATTEN_LIMIT) -> Any:
    """A layer's output as one row per sample.

    2-D outputs are rows already. Outputs of three or more dimensions are read
    in ``layout``: ``"channels"`` (N, C, *positions: a convolution's map,
    whatever the memory format), ``"tokens"`` (N, *positions, D: a sequence of
    tokens), ``"sequence"`` (T, N, D: torch's batch_first=False), or None
    (the module does not say): 4-D and wider outputs are then read as
    channels first (torchvision / timm), and a 3-D one, which is either, is a
    ValueError asking for the layout (except with ``"flatten"``, which needs
    none). ``layer_pooler`` gives the layout from the module. A tuple or list
    (Hugging Face blocks return ``(hidden, ...)``, ``nn.MultiheadAttention``
    ``(output, weights)``) gives its first tensor.

    ``pool``: ``"mean"`` averages over the positions (the width is C or D);
    ``"flatten"`` keeps every value (refused past ``limit`` columns,
    ``FLATTEN_LIMIT`` by default, the message giving the memory a covariance
    of that width would need; None: any width, for a state that holds no
    covariance); ``"first"`` / ``"last"``
    take the first / last position of a 3-D output (a ViT's class token, a
    causal model's last position). ``n``: the rows expected (the batch size),
    checked when given. ``source`` names the module in messages."""
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    if layout is not None and layout not in _SHAPES:
        raise ValueError(f"layout must be one of {LAYOUTS} or None, got {layout!r}")
    what = f"layer {name!r}"
    which = what + (f" ({source})" if source else "")
    if isinstance(act, (tuple, list)):
        if not act:
            raise ValueError(f"{what} returned an empty {type(act).__name__}, not a tensor")
        act = act[0]
    if not hasattr(act, "ndim") or not hasattr(act, "shape"):
        raise ValueError(f"{what} returned a {type(act).__name__}, not a tensor")
    if act.ndim < 2:
        raise ValueError(f"{what} gave shape {tuple(act.shape)}: need (batch, width), "
                         "(batch, tokens, width) or (batch, channels, *spatial)")
    if layout == "sequence" and act.ndim == 3:
        act, layout = act.transpose(0, 1), "tokens"
    if n is not None and act.shape[0] != n:
        raise ValueError(f"{what} gave {act.shape[0]} rows but the batch has {n} samples")
    rows = act.shape[0]
    if pool == "flatten" and act.ndim > 2:
        width = 1
        for s in act.shape[1:]:
            width *= int(s)
        if limit is not None and width > limit:
            raise ValueError(f"pool='flatten' gives {which} {width:,} columns (shape {tuple(act.shape)}), past the "
                             f"limit of {limit:,}: flattened, its float64 covariance alone would need "
                             f"{8 * width * width / 2**30:,.1f} GiB; pool='mean' averages it over its positions "
                             "instead (a smaller, different representation)")
        return act.reshape(rows, width)
    if act.ndim == 2:  # rows already (whatever the pool)
        if pool in ("first", "last"):
            raise ValueError(f"pool={pool!r} takes a position of a 3-D output; {what} gave shape "
                             f"{tuple(act.shape)} (rows already)")
        return act
    if layout is None:
        if act.ndim == 3:
            raise ValueError(f"{which} gave a 3-D output of shape {tuple(act.shape)}, either (batch, tokens, width) "
                             "or (batch, channels, positions), and its module does not say which: pass "
                             f"layout='tokens' or layout='channels' (or layout={{{name!r}: ...}} for this layer "
                             "alone)")
        layout = "channels"
    if pool in ("first", "last"):
        if act.ndim != 3:
            raise ValueError(f"pool={pool!r} takes a position of a 3-D output (batch, tokens, width) or (batch, "
                             f"channels, positions); {what} gave shape {tuple(act.shape)}")
        at = 0 if pool == "first" else -1
        return act[:, at, :] if layout == "tokens" else act[:, :, at]
    if layout == "tokens":
        return act.mean(dim=1) if act.ndim == 3 else act.flatten(1, -2).mean(dim=1)
    return act.flatten(2).mean(dim=2)


def layer_rows(act: Any, n: int, name: str, pooler: Optional[Callable[..., Any]] = None) -> Any:
    """A layer's output as one row per sample for ``evaluate(layers=...)``:
    ``pooler(act)`` (``layer_pooler`` with ``"mean"``: feature maps over
    positions, sequences over tokens), else ``pool_rows`` with ``"mean"``.
    Layers are profiled per sample, so their rows must match the head's
    (2-D head inputs)."""
    rows = pooler(act) if pooler is not None else pool_rows(act, name, "mean")
    if rows.shape[0] != n:
        raise ValueError(f"layer {name!r} gave {rows.shape[0]} rows but the head saw {n} samples "
                         "(layer profiles need one head row per sample: 2-D head inputs)")
    return rows
