"""The thread policy of the core's updates (``BlasThreads``): never more
threads than torch's intra-op pool, one for small products. Shared by
``richness.evaluate`` and ``richness.Monitor``.
"""

from __future__ import annotations

from typing import Any

__all__ = []


class BlasThreads:
    """The core's thread count for each update, restored on exit.

    Never more threads than torch's intra-op pool (``torch.get_num_threads()``):
    the core's count (``_core.blas_set_num_threads``: its own workers, each
    calling single-threaded BLAS) starts at the number of cores regardless of
    ``torch.set_num_threads``. And one thread for small products (below 2^27
    multiply-adds, e.g. a 128 x 512 training batch: half a millisecond on one
    core), where a second thread gains nothing beside a training step that
    wants the cores back at once. benchmarks/bench_monitor.py measures this.
    """

    SMALL = 2 ** 27

    def __init__(self, small: int = SMALL) -> None:
        from .._native import _core

        self.small = small
        self._core = _core
        self.old = _core.blas_get_num_threads()
        self.now = self.old

    def set_for(self, feats: Any) -> None:
        """Pick the count for an update of ``feats`` (rows x p) on the CPU."""
        if getattr(feats, "device", None) is not None and feats.device.type != "cpu":
            return
        self.set_for_work(int(feats.shape[0]) * int(feats.shape[-1]) ** 2)

    def set_for_work(self, work: int) -> None:
        """Pick the count for ``work`` multiply-adds of core products on the CPU."""
        import torch

        want = 1 if work < self.small else max(1, int(torch.get_num_threads()))
        if want != self.now:
            self._core.blas_set_num_threads(want)
            self.now = want

    def restore(self) -> None:
        if self.now != self.old:
            self._core.blas_set_num_threads(self.old)
            self.now = self.old

    def __enter__(self) -> "BlasThreads":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()
