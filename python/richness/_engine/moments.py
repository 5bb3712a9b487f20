"""The public accumulator: ``Moments`` and the one-shot ``dlr``."""

from __future__ import annotations

import copy
import functools
import os
import threading
import warnings
from typing import Any, Callable, Optional, TypeVar, cast

import numpy as np

from .. import _state
from . import adapt as _adapt
from . import statefile as _statefile
from .. import finish as _finish
from ..finish.uncertainty import add_jackknife, add_measure_jackknife
from .._checks import check_int
from .backend import Backend, Batch, adapt_batch, CoreBackend, GroupedBackend, Lockable
from .cuda_options import CudaOptions
from .._report import Report
from .._warnings import RichnessWarning

_F = TypeVar("_F", bound=Callable[..., Any])


def _refuses_head(fn: _F) -> _F:
    """``fn`` (which takes the read-out weights as ``head_weights=``), except
    that ``head=`` raises a TypeError saying so: ``head=`` names a module in
    ``evaluate``, ``Monitor`` and the callbacks, and a weight given under that
    name would otherwise fail with Python's bare unknown-keyword error. The
    signature seen by ``inspect`` and type checkers is ``fn``'s."""
    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if "head" in kwargs:
            raise TypeError(f"{fn.__name__}() got an unexpected keyword argument 'head': read-out weights "
                            "((W, b), W or an nn.Linear) go to head_weights= (head= names the module to hook in "
                            "evaluate, Monitor and the callbacks)")
        return fn(*args, **kwargs)
    return cast(_F, checked)


# The largest Moments(groups=k) (_state.MAX_GROUPS: also the bound of a saved file's groups).
MAX_GROUPS = _state.MAX_GROUPS


class Moments(Lockable):
    """Streamed float64 co-moments of features (and outputs, labels, targets).

    Args:
        num_classes: fix the label range to ``0..num_classes-1``; when None the
            class arrays grow with the largest label seen.
        device: ``"cpu"``, ``"cuda"``/``"cuda:N"``, or None to follow the first
            batch's device.
        precision: precision of the products. None: ``"fp64"`` when every input
            of a batch is float64, else ``"fp32"``. ``"fp64"`` widens float32
            inputs; ``"tf32"`` and ``"bf16"`` are CUDA-only modes. The state is
            float64 at rest whatever the mode.

        groups: keep the samples in ``groups`` sub-states (k >= 2), so that
            ``compute(uncertainty=True)`` gives a delete-one-group jackknife
            standard error at the cost of k merges, never a second pass. Each
            ``update`` (and each ``merge`` of a state without groups) goes whole
            to one group: in turn, or at random when ``group_seed`` is given; a
            ``Moments`` of the same ``groups=k`` merges group i into group i.
            ``save``, ``state_dict`` and copies keep the groups and where the
            assignment stands. Costs k times the memory
            (k float64 states of ``8 (p^2 + pC + C^2 + ...)`` bytes once filled);
            at most ``MAX_GROUPS`` (1024).
        group_seed: seed for the random assignment of updates to groups.
        cuda: a ``CudaOptions`` that tunes the CUDA backend (staging rows
            before one device product, how X^T X is formed), for benchmarks
            and checks; None: the defaults. A state on the CPU refuses
            non-default options with a ``ValueError``.

    ``update`` adds a batch; ``merge`` adds another state; ``compute`` finishes
    a ``Report`` without touching the state. Invalid input raises and leaves
    the state exactly as it was.

    ``copy.copy``, ``copy.deepcopy`` and ``pickle`` give an equal, independent
    ``Moments`` (through the state dict; a CUDA one is rebuilt on its device).

    One ``Moments`` may be updated, merged and read from several threads at
    once: each call holds its backend's lock (the GIL is released while it
    waits and computes) and sees whole batches only.
    """

    def __init__(self, num_classes: Optional[int] = None, *, device: Optional[str] = None,
                 precision: Optional[str] = None, groups: Optional[int] = None,
                 group_seed: Optional[int] = None, cuda: Optional[CudaOptions] = None) -> None:
        groups = check_int(groups, "groups", low=2, high=MAX_GROUPS, allow_none=True,
                           note="each group holds a whole state: k groups cost k times the memory")
        if group_seed is not None and groups is None:
            raise ValueError("group_seed needs groups=k")
        num_classes = _state.check_num_classes(num_classes)
        if precision is not None:
            _state.precision_mode(precision, _state.PRECISION_ARGUMENT)
        if device is not None:
            device = str(device)
            if device != "cpu" and not device.startswith("cuda"):
                raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
            if device == "cuda":
                device = "cuda:0"
        if device == "cpu" and precision is not None:
            _state.check_runs_on_cpu(precision)
        if cuda is not None and not isinstance(cuda, CudaOptions):
            raise TypeError(f"cuda must be a richness.CudaOptions or None, got {type(cuda).__name__}")
        # non-default options on the CPU are refused by CoreBackend, where the device is
        # known: here below (device given) or at the first batch, merge or load.
        self._cuda = CudaOptions() if cuda is None else cuda
        self.num_classes = None if num_classes is None else int(num_classes)
        self.precision = precision
        self._device = device
        self._backend: Optional[Backend] = None  # created by the first batch, merge or load (or here, with a device)
        self._groups = None if groups is None else int(groups)
        self._group_seed = group_seed
        self._lock = threading.Lock()  # guards creating the backend (the core locks each backend itself)
        if device is not None:
            self._create(device)

    # -- routing ---------------------------------------------------------------

    def _make_backend(self, device: str) -> CoreBackend:
        return CoreBackend(device, self.num_classes, self._cuda)

    def _new_backend(self, device: str) -> Backend:
        if self._groups is None:
            return self._make_backend(device)
        # a bound method, not a closure: the backend pickles and copies with its Moments
        return GroupedBackend(functools.partial(self._make_backend, device), self._groups, self._group_seed)

    @property
    def device(self) -> Optional[str]:
        """Where the state lives: ``"cpu"``, ``"cuda:N"``, or None before the first batch."""
        return self._device

    def _create(self, device: str) -> None:
        backend = self._new_backend(device)  # raises before anything changes (CUDA options on the CPU)
        self._device = device
        self._backend = backend

    @property
    def staged_rows(self) -> int:
        """Rows staged on the device (``CudaOptions.stack_rows``) and not yet in the state;
        0 without staging. Host-known: reading it never waits for the device."""
        return 0 if self._backend is None else self._backend.staged_rows

    @property
    def staged_batches(self) -> int:
        """The number of batches those staged rows came from."""
        return 0 if self._backend is None else self._backend.staged_batches

    def _grouped(self) -> GroupedBackend:
        """The backend of a ``Moments(groups=k)`` (created)."""
        return cast(GroupedBackend, self._backend)

    def _backend_for(self, device: str) -> Backend:
        """The backend the next update or merge goes to."""
        if self._backend is None:
            with self._lock:  # two threads' first batches must not create two backends
                if self._backend is None:
                    self._create(device)
        if device != self._device:
            raise ValueError(f"this Moments lives on {self._device} but the batch is on {device}; "
                             "move the batch or use a Moments on that device")
        return cast(Backend, self._backend)  # created above

    # -- accumulation ---------------------------------------------------------

    def update(self, features: Any, outputs: Any = None, labels: Any = None, targets: Any = None) -> None:
        """Add a batch: ``features`` (n, p); optional ``outputs`` (n, C),
        integer ``labels`` (n,) and float ``targets`` (n, T) or (n,)."""
        self._update_batch(adapt_batch(features, outputs, labels, targets))

    def _update_batch(self, batch: Batch) -> None:
        """``update`` with the batch adapted (``backend.adapt_batch``): for a
        caller that has adapted it already (the torchmetrics metric)."""
        self._backend_for(batch.features.device).update(batch, batch_precision(self.precision, batch))

    def merge(self, other: "Moments") -> None:
        """Add another state (Chan et al. pairwise merge; exact up to rounding).
        With ``groups=k``: another ``Moments(groups=k)`` group by group, one
        without groups into one group; other group counts are refused. A
        grouped state merged into one without groups adds its samples and
        warns that its groups are not kept."""
        if not isinstance(other, Moments):
            raise TypeError(f"merge expects a Moments, got {type(other).__name__}")
        if self._groups is not None and other._groups is not None and self._groups != other._groups:
            raise ValueError(f"cannot merge: this Moments keeps {self._groups} groups, the other {other._groups} "
                             "(group i merges into group i: merge Moments of the same groups=k)")
        _state.check_compatible([self._widths(), other._widths()])  # the rule of every merge, one wording
        if other._backend is None or other.n == 0:
            return
        if self._groups is None and other._groups is not None:
            _warn(f"merging a Moments(groups={other._groups}) into a Moments without groups: its samples are "
                  "added, its groups are not kept (compute(uncertainty=True) needs them): to keep them, merge into a "
                  f"Moments(groups={other._groups})")
        device = self._device if self._backend is not None else other._device
        self._backend_for(cast(str, device)).merge(other._backend)  # a Moments with a backend has a device

    def all_reduce(self, group: Any = None) -> None:
        """Merge the states of all ranks of ``group`` (torch.distributed, gloo or
        NCCL) in float64: afterwards every rank holds the global state. Exact up
        to rounding (docs/MATH.md, "Merging states": shift to the global mean,
        then sum); collective, so every rank must call it. With ``groups=k``
        each rank's group i is merged with the other ranks' group i, so the
        jackknife still works afterwards. Incompatible states raise the same
        ValueError on every rank, and no rank's state changes."""
        from .distributed import all_reduce_states

        if self._groups is not None:
            # a rank that saw no data has no backend yet: it holds k empty groups
            mine = (self._grouped().group_states() if self._backend is not None
                    else [_state.empty(self.num_classes) for _ in range(self._groups)])
            states = [_state.checked(st) for st in all_reduce_states(mine, group=group)]
            self._check_num_classes(states)
            self._backend_for(self._device or "cpu")
            self._grouped().load_group_states(states)
            self.num_classes = self._merged_num_classes(states)
            return
        self.load_state_dict(all_reduce_states([self.state_dict()], group=group)[0])

    def _widths(self) -> dict:
        """The state's integer widths (``_state.WIDTHS``, ``n`` included), from the host."""
        if self._backend is None:
            return _state.widths_of(_state.empty(self.num_classes))
        w = self._backend.widths()
        return dict({k: int(w[k]) for k in _state.WIDTHS if k != "n"}, n=self.n)

    def _check_num_classes(self, states: list) -> None:
        for st in states:
            if self.num_classes is not None and st["num_classes"] != self.num_classes:
                raise ValueError(f"state was saved with num_classes={st['num_classes']}, "
                                 f"this Moments has num_classes={self.num_classes}")

    def _merged_num_classes(self, states: list) -> Optional[int]:
        nc = max(int(st["num_classes"]) for st in states)
        return None if nc < 0 else nc

    def reset(self) -> None:
        """Forget all samples (widths are free again; num_classes is kept)."""
        if self._backend is not None:
            self._backend.reset()

    @property
    def n(self) -> int:
        """Number of samples accumulated."""
        return 0 if self._backend is None else self._backend.n

    # -- finishing ------------------------------------------------------------

    @_refuses_head
    def compute(self, *, head_weights: Any = None, test: Optional["Moments"] = None, rtol: Optional[float] = None,
                centered: bool = True, uncertainty: bool = False, spectrum: bool = True,
                measures: Any = None, measure_options: Optional[dict] = None) -> Report:
        """Finish a ``Report`` (float64); the state is not modified.

        Args:
            head_weights: linear read-out weights ``(W, b)``, ``W`` or a
                ``torch.nn.Linear`` (its weights); then DLR uses ``B = M W^T``,
                ``A = W M W^T`` and outputs need not be streamed. Otherwise
                streamed outputs are used. (``head=`` elsewhere, in
                ``evaluate``, ``Monitor`` and the callbacks, names the module to
                hook.)
            test: a ``Moments`` over held-out samples: adds ``test_quality``,
                ``test_utilization`` and ``test_eigenfunction_norms``.
            rtol: eigenvalue cut; default by product precision (docs/MATH.md, "Rank cut").
            centered: spectrum of the centered operator (default) or the
                paper's v1 uncentered one.
            spectrum: False skips the p x p eigendecomposition and what rests
                on it (eigenvalues, curves): DLR alone costs O(p^2 C), the
                full report O(p^3). For monitoring at large p.
            measures: the representation diagnostics to compute (RankMe,
                alpha-ReQ, participation ratio, NC2, NC3, LiDAR: names from
                ``richness.finish.MEASURES``, or ``"all"``). Default: all but
                LiDAR with the spectrum, none with ``spectrum=False`` (a
                spectral one then adds the p x p eigenvalues, no
                eigenvectors). ``"lidar"`` reads the labels as object ids (the
                augmentations of one input share one) and costs a p x p
                eigendecomposition of its own; computed only where named.
            measure_options: how those are computed where a user must match other
                code (default: as published): ``{"alpha_req_range": (11, 100),
                "alpha_req_weights": "1/k" or "uniform", "nc_convention": "paper"
                or "papyan_script", "lidar_delta": 1e-4}`` (LiDAR's ridge
                delta I on the within-object covariance, >= 0) (docs/MATH.md,
                representation diagnostics).
            uncertainty: add ``dlr_stderr``, ``dlr_interval`` (95%) and the
                bias-corrected ``dlr_jackknife`` from a delete-one-group
                jackknife, and ``measures_stderr`` for the measures set; needs
                ``Moments(groups=k)``.
        """
        W = _adapt.weights_of(head_weights)[0] if head_weights is not None else None
        test_state = None
        if test is not None:
            if not isinstance(test, Moments):
                raise TypeError(f"test must be a Moments, got {type(test).__name__}")
            test_state = test.state_dict()
        if uncertainty and self._groups is None:
            raise ValueError("uncertainty=True needs the samples kept in groups: use Moments(groups=k), k >= 2")
        report = _finish.finish(self.device_state(), W=W, test=test_state, rtol=rtol, centered=centered,
                                spectrum=spectrum, measures=measures, measure_options=measure_options)
        if uncertainty:
            set_measures = [name for name in _finish.MEASURES if getattr(report, name) is not None]
            if report.dlr is None and not set_measures:
                raise ValueError("uncertainty needs outputs or a head: DLR is undefined without them")
            loo = self._grouped().leave_one_out_states()
            if report.dlr is not None:
                add_jackknife(report, loo, W)
            add_measure_jackknife(report, loo, W, set_measures, centered,
                                          _finish.check_options(measure_options))
        return report

    # -- persistence ----------------------------------------------------------

    def device_state(self) -> dict:
        """``state_dict()``, except that a CUDA state stays on its device as
        float64 torch tensors (a device-to-device copy; symmetric matrices
        filled), which ``richness.finish`` finishes there."""
        if self._backend is None:
            return self.state_dict()
        return self._backend.device_state()

    def export_into(self, arrays: dict) -> dict:
        """Write ``state_dict()``'s arrays into the caller's: ``arrays`` maps
        every array's name in ``state_dict()`` to a
        writable C-contiguous numpy array of that field's dtype and size
        (symmetric matrices full). Returns the scalars (``n``, widths,
        ``num_classes``, ``precision``). Every size is checked first: on a
        mismatch (the class count grew, say) nothing is written. CPU states
        only; no allocation, one pass over the state."""
        backend = self._backend or self._make_backend("cpu")  # empty: a CPU state of no samples
        return backend.whole().export_into(arrays)

    def state_dict(self) -> dict:
        """A float64 numpy copy of the state (symmetric matrices filled).

        With ``groups=k`` it also holds the groups in one more entry,
        ``"groups"``: ``{"states": [k state dicts], "next": the group the
        next update goes to, "seed": group_seed, "rng": the random
        generator's state (None for groups in turn)}``; the other entries are
        the state of all samples, as without groups. ``load_state_dict`` of
        a ``Moments`` of the same ``groups`` restores them, and the
        assignment goes on as it would have."""
        if self._groups is None:
            return _state.empty(self.num_classes) if self._backend is None else self._backend.to_state()
        if self._backend is None:  # no batch yet: k empty groups, the assignment at its start
            seed = self._group_seed
            entry = {"states": [_state.empty(self.num_classes) for _ in range(self._groups)], "next": 0,
                     "seed": int(seed) if isinstance(seed, (int, np.integer)) else None, "rng": None}
            if seed is not None:
                rng = np.random.default_rng(seed)
                entry["next"] = int(rng.integers(self._groups))  # the draw _pick makes (GroupedBackend)
                entry["rng"] = rng.bit_generator.state
            return dict(_state.empty(self.num_classes), **{_state.GROUPS: entry})
        whole, entry = self._grouped().grouped_state()
        whole[_state.GROUPS] = entry
        return whole

    def load_state_dict(self, state: dict) -> None:
        """Replace the state with ``state``. It is validated first (shapes,
        types, and the invariants every real state satisfies: class counts
        adding up to ``n``, class sums to ``n`` times the mean, no negative
        variance); on error nothing changes.

        A state with ``"groups"`` (``state_dict`` of a ``Moments(groups=k)``)
        loads into a ``Moments`` of the same ``groups=k`` only (a ValueError
        naming both counts otherwise): its groups and the assignment of the
        next updates are restored. A state without groups loads into a
        ``Moments(groups=k)`` as one block in the first group (the jackknife
        then needs later updates to fill the others)."""
        self._load(state, gram=True)

    def _load_own_state_dict(self, state: dict) -> None:
        """``load_state_dict`` for a state dict that this library exported
        from one of its own accumulators and hands between its own steps (the
        states of ``richness.dask``'s tasks, a ``Similarity`` state shifted
        for a merge): every check but the semi-definiteness factorisations,
        which updates and merges satisfy by construction (``_state.checked``,
        ``gram=False``). Never for a file or a state dict from outside."""
        self._load(state, gram=False)

    def _load(self, state: dict, gram: bool) -> None:
        entry = None
        if isinstance(state, dict) and _state.GROUPS in state:
            count = _state.group_count(state[_state.GROUPS])
            if count != self._groups:
                mine = "keeps none (groups=None)" if self._groups is None else f"keeps {self._groups}"
                raise ValueError(f"the state holds {count} groups, this Moments {mine}: load it into a "
                                 f"Moments(groups={count}), or drop its {_state.GROUPS!r} entry to load the state "
                                 "of all its samples")
            entry = state[_state.GROUPS]
            state = {k: v for k, v in state.items() if k != _state.GROUPS}
        state = _state.checked(state, gram=gram)
        w = _state.widths_of(state)
        self._check_num_classes([state])
        device = self._device or "cpu"
        previous = self.num_classes
        # the backends (every group's too) are built for the state's classes
        self.num_classes = None if w["num_classes"] < 0 else w["num_classes"]
        try:
            backend = self._new_backend(device)
            if entry is None:
                backend.from_state(state)  # validates in the core; raises before anything changes
            else:
                groups = _state.checked_groups(entry, state, gram=gram)
                grouped = cast(GroupedBackend, backend)
                grouped.load_groups(groups)  # each group validated in the core
                _state.check_groups_add_up(state, grouped.to_state())
                self._group_seed = groups["seed"]
        except BaseException:
            self.num_classes = previous
            raise
        self._backend = backend
        self._device = device

    def save(self, path: "os.PathLike | str") -> None:
        """Write the state to ``path`` atomically (an .npz archive, no pickle)."""
        _statefile.save_state(self.state_dict(), path)

    @classmethod
    def load(cls, path: "os.PathLike | str", *, device: Optional[str] = None) -> "Moments":
        """Read a state written by ``save``, by this richness or an older one
        (docs/ARCHITECTURE.md, "Adding things"); rejects truncated, corrupted or
        foreign files and files of a newer richness with a ValueError naming
        the file."""
        state = _statefile.load_state(path)
        try:  # the archive is intact; its entries may still not form a valid state
            entry = state.get(_state.GROUPS)
            groups = None if entry is None else _state.group_count(entry)
            m = cls(device=device or "cpu", groups=groups, group_seed=None if entry is None else entry["seed"])
            m.load_state_dict(state)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{os.fspath(path)}: not a valid richness state ({e})") from None
        return m

    def __copy__(self) -> "Moments":
        # A Moments is a value: a shallow copy that shared the accumulator
        # with the original would not be a copy of the data at all.
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        if self._backend is None or self.n == 0:
            return "Moments(empty)"
        groups = "" if self._groups is None else f", groups={self._groups}"
        return f"Moments(n={self.n}, p={self._backend.widths()['p']}, device={self._device!r}{groups})"


def _warn(msg: str) -> None:
    warnings.warn(msg, RichnessWarning, stacklevel=3)


def batch_precision(precision: Optional[str], batch: Batch) -> str:
    """The product precision of one batch: ``precision``, or by default
    ``"fp64"`` when every float input is float64, else ``"fp32"``."""
    floats = [m.dtype for m in (batch.features, batch.outputs, batch.targets) if m is not None]
    return _state.default_precision(precision, all(d == _adapt.F64 for d in floats))


@_refuses_head
def dlr(features: Any, outputs: Any = None, *, head_weights: Any = None,
        rtol: Optional[float] = None) -> Optional[float]:
    """DLR of one set of samples (0 = rich, 1 = lazy); None where it is
    undefined (as ``Report.dlr``).

    Give ``outputs`` (n, C), or ``head_weights`` (``(W, b)``, ``W`` or a
    ``torch.nn.Linear``) for the linear-head shortcut.
    """
    if outputs is None and head_weights is None:
        raise ValueError("dlr needs outputs or head_weights: the learned function space is undefined without them")
    m = Moments()
    m.update(features, outputs)
    return m.compute(head_weights=head_weights, rtol=rtol).dlr
