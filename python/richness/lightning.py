"""``richness.lightning.RichnessCallback``: a ``richness.Monitor`` in a Lightning run.

Needs ``lightning`` (or the older ``pytorch_lightning``): ``pip install "richness[lightning]"``.

The callback builds the Monitor on the LightningModule when training starts,
counts one Monitor step per optimizer step (gradient accumulation: the
micro-batches of a step form its window), and sends every record to the
trainer's loggers (``log_metrics``) at the step Lightning logs that batch at.

Steps: the Monitor counts optimizer steps from 1; Lightning's ``global_step``
is the number of steps done, so a batch is logged at the 0-based step it
started from. The callback starts the Monitor at ``first_step =
trainer.global_step``, so the record of a batch lands at the same step as the
values ``self.log`` gives for it in ``training_step`` (resumed runs included).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

from ._optional import pip_extra

__all__ = ["RichnessCallback", "pair_labels"]

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - the older package name
    try:
        from pytorch_lightning.callbacks import Callback  # type: ignore[assignment,unused-ignore]
    except ImportError as _e:
        raise ImportError(f"richness.lightning needs Lightning: {pip_extra('lightning')} "
                          f"(or pytorch_lightning) ({_e})") from None

from .monitor.monitor import Monitor
from .monitor.routes import Route, Window
from .monitor.sinks import scalars


def pair_labels(batch: Any) -> Any:
    """The labels of an ``(inputs, labels, ...)`` batch: its second entry when
    that is a tensor, else None."""
    import torch

    if isinstance(batch, (tuple, list)) and len(batch) >= 2 and isinstance(batch[1], torch.Tensor):
        return batch[1]
    return None


class RichnessCallback(Callback):
    """DLR (and NC1) during ``trainer.fit``, logged to the trainer's loggers.

    Args:
        route: which batches make a record, and when: ``Window`` (default),
            ``EveryStep`` or ``Probe``, as for ``richness.Monitor``. A route
            whose ``distributed`` is None merges the ranks' windows at each
            emission when the trainer runs on more than one process.
        head: the read-out module of the LightningModule, its dotted name or
            a ``Head`` (default: found on the module's first forward; see
            ``Monitor``). The Monitor warns once if it has not run after
            ``every`` steps.
        layer: the features-only Monitor instead (a module, its dotted name
            or a ``Layer``), as for ``richness.Monitor``.
        labels: batch -> labels (integer classes or float targets) of a
            training batch, or None for no labels. Default: the second entry
            of an ``(inputs, labels)`` batch.
        log: further Monitor sinks (paths, callables, writers).
        precision, rtol: as for ``richness.Monitor``.
        prefix: logged names are ``f"{prefix}/dlr"``, ``/dlr_isotropic``,
            ``/dlr_normalized``, ``/nc1``, ``/effective_dim``, ``/rank``, ``/n``
            (and the ``measures`` asked for).

    ``monitor`` is the running ``Monitor`` (its ``history`` holds the records).
    """

    def __init__(self, route: Optional[Route] = None, *, head: Any = None, layer: Any = None,
                 labels: Optional[Callable[[Any], Any]] = pair_labels, log: Any = None,
                 precision: Optional[str] = None, rtol: Optional[float] = None, prefix: str = "richness") -> None:
        super().__init__()
        if route is not None and not isinstance(route, Route):
            raise TypeError(f"route must be a Window, EveryStep or Probe, got {type(route).__name__}")
        if labels is not None and not callable(labels):
            raise TypeError(f"labels must be a callable (batch -> labels) or None, got {type(labels).__name__}")
        self.route = Window() if route is None else route
        self.head, self.layer, self.labels, self.prefix = head, layer, labels, prefix
        self.precision, self.rtol = precision, rtol
        self.sinks = log  # not self.log: Lightning binds the module's log() onto callbacks
        self.monitor: Optional[Monitor] = None
        self._trainer: Any = None
        self._last_step = 0
        self._batch_labels: List[Any] = []

    def _to_loggers(self, rec: dict) -> None:
        trainer = self._trainer
        if trainer is None or not trainer.is_global_zero:
            return
        metrics = scalars(rec, self.prefix)
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=rec["step"])

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._trainer = trainer
        route = self.route
        if route.distributed is None:
            route = route.replace(distributed=trainer.world_size > 1)
        sinks = self.sinks
        extra = [] if sinks is None else (list(sinks) if isinstance(sinks, (list, tuple)) else [sinks])
        self.monitor = Monitor(pl_module, route, head=self.head, layer=self.layer, log=[self._to_loggers] + extra,
                               precision=self.precision, rtol=self.rtol, prefix=self.prefix,
                               first_step=trainer.global_step)
        self._last_step = trainer.global_step
        self._batch_labels = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.monitor is None:
            return
        if self.labels is not None and self.monitor.capturing:  # a step the Monitor keeps nothing of needs no labels
            y = self.labels(batch)
            if y is not None:
                self._batch_labels.append(y)
        if trainer.global_step == self._last_step:  # accumulating gradients: no optimizer step yet
            return
        self._last_step = trainer.global_step
        labels = self._batch_labels
        self._batch_labels = []
        if not labels:
            y = None
        elif len(labels) == 1:
            y = labels[0]
        else:
            import torch

            y = torch.cat(labels)
        self.monitor.step(labels=y)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.monitor is not None:
            self.monitor.close()  # emits records still queued (one-batch windows)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.monitor is not None:
            self.monitor.close()
