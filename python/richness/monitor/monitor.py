"""``richness.Monitor``: DLR during training, at a cost the step does not notice.

The Monitor counts steps, holds the hooks on the model and writes records to
sinks; its route (``monitor/routes.py``) says which batches make a record
and when, and holds the state that makes it. ``Window``: a forward hook on
the head captures the training batches of the last ``window`` steps before
every ``every``-th step; each ``step()`` copies the captured batch into the
window's buffer and drops it; at every ``every``-th step the window is added
to a ``Moments`` as one batch, and DLR (and NC1 with labels) is finished from
it and emitted (``monitor/window.py``). Windows of one batch with fewer
samples than features (``EveryStep``) take a cheaper exact route: each
step's head input and output are copied into a buffer, and groups of up to
``lag`` steps are reduced at once from the n x n Gram of each batch
(``monitor/onebatch.py``). ``Probe``: every ``every`` steps a fixed probe set
is evaluated in eval mode (train mode restored after) and its full report
emitted.

The only host synchronisation is at emission (finishing the state); ``update``
never calls ``.item()`` or copies to the host (on a GPU the CUDA backend runs
on the caller's stream). Boolean token masks are the exception: indexing with
them syncs; and so does, on a GPU, each flush of a window whose steps do not
fit its buffer at once (32 MiB): the device's checks of the flushed rows are
read then, so that a step they refuse is left out by itself.

This module wires the parts: the hook on the head or layer
(``torch/hooks.py``, calling ``monitor/capture.py``), the route, the sinks
(``monitor/sinks.py``).
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Dict, List, Optional

from ..torch.hooks import HeadHook
from .capture import ModelForwards
from .routes import Head, Layer, Probe, Route, Window
from .sinks import make_sinks
from .._checks import check_int
from .._optional import require_torch
from ..finish.isotropic import SAMPLES_PER_FEATURE, undersampled
from ..torch.threads import BlasThreads
from .._warnings import RichnessWarning

__all__ = ["Monitor"]


class Monitor:
    """DLR over training steps, from forward hooks on the head.

    Args:
        model: the ``torch.nn.Module`` being trained.
        route: which batches make a record, and when (``monitor/routes.py``):
            ``Window(every=100, window=None)`` (default: the training batches
            of the last ``window`` steps of every ``every``),
            ``EveryStep(lag=None)`` (each step's own batch) or
            ``Probe(data, every=100)`` (a fixed probe set in eval mode; its
            records also have the effective dimension).
        head: what is read: the read-out module or its dotted name, or a
            ``Head(module, tokens=, wide=, measures=)``; default: the last
            ``nn.Linear`` whose output is the model's output (found on the
            first forward).
        layer: the features-only Monitor instead, for self-supervised training
            (no head, no labels): a module of the model or its dotted name, or
            a ``Layer(module, pool=, layout=, measures=)``, whose output is
            pooled into rows and recorded on its own (see ``Layer``). Not with
            ``head`` nor a ``Probe`` route.
        log: where records go: a ``.csv`` or ``.jsonl`` path (appended), a
            callable taking the record dict, a TensorBoard ``SummaryWriter``
            (``add_scalar("richness/dlr", ...)``), ``"wandb"`` (the active
            W&B run, or pass the run object; values against the step metric
            ``richness/step``), ``"mlflow"`` (MLflow's active run, at each
            record's step), or a list of these.
        precision: precision of the products (``Moments``); default by dtype.
        rtol: eigenvalue cut (default by precision, docs/MATH.md, rank cut).
        prefix: TensorBoard tag prefix.
        first_step: the step number that records give the first ``step()``
            (default 1: records count optimizer steps done). Lightning's
            ``global_step`` of a batch is 0-based (the steps done before it):
            ``RichnessCallback`` passes the trainer's ``global_step`` at the
            start of training, so that records land at the step Lightning logs
            that batch at. The emission schedule (``every``) counts from the
            first ``step()`` whatever the base.

    Where each option sits (``Window``, ``EveryStep``, ``Probe``, ``Head``
    and ``Layer`` are importable from ``richness``):

    ======================================  ===============================================
    option                                  where
    ======================================  ===============================================
    ``every``, ``window``, ``lag``          ``Window(every, window, lag=)``; every step:
                                            ``EveryStep(lag)``
    ``probe``, ``batch_fn``                 ``Probe(data, every, batch_fn=)``
    ``distributed``                         the route's ``distributed=``
    ``tokens``, ``wide_head``               ``Head(module, tokens=, wide=)`` as ``head=``
    ``measures``                            ``Head(measures=)`` or ``Layer(measures=)``
    ``layer``, ``pool``, ``layout``         ``Layer(module, pool=, layout=)`` as ``layer=``
    ``head``, ``log``, ``precision``,       the Monitor's own
    ``rtol``, ``prefix``, ``first_step``
    ======================================  ===============================================

    Use as a context manager (hooks removed on exit) and call ``step(labels)``
    after every optimizer step. A window captures the head's forwards that
    run with gradients enabled (training steps, whatever the modules' train/eval
    mode); forwards under ``torch.no_grad()`` (validation) are ignored, and so is
    a forward of the model that raises after the head ran. With labels, a
    step's captures are its latest forwards whose rows match the labels (those
    of a step skipped after its forward are dropped with a warning); labels
    matching none are refused with nothing recorded and the step not counted.
    ``history`` holds the emitted records ``{step, mode, n, dlr, dlr_isotropic,
    dlr_normalized, rank, nc1, effective_dim, rankme, alpha_req,
    participation_ratio, nc2_equinorm, nc2_equiangle, nc3, lidar, time,
    dlr_rtol_range, dlr_from}`` (the diagnostics None unless ``measures`` or
    ``layer`` asks for them; ``lidar`` with a ``Layer`` route whose steps give
    object ids as labels): ``n`` is the rows the record's values come from
    (a window's steps together; a features-only step that runs the layer on two
    views, as SimCLR does, gives both: 2 x batch rows a step);
    ``dlr_isotropic`` the DLR of isotropic features at that n, the active
    features and the rank (the full report's finite-sample reference), and
    ``dlr_normalized`` dlr / dlr_isotropic (both None where DLR is);
    ``dlr_rtol_range`` is DLR at rtol / 10 and rtol * 10 (how much the rank
    cut matters; None in one-batch windows), ``dlr_from`` ``"weights"`` or
    ``"outputs"`` (see ``Head``'s ``wide``). CSV logs keep all but the last
    two. A window of fewer than 10 x p rows
    (``finish.isotropic.undersampled``) is warned about once.

    Bad activation values never stop training: a step whose rows the window's
    Moments refuse (NaN or Inf, co-moments that overflow, a spread whose
    squares underflow; labels out of range) is left out of its window with a
    ``RichnessWarning`` naming the step and the reason, the window's record
    coming from its other steps (a window left with none records ``n`` 0 and
    ``dlr``, ``rank`` and ``nc1`` None); a one-batch window (every step) with
    NaN or Inf gives that step such a record, and a probe set refused for its
    values a probe record with the values None, each with the warning.

    Example::

        with richness.Monitor(model, Window(every=100), log="dlr.jsonl") as mon:
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(); loss.backward(); opt.step()
                mon.step(labels=y)
    """

    def __init__(self, model: Any, route: Optional[Route] = None, *, head: Any = None, layer: Any = None,
                 log: Any = None, precision: Optional[str] = None, rtol: Optional[float] = None,
                 prefix: str = "richness", first_step: int = 1) -> None:
        torch = require_torch("richness.Monitor")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        route = Window() if route is None else route
        if not isinstance(route, Route):
            raise TypeError(f"route must be a Window, EveryStep or Probe, got {type(route).__name__}")
        first_step = check_int(first_step, "first_step")
        if layer is not None and (head is not None or isinstance(route, Probe)):
            raise ValueError("layer= is the features-only Monitor (no head, no probe): drop head= and the Probe "
                             "route, or drop layer=")
        target = (head if isinstance(head, Head) else Head(head)) if layer is None else (
            layer if isinstance(layer, Layer) else Layer(layer))
        self.model, self.route, self.first_step = model, route, first_step
        self.precision, self.rtol = precision, rtol
        self.history: List[Dict[str, Any]] = []
        self.steps = 0
        self._target = target._start(model)  # the head (given or found on the first forward) or the layer
        self._run = route._start(self)  # the route's state in this Monitor
        self._sinks = make_sinks(log, prefix)
        self._pending: list = []
        self._capturing = self._run.capturing(1)
        self._capture: Optional[HeadHook] = None  # on the head or the layer
        self._forwards: Optional[ModelForwards] = None
        self._refused = False  # the last step() refused its labels; its captures wait for a retry
        self._closed = False
        self._head_has_run = False  # told by the head's hook (_head_ran)
        self._warned: set = set()  # the warnings given once per Monitor: "idle", "undefined", "small"
        self._t0 = time.time()
        if self._run.reads_training:
            self._forwards = ModelForwards(model, self._commit)
            self._capture = self._target.hook(self, model)
        # Restored by close(). One core worker below 2^30 multiply-adds (the
        # default window's update, 1,280 x 512^2, is 3.4e8): right after a
        # training step torch's OpenMP threads are still spinning, and a second
        # worker contends with them instead of helping (bench_monitor.py, torch
        # on 2 threads: default settings +1.1-1.2% with one worker, +1.9-2.7%
        # with two; benchmarks/RESULTS.md, "Monitor overhead, CPU").
        self._threads = BlasThreads(small=2 ** 30)

    # -- hooks ----------------------------------------------------------------

    def _commit(self, captures: list) -> None:
        self._pending.extend(captures)

    # -- what the head's hook calls (monitor/capture.py) and integrations read --------------------

    @property
    def capturing(self) -> bool:
        """Whether the training forwards that run now are kept for the next
        ``step()``: True on the steps of a window, False between windows and
        with a ``Probe`` route. The head's hook reads it, and so does a caller
        that pays for something per kept forward (the Hugging Face callback
        reads a step's labels only then)."""
        return self._capturing

    def _head_ran(self) -> None:
        """The head's (or layer's) hook: it ran in a training forward (with
        gradients enabled), kept or not. A head that never does is warned
        about once, after ``every`` steps."""
        self._head_has_run = True

    def _record_head_output(self, features: Any, outputs: Any) -> None:
        """The head's hook: keep one training forward's head input (a
        layer's pooled rows) and head output (None for a layer), detached,
        for the next ``step()``. They are kept once the model forward that
        made them returns (``ModelForwards``), and dropped if it raises."""
        if self._refused:  # training moved on past a refused step(): its captures are not this step's
            self._pending = []
            self._refused = False
        self._forwards.add((features, outputs))

    @property
    def head(self) -> Any:
        """The head module (None until found on the first forward)."""
        return self._target.head

    # -- the training loop ----------------------------------------------------

    def step(self, labels: Any = None) -> Optional[dict]:
        """Count one optimizer step; ``labels`` are those of the step's batch
        (integer classes, or float targets). Returns the record when this step
        emitted one, else None. Records of one-batch windows (``EveryStep``, or
        ``Window(window=1)``, with fewer samples than features) are computed in groups
        of up to ``lag`` steps and reach ``history`` and the sinks at most
        ``lag`` steps later (a few more on a GPU, where they are finished without
        waiting for the device); ``flush()`` or closing emits the rest.

        Labels that match none of the step's captured rows raise a ValueError
        before anything changes (the step is not counted): call ``step`` again
        with this step's labels."""
        if self._closed:
            raise RuntimeError("this Monitor is closed")
        rows = None
        if self._forwards is not None:
            self._forwards.clear()
        if self._pending:  # checks only: a refused step changes nothing
            try:
                rows = self._target.step_rows(self._pending, labels, self._run.check_labels)
            except ValueError:
                self._refused = True
                raise
        self._refused = False
        run = self._run
        run.poll()
        self.steps += 1
        rec = None
        self._pending = []
        try:
            if rows is not None:
                run.add(*rows)
            if (self.steps >= self.route.every and run.reads_training and not self._head_has_run
                    and "idle" not in self._warned):
                self._warned.add("idle")
                warnings.warn(self._target.idle(self.steps), UserWarning, stacklevel=2)
            if self.steps % self.route.every == 0:
                rec = run.emit()
                if rec is not None:
                    self._dispatch(rec)
            run.after_step(self._step_label())
        finally:
            run.warn_refused()
        self._capturing = run.capturing(self.steps + 1)
        return rec

    def _warn_small_window(self, n: int, p: int) -> None:
        """Warn once of a record from fewer than 10 x p rows
        (``finish.isotropic.undersampled``, the full report's rule), naming
        the window that would reach it."""
        if "small" in self._warned or n < 2 or p < 1 or not undersampled(n, p):
            return
        self._warned.add("small")
        need = SAMPLES_PER_FEATURE * p
        fix = self._run.small_fix(n, need)
        warnings.warn(f"richness.Monitor: the record at step {self._step_label()} comes from n = {n} rows for "
                      f"p = {p} features, below {SAMPLES_PER_FEATURE} x p = {need}: DLR reads biased toward "
                      f"rich (and RankMe, alpha-ReQ toward the sample size) at this size; {fix}. "
                      "Later such records are not warned about", RichnessWarning, stacklevel=4)

    def _step_label(self) -> int:
        return self.first_step + self.steps - 1

    def _elapsed(self) -> float:
        return round(time.time() - self._t0, 6)

    def flush(self) -> None:
        """Finish the queued one-batch windows (waiting for the GPU if needed) and emit them."""
        self._run.flush()

    # -- records ---------------------------------------------------------------

    def _warn_undefined(self, rec: dict, why: Any, skip: tuple = ()) -> None:
        """Warn, once per Monitor, of a record whose asked-for diagnostics are
        None because they are undefined there (``why``: the reasons finishing
        gave, when it gave them)."""
        missing = [m for m in self._target.measures if m not in skip and rec.get(m) is None]
        if "undefined" in self._warned or not missing:
            return
        self._warned.add("undefined")
        reasons = "; ".join(why) if why else (
            "an all-zero spectrum (constant features), fewer than two eigenvalues in alpha-ReQ's range "
            "(k = 11..100), fewer than two classes for NC2, "
            "or no linear head's weights for nc3")
        warnings.warn(f"richness.Monitor: {', '.join(missing)} undefined at step {rec['step']}, recorded as None "
                      f"({reasons}); later such records are not warned about", UserWarning, stacklevel=4)

    def _dispatch(self, rec: dict) -> None:
        self.history.append(rec)
        for sink in self._sinks:
            sink(rec)

    # -- lifetime -------------------------------------------------------------

    def close(self) -> None:
        """Remove the hooks, close log files, restore the BLAS thread count.
        Warns when the run emitted no record (it ended before ``every`` steps,
        or its head never ran): the log files are then empty."""
        self._close(warn_empty=True)

    def _close(self, warn_empty: bool) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()  # queued records, and those still on their way from the GPU
            if warn_empty and not self.history:
                every = self.route.every
                why = (f"records come every {every} steps (every={every}): use a smaller every= for a "
                       "short run" if self.steps < every else "no window had features (see the warning "
                       "about the head)")
                warnings.warn(f"richness.Monitor closed after {self.steps} steps without a record, nothing was "
                              f"logged; {why}", UserWarning, stacklevel=3)
        finally:
            self._pending = []
            self._run.close()
            if self._capture is not None:
                self._capture.remove()
            if self._forwards is not None:
                self._forwards.remove()
            for s in self._sinks:
                s.close()
            self._threads.restore()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._close(warn_empty=exc[0] is None)  # an exception in the loop says enough by itself

    def __repr__(self) -> str:
        return f"Monitor(head={self._target.name!r}, route={self.route!r}, steps={self.steps})"
