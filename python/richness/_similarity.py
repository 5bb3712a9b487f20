"""Exact linear CKA between named representations of the same samples.

A ``Similarity`` streams one features-only ``Moments`` over the row-wise
concatenation of k representations ``x_1 .. x_k`` (widths p_1 .. p_k) plus one
column per representation, ``a_r = ||x_r - c_r||^2``, the squared norm after a
fixed shift ``c_r`` (the float64 mean of the first batch, kept in the state,
so that the column stays accurate far from the origin). Every block of the
joint centred co-moment sum is a cross-covariance ``C_rs``; the biased CKA of
r and s is ``||C_rs||_F^2 / (||C_rr||_F ||C_ss||_F)`` and the debiased one (the
unbiased HSIC estimator) needs, besides ``C``, only the norm columns' means
and co-moments (docs/MATH.md, "Linear CKA, exact and streamed"). Memory is
``8 (p_1 + .. + p_k + k)^2`` bytes whatever n; the answer does not depend on
how the samples are split into batches or in which order states are merged.
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from typing import Any, List, Mapping, NamedTuple, Optional, Tuple

import numpy as np

from . import _adapt, _state, _statefile
from ._moments import Moments

__all__ = ["Similarity", "SimilarityReport", "cka", "FORMAT"]

FORMAT = "richness.similarity"  # meta["format"] of a saved Similarity (a Moments file says "richness.moments")
VERSION = 1


def _warn(msg: str) -> None:
    from .torch.evaluate import RichnessWarning

    warnings.warn(msg, RichnessWarning, stacklevel=3)


class Pair(NamedTuple):
    """The two estimators for one pair of representations."""

    cka: float
    cka_debiased: float


class SimilarityReport:
    """What ``Similarity.compute`` finishes: ``names`` (first-seen order),
    ``widths``, ``n``, ``cka`` (k x k, biased) and ``cka_debiased`` (k x k,
    the unbiased-HSIC estimator; NaN below 4 samples)."""

    def __init__(self, names: List[str], widths: List[int], n: int, cka: np.ndarray,
                 cka_debiased: np.ndarray) -> None:
        self.names, self.widths, self.n = list(names), list(widths), int(n)
        self.cka, self.cka_debiased = cka, cka_debiased

    def _index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise KeyError(f"no representation named {name!r}; the report holds {self.names}") from None

    def pair(self, a: str, b: str) -> Pair:
        """Both estimators for representations ``a`` and ``b``."""
        i, j = self._index(a), self._index(b)
        return Pair(float(self.cka[i, j]), float(self.cka_debiased[i, j]))

    def to_dict(self) -> dict:
        """Plain JSON types (NaN as None): ``names``, ``cka``, ``cka_debiased``, ``n``, ``widths``."""
        def rows(a: np.ndarray) -> list:
            return [[None if not math.isfinite(v) else float(v) for v in row] for row in a]
        return {"names": list(self.names), "cka": rows(self.cka), "cka_debiased": rows(self.cka_debiased),
                "n": self.n, "widths": list(self.widths)}

    def __repr__(self) -> str:
        return f"SimilarityReport(n={self.n}, names={self.names})"


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "data_ptr")


def _as_batch(x: Any, name: str) -> Any:
    """A 2-D float batch: a torch tensor as given (detached), anything else as numpy."""
    _adapt.refuse_unreadable(x, name)
    if _is_torch(x):
        x = x.detach()
        if x.is_complex() or not x.is_floating_point():
            raise TypeError(f"{name} must be a real floating tensor, got {x.dtype}")
    else:
        if not isinstance(x, np.ndarray):
            x = np.from_dlpack(x) if hasattr(x, "__dlpack__") else np.asarray(x)
        if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
            raise TypeError(f"{name} must be a floating array, got dtype {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D (rows, width), got shape {tuple(x.shape)}")
    if x.shape[1] == 0:
        raise ValueError(f"{name} has width 0: a representation needs at least one column")
    return x


def _nonfinite(x: Any) -> int:
    """The number of NaN or Inf values (for a CUDA tensor this waits for the device)."""
    if _is_torch(x):
        import torch

        return int((~torch.isfinite(x)).sum())
    return int(np.count_nonzero(~np.isfinite(x)))


class Similarity:
    """Streamed exact linear CKA between named representations of the same samples.

    ``update({"a": xa, "b": xb, ...})`` adds one batch: each value (rows x
    width; numpy, torch or DLPack) is one representation of the same rows;
    the names and widths are fixed by the first batch. ``compute()`` gives a
    ``SimilarityReport`` with both estimators for every pair; ``merge`` adds
    another state (any order, exact up to rounding); ``state_dict`` /
    ``load_state_dict``, ``save`` / ``Similarity.load`` (a checksummed atomic
    .npz marked ``richness.similarity``), ``reset``, ``copy`` / ``deepcopy`` /
    ``pickle`` behave as for ``Moments``. Invalid input raises and leaves the
    state exactly as it was.

    precision: as ``Moments``: None takes ``"fp64"`` when every input of a batch
        is float64, else ``"fp32"`` (float32 products after a float64
        centering of the batch: CKA to about 1e-6).

    The norm columns are formed in float64 and the concatenated batch is
    handed to the core in the inputs' precision. Torch CUDA batches are
    concatenated on their device and go to the CUDA backend (that route has
    not been run on a GPU here; the CPU torch route is tested).
    """

    def __init__(self, precision: Optional[str] = None) -> None:
        if precision is not None and precision not in _state.precisions():
            raise ValueError(f"precision must be one of {_state.precisions()} or None, got {precision!r}")
        self.precision = precision
        self._names: Optional[List[str]] = None
        self._widths: Optional[List[int]] = None
        self._shift: Optional[np.ndarray] = None  # float64, the widths' sum
        self._moments = Moments(precision=precision)

    # -- accumulation ---------------------------------------------------------

    @property
    def n(self) -> int:
        return self._moments.n

    @property
    def names(self) -> List[str]:
        return list(self._names or [])

    @property
    def widths(self) -> List[int]:
        return list(self._widths or [])

    def _layout(self) -> Tuple[List[str], List[int], np.ndarray]:
        """The names, widths and shift of a Similarity that has seen a batch
        (the three are set, and cleared, together)."""
        assert self._names is not None and self._widths is not None and self._shift is not None
        return self._names, self._widths, self._shift

    def _check_names(self, names: List[str], widths: List[int]) -> None:
        if self._names is None:
            return
        if names != self._names:
            missing = [x for x in self._names if x not in names]
            added = [x for x in names if x not in self._names]
            why = (f"missing {missing}" if missing else "") + ("; " if missing and added else "") + \
                (f"added {added}" if added else "")
            raise ValueError(f"update: this Similarity holds {self._names}, the batch gives {names}"
                             f" ({why or 'another order'}); give the same names in every update")
        if widths != self._widths:
            raise ValueError(f"update: widths {dict(zip(names, widths))} differ from the first batch's "
                             f"{dict(zip(*self._layout()[:2]))}")

    def update(self, batch: Mapping[str, Any]) -> None:
        """Add one batch: a mapping name -> (rows x width) of the same rows."""
        if not isinstance(batch, Mapping):
            raise TypeError(f"update expects a mapping name -> array, got {type(batch).__name__}")
        if not batch:
            raise ValueError("update: the mapping is empty; give at least one named representation")
        names = list(batch)
        bad = [nm for nm in names if not isinstance(nm, str)]
        if bad:
            raise TypeError(f"update: representation names must be strings, got {bad!r}")
        xs = [_as_batch(batch[nm], f"representation {nm!r}") for nm in names]
        widths = [int(x.shape[1]) for x in xs]
        rows = {nm: int(x.shape[0]) for nm, x in zip(names, xs)}
        if len(set(rows.values())) > 1:
            raise ValueError(f"update: the representations have different row counts {rows}; "
                             "each must hold the same samples")
        self._check_names(names, widths)
        kinds = {"torch" if _is_torch(x) else "numpy" for x in xs}
        if len(kinds) > 1:
            raise TypeError("update: mix of torch tensors and other arrays; give one kind per batch")
        if next(iter(rows.values())) == 0:
            return
        for nm, x in zip(names, xs):
            bad_values = _nonfinite(x)
            if bad_values:
                raise ValueError(f"update: representation {nm!r} contains {bad_values} NaN or Inf values")
        shift = self._shift
        if shift is None:
            shift = np.concatenate([_mean64(x) for x in xs])
        joint = _joint(xs, shift, wide=self.precision == "fp64")
        self._moments.update(joint)  # validated by the core; on error nothing changed
        if self._names is None:
            self._names, self._widths, self._shift = names, widths, shift

    def merge(self, other: "Similarity") -> None:
        """Add another state (its norm columns re-expressed at this state's shift)."""
        if not isinstance(other, Similarity):
            raise TypeError(f"merge expects a Similarity, got {type(other).__name__}")
        if other.n == 0:
            return
        if self.n == 0 and self._names is None:
            self._load_own_state_dict(other.state_dict())
            return
        if other._names != self._names or other._widths != self._widths:
            raise ValueError(f"cannot merge: this Similarity holds names {self._names} of widths {self._widths}, "
                             f"the other names {other._names} of widths {other._widths}")
        _, widths, shift = other._layout()
        st = _reshift(other._moments.state_dict(), widths, shift, self._layout()[2])
        m = Moments()
        m._load_own_state_dict(st)  # an exact affine map of a live state's co-moments
        self._moments.merge(m)

    def all_reduce(self, group: Any = None) -> None:
        """Merge the states of all ranks of ``group`` (torch.distributed) in
        float64, exactly as ``Moments.all_reduce``: afterwards every rank holds
        the global state. Collective: every rank calls it. The names, widths
        and shift of the lowest rank that saw data are used by all; ranks that
        hold other names or widths make every rank raise the same ValueError,
        and no rank's state changes."""
        from ._distributed import _dist, all_reduce_states

        _, dist = _dist()
        world = dist.get_world_size(group)
        mine = None if self.n == 0 else (self._names, self._widths, self._layout()[2].tolist())
        gathered: List[Any] = [None] * world
        dist.all_gather_object(gathered, mine, group=group)
        live = [g for g in gathered if g is not None]
        if not live:
            return
        names, widths, shift = live[0][0], live[0][1], np.asarray(live[0][2], dtype=np.float64)
        for g in live[1:]:
            if g[0] != names or g[1] != widths:
                raise ValueError(f"all_reduce: ranks hold different representations: names {names} of widths "
                                 f"{widths} and names {g[0]} of widths {g[1]}; no rank's state changed")
        st = (self._moments.state_dict() if self.n == 0
              else _reshift(self._moments.state_dict(), widths, self._layout()[2], shift))
        merged = all_reduce_states([st], group=group)[0]
        m = Moments(precision=self.precision)
        m.load_state_dict(merged)
        self._moments, self._names, self._widths, self._shift = m, list(names), list(widths), shift

    def reset(self) -> None:
        """Forget all samples, names and widths."""
        self._moments.reset()
        self._names = self._widths = self._shift = None

    # -- finishing ------------------------------------------------------------

    def compute(self) -> SimilarityReport:
        """Both estimators for every pair, in float64; the state is not modified.

        Biased: ``||C_rs||_F^2 / (||C_rr||_F ||C_ss||_F)``, inflated at small n
        and large width. Debiased: the unbiased HSIC estimator over all n
        samples; NaN (with a ``RichnessWarning``) below 4 samples or when a
        self-HSIC is not positive (a representation too close to constant at
        that n). A constant representation gives NaN in both."""
        if self._names is None or self.n == 0:
            raise ValueError("compute: the Similarity holds no samples; update it first")
        st = self._moments.state_dict()
        return _finish(st["mean"], st["M"], self.n, *self._layout())

    # -- persistence ----------------------------------------------------------

    def state_dict(self) -> dict:
        """A float64 copy: ``names``, ``widths``, ``shift`` and the joint ``moments`` state."""
        return {"names": self.names, "widths": self.widths,
                "shift": np.zeros(0) if self._shift is None else self._shift.copy(),
                "moments": self._moments.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Replace the state with ``state``, validated first; on error nothing changes."""
        self._load(state, own=False)

    def _load_own_state_dict(self, state: dict) -> None:
        """``load_state_dict`` for a state this library exported and hands
        between its own steps (``Moments._load_own_state_dict``)."""
        self._load(state, own=True)

    def _load(self, state: dict, own: bool) -> None:
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        extra = sorted(set(state) - {"names", "widths", "shift", "moments"})
        missing = sorted({"names", "widths", "shift", "moments"} - set(state))
        if missing or extra:
            raise ValueError(f"similarity state: missing entries {missing}, unknown entries {extra}")
        names, widths = list(state["names"]), list(state["widths"])
        if not all(isinstance(x, str) for x in names) or len(set(names)) != len(names):
            raise ValueError(f"similarity state: names must be distinct strings, got {names!r}")
        if len(widths) != len(names) or not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool)
                                                and w >= 1 for w in widths):
            raise ValueError(f"similarity state: widths must be one integer >= 1 per name, got {widths!r}")
        widths = [int(w) for w in widths]
        shift = np.asarray(state["shift"], dtype=np.float64).reshape(-1)
        m = Moments(precision=self.precision)
        if own:
            m._load_own_state_dict(state["moments"])
        else:
            m.load_state_dict(state["moments"])
        if m.n == 0:
            self._moments, self._names, self._widths, self._shift = m, None, None, None
            return
        p = _state.widths_of(state["moments"])["p"]  # validated by the load above
        if not names or p != sum(widths) + len(widths) or shift.size != sum(widths):
            raise ValueError(f"similarity state: names {names} of widths {widths} need a joint width of "
                             f"{sum(widths) + len(widths)} and a shift of {sum(widths)}, the state has "
                             f"{p} and {shift.size}")
        if not np.isfinite(shift).all():
            raise ValueError("similarity state: shift contains NaN or Inf")
        self._moments, self._names, self._widths, self._shift = m, names, widths, shift.copy()

    def save(self, path: "os.PathLike | str") -> None:
        """Write the state to ``path`` atomically (.npz, no pickle, checksummed)."""
        st = self.state_dict()
        mst = st["moments"]
        arrays = {k: np.asarray(mst[k]) for k in _state.FIELD_NAMES}
        arrays["shift"] = st["shift"]
        extra = {"names": st["names"], "widths": st["widths"]}
        meta = {"format": FORMAT, "version": VERSION, **{k: mst[k] for k in _state.SCALARS}, **extra,
                "sha256": _statefile._digest(arrays, mst, extra)}
        _statefile.write_archive(path, meta, arrays)

    @classmethod
    def load(cls, path: "os.PathLike | str") -> "Similarity":
        """Read a file written by ``save``; truncated, corrupted or foreign files
        (a Moments file included) raise a ValueError naming the file."""
        path = _statefile.file_path(path)
        state = _read(path)
        s = cls()
        try:
            s.load_state_dict(state)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: not a valid similarity state ({e})") from None
        return s

    def __copy__(self) -> "Similarity":
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        if self._names is None or self.n == 0:
            return "Similarity(empty)"
        return f"Similarity(n={self.n}, names={self._names}, widths={self._widths})"


def cka(x: Any, y: Any, *, debiased: bool = False) -> float:
    """Linear CKA of two representations of the same rows (numpy, torch or
    DLPack), exact in float64 without an n x n matrix. ``debiased=True``: the
    unbiased-HSIC estimator (NaN below 4 rows)."""
    s = Similarity()
    s.update({"x": x, "y": y})
    r = s.compute()
    return float((r.cka_debiased if debiased else r.cka)[0, 1])


# -- the joint batch and its finish ---------------------------------------------


def _mean64(x: Any) -> np.ndarray:
    if _is_torch(x):
        import torch

        return x.to(torch.float64).mean(dim=0).cpu().numpy()
    return x.astype(np.float64).mean(axis=0)


def _joint(xs: List[Any], shift: np.ndarray, wide: bool = False) -> Any:
    """``[x_1 .. x_k, a_1 .. a_k]`` with ``a_r = ||x_r - c_r||^2`` formed in
    float64; float64 when every input is (or ``wide``), else float32."""
    offs = np.cumsum([0] + [int(x.shape[1]) for x in xs])
    if _is_torch(xs[0]):
        import torch

        dt = torch.float64 if wide or all(x.dtype == torch.float64 for x in xs) else torch.float32
        c = torch.as_tensor(shift, device=xs[0].device)
        cols = [x.to(dt) for x in xs]
        cols += [((x.to(torch.float64) - c[offs[r]:offs[r + 1]]) ** 2).sum(dim=1, keepdim=True).to(dt)
                 for r, x in enumerate(xs)]
        return torch.cat(cols, dim=1)
    dtype = np.float64 if wide or all(x.dtype == np.float64 for x in xs) else np.float32
    n, k = xs[0].shape[0], len(xs)
    out = np.empty((n, offs[-1] + k), dtype=dtype)
    for r, x in enumerate(xs):
        out[:, offs[r]:offs[r + 1]] = x
        d = x.astype(np.float64) - shift[offs[r]:offs[r + 1]]
        out[:, offs[-1] + r] = np.einsum("ij,ij->i", d, d)
    return out


def _reshift(st: dict, widths: List[int], old: np.ndarray, new: np.ndarray) -> dict:
    """The joint state with its norm columns at shift ``new`` instead of ``old``:
    ``a' = a - 2 e.x + (2 e.c + |e|^2)``, ``e = new - old``, an affine map of
    the joint variables under which the mean and co-moments transform exactly."""
    if np.array_equal(old, new):
        return st
    offs = np.cumsum([0] + list(widths))
    P = int(offs[-1])
    T = np.eye(P + len(widths))
    t = np.zeros(P + len(widths))
    for r in range(len(widths)):
        sl = slice(offs[r], offs[r + 1])
        e = new[sl] - old[sl]
        T[P + r, sl] = -2.0 * e
        t[P + r] = 2.0 * e @ old[sl] + e @ e
    out = dict(st)
    out["mean"] = T @ st["mean"] + t
    M = T @ st["M"] @ T.T
    out["M"] = (M + M.T) / 2
    return out


def _finish(mean: np.ndarray, M: np.ndarray, n: int, names: List[str], widths: List[int],
            shift: np.ndarray) -> SimilarityReport:
    k = len(widths)
    offs = np.cumsum([0] + list(widths))
    P = int(offs[-1])
    sl = [slice(offs[r], offs[r + 1]) for r in range(k)]
    d = [mean[s] - shift[s] for s in sl]
    tr = np.array([np.trace(M[s, s]) for s in sl])      # tr C_rr = -1'K~1
    kbar = tr / n
    F = np.empty((k, k))                                   # ||C_rs||_F^2
    S = np.empty((k, k))                                   # sum_i k_i l_i
    for r in range(k):
        for s in range(r, k):
            C = M[sl[r], sl[s]]
            F[r, s] = F[s, r] = float(np.sum(C * C))
            S[r, s] = S[s, r] = (n * kbar[r] * kbar[s] + M[P + r, P + s] - 2 * d[s] @ M[sl[s], P + r]
                                 - 2 * d[r] @ M[sl[r], P + s] + 4 * d[r] @ C @ d[s])
    diag = np.sqrt(np.diag(F))
    with np.errstate(divide="ignore", invalid="ignore"):
        biased = F / np.outer(diag, diag)
    if not np.isfinite(biased).all():
        bad = [names[r] for r in range(k) if not diag[r] > 0]
        _warn(f"CKA is undefined for constant representations {bad}: NaN")
        biased = np.where(np.isfinite(biased), biased, np.nan)
    if n < 4:
        _warn(f"debiased CKA needs at least 4 samples (n = {n}): NaN")
        deb = np.full((k, k), np.nan)
    else:
        H = (F - S + np.outer(tr, tr) / ((n - 1) * (n - 2)) - 2.0 / (n - 2) * S) / (n * (n - 3))
        h = np.diag(H)
        ok = h > 0
        if not ok.all():
            _warn(f"debiased CKA: the unbiased self-HSIC of {[names[r] for r in range(k) if not ok[r]]} is not "
                  f"positive at n = {n}: NaN for their pairs")
        with np.errstate(divide="ignore", invalid="ignore"):
            deb = H / np.sqrt(np.outer(np.where(ok, h, np.nan), np.where(ok, h, np.nan)))
    return SimilarityReport(names, widths, n, biased, deb)


# -- files ------------------------------------------------------------------------


def _shift_shape(meta: dict, widths: dict) -> dict:
    w = meta.get("widths")
    if not isinstance(w, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in w):
        raise ValueError(f"widths {w!r} are not a list of positive integers")
    return {"shift": (sum(w) if widths["n"] > 0 else 0,)}


LAYOUT = _statefile.Layout(FORMAT, VERSION, "richness similarity state", "Similarity.save", ("names", "widths"),
                           _shift_shape)


def _read(path: str) -> dict:
    """The state dict of a file written by ``Similarity.save`` (``_statefile.load_state``
    with this layout: every member's shape checked before any data is read)."""
    st = _statefile.load_state(path, LAYOUT)
    moments = {k: st[k] for k in _state.SCALARS + tuple(_state.FIELD_NAMES)}
    return {"names": st["names"], "widths": st["widths"], "shift": st["shift"], "moments": moments}
