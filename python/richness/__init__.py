"""richness: how rich (feature-learning) or lazy (kernel-like) training was.

DLR = 1 - CKA(feature kernel, projector onto the learned functions), from
streamed float64 co-moments (Nam et al., ICLR 2026). See ``Moments``, ``dlr``
and ``Report``.
"""

import os as _os

# Our OpenBLAS copy (scipy-openblas32) is loaded here, before _core links it.
# Its worker threads otherwise spin ~40 ms after each update, taking the cores
# from the training step (or numpy's BLAS) that runs next; 2^10 cycles of spin
# is plenty between back-to-back updates. The variable is read once, at load,
# and only for this copy; a user's own setting wins.
_spin_set = "OPENBLAS_THREAD_TIMEOUT" not in _os.environ
if _spin_set:
    _os.environ["OPENBLAS_THREAD_TIMEOUT"] = "10"
try:
    import scipy_openblas32 as _openblas  # noqa: F401
finally:
    if _spin_set:
        del _os.environ["OPENBLAS_THREAD_TIMEOUT"]

from ._core import blas_info
from ._moments import Moments, dlr
from ._report import Report
from ._evaluate import evaluate
from ._monitor import Monitor

__version__ = "0.1.0"

__all__ = ["Moments", "Monitor", "Report", "dlr", "evaluate", "blas_info", "__version__"]
