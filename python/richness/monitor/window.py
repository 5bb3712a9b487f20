"""The window route: the last ``window`` steps' batches, added to a Moments and finished at emission."""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional

import numpy as np

from .._moments import Moments
from .capture import StepBuffer
from ..torch.threads import BlasThreads
from ..finish import dlr_only, rtol_for, too_few_samples
from ..finish.policy import DlrOnlyResult
from ..finish.diagnostics import measure_values


class WindowValues(NamedTuple):
    """What a window's emission finishes (``WindowRoute.finish``)."""

    dlr: DlrOnlyResult  # n, DLR, rank, NC1, DLR at rtol / 10 and rtol * 10
    extra: dict         # the representation diagnostics by name (and "warnings": why one is None)


class WindowRoute:
    """The window's steps in a ``StepBuffer`` (one copy per step), added to
    the Moments as one batch when the buffer is full, changes shape, or the
    window is emitted: one update of window x n rows instead of one per step
    (one merge, one call, larger products; on a GPU a few launches per window
    instead of per step)."""

    def __init__(self, precision: Optional[str], window: int) -> None:
        self.moments = Moments(precision=precision)
        self.window = window
        self.buf: Optional[StepBuffer] = None
        # The state's arrays of the last host emission, written again by the
        # next (Moments.export_into: no allocation, no page faults) while the
        # sizes hold; the finished values are scalars, so nothing keeps them.
        self._arrays: Optional[Dict[str, np.ndarray]] = None

    def add(self, parts: Dict[str, Any], threads: BlasThreads) -> None:
        w = self.buf
        if w is not None and not w.fits(parts):
            self.update(threads)
            if not w.fits(parts):
                w = None
        if w is None:
            w = self.buf = StepBuffer(parts, self.window)
        w.add(parts)

    def update(self, threads: BlasThreads) -> None:
        """Add the buffered steps to the Moments as one batch."""
        w = self.buf
        if w is None or not w.metas:
            return
        try:
            rows = w.rows()
            threads.set_for(rows["features"])
            self.moments.update(**rows)
        finally:
            w.clear()

    def finish(self, threads: BlasThreads, distributed: bool, rtol: Optional[float],
               head: Any = None, measures: tuple = (), nc3_head: Any = None) -> Optional[WindowValues]:
        """The window's values (``WindowValues``), None below 2 samples; the
        Moments are empty after.
        ``head``: a linear head whose weights DLR uses instead of the streamed
        outputs (C > p; docs/MATH.md, many outputs). ``measures``: the
        representation diagnostics to add (a dict by name, with the effective
        dimension when a spectral one is asked; NC3 from ``nc3_head``'s
        weights, a linear head)."""
        import torch

        m = self.moments
        try:
            self.update(threads)
            if distributed:
                m.all_reduce()  # collective: all ranks emit at the same step
            if too_few_samples(m.n):
                return None
            st = self._state()  # the one host sync
            # Finish with torch float64 CPU tensors (zero-copy views of the state):
            # the math then runs on torch's own thread pool, the one training
            # uses, instead of waking numpy's BLAS threads every emission.
            st = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in st.items()}
            W = None if head is None else head.weight.detach().to("cpu", torch.float64)
            q = dlr_only(st, W, rtol)  # None where undefined (constant features or outputs, no outputs)
            extra: dict = {}
            if measures:
                W3 = None if nc3_head is None else nc3_head.weight.detach().to("cpu", torch.float64)
                # float32 eigenvalues for float32 products (their cut is 1e-5): the emission's main cost
                extra, why = measure_values(st, W3, rtol_for(st["precision"], rtol), measures,
                                            single=st["precision"] != "fp64")
                extra["warnings"] = why  # why a value is None, for the Monitor's warning
            return WindowValues(q, extra)
        finally:
            m.reset()

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
