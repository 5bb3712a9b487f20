"""``CudaOptions``: how the CUDA backend forms and stages its products."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from .._checks import check_bool, check_int

__all__ = ["CudaOptions"]

# An algorithm's name, optionally with ":block" (the CUDA core checks the name
# and the block size when the device accumulator is made).
_PRODUCT = re.compile(r"[a-z_]+(:[0-9]{1,9})?")


@dataclass(frozen=True)
class CudaOptions:
    """Tuning of the CUDA backend, given as ``Moments(cuda=CudaOptions(...))``.

    The defaults are what a ``Moments`` without ``cuda=`` uses; the options
    change how the device products are formed and batched, never what is
    accumulated (the state agrees up to the products' rounding). They exist
    for benchmarks and checks. The CPU backend has none of them: a
    ``Moments`` whose state is on the CPU (``device="cpu"``, or CPU data at
    the first batch, merge or load) refuses non-default options with a
    ``ValueError``. Each option is checked here, when the object is made.

    Args:
        stack_rows: 0 (default): one product and one float64 merge per batch.
            N > 0 (an integer below 2**31): each batch is centered on its own
            float64 mean and staged (narrowed to the product precision) until
            the next would pass N rows; then one product over all staged rows
            and one exact multi-batch merge. Meant to fill the tensor cores
            better (not yet measured on a GPU; benchmarks/RESULTS.md, "CUDA
            backend on an H200"). Costs ``N * (p + C + T)`` device elements in
            the product precision (4 bytes fp32/tf32, 2 bf16, 8 fp64) plus a
            ``(p + C + T)^2`` product, per ``Moments`` (per group with
            ``groups``). The state, ``n``, ``state_dict`` and ``compute`` are
            those of the per-batch path up to the products' rounding (staged
            rows are merged before anything reads the state); ``update`` still
            never waits for the device. An ``update`` captured in a CUDA graph
            takes the per-batch path (a replay must add its batch again); rows
            staged before the capture are merged later.
            ``Moments.staged_rows`` and ``staged_batches`` say what waits in
            the stage.
        stack_joint: with ``stack_rows``, one product over the staged rows of
            features, outputs and targets side by side (True, default), or
            one product per block (False).
        product: how the device forms X^T X: ``"auto"`` (measured once per
            shape, the fastest kept), ``"syrk"``, ``"gemm"``, ``"block_rows"``
            or ``"tiles"``, optionally with a block size (``"tiles:16"``;
            default 512). None (default): ``RICHNESS_CUDA_PRODUCT`` if set,
            else auto. The products agree up to their rounding.
    """

    stack_rows: int = 0
    stack_joint: bool = True
    product: Optional[str] = None

    def __post_init__(self) -> None:
        rows = check_int(self.stack_rows, "stack_rows", low=0, high=2**31 - 1, what="an integer in [0, 2**31)")
        object.__setattr__(self, "stack_rows", rows)  # a numpy integer is kept as the Python int
        check_bool(self.stack_joint, "stack_joint")
        if self.product is not None and (not isinstance(self.product, str) or not _PRODUCT.fullmatch(self.product)):
            raise ValueError(f"product must be None or an algorithm's name, optionally with ':block' "
                             f"(an integer), as in 'tiles:16'; got {self.product!r}")

    def _cpu_refusal(self) -> Optional[str]:
        """Why a CPU backend cannot take these options, or None for the defaults."""
        if self.stack_rows:
            return ("CudaOptions(stack_rows=...) is an option of the CUDA backend (it stages rows before one "
                    "device product); the CPU backend has no staging: leave stack_rows=0 with CPU data")
        if not self.stack_joint:
            return ("CudaOptions(stack_joint=False) is an option of the CUDA backend's staging; the CPU backend "
                    "has no staging: leave stack_joint=True with CPU data")
        if self.product is not None:
            return ("CudaOptions(product=...) is an option of the CUDA backend (how its device product is "
                    "formed); the CPU backend multiplies with its BLAS: leave product=None with CPU data")
        return None
