"""The public accumulator: ``Moments`` and the one-shot ``dlr``."""

from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np

from . import _adapt, _finish, _io, _uncertainty
from ._core import CpuMoments
from ._report import Report

_STACK_CPU = ("stack_rows is an option of the CUDA backend (it stages rows before one device product); "
              "the CPU backend has no staging: use stack_rows=0 with CPU data")

_STATE_SHAPES = {
    "mean": ("p",), "M": ("p", "p"), "out_mean": ("c",), "B": ("p", "c"), "A": ("c", "c"),
    "tgt_mean": ("t",), "Bt": ("p", "t"), "At": ("t", "t"), "class_counts": ("k",),
    "class_sums": ("k", "p"),
}


def _cuda_backend(num_classes: int, device: str):
    try:
        import torch  # noqa: F401  loads libcublas and the CUDA runtime that _cuda links against
        from . import _cuda  # built only with RICHNESS_CUDA; needs libcublas at import
    except ImportError as e:
        raise RuntimeError(f"device {device!r} needs the CUDA backend, which is not available here ({e})") from None
    index = int(device.split(":")[1]) if ":" in device else 0
    return _cuda.CudaMoments(num_classes, index)


class Moments:
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
            ``update`` (and each ``merge``) goes whole to one group: in turn, or
            at random when ``group_seed`` is given. Costs k times the memory.
        group_seed: seed for the random assignment of updates to groups.
        stack_rows: CUDA only (a ``ValueError`` on the CPU). 0 (default): one
            product and one float64 merge per batch. N > 0: each batch is
            centered on its own float64 mean and staged (narrowed to the
            product precision) until the next would pass N rows; then one
            product over all staged rows and one exact multi-batch merge.
            Meant to fill the tensor cores better (not yet measured on a GPU;
            benchmarks/RESULTS_GPU.md). Costs ``N * (p + C
            + T)`` device elements in the product precision (4 bytes fp32/tf32,
            2 bf16, 8 fp64) plus a ``(p + C + T)^2`` product, per Moments (per
            group with ``groups``). The state, ``n``, ``state_dict`` and
            ``compute`` are those of the per-batch path up to the products'
            rounding (staged rows are merged before anything reads the state);
            ``update`` still never waits for the device. An ``update`` captured
            in a CUDA graph takes the per-batch path (a replay must add its
            batch again); rows staged before the capture are merged later.

    ``update`` adds a batch; ``merge`` adds another state; ``compute`` finishes
    a ``Report`` without touching the state. Invalid input raises and leaves
    the state exactly as it was.
    """

    def __init__(self, num_classes: Optional[int] = None, *, device: Optional[str] = None,
                 precision: Optional[str] = None, groups: Optional[int] = None,
                 group_seed: Optional[int] = None, stack_rows: int = 0) -> None:
        if groups is not None and (not isinstance(groups, (int, np.integer)) or groups < 2):
            raise ValueError(f"groups must be an integer >= 2 or None, got {groups!r}")
        if group_seed is not None and groups is None:
            raise ValueError("group_seed needs groups=k")
        if num_classes is not None and (not isinstance(num_classes, (int, np.integer)) or num_classes < 1):
            raise ValueError(f"num_classes must be a positive integer or None, got {num_classes!r}")
        if precision is not None and precision not in _adapt.PRECISIONS:
            raise ValueError(f"precision must be one of {_adapt.PRECISIONS} or None, got {precision!r}")
        if device is not None:
            device = str(device)
            if device != "cpu" and not device.startswith("cuda"):
                raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
            if device == "cuda":
                device = "cuda:0"
        if device in (None, "cpu") and precision in ("tf32", "bf16"):
            if device == "cpu":
                raise ValueError(f"precision {precision!r} needs device='cuda'; the CPU multiplies in fp32 or fp64")
        if (isinstance(stack_rows, (bool, np.bool_)) or not isinstance(stack_rows, (int, np.integer))
                or not 0 <= stack_rows < 2**31):
            raise ValueError(f"stack_rows must be an integer in [0, 2**31), got {stack_rows!r}")
        if stack_rows and device == "cpu":
            raise ValueError(_STACK_CPU)
        self.stack_rows = int(stack_rows)
        self.num_classes = None if num_classes is None else int(num_classes)
        self.precision = precision
        self._device = device
        self._impl = None  # the whole state (without groups)
        self._parts = None  # the group sub-states (with groups)
        self._groups = None if groups is None else int(groups)
        self._next_group = 0
        self._group_rng = None if group_seed is None else np.random.default_rng(group_seed)
        if device is not None:
            self._create(device)

    # -- backend --------------------------------------------------------------

    def _make_backend(self, device: str):
        nc = -1 if self.num_classes is None else self.num_classes
        if device == "cpu":
            if self.stack_rows:
                raise ValueError(_STACK_CPU)
            return CpuMoments(nc)
        impl = _cuda_backend(nc, device)
        if self.stack_rows:
            impl.set_stack(self.stack_rows)
        return impl

    @property
    def device(self) -> Optional[str]:
        """Where the state lives: ``"cpu"``, ``"cuda:N"``, or None before the first batch."""
        return self._device

    def _create(self, device: str) -> None:
        if device == "cpu" and self.stack_rows:  # before anything changes
            raise ValueError(_STACK_CPU)
        self._device = device
        if self._groups is None:
            self._impl = self._make_backend(device)
        else:
            self._parts = [self._make_backend(device) for _ in range(self._groups)]

    @property
    def _started(self) -> bool:
        return self._impl is not None or self._parts is not None

    def _sink(self, device: str):
        """The backend the next update or merge goes to (one group, in turn)."""
        if not self._started:
            self._create(device)
        elif device != self._device:
            raise ValueError(f"this Moments lives on {self._device} but the batch is on {device}; "
                             "move the batch or use a Moments on that device")
        if self._parts is None:
            return self._impl
        return self._parts[self._pick_group()]

    def _pick_group(self) -> int:
        if self._group_rng is not None:
            return int(self._group_rng.integers(self._groups))
        return self._next_group

    def _advance_group(self) -> None:
        # Called only after a successful update, so a rejected batch leaves the
        # rotation (and so the state) exactly as it was.
        if self._parts is not None and self._group_rng is None:
            self._next_group = (self._next_group + 1) % self._groups

    def _whole(self):
        """A backend holding all samples (the groups merged: k merges)."""
        if self._parts is None:
            return self._impl
        total = self._make_backend(self._device)
        for part in self._parts:
            total.merge(part)
        return total

    # -- accumulation ---------------------------------------------------------

    def update(self, features: Any, outputs: Any = None, labels: Any = None, targets: Any = None) -> None:
        """Add a batch: ``features`` (n, p); optional ``outputs`` (n, C),
        integer ``labels`` (n,) and float ``targets`` (n, T) or (n,)."""
        fx = _adapt.as_matrix(features, "features")
        ox = _adapt.as_matrix(outputs, "outputs", allow_1d=True) if outputs is not None else None
        yx = _adapt.as_labels(labels) if labels is not None else None
        tx = _adapt.as_matrix(targets, "targets", allow_1d=True) if targets is not None else None
        parts = [m for m in (fx, ox, yx, tx) if m is not None]
        devices = {m.device for m in parts}
        if len(devices) > 1:
            raise ValueError(f"inputs of one batch are on different devices: {sorted(devices)}")
        impl = self._sink(fx.device)
        precision = self.precision
        if precision is None:
            floats = [m.dtype for m in (fx, ox, tx) if m is not None]
            precision = "fp64" if all(d == _adapt.F64 for d in floats) else "fp32"
        args = (fx.arg(), ox.arg() if ox else None, yx.arg() if yx else None, tx.arg() if tx else None,
                _adapt.PRECISIONS.index(precision))
        if self._device == "cpu":
            impl.update(*args)
        else:
            impl.update(*args, _current_stream(fx.owner))
        self._advance_group()

    def merge(self, other: "Moments") -> None:
        """Add another state (Chan et al. pairwise merge; exact up to rounding)."""
        if not isinstance(other, Moments):
            raise TypeError(f"merge expects a Moments, got {type(other).__name__}")
        if not other._started or other.n == 0:
            return
        source = other._whole()
        sink = self._sink(self._device if self._started else other._device)
        if source is sink or type(source) is not type(sink):
            tmp = self._make_backend(self._device)
            tmp.set_state(source.get_state())
            source = tmp
        sink.merge(source)
        self._advance_group()

    def all_reduce(self, group: Any = None) -> None:
        """Merge the states of all ranks of ``group`` (torch.distributed, gloo or
        NCCL) in float64: afterwards every rank holds the global state. Exact up
        to rounding (SPEC.md: shift to the global mean, then sum); collective,
        so every rank must call it."""
        from ._distributed import all_reduce_state

        self.load_state_dict(all_reduce_state(self.state_dict(), group=group))

    def reset(self) -> None:
        """Forget all samples (widths are free again; num_classes is kept)."""
        for impl in self._parts or [self._impl]:
            if impl is not None:
                impl.reset()
        self._next_group = 0

    @property
    def n(self) -> int:
        """Number of samples accumulated."""
        if self._parts is not None:
            return sum(int(part.n) for part in self._parts)
        return 0 if self._impl is None else int(self._impl.n)

    # -- finishing ------------------------------------------------------------

    def compute(self, *, head: Any = None, test: Optional["Moments"] = None, rtol: Optional[float] = None,
                centered: bool = True, uncertainty: bool = False, spectrum: bool = True) -> Report:
        """Finish a ``Report`` (float64); the state is not modified.

        Args:
            head: linear read-out weights ``(W, b)``, ``W`` or a ``torch.nn.Linear``;
                then DLR uses ``B = M W^T``, ``A = W M W^T`` and outputs need not
                be streamed. Otherwise streamed outputs are used.
            test: a ``Moments`` over held-out samples: adds ``test_quality``,
                ``test_utilization`` and ``test_eigenfunction_norms``.
            rtol: eigenvalue cut; default by product precision (SPEC.md).
            centered: spectrum of the centered operator (default) or the
                paper's v1 uncentered one.
            spectrum: False skips the p x p eigendecomposition and what rests
                on it (eigenvalues, curves): DLR alone costs O(p^2 C), the
                full report O(p^3). For monitoring at large p.
            uncertainty: add ``dlr_stderr``, ``dlr_interval`` (95%) and the
                bias-corrected ``dlr_jackknife`` from a delete-one-group
                jackknife; needs ``Moments(groups=k)``.
        """
        W = _adapt.weights_of(head)[0] if head is not None else None
        test_state = None
        if test is not None:
            if not isinstance(test, Moments):
                raise TypeError(f"test must be a Moments, got {type(test).__name__}")
            test_state = test.state_dict()
        if uncertainty and self._groups is None:
            raise ValueError("uncertainty=True needs the samples kept in groups: use Moments(groups=k), k >= 2")
        report = _finish.finish(self._finish_state(), W=W, test=test_state, rtol=rtol, centered=centered,
                                spectrum=spectrum)
        if uncertainty:
            if report.dlr is None:
                raise ValueError("uncertainty needs outputs or a head: DLR is undefined without them")
            _uncertainty.add_jackknife(report, self._leave_one_out_states(), W)
        return report

    def _leave_one_out_states(self) -> list:
        """The k states without one group each, from prefix and suffix merges
        (3k merges in all, exact: no subtraction of moments)."""
        k = self._groups
        sizes = [int(part.n) for part in self._parts]
        if min(sizes) < 1:
            raise ValueError(f"uncertainty needs every group filled; group sizes are {sizes} "
                             f"(make at least {k} updates, or use fewer groups)")
        prefix = [self._make_backend(self._device)]
        for part in self._parts[:-1]:
            nxt = self._make_backend(self._device)
            nxt.merge(prefix[-1])
            nxt.merge(part)
            prefix.append(nxt)
        out = [None] * k
        suffix = self._make_backend(self._device)
        for i in range(k - 1, -1, -1):
            loo = self._make_backend(self._device)
            loo.merge(prefix[i])
            loo.merge(suffix)
            out[i] = loo.get_state()
            suffix.merge(self._parts[i])
        return out

    # -- persistence ----------------------------------------------------------

    def _finish_state(self) -> dict:
        """``state_dict()``, except that a CUDA state stays on its device as
        float64 torch tensors, so that ``compute`` finishes there."""
        if self._device in (None, "cpu") or not self._started:
            return self.state_dict()
        return _device_state(self._whole(), self._device)

    def state_dict(self) -> dict:
        """A float64 numpy copy of the state (symmetric matrices filled)."""
        if not self._started:
            return CpuMoments(-1 if self.num_classes is None else self.num_classes).get_state()
        return self._whole().get_state()

    def load_state_dict(self, state: dict) -> None:
        """Replace the state with ``state`` (validated first; on error nothing changes)."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        missing = [k for k in _io.SCALARS + _io.FLOATS + _io.INTS if k not in state]
        if missing:
            raise ValueError(f"state is missing entries: {', '.join(missing)}")
        dims = {}
        for key in ("n", "p", "c", "t", "k", "num_classes"):
            v = state[key]
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"state entry {key!r} must be an integer, got {type(v).__name__}")
            dims[key] = int(v)
        if not isinstance(state["precision"], str):
            raise TypeError(f"state entry 'precision' must be a string, got {type(state['precision']).__name__}")
        if state["precision"] not in _adapt.PRECISIONS:
            raise ValueError(f"state entry 'precision' is {state['precision']!r}, expected one of {_adapt.PRECISIONS}")
        for key, axes in _STATE_SHAPES.items():
            want = tuple(max(dims[a], 0) for a in axes)
            got = np.shape(state[key])
            if got != want:
                raise ValueError(f"state entry {key!r} has shape {got}, expected {want}")
        if self.num_classes is not None and dims["num_classes"] != self.num_classes:
            raise ValueError(f"state was saved with num_classes={dims['num_classes']}, "
                             f"this Moments has num_classes={self.num_classes}")
        for key in _io.FLOATS:
            if not np.isfinite(np.asarray(state[key], dtype=np.float64)).all():
                raise ValueError(f"state entry {key!r} contains NaN or Inf")
        device = self._device or "cpu"
        target = self._make_backend(device)
        target.set_state(dict(state))  # validates; raises before anything changes
        self._device = device
        if self._groups is None:
            self._impl = target
        else:  # a loaded state is one block: the jackknife needs later updates
            self._parts = [target] + [self._make_backend(device) for _ in range(self._groups - 1)]
            self._next_group = 1 % self._groups
        self.num_classes = None if dims["num_classes"] < 0 else dims["num_classes"]

    def save(self, path: "os.PathLike | str") -> None:
        """Write the state to ``path`` atomically (an .npz archive, no pickle)."""
        _io.save_state(self.state_dict(), path)

    @classmethod
    def load(cls, path: "os.PathLike | str", *, device: Optional[str] = None) -> "Moments":
        """Read a state written by ``save``; rejects truncated, corrupted or
        foreign files and unknown versions with a ValueError naming the file."""
        state = _io.load_state(path)
        m = cls(device=device or "cpu")
        try:  # the archive is intact; its entries may still not form a valid state
            m.load_state_dict(state)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{os.fspath(path)}: not a valid richness state ({e})") from None
        return m

    def __repr__(self) -> str:
        if not self._started or self.n == 0:
            return "Moments(empty)"
        groups = "" if self._groups is None else f", groups={self._groups}"
        return f"Moments(n={self.n}, p={self._whole().p}, device={self._device!r}{groups})"


def _device_state(impl: Any, device: str) -> dict:
    """The keys of ``state_dict()`` with float64 torch tensors on ``device``
    (copied device to device from a CUDA backend; symmetric matrices filled)."""
    import torch

    n = int(impl.n)  # synchronises; raises a pending device-side input error
    sh = impl.shape()
    if n == 0 or sh["p"] < 0:
        return impl.get_state()
    p, c, t, k = sh["p"], max(sh["c"], 0), max(sh["t"], 0), max(sh["k"], 0)
    dev = torch.device(device)

    def f64(*shape):
        return torch.empty(shape, dtype=torch.float64, device=dev)

    st = {"n": n, "p": sh["p"], "c": sh["c"], "t": sh["t"], "k": sh["k"], "num_classes": sh["num_classes"],
          "precision": sh["precision"], "mean": f64(p), "M": f64(p, p), "out_mean": f64(c), "B": f64(p, c),
          "A": f64(c, c), "tgt_mean": f64(t), "Bt": f64(p, t), "At": f64(t, t),
          "class_counts": torch.empty(k, dtype=torch.int64, device=dev), "class_sums": f64(k, p)}
    impl.export_to({key: v.data_ptr() for key, v in st.items() if isinstance(v, torch.Tensor) and v.numel() > 0})
    return st


def _current_stream(tensor: Any) -> int:
    """The caller's current CUDA stream for ``tensor``'s device (0 = legacy default)."""
    try:
        import torch

        return int(torch.cuda.current_stream(tensor.device).cuda_stream)
    except Exception:  # not a torch tensor: DLPack producers sync on the default stream
        return 0


def dlr(features: Any, outputs: Any = None, *, head: Any = None, rtol: Optional[float] = None) -> float:
    """DLR of one set of samples (0 = rich, 1 = lazy).

    Give ``outputs`` (n, C), or ``head`` (``(W, b)``, ``W`` or a ``torch.nn.Linear``)
    for the linear-head shortcut.
    """
    if outputs is None and head is None:
        raise ValueError("dlr needs outputs or a head: the learned function space is undefined without them")
    m = Moments()
    m.update(features, outputs)
    return m.compute(head=head, rtol=rtol).dlr
