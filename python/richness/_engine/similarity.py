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

``Similarity(estimator="minibatch")`` keeps instead the minibatch estimator of
Nguyen, Raghu and Kornblith (2021), what the CKA libraries for PyTorch report:
per batch given to ``update``, the unbiased HSIC (Song et al. 2012) of every
pair of the batch's linear-kernel Grams, summed over the batches
(``finish/cka.py``, ``hsic1_batch``; the Grams of the batch-centred rows,
which leaves HSIC_1 unchanged). Its state is k x k, whatever the widths;
its value depends on how the rows are cut into batches; batches of fewer than
4 rows do not enter it. ``estimator="both"`` keeps both states.
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from .. import _state
from . import adapt as _adapt
from . import statefile as _statefile
from .._checks import is_int, is_torch
from .moments import Moments
from .._warnings import RichnessWarning
from ..finish.cka import MINIBATCH_MIN_ROWS, cka_minibatch_matrix, column_factors, hsic1_batch, scaled_shift
from ..finish.policy import check_rtol, rtol_for
from ..finish.similarity import MEASURES, check_measures, exact_matrices

__all__ = ["Similarity", "SimilarityReport", "SimilarityBlock", "EmptySimilarityError", "cka", "FORMAT", "ESTIMATORS"]

FORMAT = "richness.similarity"  # meta["format"] of a saved Similarity (a Moments file says "richness.moments")
# 2: a "scale" member (the power-of-two scale of each representation); version 1 files hold scale 1.
# 3: meta "estimator" and, for "both" and "minibatch", meta "minibatch" (batches, skipped, n) and a
# member "hsic" (k x k); files of versions 1 and 2 are states of the estimator "exact".
VERSION = 3
# What a Similarity accumulates: the exact joint state, the minibatch HSIC sums, or both.
ESTIMATORS = ("exact", "both", "minibatch")

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
# The minibatch estimator takes values of magnitude up to 2^200 (and, but for
# zeros, from 2^-200): its terms, of degree 4 in the values, stay within float64.
_MINIBATCH_MAX = 2.0 ** 200
# Its Gram products are float32 (unless every input is float64, or precision="fp64") for a representation
# whose largest magnitude in the batch lies within this range, where no product over- or underflows float32;
# outside it (all zeros aside), float64.
_FP32_SAFE = (2.0 ** -40, 2.0 ** 40)


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


def _measure(name: str, holder: Any) -> Optional[Any]:
    """``holder.values[name]`` for a similarity measure's name (None where not
    computed); AttributeError for any other name."""
    if name in MEASURES:
        return holder.__dict__.get("values", {}).get(name)
    raise AttributeError(f"{type(holder).__name__!r} object has no attribute {name!r}")


def _values_of(state: dict) -> Dict[str, Any]:
    """The ``values`` of a report or block pickled with one attribute per estimator."""
    return {k: state.pop(k) for k in list(state) if k in MEASURES and state[k] is not None}


class Pair:
    """The values of one pair of representations (``SimilarityReport.pair``):
    an attribute per similarity measure (``cka``, ``cka_debiased``,
    ``cca_r2``, ...; see ``richness.finish.similarity.MEASURES``), None for a
    measure the report does not hold; ``values``: those it holds, by name."""

    def __init__(self, values: Dict[str, Optional[float]]) -> None:
        self.values = dict(values)

    def __getattr__(self, name: str) -> Optional[float]:
        return _measure(name, self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pair) and self.values == other.values

    def __repr__(self) -> str:
        return "Pair(" + ", ".join(f"{k}={v!r}" for k, v in self.values.items()) + ")"


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


def _caption(name: str, batches: Optional[int]) -> str:
    """A measure's title in tables (the minibatch estimator's with its batches)."""
    title = MEASURES[name].title
    return title.replace("over batches", f"over {batches} batches") if name == "cka_minibatch" else title


def _matrices(values: Dict[str, np.ndarray], batches: Optional[int] = None) -> List[Tuple[str, np.ndarray]]:
    """The matrices to print, in ``MEASURES`` order (a debiased CKA that is NaN everywhere left out)."""
    return [(_caption(name, batches), values[name]) for name in MEASURES if name in values
            and not (name == "cka_debiased" and np.isnan(values[name]).all())]


def _rows(a: np.ndarray) -> list:
    """A matrix as lists of floats (NaN as None)."""
    return [[None if not math.isfinite(v) else float(v) for v in row] for row in a]


class SimilarityBlock:
    """The similarity of the representations of one model (or name prefix)
    against another's (``SimilarityReport.between``): ``rows`` and ``cols``
    (full names), ``values`` (measure name -> len(rows) x len(cols) matrix,
    the measures the report holds), an attribute per measure (``cka``,
    ``cka_debiased``, ``cca_r2``, ...; None where the report has none),
    ``n``, ``batches`` (the batches in the minibatch estimator, None without
    it), and ``row_label`` / ``col_label``, what was selected for each axis."""

    def __init__(self, row_label: str, col_label: str, rows: List[str], cols: List[str], n: int,
                 values: Dict[str, np.ndarray], warnings: Optional[List[str]] = None,
                 batches: Optional[int] = None) -> None:
        self.row_label, self.col_label = row_label, col_label
        self.rows, self.cols, self.n = list(rows), list(cols), int(n)
        self.values = dict(values)
        self.batches = batches
        self.warnings = list(warnings or [])

    def __getattr__(self, name: str) -> Optional[np.ndarray]:
        return _measure(name, self)

    def __setstate__(self, state: dict) -> None:  # blocks pickled with one attribute per estimator
        if "values" not in state:
            state["values"] = _values_of(state)
        state.setdefault("batches", None)
        self.__dict__.update(state)

    def __str__(self) -> str:
        lines = [f"SimilarityBlock: {self.row_label!r} (rows) against {self.col_label!r} (columns), n = {self.n:,}"]
        lines += _table(self.rows, self.cols, _matrices(self.values, self.batches))
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    __repr__ = __str__


class SimilarityReport:
    """What ``Similarity.compute`` finishes: ``names`` (first-seen order),
    ``widths``, ``n``, ``values`` (measure name -> k x k matrix, the measures
    computed, in ``richness.finish.similarity.MEASURES`` order), an attribute
    per measure (None where not computed):

    - ``cka`` (biased linear CKA) and ``cka_debiased`` (the unbiased-HSIC
      estimator; NaN below 4 samples), from the exact state;
    - ``cka_minibatch`` (the minibatch estimator, which depends on the
      batching), with ``batches`` and ``skipped`` (the batches that entered it
      and those of fewer than 4 rows left out; None without it);
    - ``cca_r2``, ``cca_rho``, ``svcca``, ``pwcca``, ``procrustes``,
      ``shape_angular``, ``linreg_r2`` (entry [i, j]: j predicted from i),
      when asked for (``compute(measures=...)``);

    and ``warnings`` (what the finish warned about, once each).
    ``print(report)`` shows the matrices as tables; ``between(a, b)`` the block
    of one model against another; ``pair(a, b)`` one pair's values."""

    def __init__(self, names: List[str], widths: List[int], n: int, values: Dict[str, np.ndarray],
                 warnings: Optional[List[str]] = None, *, batches: Optional[int] = None,
                 skipped: Optional[int] = None) -> None:
        self.names, self.widths, self.n = list(names), list(widths), int(n)
        self.values = {name: values[name] for name in MEASURES if name in values}
        self.batches, self.skipped = batches, skipped
        self.warnings = list(dict.fromkeys(warnings or []))

    def __getattr__(self, name: str) -> Optional[np.ndarray]:
        return _measure(name, self)

    def __setstate__(self, state: dict) -> None:  # reports pickled with one attribute per estimator
        if "values" not in state:
            state["values"] = _values_of(state)
        state.setdefault("warnings", [])
        state.setdefault("batches", None)
        state.setdefault("skipped", None)
        self.__dict__.update(state)

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
        representations named ``a`` or ``a.*``, columns those of ``b``, every
        measure the report holds (the A x B map the CKA libraries return;
        ``plot.similarity`` draws it with each axis labelled by its model)."""
        rows, cols = self.select(a), self.select(b)
        i = [self.names.index(nm) for nm in rows]
        j = [self.names.index(nm) for nm in cols]
        return SimilarityBlock(a, b, rows, cols, self.n, {k: v[np.ix_(i, j)] for k, v in self.values.items()},
                               self.warnings, batches=self.batches)

    def _index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise KeyError(f"no representation named {name!r}; the report holds {self.names}") from None

    def pair(self, a: str, b: str) -> Pair:
        """The values of representations ``a`` and ``b`` (row ``a``, column
        ``b``: for ``linreg_r2``, ``b`` predicted from ``a``)."""
        i, j = self._index(a), self._index(b)
        return Pair({k: float(v[i, j]) for k, v in self.values.items()})

    def to_dict(self) -> dict:
        """Plain JSON types (NaN as None): ``names``, ``n``, ``widths``, each
        measure computed by name (k x k lists), and where the minibatch
        estimator was kept ``batches`` and ``skipped``."""
        out: Dict[str, Any] = {"names": list(self.names)}
        out.update((k, _rows(v)) for k, v in self.values.items())
        out.update(n=self.n, widths=list(self.widths))
        if self.batches is not None:
            out.update(batches=self.batches, skipped=self.skipped)
        return out

    def __str__(self) -> str:
        lines = [f"SimilarityReport: {len(self.names)} representations, n = {self.n:,}"]
        if self.batches is not None:
            lines[0] += (f", minibatch estimator over {self.batches:,} batches"
                         + (f" ({self.skipped:,} of fewer than {MINIBATCH_MIN_ROWS} rows left out)"
                            if self.skipped else ""))
        lines += _table([f"{nm} (width {w})" for nm, w in zip(self.names, self.widths)],
                        [f"{nm} (width {w})" for nm, w in zip(self.names, self.widths)],
                        _matrices(self.values, self.batches))
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


def _nonfinite_refusal(names: List[str], xs: List[Any]) -> str:
    """The refusal naming the first representation that holds NaN or Inf
    values, with their count; "" when none does."""
    for nm, x in zip(names, xs):
        bad = _nonfinite(x)
        if bad:
            return f"update: representation {nm!r} contains {bad} NaN or Inf values"
    return ""


def _nonfinite(x: Any) -> int:
    """The number of NaN or Inf values (for a CUDA tensor this waits for the device)."""
    if is_torch(x):
        import torch

        return int((~torch.isfinite(x)).sum())
    return int(np.count_nonzero(~np.isfinite(x)))


class Similarity:
    """Streamed linear CKA between named representations of the same samples.

    ``update({"a": xa, "b": xb, ...})`` adds one batch: each value (rows x
    width; numpy, torch or DLPack) is one representation of the same rows;
    the names and widths are fixed by the first batch. ``compute()`` gives a
    ``SimilarityReport`` with the estimators kept for every pair; ``merge`` adds
    another state (any order, exact up to rounding); ``state_dict`` /
    ``load_state_dict``, ``save`` / ``Similarity.load`` (a checksummed atomic
    .npz marked ``richness.similarity``), ``reset``, ``copy`` / ``deepcopy`` /
    ``pickle`` behave as for ``Moments``. Invalid input raises and leaves the
    state exactly as it was.

    precision: as ``Moments``: None takes ``"fp64"`` when every input of a batch
        is float64, else ``"fp32"`` (float32 products after a float64
        centering of the batch: CKA to about 1e-6). For the minibatch
        estimator the same rule picks its Gram products: float64 for
        ``"fp64"`` or all-float64 batches, else float32 products of the
        batch-centred rows (float64 for a representation whose largest
        magnitude in the batch lies outside 2^-40 .. 2^40); the sums are
        float64.
    estimator: what is kept:

        - ``"exact"`` (default): the exact joint state, ``8 (p_1 + .. + p_k +
          k)^2`` bytes; ``cka`` and ``cka_debiased`` over all n samples, not
          depending on the batching.
        - ``"minibatch"``: only the k x k sums of the minibatch estimator
          (Nguyen, Raghu and Kornblith 2021; what ckatorch, torch-cka and
          pytorch-cka report): for each batch given to ``update``, the unbiased
          HSIC (Song et al. 2012) of every pair of the batch's linear-kernel
          Grams ``X_b X_b^T``, summed over batches;
          ``cka_minibatch[r, s] = sum_b HSIC_1(r, s) / sqrt(sum_b HSIC_1(r, r)
          sum_b HSIC_1(s, s))``. Its value depends on how the rows are cut
          into batches (the same rows in other batches give another value) and
          differs from the CKA of all rows at once. A batch of fewer than 4 rows
          has no HSIC_1: it is left out (counted in ``skipped``, said by a
          ``RichnessWarning`` at ``compute``). Any width: the state is k x k,
          an update holds the k Grams of its batch (``8 k rows^2`` bytes).
          Values beyond 2^200 (or, but for zeros, below 2^-200) in magnitude
          are refused. ``cka`` and ``cka_debiased`` are None.
        - ``"both"``: the two states, every field of the report.

    The norm columns are formed in float64 and the concatenated batch is
    handed to the core in the inputs' precision. Torch CUDA batches are
    concatenated on their device and go to the CUDA backend (that route has
    not been run on a GPU here; the CPU torch route is tested); the minibatch
    Grams of torch tensors are formed on their device.
    """

    def __init__(self, precision: Optional[str] = None, estimator: str = "exact") -> None:
        if not isinstance(estimator, str) or estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
        self.precision = precision
        self.estimator = estimator
        self._names: Optional[List[str]] = None
        self._widths: Optional[List[int]] = None
        self._shift: Optional[np.ndarray] = None  # float64, the widths' sum
        self._scale: Optional[np.ndarray] = None  # float64 powers of two, one per representation
        self._moments = Moments(precision=precision)  # checks the precision's name
        # the minibatch estimator ("both", "minibatch"): the k x k sums of HSIC_1 over the batches that
        # entered (None before the first), their count, the count of batches too small to enter, all rows
        self._hsic: Optional[np.ndarray] = None
        self._batches = self._skipped = self._rows = 0

    def __setstate__(self, state: dict) -> None:  # objects pickled before the minibatch estimator existed
        self.__dict__.update(state)
        self.__dict__.setdefault("estimator", "exact")
        self.__dict__.setdefault("_hsic", None)
        for key in ("_batches", "_skipped", "_rows"):
            self.__dict__.setdefault(key, 0)

    # -- accumulation ---------------------------------------------------------

    @property
    def n(self) -> int:
        """The samples added (every row of every update)."""
        return self._rows if self.estimator == "minibatch" else self._moments.n

    @property
    def batches(self) -> int:
        """The batches in the minibatch estimator (0 for ``estimator="exact"``)."""
        return self._batches

    @property
    def skipped(self) -> int:
        """The batches of fewer than 4 rows left out of the minibatch estimator."""
        return self._skipped

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
                             f"{dict(zip(self._names, self._widths or []))}")

    def update(self, batch: Mapping[str, Any]) -> None:
        """Add one batch: a mapping name -> (rows x width) of the same rows.
        The names are those of the first batch, in any order (a mapping is
        keyed by name: the batch is taken in the first batch's order). For the
        minibatch estimator the batch is one term of its sums: a batch of no
        rows adds nothing, one of 1 to 3 rows only counts as skipped."""
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
        # NaN or Inf show in one check per batch (the exact state's norm columns, the minibatch estimator's
        # largest magnitudes); only a refused batch is scanned, to name the representation that holds them
        mags = None if self.estimator == "exact" else _magnitudes(xs)
        if mags is not None and not all(math.isfinite(m) for m in mags):
            raise ValueError(_nonfinite_refusal(names, xs))
        hsic = None
        rows_given = int(xs[0].shape[0])
        if mags is not None and rows_given >= MINIBATCH_MIN_ROWS:
            out_of_range = _minibatch_range(names, mags)
            if out_of_range:
                raise ValueError(out_of_range)
            fp64 = _state.default_precision(self.precision, all(_is_float64(x) for x in xs)) == "fp64"
            hsic = hsic1_batch(xs, wide=[fp64 or not (m == 0 or _FP32_SAFE[0] <= m <= _FP32_SAFE[1]) for m in mags])
            if not np.isfinite(hsic).all():
                raise ValueError(_too_large_minibatch(names, xs))
        if self.estimator != "minibatch":
            self._update_exact(names, widths, xs)
        elif self._names is None:
            self._names, self._widths = names, widths
        if self.estimator != "exact":  # nothing below can fail: the batch is added whole or not at all
            if hsic is None:
                self._skipped += 1
            else:
                self._hsic = hsic if self._hsic is None else self._hsic + hsic
                self._batches += 1
            self._rows += rows_given

    def _update_exact(self, names: List[str], widths: List[int], xs: List[Any]) -> None:
        """The exact joint state's update by a checked batch (on error nothing changed)."""
        shift = self._shift
        if shift is None:
            shift = np.concatenate([_mean64(x) for x in xs])
        joint, scale = _joint(xs, shift, self._scale, wide=self.precision == "fp64")
        too_large = _too_large(names, xs, joint)  # "" for the usual batch: its norm columns are finite
        if too_large:
            raise ValueError(_nonfinite_refusal(names, xs) or too_large)
        try:
            self._moments.update(joint)  # validated by the core; on error nothing changed
        except _adapt.InputError as e:  # the core names the joint batch "features": say which representation
            if e.limit in ("finite", "overflow"):
                raise ValueError(_too_large(names, xs, joint, force=True)) from None
            if e.limit == "underflow":
                spread = max(_range(x) for x in xs)
                raise ValueError(f"update: the representations {names} vary by at most {spread:.3g} (as given), "
                                 "too little at the scale this state holds them (fixed by its first batch): their "
                                 "squares underflow; rescale them alike in every batch; the batch was not added") \
                    from None
            raise
        if self._names is None:
            self._names, self._widths, self._shift, self._scale = names, widths, shift, scale

    def merge(self, other: "Similarity") -> None:
        """Add another state (its norm columns re-expressed at this state's
        shift; the minibatch sums added). An empty state takes the other's,
        its estimator included; two states that hold samples must keep the
        same estimator."""
        if not isinstance(other, Similarity):
            raise TypeError(f"merge expects a Similarity, got {type(other).__name__}")
        if other.n == 0:
            return
        if self.n == 0 and self._names is None:
            self._load_own_state_dict(other.state_dict())
            return
        if other.estimator != self.estimator:
            raise ValueError(f"cannot merge: this Similarity keeps the estimator {self.estimator!r}, the other "
                             f"{other.estimator!r}")
        if other._names != self._names or other._widths != self._widths:
            raise ValueError(f"cannot merge: this Similarity holds names {self._names} of widths {self._widths}, "
                             f"the other names {other._names} of widths {other._widths}")
        if self.estimator != "minibatch":
            self._merge_exact(other)
        if self.estimator != "exact":  # after the exact merge, which may refuse: nothing below can fail
            self._add_minibatch(other._hsic, other._batches, other._skipped, other._rows)

    def _add_minibatch(self, hsic: Optional[np.ndarray], batches: int, skipped: int, rows: int) -> None:
        if hsic is not None:
            self._hsic = hsic.copy() if self._hsic is None else self._hsic + hsic
        self._batches += batches
        self._skipped += skipped
        self._rows += rows

    def _merge_exact(self, other: "Similarity") -> None:
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
        hold other names or widths, or keep other estimators, make every rank
        raise the same ValueError, and no rank's state changes. The minibatch
        sums are added in rank order on every rank (the same float64 sum)."""
        from .distributed import _dist, all_reduce_states

        _, dist = _dist()
        world = dist.get_world_size(group)
        exact = self.estimator != "minibatch"
        layout = None
        if self.n > 0:
            layout = (self._names, self._widths, self._layout()[2].tolist() if exact else None,
                      self._layout()[3].tolist() if exact else None)
        sums = None if self.estimator == "exact" else (None if self._hsic is None else self._hsic.tolist(),
                                                       self._batches, self._skipped, self._rows)
        gathered: List[Any] = [None] * world
        dist.all_gather_object(gathered, (self.estimator, layout, sums), group=group)
        kept = sorted({g[0] for g in gathered})
        if len(kept) > 1:
            raise ValueError(f"all_reduce: ranks keep different estimators {kept}; no rank's state changed")
        live = [g[1] for g in gathered if g[1] is not None]
        if not live:
            return
        names, widths = live[0][0], live[0][1]
        for g in live[1:]:
            if g[0] != names or g[1] != widths:
                raise ValueError(f"all_reduce: ranks hold different representations: names {names} of widths "
                                 f"{widths} and names {g[0]} of widths {g[1]}; no rank's state changed")
        if exact:
            self._all_reduce_exact(group, all_reduce_states, names, widths, live[0][2], live[0][3])
        self._names, self._widths = list(names), list(widths)
        if self.estimator != "exact":
            self._hsic, self._batches, self._skipped, self._rows = None, 0, 0, 0
            for g in gathered:
                if g[2] is not None:
                    self._add_minibatch(None if g[2][0] is None else np.asarray(g[2][0], dtype=np.float64),
                                        *g[2][1:])

    def _all_reduce_exact(self, group: Any, all_reduce_states: Any, names: List[str], widths: List[int],
                          shift_list: List[float], scale_list: List[float]) -> None:
        """The exact joint state's part of ``all_reduce`` (collective), at the given shift and scale."""
        shift = np.asarray(shift_list, dtype=np.float64)
        scale = np.asarray(scale_list, dtype=np.float64)
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
        """Forget all samples, names and widths (the estimator stays)."""
        self._moments.reset()
        self._names = self._widths = self._shift = self._scale = None
        self._hsic, self._batches, self._skipped, self._rows = None, 0, 0, 0

    # -- finishing ------------------------------------------------------------

    def compute(self, measures: Any = None, *, rtol: Optional[float] = None, svcca_keep: float = 0.99,
                ridge: float = 0.0) -> SimilarityReport:
        """The similarity of every pair, in float64; the state is not modified.

        Args:
            measures: the measures to finish (names of
                ``richness.finish.similarity.MEASURES``), or ``"all"`` (every
                measure of the states kept). Default: those of the estimator,
                ``cka`` and ``cka_debiased`` (exact), ``cka_minibatch``
                (minibatch), all three (both). Only what is asked is finished.

                - ``cka``: ``||C_rs||_F^2 / (||C_rr||_F ||C_ss||_F)``, inflated
                  at small n and large width; ``cka_debiased``: the unbiased
                  HSIC estimator over all n samples, NaN below 4 samples or
                  where a self-HSIC is not positive;
                - ``cka_minibatch``: the summed HSIC_1 of the batches as given
                  to ``update`` (a warning counts the batches of fewer than 4
                  rows left out);
                - ``cca_r2`` (Yanai's mean squared canonical correlation),
                  ``cca_rho`` (mean canonical correlation), ``svcca``,
                  ``pwcca``; ``procrustes`` (orthogonal Procrustes distance,
                  0..2) and ``shape_angular`` (angular shape metric, radians);
                  ``linreg_r2`` (entry [i, j]: the share of j's variance a
                  least-squares map from i explains; not symmetric).

                The exact measures need ``estimator="exact"`` or ``"both"``,
                ``cka_minibatch`` needs ``"minibatch"`` or ``"both"``.
            rtol: the eigenvalue cut of the CCA measures and the regression
                (relative to each representation's largest eigenvalue); default
                by the product precision (docs/MATH.md, "Rank cut").
            svcca_keep: SVCCA's share of each representation's variance kept,
                in (0, 1].
            ridge: ``linreg_r2``'s ridge, relative to the mean eigenvalue of the
                predicting representation (0: least squares).

        A constant representation gives NaN in its row and column; CCA values
        that approach 1 by construction (widths near n) are given with a
        warning. Every ``RichnessWarning`` is also listed, once, in the
        report's ``warnings``.

        Raises ``EmptySimilarityError`` (a ValueError) when no samples were
        added; ValueError for an unknown measure, one whose state is not kept,
        or an option out of range."""
        held = [s for s in ("exact", "minibatch") if self.estimator in (s, "both")]
        if measures is None:
            asked = [m for m in ("cka", "cka_debiased", "cka_minibatch") if MEASURES[m].state in held]
        elif isinstance(measures, str) and measures == "all":
            asked = [m for m in MEASURES if MEASURES[m].state in held]
        else:
            asked = check_measures(measures, held, self.estimator)
        rtol = check_rtol(rtol)
        if self._names is None or self.n == 0:
            raise EmptySimilarityError("compute: the Similarity holds no samples; update it first")
        names, widths = self._names, self.widths
        values: Dict[str, np.ndarray] = {}
        notes: List[str] = []
        exact = [m for m in asked if MEASURES[m].state == "exact"]
        if exact:
            st = self._moments.state_dict()
            _, _, shift, scale = self._layout()
            values, notes = exact_matrices(st["mean"], st["M"], self.n, names, widths, shift, scale, exact,
                                           rtol=rtol_for(st["precision"], rtol), keep=svcca_keep, ridge=ridge)
        if "cka_minibatch" in asked:
            hsic = np.zeros((len(names), len(names))) if self._hsic is None else self._hsic
            values["cka_minibatch"], more = cka_minibatch_matrix(hsic, self._batches, self._skipped, names)
            notes = notes + more
        for msg in notes:
            _warn(msg, 3)
        kept = "minibatch" in held
        return SimilarityReport(names, widths, self.n, values, warnings=notes,
                                batches=self._batches if kept else None, skipped=self._skipped if kept else None)

    # -- persistence ----------------------------------------------------------

    def state_dict(self) -> dict:
        """A float64 copy: ``names``, ``widths``, ``shift``, ``scale`` (each
        representation's power-of-two scale in the joint state, 1 unless its
        magnitudes are extreme) and the joint ``moments`` state (empty, and
        ``shift`` and ``scale`` of size 0, for ``estimator="minibatch"``).
        For ``"both"`` and ``"minibatch"`` also ``estimator`` and
        ``minibatch``: ``hsic`` (k x k, the sums of HSIC_1; 0 x 0 before a
        sample), ``batches``, ``skipped`` and ``n`` (every row added)."""
        out = {"names": self.names, "widths": self.widths,
               "shift": np.zeros(0) if self._shift is None else self._shift.copy(),
               "scale": np.zeros(0) if self._scale is None else self._scale.copy(),
               "moments": self._moments.state_dict()}
        if self.estimator != "exact":
            k = len(self.names)
            hsic = np.zeros((k, k)) if self._hsic is None else self._hsic.copy()
            out["estimator"] = self.estimator
            out["minibatch"] = {"hsic": hsic, "batches": self._batches, "skipped": self._skipped, "n": self._rows}
        return out

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
        estimator = state.get("estimator", "exact")  # states written before the minibatch estimator: exact
        if not isinstance(estimator, str) or estimator not in ESTIMATORS:
            raise ValueError(f"similarity state: estimator must be one of {ESTIMATORS}, got {estimator!r}")
        known = {"names", "widths", "shift", "scale", "moments", "estimator"} | (
            set() if estimator == "exact" else {"minibatch"})
        extra = sorted(set(state) - known)
        missing = sorted(({"names", "widths", "shift", "moments"} | (set() if estimator == "exact" else {"minibatch"}))
                         - set(state))
        if missing or extra:
            raise ValueError(f"similarity state: missing entries {missing}, unknown entries {extra}")
        names, widths = list(state["names"]), list(state["widths"])
        if not all(isinstance(x, str) for x in names) or len(set(names)) != len(names):
            raise ValueError(f"similarity state: names must be distinct strings, got {names!r}")
        if len(widths) != len(names) or not all(is_int(w) and w >= 1 for w in widths):
            raise ValueError(f"similarity state: widths must be one integer >= 1 per name, got {widths!r}")
        widths = [int(w) for w in widths]
        shift = np.asarray(state["shift"], dtype=np.float64).reshape(-1)
        sums = None if estimator == "exact" else _minibatch_of(state["minibatch"], len(names))
        m = Moments(precision=self.precision)
        if own:
            m._load_own_state_dict(state["moments"])
        else:
            m.load_state_dict(state["moments"])
        if estimator == "minibatch":
            self._load_minibatch(m, names, widths, shift, state.get("scale"), sums)
            return
        if sums is not None and sums[3] != m.n:
            raise ValueError(f"similarity state: the minibatch sums count {sums[3]} samples, the joint state {m.n}")
        if m.n == 0:
            self._moments, self._names, self._widths, self._shift, self._scale = m, None, None, None, None
            self._set_minibatch(estimator, sums)
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
        self._set_minibatch(estimator, sums)

    def _load_minibatch(self, m: Moments, names: List[str], widths: List[int], shift: np.ndarray, scale: Any,
                        sums: Optional[tuple]) -> None:
        """``_load`` of a state of the estimator "minibatch": no joint state, the sums alone."""
        assert sums is not None
        if m.n != 0 or shift.size or np.asarray(scale if scale is not None else [], dtype=np.float64).size:
            raise ValueError("similarity state: a minibatch state holds no joint moments, shift or scale")
        if sums[3] > 0 and not names:
            raise ValueError("similarity state: a minibatch state of samples needs its names and widths")
        self._moments = m
        self._names, self._widths = (names, widths) if sums[3] > 0 else (None, None)
        self._shift = self._scale = None
        self._set_minibatch("minibatch", sums)

    def _set_minibatch(self, estimator: str, sums: Optional[tuple]) -> None:
        self.estimator = estimator
        if sums is None or sums[3] == 0:
            self._hsic, self._batches, self._skipped, self._rows = None, 0, 0, 0
        else:
            self._hsic, self._batches, self._skipped, self._rows = sums

    def save(self, path: "os.PathLike | str") -> None:
        """Write the state to ``path`` atomically (.npz, no pickle, checksummed)."""
        st = self.state_dict()
        mst = st["moments"]
        arrays = {k: np.asarray(mst[k]) for k in _state.FIELD_NAMES}
        arrays["shift"] = st["shift"]
        arrays["scale"] = st["scale"]
        extra: dict = {"names": st["names"], "widths": st["widths"], "estimator": self.estimator}
        if self.estimator != "exact":
            mb = st["minibatch"]
            if self._rows:
                arrays["hsic"] = mb["hsic"]
            extra["minibatch"] = {"batches": mb["batches"], "skipped": mb["skipped"], "n": mb["n"]}
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
        est = "" if self.estimator == "exact" else f", estimator={self.estimator!r}"
        if self._names is None or self.n == 0:
            return f"Similarity(empty{est})"
        more = "" if self.estimator == "exact" else f", batches={self._batches}, skipped={self._skipped}"
        return f"Similarity(n={self.n}, names={self._names}, widths={self._widths}{est}{more})"


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
    mat = r.cka_debiased if debiased else r.cka
    assert mat is not None  # an exact Similarity
    return float(mat[0, 1])


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


def _magnitudes(xs: List[Any]) -> List[float]:
    """Each representation's largest magnitude, from its smallest and largest
    value (one pass, no temporary; for tensors one device sync for all); inf
    where a value is not finite."""
    if is_torch(xs[0]):
        import torch

        dev = xs[0].device
        ends = torch.stack([torch.stack(torch.aminmax(x)).to(device=dev, dtype=torch.float64) for x in xs])
        pairs = ends.cpu().tolist()
    else:
        pairs = [[float(x.min()), float(x.max())] for x in xs]
    return [max(-lo, hi) if math.isfinite(lo) and math.isfinite(hi) else math.inf for lo, hi in pairs]


def _is_float64(x: Any) -> bool:
    return str(x.dtype) in ("float64", "torch.float64")


def _minibatch_range(names: List[str], mags: List[float]) -> str:
    """A one-line refusal naming a representation whose largest magnitude
    (``mags``, one per representation) lies outside 2^-200 .. 2^200 (about
    6e-61 .. 2e60; all zeros pass): its HSIC_1 terms, of degree 4 in the
    values, would under- or overflow float64. "" when every one is within."""
    for nm, mag in zip(names, mags):
        if mag > _MINIBATCH_MAX or 0 < mag < 1 / _MINIBATCH_MAX:
            return (f"update: representation {nm!r} has a largest magnitude of {mag:.3g}, outside the "
                    f"{1 / _MINIBATCH_MAX:.1g} .. {_MINIBATCH_MAX:.1g} the minibatch estimator holds in float64 "
                    "(its terms are of degree 4 in the values); rescale it alike in every batch; the batch was not "
                    "added")
    return ""


def _too_large_minibatch(names: List[str], xs: List[Any]) -> str:
    """The refusal of a batch whose minibatch terms are past float64, naming
    the representation of largest squared row norm bound (width x largest
    magnitude squared)."""
    mags = [_largest(x) for x in xs]
    r = int(np.argmax([m * m * int(x.shape[1]) for m, x in zip(mags, xs)]))
    return (f"update: representation {names[r]!r} is too large for the minibatch estimator: its largest magnitude "
            f"{mags[r]:.3g} gives Gram products past float64; rescale it alike in every batch; the batch was not "
            "added")


# -- files ------------------------------------------------------------------------


def _file_estimator(meta: dict) -> str:
    """The estimator a file's meta gives: "exact" for versions 1 and 2 (which
    have no entry), the entry (checked, with its ``minibatch`` counts) from 3."""
    version = meta.get("version", 1)
    if version < 3:
        if "estimator" in meta or "minibatch" in meta:
            raise ValueError(f"a version {version} file has no estimator entry")
        return "exact"
    estimator = meta.get("estimator")
    if not isinstance(estimator, str) or estimator not in ESTIMATORS:
        raise ValueError(f"estimator {estimator!r} is not one of {ESTIMATORS}")
    counts = meta.get("minibatch")
    if estimator == "exact":
        if counts is not None:
            raise ValueError("an exact state has no minibatch entry")
        return estimator
    if not isinstance(counts, dict) or sorted(counts) != ["batches", "n", "skipped"] or not all(
            is_int(v) and v >= 0 for v in counts.values()):
        raise ValueError(f"minibatch entry {counts!r} is not a dict of the counts batches, skipped and n")
    return estimator


def _shift_shape(meta: dict, widths: dict) -> dict:
    w = meta.get("widths")
    if not isinstance(w, list) or not all(is_int(x) and x > 0 for x in w):
        raise ValueError(f"widths {w!r} are not a list of positive integers")
    more: Dict[str, Tuple[int, ...]] = {"shift": (sum(w) if widths["n"] > 0 else 0,)}
    if meta.get("version", 1) >= 2:
        more["scale"] = (len(w) if widths["n"] > 0 else 0,)
    if _file_estimator(meta) != "exact" and meta["minibatch"]["n"] > 0:
        more["hsic"] = (len(w), len(w))
    return more


LAYOUT = _statefile.Layout(FORMAT, VERSION, "richness similarity state", "Similarity.save", ("names", "widths"),
                           _shift_shape, optional=("estimator", "minibatch"))


def _read(path: str) -> dict:
    """The state dict of a file written by ``Similarity.save`` (``_statefile.load_state``
    with this layout: every member's shape checked before any data is read)."""
    st = _statefile.load_state(path, LAYOUT)
    moments = {k: st[k] for k in _state.SCALARS + tuple(_state.FIELD_NAMES)}
    out = {"names": st["names"], "widths": st["widths"], "shift": st["shift"], "moments": moments}
    if "scale" in st:
        out["scale"] = st["scale"]
    if st.get("estimator", "exact") != "exact":
        k = len(st["widths"])
        out["estimator"] = st["estimator"]
        out["minibatch"] = {"hsic": st["hsic"] if "hsic" in st else np.zeros((k, k)), **st["minibatch"]}
    return out


def _minibatch_of(value: Any, k: int) -> Tuple[Optional[np.ndarray], int, int, int]:
    """A state's ``minibatch`` entry, checked: ``(hsic, batches, skipped, n)``,
    ``hsic`` a finite symmetric k x k float64 copy (None while no batch entered)."""
    if not isinstance(value, dict) or sorted(value) != ["batches", "hsic", "n", "skipped"]:
        raise ValueError("similarity state: minibatch must be a dict of hsic, batches, skipped and n")
    counts = [value[key] for key in ("batches", "skipped", "n")]
    if not all(is_int(c) and c >= 0 for c in counts):
        raise ValueError(f"similarity state: minibatch batches, skipped and n must be integers >= 0, got {counts}")
    batches, skipped, n = (int(c) for c in counts)
    if n == 0:
        if batches or skipped:
            raise ValueError(f"similarity state: minibatch counts {batches} batches and {skipped} skipped of no rows")
        return None, 0, 0, 0
    if batches + skipped == 0 or MINIBATCH_MIN_ROWS * batches + skipped > n:
        raise ValueError(f"similarity state: {batches} batches of at least {MINIBATCH_MIN_ROWS} rows and {skipped} "
                         f"smaller ones cannot hold {n} rows")
    hsic = np.array(value["hsic"], dtype=np.float64)
    if hsic.shape != (k, k):
        raise ValueError(f"similarity state: minibatch hsic has shape {hsic.shape} for {k} representations")
    if not np.isfinite(hsic).all() or not np.array_equal(hsic, hsic.T):
        raise ValueError("similarity state: minibatch hsic must be finite and symmetric")
    if batches == 0:
        if hsic.any():
            raise ValueError("similarity state: minibatch hsic is not zero, but no batch entered")
        return None, 0, skipped, n
    return hsic, batches, skipped, n
