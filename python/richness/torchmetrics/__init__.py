"""``richness.torchmetrics.DLR``: DLR as a torchmetrics ``Metric``.

Needs the optional dependency torchmetrics (``pip install "richness[torchmetrics]"``).

The state is one tensor per field of the state schema (``_state.FIELDS``:
``mean``, ``M``, ``out_mean``, ``B``, ``A``, ...) plus ``widths`` (n, p, c, t,
k, num_classes and the precision's index), all with ``dist_reduce_fx=None``:
torchmetrics reduces each state on its own, but the exact merge needs ``n``,
the means and the co-moments of a rank together. Under DDP the ranks' states
are gathered side by side and ``compute`` merges them with ``_state.merge``
(docs/MATH.md, "Merging states"), in float64.

The state tensors are the state. Batches go to a ``richness.Moments`` on the
metric's device (its update is one product, and on a GPU it never waits for
the device), and after every batch the tensors hold its state: on the CPU
the core writes the merged state into the tensors' memory as it merges (the
merge's own pass over the co-moments, on its threads, the symmetric matrices
mirrored in blocks); on a GPU they are the state's device-to-device copy.
``compute``, ``sync``, ``state_dict``, ``metric_state`` and pickling read the
tensors as they are. The accumulator is checked against them before each
batch: when they are not the ones it last wrote, or torch has written them
in place since (their version moved: torchmetrics' ``reset``, ``sync`` /
``unsync``, ``load_state_dict``, ``merge_state``, ``.to(device)``, or a
user's ``copy_``), it is loaded from them first. Nothing else of
torchmetrics is overridden but its documented methods, and device moves go
through the documented ``exclude_state`` of ``Metric._apply``.

What that costs (benchmarks/RESULTS.md, torchmetrics metric): writing a full
float64 p x p matrix after every batch, about a fifth of an update at batch
256 (p = 512 to 2,048), less for larger batches. An earlier design that
exported each batch's state through a copy and merged it into the tensors in
numpy made ``update`` 2x slower; the one before this kept the tensors as a
lazily exported mirror of the accumulator.
"""

from .._optional import pip_extra

try:
    import torch  # noqa: F401
    import torchmetrics  # noqa: F401
except ImportError as _e:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"richness.torchmetrics needs torch and torchmetrics: {pip_extra('torchmetrics')} "
                      f"({_e})") from None

from .metric import DLR

__all__ = ["DLR"]
