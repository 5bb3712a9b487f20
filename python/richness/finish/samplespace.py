"""The finish of stacked one-batch states given as small Gram matrices
(docs/MATH.md, a single batch with fewer rows than features).

Why a sample-space form: a window of one batch of n rows with n < p features
has a p x p moment M = Xc^T Xc of rank at most n, costly to form and to
decompose every step, while its nonzero spectrum is that of the n x n Gram
G = Xc Xc^T, and DLR, NC1 and the spectral measures are functions of G and a
few C x C (or, with more outputs than samples, n x n) products of it
(``GramRows``). The route that reduces the batches (the Monitor's
``EveryStep``, the torchmetrics metric's batch value) forms those products on
its device; here they are finished, on a stack of steps at once, with the
feature-space formulas themselves: ``dlr.span_of_grams`` and
``dlr.dlr_values`` (DLR and the rank cut), ``nc1.nc1_from_grams``,
``diagnostics.spectral_values`` and ``nc2_from_grams`` (the representation
measures) and ``isotropic.normalized`` (the finite-sample reference). The
numbers are those of the feature-space form on the same batch.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from ._xp import ns
from .diagnostics import MEASURES, SPECTRAL, nc2_from_grams, spectral_values
from .dlr import dlr_values, span_of_grams
from .isotropic import normalized
from .nc1 import nc1_from_grams

__all__ = ["GramRows", "finish_gram_rows", "finish_steps", "measures_of_gram_rows"]


class GramRows(NamedTuple):
    """Stacked per-batch states as small float64 Gram matrices (leading axis:
    steps). With the centered features Xc (n x p), outputs Fc and class means
    D = Yn^T Xc: ``norm_m`` = ||Xc^T Xc||_F; ``A``, ``Q`` = Fc^T Fc,
    Fc^T G Fc (c = C), or Fc Fc^T, G in sample space (c = n); with labels
    (k class columns) ``counts``, ``DDt`` = D D^T, ``DMD`` = D M D^T and
    ``invalid`` (samples outside the classes); ``eig`` the eigenvalues of
    G (descending; the nonzero spectrum of M) when the representation
    diagnostics are asked for, ``eig_raw`` the min(n, p) largest of the
    uncentered Gram X X^T's (RankMe's). Without outputs (a features-only Monitor)
    ``A`` and ``Q`` are None (c = 0). ``pack`` lays them side by side in one
    (steps, m) array (one copy to the host), ``unpack`` reads them back by
    name."""

    norm_m: Any
    A: Any
    Q: Any
    counts: Any = None
    DDt: Any = None
    DMD: Any = None
    invalid: Any = None
    eig: Any = None
    eig_raw: Any = None

    @staticmethod
    def shapes(c: int, k: int, e: int = 0, r: int = 0) -> dict:
        """Each field's per-step shape, in packing order (labels only with k > 0,
        the ``e`` and ``r`` eigenvalues only when those are > 0)."""
        out = {"norm_m": (), "A": (c, c), "Q": (c, c)}
        if k:
            out.update(counts=(k,), DDt=(k, k), DMD=(k, k), invalid=())
        if e:
            out["eig"] = (e,)
        if r:
            out["eig_raw"] = (r,)
        return out

    def pack(self) -> Any:
        steps = self.norm_m.shape[0]
        parts = [v.reshape(steps, -1) for v in self if v is not None]
        xp = ns(parts[0])
        return xp.cat(parts, dim=1) if xp is not np else np.concatenate(parts, axis=1)

    @classmethod
    def unpack(cls, v: Any, c: int, k: int, e: int = 0, r: int = 0) -> "GramRows":
        steps, pos, fields = v.shape[0], 0, {}
        for name, shape in cls.shapes(c, k, e, r).items():
            size = int(np.prod(shape, dtype=np.int64))
            fields[name] = v[:, pos:pos + size].reshape((steps,) + shape)
            pos += size
        if pos != v.shape[1]:
            raise ValueError(f"packed rows have {v.shape[1]} columns, the layout for c={c}, k={k}, e={e}, r={r} "
                             f"has {pos}")
        return cls(**fields)


def finish_gram_rows(rows: GramRows, n: int, rtol: float, sample_space: bool) -> tuple:
    """DLR, rank and NC1 of each step of ``rows`` (float64, host), on the
    stacked matrices at once (no loop over steps): three lists, None where a
    value is undefined (constant features or outputs; fewer than two classes;
    labels outside the classes)."""
    steps = rows.norm_m.shape[0]
    # <G, P> over the kept eigenpairs (a_i, u_i) of A: ||B u_i||^2 / a_i = u_i^T Q u_i / a_i
    # (C-space), or u_i^T G u_i for eigenvectors of Fc Fc^T (sample space)
    a, terms = span_of_grams(rows.A, rows.Q, rtol, divide=not sample_space)
    dlr, rank = dlr_values(rows.norm_m, a, terms, rtol)
    ok = ~np.isnan(dlr)
    dlrs = [float(d) if good else None for d, good in zip(dlr, ok)]
    ranks = [int(r) if good else None for r, good in zip(rank, ok)]
    nc1s: list = [None] * steps
    if rows.counts is not None:
        value, defined = nc1_from_grams(rows.DDt, rows.DMD, rows.counts, n, rtol)
        nc1s = [float(x) if good else None for x, good in zip(value, defined & (rows.invalid == 0))]
    return dlrs, ranks, nc1s


def finish_steps(rows: GramRows, n: int, rtol: float, sample_space: bool, measures: tuple = (),
                 active: Any = None) -> tuple:
    """DLR, rank and NC1 of each step of ``rows`` (float64, host): three
    lists, None where a value is undefined (``finish_gram_rows``; all None
    without outputs, ``active`` None), and a dict of the representation
    diagnostics in ``measures`` (``measures_of_gram_rows``, with the
    effective dimension where ``rows.eig`` is given), lists by name.
    ``active``: each step's active features (with outputs); they add
    ``dlr_isotropic`` and ``dlr_normalized`` (``isotropic.normalized`` at the
    batch's n, its active features and the rank)."""
    steps = int(rows.norm_m.shape[0])
    extra = measures_of_gram_rows(rows, rtol, measures)
    if active is None:
        none = [None] * steps
        return none, none, none, extra
    dlrs, ranks, nc1s = finish_gram_rows(rows, n, rtol, sample_space)
    ref = [normalized(d, n, int(a), r) for d, a, r in zip(dlrs, active, ranks)]
    extra["dlr_isotropic"] = [iso for iso, _ in ref]
    extra["dlr_normalized"] = [norm for _, norm in ref]
    return dlrs, ranks, nc1s, extra


def _listed(a) -> list:
    return [None if not math.isfinite(float(x)) else float(x) for x in a]


def measures_of_gram_rows(rows: Any, rtol: float, wanted: tuple) -> dict:
    """The representation diagnostics of each step of stacked per-batch
    states (``GramRows``, float64, host): alpha-ReQ, the participation
    ratio and the effective dimension from ``rows.eig`` (the centered n x n
    Gram's eigenvalues: the nonzero spectrum of M), RankMe from
    ``rows.eig_raw`` (the uncentered Gram's, the min(n, p) largest), NC2 from
    ``rows.DDt`` and ``rows.counts``. Lists, one entry a step, None where not
    wanted or undefined; NC3 needs the head's weights, which per-batch states
    do not carry (None)."""
    steps = int(rows.norm_m.shape[0])
    out: dict = {name: [None] * steps for name in MEASURES + ("effective_dim",)}
    if rows.eig is not None:
        v = spectral_values(rows.eig, rtol, lam_u=getattr(rows, "eig_raw", None))
        for name in SPECTRAL + ("effective_dim",):
            if name in wanted or name == "effective_dim":
                out[name] = _listed(v[name])
    if rows.counts is not None and ("nc2_equinorm" in wanted or "nc2_equiangle" in wanted):
        equinorm, equiangle = nc2_from_grams(rows.DDt, rows.counts)
        bad = rows.invalid != 0
        for name, a in (("nc2_equinorm", equinorm), ("nc2_equiangle", equiangle)):
            if name in wanted:
                out[name] = [None if b else x for x, b in zip(_listed(a), bad)]
    return out
