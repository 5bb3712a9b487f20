"""Backends: where a ``Moments``'s samples are accumulated.

Every backend has the same interface (``Backend``): ``update`` with one
adapted batch, ``merge``, ``reset``, ``n``, ``widths`` (host-known, no device
synchronisation), ``to_state``/``from_state`` (the schema of ``_state``) and
``device_state`` (the state where ``compute`` finishes it). ``CoreBackend``
wraps one compiled accumulator (``_core.CpuMoments`` or ``_cuda.CudaMoments``);
``GroupedBackend`` keeps the samples in k of them for the jackknife.
``Moments`` validates and routes; the arithmetic lives in the core.
``centered_grams`` gives per-batch n x n Grams for the routes that finish
one batch at a time.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Protocol

import numpy as np

from .. import _state
from .adapt import as_labels, as_matrix
from .cuda_options import CudaOptions
from .._native import _core


class Batch(NamedTuple):
    """One adapted batch (``_adapt.Matrix`` views; None where not streamed)."""

    features: Any
    outputs: Any = None
    labels: Any = None
    targets: Any = None

    def args(self) -> tuple:
        return tuple(None if m is None else m.arg() for m in self)


def adapt_batch(features: Any, outputs: Any = None, labels: Any = None, targets: Any = None) -> Batch:
    """A batch's inputs as views (``adapt.as_matrix`` / ``as_labels``: no copy
    where none is needed), all on one device; each input is adapted once, by
    this, whoever passes the batch on (``Moments.update``, the torchmetrics
    metric)."""
    batch = Batch(as_matrix(features, "features"),
                  as_matrix(outputs, "outputs", allow_1d=True) if outputs is not None else None,
                  as_labels(labels) if labels is not None else None,
                  as_matrix(targets, "targets", allow_1d=True) if targets is not None else None)
    devices = {m.device for m in batch if m is not None}
    if len(devices) > 1:
        raise ValueError(f"inputs of one batch are on different devices: {sorted(devices)}")
    return batch


class Backend(Protocol):
    """What ``Moments`` asks of a backend (``CoreBackend``, ``GroupedBackend``)."""

    device: str

    def update(self, batch: Batch, precision: str) -> None: ...
    def merge(self, other: "Backend") -> None: ...
    def reset(self) -> None: ...
    @property
    def n(self) -> int: ...
    def widths(self) -> dict: ...
    def to_state(self) -> dict: ...
    def from_state(self, state: dict) -> None: ...
    def device_state(self) -> dict: ...
    def whole(self) -> "CoreBackend": ...
    @property
    def staged_rows(self) -> int: ...
    @property
    def staged_batches(self) -> int: ...


def _cuda_core(num_classes: int, device: str):
    try:
        import torch  # noqa: F401  loads libcublas and the CUDA runtime that _cuda links against
        from .. import _cuda  # built only with RICHNESS_CUDA; needs libcublas at import
    except ImportError as e:
        raise RuntimeError(f"device {device!r} needs the CUDA backend, which is not available here ({e})") from None
    index = int(device.split(":")[1]) if ":" in device else 0
    return _cuda.CudaMoments(num_classes, index)


def _current_stream(tensor: Any) -> int:
    """The caller's current CUDA stream for ``tensor``'s device (0 = legacy default)."""
    try:
        import torch

        return int(torch.cuda.current_stream(tensor.device).cuda_stream)
    except Exception:  # not a torch tensor: DLPack producers sync on the default stream
        return 0


NO_CUDA_OPTIONS = CudaOptions()  # the defaults: what a CPU backend takes


class CoreBackend:
    """One compiled accumulator on ``device`` ("cpu" or "cuda:N").

    ``cuda`` tunes the CUDA backend (``CudaOptions``: staging and how
    X^T X is formed); the CPU backend refuses any but the defaults.
    """

    def __init__(self, device: str, num_classes: Optional[int], cuda: CudaOptions = NO_CUDA_OPTIONS) -> None:
        nc = -1 if num_classes is None else int(num_classes)
        self.device = device
        self.cuda = cuda
        self._num_classes = num_classes
        self.core: Any  # _core.CpuMoments or _cuda.CudaMoments
        if device == "cpu":
            refusal = cuda._cpu_refusal()
            if refusal is not None:
                raise ValueError(refusal)
            self.core = _core.CpuMoments(nc)
            return
        self.core = _cuda_core(nc, device)
        if cuda.product is not None:
            algo, _, block = cuda.product.partition(":")
            self.core.set_product(algo, int(block) if block else 512)
        if cuda.stack_rows:
            self.core.set_stack(cuda.stack_rows, cuda.stack_joint)

    @property
    def staged_rows(self) -> int:
        """Rows staged on the device and not yet in the state (host-known; 0 on the CPU)."""
        return 0 if self.device == "cpu" else int(self.core.staged_rows)

    @property
    def staged_batches(self) -> int:
        """Batches those staged rows came from."""
        return 0 if self.device == "cpu" else int(self.core.staged_batches)

    def empty_like(self) -> "CoreBackend":
        return CoreBackend(self.device, self._num_classes, self.cuda)

    def update(self, batch: Batch, precision: str) -> None:
        args = (*batch.args(), precision)
        if self.device == "cpu":
            self.core.update(*args)
        else:
            self.core.update(*args, _current_stream(batch.features.owner))

    def merge(self, other: Backend) -> None:
        source = other.whole()
        if source is self or type(source.core) is not type(self.core):
            tmp = self.empty_like()
            tmp.from_state(source.to_state())
            source = tmp
        self.core.merge(source.core)

    def reset(self) -> None:
        self.core.reset()

    @property
    def n(self) -> int:
        return int(self.core.n)  # CUDA: synchronises, raises a pending device-side input error

    def widths(self) -> dict:
        """p, c, t, k, num_classes and precision, known on the host (no sync)."""
        return dict(self.core.shape())

    def to_state(self) -> dict:
        return self.core.get_state()

    def from_state(self, state: dict) -> None:
        self.core.set_state(dict(state))

    def device_state(self) -> dict:
        if self.device == "cpu":
            return self.to_state()
        return _device_state(self.core, self.device)

    def export_into(self, arrays: dict) -> dict:
        if self.device != "cpu":
            raise ValueError(f"export_into writes host arrays; this state is on {self.device} (use device_state)")
        return dict(self.core.export_into(arrays))

    def merge_into(self, arrays: dict, widths: dict) -> dict:
        """Chan's merge of this CPU state into the state held in ``arrays``
        (host arrays as ``export_into`` takes them, sized for the merged
        state; ``widths`` that state's scalars), in place: the core's merge,
        the one ``merge`` runs. Returns the merged state's scalars."""
        return dict(self.core.merge_into(arrays, widths))

    def whole(self) -> "CoreBackend":
        return self

    # A compiled accumulator does not pickle: copies and pickles go through
    # the state dict (``_state``), exact, and a new accumulator on the same
    # device (CUDA: the state passes through the host).
    def __getstate__(self) -> dict:
        return {"device": self.device, "num_classes": self._num_classes, "cuda": self.cuda,
                "state": self.to_state()}

    def __setstate__(self, st: dict) -> None:
        CoreBackend.__init__(self, st["device"], st["num_classes"], st["cuda"])
        self.from_state(st["state"])


class Lockable:
    """An object with a ``threading.Lock`` in ``_lock`` that still pickles and
    copies (the lock is not copied; the copy gets a new one). What it holds
    must pickle too: a backend's compiled accumulator does so through its
    state dict (``CoreBackend.__getstate__``)."""

    _lock: threading.Lock

    def __getstate__(self) -> dict:
        st = dict(self.__dict__)
        st.pop("_lock", None)
        return st

    def __setstate__(self, st: dict) -> None:
        self.__dict__.update(st)
        self._lock = threading.Lock()


class GroupedBackend(Lockable):
    """The samples kept in k sub-states (each update or merge goes whole to one
    group: in turn, or at random with a seed), so that the jackknife can leave
    one group out without a second pass."""

    def __init__(self, make: Callable[[], CoreBackend], groups: int, seed: Optional[int] = None) -> None:
        self._make = make
        self.parts: List[CoreBackend] = [make() for _ in range(groups)]
        self.device = self.parts[0].device
        self._next = 0
        self.seed = seed
        self._rng = None if seed is None else np.random.default_rng(seed)
        self._pending: Optional[int] = None
        # One update or merge at a time: the group rotation moves only after
        # a batch is accepted, so choosing a group and adding to it is one step.
        self._lock = threading.Lock()

    def _pick(self) -> int:
        if self._pending is None:
            self._pending = int(self._rng.integers(len(self.parts))) if self._rng is not None else self._next
        return self._pending

    def _advance(self) -> None:
        # Only after a successful update or merge: a rejected batch leaves the
        # rotation (and so the state) exactly as it was. The random choice is
        # drawn once per accepted batch, so a rejected one does not move it.
        if self._rng is None:
            self._next = (self._next + 1) % len(self.parts)
        self._pending = None

    def update(self, batch: Batch, precision: str) -> None:
        with self._lock:
            part = self.parts[self._pick()]
            if part.widths()["p"] < 0:  # an empty group knows no widths: check against the whole
                _core.check_batch(self.widths(), *batch.args())
            part.update(batch, precision)
            if batch.features.rows > 0:  # an empty batch adds nothing and does not move the rotation
                self._advance()

    def merge(self, other: Any) -> None:
        """Another state: a grouped one of as many groups group by group (its
        group i into group i: the groups stay k disjoint parts of the samples,
        and the rotation does not move); any other whole into one group."""
        with self._lock:  # compatibility with the whole: Moments.merge checked it (_state.check_compatible)
            if isinstance(other, GroupedBackend):
                if len(other.parts) != len(self.parts):
                    raise ValueError(f"cannot merge: this state keeps {len(self.parts)} groups, the other "
                                     f"{len(other.parts)}")
                parts = []
                for mine, theirs in zip(self.parts, other.parts):  # on copies: a refused merge changes nothing
                    part = mine.empty_like()
                    part.from_state(mine.to_state())
                    part.merge(theirs)
                    parts.append(part)
                self.parts = parts
                return
            self.parts[self._pick()].merge(other)
            self._advance()

    def reset(self) -> None:
        for part in self.parts:
            part.reset()
        if self._rng is None:  # in turn: from the first group again
            self._next = 0
            self._pending = None
        # at random: the draws go on (a group already drawn for the next batch stays drawn)

    @property
    def n(self) -> int:
        return sum(part.n for part in self.parts)

    def widths(self) -> dict:
        """The widths of the whole (of the started groups; they agree)."""
        found = [w for w in (part.widths() for part in self.parts) if w["p"] >= 0]
        if not found:
            return self.parts[0].widths()
        out = dict(found[0])
        if out["k"] >= 0:
            out["k"] = max(w["k"] for w in found)
        out["precision"] = _state.coarsest(w["precision"] for w in found)
        return out

    @property
    def staged_rows(self) -> int:
        return sum(part.staged_rows for part in self.parts)

    @property
    def staged_batches(self) -> int:
        return sum(part.staged_batches for part in self.parts)

    def whole(self) -> CoreBackend:
        total = self._make()
        for part in self.parts:
            total.merge(part)
        return total

    def to_state(self) -> dict:
        return self.whole().to_state()

    def device_state(self) -> dict:
        return self.whole().device_state()

    def from_state(self, state: dict) -> None:
        # A loaded state is one block: the jackknife needs later updates.
        first = self._make()
        first.from_state(state)
        self.parts = [first] + [self._make() for _ in range(len(self.parts) - 1)]
        self._next = 1 % len(self.parts)
        self._pending = None

    def group_states(self) -> List[dict]:
        return [part.to_state() for part in self.parts]

    def load_group_states(self, states: List[dict]) -> None:
        parts = []
        for st in states:
            part = self._make()
            part.from_state(st)
            parts.append(part)
        self.parts = parts

    def grouped_state(self) -> tuple:
        """The state of all samples and the ``groups`` entry of a state dict
        (``_state.GROUPS``), read together: the groups' states and where the
        assignment stands (the group the next update goes to, and the random
        generator's state after that group was drawn)."""
        with self._lock:
            nxt = self._pick()  # at random: drawn now rather than at the next update (the same draw)
            entry = {"states": self.group_states(), "next": nxt,
                     "seed": int(self.seed) if isinstance(self.seed, (int, np.integer)) else None,
                     "rng": None if self._rng is None else self._rng.bit_generator.state}
            return self.whole().to_state(), entry

    def load_groups(self, entry: dict) -> None:
        """Load a checked ``groups`` entry (``_state.checked_groups``): its
        states, and the assignment where it stood."""
        self.load_group_states(entry["states"])
        self.seed = entry["seed"]
        if entry["rng"] is None:
            self._rng, self._next, self._pending = None, entry["next"], None
        else:
            rng = np.random.default_rng()
            rng.bit_generator.state = entry["rng"]
            self._rng, self._next, self._pending = rng, 0, entry["next"]

    def leave_one_out_states(self) -> List[dict]:
        """The k states without one group each, from prefix and suffix merges
        (3k merges in all, exact: no subtraction of moments)."""
        k = len(self.parts)
        sizes = [part.n for part in self.parts]
        if min(sizes) < 1:
            raise ValueError(f"uncertainty needs every group filled; group sizes are {sizes} "
                             f"(make at least {k} updates, or use fewer groups)")
        prefix = [self._make()]
        for part in self.parts[:-1]:
            nxt = self._make()
            nxt.merge(prefix[-1])
            nxt.merge(part)
            prefix.append(nxt)
        out: List[Any] = [None] * k
        suffix = self._make()
        for i in range(k - 1, -1, -1):
            loo = self._make()
            loo.merge(prefix[i])
            loo.merge(suffix)
            out[i] = loo.to_state()
            suffix.merge(self.parts[i])
        return out


def _device_state(core: Any, device: str) -> dict:
    """The keys of a state dict with float64 torch tensors on ``device``
    (copied device to device from a CUDA backend; symmetric matrices filled)."""
    import torch

    n = int(core.n)  # synchronises; raises a pending device-side input error
    sh = core.shape()
    if n == 0 or sh["p"] < 0:
        return core.get_state()
    dev = torch.device(device)
    st = {"n": n, **{k: sh[k] for k in ("p", "c", "t", "k", "num_classes", "precision")}}
    dtypes: Dict[type, Any] = {np.float64: torch.float64, np.int64: torch.int64}
    for f in _state.FIELDS:
        st[f.name] = torch.empty(_state.shape_of(f, sh), dtype=dtypes[f.dtype], device=dev)
    core.export_to({f.name: st[f.name].data_ptr() for f in _state.FIELDS if st[f.name].numel() > 0})
    return st


def _address(a: Any) -> int:
    """The data address of a C-contiguous numpy array or torch tensor."""
    return int(a.ctypes.data) if isinstance(a, np.ndarray) else int(a.data_ptr())


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray, trans_b: bool = False) -> None:
    """``out = a @ b`` (``a @ b.T`` with ``trans_b``) for C-contiguous numpy
    matrices of one float dtype, by the core's BLAS on the calling thread
    only: no thread pool (numpy's, torch's) wakes beside the core's workers
    and the training's for a product this small."""
    _core.matmul(a, b, out, trans_b)


def centered_grams(features: Any, rows: int, precision: str, grams: Any, norms: Any) -> None:
    """The Gram Xc Xc^T of each block of ``rows`` consecutive rows of
    ``features`` (an ``_adapt.Matrix`` on the CPU), each block centered on its
    own float64 mean before narrowing to the product precision, one product
    per block: written into ``grams`` (blocks x rows x rows, float32, or
    float64 for fp64; a numpy array or a CPU torch tensor), their Frobenius
    norms into ``norms`` (float64, one per block)."""
    _core.centered_grams(features.arg(), rows, precision, _address(grams), _address(norms))
