"""What the Monitor's hooks capture, and the step buffers that hold it until it is reduced."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional

from ..torch.batches import label_kwargs, select_rows
from ..torch.hooks import ModelHook, pooled_rows

__all__ = []


def grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()


class TrainingCapture:
    """What the Monitor's ``HeadHook`` (``torch/hooks.py``) calls with each
    forward of its head: a forward run with gradients enabled (training;
    validation under ``no_grad`` is skipped) tells the Monitor that the head
    ran (``Monitor._head_ran``), and during window steps
    (``Monitor.capturing``) its head input and output, detached, go to
    ``Monitor._record_head_output``, which ties them to the model forward that
    made them until ``Monitor.step`` consumes them. ``rows``: what is
    recorded of a layer's output instead (its pooled rows; no outputs)."""

    def __init__(self, mon: Any, rows: Optional[Callable[[Any], Any]] = None) -> None:
        self.mon, self.rows = mon, rows

    def __call__(self, x: Any, y: Any) -> None:
        if not grad_enabled():
            return
        mon = self.mon
        mon._head_ran()
        if not mon.capturing:
            return
        if self.rows is not None:
            mon._record_head_output(self.rows(y), None)
        elif x is not None:
            mon._record_head_output(x.detach(), y.detach() if hasattr(y, "detach") else y)


class ModelForwards:
    """Hooks on the model that tie the head's captures to the model forward
    that made them: captures made while the model's forward runs are kept
    (``commit``) only when that forward returns, so a forward that raises after
    the head ran (a failing check or loss inside ``forward``, an out-of-memory
    error) leaves nothing in the step. The head called outside the model's
    forward (training code calling submodules itself) commits at once."""

    def __init__(self, model: Any, commit: Callable[[list], None]) -> None:
        self.commit = commit
        self.frames: List[list] = []  # one per model forward in progress: [returned, captures]
        # The "returned" hook runs only when the forward returned; the
        # always-called one after it, returned or raised: it closes the frame.
        # ModelHook: a copied or unpickled model carries inert hooks.
        self.handles = [model.register_forward_pre_hook(ModelHook(self._begin)),
                        model.register_forward_hook(ModelHook(self._returned)),
                        model.register_forward_hook(ModelHook(self._end), always_call=True)]

    def add(self, capture: tuple) -> None:
        if self.frames:
            self.frames[-1][1].append(capture)
        else:
            self.commit([capture])

    def _begin(self, mod, args) -> None:
        self.frames.append([False, [], None])

    def _returned(self, mod, args, out) -> None:
        if self.frames:
            self.frames[-1][0] = True
            self.frames[-1][2] = out

    def _end(self, mod, args, out) -> None:
        if not self.frames:
            return
        returned, captures, out = self.frames.pop()
        if returned and captures and not self.frames:  # a head pooled after it ran: its rows at the pooled positions
            captures = [pooled_rows(x, y, out) for x, y in captures]
        if returned and captures:
            if self.frames:  # a forward nested in another: kept if the outer one returns too
                self.frames[-1][1].extend(captures)
            else:
                self.commit(captures)

    def clear(self) -> None:
        """Forget forwards still open (``step()`` runs between forwards: these
        raised where the always-called hook could not run)."""
        self.frames.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class StepBuffer:
    """Copies of the head's input, output and labels of consecutive steps, in
    preallocated buffers with a leading step axis (one copy per tensor and
    step; no reference to the activations is kept). Steps of one buffer have
    the same shapes, dtypes and device (``fits``); the buffers are reused
    after ``clear``. Their size is capped at ``BUDGET`` bytes."""

    BUDGET = 32 << 20

    def __init__(self, parts: Dict[str, Any], capacity: int) -> None:
        import torch

        per_step = sum(t.numel() * t.element_size() for t in parts.values())
        self.capacity = max(1, min(capacity, self.BUDGET // max(per_step, 1)))
        self.key = self._key(parts)
        self.bufs = {name: torch.empty((self.capacity,) + tuple(t.shape), dtype=t.dtype, device=t.device)
                     for name, t in parts.items()}
        self.metas: list = []  # one entry per buffered step

    @staticmethod
    def _key(parts: Dict[str, Any]) -> tuple:
        return tuple((name, tuple(t.shape), t.dtype, t.device) for name, t in parts.items())

    def fits(self, parts: Dict[str, Any]) -> bool:
        return len(self.metas) < self.capacity and self._key(parts) == self.key

    def add(self, parts: Dict[str, Any], meta: Any = None) -> None:
        j = len(self.metas)
        for name, t in parts.items():
            self.bufs[name][j].copy_(t)
        self.metas.append(meta)

    def rows(self) -> Dict[str, Any]:
        """The buffered steps as one batch: (steps x n, ...) views."""
        j = len(self.metas)
        return {name: b[:j].reshape((-1,) + tuple(b.shape[2:])) for name, b in self.bufs.items()}

    def clear(self) -> None:
        self.metas.clear()


def probe_batches(probe: Any) -> Iterable:
    import torch

    if isinstance(probe, torch.Tensor):
        return [(probe,)]
    if isinstance(probe, tuple) and len(probe) == 2 and isinstance(probe[0], torch.Tensor):
        return [probe]
    if hasattr(probe, "__iter__"):
        return probe
    raise TypeError(f"probe must be a tensor, an (inputs, labels) pair or a re-iterable loader, "
                    f"got {type(probe).__name__}")


def step_rows(pending: list, labels: Any, tokens: Any) -> tuple:
    """The rows of one step from the head's captures since the last step:
    ``(features, outputs, label keyword arguments, first, dropped)``. With
    labels, the step's captures are the latest forwards whose rows add up to
    the labels' rows: the ``first`` captures before them (``dropped`` samples)
    come from a forward whose step was never counted (a batch skipped after its
    forward). Labels that no run of latest forwards matches raise a ValueError
    naming both counts."""
    import torch

    if labels is not None and not isinstance(labels, torch.Tensor):
        labels = torch.as_tensor(labels)
    if labels is not None and labels.ndim == 0:
        raise ValueError("labels must hold one entry per sample, got a single value")
    rows = [select_rows(x, y, None, tokens=tokens) for x, y in pending]
    first = _first_capture(pending, rows, labels)
    dropped = sum(int(r[0].shape[0]) for r in rows[:first])
    rows = rows[first:]
    if len(rows) == 1:
        feats, outs, _ = rows[0]
    else:
        feats = torch.cat([r[0] for r in rows])
        outs = torch.cat([r[1] for r in rows]) if all(r[1] is not None for r in rows) else None
    if labels is not None and labels.ndim >= 2 and feats.shape[0] != labels.shape[0] and len(rows) == 1:
        # per-token labels of a sequence batch: follow the token selection
        x, y = pending[first]
        feats, outs, labels = select_rows(x, y, labels, tokens=tokens)
    return feats, outs, label_kwargs(labels, feats.shape[0], feats.device), first, dropped


def _first_capture(pending: list, rows: list, labels: Any) -> int:
    """Index of the first capture of this step (see ``step_rows``)."""
    if labels is None:
        return 0
    want, total = int(labels.shape[0]), 0
    for i in range(len(rows) - 1, -1, -1):
        x = pending[i][0]
        if i == len(rows) - 1 and labels.ndim >= 2 and x.ndim == 3 and int(x.shape[0]) == want:
            return i  # per-token labels of one sequence batch
        total += int(rows[i][0].shape[0])
        if total == want:
            return i
        if total > want:
            break
    sizes = [int(r[0].shape[0]) for r in rows]
    raise ValueError(f"labels have {want} rows, but the head's training forwards since the last step() gave "
                     f"{' + '.join(map(str, sizes))} rows, and no run of the latest of them adds up to {want}")
