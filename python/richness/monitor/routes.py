"""What a ``Monitor`` measures and when: its routes and what they read.

A route says which batches make a record and when:

- ``Window(every=100, window=None)``: the training batches of the last
  ``window`` steps of every ``every`` steps, added to a ``Moments`` and
  finished at the ``every``-th (``window.py``); windows of one batch with
  fewer samples than features take the exact n x n Gram route in groups of
  ``lag`` steps (``onebatch.py``);
- ``EveryStep(lag=None)``: each step's own batch (a window of one step at
  every step);
- ``Probe(data, every=100)``: a fixed probe set evaluated in eval mode
  every ``every`` steps (``richness.torch.evaluate.collect``).

What is read: ``Head(module=None)`` (the head's input and output: DLR, NC1)
or ``Layer(module)`` (one layer's pooled output: the features-only
measures, ``layer.py``).

All five are plain values: their options are checked at construction and
never change after (``replace`` makes a changed copy), they compare by
their options and pickle, and any number of Monitors may share one. Each
Monitor starts its own run of its route and target (``_start``), which
holds that Monitor's state: the window's Moments, the one-batch group, the
head found on the first forward.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Optional, Tuple, TypeVar

import numpy as np

from .._checks import check_bool_or_none, check_int
from .._warnings import RichnessWarning
from ..finish.diagnostics import SPECTRAL
from ..torch.batches import POOLS, check_layout, check_tokens
from ..torch.evaluate import collect
from ..torch.hooks import HeadHook, resolve_head
from .capture import TrainingCapture, probe_batches, step_rows
from .layer import RECORD_MEASURES, layer_rows, monitor_measures, pooled_output, renumber, resolve_layer
from .onebatch import GroupMeta, OneBatchRoute, StepMeta, finish_group
from .window import WindowRoute

__all__ = ["Window", "EveryStep", "Probe", "Head", "Layer"]

_V = TypeVar("_V", bound="_Value")


def _num(v: Any) -> Optional[float]:
    return None if v is None or (isinstance(v, float) and not math.isfinite(v)) else float(v)


def _same(a: Any, b: Any) -> bool:
    """Options compare by value where they are plain values, else by identity (a tensor, a module, a loader)."""
    plain = (type(None), bool, int, float, str, tuple)
    return a is b or (isinstance(a, plain) and type(a) is type(b) and a == b)


def _shown(v: Any) -> str:
    return repr(v) if isinstance(v, (type(None), bool, int, float, str, tuple)) else f"<{type(v).__name__}>"


class _Value:
    """Options fixed at construction (``_fields``): compared, shown and
    copied (``replace``) by them; setting one afterwards is an error."""

    _fields: Tuple[str, ...] = ()

    def _set(self, **values: Any) -> None:
        for k, v in values.items():
            object.__setattr__(self, k, v)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is a fixed value: make a changed copy with replace({name}=...)")

    def replace(self: _V, **changes: Any) -> _V:
        """A copy with the options in ``changes`` replaced (checked again)."""
        unknown = sorted(set(changes) - set(self._fields))
        if unknown:
            raise TypeError(f"{type(self).__name__} has no option {unknown[0]!r}; its options: {self._fields}")
        return type(self)(**{**{f: getattr(self, f) for f in self._fields}, **changes})

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(_same(getattr(self, f), getattr(other, f)) for f in self._fields)

    __hash__ = None  # type: ignore[assignment]  # options may be tensors or modules

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{f}={_shown(getattr(self, f))}' for f in self._fields)})"


# -- what is read ---------------------------------------------------------------


class Head(_Value):
    """The head read by a Monitor: DLR (and NC1 with labels) from its input
    (the features) and output (the learned functions).

    Args:
        module: the read-out module or its dotted name; default: the last
            ``nn.Linear`` whose output is the model's output (found on the
            first forward).
        tokens: token selection for 3-D head inputs (see ``richness.evaluate``).
        wide: a linear head with more outputs than features (a language
            model's vocabulary): ``"weights"`` (default) finishes DLR from the
            head's weights at emission time and the window's features (no
            C x C Gram; the weights have moved since the window's first step);
            ``"outputs"`` streams the head's outputs as for any other head
            (the functions at the steps that made the features; a C x C Gram,
            8 C^2 bytes). Records say which in ``dlr_from``.
        measures: representation diagnostics to add to each record (names
            from ``richness.finish.MEASURES`` or ``"all"``): RankMe, alpha-ReQ
            and the participation ratio from the window's eigenvalues (or, at
            every step, the batch's n x n Gram's), NC2 with labels, NC3 with a
            linear head (windows of several steps only), LiDAR with labels
            read as object ids (not in one-batch windows of fewer rows than
            features: None there). Default: none (each costs a p x p
            eigenvalue decomposition per emission).
    """

    _fields: Tuple[str, ...] = ("module", "tokens", "wide", "measures")
    module: Any
    tokens: Any
    wide: str
    measures: tuple

    def __init__(self, module: Any = None, *, tokens: Any = "all", wide: str = "weights",
                 measures: Any = None) -> None:
        if module is not None and not isinstance(module, str) and not hasattr(module, "named_modules"):
            raise TypeError(f"head must be a submodule or its dotted name (str), got {type(module).__name__}")
        check_tokens(tokens)
        if wide not in ("weights", "outputs"):
            raise ValueError(f"wide must be 'weights' or 'outputs', got {wide!r}")
        self._set(module=module, tokens=tokens, wide=wide, measures=monitor_measures(measures, None))

    def _start(self, model: Any) -> "_HeadRun":
        return _HeadRun(self, model)


class Layer(_Value):
    """The features-only read, for self-supervised training (no head, no
    labels): one layer's output, pooled into rows. Records carry
    ``rankme``, ``alpha_req``, ``effective_dim`` and ``participation_ratio``
    of that representation (``dlr``, ``rank`` and ``nc1`` stay None; labels
    given to ``step`` are ignored unless LiDAR is asked for). Not with a head
    nor a ``Probe`` route.

    With ``measures`` naming ``"lidar"``, ``step(labels=ids)`` takes object
    ids, one integer per row of the step (both views of a two-view step): the
    rows that share an id in one step are augmentations of one input, and
    the same id in another step names another input. The window's records
    then carry ``lidar`` (Thilak et al., ICLR 2024; docs/MATH.md, LiDAR),
    None with a warning on steps without ids. Such windows always take the
    Moments route (the one-batch n x n route has no LiDAR), and a
    ``distributed`` route is refused (ids are per rank).

    Args:
        module: a module of the model or its dotted name.
        pool: how the layer's output becomes rows (``"mean"`` over spatial
            positions or tokens, ``"first"``/``"last"`` token, ``"flatten"``;
            ``richness.torch.batches.pool_rows``).
        layout: how the layer's 3-D output is laid out where its module does
            not say (a custom block): ``"tokens"`` (batch, tokens, width) or
            ``"channels"`` (batch, channels, positions); convolutions, pooling
            and normalisation of 1-D maps are channels, Linear, LayerNorm,
            attention and transformer layers tokens (``module_layout``).
        measures: the diagnostics to record, among the spectral ones
            (``richness.finish.diagnostics.SPECTRAL``) and ``"lidar"`` (NC2
            and NC3 need class labels and a head); default: the spectral ones.
    """

    _fields: Tuple[str, ...] = ("module", "pool", "layout", "measures")
    module: Any
    pool: str
    layout: Any
    measures: tuple

    def __init__(self, module: Any, *, pool: str = "mean", layout: Any = None, measures: Any = None) -> None:
        if isinstance(module, str) and module == "":
            raise ValueError("layer must name a submodule, got ''")
        if not isinstance(module, str) and not hasattr(module, "named_modules"):
            raise TypeError(f"layer must be a submodule or its dotted name (str), got {type(module).__name__}")
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        if layout is None or isinstance(layout, str):
            check_layout(layout)
        elif not isinstance(layout, Mapping):
            raise TypeError(f"layout must be 'tokens', 'channels', None or a dict layer -> layout, "
                            f"got {type(layout).__name__}")
        self._set(module=module, pool=pool, layout=layout, measures=monitor_measures(measures, module))

    def _start(self, model: Any) -> "_LayerRun":
        return _LayerRun(self, model)


class _HeadRun:
    """A ``Head`` in one Monitor: the module (found on the first forward
    when not given) and this step's rows of its captures."""

    features_only = False
    refused_what = "the head's input, output or labels"
    nonfinite_what = "the head's input or output"

    def __init__(self, spec: Head, model: Any) -> None:
        resolved = resolve_head(model, spec.module)
        self.name: Optional[str] = None
        self.head: Any = None
        if resolved is not None:
            self.name, self.head = resolved
        self.tokens, self.wide, self.measures = spec.tokens, spec.wide, spec.measures

    def found(self, name: str, head: Any) -> None:
        self.name, self.head = name, head

    def hook(self, mon: Any, model: Any) -> HeadHook:
        return HeadHook(TrainingCapture(mon), self.head, model=model, found=self.found)

    def step_rows(self, pending: list, labels: Any, check_labels: Callable[[bool], None]) -> tuple:
        """This step's (features, outputs, label keyword arguments), checked
        (``step_rows``); changes nothing. Captures before the step's own are
        dropped with a warning (at the caller of ``Monitor.step``)."""
        try:
            feats, outs, lk, first, dropped = step_rows(pending, labels, self.tokens)
        except (ValueError, TypeError, IndexError, RuntimeError) as e:
            raise ValueError(f"Monitor.step: {e}. The step was not counted and nothing was recorded: call step() "
                             "again with this step's labels") from None
        check_labels(bool(lk))
        if outs is None and not self.uses_weights():
            raise ValueError(f"the head {type(self.head).__name__} did not return a tensor")
        if first:
            warnings.warn(f"richness.Monitor: {first} training forward(s) of the head ({dropped} samples) before "
                          "this step's did not belong to it (a step skipped after its forward?); they are not "
                          "recorded", UserWarning, stacklevel=3)
        return feats, outs, lk

    def uses_weights(self) -> bool:
        """A window streams the head's outputs: they are the function at the
        step that produced the features (the head's weights at emission time
        have moved since), and B, A cost b p C + b C^2 / 2 per batch against
        p^2 C once per emission for the weights. Except for a linear head with
        more outputs than features (vocabularies): a C x C Gram is out of the
        question there, and the emission-time weights are used (docs/MATH.md,
        many outputs)."""
        import torch

        head = self.head
        return (self.wide == "weights" and isinstance(head, torch.nn.Linear)
                and head.out_features > head.in_features)

    def idle(self, steps: int) -> str:
        """The warning of a head that has not run after ``steps`` steps."""
        if self.head is None:
            what = ("no forward of the model has run, so its head was not found (training code that calls a "
                    "submodule directly bypasses the model's forward)")
        else:
            what = (f"its head {self.name!r} ({type(self.head).__name__}) has not run in a training "
                    "forward (with gradients enabled)")
        return (f"richness.Monitor: after {steps} steps {what}; no DLR is recorded. Choose the module "
                "whose input is the features with head= (the module or its dotted name)")


class _LayerRun:
    """A ``Layer`` in one Monitor: the module, how its output is pooled, and
    a step's rows (its captures concatenated; labels play no part)."""

    features_only = True
    refused_what = nonfinite_what = "the layer's output"
    head = None

    def __init__(self, spec: Layer, model: Any) -> None:
        self.name, self.module = resolve_layer(model, spec.module)
        self.pooled = pooled_output(self.name, spec.pool, self.module, spec.layout, model)
        self.measures = spec.measures
        self.reads_ids = "lidar" in spec.measures  # step(labels=...) are LiDAR's object ids

    def hook(self, mon: Any, model: Any) -> HeadHook:
        return HeadHook(TrainingCapture(mon, self.pooled), self.module)

    def step_rows(self, pending: list, labels: Any, check_labels: Callable[[bool], None]) -> Any:
        if not self.reads_ids:
            return layer_rows(pending)
        rows = layer_rows(pending, labels)
        check_labels(bool(rows[2]))
        return rows

    def uses_weights(self) -> bool:
        return False

    def idle(self, steps: int) -> str:
        return (f"richness.Monitor: after {steps} steps the layer {self.name!r} ({type(self.module).__name__}) "
                "has not run in a training forward (with gradients enabled); nothing is recorded. Choose a module "
                "that runs with layer=")


# -- routes ---------------------------------------------------------------------


def record(step: int, time: float, n: int, dlr: Any, rank: Any, nc1: Any, extra: dict, eff: Any, mode: str,
           dlr_range: Any = None, weights: bool = False, isotropic: Any = None, normalized: Any = None) -> dict:
    """A record: ``extra`` holds the representation diagnostics by name (and
    the effective dimension where they came with the eigenvalues);
    ``isotropic``, ``normalized``: the finite-sample reference and DLR read
    against it (``finish.isotropic``)."""
    eff = extra.get("effective_dim", eff)
    rec = {"step": step, "mode": mode, "n": int(n), "dlr": _num(dlr),
           "dlr_isotropic": _num(isotropic), "dlr_normalized": _num(normalized),
           "rank": None if rank is None else int(rank), "nc1": _num(nc1), "effective_dim": _num(eff)}
    rec.update({name: _num(extra.get(name)) for name in RECORD_MEASURES})
    rec.update(time=time, dlr_rtol_range=None if dlr_range is None else [_num(d) for d in dlr_range],
               dlr_from="weights" if weights else "outputs")
    return rec


class Route(_Value):
    """What the routes share: ``every`` (a record every ``every`` optimizer
    steps, counted from the first ``step()``) and ``distributed`` (merge the
    state of all ranks at each emission, ``Moments.all_reduce``, so that
    every rank emits the global value; every rank must call ``step()``
    equally often. None: off in a Monitor; in the Lightning and Hugging Face
    callbacks, on when the trainer runs on more than one process)."""

    every: int
    distributed: Optional[bool]

    def _start(self, mon: Any) -> Any:  # a run: the route's state in one Monitor
        raise NotImplementedError


class Window(Route):
    """The training batches of the last ``window`` steps before every
    ``every``-th step, added to a ``Moments`` and finished into a record
    there. A forward hook on the head keeps the training forwards (with
    gradients enabled) of those steps only.

    Args:
        every: a record every ``every`` optimizer steps.
        window: the steps of each record (``window <= every``; default
            ``min(10, every)``). The defaults (``every=100, window=10``)
            keep the hooks idle 90% of the time; a window of 10 batches of
            128 gives n = 1280 samples, so read docs/MATH.md, finite-sample
            bias (n well above p), before shrinking it.
        lag: windows of one step (``window=1``) with fewer samples than
            features are computed exactly from the n x n Gram of each batch,
            in groups of up to ``lag`` steps with batched products; their
            records arrive up to ``lag`` steps late. Grouping is what keeps
            every-step records cheap (the per-step cost is one copy of the
            head's input and output); ``lag=1`` computes each at its own step.
            Default: 16 on the CPU, 64 on a GPU (where a group's fixed cost is
            kernel launches, paid on the host while training waits for it).
            The buffered inputs of a group are capped at 32 MiB (its
            reduction's scratch takes about as much again).
        distributed: see ``Route``.
    """

    _fields: Tuple[str, ...] = ("every", "window", "lag", "distributed")
    window: int
    lag: Optional[int]

    def __init__(self, every: int = 100, window: Optional[int] = None, *, lag: Optional[int] = None,
                 distributed: Optional[bool] = None) -> None:
        every = check_int(every, "every", low=1)
        window = check_int(min(10, every) if window is None else window, "window", low=1, high=every,
                           what=f"an integer in [1, every={every}]")
        self._set(every=every, window=window, lag=check_int(lag, "lag", low=1, allow_none=True),
                  distributed=check_bool_or_none(distributed, "distributed"))

    def _start(self, mon: Any) -> "_WindowRun":
        return _WindowRun(self, mon)


class EveryStep(Window):
    """A record at every step from that step's own batch: ``Window(every=1,
    window=1, lag=lag)``. Batches with fewer samples than features take the
    exact n x n Gram route, in groups of up to ``lag`` steps (see
    ``Window``'s ``lag``); their records reach ``history`` and the sinks up
    to ``lag`` steps late (``Monitor.flush`` or closing emits the rest)."""

    _fields: Tuple[str, ...] = ("lag", "distributed")

    def __init__(self, lag: Optional[int] = None, *, distributed: Optional[bool] = None) -> None:
        super().__init__(1, 1, lag=lag, distributed=distributed)


class Probe(Route):
    """A fixed probe set evaluated in eval mode (train mode restored after)
    every ``every`` steps, its full report recorded (with the effective
    dimension and every diagnostic). No hook reads the training forwards.

    Args:
        data: a tensor, an ``(inputs, labels)`` pair or a re-iterable loader.
        every: a record every ``every`` optimizer steps.
        batch_fn: adapts the loader's batches (see ``richness.evaluate``).
        distributed: see ``Route``.
    """

    _fields: Tuple[str, ...] = ("data", "every", "batch_fn", "distributed")
    data: Any
    batch_fn: Optional[Callable]

    def __init__(self, data: Any, every: int = 100, *, batch_fn: Optional[Callable] = None,
                 distributed: Optional[bool] = None) -> None:
        probe_batches(data)  # a TypeError for what is none of the three
        if batch_fn is not None and not callable(batch_fn):
            raise TypeError(f"batch_fn must be a callable or None, got {type(batch_fn).__name__}")
        self._set(data=data, every=check_int(every, "every", low=1), batch_fn=batch_fn,
                  distributed=check_bool_or_none(distributed, "distributed"))

    def _start(self, mon: Any) -> "_ProbeRun":
        return _ProbeRun(self, mon)


# The core's refusals of a batch for its values (InputError.limit; both backends): NaN or Inf,
# co-moments that overflow, a spread whose squares underflow the products. A probe set refused for
# these is a diverged model, not a mistake.
_VALUE_REFUSALS = ("finite", "overflow", "underflow")


def _refused_values(e: Exception) -> bool:
    return getattr(e, "limit", None) in _VALUE_REFUSALS


class _WindowRun:
    """A ``Window`` in one Monitor (``mon``: its step label, precision,
    rtol, threads, target, records and warnings): the window's Moments
    (``WindowRoute``), the one-batch windows waiting for their reduction
    (``OneBatchRoute``), whether this step's window went there, and whether
    this window's steps gave labels."""

    reads_training = True

    def __init__(self, route: Window, mon: Any) -> None:
        self.route, self.mon = route, mon
        measures = mon._target.measures
        self.moments = WindowRoute(mon.precision, route.window)
        self.one_batch = OneBatchRoute(route.lag, mon.precision, mon.rtol, self._finish_records,
                                       eig=any(m in SPECTRAL for m in measures), raw_eig="rankme" in measures)
        self.deferred = False  # this step's window went to the one-batch route
        self.labels: Optional[bool] = None
        self.objects = 0  # LiDAR's objects in this window so far (a features-only target's ids, renumbered)
        if route.distributed and mon._target.features_only and "lidar" in measures:
            raise ValueError("LiDAR's object ids are per step and rank, so windows merged across ranks would mix "
                             "objects: drop 'lidar' from Layer(measures=...) or use distributed=False")

    def capturing(self, j: int) -> bool:
        """Whether the ``j``-th step (from 1) is one of a window's."""
        every = self.route.every
        return (j - 1) % every >= every - self.route.window

    def check_labels(self, given: bool) -> None:
        if self.labels is not None and self.labels != given:
            raise ValueError("Monitor.step got labels on some steps of a window and none on others")

    def add(self, feats: Any, outs: Any, lk: dict) -> None:
        """Add this step's checked rows to the window (or the one-batch group)."""
        mon, target = self.mon, self.mon._target
        if self.labels is None:
            self.labels = bool(lk)
        if target.features_only and "labels" in lk:  # object ids: this step's own objects in the window
            ids, count = renumber(lk["labels"], self.objects)
            lk = {"labels": ids}
            self.objects += count
        if self._one_batch_fits(feats, outs):
            meta = StepMeta(mon._step_label(), mon._elapsed())
            self.one_batch.add(feats, outs, lk.get("labels"), target.head, meta, mon._threads)
            self.deferred = True
            return
        parts = {"features": feats}
        if outs is not None and not target.uses_weights():
            parts["outputs"] = outs
        parts.update(lk)
        self.moments.add(parts, mon._threads, mon._step_label())

    def _one_batch_fits(self, feats: Any, outs: Any) -> bool:
        """A window of one batch with fewer rows than features (every step
        with a training batch of 128 and p = 512): its exact moments come
        cheaper from the n x n Gram, O(n^2 p), than from the p x p update,
        O(n p^2). (With window = 1 the Moments are empty between steps: each
        window is added and reset at its own emission; asking them for n
        could sync a GPU.) Not a features-only window asked for LiDAR: the
        n x n route has none."""
        target = self.mon._target
        n, p = int(feats.shape[0]), int(feats.shape[1])
        return (self.route.window == 1 and not self.route.distributed and 2 <= n < p
                and not (target.features_only and "lidar" in target.measures)
                and (outs is not None or target.features_only)
                and not target.uses_weights() and self.mon.precision in (None, "fp32", "fp64"))

    def _finish_records(self, meta: GroupMeta, v: np.ndarray) -> None:
        """Finish a reduced group's rows (``finish_group``) and emit their records."""
        mon, target = self.mon, self.mon._target
        bad = {m.step for m, norm_m in zip(meta.steps, v[:, 0]) if math.isnan(norm_m)}  # _to_unit_spread
        if bad:
            warnings.warn(f"richness.Monitor: {target.nonfinite_what} had NaN or Inf values at step(s) "
                          f"{', '.join(map(str, sorted(bad)))}: their records have n 0 and dlr, rank and nc1 None",
                          RichnessWarning, stacklevel=5)
        dlrs, ranks, nc1s, extra = finish_group(v, meta, target.measures)
        for i, (m, dlr, rank, nc1) in enumerate(zip(meta.steps, dlrs, ranks, nc1s)):
            row = {name: values[i] for name, values in extra.items()}
            rec = record(m.step, m.time, 0 if m.step in bad else meta.n, dlr, rank, nc1, row, None, "window",
                         isotropic=row.get("dlr_isotropic"), normalized=row.get("dlr_normalized"))
            if m.step not in bad:  # a bad step is warned about above
                mon._warn_small_window(meta.n, meta.p)
                # per-batch states carry no weights (NC3) and the n x n route has no LiDAR: None
                mon._warn_undefined(rec, (), skip=("nc3", "lidar"))
            mon._dispatch(rec)

    def poll(self) -> None:
        self.one_batch.poll()

    def after_step(self, step: int) -> None:
        if self.one_batch.due(step):
            self.one_batch.reduce(self.mon._threads)

    def flush(self) -> None:
        """Finish the queued one-batch windows (waiting for the GPU if needed) and emit them."""
        self.one_batch.reduce(self.mon._threads)
        self.one_batch.poll(wait=True)

    def emit(self) -> Optional[dict]:
        """The record of the window ending at this step; None when it went to
        the one-batch group (its record comes from there, at most ``lag``
        steps later) or had fewer than 2 samples."""
        if self.deferred:
            self.deferred = False
            self.labels = None
            self.objects = 0
            return None
        self.flush()  # queued records first: history stays in step order
        import torch

        mon, target = self.mon, self.mon._target
        try:
            head = target.head if target.uses_weights() else None
            linear = target.head if isinstance(target.head, torch.nn.Linear) else None
            # a layer's labels are LiDAR's object ids, not classes: no NC1 over them
            values = self.moments.finish(mon._threads, bool(self.route.distributed), mon.rtol, head,
                                         target.measures, linear, with_nc1=not target.features_only)
        finally:
            self.labels = None
            self.objects = 0
        if values is None:
            return None
        q = values.dlr
        rec = record(mon._step_label(), mon._elapsed(), q.n, q.dlr, q.rank, q.nc1, values.extra, None, "window",
                     q.dlr_range, head is not None, values.isotropic, values.normalized)
        if head is not None and q.dlr is None and not bool(torch.isfinite(head.weight).all()):
            warnings.warn(f"richness.Monitor: step {mon._step_label()}: the head's weights have NaN or Inf values "
                          "(has training diverged?): the record's dlr and rank are None", RichnessWarning,
                          stacklevel=3)
        if q.n >= 2:  # else every step of the window was refused, and warned about
            mon._warn_small_window(q.n, values.p)
            mon._warn_undefined(rec, values.extra.get("warnings"))
        return rec

    def warn_refused(self) -> None:
        """Warn of the steps the window's Moments refused (``WindowRoute``)."""
        what = self.mon._target.refused_what
        for step, why in self.moments.take_refused():
            warnings.warn(f"richness.Monitor: step {step}: {what} refused ({why}); the step is left out of its "
                          "window, whose record comes from its other steps (with none: n 0, dlr, rank and nc1 "
                          "None)", RichnessWarning, stacklevel=3)

    def small_fix(self, n: int, need: int) -> str:
        """How to reach ``need`` rows from a record of ``n``."""
        route = self.route
        per_step = n / route.window
        w = max(route.window + 1, math.ceil(need / per_step))
        return (f"widen the window: window={w} (with every={max(route.every, w)} or more: window <= every) "
                f"gives about {round(w * per_step)} rows at this batch size")

    def close(self) -> None:
        self.one_batch.group = self.moments.buf = None


class _ProbeRun:
    """A ``Probe`` in one Monitor: the probe set, evaluated at each emission."""

    reads_training = False

    def __init__(self, route: Probe, mon: Any) -> None:
        self.route, self.mon = route, mon
        self.batches = probe_batches(route.data)

    def capturing(self, j: int) -> bool:
        return False

    def check_labels(self, given: bool) -> None:
        pass

    def add(self, feats: Any, outs: Any, lk: dict) -> None:
        pass

    def poll(self) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def warn_refused(self) -> None:
        pass

    def close(self) -> None:
        pass

    def small_fix(self, n: int, need: int) -> str:
        return f"use a probe set of at least {need} samples (Probe)"

    def emit(self) -> Optional[dict]:
        import torch

        mon, target = self.mon, self.mon._target
        distributed = bool(self.route.distributed)
        try:
            moments, head = collect(mon.model, self.batches, head=target.head, precision=mon.precision,
                                    progress=False, batch_fn=self.route.batch_fn, tokens=target.tokens,
                                    allow_empty=distributed)
        except ValueError as e:
            if not _refused_values(e):
                raise
            warnings.warn(f"richness.Monitor: step {mon._step_label()}: the probe set's activations were refused "
                          f"({e}); its record has n 0 and dlr, rank and nc1 None (has training diverged?)",
                          RichnessWarning, stacklevel=3)
            return record(mon._step_label(), mon._elapsed(), 0, None, None, None, {}, None, "probe")
        if distributed:
            moments.all_reduce()
        if target.head is None:
            target.head = head
        try:
            rep = moments.compute(head_weights=head if isinstance(head, torch.nn.Linear) else None, rtol=mon.rtol)
        except ValueError as e:
            warnings.warn(f"richness.Monitor: step {mon._step_label()}: the probe set's DLR is undefined ({e}); "
                          "its record has dlr, rank and nc1 None", RichnessWarning, stacklevel=3)
            return record(mon._step_label(), mon._elapsed(), moments.n, None, None, None, {}, None, "probe")
        extra = {name: getattr(rep, name) for name in RECORD_MEASURES}  # the full report has them all
        if rep.eigenvalues is not None:
            mon._warn_small_window(rep.n, len(rep.eigenvalues))
        return record(mon._step_label(), mon._elapsed(), rep.n, rep.dlr, rep.rank, rep.nc1, extra,
                      rep.effective_dim, "probe", rep.dlr_rtol_range, isinstance(head, torch.nn.Linear),
                      rep.dlr_isotropic, rep.dlr_normalized)
