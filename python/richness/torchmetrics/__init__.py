"""``richness.torchmetrics.DLR``: DLR as a torchmetrics ``Metric``.

Needs the optional dependency torchmetrics (``pip install "richness[torchmetrics]"``).

The state is one tensor per field of the state schema (``_state.FIELDS``:
``mean``, ``M``, ``out_mean``, ``B``, ``A``, ...) plus ``widths`` (n, p, c, t,
k, num_classes and the precision's index), all with ``dist_reduce_fx=None``:
torchmetrics reduces each state on its own, but the exact merge needs ``n``,
the means and the co-moments of a rank together. Under DDP the ranks' states
are gathered side by side and ``compute`` merges them with ``_state.merge``
(docs/MATH.md, "Merging states"), in float64.

Batches go to a ``richness.Moments`` on the metric's device (its update is one
product, and on a GPU it never waits for the device); the field tensors are
exported from it when anything reads them (``compute``, ``sync``,
``state_dict``, ``metric_state``, pickling), and a state written from outside
(``load_state_dict``, ``merge_state``, ``unsync``, ``.to(device)``) is loaded
back into it before the next batch.

Why the accumulator stays: a design with the state tensors as the only state
(each ``update`` accumulating the batch into a reset ``Moments``, exporting
it and merging it into the tensors in place) was built and measured
(benchmarks/RESULTS.md, torchmetrics metric): on the CPU the export of the
batch's p x p state (the core copies its state out; it has no export into
given buffers) costs about as much as the batch's product, and ``update``
took 2x as long at p = 512, batch 256 (3-5x with a linear head, whose update
is otherwise only the product). ``update`` is the hot path, so the
accumulator is kept; the mirroring lives in ``__getattr__``/``__setattr__``
and nothing else writes torchmetrics' internals (device moves go through the
documented ``exclude_state`` of ``Metric._apply``).
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
