"""``richness.Monitor``: DLR during training, at a cost the step does not notice.

Window mode (default): a forward hook on the head captures the training
batches of the last ``window`` steps before every ``every``-th step; each
``step()`` copies the captured batch into the window's buffer and drops it; at
every ``every``-th step the window is added to a ``Moments`` as one batch, and
DLR (and NC1 with labels) is finished from it and emitted
(``monitor/window.py``). Windows of one batch with fewer samples than features
(every=1) take a cheaper exact route: each step's head input and output are
copied into a buffer, and groups of up to ``lag`` steps are reduced at once
from the n x n Gram of each batch (``monitor/onebatch.py``). Probe mode
(``probe=``): every ``every`` steps a fixed probe set is evaluated in eval mode
(train mode restored after) and its full report emitted.

The only host synchronisation is at emission (finishing the state); ``update``
never calls ``.item()`` or copies to the host (on a GPU the CUDA backend runs
on the caller's stream). Boolean token masks are the exception: indexing with
them syncs; and so does, on a GPU, each flush of a window whose steps do not
fit its buffer at once (32 MiB): the device's checks of the flushed rows are
read then, so that a step they refuse is left out by itself.

This module wires the parts: the head's hook (``torch/hooks.py``, calling
``monitor/capture.py``), the step buffers (``monitor/capture.py``),
the two routes, the sinks (``monitor/sinks.py``), and the finishing math they
share (``richness.finish``).
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from ..torch.batches import check_tokens
from ..torch.evaluate import collect
from ..torch.hooks import HeadHook, resolve_head
from .capture import ModelForwards, TrainingCapture, probe_batches, step_rows
from .onebatch import BatchGroup, GroupMeta, OneBatchRoute, StepMeta, finish_group
from .sinks import make_sinks
from .window import WindowRoute
from .layer import RECORD_MEASURES, layer_rows, monitor_measures, pooled_output, resolve_layer
from .._checks import check_int
from .._optional import require_torch
from ..finish.diagnostics import SPECTRAL
from ..finish.isotropic import SAMPLES_PER_FEATURE, undersampled
from ..torch.threads import BlasThreads
from .._warnings import RichnessWarning


def _num(v: Any) -> Optional[float]:
    return None if v is None or (isinstance(v, float) and not math.isfinite(v)) else float(v)


# What the Moments say when they refuse a batch for its values (csrc/cpu/cpu_moments.cpp,
# csrc/cuda/cuda_moments.cu): NaN or Inf, co-moments that overflow, a spread whose squares
# underflow the products. A probe set refused for these is a diverged model, not a mistake.
_VALUE_REFUSALS = ("non-finite", "not finite", "overflow", "too little for")


def _refused_values(e: Exception) -> bool:
    return any(s in str(e) for s in _VALUE_REFUSALS)


class Monitor:
    """DLR over training steps, from forward hooks on the head.

    Args:
        model: the ``torch.nn.Module`` being trained.
        head: the read-out module or its dotted name; default: the last
            ``nn.Linear`` whose output is the model's output (found on the first
            forward).
        every: emit every ``every`` optimizer steps (count them with ``step()``).
        window: window mode: accumulate the training batches of the last
            ``window`` steps before each emission (``window <= every``). The
            defaults (``every=100, window=10``) keep the hooks idle 90% of the
            time; a window of 10 batches of 128 gives n = 1280 samples, so read
            docs/MATH.md, finite-sample bias (n well above p), before
            shrinking it.
        probe: probe mode instead: a tensor, an ``(inputs, labels)`` pair or a
            re-iterable loader evaluated in eval mode at every emission (train
            mode restored after); the emitted record then also has the
            effective dimension.
        log: where records go: a ``.csv`` or ``.jsonl`` path (appended), a
            callable taking the record dict, a TensorBoard ``SummaryWriter``
            (``add_scalar("richness/dlr", ...)``), ``"wandb"`` (the active
            W&B run, or pass the run object; values against the step metric
            ``richness/step``), ``"mlflow"`` (MLflow's active run, at each
            record's step), or a list of these.
        precision: precision of the products (``Moments``); default by dtype.
        tokens: token selection for 3-D head inputs (see ``richness.evaluate``).
        batch_fn: adapts probe-loader batches (see ``richness.evaluate``).
        rtol: eigenvalue cut (default by precision, docs/MATH.md, rank cut).
        prefix: TensorBoard tag prefix.
        distributed: merge the window (or probe) state of all ranks
            (``Moments.all_reduce``) at each emission, so every rank emits the
            global value; every rank must call ``step()`` equally often.
        first_step: the step number that records give the first ``step()``
            (default 1: records count optimizer steps done). Lightning's
            ``global_step`` of a batch is 0-based (the steps done before it):
            ``RichnessCallback`` passes the trainer's ``global_step`` at the
            start of training, so that records land at the step Lightning logs
            that batch at. The emission schedule (``every``) counts from the
            first ``step()`` whatever the base.
        lag: one-batch windows (``window=1`` with fewer samples than
            features, as with ``every=1``) are computed exactly from the n x n
            Gram of each batch, in groups of up to ``lag`` steps with batched
            products; their records arrive up to ``lag`` steps late. Grouping
            is what keeps every=1 cheap (the per-step cost is one copy of the
            head's input and output); ``lag=1`` computes each at its own step.
            Default: 16 on the CPU, 64 on a GPU (where a group's fixed cost is
            kernel launches, paid on the host while training waits for it).
            The buffered inputs of a group are capped at 32 MiB (its
            reduction's scratch takes about as much again).
        layer: the features-only Monitor, for self-supervised training (no
            head, no labels): a module of the model or its dotted name, whose
            output is pooled into rows (``pool``) and recorded on its own:
            records carry ``rankme``, ``alpha_req``, ``effective_dim`` and
            ``participation_ratio`` of that representation (``dlr``, ``rank``
            and ``nc1`` stay None; labels given to ``step`` are ignored).
            Not with ``head`` or ``probe``.
        pool: how a layer's output becomes rows (``"mean"`` over spatial
            positions or tokens, ``"first"``/``"last"`` token, ``"flatten"``;
            ``richness.torch.batches.pool_rows``).
        layout: how the layer's 3-D output is laid out where its module does
            not say (a custom block): ``"tokens"`` (batch, tokens, width) or
            ``"channels"`` (batch, channels, positions); convolutions, pooling
            and normalisation of 1-D maps are channels, Linear, LayerNorm,
            attention and transformer layers tokens (``module_layout``).
        measures: representation diagnostics to add to each record (names
            from ``richness.finish.MEASURES`` or ``"all"``): RankMe, alpha-ReQ
            and the participation ratio from the window's eigenvalues (or, at
            every=1, the batch's n x n Gram's), NC2 with labels, NC3 with a
            linear head (window route only). Default: none with a head (each
            costs a p x p eigenvalue decomposition per emission), the
            spectral ones with ``layer``.
        wide_head: a linear head with more outputs than features (a language
            model's vocabulary): ``"weights"`` (default) finishes DLR from the
            head's weights at emission time and the window's features (no
            C x C Gram; the weights have moved since the window's first step);
            ``"outputs"`` streams the head's outputs as for any other head
            (the functions at the steps that made the features; a C x C Gram,
            8 C^2 bytes). Records say which in ``dlr_from``.

    Use as a context manager (hooks removed on exit) and call ``step(labels)``
    after every optimizer step. Window mode captures the head's forwards that
    run with gradients enabled (training steps, whatever the modules' train/eval
    mode); forwards under ``torch.no_grad()`` (validation) are ignored, and so is
    a forward of the model that raises after the head ran. With labels, a
    step's captures are its latest forwards whose rows match the labels (those
    of a step skipped after its forward are dropped with a warning); labels
    matching none are refused with nothing recorded and the step not counted.
    ``history`` holds the emitted records ``{step, mode, n, dlr, dlr_isotropic,
    dlr_normalized, rank, nc1, effective_dim, rankme, alpha_req,
    participation_ratio, nc2_equinorm, nc2_equiangle, nc3, time,
    dlr_rtol_range, dlr_from}`` (the diagnostics None unless ``measures`` or
    ``layer`` asks for them): ``n`` is the rows the record's values come from
    (a window's steps together; a features-only step that runs the layer on two
    views, as SimCLR does, gives both: 2 x batch rows a step);
    ``dlr_isotropic`` the DLR of isotropic features at that n, the active
    features and the rank (the full report's finite-sample reference), and
    ``dlr_normalized`` dlr / dlr_isotropic (both None where DLR is);
    ``dlr_rtol_range`` is DLR at rtol / 10 and rtol * 10 (how much the rank
    cut matters; None in one-batch windows), ``dlr_from`` ``"weights"`` or
    ``"outputs"`` (see ``wide_head``). CSV logs keep all but the last two. A
    window of fewer than 10 x p rows (``finish.isotropic.undersampled``) is
    warned about once.

    Bad activation values never stop training: a step whose rows the window's
    Moments refuse (NaN or Inf, co-moments that overflow, a spread whose
    squares underflow; labels out of range) is left out of its window with a
    ``RichnessWarning`` naming the step and the reason, the window's record
    coming from its other steps (a window left with none records ``n`` 0 and
    ``dlr``, ``rank`` and ``nc1`` None); a one-batch window (every=1) with
    NaN or Inf gives that step such a record, and a probe set refused for its
    values a probe record with the values None, each with the warning.

    Example::

        with richness.Monitor(model, every=100, log="dlr.jsonl") as mon:
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(); loss.backward(); opt.step()
                mon.step(labels=y)
    """

    def __init__(self, model: Any, head: Any = None, *, every: int = 100, window: Optional[int] = None,
                 probe: Any = None, log: Any = None, precision: Optional[str] = None, tokens: Any = "all",
                 batch_fn: Optional[Callable] = None, rtol: Optional[float] = None, prefix: str = "richness",
                 distributed: bool = False, lag: Optional[int] = None, first_step: int = 1,
                 layer: Any = None, pool: str = "mean", measures: Any = None, wide_head: str = "weights",
                 layout: Any = None) -> None:
        torch = require_torch("richness.Monitor")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        every = check_int(every, "every", low=1)
        if window is None:
            window = min(10, every)
        window = check_int(window, "window", low=1, high=every, what=f"an integer in [1, every={every}]")
        lag = check_int(lag, "lag", low=1, allow_none=True)
        first_step = check_int(first_step, "first_step")
        if wide_head not in ("weights", "outputs"):
            raise ValueError(f"wide_head must be 'weights' or 'outputs', got {wide_head!r}")
        check_tokens(tokens)
        if layer is not None and (head is not None or probe is not None):
            raise ValueError("layer= is the features-only Monitor (no head, no probe): drop head= and probe=, "
                             "or drop layer=")
        if layout is not None and layer is None:
            raise ValueError("layout= tells how the output of layer= is laid out: give layer= or drop layout=")
        self.measures = monitor_measures(measures, layer)
        self.wide_head = wide_head
        self.model = model
        self.first_step = first_step
        self.every, self.window = every, window
        self.precision, self.tokens, self.batch_fn, self.rtol = precision, tokens, batch_fn, rtol
        self.distributed = bool(distributed)
        self.probe = None if probe is None else probe_batches(probe)
        self.history: List[Dict[str, Any]] = []
        self.steps = 0
        resolved = resolve_head(model, head)
        self._head_name, self._head = (resolved if resolved is not None else (None, None))
        self._layer_name, self._layer = resolve_layer(model, layer) if layer is not None else (None, None)
        self._sinks = make_sinks(log, prefix)
        self._window_route = WindowRoute(precision, window)
        self._pending: list = []
        self.lag = lag
        self._one_batch = OneBatchRoute(lag, precision, rtol, self._finish_records,
                                        eig=any(m in SPECTRAL for m in self.measures),
                                        raw_eig="rankme" in self.measures)
        self._deferred = False  # this step's window went to the one-batch route
        self._window_labels: Optional[bool] = None
        self._capturing = self._is_window_step(1)
        self._capture: Optional[HeadHook] = None  # on the head (given or found) or the layer
        self._forwards: Optional[ModelForwards] = None
        self._refused = False  # the last step() refused its labels; its captures wait for a retry
        self._closed = False
        self._head_has_run = False  # told by the head's hook (head_ran)
        self._idle_warned = False  # a head that never runs is warned about once
        self._undefined_warned = False  # a record with an asked-for diagnostic undefined is warned about once
        self._small_warned = False  # a window of fewer than 10 x p rows is warned about once
        self._t0 = time.time()
        if self.probe is None:
            self._forwards = ModelForwards(model, self._commit)
            if self._layer is not None:
                pooled = pooled_output(self._layer_name, pool, self._layer, layout, model)
                self._capture = HeadHook(TrainingCapture(self, pooled), self._layer)
            else:
                self._capture = HeadHook(TrainingCapture(self), self._head, model=model, found=self._head_found)
        # Restored by close(). One core worker below 2^30 multiply-adds (the
        # default window's update, 1,280 x 512^2, is 3.4e8): right after a
        # training step torch's OpenMP threads are still spinning, and a second
        # worker contends with them instead of helping (bench_monitor.py, torch
        # on 2 threads: default settings +1.1-1.2% with one worker, +1.9-2.7%
        # with two; benchmarks/RESULTS.md, "Monitor overhead, CPU").
        self._threads = BlasThreads(small=2 ** 30)

    # -- hooks ----------------------------------------------------------------

    def _is_window_step(self, j: int) -> bool:
        return (j - 1) % self.every >= self.every - self.window

    def _head_found(self, name: str, head: Any) -> None:
        self._head_name, self._head = name, head

    def _commit(self, captures: list) -> None:
        self._pending.extend(captures)

    # -- what the head's hook calls (monitor/capture.py) and integrations read --------------------

    @property
    def capturing(self) -> bool:
        """Whether the training forwards that run now are kept for the next
        ``step()``: True on the steps of a window, False between windows and
        in probe mode. The head's hook reads it, and so does a caller that
        pays for something per kept forward (the Hugging Face callback reads
        a step's labels only then)."""
        return self._capturing

    def head_ran(self) -> None:
        """The head's (or layer's) hook: it ran in a training forward (with
        gradients enabled), kept or not. A head that never does is warned
        about once, after ``every`` steps."""
        self._head_has_run = True

    def record_head_output(self, features: Any, outputs: Any) -> None:
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
        return self._head

    # -- the training loop ----------------------------------------------------

    def step(self, labels: Any = None) -> Optional[dict]:
        """Count one optimizer step; ``labels`` are those of the step's batch
        (integer classes, or float targets). Returns the record when this step
        emitted one, else None. Records of one-batch windows (``window=1`` with
        fewer samples than features, as with ``every=1``) are computed in groups
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
        if self.probe is None and self._pending:
            try:
                rows = self._step_rows(labels)  # checks only: a refused step changes nothing
            except ValueError:
                self._refused = True
                raise
        self._refused = False
        self._one_batch.poll()
        self.steps += 1
        rec = None
        self._pending = []
        try:
            if rows is not None:
                self._add_rows(*rows)
            if self.steps >= self.every and not self._head_has_run and not self._idle_warned and self.probe is None:
                self._warn_head_idle()
            if self.steps % self.every == 0:
                rec = self._emit()
            if self._one_batch.due(self._step_label()):
                self._one_batch.reduce(self._threads, _core_route)
        finally:
            self._warn_refused()
        self._capturing = self.probe is None and self._is_window_step(self.steps + 1)
        return rec

    def _warn_refused(self) -> None:
        """Warn of the steps the window's Moments refused (``WindowRoute``)."""
        what = "the layer's output" if self._layer is not None else "the head's input, output or labels"
        for step, why in self._window_route.take_refused():
            warnings.warn(f"richness.Monitor: step {step}: {what} refused ({why}); the step is left out of its "
                          "window, whose record comes from its other steps (with none: n 0, dlr, rank and nc1 "
                          "None)", RichnessWarning, stacklevel=3)

    def _warn_small_window(self, n: int, p: int) -> None:
        """Warn once of a record from fewer than 10 x p rows
        (``finish.isotropic.undersampled``, the full report's rule), naming
        the window that would reach it."""
        if self._small_warned or n < 2 or p < 1 or not undersampled(n, p):
            return
        self._small_warned = True
        need = SAMPLES_PER_FEATURE * p
        if self.probe is not None:
            fix = f"use a probe set of at least {need} samples (probe=)"
        else:
            per_step = n / self.window
            w = max(self.window + 1, math.ceil(need / per_step))
            fix = (f"widen the window: window={w} (with every={max(self.every, w)} or more: window <= every) "
                   f"gives about {round(w * per_step)} rows at this batch size")
        warnings.warn(f"richness.Monitor: the record at step {self._step_label()} comes from n = {n} rows for "
                      f"p = {p} features, below {SAMPLES_PER_FEATURE} x p = {need}: DLR reads biased toward "
                      f"rich (and RankMe, alpha-ReQ toward the sample size) at this size; {fix}. "
                      "Later such records are not warned about", RichnessWarning, stacklevel=4)

    def _warn_head_idle(self) -> None:
        # A head given by the user (or found on the model's first forward) that
        # never runs in a training forward leaves every record empty.
        self._idle_warned = True
        if self._layer is not None:
            warnings.warn(f"richness.Monitor: after {self.steps} steps the layer {self._layer_name!r} "
                          f"({type(self._layer).__name__}) has not run in a training forward (with gradients "
                          "enabled); nothing is recorded. Choose a module that runs with layer=", UserWarning,
                          stacklevel=3)
            return
        if self._head is None:
            what = ("no forward of the model has run, so its head was not found (training code that calls a "
                    "submodule directly bypasses the model's forward)")
        else:
            what = (f"its head {self._head_name!r} ({type(self._head).__name__}) has not run in a training "
                    "forward (with gradients enabled)")
        warnings.warn(f"richness.Monitor: after {self.steps} steps {what}; no DLR is recorded. Choose the module "
                      "whose input is the features with head= (the module or its dotted name)", UserWarning,
                      stacklevel=3)

    def _step_label(self) -> int:
        return self.first_step + self.steps - 1

    def _step_rows(self, labels: Any) -> tuple:
        """This step's (features, outputs, label keyword arguments), checked
        (``step_rows``); changes nothing. Captures before the step's own are
        dropped with a warning. A features-only Monitor's rows are its
        layer's, whatever the labels."""
        if self._layer is not None:
            return layer_rows(self._pending)
        try:
            feats, outs, lk, first, dropped = step_rows(self._pending, labels, self.tokens)
        except (ValueError, TypeError, IndexError, RuntimeError) as e:
            raise ValueError(f"Monitor.step: {e}. The step was not counted and nothing was recorded: call step() "
                             "again with this step's labels") from None
        if self._window_labels is not None and self._window_labels != bool(lk):
            raise ValueError("Monitor.step got labels on some steps of a window and none on others")
        if outs is None and not self._uses_weights():
            raise ValueError(f"the head {type(self._head).__name__} did not return a tensor")
        if first:
            warnings.warn(f"richness.Monitor: {first} training forward(s) of the head ({dropped} samples) before "
                          "this step's did not belong to it (a step skipped after its forward?); they are not "
                          "recorded", UserWarning, stacklevel=3)
        return feats, outs, lk

    def _add_rows(self, feats: Any, outs: Any, lk: dict) -> None:
        """Add this step's checked rows to the window (or the one-batch group)."""
        if self._window_labels is None:
            self._window_labels = bool(lk)
        if self._batch_path_fits(feats, outs):
            self._defer(feats, outs, lk.get("labels"))
            return
        parts = {"features": feats}
        if outs is not None and not self._uses_weights():
            parts["outputs"] = outs
        parts.update(lk)
        self._window_route.add(parts, self._threads, self._step_label())

    def _batch_path_fits(self, feats: Any, outs: Any) -> bool:
        """A window of one batch with fewer rows than features (every=1 with a
        training batch of 128 and p = 512): its exact moments come cheaper from
        the n x n Gram, O(n^2 p), than from the p x p update, O(n p^2). (With
        window = 1 the Moments are empty between steps: each window is added
        and reset at its own emission; asking them for n could sync a GPU.)"""
        n, p = int(feats.shape[0]), int(feats.shape[1])
        return (self.window == 1 and not self.distributed and 2 <= n < p
                and (outs is not None or self._layer is not None)
                and not self._uses_weights() and self.precision in (None, "fp32", "fp64"))

    def _defer(self, feats: Any, outs: Any, labels: Any) -> None:
        """Queue this step's one-batch window in the group (see ``BatchGroup``)."""
        meta = StepMeta(self._step_label(), round(time.time() - self._t0, 6))
        self._one_batch.add(feats, outs, labels, self._head, meta, self._threads, _core_route)
        self._deferred = True

    def _finish_records(self, meta: GroupMeta, v: np.ndarray) -> None:
        """Finish a reduced group's rows (``finish_group``) and emit their records."""
        bad = {m.step for m, norm_m in zip(meta.steps, v[:, 0]) if math.isnan(norm_m)}  # _to_unit_spread
        if bad:
            what = "the layer's output" if self._layer is not None else "the head's input or output"
            warnings.warn(f"richness.Monitor: {what} had NaN or Inf values at step(s) "
                          f"{', '.join(map(str, sorted(bad)))}: their records have n 0 and dlr, rank and nc1 None",
                          RichnessWarning, stacklevel=4)
        dlrs, ranks, nc1s, extra = finish_group(v, meta, self.measures)
        none = [None] * len(meta.steps)
        isos, norms = extra.get("dlr_isotropic", none), extra.get("dlr_normalized", none)
        for i, (m, dlr, rank, nc1) in enumerate(zip(meta.steps, dlrs, ranks, nc1s)):
            rec = {"step": m.step, "mode": "window", "n": 0 if m.step in bad else meta.n, "dlr": _num(dlr),
                   "dlr_isotropic": _num(isos[i]), "dlr_normalized": _num(norms[i]), "rank": rank,
                   "nc1": _num(nc1), "effective_dim": _num(extra["effective_dim"][i])}
            rec.update({name: _num(extra[name][i]) if name in self.measures else None for name in RECORD_MEASURES})
            rec.update(time=m.time, dlr_rtol_range=None, dlr_from="outputs")
            if m.step not in bad:  # a bad step is warned about above
                self._warn_small_window(meta.n, meta.p)
                self._warn_undefined(rec, (), skip=("nc3",))  # per-batch states carry no weights: NC3 None
            self._dispatch(rec)

    @property
    def _group(self) -> Optional[BatchGroup]:
        return self._one_batch.group

    def flush(self) -> None:
        """Finish the queued one-batch windows (waiting for the GPU if needed) and emit them."""
        self._one_batch.reduce(self._threads, _core_route)
        self._one_batch.poll(wait=True)

    def _uses_weights(self) -> bool:
        """Window mode streams the head's outputs: they are the function at the
        step that produced the features (the head's weights at emission time
        have moved since), and B, A cost b p C + b C^2 / 2 per batch against
        p^2 C once per emission for the weights. Except for a linear head with
        more outputs than features (vocabularies): a C x C Gram is out of the
        question there, and the emission-time weights are used (docs/MATH.md,
        many outputs)."""
        import torch

        head = self._head
        return (self.wide_head == "weights" and isinstance(head, torch.nn.Linear)
                and head.out_features > head.in_features)

    # -- emission -------------------------------------------------------------

    def _emit(self) -> Optional[dict]:
        if self.probe is not None:
            rec = self._emit_probe()
        else:
            rec = self._emit_window()
        if rec is None:
            return None
        self._dispatch(rec)
        return rec

    def _warn_undefined(self, rec: dict, why: Any, skip: tuple = ()) -> None:
        """Warn, once per Monitor, of a record whose asked-for diagnostics are
        None because they are undefined there (``why``: the reasons finishing
        gave, when it gave them)."""
        missing = [m for m in self.measures if m not in skip and rec.get(m) is None]
        if self._undefined_warned or not missing:
            return
        self._undefined_warned = True
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

    def _record(self, n: int, dlr: Any, rank: Any, nc1: Any, extra: dict, eff: Any, mode: str,
                dlr_range: Any = None, weights: bool = False, isotropic: Any = None, normalized: Any = None) -> dict:
        """A record: ``extra`` holds the representation diagnostics by name
        (and the effective dimension where they came with the eigenvalues);
        ``isotropic``, ``normalized``: the finite-sample reference and DLR
        read against it (``finish.isotropic``)."""
        eff = extra.get("effective_dim", eff)
        rec = {"step": self._step_label(), "mode": mode, "n": int(n), "dlr": _num(dlr),
               "dlr_isotropic": _num(isotropic), "dlr_normalized": _num(normalized),
               "rank": None if rank is None else int(rank), "nc1": _num(nc1), "effective_dim": _num(eff)}
        rec.update({name: _num(extra.get(name)) for name in RECORD_MEASURES})
        rec.update(time=round(time.time() - self._t0, 6),
                   dlr_rtol_range=None if dlr_range is None else [_num(d) for d in dlr_range],
                   dlr_from="weights" if weights else "outputs")
        return rec

    def _emit_window(self) -> Optional[dict]:
        if self._deferred:  # the record comes from the group, at most `lag` steps later
            self._deferred = False
            self._window_labels = None
            return None
        self.flush()  # queued records first: history stays in step order
        try:
            import torch

            head = self._head if self._uses_weights() else None
            linear = self._head if isinstance(self._head, torch.nn.Linear) else None
            values = self._window_route.finish(self._threads, self.distributed, self.rtol, head,
                                               self.measures, linear)
        finally:
            self._window_labels = None
        if values is None:
            return None
        q = values.dlr
        rec = self._record(q.n, q.dlr, q.rank, q.nc1, values.extra, None, "window", q.dlr_range, head is not None,
                           values.isotropic, values.normalized)
        if head is not None and q.dlr is None and not bool(torch.isfinite(head.weight).all()):
            warnings.warn(f"richness.Monitor: step {self._step_label()}: the head's weights have NaN or Inf values "
                          "(has training diverged?): the record's dlr and rank are None", RichnessWarning,
                          stacklevel=4)
        if q.n >= 2:  # else every step of the window was refused, and warned about
            self._warn_small_window(q.n, values.p)
            self._warn_undefined(rec, values.extra.get("warnings"))
        return rec

    def _emit_probe(self) -> Optional[dict]:
        import torch

        try:
            moments, head = collect(self.model, self.probe, head=self._head, precision=self.precision,
                                    progress=False, batch_fn=self.batch_fn, tokens=self.tokens,
                                    allow_empty=self.distributed)
        except ValueError as e:
            if not _refused_values(e):
                raise
            warnings.warn(f"richness.Monitor: step {self._step_label()}: the probe set's activations were refused "
                          f"({e}); its record has n 0 and dlr, rank and nc1 None (has training diverged?)",
                          RichnessWarning, stacklevel=4)
            return self._record(0, None, None, None, {}, None, "probe")
        if self.distributed:
            moments.all_reduce()
        if self._head is None:
            self._head = head
        try:
            rep = moments.compute(head=head if isinstance(head, torch.nn.Linear) else None, rtol=self.rtol)
        except ValueError as e:
            warnings.warn(f"richness.Monitor: step {self._step_label()}: the probe set's DLR is undefined ({e}); "
                          "its record has dlr, rank and nc1 None", RichnessWarning, stacklevel=4)
            return self._record(moments.n, None, None, None, {}, None, "probe")
        extra = {name: getattr(rep, name) for name in RECORD_MEASURES}  # the full report has them all
        if rep.eigenvalues is not None:
            self._warn_small_window(rep.n, len(rep.eigenvalues))
        return self._record(rep.n, rep.dlr, rep.rank, rep.nc1, extra, rep.effective_dim, "probe",
                            rep.dlr_rtol_range, isinstance(head, torch.nn.Linear), rep.dlr_isotropic,
                            rep.dlr_normalized)

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
                why = (f"records come every {self.every} steps (every={self.every}): use a smaller every= for a "
                       "short run" if self.steps < self.every else "no window had features (see the warning "
                       "about the head)")
                warnings.warn(f"richness.Monitor closed after {self.steps} steps without a record, nothing was "
                              f"logged; {why}", UserWarning, stacklevel=3)
        finally:
            self._pending = []
            self._one_batch.group = self._window_route.buf = None
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
        mode = "probe" if self.probe is not None else f"window={self.window}"
        return f"Monitor(head={self._head_name!r}, every={self.every}, {mode}, steps={self.steps})"


# The route of a CPU group's Gram matrices: None chooses by torch's thread
# count (benchmarks/bench_monitor.py, 2 cores: with torch on one thread the
# core's ssyrk and float64 centering cost 5.3-6.6% of a step against 7.6-9.6%
# for torch's batched product; with torch on two threads torch's product, on
# its own still-spinning OpenMP pool, costs 5.6-6.3% against 8.4-9.0% for
# the core's workers, which contend with that pool). True/False force the
# core/torch route (tests). Device buffers always take the torch route.
CORE_GRAMS: Optional[bool] = None


def _core_route(x: Any) -> bool:
    import torch

    if x.device.type != "cpu":
        return False
    return CORE_GRAMS if CORE_GRAMS is not None else torch.get_num_threads() == 1
