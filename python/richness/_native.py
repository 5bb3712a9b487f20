"""The compiled core ``_core``, for every module of the package that needs it.

The accumulators (``_backend``) and the precision table (``_state``, read
from ``_core.precisions()``, one table in csrc/common/precision.hpp) import it
from here, so that a process where it cannot be loaded gets one clear
ImportError on first use. The finishing math (``richness.finish``) and the
state schema import without it. ``richness/__init__.py`` has loaded the BLAS
that ``_core`` links before this runs.
"""

try:
    from . import _core
except ImportError as e:
    raise ImportError(
        f"richness: the precision table and the accumulators come from the compiled core richness._core, "
        f"which cannot be imported ({e}); reinstall richness", name="richness._core") from e

blas_info = _core.blas_info

__all__ = ["_core", "blas_info"]
