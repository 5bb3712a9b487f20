"""``richness.transformers.RichnessCallback``: a ``richness.Monitor`` in a Hugging Face ``Trainer`` run.

Needs ``transformers`` (and ``accelerate``, which its ``Trainer`` needs):
``pip install transformers accelerate``.

The callback builds the Monitor on the Trainer's model when training starts
(the head found as ``richness.evaluate`` finds it, or named with ``head=``),
counts one Monitor step per optimizer step (the micro-batches of gradient
accumulation form its window), and logs every record with ``trainer.log``, so
the values reach every ``report_to`` backend (TensorBoard, W&B, MLflow, ...)
and ``trainer.state.log_history`` at the Trainer's ``global_step``.

Labels: a ``TrainerCallback`` is never shown the batch, so a forward pre-hook
on the model reads the ``labels`` keyword of each training forward (the name
in ``TrainingArguments.label_names`` when one is set): the labels the model
itself receives, whatever the collator or the process layout. With label
smoothing or ``compute_loss_func`` the Trainer keeps the labels out of the
model's call, and the records have no NC1.

Sequence heads (``(batch, tokens, features)`` inputs): the positions measured
are those with a label (not -100) and not padding (``attention_mask``).
Causal LMs follow Hugging Face's convention, ``labels = input_ids`` shifted
inside the model: position i is labelled with token i + 1 and the last
position is dropped (``shift_labels``, by default on for the model classes
the Trainer itself shifts for).
"""

from __future__ import annotations

import warnings
from typing import Any, List, Optional, Tuple

from ._optional import pip_extra

__all__ = ["RichnessCallback"]

try:
    from transformers import TrainerCallback
except ImportError as _e:
    raise ImportError(f"richness.transformers needs transformers: {pip_extra('transformers')} ({_e})") from None

from .torch.batches import UNSHIFTED, labels_are_inputs, next_token_labels
from .torch.hooks import ModelHook
from .monitor.monitor import Monitor
from .monitor.routes import Head, Route, Window
from .monitor.sinks import scalars


def is_causal_lm(model: Any) -> bool:
    """Whether the Trainer shifts this model's labels (its class is a causal LM; PEFT unwrapped)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return type(base).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def token_rows(labels: Any, attention_mask: Any, shift: bool) -> Tuple[Any, Any]:
    """``(row labels, positions)`` of one forward: per-sample labels pass through
    (positions None); per-token integer labels ``(b, T)`` keep the positions with a
    label (>= 0) that are not padding, shifted to the next token for a causal LM
    (positions a boolean ``(b, T)`` mask, labels 1-D in its order). Without labels
    the positions are the attention mask's (None when there is none)."""
    import torch

    if labels is None:
        return None, None if attention_mask is None else attention_mask.bool()
    per_token = (labels.ndim == 2 and not labels.is_floating_point()
                 and (attention_mask is None or tuple(attention_mask.shape) == tuple(labels.shape)))
    if not per_token:
        return labels, None
    if shift:
        nxt, keep = next_token_labels(labels, attention_mask)
        mask = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
        mask[:, :-1] = keep
        return nxt[keep], mask
    mask = labels >= 0
    if attention_mask is not None:
        mask = mask & attention_mask.to(labels.device).bool()
    return labels[mask], mask


class RichnessCallback(TrainerCallback):
    """DLR (and NC1) during ``Trainer.train()``, logged through the Trainer.

    Args:
        trainer: the ``transformers.Trainer`` (records go out through its
            ``log``: every ``report_to`` backend and ``state.log_history``);
            add the callback with ``trainer.add_callback(...)``.
        route: ``Window`` (default: ``Window()``) or ``EveryStep``, as for
            ``richness.Monitor`` (a ``Probe`` is not for the training
            forwards this callback reads). A ``lag`` left None is 1 here, so
            that each record is logged at its own step; a ``distributed``
            left None merges the ranks' windows at each emission when the
            Trainer runs on more than one process.
        head: the read-out module of the model, its dotted name or a ``Head``
            (default: the last ``nn.Linear`` whose output is the model's
            output, found on the first forward, as ``richness.evaluate``
            does). Its ``tokens`` are the callback's own: the positions
            follow the labels and the attention mask.
        layer: the features-only Monitor instead, as for ``richness.Monitor``.
        shift_labels: causal-LM labels (position i labelled with token i + 1).
            Default: for the model classes the Trainer shifts (its causal-LM
            mapping); False warns when the labels equal the input_ids.
        log: further Monitor sinks (paths, callables, writers, "wandb", "mlflow").
        precision, rtol: as for ``richness.Monitor``.
        prefix: logged names are ``f"{prefix}/dlr"``, ``/dlr_isotropic``,
            ``/dlr_normalized``, ``/nc1``, ``/effective_dim``, ``/rank``, ``/n``
            (and the ``measures`` asked for).

    ``monitor`` is the running ``Monitor`` (its ``history`` holds the records).
    """

    def __init__(self, trainer: Any, route: Optional[Route] = None, *, head: Any = None, layer: Any = None,
                 shift_labels: Optional[bool] = None, log: Any = None, precision: Optional[str] = None,
                 rtol: Optional[float] = None, prefix: str = "richness") -> None:
        super().__init__()
        if not hasattr(trainer, "log") or not hasattr(trainer, "add_callback"):
            raise TypeError(f"trainer must be the transformers.Trainer the callback is added to, got "
                            f"{type(trainer).__name__}")
        route = Window() if route is None else route
        if not isinstance(route, Window):
            raise TypeError(f"RichnessCallback reads the training forwards: route must be a Window or EveryStep, "
                            f"got {type(route).__name__}")
        if isinstance(head, Head) and not (isinstance(head.tokens, str) and head.tokens == "all"):
            raise TypeError("RichnessCallback sets the head's tokens itself (positions follow the labels and the "
                            "attention mask)")
        self.trainer, self.route, self.head, self.layer = trainer, route, head, layer
        self.shift_labels, self.prefix, self.sinks = shift_labels, prefix, log
        self.precision, self.rtol = precision, rtol
        self.monitor: Optional[Monitor] = None
        self._hook = None
        self._shift = False
        self._label_name: Optional[str] = "labels"
        self._forwards: List[Tuple[Any, Any]] = []
        self._positions: List[Any] = []
        self._checked = False

    def _to_trainer(self, rec: dict) -> None:
        values = scalars(rec, self.prefix)
        if values:
            self.trainer.log(values)

    def _on_forward(self, module: Any, args: Any, kwargs: dict) -> None:
        import torch

        if not torch.is_grad_enabled():  # evaluation and prediction loops: not training forwards
            return
        labels = kwargs.get(self._label_name) if self._label_name else None
        if not self._checked and labels is not None:
            self._checked = True
            if not self._shift and labels_are_inputs(kwargs, labels):
                warnings.warn(UNSHIFTED.format(fix="pass RichnessCallback(shift_labels=True)"), UserWarning,
                              stacklevel=2)
        self._forwards.append((labels, kwargs.get("attention_mask")))

    def _tokens(self, batch: Any) -> Any:
        # Monitor's token selection, asked once per captured forward in order
        return self._positions.pop(0) if self._positions else None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._shift = is_causal_lm(model) if self.shift_labels is None else bool(self.shift_labels)
        names = list(args.label_names or ["labels"])
        self._label_name = names[0] if len(names) == 1 else None  # NC1 needs one class label per row
        route = self.route
        if route.lag is None:
            route = route.replace(lag=1)
        if route.distributed is None:
            route = route.replace(distributed=args.world_size > 1)
        head = self.head  # with layer=: refused by the Monitor where given
        if self.layer is None:  # the head's positions: the callback's own (``_tokens``)
            head = (self.head if isinstance(self.head, Head) else Head(self.head)).replace(tokens=self._tokens)
        # records carry the Trainer's global_step after their optimizer step (as its own loss logs do)
        self.monitor = Monitor(model, route, head=head, layer=self.layer, log=[self._to_trainer, self.sinks],
                               precision=self.precision, rtol=self.rtol, prefix=self.prefix,
                               first_step=state.global_step + 1)
        # a ModelHook: a deep-copied or saved model carries an inert hook, not this callback
        self._hook = model.register_forward_pre_hook(ModelHook(self._on_forward), with_kwargs=True)
        self._forwards, self._positions, self._checked = [], [], False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is None:
            return
        forwards, self._forwards = self._forwards, []
        if not self.monitor.capturing:  # this step's forwards were not captured: no labels needed (no sync)
            self.monitor.step()
            return
        rows = [token_rows(labels, mask, self._shift) for labels, mask in forwards]
        self._positions = [pos for _, pos in rows]
        labels = [lab for lab, _ in rows]
        if not labels or any(lab is None for lab in labels):
            y = None
        elif len(labels) == 1:
            y = labels[0]
        else:
            import torch

            y = torch.cat(labels)
        try:
            self.monitor.step(labels=y)
        finally:
            self._positions = []

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.monitor is not None:
            self.monitor.close()  # emits records still queued
