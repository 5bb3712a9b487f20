"""Exact linear CKA between named representations of the same samples.

A ``Similarity`` streams one features-only ``Moments`` over the row-wise
concatenation of k representations ``x_1 .. x_k`` (widths p_1 .. p_k) plus one
column per representation, ``a_r = ||x_r - c_r||^2``, the squared norm after a
fixed shift ``c_r`` (the float64 mean of the first batch, kept in the state,
so that the column stays accurate far from the origin). A representation whose
squared row norms in its first batch lie outside 2^-48 .. 2^48 is held at a
fixed power-of-two scale ``g_r`` (also kept in the state): the state holds
``g_r x_r`` and ``g_r^2 a_r``, exact multiples of the given values, and every
CKA is unchanged by it; the finish scales each block the same way before
squaring, so no value depends on the representations' magnitudes. Every block of the
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

from .. import _state
from . import adapt as _adapt
from . import statefile as _statefile
from .._checks import is_torch
from .._checks import is_int
from .moments import Moments
from .._warnings import RichnessWarning
from ..finish.cka import cka_matrices, column_factors, scaled_shift

__all__ = ["Similarity", "SimilarityReport", "SimilarityBlock", "EmptySimilarityError", "cka", "FORMAT"]

FORMAT = "richness.similarity"  # meta["format"] of a saved Similarity (a Moments file says "richness.moments")
VERSION = 2  # 2: a "scale" member (the power-of-two scale of each representation); version 1 files hold scale 1

# Squared row norms within 2^-48 .. 2^48 are used as given; outside, a
# power-of-two scale brings them near 1 (exact: only the exponents change).
# The finish does the same for blocks outside 2^-64 .. 2^64 (finish/cka.py).
_SAFE_LOG2 = 48
# ``cka`` streams its rows in chunks of at most this many bytes of the joint
# float64 batch (the two representations and their norm columns).
_CHUNK_BYTES = 1 << 25
# The width check of a loaded state: each norm column's mean against its
# block's trace over n plus the shift's squared distance, relative.
_WIDTH_RTOL = 1e-3


class EmptySimilarityError(ValueError):
    """``Similarity.compute`` on a state that holds no samples. A ValueError;
    callers that know what the user ran catch it to say so in their words."""


def _warn(msg: str, stacklevel: int = 3) -> None:
    warnings.warn(msg, RichnessWarning, stacklevel=stacklevel)


def check_names(keys: Any, where: str) -> List[str]:
    """The names of a mapping of representations, as given: strings only (a
    key 1 and a key "1" would otherwise both be called "1"), each once."""
    keys = list(keys)
    bad = [nm for nm in keys if not isinstance(nm, str)]
    if bad:
        raise TypeError(f"{where}: representation names must be strings, got {bad!r}")
    twice = sorted({nm for nm in keys if keys.count(nm) > 1})
    if twice:
        raise ValueError(f"{where}: representation names {twice} are given more than once")
    return keys


class Pair(NamedTuple):
    """The two estimators for one pair of representations."""

    cka: float
    cka_debiased: float


def _table(rows: List[str], cols: List[str], mats: List[Tuple[str, np.ndarray]]) -> List[str]:
    """Lines of a readable table: each matrix with its caption, every row
    labelled ``[i] name``, the columns ``[j]`` (the rows' numbers when the
    columns are the rows, else listed with their names first)."""
    lines = []
    if rows != cols:
        lines += ["  columns: " + ", ".join(f"[{j}] {nm}" for j, nm in enumerate(cols))]
    labels = [f"[{i}] {nm}" for i, nm in enumerate(rows)]
    lab = max(len(t) for t in labels)
    for caption, mat in mats:
        lines.append(f"  {caption}:")
        lines.append("    " + " " * lab + "".join(f"{f'[{j}]':>9}" for j in range(len(cols))))
        for i in range(len(rows)):
            lines.append(f"    {labels[i]:<{lab}}" + "".join(f"{v:9.4f}" if math.isfinite(v) else f"{'nan':>9}"
                                                          for v in np.asarray(mat[i], dtype=float)))
    return lines


def _matrices(cka: np.ndarray, cka_debiased: np.ndarray) -> List[Tuple[str, np.ndarray]]:
    mats = [("linear CKA (biased)", cka)]
    if not np.isnan(cka_debiased).all():
        mats.append(("debiased linear CKA (unbiased HSIC)", cka_debiased))
    return mats


class SimilarityBlock:
    """The CKA of the representations of one model (or name prefix) against
    another's (``SimilarityReport.between``): ``rows`` and ``cols`` (full
    names), ``cka`` and ``cka_debiased`` (len(rows) x len(cols)), ``n``, and
    ``row_label`` / ``col_label``, what was selected for each axis."""

    def __init__(self, row_label: str, col_label: str, rows: List[str], cols: List[str], n: int, cka: np.ndarray,
                 cka_debiased: np.ndarray, warnings: Optional[List[str]] = None) -> None:
        self.row_label, self.col_label = row_label, col_label
        self.rows, self.cols, self.n = list(rows), list(cols), int(n)
        self.cka, self.cka_debiased = cka, cka_debiased
        self.warnings = list(warnings or [])

    def __str__(self) -> str:
        lines = [f"SimilarityBlock: {self.row_label!r} (rows) against {self.col_label!r} (columns), n = {self.n:,}"]
        lines += _table(self.rows, self.cols, _matrices(self.cka, self.cka_debiased))
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    __repr__ = __str__


class SimilarityReport:
    """What ``Similarity.compute`` finishes: ``names`` (first-seen order),
    ``widths``, ``n``, ``cka`` (k x k, biased), ``cka_debiased`` (k x k,
    the unbiased-HSIC estimator; NaN below 4 samples) and ``warnings`` (what
    the finish warned about, once each). ``print(report)`` shows them as a
    table; ``between(a, b)`` the block of one model against another."""

    def __init__(self, names: List[str], widths: List[int], n: int, cka: np.ndarray,
                 cka_debiased: np.ndarray, warnings: Optional[List[str]] = None) -> None:
        self.names, self.widths, self.n = list(names), list(widths), int(n)
        self.cka, self.cka_debiased = cka, cka_debiased
        self.warnings = list(dict.fromkeys(warnings or []))

    def __setstate__(self, state: dict) -> None:  # reports pickled before ``warnings`` existed
        self.__dict__.update(state)
        self.__dict__.setdefault("warnings", [])

    def select(self, prefix: str) -> List[str]:
        """The names of model (or name prefix) ``prefix``: the name itself,
        or names that start with ``prefix`` followed by ``"."`` (the
        ``"model.layer"`` names of ``richness.similarity``), in report order."""
        if not isinstance(prefix, str):
            raise TypeError(f"a model or name prefix must be a string, got {type(prefix).__name__}")
        out = [nm for nm in self.names if nm == prefix or nm.startswith(prefix + ".")]
        if not out:
            models = list(dict.fromkeys(nm.split(".", 1)[0] for nm in self.names))
            raise KeyError(f"no representation is named {prefix!r} or starts with {prefix + '.'!r}; the report "
                           f"holds models {models} (names {self.names})")
        return out

    def between(self, a: str, b: str) -> SimilarityBlock:
        """The block of model (or name prefix) ``a`` against ``b``: rows the
        representations named ``a`` or ``a.*``, columns those of ``b``, both
        estimators (the A x B map the CKA libraries return; ``plot.similarity``
        draws it with each axis labelled by its model)."""
        rows, cols = self.select(a), self.select(b)
        i = [self.names.index(nm) for nm in rows]
        j = [self.names.index(nm) for nm in cols]
        return SimilarityBlock(a, b, rows, cols, self.n, self.cka[np.ix_(i, j)], self.cka_debiased[np.ix_(i, j)],
                               self.warnings)

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

    def __str__(self) -> str:
        lines = [f"SimilarityReport: {len(self.names)} representations, n = {self.n:,}"]
        lines += _table([f"{nm} (width {w})" for nm, w in zip(self.names, self.widths)],
                        [f"{nm} (width {w})" for nm, w in zip(self.names, self.widths)],
                        _matrices(self.cka, self.cka_debiased))
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    __repr__ = __str__


def _as_batch(x: Any, name: str) -> Any:
    """A 2-D float batch: a torch tensor as given (detached), anything else as numpy."""
    _adapt.refuse_unreadable(x, name)
    if is_torch(x) and hasattr(x, "data_ptr"):  # a tensor (as _adapt.as_matrix tells one)
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
    if is_torch(x):
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
        self.precision = precision
        self._names: Optional[List[str]] = None
        self._widths: Optional[List[int]] = None
        self._shift: Optional[np.ndarray] = None  # float64, the widths' sum
        self._scale: Optional[np.ndarray] = None  # float64 powers of two, one per representation
        self._moments = Moments(precision=precision)  # checks the precision's name

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

    def _layout(self) -> Tuple[List[str], List[int], np.ndarray, np.ndarray]:
        """The names, widths, shift and scale of a Similarity that has seen a
        batch (the four are set, and cleared, together)."""
        assert self._names is not None and self._widths is not None and self._shift is not None
        assert self._scale is not None
        return self._names, self._widths, self._shift, self._scale

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
                             f"{dict(zip(self._layout()[0], self._layout()[1]))}")

    def update(self, batch: Mapping[str, Any]) -> None:
        """Add one batch: a mapping name -> (rows x width) of the same rows.
        The names are those of the first batch, in any order (a mapping is
        keyed by name: the batch is taken in the first batch's order)."""
        if not isinstance(batch, Mapping):
            raise TypeError(f"update expects a mapping name -> array, got {type(batch).__name__}")
        if not batch:
            raise ValueError("update: the mapping is empty; give at least one named representation")
        names = check_names(batch, "update")
        if self._names is not None and names != self._names and len(names) == len(self._names) \
                and set(names) == set(self._names):
            names = list(self._names)
        xs = [_as_batch(batch[nm], f"representation {nm!r}") for nm in names]
        widths = [int(x.shape[1]) for x in xs]
        rows = {nm: int(x.shape[0]) for nm, x in zip(names, xs)}
        if len(set(rows.values())) > 1:
            raise ValueError(f"update: the representations have different row counts {rows}; "
                             "each must hold the same samples")
        self._check_names(names, widths)
        kinds = {"torch" if is_torch(x) else "numpy" for x in xs}
        if len(kinds) > 1:
            raise TypeError("update: mix of torch tensors and other arrays; give one kind per batch")
        if next(iter(rows.values())) == 0:
            return
        # Kept here, not left to the core: the core sees one joint batch ("features") and would refuse the
        # same values, but cannot say which representation holds them or how many there are.
        for nm, x in zip(names, xs):
            bad_values = _nonfinite(x)
            if bad_values:
                raise ValueError(f"update: representation {nm!r} contains {bad_values} NaN or Inf values")
        shift = self._shift
        if shift is None:
            shift = np.concatenate([_mean64(x) for x in xs])
        joint, scale = _joint(xs, shift, self._scale, wide=self.precision == "fp64")
        too_large = _too_large(names, xs, joint)
        if too_large:
            raise ValueError(too_large)
        try:
            self._moments.update(joint)  # validated by the core; on error nothing changed
        except ValueError as e:  # the core names the joint batch "features": say which representation
            if "too large" in str(e) or "overflow" in str(e) or "non-finite" in str(e):
                raise ValueError(_too_large(names, xs, joint, force=True)) from None
            if "vary by at most" in str(e):
                spread = max(_range(x) for x in xs)
                raise ValueError(f"update: the representations {names} vary by at most {spread:.3g} (as given), "
                                 "too little at the scale this state holds them (fixed by its first batch): their "
                                 "squares underflow; rescale them alike in every batch; the batch was not added") \
                    from None
            raise
        if self._names is None:
            self._names, self._widths, self._shift, self._scale = names, widths, shift, scale

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
        _, widths, shift, scale = other._layout()
        _, _, mine, mine_scale = self._layout()
        st = _rescale(other._moments.state_dict(), widths, mine_scale / scale)
        st = _reshift(st, widths, scaled_shift(shift, widths, mine_scale), scaled_shift(mine, widths, mine_scale))
        m = Moments()
        try:
            m._load_own_state_dict(st)  # an exact affine map of a live state's co-moments
        except ValueError as e:
            raise ValueError(f"cannot merge: the other state's co-moments do not fit at this state's scale "
                             f"{mine_scale.tolist()} (the other's {scale.tolist()}): {e}") from None
        self._moments.merge(m)

    def all_reduce(self, group: Any = None) -> None:
        """Merge the states of all ranks of ``group`` (torch.distributed) in
        float64, exactly as ``Moments.all_reduce``: afterwards every rank holds
        the global state. Collective: every rank calls it. The names, widths
        and shift of the lowest rank that saw data are used by all; ranks that
        hold other names or widths make every rank raise the same ValueError,
        and no rank's state changes."""
        from .distributed import _dist, all_reduce_states

        _, dist = _dist()
        world = dist.get_world_size(group)
        mine = None if self.n == 0 else (self._names, self._widths, self._layout()[2].tolist(),
                                         self._layout()[3].tolist())
        gathered: List[Any] = [None] * world
        dist.all_gather_object(gathered, mine, group=group)
        live = [g for g in gathered if g is not None]
        if not live:
            return
        names, widths, shift = live[0][0], live[0][1], np.asarray(live[0][2], dtype=np.float64)
        scale = np.asarray(live[0][3], dtype=np.float64)
        for g in live[1:]:
            if g[0] != names or g[1] != widths:
                raise ValueError(f"all_reduce: ranks hold different representations: names {names} of widths "
                                 f"{widths} and names {g[0]} of widths {g[1]}; no rank's state changed")
        if self.n == 0:
            st = self._moments.state_dict()
        else:
            _, _, own_shift, own_scale = self._layout()
            st = _rescale(self._moments.state_dict(), widths, scale / own_scale)
            st = _reshift(st, widths, scaled_shift(own_shift, widths, scale), scaled_shift(shift, widths, scale))
        merged = all_reduce_states([st], group=group)[0]
        m = Moments(precision=self.precision)
        m.load_state_dict(merged)
        self._moments, self._names, self._widths, self._shift = m, list(names), list(widths), shift
        self._scale = scale

    def reset(self) -> None:
        """Forget all samples, names and widths."""
        self._moments.reset()
        self._names = self._widths = self._shift = self._scale = None

    # -- finishing ------------------------------------------------------------

    def compute(self) -> SimilarityReport:
        """Both estimators for every pair, in float64; the state is not modified.

        Biased: ``||C_rs||_F^2 / (||C_rr||_F ||C_ss||_F)``, inflated at small n
        and large width. Debiased: the unbiased HSIC estimator over all n
        samples; NaN (with a ``RichnessWarning``) below 4 samples or when a
        self-HSIC is not positive (a representation too close to constant at
        that n). A constant representation gives NaN in both. The warnings
        are also listed, once each, in the report's ``warnings``.

        Raises ``EmptySimilarityError`` (a ValueError) when no samples were added."""
        if self._names is None or self.n == 0:
            raise EmptySimilarityError("compute: the Similarity holds no samples; update it first")
        st = self._moments.state_dict()
        return _finish(st["mean"], st["M"], self.n, *self._layout())

    # -- persistence ----------------------------------------------------------

    def state_dict(self) -> dict:
        """A float64 copy: ``names``, ``widths``, ``shift``, ``scale`` (each
        representation's power-of-two scale in the joint state, 1 unless its
        magnitudes are extreme) and the joint ``moments`` state."""
        return {"names": self.names, "widths": self.widths,
                "shift": np.zeros(0) if self._shift is None else self._shift.copy(),
                "scale": np.zeros(0) if self._scale is None else self._scale.copy(),
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
        extra = sorted(set(state) - {"names", "widths", "shift", "scale", "moments"})
        missing = sorted({"names", "widths", "shift", "moments"} - set(state))
        if missing or extra:
            raise ValueError(f"similarity state: missing entries {missing}, unknown entries {extra}")
        names, widths = list(state["names"]), list(state["widths"])
        if not all(isinstance(x, str) for x in names) or len(set(names)) != len(names):
            raise ValueError(f"similarity state: names must be distinct strings, got {names!r}")
        if len(widths) != len(names) or not all(is_int(w) and w >= 1 for w in widths):
            raise ValueError(f"similarity state: widths must be one integer >= 1 per name, got {widths!r}")
        widths = [int(w) for w in widths]
        shift = np.asarray(state["shift"], dtype=np.float64).reshape(-1)
        m = Moments(precision=self.precision)
        if own:
            m._load_own_state_dict(state["moments"])
        else:
            m.load_state_dict(state["moments"])
        if m.n == 0:
            self._moments, self._names, self._widths, self._shift, self._scale = m, None, None, None, None
            return
        p = _state.widths_of(state["moments"])["p"]  # validated by the load above
        if not names or p != sum(widths) + len(widths) or shift.size != sum(widths):
            raise ValueError(f"similarity state: names {names} of widths {widths} need a joint width of "
                             f"{sum(widths) + len(widths)} and a shift of {sum(widths)}, the state has "
                             f"{p} and {shift.size}")
        if not np.isfinite(shift).all():
            raise ValueError("similarity state: shift contains NaN or Inf")
        scale = _scale_of(state.get("scale"), len(widths))
        _check_widths(state["moments"], m.n, names, widths, shift, scale)
        self._moments, self._names, self._widths, self._shift, self._scale = m, names, widths, shift.copy(), scale

    def save(self, path: "os.PathLike | str") -> None:
        """Write the state to ``path`` atomically (.npz, no pickle, checksummed)."""
        st = self.state_dict()
        mst = st["moments"]
        arrays = {k: np.asarray(mst[k]) for k in _state.FIELD_NAMES}
        arrays["shift"] = st["shift"]
        arrays["scale"] = st["scale"]
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
    unbiased-HSIC estimator (NaN below 4 rows).

    The rows are streamed in chunks (a memory-mapped array is read a chunk at
    a time): the memory is a ``Similarity``'s plus one chunk's, not a copy of
    the data."""
    x, y = _as_batch(x, "representation 'x'"), _as_batch(y, "representation 'y'")
    n = int(x.shape[0])
    if int(y.shape[0]) != n:
        raise ValueError(f"cka: the representations have different row counts {{'x': {n}, 'y': {int(y.shape[0])}}}; "
                         "each must hold the same samples")
    s = Similarity()
    step = max(1, _CHUNK_BYTES // (8 * (int(x.shape[1]) + int(y.shape[1]) + 2)))
    for a in range(0, max(n, 1), step):
        s.update({"x": x[a:a + step], "y": y[a:a + step]})
    r = s.compute()
    return float((r.cka_debiased if debiased else r.cka)[0, 1])


# -- the joint batch and its finish ---------------------------------------------


def _mean64(x: Any) -> np.ndarray:
    if is_torch(x):
        import torch

        return x.to(torch.float64).mean(dim=0).cpu().numpy()
    return x.astype(np.float64).mean(axis=0)


def _scale_for(spread: float, magnitude: float, width: int) -> float:
    """The power-of-two scale of a representation, fixed by its first batch:
    1 when its squared row norms (at most ``width * spread^2``, ``spread`` the
    largest |x - c|, or the largest |x| for a batch of one row) lie within
    2^-48 .. 2^48, else the power of two that brings them near 1."""
    u = spread if spread > 0 else magnitude
    if not (u > 0 and math.isfinite(u)):
        return 1.0
    e = 2.0 * math.log2(u) + math.log2(width)
    if -_SAFE_LOG2 <= e <= _SAFE_LOG2:
        return 1.0
    return math.ldexp(1.0, -max(-1000, min(1000, math.floor(e / 2))))


def _joint(xs: List[Any], shift: np.ndarray, scale: Optional[np.ndarray],
           wide: bool = False) -> Tuple[Any, np.ndarray]:
    """``[g_1 x_1 .. g_k x_k, a_1 .. a_k]`` with ``a_r = ||g_r (x_r - c_r)||^2``
    formed in float64; float64 when every input is (or ``wide``), else
    float32. ``scale`` (the ``g_r``, powers of two) None: chosen from this
    batch (``_scale_for``). Returns the batch and the scale."""
    offs = np.cumsum([0] + [int(x.shape[1]) for x in xs])
    g = [] if scale is None else [float(v) for v in scale]
    if is_torch(xs[0]):
        import torch

        dt = torch.float64 if wide or all(x.dtype == torch.float64 for x in xs) else torch.float32
        c = torch.as_tensor(shift, device=xs[0].device)
        ds = [x.to(torch.float64) - c[offs[r]:offs[r + 1]] for r, x in enumerate(xs)]
        if scale is None:
            g = [_scale_for(float(d.abs().max()), float(x.abs().max()), int(x.shape[1])) for d, x in zip(ds, xs)]
        cols = [x.to(dt) if g[r] == 1.0 else (x.to(torch.float64) * g[r]).to(dt) for r, x in enumerate(xs)]
        cols += [((d if g[r] == 1.0 else d * g[r]) ** 2).sum(dim=1, keepdim=True).to(dt) for r, d in enumerate(ds)]
        return torch.cat(cols, dim=1), np.asarray(g, dtype=np.float64)
    dtype = np.float64 if wide or all(x.dtype == np.float64 for x in xs) else np.float32
    n, k = xs[0].shape[0], len(xs)
    out = np.empty((n, offs[-1] + k), dtype=dtype)
    for r, x in enumerate(xs):
        d = x.astype(np.float64) - shift[offs[r]:offs[r + 1]]
        if scale is None:
            g.append(_scale_for(float(np.abs(d).max()), float(np.abs(x).max()), int(x.shape[1])))
        if g[r] == 1.0:
            out[:, offs[r]:offs[r + 1]] = x
        else:
            out[:, offs[r]:offs[r + 1]] = x.astype(np.float64) * g[r]
            d *= g[r]
        out[:, offs[-1] + r] = np.einsum("ij,ij->i", d, d)
    return out, np.asarray(g, dtype=np.float64)


def _too_large(names: List[str], xs: List[Any], joint: Any, force: bool = False) -> str:
    """A one-line refusal naming the representation whose values the joint
    batch cannot hold (a squared norm past the product type), with its largest
    magnitude as given; "" when every norm column is finite (unless ``force``:
    then the one of largest squared norm is named)."""
    k = len(xs)
    tail = joint[:, joint.shape[1] - k:]
    if not force and math.isfinite(_largest(tail)):  # one check (one device sync) for the usual batch
        return ""
    worst = [_largest(tail[:, r]) for r in range(k)]
    r = int(np.argmax(worst))
    x = xs[r]
    mag = _largest(x)
    kind = "float32" if str(joint.dtype).endswith("float32") else "float64"
    return (f"update: representation {names[r]!r} is too large: its largest magnitude {mag:.3g} gives squared row "
            f"norms past {kind} at the scale this state holds it (fixed by its first batch); rescale it alike in "
            "every batch; the batch was not added")


def _range(x: Any) -> float:
    """The largest column range (max - min) of a batch, in float64."""
    if is_torch(x):
        return float((x.amax(dim=0) - x.amin(dim=0)).max())
    return float((x.max(axis=0).astype(np.float64) - x.min(axis=0)).max())


def _largest(col: Any) -> float:
    """The largest magnitude of a column (numpy or torch); inf where any value is not finite."""
    if is_torch(col):
        v = float(col.abs().max())  # one pass: max propagates NaN
    else:
        v = float(np.abs(col).max())
    return v if math.isfinite(v) else math.inf


def _rescale(st: dict, widths: List[int], factor: np.ndarray) -> dict:
    """The joint state with representation r multiplied by ``factor[r]`` (a
    power of two: exact), its norm column by ``factor[r]^2``."""
    if (factor == 1.0).all():
        return st
    D = column_factors(widths, factor)
    out = dict(st)
    out["mean"] = st["mean"] * D
    out["M"] = st["M"] * np.outer(D, D)
    return out


def _scale_of(value: Any, k: int) -> np.ndarray:
    """A state's ``scale`` entry, checked: one positive power of two per
    representation (absent, as in states of version 1: all 1)."""
    if value is None:
        return np.ones(k)
    scale = np.asarray(value, dtype=np.float64).reshape(-1)
    if scale.size != k:
        raise ValueError(f"similarity state: scale has {scale.size} values for {k} representations")
    ok = np.isfinite(scale) & (scale > 0)
    if not ok.all() or not (np.frexp(scale[ok])[0] == 0.5).all():
        raise ValueError(f"similarity state: scale must hold positive powers of two, got {scale.tolist()}")
    return scale


def _check_widths(mst: dict, n: int, names: List[str], widths: List[int], shift: np.ndarray,
                  scale: np.ndarray) -> None:
    """The widths against the state's own columns: the mean of representation
    r's norm column is ``tr C_rr / n + ||mean_r - c_r||^2`` over its block;
    blocks of other widths (names relabelled, widths permuted) break it."""
    mean, M = np.asarray(mst["mean"], dtype=np.float64), np.asarray(mst["M"], dtype=np.float64)
    diag = np.diagonal(M)
    offs = np.cumsum([0] + list(widths))
    P = int(offs[-1])
    c = scaled_shift(shift, widths, scale)
    for r, nm in enumerate(names):
        sl = slice(offs[r], offs[r + 1])
        d = mean[sl] - c[sl]
        block = float(diag[sl].sum()) / n + float(d @ d)
        given = float(mean[P + r])
        if not abs(given - block) <= _WIDTH_RTOL * max(abs(given), abs(block)):
            raise ValueError(f"similarity state: the widths {widths} do not match the state's columns: "
                             f"representation {nm!r} (width {widths[r]}, columns {offs[r]}..{offs[r + 1] - 1}) "
                             f"has a mean squared norm of {given:.6g} in its norm column but {block:.6g} over "
                             "its columns")


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
            shift: np.ndarray, scale: np.ndarray) -> SimilarityReport:
    """Both estimators of a joint state (``finish/cka.py``); each of its notes is also issued as a
    ``RichnessWarning``."""
    biased, deb, notes = cka_matrices(mean, M, n, names, widths, shift, scale)
    for msg in notes:
        _warn(msg, 3)
    return SimilarityReport(names, widths, n, biased, deb, warnings=notes)


# -- files ------------------------------------------------------------------------


def _shift_shape(meta: dict, widths: dict) -> dict:
    w = meta.get("widths")
    if not isinstance(w, list) or not all(is_int(x) and x > 0 for x in w):
        raise ValueError(f"widths {w!r} are not a list of positive integers")
    more = {"shift": (sum(w) if widths["n"] > 0 else 0,)}
    if meta.get("version", 1) >= 2:
        more["scale"] = (len(w) if widths["n"] > 0 else 0,)
    return more


LAYOUT = _statefile.Layout(FORMAT, VERSION, "richness similarity state", "Similarity.save", ("names", "widths"),
                           _shift_shape)


def _read(path: str) -> dict:
    """The state dict of a file written by ``Similarity.save`` (``_statefile.load_state``
    with this layout: every member's shape checked before any data is read)."""
    st = _statefile.load_state(path, LAYOUT)
    moments = {k: st[k] for k in _state.SCALARS + tuple(_state.FIELD_NAMES)}
    out = {"names": st["names"], "widths": st["widths"], "shift": st["shift"], "moments": moments}
    if "scale" in st:
        out["scale"] = st["scale"]
    return out
