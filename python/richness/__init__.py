"""richness: how rich (feature-learning) or lazy (kernel-like) training was.

DLR = 1 - CKA(feature kernel, projector onto the learned functions), from
streamed float64 co-moments (Nam et al., ICLR 2026). See ``Moments``, ``dlr``
and ``Report``.
"""

import logging as _logging

# Loads the BLAS that _core links (scipy-openblas32). _core then runs it
# single-threaded inside its own worker threads (csrc/cpu/cpu_moments.cpp).
import scipy_openblas32 as _openblas  # noqa: F401

from ._core import blas_info
from ._moments import Moments, dlr
from ._report import Report
from .torch.evaluate import RichnessWarning, evaluate
from .monitor import Monitor
from ._similarity import Similarity, SimilarityReport, cka
from .torch.similarity import similarity

try:
    from importlib.metadata import PackageNotFoundError as _NotFound, version as _version

    __version__ = _version("richness")
except _NotFound:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

# progress and notes of evaluate and the command line; silent unless configured
_logging.getLogger("richness").addHandler(_logging.NullHandler())


def __getattr__(name: str):
    # The submodules with optional dependencies (matplotlib, torchmetrics, lightning,
    # transformers, torch.distributed, dask) load on first use, so `richness.plot.depth(...)` works
    # after a plain `import richness` without making matplotlib a dependency of the import.
    if name in ("plot", "baselines", "torchmetrics", "lightning", "transformers", "dask"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'richness' has no attribute {name!r}")


__all__ = ["Moments", "Monitor", "Report", "RichnessWarning", "dlr", "evaluate", "blas_info", "__version__",
           "Similarity", "SimilarityReport", "cka", "similarity"]
