"""``richness.torchmetrics.DLR``: DLR as a torchmetrics ``Metric``.

Needs the optional dependency torchmetrics (``pip install "richness[torchmetrics]"``).

The state is one tensor per field of the state schema (``_state.FIELDS``:
``mean``, ``M``, ``out_mean``, ``B``, ``A``, ...) plus ``widths`` (n, p, c, t,
k, num_classes and the precision's index), all with ``dist_reduce_fx=None``:
torchmetrics reduces each state on its own, but the exact merge needs ``n``,
the means and the co-moments of a rank together. Under DDP the ranks' states
are gathered side by side and ``compute`` merges them with ``_state.merge``
(docs/MATH.md, "Merging states"), in float64.

The state tensors are the metric's only state. Each batch is accumulated
alone by the core into a batch state (a ``richness.Moments`` on the metric's
device, kept and reset for each batch so that its scratch is reused), which
is then merged into the tensors with the core's Chan merge, the one
``Moments.merge`` runs: on the CPU in the tensors' memory (the symmetric
matrices mirrored as each worker merges its rows); new tensors are made only
where sizes change (the first batch, class arrays growing with the labels),
and on a GPU the merge runs on host copies. ``forward`` finishes the same
batch state for the batch's value before merging it. ``compute``, ``sync``,
``state_dict``, ``metric_state`` and pickling read the tensors as they are;
torchmetrics' ``reset``, ``load_state_dict``, ``merge_state`` and device
moves replace them, and a user's in-place writes are the state.

What that costs is measured in benchmarks/RESULTS.md ("torchmetrics metric"):
the batch state's own pass besides the merge's.
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
