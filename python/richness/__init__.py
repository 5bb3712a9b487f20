"""richness: how rich (feature-learning) or lazy (kernel-like) training was.

DLR = 1 - CKA(feature kernel, projector onto the learned functions), from
streamed float64 co-moments (Nam et al., ICLR 2026). See ``Moments``, ``dlr``
and ``Report``.

A module whose dotted path has no component starting with ``_`` is public; its
``__all__`` lists the names meant for users, and its other names are private.
"""

import logging as _logging
import typing as _typing

# _core links the BLAS of the scipy-openblas32 wheel. Its RUNPATH
# ($ORIGIN/../scipy_openblas32/lib) finds the library only when both packages
# sit in one site-packages; loading it here (by its soname, which the dynamic
# loader then matches) serves every route to _core, since importing
# richness._core runs this file first. Without the wheel, _core's own import
# error names the missing library (``_native``); the finishing math needs
# neither. _core runs the BLAS single-threaded inside its own worker threads
# (csrc/cpu/cpu_moments.cpp).
try:
    import scipy_openblas32 as _openblas  # noqa: F401
except (ImportError, OSError):
    pass

try:
    from importlib.metadata import PackageNotFoundError as _NotFound, version as _version

    __version__ = _version("richness")
except _NotFound:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

# progress and notes of evaluate and the command line; silent unless configured
_logging.getLogger("richness").addHandler(_logging.NullHandler())

if _typing.TYPE_CHECKING:
    from ._core import blas_info
    from ._engine.cuda_options import CudaOptions
    from ._engine.moments import Moments, dlr
    from ._report import Report
    from ._engine.similarity import Similarity, SimilarityReport, cka
    from .monitor import EveryStep, Head, Layer, Monitor, Probe, Window
    from ._warnings import RichnessWarning
    from .torch.evaluate import evaluate
    from .torch.similarity import similarity

# The public names load on first use (PEP 562): `import richness.finish` then
# works where the compiled core cannot load, and the accumulators raise one
# clear ImportError (``_native``) when first used there.
_PUBLIC = {"blas_info": "._native", "Moments": "._engine.moments", "dlr": "._engine.moments", "Report": "._report",
           "CudaOptions": "._engine.cuda_options",
           "Similarity": "._engine.similarity", "SimilarityReport": "._engine.similarity", "cka": "._engine.similarity",
           "Monitor": ".monitor", "Window": ".monitor", "EveryStep": ".monitor", "Probe": ".monitor",
           "Head": ".monitor", "Layer": ".monitor", "RichnessWarning": "._warnings", "evaluate": ".torch.evaluate",
           "similarity": ".torch.similarity"}


def __getattr__(name: str):
    import importlib.util

    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
        globals()[name] = value
        return value
    # Submodules load on first use too, those with optional dependencies (matplotlib, torchmetrics,
    # lightning, transformers, torch.distributed, dask) among them, so `richness.plot.depth(...)` works
    # after a plain `import richness` without making matplotlib a dependency of the import.
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'richness' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


__all__ = ["Moments", "Monitor", "Report", "RichnessWarning", "dlr", "evaluate", "blas_info", "__version__",
           "Similarity", "SimilarityReport", "cka", "similarity", "Window", "EveryStep", "Probe", "Head", "Layer",
           "CudaOptions"]
