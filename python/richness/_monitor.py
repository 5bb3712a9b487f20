"""``richness.Monitor``: DLR during training, at a cost the step does not notice.

Window mode (default): a forward hook on the head captures the training
batches of the last ``window`` steps before every ``every``-th step; each
``step()`` copies the captured batch into the window's buffer and drops it; at
every ``every``-th step the window is added to a ``Moments`` as one batch, and
DLR (and NC1 with labels) is finished from it and emitted. Windows of one batch with fewer samples than features (every=1)
take a cheaper exact route: each step's head input and output are copied into
a buffer, and groups of up to ``lag`` steps are reduced at once from the n x n
Gram of each batch (``_BatchGroup``). Probe mode (``probe=``): every ``every``
steps a fixed probe set is evaluated in eval mode (train mode restored after)
and its full report emitted.

The only host synchronisation is at emission (finishing the state); ``update``
never calls ``.item()`` or copies to the host (on a GPU the CUDA backend runs
on the caller's stream). Boolean token masks are the exception: indexing with
them syncs.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import time
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional

import numpy as np

from . import _adapt, _core, _finish
from ._evaluate import (BlasThreads, HeadFinder, check_tokens, collect, label_kwargs,
                        require_torch, resolve_head, select_rows)
from ._moments import Moments

FIELDS = ("step", "mode", "n", "dlr", "rank", "nc1", "effective_dim", "time")


class _CsvSink:
    def __init__(self, path: str) -> None:
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        self.f = open(path, "a", newline="")
        self.w = csv.DictWriter(self.f, fieldnames=FIELDS)
        if new:
            self.w.writeheader()
            self.f.flush()

    def __call__(self, rec: dict) -> None:
        self.w.writerow({k: ("" if rec.get(k) is None else rec.get(k)) for k in FIELDS})
        self.f.flush()

    def close(self) -> None:
        self.f.close()


class _JsonlSink:
    def __init__(self, path: str) -> None:
        self.f = open(path, "a")

    def __call__(self, rec: dict) -> None:
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


class _TensorBoardSink:
    def __init__(self, writer: Any, prefix: str) -> None:
        self.writer, self.prefix = writer, prefix

    def __call__(self, rec: dict) -> None:
        for key in ("dlr", "nc1", "effective_dim"):
            v = rec.get(key)
            if v is not None:
                self.writer.add_scalar(f"{self.prefix}/{key}", v, rec["step"])

    def close(self) -> None:
        pass


class _CallbackSink:
    def __init__(self, fn: Callable[[dict], Any]) -> None:
        self.fn = fn

    def __call__(self, rec: dict) -> None:
        self.fn(rec)

    def close(self) -> None:
        pass


def _make_sinks(log: Any, prefix: str) -> list:
    if log is None:
        return []
    if isinstance(log, (list, tuple)):
        return [s for item in log for s in _make_sinks(item, prefix)]
    if isinstance(log, (str, os.PathLike)):
        path = os.fspath(log)
        if path.endswith(".csv"):
            return [_CsvSink(path)]
        if path.endswith(".jsonl") or path.endswith(".json"):
            return [_JsonlSink(path)]
        raise ValueError(f"log file {path!r}: use a .csv or .jsonl name")
    if hasattr(log, "add_scalar"):
        return [_TensorBoardSink(log, prefix)]
    if callable(log):
        return [_CallbackSink(log)]
    raise TypeError(f"log must be a .csv/.jsonl path, a callable, a SummaryWriter or a list of them, "
                    f"got {type(log).__name__}")


def _probe_batches(probe: Any) -> Iterable:
    import torch

    if isinstance(probe, torch.Tensor):
        return [(probe,)]
    if isinstance(probe, tuple) and len(probe) == 2 and isinstance(probe[0], torch.Tensor):
        return [probe]
    if hasattr(probe, "__iter__"):
        return probe
    raise TypeError(f"probe must be a tensor, an (inputs, labels) pair or a re-iterable loader, "
                    f"got {type(probe).__name__}")


def _num(v: Any) -> Optional[float]:
    return None if v is None or (isinstance(v, float) and not math.isfinite(v)) else float(v)


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
            the finite-sample bias note in SPEC.md (n well above p) before
            shrinking it.
        probe: probe mode instead: a tensor, an ``(inputs, labels)`` pair or a
            re-iterable loader evaluated in eval mode at every emission (train
            mode restored after); the emitted record then also has the
            effective dimension.
        log: where records go: a ``.csv`` or ``.jsonl`` path (appended), a
            callable taking the record dict, a TensorBoard ``SummaryWriter``
            (``add_scalar("richness/dlr", ...)``), or a list of these.
        precision: precision of the products (``Moments``); default by dtype.
        tokens: token selection for 3-D head inputs (see ``richness.evaluate``).
        batch_fn: adapts probe-loader batches (see ``richness.evaluate``).
        rtol: eigenvalue cut (default by precision, SPEC.md).
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

    Use as a context manager (hooks removed on exit) and call ``step(labels)``
    after every optimizer step. Window mode captures the head's forwards that
    run with gradients enabled (training steps, whatever the modules' train/eval
    mode); forwards under ``torch.no_grad()`` (validation) are ignored. ``history`` holds the emitted records
    ``{step, mode, n, dlr, rank, nc1, effective_dim, time}``.

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
                 distributed: bool = False, lag: Optional[int] = None, first_step: int = 1) -> None:
        torch = require_torch("richness.Monitor")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive integer, got {every!r}")
        if window is None:
            window = min(10, every)
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= every:
            raise ValueError(f"window must be an integer in [1, every={every}], got {window!r}")
        if lag is not None and (isinstance(lag, bool) or not isinstance(lag, int) or lag < 1):
            raise ValueError(f"lag must be a positive integer or None, got {lag!r}")
        if isinstance(first_step, bool) or not isinstance(first_step, int):
            raise ValueError(f"first_step must be an integer, got {first_step!r}")
        check_tokens(tokens)
        self.model = model
        self.first_step = first_step
        self.every, self.window = every, window
        self.precision, self.tokens, self.batch_fn, self.rtol = precision, tokens, batch_fn, rtol
        self.distributed = bool(distributed)
        self.probe = None if probe is None else _probe_batches(probe)
        self.history: List[Dict[str, Any]] = []
        self.steps = 0
        resolved = resolve_head(model, head)
        self._head_name, self._head = (resolved if resolved is not None else (None, None))
        self._sinks = _make_sinks(log, prefix)
        self._moments = Moments(precision=precision)
        self._pending: list = []
        self.lag = lag
        self._group: Optional[_BatchGroup] = None  # one-batch windows waiting for one batched reduction
        self._deferred = False  # this step's window went to the group
        self._window_buf: Optional[_StepBuffer] = None  # the window's steps, added at emission
        self._inflight: list = []  # (meta, pinned host buffer, CUDA event) of records on their way
        self._classes: Optional[int] = None
        self._window_labels: Optional[bool] = None
        self._active = self._is_window_step(1)
        self._capture: Optional[_PendingCapture] = None
        self._finder: Optional[HeadFinder] = None
        self._model_hook = None
        self._closed = False
        self._head_ran = False  # set by the head's hook; a head that never runs is warned about once
        self._t0 = time.time()
        if self.probe is None:
            if self._head is not None:
                self._capture = _PendingCapture(self._head, self)
            else:
                self._finder = HeadFinder(model)
                self._model_hook = model.register_forward_hook(self._on_model_output)
        # Restored by close(). One core worker below 2^30 multiply-adds (the
        # default window's update, 1,280 x 512^2, is 3.4e8): right after a
        # training step torch's OpenMP threads are still spinning, and a second
        # worker contends with them instead of helping (bench_monitor.py, torch
        # on 2 threads: default settings +1.1-1.2% with one worker, +1.9-2.7%
        # with two; RESULTS_INTEGRATION.md).
        self._threads = BlasThreads(small=2 ** 30)

    # -- hooks ----------------------------------------------------------------

    def _hook_active(self) -> bool:
        import torch

        return self._active and torch.is_grad_enabled()

    def _is_window_step(self, j: int) -> bool:
        return (j - 1) % self.every >= self.every - self.window

    def _on_model_output(self, mod, args, out) -> None:
        finder = self._finder
        if finder is None:
            return
        try:
            name, head, x, y = finder.result(out)
        finally:
            finder.remove()
            self._finder = None
            self._model_hook.remove()
            self._model_hook = None
        self._head_name, self._head = name, head
        self._head_ran = self._head_ran or (x is not None and _grad_enabled())
        self._capture = _PendingCapture(head, self)
        if x is not None and self._hook_active():
            self._pending.append((x.detach(), y.detach() if hasattr(y, "detach") else y))

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
        waiting for the device); ``flush()`` or closing emits the rest."""
        if self._closed:
            raise RuntimeError("this Monitor is closed")
        if self._inflight:
            self._poll()
        self.steps += 1
        rec = None
        try:
            if self.probe is None and self._pending:
                self._consume(labels)
        finally:
            self._pending = []
        if self.steps >= self.every and not self._head_ran and self.probe is None:
            self._warn_head_idle()
        if self.steps % self.every == 0:
            rec = self._emit()
        g = self._group
        if g is not None and g.metas and (len(g.metas) >= g.capacity or self.steps - g.metas[0][0] + 1 >= g.lag):
            self._reduce_group()
        self._active = self.probe is None and self._is_window_step(self.steps + 1)
        return rec

    def _warn_head_idle(self) -> None:
        # A head given by the user (or found on the model's first forward) that
        # never runs in a training forward leaves every record empty.
        self._head_ran = True  # once
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

    def _consume(self, labels: Any) -> None:
        import torch

        rows = [select_rows(x, y, None, tokens=self.tokens) for x, y in self._pending]
        if len(rows) == 1:
            feats, outs, _ = rows[0]
        else:
            feats = torch.cat([r[0] for r in rows])
            outs = torch.cat([r[1] for r in rows]) if all(r[1] is not None for r in rows) else None
        if labels is not None and isinstance(labels, torch.Tensor) and labels.ndim >= 2 \
                and feats.shape[0] != labels.shape[0] and len(rows) == 1:
            # per-token labels of a sequence batch: follow the token selection
            x, y = self._pending[0]
            feats, outs, labels = select_rows(x, y, labels, tokens=self.tokens)
        lk = label_kwargs(labels, feats.shape[0], feats.device)
        has = bool(lk)
        if self._window_labels is None:
            self._window_labels = has
        elif self._window_labels != has:
            raise ValueError("Monitor.step got labels on some steps of a window and none on others")
        if self._batch_path_fits(feats, outs):
            self._defer(feats, outs, lk.get("labels"))
            return
        parts = {"features": feats}
        if not self._uses_weights():
            if outs is None:
                raise ValueError(f"the head {type(self._head).__name__} did not return a tensor")
            parts["outputs"] = outs
        parts.update(lk)
        w = self._window_buf
        if w is not None and not w.fits(parts):
            self._update_window()
            if not w.fits(parts):
                w = None
        if w is None:
            w = self._window_buf = _StepBuffer(parts, self.window)
        w.add(parts)

    def _update_window(self) -> None:
        """Add the buffered steps of the window to the Moments as one batch: one
        update of window x n rows instead of one per step (one merge, one call,
        larger products; on a GPU a few launches per window instead of per step)."""
        w = self._window_buf
        if w is None or not w.metas:
            return
        try:
            rows = w.rows()
            self._threads.set_for(rows["features"])
            self._moments.update(**rows)
        finally:
            w.clear()

    def _batch_path_fits(self, feats: Any, outs: Any) -> bool:
        """A window of one batch with fewer rows than features (every=1 with a
        training batch of 128 and p = 512): its exact moments come cheaper from
        the n x n Gram, O(n^2 p), than from the p x p update, O(n p^2). (With
        window = 1 the Moments are empty between steps: each window is added
        and reset at its own emission; asking them for n could sync a GPU.)"""
        n, p = int(feats.shape[0]), int(feats.shape[1])
        return (self.window == 1 and not self.distributed and 2 <= n < p and outs is not None
                and not self._uses_weights() and self.precision in (None, "fp32", "fp64"))

    def _defer(self, feats: Any, outs: Any, labels: Any) -> None:
        """Queue this step's one-batch window in the group (see ``_BatchGroup``)."""
        import torch

        parts = {"features": feats, "outputs": outs}
        if labels is not None:
            parts["labels"] = labels
        g = self._group
        if g is not None and not g.fits(parts):
            self._reduce_group()
            g = self._group = None
        if g is None:
            if labels is not None and self._classes is None:
                head = self._head
                self._classes = (head.out_features if isinstance(head, torch.nn.Linear)
                                 else int(labels.max()) + 1)  # one sync, on the first group only
            lag = self.lag if self.lag is not None else (16 if feats.device.type == "cpu" else 64)
            g = self._group = _BatchGroup(parts, lag, self._classes or 0)
        g.add(parts, (self._step_label(), round(time.time() - self._t0, 6)))
        self._deferred = True

    def _reduce_group(self) -> None:
        """Reduce the queued one-batch windows. On the CPU their records are
        finished and dispatched at once; on a GPU the small matrices are copied
        to pinned host memory behind a CUDA event, and a later ``step()`` (or
        ``flush()``) finishes them once the event has passed: the training loop
        never waits."""
        import torch

        g = self._group
        if g is None or not g.metas:
            return
        x, f = g.x, g.f
        all64 = x.dtype == torch.float64 and f.dtype == torch.float64
        prec = self.precision or ("fp64" if all64 else "fp32")
        rtol = self.rtol if self.rtol is not None else _finish.DEFAULT_RTOL[prec]
        try:
            packed = g.reduce(prec, self._threads)
            n = int(x.shape[1])
            meta = (list(g.metas), n, n if g.sample_space else int(f.shape[2]),
                    g.label_cols if g.y is not None else 0, rtol, g.sample_space)
        finally:
            g.clear()  # the buffers are reused by the next group (same stream: ordered)
        if packed.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=torch.float64, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(packed.device))
            self._inflight.append((meta, host, event))
        else:
            self._finish_records(meta, packed.numpy())

    def _finish_records(self, meta: tuple, v: np.ndarray) -> None:
        metas, n, c, k, rtol, sample_space = meta
        for (step, t), dlr, rank, nc1 in zip(metas, *_finish_group(v, n, c, k, rtol, sample_space)):
            self._dispatch({"step": step, "mode": "window", "n": n, "dlr": _num(dlr), "rank": rank,
                            "nc1": _num(nc1), "effective_dim": None, "time": t})

    def _poll(self, wait: bool = False) -> None:
        """Finish and dispatch device records whose copy has landed (all of them when ``wait``)."""
        while self._inflight:
            meta, host, event = self._inflight[0]
            if not wait and not event.query():
                return
            event.synchronize()
            self._inflight.pop(0)
            self._finish_records(meta, host.numpy())

    def flush(self) -> None:
        """Finish the queued one-batch windows (waiting for the GPU if needed) and emit them."""
        self._reduce_group()
        self._poll(wait=True)

    def _uses_weights(self) -> bool:
        """Window mode streams the head's outputs: they are the function at the
        step that produced the features (the head's weights at emission time
        have moved since), and B, A cost b p C + b C^2 / 2 per batch against
        p^2 C once per emission for the weights. Except for a linear head with
        more outputs than features (vocabularies): a C x C Gram is out of the
        question there, and the emission-time weights are used (SPEC.md, many
        outputs)."""
        import torch

        head = self._head
        return isinstance(head, torch.nn.Linear) and head.out_features > head.in_features

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

    def _dispatch(self, rec: dict) -> None:
        self.history.append(rec)
        for sink in self._sinks:
            sink(rec)

    def _record(self, n: int, dlr: Any, rank: Any, nc1: Any, eff: Any, mode: str) -> dict:
        return {"step": self._step_label(), "mode": mode, "n": int(n), "dlr": _num(dlr),
                "rank": None if rank is None else int(rank), "nc1": _num(nc1), "effective_dim": _num(eff),
                "time": round(time.time() - self._t0, 6)}

    def _emit_window(self) -> Optional[dict]:
        if self._deferred:  # the record comes from the group, at most `lag` steps later
            self._deferred = False
            self._window_labels = None
            return None
        self.flush()  # queued records first: history stays in step order
        m = self._moments
        try:
            self._update_window()
            if self.distributed:
                m.all_reduce()  # collective: all ranks emit at the same step
            if m.n < 2:
                return None
            import torch

            st = m.state_dict()  # the one host sync
            rtol = self.rtol if self.rtol is not None else _finish.DEFAULT_RTOL[st["precision"]]
            # Finish with torch float64 CPU tensors (zero-copy views of the state):
            # the math then runs on torch's own thread pool, the one training
            # uses, instead of waking numpy's BLAS threads every emission.
            st = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in st.items()}
            dlr = rank = nc1 = None
            try:
                W = None
                if self._uses_weights():
                    W = self._head.weight.detach().to("cpu", torch.float64)
                dlr, rank = _finish.dlr_of_state(st, W, rtol)
            except ValueError:
                pass  # constant features or outputs: DLR undefined, reported as None
            if st["k"] > 0 and st["precision"] in _finish.NC1_RELIABLE:
                nc1 = _finish.nc1(st, rtol)
            return self._record(st["n"], dlr, rank, nc1, None, "window")
        finally:
            m.reset()
            self._window_labels = None

    def _emit_probe(self) -> Optional[dict]:
        import torch

        moments, head = collect(self.model, self.probe, head=self._head, precision=self.precision, progress=False,
                                batch_fn=self.batch_fn, tokens=self.tokens, allow_empty=self.distributed)
        if self.distributed:
            moments.all_reduce()
        if self._head is None:
            self._head = head
        try:
            rep = moments.compute(head=head if isinstance(head, torch.nn.Linear) else None, rtol=self.rtol)
        except ValueError:
            return self._record(moments.n, None, None, None, None, "probe")
        return self._record(rep.n, rep.dlr, rep.rank, rep.nc1, rep.effective_dim, "probe")

    # -- lifetime -------------------------------------------------------------

    def close(self) -> None:
        """Remove the hooks, close log files, restore the BLAS thread count."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()  # queued records, and those still on their way from the GPU
        finally:
            self._pending = []
            self._group = self._window_buf = None
            if self._capture is not None:
                self._capture.remove()
            if self._finder is not None:
                self._finder.remove()
            if self._model_hook is not None:
                self._model_hook.remove()
            for s in self._sinks:
                s.close()
            self._threads.restore()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "probe" if self.probe is not None else f"window={self.window}"
        return f"Monitor(head={self._head_name!r}, every={self.every}, {mode}, steps={self.steps})"


def _grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()


class _PendingCapture:
    """Forward hook on the head: queues (features, outputs) of the training
    forwards of window steps until ``Monitor.step`` consumes them."""

    def __init__(self, module: Any, mon: Monitor) -> None:
        self.mon = mon
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, mod, args, out) -> None:
        mon = self.mon
        if _grad_enabled():
            mon._head_ran = True
        # training forwards run with gradients; validation under no_grad is skipped
        if mon._active and args and _grad_enabled():
            mon._pending.append((args[0].detach(), out.detach() if hasattr(out, "detach") else out))

    def remove(self) -> None:
        self.handle.remove()


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


@contextlib.contextmanager
def _ieee_matmul(device_type: str) -> Iterator[None]:
    """True float32 matrix products for the duration of the block, on the
    buffers' backend (CUDA or oneDNN on the CPU), then the caller's setting
    back. Training loops often allow TF32 or bf16 for their own float32
    products (``torch.set_float32_matmul_precision("high")``, or
    ``allow_tf32``); the Monitor's fp32 DLR (within 1e-6) needs IEEE
    products. Nothing is touched where IEEE is already the setting (torch's
    default). The setting is changed through the API the caller used: torch
    >= 2.9 refuses to mix the legacy and the per-backend ones."""
    import torch

    backend = getattr(torch.backends.cuda if device_type == "cuda" else torch.backends.mkldnn, "matmul", None)
    current = getattr(backend, "fp32_precision", None)  # per-backend API (torch >= 2.9); mirrors the legacy one
    effective = getattr(torch.backends, "fp32_precision", "none") if current == "none" else current
    try:
        legacy: Optional[str] = torch.get_float32_matmul_precision()
    except RuntimeError:  # the per-backend API is in use: reading the legacy one raises
        legacy = None
    if effective in ("ieee", "none") or (effective is None and legacy == "highest"):
        yield
    elif legacy is not None:
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(legacy)
    else:
        backend.fp32_precision = "ieee"
        try:
            yield
        finally:
            backend.fp32_precision = current


class _StepBuffer:
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


class _BatchGroup(_StepBuffer):
    """One-batch windows (``window=1`` with fewer rows than features, as with
    every=1) waiting to be reduced together: ``reduce`` turns all of them at
    once into a handful of small float64 matrices per step, with batched
    products, so that the per-step cost is the copy and the fixed costs of the
    reduction (Python, kernel launches, cold caches after the training step)
    are paid once per group."""

    def __init__(self, parts: Dict[str, Any], lag: int, classes: int) -> None:
        super().__init__(parts, lag)
        self.lag = lag
        feats, outs = parts["features"], parts["outputs"]
        self.x, self.f, self.y = self.bufs["features"], self.bufs["outputs"], self.bufs.get("labels")
        self.classes = classes
        # NC1 needs only the classes present in a batch, at most n of them: with
        # more classes than samples (ImageNet's 1,000 and a batch of 256) each
        # step's classes are renumbered 0..n-1, so that its k x k matrices are
        # n x n (a 1,000-class k x k pair is 16 MB a step, and its host eigh
        # costs more than the training step).
        self.label_cols = min(classes, int(feats.shape[0]))
        self.sample_space = int(outs.shape[1]) > int(feats.shape[0])  # more outputs than samples: n x n forms
        self.grams: Any = None  # reduction scratch, made on the first reduce
        self.centered: Any = None

    def reduce(self, prec: str, threads: BlasThreads) -> Any:
        """See ``_reduce``; its products in true float32 whatever the training
        loop allows for its own (``_ieee_matmul``)."""
        with _ieee_matmul(self.x.device.type):
            return self._reduce(prec, threads)

    def _reduce(self, prec: str, threads: BlasThreads) -> Any:
        """The small matrices of every buffered step, one row each: a (steps, m)
        float64 tensor on the buffers' device. Issues no host synchronisation.

        Everything comes from the n x n Gram G = Xc Xc^T of each batch (the
        one product of size p; the rest is O(n^2 (C + K))), all products in
        the product precision: ||M||_F = ||G||_F; with C <= n outputs,
        A = Fc^T Fc and Q = B^T B = Fc^T G Fc (C x C); with more outputs than
        samples, A = Fc Fc^T and G itself (n x n: the projector onto the
        outputs' span in sample space); for NC1, with Yn the class-indicator
        matrix divided by the class counts, D = Yn^T Xc are the class means of
        Xc, so D D^T = Yn^T G Yn and D M D^T = (G Yn)^T (G Yn). Each batch is
        centered on its own mean before the products."""
        import torch

        f64 = torch.float64
        pdt = torch.float64 if prec == "fp64" else torch.float32
        j = len(self.metas)
        x = self.x
        core = _core_route(x)
        # Scratch kept across groups (fresh temporaries of this size page-fault
        # on every group): the Grams, and the centered rows on the torch route.
        if self.grams is None or self.grams.dtype != pdt:
            self.grams = torch.empty((x.shape[0], x.shape[1], x.shape[1]), dtype=pdt, device=x.device)
            self.centered = None
        X = x[:j]
        G = self.grams[:j]  # steps x n x n
        if core:
            # the core: float64 means, centering before narrowing, one syrk per
            # batch, on at most torch's thread count
            threads.set_for_work(j * int(x.shape[1]) ** 2 * int(x.shape[2]))
            norm_m = torch.empty(j, dtype=f64)
            _core.centered_grams(_adapt.as_matrix(X.reshape(-1, X.shape[2]), "features").arg(), X.shape[1],
                                 prec, G.data_ptr(), norm_m.data_ptr())
        else:
            # Compensated centering on the device (SPEC.md: "computed in float64
            # (or compensated)"): x - m is exact where x is within a factor 2 of
            # m (Sterbenz), and the second pass removes what the first mean's
            # rounding left, now at the scale of the spread: a mean of 1e4 with a
            # spread of 1e-2 still gives DLR to 1e-6. Two fast passes in the
            # product precision instead of a float64 copy of the buffer.
            if self.centered is None:
                self.centered = torch.empty(x.shape, dtype=pdt, device=x.device)
            Xc = torch.sub(X, torch.mean(X, dim=1, keepdim=True, dtype=pdt), out=self.centered[:j])
            Xc.sub_(Xc.mean(dim=1, keepdim=True))
            torch.bmm(Xc, Xc.transpose(1, 2), out=G)
            norm_m = torch.linalg.vector_norm(G, dim=(1, 2)).to(f64)  # a float32 G's own accuracy
        F64 = self.f[:j].to(f64, copy=True)
        Fc64 = F64.sub_(F64.mean(dim=1, keepdim=True))
        Fc = Fc64.to(pdt)
        labels = self.y is not None and self.classes > 0
        if labels:
            k = self.classes
            lab = self.y[:j].long()
            valid = (lab >= 0) & (lab < k)
            kk = self.label_cols
            col = lab.clamp(0, k - 1) if kk == k else _batch_class_ids(lab, valid, k)
            Y = torch.zeros(lab.shape + (kk,), dtype=pdt, device=lab.device).scatter_(
                2, col[..., None], valid.to(pdt)[..., None])
            counts = Y.sum(dim=1)  # steps x kk
            Yn = Y.div_(counts.clamp(min=1.0)[:, None, :])
        if self.sample_space:
            A = torch.bmm(Fc, Fc.transpose(1, 2)).to(f64)
            Q = G.to(f64)
            Z = Yn if labels else None
        else:
            A = torch.bmm(Fc.transpose(1, 2), Fc).to(f64)
            Z = torch.cat([Fc, Yn], dim=2) if labels else Fc
        if Z is not None:
            H = torch.bmm(G, Z)  # G [Fc | Yn]
            W = torch.bmm(Z.transpose(1, 2), H).to(f64)
        c = int(Fc.shape[2])
        parts = [norm_m[:, None], A.reshape(j, -1)]
        if not self.sample_space:
            Q = W[:, :c, :c]
        parts.append(Q.reshape(j, -1))
        if labels:
            off = 0 if self.sample_space else c
            E = H[:, :, off:]  # Xc D^T
            parts += [counts.to(f64), W[:, off:, off:].reshape(j, -1),
                      torch.bmm(E.transpose(1, 2), E).to(f64).reshape(j, -1),
                      (~valid).sum(dim=1).to(f64)[:, None]]
        return torch.cat(parts, dim=1)


def _batch_class_ids(lab: Any, valid: Any, k: int) -> Any:
    """Each sample's class renumbered within its own step, in order of class
    (steps x n, values in 0..n-1), with fixed shapes and no host sync: sort
    each row, count the distinct labels before each position. Samples with
    invalid labels share one number past the valid ones (they carry zero
    weight)."""
    import torch

    key, order = torch.where(valid, lab, k).sort(dim=1)
    new = torch.ones_like(key, dtype=torch.bool)
    new[:, 1:] = key[:, 1:] != key[:, :-1]
    return torch.empty_like(key).scatter_(1, order, new.cumsum(dim=1) - 1)


def _finish_group(v: np.ndarray, n: int, c: int, k: int, rtol: float, sample_space: bool) -> tuple:
    """DLR, rank and NC1 of each row of ``_BatchGroup.reduce`` (float64, host):
    three lists, None where a value is undefined (constant features or
    outputs; fewer than two classes; labels outside the head's classes).
    ``c`` is the side of A and Q (C, or n in sample space); ``k`` the class
    columns (the classes, or n when renumbered within each step)."""
    steps = v.shape[0]
    norm_m = v[:, 0]
    A = v[:, 1:1 + c * c].reshape(steps, c, c)
    Q = v[:, 1 + c * c:1 + 2 * c * c].reshape(steps, c, c)
    a, U = np.linalg.eigh((A + A.transpose(0, 2, 1)) / 2)
    a, U = a[:, ::-1], U[:, :, ::-1]
    top = a[:, :1]
    keep = (a > rtol * top) & (top > 0.0)
    rank = keep.sum(axis=1)
    # <G, P> over the kept eigenpairs (a_i, u_i) of A: ||B u_i||^2 / a_i = u_i^T Q u_i / a_i
    # (C-space), or u_i^T G u_i for eigenvectors of Fc Fc^T (sample space)
    uqu = np.einsum("sij,sij->sj", Q @ U, U)
    if not sample_space:
        uqu = uqu / np.where(keep, a, 1.0)
    terms = np.where(keep, uqu, 0.0).sum(axis=1)
    ok = (norm_m > 0.0) & (rank > 0)
    dlr = 1.0 - terms / np.where(ok, norm_m * np.sqrt(np.maximum(rank, 1)), 1.0)
    dlrs = [min(max(float(d), 0.0), 1.0) if good else None for d, good in zip(dlr, ok)]
    ranks = [int(r) if good else None for r, good in zip(rank, ok)]
    nc1s: list = [None] * steps
    if k:
        pos = 1 + 2 * c * c
        counts = v[:, pos:pos + k]
        DDt = v[:, pos + k:pos + k + k * k].reshape(steps, k, k)
        DMD = v[:, pos + k + k * k:pos + k + 2 * k * k].reshape(steps, k, k)
        invalid = v[:, pos + k + 2 * k * k]
        present = np.count_nonzero(counts > 0, axis=1)
        s, U = np.linalg.eigh((DDt + DDt.transpose(0, 2, 1)) / 2)
        s, U = s[:, ::-1], U[:, :, ::-1]
        top = s[:, :1]
        keep = (s > rtol * top) & (top > 0.0)
        safe = np.where(keep, s, 1.0)
        # v_i = D^T u_i / sqrt(s_i): v^T M v = u^T D M D^T u / s, (d_k . v_i)^2 = s_i u_ki^2
        vmv = np.einsum("sij,sij->sj", DMD @ U, U) / safe
        between = s * np.einsum("sk,ski->si", counts, U * U)
        vwv = (vmv - between) / n
        kk = np.maximum(present, 1)[:, None]
        nc1 = np.where(keep, vwv / (safe / kk), 0.0).sum(axis=1) / kk[:, 0]
        for i in range(steps):
            if invalid[i] == 0 and present[i] >= 2 and keep[i, 0]:
                nc1s[i] = max(float(nc1[i]), 0.0)
    return dlrs, ranks, nc1s
