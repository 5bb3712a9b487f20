"""Finding and hooking the head and the profiled layers of a torch model.

The head is the module whose input are the features ``phi(x)`` and whose
output are the logits ``f(x)``: named by the caller (``resolve_head``) or
found in one forward pass (``HeadFinder``). ``HeadHook`` is the one hook on a
head (or on any module named as one): it hands each forward's input and
output to a function, on the module given or on the head found in the
model's first forward. ``Latest`` keeps the latest pair; ``resolve_layers``
names the layers profiled by depth. Shared by ``richness.evaluate``,
``richness.Monitor`` and the torchmetrics ``DLR``.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

from .._optional import require_torch

__all__ = ["HeadHook"]


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
                    "(weights go to Moments.compute(head_weights=...), not here)")


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
    res: list = []
    for v in vals:
        res.extend(output_tensors(v) if not isinstance(v, torch.Tensor) else [v])
    return res


def pooled_rows(x: Any, y: Any, model_out: Any) -> Tuple[Any, Any]:
    """A head applied to every position and pooled afterwards (Hugging Face's
    ``*ForSequenceClassification`` decoders: GPT-2's ``score`` on each token,
    the model's logits taken at the last non-padding one): the head's input
    ``x`` (b, T, p) and output ``y`` (b, T, C) at the positions the model
    pooled, found as the position of each row whose head output the model
    returned, exactly (the last one where several agree). ``(x, y)``
    unchanged when the model returned no (b, C) tensor that is such a
    selection of ``y``. One host synchronisation (the check)."""
    import torch

    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.ndim == 3 and y.ndim == 3):
        return x, y
    b, T, C = y.shape
    for t in output_tensors(model_out):
        if t.ndim != 2 or tuple(t.shape) != (b, C) or t.dtype != y.dtype:
            continue
        same = (y == t.to(y.device)[:, None, :]).all(dim=2)  # (b, T)
        pos = torch.arange(T, device=y.device).expand(b, T)
        idx = torch.where(same, pos, torch.full_like(pos, -1)).amax(dim=1)
        if bool((idx >= 0).all()):
            rows = torch.arange(b, device=y.device)
            return x[rows, idx.to(x.device)], y[rows, idx]
    return x, y


class ModelHook:
    """A forward hook that richness puts on a user's model, calling ``fn``.

    Models are deep-copied (EMA, SWA) and pickled whole (``torch.save``) with
    the hooks in their modules' dicts. A copy or an unpickled copy of this
    hook calls nothing: a copied model's forwards never reach the original's
    monitor or metric, and what ``fn`` holds (a Monitor, its sinks) is never
    copied or pickled."""

    __slots__ = ("fn",)

    def __init__(self, fn: Optional[Callable] = None) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> None:  # (mod, args[, out or kwargs]): pre-hooks and forward hooks
        if self.fn is not None:
            self.fn(*args)

    def __copy__(self) -> "ModelHook":
        return ModelHook()

    def __deepcopy__(self, memo: dict) -> "ModelHook":
        # ``fn.copied(memo)``: what the copy of the module this hook sits on
        # should call instead (a metric copied by the same deep copy follows
        # its own head); inert otherwise
        copied = getattr(self.fn, "copied", None)
        return ModelHook(copied(memo) if copied is not None else None)

    def __reduce__(self) -> tuple:
        return (ModelHook, ())


def hook_forward(module: Any, fn: Callable) -> Any:
    """Register ``fn`` as a forward hook of ``module`` (a ``ModelHook``); returns the handle."""
    return module.register_forward_hook(ModelHook(fn))


class HeadFinder:
    """Hooks on every ``nn.Linear`` for one forward pass; afterwards names the
    last one whose output object is (one of) the model's output(s), or else
    the last one called when the model's output is that Linear's output at one
    position of each sequence (a head pooled after it ran, ``pooled_rows``).

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
                self.handles.append(hook_forward(mod, self._hook(name)))

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
        was not the last Linear called (the caller must run the batch again);
        a pooled head's input and output come at the pooled positions."""
        outs = output_tensors(model_out)
        found = [name for name, ref in self.calls if any(ref() is t for t in outs)]
        last, self.last, self.calls = self.last, None, []
        if not found and last is not None:
            pooled = pooled_rows(last[2], last[3], model_out)
            if pooled[1] is not last[3]:  # the last Linear, applied to every position, then pooled by the model
                name = last[0]
                return name, dict(self.model.named_modules())[name], pooled[0], pooled[1]
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


class _OnForward:
    """What a ``HeadHook`` registers (inside a ``ModelHook``): each forward's
    first positional input (None when there is none) and output, to ``fn``.
    A deep copy of the module follows ``fn.copied(memo)`` where ``fn`` has it
    (``ModelHook.__deepcopy__``), else calls nothing."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[Any, Any], None]) -> None:
        self.fn = fn

    def __call__(self, mod: Any, args: tuple, out: Any) -> None:
        self.fn(args[0] if args else None, out)

    def copied(self, memo: dict) -> "Optional[_OnForward]":
        follow = getattr(self.fn, "copied", None)
        fn = follow(memo) if follow is not None else None
        return None if fn is None else _OnForward(fn)


class HeadHook:
    """The forwards of a model's head, each handed to ``fn(inputs, output)``:
    the head's first positional input (the features; None when it has none)
    and its output.

    On ``head``, the module given (the head, or any module named as one: the
    Monitor's layer, evaluate's profiled layers). Without one, the head is
    found in ``model``'s first forward (``HeadFinder``: hooks on every
    ``nn.Linear`` for that forward only), ``found(name, module)`` is told,
    the head is hooked from then on, and that forward's pair goes to ``fn``
    when the head was the last Linear called (at the pooled positions of a
    head pooled after it ran); else the caller runs the batch again if it
    needs it. A model whose head cannot be found raises the finder's
    ValueError from that forward.

    ``module`` is the head (None until found), ``name`` the name it was
    found under (None when given). Every hook is
    a ``ModelHook``: a copied or saved model carries inert ones (a deep copy
    asks ``fn.copied(memo)``, where ``fn`` has it, what its copy calls)."""

    def __init__(self, fn: Callable[[Any, Any], None], head: Any = None, *, model: Any = None,
                 found: Optional[Callable[[str, Any], None]] = None) -> None:
        self.fn, self.found = fn, found
        self.name: Optional[str] = None
        self.module = head
        self.handles: List[Any] = []
        self.finder: Optional[HeadFinder] = None
        if head is not None:
            self._hook_head()
        else:
            self.finder = HeadFinder(model)
            self.handles.append(hook_forward(model, self._on_model_output))

    def _hook_head(self) -> None:
        self.handles.append(hook_forward(self.module, _OnForward(self.fn)))

    def _on_model_output(self, mod: Any, args: Any, out: Any) -> None:
        finder = self.finder
        if finder is None:
            return
        try:
            name, module, x, y = finder.result(out)
        finally:
            self.remove()
        self.name, self.module = name, module
        if self.found is not None:
            self.found(name, module)
        self._hook_head()
        if x is not None:
            self.fn(x, y)

    def remove(self) -> None:
        """Remove every hook (the finder's too)."""
        if self.finder is not None:
            self.finder.remove()
            self.finder = None
        for h in self.handles:
            h.remove()
        self.handles = []


class Latest:
    """The latest ``(inputs, output)`` pair handed to it (a ``HeadHook``'s
    function), until taken."""

    def __init__(self) -> None:
        self.pair: Tuple[Any, Any] = (None, None)

    def __call__(self, x: Any, y: Any) -> None:
        self.pair = (x, y)

    def take(self) -> Tuple[Any, Any]:
        pair, self.pair = self.pair, (None, None)
        return pair


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
