"""The window route: the last ``window`` steps' batches, added to a Moments and finished at emission."""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from .._engine.moments import Moments
from .capture import StepBuffer
from ..torch.threads import BlasThreads
from ..finish import dlr_only, rtol_for, too_few_samples
from ..finish.isotropic import reference
from ..finish.policy import DlrOnlyResult
from ..finish.diagnostics import measure_values

__all__ = []


class WindowValues(NamedTuple):
    """What a window's emission finishes (``WindowRoute.finish``)."""

    dlr: DlrOnlyResult  # n, DLR, rank, NC1, DLR at rtol / 10 and rtol * 10
    extra: dict         # the representation diagnostics by name (and "warnings": why one is None)
    p: int = 0          # the features
    isotropic: Optional[float] = None   # DLR of isotropic features at this n, active p and rank
    normalized: Optional[float] = None  # DLR / its isotropic reference
    refused: int = 0    # steps of the window whose rows the Moments refused (left out)


class WindowRoute:
    """The window's steps in a ``StepBuffer`` (one copy per step), added to
    the Moments as one batch when the buffer is full, changes shape, or the
    window is emitted: one update of window x n rows instead of one per step
    (one merge, one call, larger products; on a GPU a few launches per window
    instead of per step).

    A step whose rows the Moments refuse (NaN or Inf activations, co-moments
    that overflow, a spread whose squares underflow the products, labels out
    of range) is left out of the window, and the window's other steps are
    added as they would have been without it: ``refused`` lists ``(step,
    reason)`` for the caller to report. The Moments keep nothing of a
    refused batch. On a GPU the device checks a batch and refuses it at the
    next synchronising call: each flush reads that verdict at once (a sync;
    at emission the one that finishing needs anyway), while the rows are
    still in the buffer."""

    def __init__(self, precision: Optional[str], window: int) -> None:
        self.precision = precision
        self.moments = Moments(precision=precision)
        self.window = window
        self.buf: Optional[StepBuffer] = None
        self.refused: List[Tuple[Any, str]] = []  # (step, reason) not yet reported
        self._refused_in_window = 0  # steps refused since the last emission
        # The state's arrays of the last host emission, written again by the
        # next (Moments.export_into: no allocation, no page faults) while the
        # sizes hold; the finished values are scalars, so nothing keeps them.
        self._arrays: Optional[Dict[str, np.ndarray]] = None

    def add(self, parts: Dict[str, Any], threads: BlasThreads, step: Any = None) -> None:
        """Buffer one step's rows (``step``: its label, named if they are refused)."""
        w = self.buf
        if w is not None and not w.fits(parts):
            self.update(threads)
            if not w.fits(parts):
                w = None
        if w is None:
            w = self.buf = StepBuffer(parts, self.window)
        w.add(parts, step)

    def update(self, threads: BlasThreads) -> None:
        """Add the buffered steps to the Moments as one batch (those the
        Moments refuse left out: ``_add_checked``)."""
        w = self.buf
        if w is None or not w.metas:
            return
        try:
            self._add(w.rows(), threads)
        except ValueError as e:
            self._add_checked(w, threads, e)
        finally:
            w.clear()

    def _add(self, rows: Dict[str, Any], threads: BlasThreads) -> None:
        threads.set_for(rows["features"])
        m = self.moments
        m.update(**rows)
        if m.device != "cpu":
            m.n  # noqa: B018 -- a CUDA state checks a batch on the device and refuses it at the next sync: now

    def _add_checked(self, w: StepBuffer, threads: BlasThreads, error: ValueError) -> None:
        """The buffered steps after the Moments refused them together: each
        step is checked alone in a scratch Moments, the refused ones are left
        out (``refused``) and the others added together, as one batch as
        before (one at a time if they are refused together again: a sum that
        overflows, say). Runs only when a batch was refused."""
        steps = list(w.metas)
        reasons: Dict[int, str] = {}
        if len(steps) == 1:
            reasons[0] = str(error)
        else:
            for i in range(len(steps)):
                scratch = Moments(precision=self.precision)
                try:
                    self._add_to(scratch, {k: b[i] for k, b in w.bufs.items()})
                except ValueError as e:
                    reasons[i] = str(e)
        good = [i for i in range(len(steps)) if i not in reasons]
        if good:
            try:
                self._add({k: b[good].reshape((-1,) + tuple(b.shape[2:])) for k, b in w.bufs.items()}, threads)
            except ValueError:
                for i in good:
                    try:
                        self._add({k: b[i] for k, b in w.bufs.items()}, threads)
                    except ValueError as e:
                        reasons[i] = str(e)
        self._refused_in_window += len(reasons)
        self.refused += [(steps[i], reasons[i]) for i in sorted(reasons)]

    @staticmethod
    def _add_to(m: Moments, rows: Dict[str, Any]) -> None:
        m.update(**rows)
        if m.device != "cpu":
            m.n  # noqa: B018 -- the device's checks, now

    def take_refused(self) -> List[Tuple[Any, str]]:
        """The steps refused since the last call, as ``(step, reason)``."""
        out, self.refused = self.refused, []
        return out

    def finish(self, threads: BlasThreads, distributed: bool, rtol: Optional[float],
               head: Any = None, measures: tuple = (), nc3_head: Any = None,
               with_nc1: bool = True) -> Optional[WindowValues]:
        """The window's values (``WindowValues``), None below 2 samples
        (values all None there when steps of the window were refused); the
        Moments are empty after.
        ``head``: a linear head whose weights DLR uses instead of the streamed
        outputs (C > p; docs/MATH.md, many outputs). ``measures``: the
        representation diagnostics to add (a dict by name, with the effective
        dimension when a spectral one is asked; NC3 from ``nc3_head``'s
        weights, a linear head). ``with_nc1``: False for labels that are not
        classes (a layer's object ids): NC1 is then not computed."""
        import torch

        m = self.moments
        try:
            self.update(threads)
            if distributed:
                m.all_reduce()  # collective: all ranks emit at the same step
            refused = self._refused_in_window
            if too_few_samples(m.n):
                if not refused:
                    return None
                n = m.n
                return WindowValues(DlrOnlyResult(n, None, None, None, "its steps were refused", ()), {},
                                    refused=refused)
            st = self._state()  # the one host sync
            # Finish with torch float64 CPU tensors (zero-copy views of the state):
            # the math then runs on torch's own thread pool, the one training
            # uses, instead of waking numpy's BLAS threads every emission.
            st = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in st.items()}
            W = None if head is None else head.weight.detach().to("cpu", torch.float64)
            q = dlr_only(st, W, rtol, with_nc1)  # None where undefined (constant features or outputs, no outputs)
            # the finite-sample reference, as the full report gives it (its warning is the Monitor's own)
            iso, norm = (None, None) if q.dlr is None else reference(st, rtol_for(st["precision"], rtol),
                                                                     q.dlr, q.rank)[1:3]
            extra: dict = {}
            if measures:
                W3 = None if nc3_head is None else nc3_head.weight.detach().to("cpu", torch.float64)
                # float32 eigenvalues for float32 products (their cut is 1e-5): the emission's main cost
                extra, why = measure_values(st, W3, rtol_for(st["precision"], rtol), measures,
                                            single=st["precision"] != "fp64")
                extra["warnings"] = why  # why a value is None, for the Monitor's warning
            return WindowValues(q, extra, int(st["p"]), iso, norm, refused)
        finally:
            m.reset()
            self._refused_in_window = 0

    def _state(self) -> Dict[str, Any]:
        """The window's state dict: on the host, written into the arrays of
        the last emission when their sizes still fit (else new ones, kept for
        the next)."""
        m = self.moments
        if m.device != "cpu":
            return m.state_dict()
        if self._arrays is not None:
            try:
                return {**self._arrays, **m.export_into(self._arrays)}
            except ValueError:  # another size (classes, widths): nothing was written
                pass
        st = m.state_dict()
        self._arrays = {k: v for k, v in st.items() if isinstance(v, np.ndarray)}
        return st
