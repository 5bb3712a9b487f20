"""DLR as a torchmetrics ``Metric`` (the package docstring says how its state works)."""

from __future__ import annotations

import copy
import math
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, cast

import numpy as np

import torch
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors
from torchmetrics.utilities.exceptions import TorchMetricsUserError

from .. import _state
from .._engine import adapt as _adapt
from .. import finish as _finish
from ..finish.policy import check_rtol
from ..finish.samplespace import GramRows, finish_gram_rows
from .._engine.backend import Batch, CoreBackend, adapt_batch
from .._engine.moments import Moments
from .._native import _core
from .._report import Report
from ..torch.hooks import HeadHook
from .tensors import _STATES, _TORCH_DTYPE, _from_tensors, _host, _kept, _padded, _widths_of

__all__ = ["DLR"]


class DLR(Metric):
    """DLR (0 = rich, 1 = lazy) of the features and outputs seen by ``update``.

    Args:
        num_classes: fix the label range (see ``Moments``); labels are optional.
        head: the read-out module. A forward hook keeps its latest input as
            the features of the next ``update`` without ``features=``, so that
            ``MetricCollection.update(logits, y)`` works. A ``torch.nn.Linear``:
            DLR uses its weights at ``compute`` time (the linear-head
            shortcut, docs/MATH.md) and outputs are not streamed; any other
            module has its outputs streamed from ``preds``.
        head_weights: fixed read-out weights instead, ``W`` (C x p) or
            ``(W, b)``: the linear-head shortcut without a hook (features
            then come with ``features=``). Not with ``head``.
        precision: precision of the products (``Moments``).
        rtol: eigenvalue cut (default by precision).
        measures: representation diagnostics to return beside DLR (names from
            ``richness.finish.MEASURES``, or ``"all"``: RankMe, alpha-ReQ,
            participation ratio, NC2 with labels, NC3 with a linear head).
            Then ``compute`` and ``forward`` return a dict of float64 scalar
            tensors, ``{"dlr": ..., "rankme": ..., ...}`` (nan where a value is
            undefined); each spectral one costs a p x p eigenvalue
            decomposition. Default None: DLR alone, as a tensor.
        **kwargs: torchmetrics ``Metric`` options.

    ``update(preds, target=None, features=None)``: ``preds`` the outputs
    (logits, not probabilities), ``target`` integer labels (or float
    regression targets), ``features`` the penultimate activations (n, p).
    ``forward`` (``metric(preds, target)``, also in a ``MetricCollection``)
    takes the same arguments, returns the batch's DLR and adds the batch.
    ``compute()`` returns a float64 scalar tensor (nan with a warning while
    DLR is undefined: fewer than 2 samples, constant features or outputs) and
    never changes the state; with a linear head it is not cached, since it
    reads the head's current weights. ``report()`` gives the full
    ``richness.Report``. Under DDP the ranks' states merge exactly in
    float64. Inputs must be on the metric's device (``.to(device)``).

    Dtypes: the states are float64 sums (and int64 widths) and the values
    float64 tensors whatever ``set_dtype``, ``.double()``, ``.float()`` or
    ``.half()`` ask (a model's ``.double()`` reaching the metric changes
    nothing); device moves are followed. The products' precision is the
    ``precision`` argument, by default by the inputs' dtype (``Moments``).

    Copies: ``clone()`` (and ``MetricCollection.clone``) keeps the same head
    module, so a validation clone reads the live model and its hook fires on
    the model's forwards. A model holding the metric pickles with it, the
    copy's metric on the copy's head; so does a deep copy, whichever of the
    metric and the head the model's modules list first. A copied model's
    forwards never reach the original's metric.
    """

    widths: Any

    is_differentiable = False
    higher_is_better = None
    full_state_update = False
    plot_lower_bound = 0.0
    plot_upper_bound = 1.0

    def __init__(self, num_classes: Optional[int] = None, *, head: Any = None, head_weights: Any = None,
                 precision: Optional[str] = None, rtol: Optional[float] = None, measures: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.measures = _finish.check_measures(measures)
        Moments(num_classes, precision=precision)  # validates the arguments
        self.num_classes, self.precision, self.rtol = num_classes, precision, check_rtol(rtol)
        if head is not None and not isinstance(head, torch.nn.Module):
            raise TypeError(f"head must be a torch.nn.Module (the read-out to hook), got {type(head).__name__}; "
                            "fixed weights, W or (W, b), go to head_weights=")
        if head is not None and head_weights is not None:
            raise ValueError("give head= (the read-out module) or head_weights= (fixed weights), not both")
        # a plain attribute, not a registered submodule: the head belongs to the model
        object.__setattr__(self, "head", head)
        object.__setattr__(self, "head_weights", head_weights)
        self._uses_weights = head_weights is not None or isinstance(head, torch.nn.Linear)
        if self._uses_weights:
            self._read_out()  # bad weights fail here, not at the end of an epoch
            # compute() reads the head's current weights besides the states,
            # and they change between updates: a cached value would be stale
            self.compute_with_cache = False
        empty = _state.empty(num_classes)
        for f in _state.FIELDS:
            self.add_state(f.name, torch.zeros(_state.shape_of(f, empty), dtype=_TORCH_DTYPE[f.dtype],
                                               device=self.device), dist_reduce_fx=None)
        self.add_state("widths", self._widths_tensor(empty, self.device), dist_reduce_fx=None)
        self.__dict__.update(_TRANSIENT)
        self._watch_head()

    # -- the state tensors and the batch state ----------------------------------

    @staticmethod
    def _widths_values(st: dict) -> List[int]:
        return [int(st[k]) for k in _state.WIDTHS] + [_state.precisions().index(st["precision"])]

    @classmethod
    def _widths_tensor(cls, st: dict, device: Any) -> Any:
        return torch.tensor(cls._widths_values(st), dtype=torch.int64, device=device)

    def _device_name(self) -> str:
        dev = self.device
        if dev.type == "cpu":
            return "cpu"
        return f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}"

    def _new_moments(self) -> Moments:
        return Moments(self.num_classes, device=self._device_name(), precision=self.precision)

    def _batch_state(self, batch: Batch) -> Moments:
        """The batch's own co-moments: a ``Moments`` on the metric's device,
        kept between batches and reset for each (the core's scratch is
        reused), the batch (adapted once, ``adapt_batch``) checked against the
        state first (a batch that cannot merge raises here, in the words of an
        update)."""
        widths = _widths_of(self.widths)
        if widths["n"] > 0:
            _core.check_batch(widths, *batch.args())
        m: Optional[Moments] = self.__dict__.get("_kept_batch")
        if m is None or m.device not in (None, self._device_name()):
            m = self._new_moments()
            self.__dict__["_kept_batch"] = m
        else:
            m.reset()
        m._update_batch(batch)
        return m

    def _add(self, batch: Moments) -> None:
        """Merge a batch state into the state tensors: the core's Chan merge
        (the one ``Moments.merge`` runs), on the CPU in the tensors' memory.
        New tensors only where sizes change (the first batch, class arrays
        growing with the labels); on a GPU the merge runs on host copies."""
        if batch.n == 0:
            return
        if batch.device == "cpu":
            source = cast(CoreBackend, batch._backend)
        else:  # a device state: merged on the host by a CPU core
            source = CoreBackend("cpu", self.num_classes)
            source.from_state(batch.state_dict())
        widths = _widths_of(self.widths)
        if widths["n"] == 0 or widths["p"] < 0:
            self._set_state(source.to_state())
            return
        dev, k = self.device, int(source.widths()["k"])
        arrays, fresh = {}, {}
        for f in _state.FIELDS:
            t = getattr(self, f.name)
            if f.axes[0] == "k" and k > t.shape[0]:  # class arrays grow with the labels (zeros)
                grown = torch.zeros((k,) + tuple(t.shape[1:]), dtype=t.dtype)
                grown[:t.shape[0]] = t.cpu()
                t = fresh[f.name] = grown
            elif dev.type != "cpu":
                t = fresh[f.name] = t.cpu()
            arrays[f.name] = t.numpy()
        merged = source.merge_into(arrays, widths)  # refused before anything is written
        for name, t in fresh.items():
            setattr(self, name, t.to(dev))
        self._set_widths(merged)

    def _set_state(self, st: dict) -> None:
        """New state tensors holding the state dict ``st`` (numpy)."""
        dev = self.device
        for f in _state.FIELDS:
            setattr(self, f.name, torch.from_numpy(np.ascontiguousarray(st[f.name])).to(dev))
        self.widths = self._widths_tensor(st, dev)

    def _set_widths(self, st: dict) -> None:
        values = self._widths_values(st)
        if self.device.type == "cpu" and tuple(self.widths.shape) == (len(values),):
            self.widths.numpy()[:] = values
        else:
            self.widths = self._widths_tensor(st, self.device)

    def _state_at(self, rank: Optional[int], host: bool) -> dict:
        """One state dict from the state tensors: rank ``rank`` of a synced
        (stacked) state, or the local one (None). numpy on the host, else
        torch tensors where they are (``richness.finish`` runs on either)."""
        st = _widths_of(self.widths if rank is None else self.widths[rank])
        for f in _state.FIELDS:
            t = getattr(self, f.name)
            t = t if rank is None else t[rank][tuple(slice(0, s) for s in _state.shape_of(f, st))]
            st[f.name] = t.detach().cpu().numpy() if host or t.device.type == "cpu" else t.detach()
        return st

    def _local_state(self, host: bool = False) -> dict:
        return self._state_at(None, host)

    def _states(self) -> List[dict]:
        """The local state, or each rank's while synced."""
        if self.widths.ndim == 1:
            return [self._local_state()]
        return [self._state_at(r, True) for r in range(self.widths.shape[0])]

    def _merged(self) -> dict:
        states = self._states()
        return states[0] if len(states) == 1 else _state.merge(states)

    # -- torchmetrics interface -------------------------------------------------

    def update(self, preds: Any = None, target: Any = None, features: Any = None) -> None:
        """Add a batch: ``preds`` (n, C) outputs, ``target`` (n,) integer labels
        or (n,)/(n, T) float targets, ``features`` (n, p). A bad batch raises
        and leaves the state unchanged."""
        if self._is_synced:
            raise TorchMetricsUserError("The metric is synced: call unsync() before update().")
        batch = self._batch_state(adapt_batch(**self._batch(preds, target, features)))
        self.__dict__["_captured"] = None
        self._add(batch)

    def _batch(self, preds: Any = None, target: Any = None, features: Any = None) -> dict:
        if features is None:
            features = self._captured
            if features is None:
                raise ValueError("DLR.update needs features (the penultimate activations): pass features=, or "
                                 "construct DLR(head=module) so that the head's input is kept on each forward")
            if preds is not None and hasattr(preds, "shape") and int(features.shape[0]) != int(preds.shape[0]):
                raise ValueError(f"the head's latest input has {int(features.shape[0])} rows but preds has "
                                 f"{int(preds.shape[0])}: run the model on this batch before update")
        if isinstance(features, torch.Tensor) and features.device != self.device:
            raise ValueError(f"features are on {features.device} but the metric is on {self.device}: "
                             "move the metric with .to(device)")
        args: Dict[str, Any] = {"features": features}
        if self._uses_weights:
            if preds is not None and hasattr(preds, "shape") and int(preds.shape[0]) != int(features.shape[0]):
                raise ValueError(f"preds has {int(preds.shape[0])} rows but features has {int(features.shape[0])}")
        elif preds is None:
            raise ValueError("DLR.update needs preds (the outputs, logits), or construct DLR(head=...) with a "
                             "linear head for the linear-head shortcut")
        else:
            args["outputs"] = preds
        if target is not None:
            floating = (target.is_floating_point() if isinstance(target, torch.Tensor)
                        else np.asarray(target).dtype.kind == "f")
            args["targets" if floating else "labels"] = target
        return args

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The DLR of this batch alone (no spectrum), and the batch added to
        the state; takes what ``update`` takes.

        The batch state ``update`` merges is finished first. On the CPU its
        own DLR comes from small matrices (docs/MATH.md, a batch's own DLR):
        with C <= n outputs, from the norm of the batch's feature co-moment
        and its cross co-moment (or O(n p C) products with a head); with
        more outputs than rows (n < p), from the batch's n x n Gram. No
        p x p finishing. Otherwise (a GPU, representation measures,
        ``dist_sync_on_step``, or C > n >= p) the batch state is finished
        as ``compute`` finishes a state."""
        if self._is_synced:
            raise TorchMetricsUserError("The Metric shouldn't be synced when performing ``forward``. "
                                        "HINT: Did you forget to call ``unsync`` ?.")
        adapted = adapt_batch(**self._batch(*args, **kwargs))
        feats = adapted.features
        W = self._head_weights(feats.cols) if self._uses_weights else None  # a bad head raises before the batch
        batch = self._batch_state(adapted)
        self.__dict__["_captured"] = None
        value = None
        if (feats.device == "cpu" and feats.rows >= 2 and not self.measures
                and not (self.dist_sync_on_step and self.distributed_available_fn())):
            streams = {k: getattr(adapted, k) for k in ("outputs", "targets") if getattr(adapted, k) is not None}
            c = W.shape[0] if W is not None else streams["outputs"].cols
            if c <= feats.rows or feats.rows < feats.cols:
                value = self._batch_value(feats, streams, W, batch if c <= feats.rows else None)
        if value is None:
            seen = batch
            if self.dist_sync_on_step and self.distributed_available_fn():
                seen = self._new_moments()
                seen.merge(batch)
                seen.all_reduce(group=self.process_group)
            value = self._value(seen.device_state())
        # what torchmetrics' wrapped update does: the state changes here, so a
        # cached compute() is stale and the metric counts as updated
        self._computed = None
        self._update_count += 1
        self._add(batch)
        self._forward_cache = value
        return value

    def _batch_value(self, feats: Any, streams: dict, W: Any, batch: Optional[Moments]) -> Any:
        """DLR of one CPU batch (n rows, C outputs), as the Monitor's
        one-batch windows finish it (``finish.samplespace.finish_gram_rows``):
        ||M||_F, A = Fc^T Fc and Q = B^T B with B = Xc^T Fc, where Fc are
        the centered outputs (the head's on the features, or the streamed
        ones). ``streams``: the batch's outputs and targets as ``forward``
        adapted them (``_adapt.as_matrix``).

        ``batch`` given (C <= n): the batch state's ``norm_m`` (the core
        reads it off M's lower triangle), and B: with streamed outputs the
        batch state's too, with a head B = X^T Fc in float64 (Fc's columns sum to zero, so X needs no
        centering): O(n p C). A comes from the float64 outputs in both: A^+
        enters DLR, and A from float32 products moved DLR by up to 7e-7 where
        the outputs were exact linear functions of the features (3e-8 with
        A in float64; tests/metric/test_metric.py bounds both routes).
        Else (C > n, n < p) in sample space from the batch's Gram
        G = Xc Xc^T (the core's ``centered_grams``: float64 means, centering
        before narrowing, one product in the batch's product precision):
        A = Fc Fc^T and Q = G.

        The products run in the core's BLAS on the calling thread
        (``_backend.matmul``), the rest in numpy's own loops (``einsum``):
        a threaded BLAS or torch product this small only wakes a thread pool
        beside the core's and the training's, which costs more than the
        product on a busy CPU (benchmarks/bench_torchmetrics.py)."""
        from .._engine.backend import centered_grams, matmul
        from .._engine.moments import batch_precision

        n = feats.rows
        precision = batch_precision(self.precision, Batch(feats, streams.get("outputs"), None, streams.get("targets")))
        X: Optional[np.ndarray] = None
        if W is not None:  # the head's outputs in float64, less the bias (centered away)
            X = np.ascontiguousarray(_host(feats.owner), dtype=np.float64)
            F = np.empty((n, W.shape[0]))
            matmul(X, np.ascontiguousarray(W, dtype=np.float64), F, trans_b=True)
        else:
            F = _host(streams["outputs"].owner).astype(np.float64).reshape(n, -1)
        Fc = F - F.mean(axis=0)
        if batch is not None:
            core = cast(CoreBackend, batch._backend).core
            norm_m, A = np.array([core.norm_m()]), np.einsum("ki,kj->ij", Fc, Fc)
            if X is None:  # streamed outputs: B from the batch state
                B = core.get_fields(["B"])["B"]
                Q = np.einsum("pi,pj->ij", B, B)
            else:
                Bt = np.empty((Fc.shape[1], feats.cols))
                matmul(np.ascontiguousarray(Fc.T), X, Bt)
                Q = np.einsum("ip,jp->ij", Bt, Bt)
            sample_space = False
        else:
            dtype = np.float64 if precision == "fp64" else np.float32
            G = self.__dict__.get("_gram")
            if G is None or G.shape[0] != n or G.dtype != dtype:
                G = np.empty((n, n), dtype=dtype)  # kept: a fresh buffer page-faults on every batch
                self.__dict__["_gram"] = G
            norm_m = np.empty(1)
            centered_grams(feats, n, precision, G, norm_m)
            A, Q, sample_space = np.einsum("ik,jk->ij", Fc, Fc), G.astype(np.float64), True
        rows = GramRows(norm_m[:1], A[None], Q[None])
        (dlr,), _, _ = finish_gram_rows(rows, n, _finish.rtol_for(precision, self.rtol), sample_space)
        if dlr is None:
            return self._undefined("for the samples added (constant features or outputs)")
        return torch.tensor(dlr, dtype=torch.float64, device=self.device)

    def _undefined(self, why: str) -> Any:
        warnings.warn(f"DLR is undefined {why}; returning nan", UserWarning, stacklevel=4)
        return torch.tensor(math.nan, dtype=torch.float64, device=self.device)

    def _value(self, st: dict) -> Any:
        """DLR of a state dict as a float64 scalar tensor on the metric's device;
        nan with a warning where it is undefined."""
        W = None if _finish.too_few_samples(int(st["n"])) else self._weights(st)
        q = _finish.dlr_only(st, W, self.rtol, with_nc1=False)
        if self.measures:
            return self._with_measures(st, W, q)
        if q.dlr is None:
            return self._undefined(q.undefined or "")
        return torch.tensor(q.dlr, dtype=torch.float64, device=self.device)

    def _with_measures(self, st: dict, W: Any, q: Any) -> dict:
        """``{"dlr": ..., measure: ...}`` as float64 scalar tensors, nan where undefined."""
        measures = self.measures
        assert measures  # called only when measures are set
        values: dict = {}
        if _finish.too_few_samples(int(st["n"])) is None:
            values = _finish.measure_values(st, W, _finish.rtol_for(st["precision"], self.rtol), measures)[0]
        out = {"dlr": q.dlr}
        out.update({name: values.get(name) for name in measures})
        return {k: torch.tensor(math.nan if v is None else float(v), dtype=torch.float64, device=self.device)
                for k, v in out.items()}

    def _read_out(self) -> np.ndarray:
        """The read-out weight W (C x p) now: ``head_weights``, or the head's."""
        return _adapt.weights_of(self.head if self.head_weights is None else self.head_weights)[0]

    def _head_weights(self, p: int) -> np.ndarray:
        """The head's weight W (C x p) now, checked against the feature width."""
        W = self._read_out()
        if W.shape[1] != p:
            raise ValueError(f"head weight has {W.shape[1]} input columns but the features have {p}")
        return W

    def _weights(self, st: dict) -> Any:
        """The head's weight for finishing ``st``, on the state's device."""
        if not self._uses_weights:
            return None
        W: Any = self._head_weights(int(st["p"]))
        if not isinstance(st["M"], np.ndarray):
            W = torch.as_tensor(W, device=st["M"].device)
        return W

    def compute(self) -> Any:
        """DLR as a float64 scalar tensor (nan with a warning while undefined)."""
        return self._value(self._merged())

    def report(self) -> Report:
        """The full report (spectrum, curves, NC1) of the current state, or of
        the synced one inside torchmetrics' sync context."""
        st = self._merged()
        W = self._weights(st)
        return _finish.finish(st, W=W, rtol=self.rtol)

    def plot(self, val: Any = None, ax: Any = None) -> Any:
        """Plot one value or a sequence of values (``compute``/``forward``
        results) with torchmetrics' plotting; bounds 0 (rich) and 1 (lazy)."""
        return self._plot(val, ax)

    def sync(self, dist_sync_fn: Optional[Callable] = None, process_group: Optional[Any] = None,
             should_sync: bool = True, distributed_available: Optional[Callable] = None) -> None:
        # torchmetrics stacks the gathered states, which needs one shape on every rank; a rank
        # that saw fewer classes or no data holds smaller arrays: the gather pads them (widths
        # says what is real) and compute merges the ranks exactly (_merged)
        super().sync(_padded(dist_sync_fn or gather_all_tensors), process_group, should_sync,
                     distributed_available)

    def merge_state(self, incoming_state: Any) -> None:
        """Add another DLR metric's state (or its ``metric_state`` dict): the
        exact merge, like ranks under DDP."""
        if isinstance(incoming_state, Metric):
            if not isinstance(incoming_state, DLR):
                raise ValueError(f"Expected incoming state to be an instance of DLR but got {type(incoming_state)}")
            other = incoming_state._local_state(host=True)
        elif isinstance(incoming_state, dict):
            missing = [k for k in _STATES if k not in incoming_state]
            if missing:
                raise ValueError(f"incoming DLR state is missing {', '.join(missing)}")
            other = _from_tensors(incoming_state)  # checked by _state.merge
        else:
            raise ValueError(f"Expected incoming state to be a dict or an instance of Metric but got "
                             f"{type(incoming_state)}")
        merged = _state.merge([self._local_state(host=True), other])  # raises before anything changes
        self._set_state(merged)
        self._computed = None

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        # A state dict saved before a field existed is refused naming the field, in the words of
        # every other loader (_state.checked; docs/ARCHITECTURE.md, "Adding things").
        lacking = [f.name for f in _state.FIELDS if prefix + f.name not in state_dict]
        if lacking and prefix + "widths" in state_dict:
            _state.checked(_from_tensors(state_dict, prefix))
        loaded = [name for name in _STATES if prefix + name in state_dict]
        super()._load_from_state_dict(state_dict, prefix, *args)
        # torchmetrics keeps the given tensors as the states; batches are merged into the
        # states in place, so the metric takes copies (the caller's state dict stays as it was)
        for name in loaded:
            t = getattr(self, name)
            setattr(self, name, t.detach().to(self.device, _TORCH_DTYPE[np.int64] if name in _INT_STATES
                                                else _TORCH_DTYPE[np.float64], copy=True).contiguous())

    def _apply(self, fn: Callable, exclude_state: Any = ()) -> Any:
        # The states keep their dtypes (float64 sums, int64 widths) whatever
        # dtype conversion is asked (torchmetrics converts states under
        # set_dtype and .to(dtype)): they are excluded from ``fn``, the
        # exclude_state hook torchmetrics documents for states a metric
        # handles itself, and follow device moves only. Their defaults stay
        # where they are: reset() copies a default to the state's device.
        this = cast("DLR", super()._apply(fn, exclude_state=tuple(exclude_state) + _STATES))
        dev = this.device
        for name in _STATES:
            t = getattr(this, name)
            if t.device != dev:
                setattr(this, name, t.to(dev))
        return this

    def __getstate__(self) -> dict:
        st = super().__getstate__()
        st.update(_TRANSIENT)  # scratch and the hook: remade, not copied
        return st

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # batches are merged into the state tensors in place: a copy (copy.copy
        # shares the original's tensors) holds tensors of its own
        for name in _STATES:
            setattr(self, name, getattr(self, name).clone())
        self._watch_head()

    def __deepcopy__(self, memo: dict) -> "DLR":
        # The head belongs to the model: ``clone()`` (a deep copy, also of a
        # MetricCollection) keeps the same head, so a validation clone reads
        # the live model's weights and its hook fires on the model's
        # forwards. When the head itself is copied by the same deep copy (a
        # model deep-copied with the metric as a submodule) the copy follows
        # the copied head: here when the head was reached first, else when it
        # is reached later (its hook's ``_HeadInput.copied`` moves the copy).
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        state = self.__getstate__()
        head = state.pop("head", None)
        state = copy.deepcopy(state, memo)
        state["head"] = _kept(head, memo)
        new.__setstate__(state)
        return new

    # -- the head hook ----------------------------------------------------------

    def _watch_head(self) -> None:
        if isinstance(self.head, torch.nn.Module):
            self.__dict__["_hook"] = HeadHook(_HeadInput(self), self.head)

    def __del__(self) -> None:
        hook = self.__dict__.get("_hook")
        if hook is not None:
            hook.remove()


# What the metric keeps besides its states, none of it copied or pickled: the
# kept batch state (its scratch reused), the head's latest input, the head's
# hook and the one-batch Gram's buffer.
_TRANSIENT: Dict[str, Any] = {"_kept_batch": None, "_captured": None, "_hook": None, "_gram": None}
_INT_STATES = ("widths",) + _state.INT_FIELDS


class _HeadInput:
    """What the metric's ``HeadHook`` calls with each forward of its head:
    keeps the head's latest input (the features) for the next ``update``
    without ``features=``. Holds the metric and the head weakly (the head
    must not keep the metric alive); a deep-copied or saved model's copy of
    the hook captures nothing, unless the same deep copy copied the metric
    (``copied``)."""

    def __init__(self, metric: DLR) -> None:
        self.ref = weakref.ref(metric)
        self.head = weakref.ref(metric.head)  # the module hooked

    def __call__(self, x: Any, out: Any) -> None:
        metric = self.ref()
        # only the metric's own head: a deep copy may have moved it to the copied head
        if metric is not None and metric.head is self.head() and isinstance(x, torch.Tensor):
            metric.__dict__["_captured"] = x.detach()

    def copied(self, memo: dict) -> "Optional[_HeadInput]":
        """The function of the head's deep copy's hook: when the same deep copy
        copied the metric before reaching its head (the model's modules list
        the metric first), the metric's copy is moved to the copied head and
        fed from there; else None (a copied model's forwards never reach a
        metric that was not copied with it)."""
        metric = self.ref()
        if metric is None:
            return None
        twin = memo.get(id(metric))
        head_copy = memo.get(id(metric.head))
        if twin is None or head_copy is None or twin.head is not metric.head:
            return None
        object.__setattr__(twin, "head", head_copy)
        return _HeadInput(twin)
