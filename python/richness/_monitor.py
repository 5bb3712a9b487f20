"""``richness.Monitor``: DLR during training, at a cost the step does not notice.

Window mode (default): a forward hook on the head captures the training
batches of the last ``window`` steps before every ``every``-th step; each
``step()`` feeds the captured batch to a ``Moments`` and drops it; at every
``every``-th step DLR (and NC1 with labels) is finished from the window and
emitted. Probe mode (``probe=``): every ``every`` steps a fixed probe set is
evaluated in eval mode (train mode restored after) and its full report
emitted.

The only host synchronisation is at emission (finishing the state); ``update``
never calls ``.item()`` or copies to the host (on a GPU the CUDA backend runs
on the caller's stream). Boolean token masks are the exception: indexing with
them syncs.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from typing import Any, Callable, Dict, Iterable, List, Optional

import numpy as np

from . import _finish
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
                 distributed: bool = False) -> None:
        torch = require_torch("richness.Monitor")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive integer, got {every!r}")
        if window is None:
            window = min(10, every)
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= every:
            raise ValueError(f"window must be an integer in [1, every={every}], got {window!r}")
        check_tokens(tokens)
        self.model = model
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
        self._batch: Optional[tuple] = None  # a one-batch window kept for _batch_emit
        self._inflight: list = []  # (meta, pinned host buffer, CUDA event) of records on their way
        self._classes: Optional[int] = None
        self._window_labels: Optional[bool] = None
        self._active = self._is_window_step(1)
        self._capture: Optional[Capture] = None
        self._finder: Optional[HeadFinder] = None
        self._model_hook = None
        self._closed = False
        self._t0 = time.time()
        if self.probe is None:
            if self._head is not None:
                self._capture = _PendingCapture(self._head, self)
            else:
                self._finder = HeadFinder(model)
                self._model_hook = model.register_forward_hook(self._on_model_output)
        self._threads = BlasThreads()  # restored by close()

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
        emitted one, else None. On a GPU, records of one-batch windows are
        finished without waiting for the device: they reach ``history`` and the
        sinks at a later ``step()`` (``flush()`` or closing waits for them)."""
        if self._closed:
            raise RuntimeError("this Monitor is closed")
        if self._inflight:
            self._poll()
        self.steps += 1
        rec = None
        try:
            if self.probe is None and self._pending:
                self._flush(labels)
        finally:
            self._pending = []
        if self.steps % self.every == 0:
            rec = self._emit()
        self._active = self.probe is None and self._is_window_step(self.steps + 1)
        return rec

    def _flush(self, labels: Any) -> None:
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
        if self._batch_path_fits(feats):
            self._batch = (feats, outs, lk.get("labels"))
            return
        self._threads.set_for(feats)
        if self._uses_weights():
            self._moments.update(feats, **lk)
        else:
            if outs is None:
                raise ValueError(f"the head {type(self._head).__name__} did not return a tensor")
            self._moments.update(feats, outs, **lk)

    def _batch_path_fits(self, feats: Any) -> bool:
        """A window of one batch with fewer rows than features (every=1 with a
        training batch of 128 and p = 512): its exact moments come cheaper from
        the n x n Gram, O(n^2 p), than from the p x p update, O(n p^2)."""
        n, p = int(feats.shape[0]), int(feats.shape[1])
        return (self.window == 1 and not self.distributed and 2 <= n < p
                and self.precision in (None, "fp32", "fp64") and self._moments.n == 0)

    def _batch_emit(self) -> Optional[dict]:
        """Emit the one-batch window in ``self._batch`` without a host sync.

        The device reduces the batch to a handful of small matrices (SPEC.md's
        quantities, rewritten so that nothing of size p or n leaves the device):
        ||M||_F = ||Xc Xc^T||_F; tr(B A^+ B^T) from A = Fc^T Fc and
        Q = B^T B (C x C, B = Xc^T Fc); for NC1 the class counts, D D^T and
        D M D^T = (Xc D^T)^T (Xc D^T), D the class means of Xc (K x K). The batch
        mean is taken in float64 and subtracted before the products, which run
        in float32 unless every input is float64 (the core's rule). On a GPU
        they are copied to pinned host memory behind a CUDA event and the record
        is finished by a later ``step()`` (or ``flush()``), once the event has
        passed: the training loop never waits. On the CPU the record is
        finished at once and returned. tests/test_integration.py checks both
        paths against the n x n oracle and the Moments path."""
        import torch

        feats, outs, labels = self._batch
        self._batch = None
        weights = self._uses_weights()
        all64 = feats.dtype == torch.float64 and (weights or outs is None or outs.dtype == torch.float64)
        prec = self.precision or ("fp64" if all64 else "fp32")
        pdt = torch.float64 if prec == "fp64" else torch.float32
        f64 = torch.float64
        n = int(feats.shape[0])
        X = feats.detach().to(f64)
        Xc64 = X - X.mean(dim=0)
        Xc = Xc64.to(pdt)
        norm_m = torch.linalg.vector_norm((Xc @ Xc.T).to(f64)).reshape(1)
        if weights:
            Fc = Xc @ self._head.weight.detach().to(feats.device, pdt).T
        else:
            F = outs.detach().to(f64)
            Fc = (F - F.mean(dim=0)).to(pdt)
        Ft = Fc.T.contiguous()
        B = Ft @ Xc  # C x p: (C x n)(n x p) reads both operands row-wise
        A = (Ft @ Fc).to(f64)
        Q = (B.to(f64) @ B.T.to(f64))
        parts = [norm_m, A.reshape(-1), Q.reshape(-1)]
        k = 0
        if labels is not None and prec in _finish.NC1_RELIABLE:
            if self._classes is None:
                head = self._head
                self._classes = (head.out_features if isinstance(head, torch.nn.Linear)
                                 else int(labels.max()) + 1)  # one sync, on the first emission only
            k = self._classes
            lab = labels.to(feats.device)
            valid = (lab >= 0) & (lab < k)
            idx = lab.clamp(0, k - 1)
            w = valid.to(f64)
            counts = torch.zeros(k, dtype=f64, device=feats.device).index_add_(0, idx, w)
            sums = torch.zeros(k, Xc64.shape[1], dtype=f64, device=feats.device).index_add_(0, idx, Xc64 * w[:, None])
            D = sums / counts.clamp(min=1.0)[:, None]
            E = Xc64 @ D.T
            parts += [counts, (D @ D.T).reshape(-1), (E.T @ E).reshape(-1), (~valid).sum().to(f64).reshape(1)]
        packed = torch.cat(parts)
        rtol = self.rtol if self.rtol is not None else _finish.DEFAULT_RTOL[prec]
        meta = (self.steps, n, int(A.shape[0]), k, rtol)
        if packed.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=f64, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(packed.device))
            self._inflight.append((meta, host, event))
            return None
        return self._finish_small(meta, packed.numpy())

    def _finish_small(self, meta: tuple, v: np.ndarray) -> dict:
        """The record from the small matrices of ``_batch_emit`` (float64, host)."""
        step, n, c, k, rtol = meta
        norm_m = float(v[0])
        A = v[1:1 + c * c].reshape(c, c)
        Q = v[1 + c * c:1 + 2 * c * c].reshape(c, c)
        dlr = rank = nc1 = None
        a, U = np.linalg.eigh((A + A.T) / 2)
        a, U = a[::-1], U[:, ::-1]
        if norm_m > 0.0 and a[0] > 0.0:
            keep = a > rtol * a[0]
            rank = int(keep.sum())
            # ||B u_i||^2 = u_i^T Q u_i
            terms = np.einsum("ij,ij->j", Q @ U[:, keep], U[:, keep]) / a[keep]
            dlr = min(max(1.0 - float(terms.sum()) / (norm_m * math.sqrt(rank)), 0.0), 1.0)
        if k:
            pos = 1 + 2 * c * c
            counts = v[pos:pos + k]
            DDt = v[pos + k:pos + k + k * k].reshape(k, k)
            DMD = v[pos + k + k * k:pos + k + 2 * k * k].reshape(k, k)
            invalid = v[pos + k + 2 * k * k]
            K = int(np.count_nonzero(counts > 0))
            if invalid == 0 and K >= 2:
                s, U = np.linalg.eigh((DDt + DDt.T) / 2)
                s, U = s[::-1], U[:, ::-1]
                if s[0] > 0.0:
                    keep = s > rtol * s[0]
                    s, U = s[keep], U[:, keep]
                    # v_i = D^T u_i / sqrt(s_i): v^T M v = u^T D M D^T u / s, (d_k . v_i)^2 = s_i u_ki^2
                    vmv = np.einsum("ij,ij->j", DMD @ U, U) / s
                    between = s * np.einsum("k,ki->i", counts, U * U)
                    vwv = (vmv - between) / n
                    nc1 = max(float(np.sum(vwv / (s / K))) / K, 0.0)
        return {"step": step, "mode": "window", "n": n, "dlr": _num(dlr), "rank": rank, "nc1": _num(nc1),
                "effective_dim": None, "time": round(time.time() - self._t0, 6)}

    def _poll(self, wait: bool = False) -> None:
        """Finish and dispatch device records whose copy has landed (all of them when ``wait``)."""
        while self._inflight:
            meta, host, event = self._inflight[0]
            if not wait and not event.query():
                return
            event.synchronize()
            self._inflight.pop(0)
            self._dispatch(self._finish_small(meta, host.numpy()))

    def flush(self) -> None:
        """Wait for records still being computed on the GPU and emit them."""
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
        return {"step": self.steps, "mode": mode, "n": int(n), "dlr": _num(dlr),
                "rank": None if rank is None else int(rank), "nc1": _num(nc1), "effective_dim": _num(eff),
                "time": round(time.time() - self._t0, 6)}

    def _emit_window(self) -> Optional[dict]:
        if self._batch is not None:
            try:
                return self._batch_emit()
            finally:
                self._batch = None
                self._window_labels = None
        m = self._moments
        try:
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
            self._poll(wait=True)  # records still on their way from the GPU
        finally:
            self._pending = []
            self._batch = None
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
        # training forwards run with gradients; validation under no_grad is skipped
        if mon._active and args and _grad_enabled():
            mon._pending.append((args[0].detach(), out.detach() if hasattr(out, "detach") else out))

    def remove(self) -> None:
        self.handle.remove()


def _batch_nc1(Xc: Any, labels: Any, rtol: float) -> Optional[float]:
    """NC1 of one batch (SPEC.md, Papyan et al.) from its centered float64
    features ``Xc`` (n x p): class means of Xc are m_k - mu, and
    v^T M v = ||Xc v||^2 (no p x p matrix is formed)."""
    import torch

    n = Xc.shape[0]
    k = int(labels.max()) + 1
    counts = torch.bincount(labels, minlength=k).to(torch.float64)
    sums = torch.zeros(k, Xc.shape[1], dtype=torch.float64, device=Xc.device).index_add_(0, labels, Xc)
    present = counts > 0
    if int(present.sum()) < 2:
        return None
    D = sums[present] / counts[present, None]

    def vmv(Vt):
        VX = Vt @ Xc.T
        return (VX * VX).sum(dim=1)

    return _finish.nc1_from_class_means(D, counts[present], float(n), vmv, rtol)
