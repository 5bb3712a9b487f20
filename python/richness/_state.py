"""The state's one schema: its fields, their shapes, validation and merging.

Every place that handles a state dict (``Moments.state_dict`` and
``load_state_dict``, the saved ``.npz`` file, the torch.distributed and
torchmetrics merges) reads the field list from here, so adding a field is
one entry below plus its line and arithmetic in the core. The precision
modes are read from the compiled core's table on first use
(``precision_modes``), so the schema imports without the core.

A state is a dict with the integer widths ``n, p, c, t, k, num_classes``
(-1 where a stream is absent or, for ``num_classes``, not fixed), the product
``precision`` by name, and one float64 (or int64) array per field. Symmetric
matrices are full (both triangles filled).

The many-state merge (docs/MATH.md, "Merging states") shifts every state's
co-moments to the global mean and sums them:

    M = sum_r (M_r + n_r d_r d_r^T),   d_r = mu_r - mu

and likewise for each cross-moment with the two streams' mean shifts. It is
Chan's pairwise merge applied to all states at once: one sum, so it suits
collectives.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np

from ._checks import check_int, is_int


@dataclass(frozen=True)
class Precision:
    """A precision mode of the products (docs/MATH.md, "The rank cut")."""

    name: str
    coarseness: int     # merging two states keeps the coarser mode
    rtol: float         # default eigenvalue cut: about the products' relative noise
    cuda_only: bool
    resolves_nc1: bool  # fine enough for Sigma_W by subtraction (docs/MATH.md, "NC1")


@functools.lru_cache(maxsize=None)
def precision_modes() -> Tuple[Precision, ...]:
    """The precision modes, finest to coarsest: the compiled core's one table
    (csrc/common/precision.hpp), read on first use. ImportError, naming the
    reason, where the core cannot be imported."""
    from ._native import _core

    return tuple(Precision(m["name"], m["coarseness"], m["rtol"], m["cuda_only"], m["resolves_nc1"])
                 for m in _core.precisions())


@functools.lru_cache(maxsize=None)
def precisions() -> Tuple[str, ...]:
    """The names of ``precision_modes()``, finest to coarsest."""
    return tuple(m.name for m in precision_modes())


# How a caller words an unknown precision name (``str.format`` with ``name`` and ``names``).
PRECISION_ARGUMENT = "precision must be one of {names} or None, got {name!r}"  # a constructor's precision=
PRECISION_ENTRY = "state entry 'precision' is {name!r}, expected one of {names}"  # a state dict's entry


def precision_mode(name: object, refusal: str = "unknown precision {name!r}; expected one of {names}") -> Precision:
    """The table entry of a precision named ``name``; ValueError if unknown,
    worded by ``refusal``. The one place a precision name is validated."""
    mode = next((m for m in precision_modes() if m.name == name), None)
    if mode is None:
        raise ValueError(refusal.format(name=name, names=precisions()))
    return mode


def check_runs_on_cpu(name: str) -> None:
    """Raise ValueError unless the CPU backend runs precision ``name`` (the
    core's own message for a CUDA-only mode, as its update gives it)."""
    from ._native import _core

    precision_mode(name)
    _core.check_cpu_precision(name)


def default_precision(precision: Optional[str], all_float64: bool) -> str:
    """The product precision of a batch: ``precision`` when one is fixed, else
    ``"fp64"`` when every float input of the batch is float64 and ``"fp32"``
    otherwise (the rule of ``Moments.update`` and the Monitor's every=1 route)."""
    if precision is not None:
        return precision
    return "fp64" if all_float64 else "fp32"


def coarsest(names: Iterable[str]) -> str:
    """The coarsest of several precisions (what a merged state's products were)."""
    return max((precision_mode(n) for n in names), key=lambda m: m.coarseness).name


@dataclass(frozen=True)
class Field:
    """One array of the state.

    axes: its shape in terms of the widths p, c, t, k (a width of -1 counts 0).
    shift: for a co-moment, the two means whose shifts enter the merge
        (``X + n d_a d_b^T``); None for a mean or a plain sum.
    """

    name: str
    axes: Tuple[str, ...]
    dtype: type = np.float64
    symmetric: bool = False
    shift: Optional[Tuple[str, str]] = None
    is_mean: bool = False



FIELDS: Tuple[Field, ...] = (
    Field("mean", ("p",), is_mean=True),
    Field("M", ("p", "p"), symmetric=True, shift=("mean", "mean")),
    Field("out_mean", ("c",), is_mean=True),
    Field("B", ("p", "c"), shift=("mean", "out_mean")),
    Field("A", ("c", "c"), symmetric=True, shift=("out_mean", "out_mean")),
    Field("tgt_mean", ("t",), is_mean=True),
    Field("Bt", ("p", "t"), shift=("mean", "tgt_mean")),
    Field("At", ("t", "t"), symmetric=True, shift=("tgt_mean", "tgt_mean")),
    Field("class_counts", ("k",), dtype=np.int64),
    Field("class_sums", ("k", "p")),
)
WIDTHS: Tuple[str, ...] = ("n", "p", "c", "t", "k", "num_classes")
SCALARS: Tuple[str, ...] = WIDTHS + ("precision",)
FIELD_NAMES: Tuple[str, ...] = tuple(f.name for f in FIELDS)
FLOAT_FIELDS: Tuple[str, ...] = tuple(f.name for f in FIELDS if f.dtype == np.float64)
INT_FIELDS: Tuple[str, ...] = tuple(f.name for f in FIELDS if f.dtype == np.int64)


def shape_of(field: Field, widths: Dict[str, int]) -> Tuple[int, ...]:
    return tuple(max(int(widths[a]), 0) for a in field.axes)


# The largest Moments(groups=k). Each group is a whole state (its p x p Gram
# alone is 8 p^2 bytes: 2 MiB at p = 512, so 1024 groups fill 2 GiB), and the
# jackknife's standard error gains little past a few dozen groups; a larger
# k is a typo or a unit mistake, refused before anything is allocated.
MAX_GROUPS = 1024

# The entry of a Moments(groups=k) state dict that holds its groups (beside
# the state of all its samples, which every other reader of a state dict reads):
#   {"states": [k state dicts], "next": the group the next update or merge goes
#    to, "seed": the group_seed (an int) or None, "rng": None for groups in
#    turn, else the state of the random generator that draws the groups}.
GROUPS = "groups"
GROUP_KEYS: Tuple[str, ...] = ("states", "next", "seed", "rng")


def group_count(entry: object) -> int:
    """The number of groups a ``groups`` entry holds (ValueError if it is not
    a dict of ``GROUP_KEYS`` with a list of 2 to ``MAX_GROUPS`` states)."""
    if not isinstance(entry, dict):
        raise TypeError(f"state entry {GROUPS!r} must be a dict, got {type(entry).__name__}")
    if sorted(entry) != sorted(GROUP_KEYS):
        raise ValueError(f"state entry {GROUPS!r} must have the keys {', '.join(GROUP_KEYS)}; it has "
                         f"{', '.join(sorted(map(str, entry)))}")
    states = entry["states"]
    if not isinstance(states, (list, tuple)) or not 2 <= len(states) <= MAX_GROUPS:
        raise ValueError(f"state entry {GROUPS!r} must hold a list of 2 to {MAX_GROUPS} group states, got "
                         f"{len(states) if isinstance(states, (list, tuple)) else type(states).__name__}")
    return len(states)


def check_rng_state(rng: object) -> None:
    """Raise unless ``rng`` is a state of numpy's default generator (PCG64)."""
    try:
        np.random.default_rng().bit_generator.state = rng  # type: ignore[assignment]  # checked by the setter
    except (TypeError, ValueError, KeyError, OverflowError) as e:
        raise ValueError(f"state entry {GROUPS!r}: 'rng' is not the state of numpy's default random "
                         f"generator ({type(e).__name__}: {e})") from None


def checked_groups(entry: object, whole: dict, *, gram: bool = True) -> dict:
    """The ``groups`` entry of a Moments(groups=k) state dict, validated (each
    group as ``checked``) against ``whole``, the state of all its samples
    (``checked`` already): the groups hold the same widths, the same fixed
    num_classes and, between them, ``n`` samples. That their merge equals the
    whole is checked where they are merged (``check_groups_add_up``)."""
    k = group_count(entry)
    assert isinstance(entry, dict)
    states = []
    for i, st in enumerate(entry["states"]):
        try:
            states.append(checked(st, gram=gram))
        except (TypeError, ValueError) as e:
            raise type(e)(f"group {i} of {k}: {e}") from None
    metas = [widths_of(s) for s in states]
    check_compatible(metas + [widths_of(whole)])
    nc = {m["num_classes"] for m in metas}
    if nc != {whole["num_classes"]}:
        raise ValueError(f"the groups fix num_classes {sorted(nc)}, the whole state {whole['num_classes']}")
    total = sum(m["n"] for m in metas)
    if total != whole["n"]:
        raise ValueError(f"the groups hold {total} samples between them, the whole state n={whole['n']}")
    nxt = check_int(entry["next"], f"state entry {GROUPS!r}: 'next'", low=0, high=k - 1,
                    what=f"a group index in [0, {k})")
    seed = check_int(entry["seed"], f"state entry {GROUPS!r}: 'seed'", low=0, allow_none=True,
                     what="None or a non-negative integer")
    rng = entry["rng"]
    if rng is not None:
        check_rng_state(rng)
    return {"states": states, "next": nxt, "seed": seed, "rng": rng}


def check_groups_add_up(whole: dict, merged: dict) -> None:
    """Raise unless ``merged`` (the merge of a state dict's groups) is its
    ``whole`` state: the same widths and precision, equal class counts, and
    every float within ``INVARIANT_RTOL`` of the field's magnitude (the two
    are merges of the same groups; a whole edited apart from its groups, or
    groups apart from their whole, is refused)."""
    w, m = widths_of(whole), widths_of(merged)
    if w != m or whole["precision"] != merged["precision"]:
        raise ValueError(f"the groups merge to widths {m} in {merged['precision']}, but the whole state has "
                         f"{w} in {whole['precision']}: they do not belong together")
    for f in FIELDS:
        a, b = np.asarray(whole[f.name]), np.asarray(merged[f.name])
        if f.dtype == np.int64:
            same = np.array_equal(a, b)
        else:
            scale = max(float(np.abs(a).max(initial=0.0)), float(np.abs(b).max(initial=0.0)))
            same = bool(np.all(np.abs(a - b) <= INVARIANT_RTOL * scale))
        if not same:
            raise ValueError(f"state entry {f.name!r} is not the merge of the state's groups: the whole and "
                             "its groups do not belong together")


def empty(num_classes: Optional[int] = None) -> dict:
    """The state of a Moments that has seen nothing."""
    st: dict = {"n": 0, "p": -1, "c": -1, "t": -1, "k": -1,
          "num_classes": -1 if num_classes is None else int(num_classes), "precision": "fp64"}
    for f in FIELDS:
        st[f.name] = np.zeros(shape_of(f, st), dtype=f.dtype)
    return st


INT64_MAX = 2**63 - 1


def check_num_classes(num_classes: object) -> Optional[int]:
    """``num_classes`` as an int (None stays None), or a ValueError naming
    the range it must be in: an integer from 1 to 2**63 - 1 (in a state dict,
    -1 stands for None)."""
    return check_int(num_classes, "num_classes", low=1, high=INT64_MAX, allow_none=True,
                     what="an integer from 1 to 2**63 - 1 (or None)")


def _as_int(key: str, v: object) -> int:
    """An integer entry as a Python int (any numpy integer type, signed or
    not); TypeError for non-integers, ValueError beyond int64."""
    if not is_int(v):
        raise TypeError(f"state entry {key!r} must be an integer, got {type(v).__name__}")
    v = int(v)
    if not -INT64_MAX - 1 <= v <= INT64_MAX:
        raise ValueError(f"state entry {key!r} is {v}, outside int64")
    return v


def widths_of(state: dict) -> Dict[str, int]:
    """The integer widths of ``state`` as Python ints, type- and range-checked
    (TypeError for non-integers, ValueError outside int64)."""
    return {key: _as_int(key, state[key]) for key in WIDTHS}


def validate(state: dict) -> Dict[str, int]:
    """Check a state dict before anything reads it; returns its widths.

    The one validator of states that come from outside a ``Moments`` (load,
    ``load_state_dict``, the many-state and distributed merges): every entry
    present, integer widths, a known precision, every array of the shape its
    widths give, finite floats, and what every state built by updates and
    merges satisfies (``check_invariants``). A field the state lacks (a
    state written before the field existed) is refused by name."""
    checked(state)
    return widths_of(state)


def checked(state: dict, *, gram: bool = True) -> dict:
    """``state`` validated (see ``validate``), as a new dict with Python-int
    widths and C-contiguous float64 / int64 arrays: what the core imports.

    ``gram=False`` leaves out only the semi-definiteness factorisations
    (``check_gram``, O((p + c)^3): 0.06 s at p = 1024 with 1,000 classes),
    keeping every O(p^2) check. It is for a state this library has just
    exported from an accumulator of its own and passes between its own steps
    (``Moments._load_own_state_dict``): updates and merges build
    semi-definite co-moments, so the factorisation cannot fail there. A saved
    file, a user's state dict and a collective's gathered states get the
    full check."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    missing = [k for k in SCALARS + FIELD_NAMES if k not in state]
    if missing:
        raise ValueError(f"state is missing entries: {', '.join(missing)}")
    extra = sorted(str(k) for k in state if k not in SCALARS + FIELD_NAMES)
    if extra == [GROUPS]:
        raise ValueError(f"state has a {GROUPS!r} entry: it is the state dict of a Moments(groups=k), which only "
                         "Moments.load_state_dict reads (drop the entry for the state of all its samples)")
    if extra:
        raise ValueError(f"state has unknown entries: {', '.join(extra)}")
    w = widths_of(state)
    if not isinstance(state["precision"], str):
        raise TypeError(f"state entry 'precision' must be a string, got {type(state['precision']).__name__}")
    precision_mode(state["precision"], PRECISION_ENTRY)
    if w["n"] < 0:
        raise ValueError(f"state's sample count n is negative ({w['n']})")
    out: dict = dict(w, precision=str(state["precision"]))
    for f in FIELDS:
        want = shape_of(f, w)
        raw = state[f.name]
        got = np.shape(raw)
        if got != want:
            raise ValueError(f"state entry {f.name!r} has shape {got}, expected {want}")
        a = np.asarray(raw)
        if f.dtype == np.int64:
            out[f.name] = _int_array(f.name, a)
            continue
        if a.size and (a.dtype.kind not in "fiu"):
            raise TypeError(f"state entry {f.name!r} must hold real numbers, got dtype {a.dtype}")
        a = np.ascontiguousarray(a, dtype=np.float64)
        if not np.isfinite(a).all():
            raise ValueError(f"state entry {f.name!r} contains NaN or Inf")
        out[f.name] = a
    check_invariants(out, gram=gram)
    return out


def _int_array(name: str, a: np.ndarray) -> np.ndarray:
    """An array of counts as int64: integers only, none negative or beyond int64."""
    if a.size == 0:
        return np.zeros(a.shape, dtype=np.int64)
    if a.dtype.kind not in "iu":
        raise TypeError(f"state entry {name!r} must hold integers, got dtype {a.dtype}")
    if a.dtype.kind == "i" and (a < 0).any():
        raise ValueError(f"state entry {name!r} has a negative count ({int(a.min())})")
    if a.dtype.kind == "u" and a.dtype.itemsize >= 8 and (a > INT64_MAX).any():
        raise ValueError(f"state entry {name!r} has a count beyond 2**63 - 1 ({int(a.max())})")
    return np.ascontiguousarray(a, dtype=np.int64)


# Relative slack of the float64 identities below: their two sides are sums of
# the same numbers taken in different orders (raw class sums against Chan's
# merged mean), so they agree to a few ulps per merge; 1e-9 of the magnitudes
# involved leaves room for 10^6 merges and still catches any tampered value
# that matters.
INVARIANT_RTOL = 1e-9


def check_invariants(st: dict, *, gram: bool = True) -> None:
    """What every state built by updates and merges satisfies, checked on a
    validated ``st`` (widths as ints, arrays float64 / int64), in every
    product precision (docs/MATH.md, "Streaming estimator"):

    * the widths: a nonempty state has features; streams are -1 or >= 1;
      no more classes than a fixed ``num_classes``;
    * a state of no samples holds only zeros;
    * the class counts add up to ``n`` exactly (each sample has one class),
      and a class of no samples has a zero sum;
    * the class sums add up to ``n`` times the mean (float64 sums of the same
      inputs: within ``INVARIANT_RTOL`` of their magnitudes);
    * each Gram (M, A, At) is symmetric and has no negative diagonal entry:
      its diagonal is a sum of squares in every precision and each merge
      adds squares, so a negative variance is impossible, not rounding;
    * M, the joint Grams of features with outputs and with targets, and the
      within-class scatter are positive semi-definite within rounding
      (``check_gram``; left out with ``gram=False``, see ``checked``).
    """
    n, p, k = st["n"], st["p"], st["k"]
    for key in ("c", "t"):
        if st[key] == 0 or st[key] < -1:
            raise ValueError(f"state entry {key!r} is {st[key]}: a width is -1 (not streamed) or >= 1")
    if p == 0 or p < -1 or k < -1 or st["num_classes"] == 0 or st["num_classes"] < -1:
        raise ValueError(f"state widths p={p}, k={k}, num_classes={st['num_classes']}: p and num_classes are -1 "
                         "(not yet known, not fixed) or >= 1, k is -1 (no labels) or >= 0")
    if n > 0 and p < 1:
        raise ValueError(f"state has n={n} samples but no feature width (p={p})")
    if st["num_classes"] >= 0 and k > st["num_classes"]:
        raise ValueError(f"state has more classes than num_classes ({k} > {st['num_classes']})")
    if n == 0:
        held = [f.name for f in FIELDS if np.any(st[f.name] != 0)]
        if held:
            raise ValueError(f"state has n=0 samples but nonzero {', '.join(held)}")
    if k >= 0:
        counts = st["class_counts"]
        total = int(counts.astype(object).sum())  # Python ints: no wraparound
        if total != n:
            raise ValueError(f"class counts do not add up to n: they sum to {total}, n is {n}")
        sums = st["class_sums"]
        empty_classes = (counts == 0) & np.any(sums != 0, axis=1)
        if empty_classes.any():
            raise ValueError(f"state's class {int(np.argmax(empty_classes))} has no samples but a nonzero class sum")
        mean = st["mean"]
        with np.errstate(over="ignore"):
            gap = np.abs(sums.sum(axis=0) - n * mean)
            scale = np.abs(sums).sum(axis=0) + n * np.abs(mean) + np.sqrt(n * np.maximum(np.diag(st["M"]), 0))
        bad = ~(gap <= INVARIANT_RTOL * scale)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(f"state's class sums add up to {sums[:, j].sum():.17g} in feature {j}, but n times "
                             f"the mean is {n * mean[j]:.17g}: class_sums and mean do not belong together")
    for f in FIELDS:
        if not f.symmetric or st[f.name].size == 0:
            continue
        a = st[f.name]
        d = np.diag(a)
        scale = np.abs(d).max()
        if (d < -INVARIANT_RTOL * scale).any():
            j = int(np.argmin(d))
            raise ValueError(f"state entry {f.name!r} has the negative variance {d[j]:.6g} on its diagonal "
                             f"(entry {j}): a Gram matrix's diagonal is a sum of squares")
        asym = np.abs(a - a.T).max()
        if asym > INVARIANT_RTOL * max(np.abs(a).max(), np.finfo(float).tiny):
            raise ValueError(f"state entry {f.name!r} is not symmetric (largest |{f.name} - {f.name}^T| is "
                             f"{asym:.3g})")
    if n > 0 and gram:
        check_gram(st)


def _semidefinite(G: np.ndarray, diag: np.ndarray, mean: np.ndarray, n: int, tol: float) -> bool:
    """Whether the symmetric ``G`` is positive semi-definite within ``tol``
    relative to the variances ``diag`` (G's own diagonal, or the one it is a
    part of): a Cholesky factor of D^-1/2 G D^-1/2 + tol I exists. Variances
    count from the rounding level that centering on a float64 ``mean`` of n
    values leaves (32 sqrt(n) eps |mean| a sample, as for constant features),
    that level being added to the diagonal as slack: a constant feature's
    rounding passes; a zero variance with a larger covariance fails
    (Cauchy-Schwarz)."""
    top = float(diag.max()) if diag.size else 0.0
    level = n * (32.0 * np.sqrt(n) * np.finfo(np.float64).eps * np.abs(mean)) ** 2
    floor = np.maximum(level, max(top, float(level.max(initial=0.0))) * 1e-300)
    if not floor.max(initial=0.0) > 0.0:
        return not np.any(G)
    inv = 1.0 / np.sqrt(np.maximum(diag, floor))
    C = (G + np.diag(level)) * inv[:, None] * inv[None, :]
    try:
        np.linalg.cholesky((C + C.T) / 2 + tol * np.eye(C.shape[0]))
    except np.linalg.LinAlgError:
        return False
    return True


def check_gram(st: dict) -> None:
    """The co-moments are those of real samples: the joint Grams
    [[M, B], [B^T, A]] and [[M, Bt], [Bt^T, At]] and the within-class scatter
    M - sum_k n_k (m_k - mu)(m_k - mu)^T are positive semi-definite within
    the rounding of the state's product precision (10 times its eigenvalue
    cut, relative to the variances), and so is M (implied by any of them):
    no cross-moment beyond Cauchy-Schwarz with its Grams, no class mean
    farther from the mean than the samples allow. One Cholesky factor per
    stream, O((p + c)^3); M alone is factored only without streams, or to
    name the culprit once a check failed."""
    tol = 10.0 * precision_mode(st["precision"]).rtol
    M, mu, n = st["M"], st["mean"], int(st["n"])
    dM = np.diag(M)
    checks = []
    for cross, gram, means, what in (("B", "A", "out_mean", "outputs"), ("Bt", "At", "tgt_mean", "targets")):
        if st[gram].size:
            J = np.block([[M, st[cross]], [st[cross].T, st[gram]]])
            checks.append((J, np.diag(J), np.concatenate([mu, st[means]]), (
                f"state entries 'M', {cross!r} and {gram!r} do not belong together: the joint Gram [[M, {cross}], "
                f"[{cross}^T, {gram}]] has a negative eigenvalue beyond rounding (the cross-moment of the features "
                f"and {what} exceeds what M and {gram} allow)")))
    counts = st["class_counts"]
    present = counts > 0
    if present.any():
        c = counts[present].astype(np.float64)
        D = st["class_sums"][present] / c[:, None] - mu[None, :]
        checks.append((M - (D.T * c) @ D, dM, mu, (
            "state entries 'class_sums', 'class_counts' and 'M' do not belong together: the within-class scatter "
            "M - sum_k n_k (m_k - mu)(m_k - mu)^T has a negative eigenvalue beyond rounding (class means farther "
            "from the mean than the samples allow)")))
    failed = next((msg for G, d, m, msg in checks if not _semidefinite(G, d, m, n, tol)), None)
    if (failed is not None or not checks) and not _semidefinite(M, dM, mu, n, tol):
        failed = ("state entry 'M' is not positive semi-definite (it has a negative eigenvalue beyond rounding): it "
                  "is not the second moment of any samples")
    if failed is not None:
        raise ValueError(failed)


# -- many-state merge ----------------------------------------------------------


def check_compatible(metas: List[Dict[str, int]]) -> None:
    """Raise the same ValueError for every caller when states of widths
    ``metas`` (dicts of WIDTHS) cannot merge: the one merge rule of richness
    (``Moments.merge``, the many-state and distributed merges, ``richness
    merge``, ``richness.dask``), which lives in the compiled core
    (``Moments::check_compatible_for_merge``, csrc/common/moments.hpp) and is
    asked there by every merge the backends run. States that fix num_classes
    must fix the same one; empty states merge with anything else; the merged
    sample count fits int64."""
    from ._native import _core

    _core.check_compatible_for_merge([{key: int(m[key]) for key in WIDTHS} for m in metas])


def merged_widths(metas: List[Dict[str, int]]) -> Dict[str, int]:
    """Widths of the shift-and-sum merge of compatible states (check_compatible
    first). Its sums are float64, class counts included: counts past 2**53
    would lose exactness there, so such a merge is refused (ValueError)."""
    live = [m for m in metas if m["n"] > 0]
    nc = max(m["num_classes"] for m in metas)
    if not live:
        return {"n": 0, "p": -1, "c": -1, "t": -1, "k": -1, "num_classes": nc}
    first = live[0]
    k = max(max(m["k"] for m in live), nc) if first["k"] >= 0 else -1
    n = sum(m["n"] for m in live)
    if k >= 0 and n > 2**53:
        raise ValueError(f"cannot merge: {n} labelled samples, past 2**53, where the float64 sums of this merge "
                         "no longer count exactly")
    return {"n": n, "p": first["p"], "c": first["c"], "t": first["t"], "k": k, "num_classes": nc}


def weighted_means(state: dict, widths: Dict[str, int]) -> np.ndarray:
    """``n`` times each mean, concatenated (the global means are their sum / N)."""
    n = int(state["n"])
    parts = []
    for f in FIELDS:
        if f.is_mean:
            size = shape_of(f, widths)
            parts.append(np.asarray(state[f.name], np.float64).reshape(size) * n if n > 0 else np.zeros(size))
    return np.concatenate(parts)


def split_means(flat: np.ndarray, widths: Dict[str, int]) -> Dict[str, np.ndarray]:
    out, pos = {}, 0
    for f in FIELDS:
        if f.is_mean:
            size = int(np.prod(shape_of(f, widths)))
            out[f.name] = np.array(flat[pos:pos + size], dtype=np.float64)
            pos += size
    return out


def shifted_sums(state: dict, means: Dict[str, np.ndarray], widths: Dict[str, int]) -> np.ndarray:
    """One state's summands of the merge, flattened: each co-moment shifted to
    the global ``means`` (``X + n d_a d_b^T``), class arrays padded to the
    merged class count. Summing these over states gives the merged fields."""
    n = int(state["n"])
    d = {}
    for name, g in means.items():
        d[name] = (np.asarray(state[name], np.float64).reshape(g.shape) - g) if n > 0 else np.zeros(g.shape)
    parts = []
    for f in FIELDS:
        if f.is_mean:
            continue
        shape = shape_of(f, widths)
        a = np.zeros(shape)
        if n > 0:
            own = np.asarray(state[f.name], np.float64)
            a[tuple(slice(0, s) for s in own.shape)] = own  # class arrays may be shorter
            if f.shift is not None:
                a += n * np.outer(d[f.shift[0]], d[f.shift[1]])
        parts.append(a.reshape(-1))
    return np.concatenate(parts)


def assemble(flat: np.ndarray, means: Dict[str, np.ndarray], widths: Dict[str, int], precision: str) -> dict:
    """The merged state from the summed ``shifted_sums`` and the global means."""
    st: dict = dict(widths)
    st["precision"] = precision
    pos = 0
    for f in FIELDS:
        shape = shape_of(f, widths)
        if f.is_mean:
            st[f.name] = means[f.name].reshape(shape)
            continue
        size = int(np.prod(shape))
        a = np.asarray(flat[pos:pos + size], dtype=np.float64).reshape(shape)
        pos += size
        if f.dtype == np.int64:
            a = np.rint(a).astype(np.int64)  # counts are exact in float64 below 2^53
        elif f.symmetric:
            a = (a + a.T) / 2  # symmetric up to the rounding of the outer products
        st[f.name] = a
    return st


def merge(states: List[dict]) -> dict:
    """The merge of several state dicts (numpy, float64), in one shift-and-sum.
    Each is validated first (``validate``)."""
    states = [checked(s) for s in states]
    metas = [widths_of(s) for s in states]
    check_compatible(metas)
    w = merged_widths(metas)
    live = [s for s, m in zip(states, metas) if m["n"] > 0]
    if not live:
        out = empty(None if w["num_classes"] < 0 else w["num_classes"])
        return out
    with np.errstate(over="ignore", invalid="ignore"):
        means = split_means(np.asarray(sum(weighted_means(s, w) for s in live) / w["n"]), w)
        flat = np.asarray(sum(shifted_sums(s, means, w) for s in live))
    check_finite(flat, means)
    return assemble(flat, means, w, coarsest(s["precision"] for s in live))


def check_finite(flat: np.ndarray, means: Dict[str, np.ndarray]) -> None:
    """Raise when a merge overflowed float64 (the states are finite, so only
    the sums and the mean shifts can be): nothing is kept."""
    if np.isfinite(flat).all() and all(np.isfinite(m).all() for m in means.values()):
        return
    finite = [np.abs(a[np.isfinite(a)]).max(initial=0.0) for a in (flat, *means.values())]
    raise ValueError(f"cannot merge: the merged co-moments overflow float64 (largest finite magnitude "
                     f"{max(finite):.3g}); rescale the features or outputs")
