"""The similarity measures by name (docs/MATH.md, "Linear CKA, exact and
streamed" and "The similarity family"): which state each is finished from,
whether its matrix is symmetric, its range and whether 0 means identical, and
``exact_matrices``, which finishes the asked ones from a ``Similarity``'s
joint state (each module of this package computes its own: ``cka``, ``cca``,
``shape``, ``linreg``). The minibatch CKA is finished from its own k x k sums
(``cka.cka_minibatch_matrix``).

Every name here is a field of ``SimilarityReport``, an entry of
``Similarity.compute(measures=...)``, ``richness cka --measures`` and
``plot.similarity(measure=...)``; a new measure is one line of ``MEASURES`` and
its branch in ``exact_matrices``.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, NamedTuple, Sequence, Tuple

import numpy as np

from .cca import CCA_MEASURES, cca_matrices
from .cka import cka_matrices
from .linreg import linreg_matrix
from .shape import SHAPE_MEASURES, shape_matrices

__all__ = ["Measure", "MEASURES", "EXACT", "MINIBATCH", "exact_matrices", "check_measures"]


class Measure(NamedTuple):
    """A similarity measure: its ``name``; its ``title`` (tables, plots);
    ``state``, ``"exact"`` (the joint co-moments) or ``"minibatch"`` (the
    per-batch HSIC sums); ``symmetric``; the range ``lo``..``hi`` of its values
    (the colour scale of a heatmap); ``distance``: True when 0 means identical
    representations and larger values mean less alike."""

    name: str
    title: str
    state: str
    symmetric: bool
    lo: float
    hi: float
    distance: bool = False


MEASURES: Dict[str, Measure] = {m.name: m for m in (
    Measure("cka", "linear CKA (biased)", "exact", True, 0.0, 1.0),
    Measure("cka_debiased", "debiased linear CKA (unbiased HSIC)", "exact", True, 0.0, 1.0),
    Measure("cka_minibatch", "minibatch linear CKA (unbiased HSIC summed over batches)", "minibatch", True, 0.0, 1.0),
    Measure("cca_r2", "mean squared canonical correlation (R2 CCA)", "exact", True, 0.0, 1.0),
    Measure("cca_rho", "mean canonical correlation", "exact", True, 0.0, 1.0),
    Measure("svcca", "SVCCA (mean canonical correlation, 99% principal subspaces)", "exact", True, 0.0, 1.0),
    Measure("pwcca", "PWCCA (projection-weighted canonical correlation)", "exact", True, 0.0, 1.0),
    Measure("procrustes", "orthogonal Procrustes distance", "exact", True, 0.0, 2.0, distance=True),
    Measure("shape_angular", "angular shape metric (radians)", "exact", True, 0.0, math.pi / 2, distance=True),
    Measure("linreg_r2", "linear regression R2 (row predicts column)", "exact", False, 0.0, 1.0),
)}
EXACT = tuple(m.name for m in MEASURES.values() if m.state == "exact")
MINIBATCH = tuple(m.name for m in MEASURES.values() if m.state == "minibatch")


def check_measures(measures: Iterable[str], held: Sequence[str], estimator: str) -> List[str]:
    """``measures`` as a list of known names without repeats, each finished
    from a state the Similarity holds (``held``: ``"exact"``, ``"minibatch"``);
    ValueError naming an unknown measure, or one whose state is not held and
    the estimator that keeps it."""
    if isinstance(measures, str):
        measures = [measures]
    out: List[str] = []
    for name in measures:
        if not isinstance(name, str) or name not in MEASURES:
            raise ValueError(f"unknown similarity measure {name!r}; expected some of {list(MEASURES)}")
        state = MEASURES[name].state
        if state not in held:
            keeps = "'minibatch' or 'both'" if state == "minibatch" else "'exact' or 'both'"
            raise ValueError(f"{name} needs the {state} state, which a Similarity(estimator={estimator!r}) does not "
                             f"keep: use estimator={keeps}")
        if name not in out:
            out.append(name)
    return out


def exact_matrices(mean: np.ndarray, M: np.ndarray, n: int, names: Sequence[str], widths: Sequence[int],
                   shift: np.ndarray, scale: np.ndarray, measures: Sequence[str], *, rtol: float,
                   keep: float = 0.99, ridge: float = 0.0) -> Tuple[Dict[str, np.ndarray], List[str]]:
    """The k x k matrices of the exact ``measures`` (names of ``EXACT``) from a
    joint state of ``n`` samples, and what is undefined or degenerate in them,
    one line each (the caller warns). ``rtol``: the rank cut of the CCA
    measures and the regression; ``keep``: SVCCA's share of variance;
    ``ridge``: the regression's ridge (``linreg.linreg_matrix``)."""
    asked = set(measures)
    out: Dict[str, np.ndarray] = {}
    notes: List[str] = []
    if asked & {"cka", "cka_debiased"}:
        biased, debiased, more = cka_matrices(mean, M, n, names, widths, shift, scale)
        out.update((k, v) for k, v in (("cka", biased), ("cka_debiased", debiased)) if k in asked)
        notes += [x for x in more if "cka_debiased" in asked or not x.startswith("debiased")]
    cca = [m for m in CCA_MEASURES if m in asked]
    if cca:
        mats, more = cca_matrices(M, n, names, widths, which=cca, rtol=rtol, keep=keep)
        out.update(mats)
        notes += more
    shape = [m for m in SHAPE_MEASURES if m in asked]
    if shape:
        mats, more = shape_matrices(M, n, names, widths, which=shape)
        out.update(mats)
        notes += more
    if "linreg_r2" in asked:
        out["linreg_r2"], more = linreg_matrix(M, n, names, widths, rtol=rtol, ridge=ridge)
        notes += more
    return {m: out[m] for m in measures if m in out}, notes
