"""Representation diagnostics from the same state: RankMe, alpha-ReQ, the
participation ratio, NC2 (equinorm, equiangle) and NC3 (docs/MATH.md,
representation diagnostics).

The spectral measures are functions of the eigenvalues of M (or, per batch, of
the n x n Gram, which has the same nonzero spectrum): O(p) once the spectrum
is known. NC2 needs the K x K Gram of the centered class means, NC3 the head
as well. Every function takes numpy arrays or torch tensors (``_xp.ns``); the
spectral and NC2 ones batch stacked states over leading axes and give NaN
where a value is undefined, which the callers turn into None and a warning.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import numpy as np

from ._xp import f64, kept, norm, ns

SPECTRAL = ("rankme", "alpha_req", "participation_ratio")
CLASS_MEANS = ("nc2_equinorm", "nc2_equiangle", "nc3")
MEASURES = SPECTRAL + CLASS_MEANS


def check_measures(measures: Any) -> Optional[tuple]:
    """``measures`` as a tuple of names (``"all"`` for every one), None for
    the default; ValueError naming what is not a measure."""
    if measures is None:
        return None
    if isinstance(measures, str):
        measures = MEASURES if measures == "all" else (measures,)
    if not isinstance(measures, Iterable):
        raise TypeError(f"measures must be None, 'all' or names from {MEASURES}, got {type(measures).__name__}")
    out = tuple(measures)
    bad = [m for m in out if m not in MEASURES]
    if bad:
        raise ValueError(f"unknown measures {bad}: choose from {MEASURES} (or 'all')")
    return out


def entropy_rank(w):
    """exp(-sum_k q_k log q_k), q_k = w_k / sum w over the last axis (w >= 0;
    terms with q_k = 0 contribute 0). NaN where sum w = 0."""
    xp = ns(w)
    total = w.sum(axis=-1)
    safe = xp.where(total > 0.0, total, 1.0)
    q = w / safe[..., None]
    logq = xp.log(xp.where(q > 0.0, q, 1.0))
    value = xp.exp(-(q * logq).sum(axis=-1))
    return xp.where(total > 0.0, value, math.nan)


def spectral_values(lam, rtol: float) -> dict:
    """RankMe, alpha-ReQ (and its K), the participation ratio and the
    effective dimension from eigenvalues of M, descending and >= 0, over the
    last axis (leading axes: stacked states). Eigenvalues at or below the rank
    cut ``rtol * lam_1`` are the products' rounding and count as 0 in RankMe
    and the participation ratio (docs/MATH.md, representation diagnostics); the
    effective dimension keeps them, as ``Report.effective_dim`` always has.
    Everything is computed on ``lam / lam_1``: the measures are scale-free.
    Arrays, NaN where undefined: all of them for an all-zero spectrum, alpha
    with fewer than two eigenvalues above the cut."""
    xp = ns(lam)
    lam = f64(lam)
    top = lam[..., :1]
    rel = lam / xp.where(top > 0.0, top, 1.0)
    keep = kept(lam, rtol)
    kept_rel = xp.where(keep, rel, 0.0)
    rankme = entropy_rank(xp.sqrt(kept_rel))
    s1, s2 = kept_rel.sum(axis=-1), (kept_rel * kept_rel).sum(axis=-1)
    pr = xp.where(s2 > 0.0, s1 * s1 / xp.where(s2 > 0.0, s2, 1.0), math.nan)
    # least squares of log lam_k = c - alpha log k over k = 1..K (the kept ones: a prefix)
    K = f64(keep.sum(axis=-1))
    m = lam.shape[-1]
    x = xp.log(f64(xp.asarray(np.arange(1, m + 1)))) if xp is not np else np.log(np.arange(1.0, m + 1))
    w = f64(keep)
    y = xp.log(xp.where(keep, rel, 1.0))
    kk = xp.where(K > 0.0, K, 1.0)
    sx, sy = (w * x).sum(axis=-1), (w * y).sum(axis=-1)
    sxx, sxy = (w * x * x).sum(axis=-1), (w * x * y).sum(axis=-1)
    den = sxx - sx * sx / kk
    alpha = xp.where(K >= 2.0, -(sxy - sx * sy / kk) / xp.where(K >= 2.0, den, 1.0), math.nan)
    eff = entropy_rank(rel)
    return {"rankme": rankme, "alpha_req": alpha, "alpha_req_k": K, "participation_ratio": pr,
            "effective_dim": eff}


def nc2_from_grams(DDt, counts) -> tuple:
    """(equinorm, equiangle) from the K x K Gram D D^T of the centered class
    means (rows of absent classes 0) and the class counts, over the classes
    present (counts > 0); leading axes batch stacked states. NaN where fewer
    than two classes are present or a present class mean is 0 (docs/MATH.md,
    NC2)."""
    xp = ns(DDt)
    present = counts > 0
    C = f64(present.sum(axis=-1))
    d = xp.diagonal(DDt, 0, -2, -1)
    d = xp.where(present, xp.clip(d, 0.0, None), 0.0)
    norms = xp.sqrt(d)
    cc = xp.where(C > 0.0, C, 1.0)
    mean = norms.sum(axis=-1) / cc
    var = xp.where(present, (norms - mean[..., None]) ** 2, 0.0).sum(axis=-1) / cc
    nonzero = ~(present & (norms <= 0.0)).any(axis=-1)
    ok = (C >= 2.0) & nonzero & (mean > 0.0)
    equinorm = xp.where(ok, xp.sqrt(var) / xp.where(ok, mean, 1.0), math.nan)
    inv = xp.where(present & (norms > 0.0), 1.0 / xp.where(norms > 0.0, norms, 1.0), 0.0)
    cos = DDt * inv[..., :, None] * inv[..., None, :]
    pair = present[..., :, None] & present[..., None, :]
    off = xp.where(pair, xp.abs(cos + (1.0 / xp.where(C > 1.0, C - 1.0, 1.0))[..., None, None]), 0.0)
    diag = xp.where(present, xp.abs(1.0 + 1.0 / xp.where(C > 1.0, C - 1.0, 1.0)[..., None]), 0.0)
    pairs = xp.where(C >= 2.0, C * (C - 1.0), 1.0)
    equiangle = xp.where(ok, (off.sum(axis=(-2, -1)) - diag.sum(axis=-1)) / pairs, math.nan)
    return equinorm, equiangle


def class_means(st: dict) -> tuple:
    """(D, index of the classes present, counts): the globally centered class
    means of the classes with samples (C x p), as NC1 takes them."""
    counts = f64(st["class_counts"])
    present = counts > 0
    D = st["class_sums"][present] / counts[present, None] - st["mean"][None, :]
    return D, present, counts[present]


def nc3_value(D, present, W) -> tuple:
    """(NC3 or None, warning or None): || W / ||W||_F - U / ||U||_F ||_F^2 with
    U = D and W the head's rows of the classes present (docs/MATH.md, NC3)."""
    xp = ns(D)
    index = xp.nonzero(present)[0] if xp is np else xp.nonzero(present)[:, 0]
    if int(W.shape[0]) <= int(index.max()):
        return None, (f"NC3 not reported: the head has {int(W.shape[0])} rows but labels reach class "
                      f"{int(index.max())}")
    Wc = W[index]
    nu, nw = norm(D), norm(Wc)
    if not (nu > 0.0 and nw > 0.0):
        what = "the class means coincide" if not nu > 0.0 else "the head's rows of the classes present are 0"
        return None, f"NC3 undefined: {what}"
    Dd = D / nu - Wc / nw
    return float((Dd * Dd).sum()), None


def eigenvalues_of_state(st: dict, centered: bool = True, single: bool = False):
    """Eigenvalues of M (or of the uncentered M + n mu mu^T), descending,
    clipped at 0: the spectral measures need no eigenvectors. ``single``:
    solve in float32 on M divided by its largest diagonal entry (the
    measures are scale-free), for a state of float32 products, whose
    eigenvalues below 1e-5 lambda_1 are cut anyway: about 1.7x faster at
    p = 512 (docs/MATH.md, representation diagnostics)."""
    xp = ns(st["M"])
    S = st["M"] if centered else st["M"] + int(st["n"]) * xp.outer(st["mean"], st["mean"])
    if single:
        top = float(xp.diagonal(S).max())
        S = S / (top if top > 0.0 else 1.0)
        S = S.astype(np.float32) if xp is np else S.float()
    w = f64(xp.linalg.eigvalsh(S))
    return xp.clip(xp.flip(w, (-1,)), 0.0, None)


def _scalar(v) -> Optional[float]:
    v = float(v)
    return v if math.isfinite(v) else None


def spectral_report(lam, rtol: float, wanted: tuple = SPECTRAL) -> tuple:
    """(values, warnings) of the spectral measures from one state's
    eigenvalues: Python floats, None where undefined (with a warning)."""
    v = spectral_values(lam, rtol)
    out: dict = {name: _scalar(v[name]) for name in SPECTRAL}
    out["effective_dim"] = _scalar(v["effective_dim"])
    K = int(v["alpha_req_k"])
    out["alpha_req_range"] = (1, K) if out["alpha_req"] is not None else None
    warnings = []
    if out["rankme"] is None:
        warnings.append("RankMe, alpha-ReQ and the participation ratio undefined: the spectrum is all zero")
    elif out["alpha_req"] is None and "alpha_req" in wanted:
        warnings.append(f"alpha-ReQ undefined: {K} eigenvalue(s) above the rank cut (a fit needs two)")
    return out, warnings


def class_report(st: dict, W: Any, wanted: tuple) -> tuple:
    """(values, warnings) of the NC2 and NC3 measures in ``wanted`` from one
    state; None (with a warning) where undefined or without labels or a head."""
    out: dict = {name: None for name in CLASS_MEANS}
    warnings: list = []
    if int(st["k"]) <= 0 or not any(name in wanted for name in CLASS_MEANS):
        return out, warnings
    D, present, counts = class_means(st)
    C = int(D.shape[0])
    if C < 2:
        warnings.append(f"NC2 and NC3 undefined: {C} class(es) with samples (they compare two or more)")
        return out, warnings
    if "nc2_equinorm" in wanted or "nc2_equiangle" in wanted:
        equinorm, equiangle = nc2_from_grams(D @ D.T, counts)
        out["nc2_equinorm"], out["nc2_equiangle"] = _scalar(equinorm), _scalar(equiangle)
        if out["nc2_equinorm"] is None:
            warnings.append("NC2 undefined: a class mean equals the global mean")
        for name in ("nc2_equinorm", "nc2_equiangle"):
            if name not in wanted:
                out[name] = None
    if "nc3" in wanted and W is not None:
        out["nc3"], warning = nc3_value(D, present, W)
        warnings += [warning] if warning else []
    return out, warnings


def measure_values(st: dict, W: Any, rtol: float, wanted: tuple, lam: Any = None, centered: bool = True,
                   single: bool = False) -> tuple:
    """(values, warnings) of the measures in ``wanted`` from a state dict:
    ``lam`` the eigenvalues of M (descending; any positive multiple) when the
    spectrum was computed, else they are computed here when a spectral
    measure is wanted. Values are Python floats, None where not wanted or
    undefined; ``alpha_req_range`` is (1, K). ``single``: see
    ``eigenvalues_of_state``."""
    out: dict = {name: None for name in MEASURES}
    out["alpha_req_range"] = None
    warnings: list = []
    if any(name in wanted for name in SPECTRAL):
        spec, warns = spectral_report(eigenvalues_of_state(st, centered, single) if lam is None else lam, rtol,
                                      wanted)
        for name in SPECTRAL:
            if name in wanted:
                out[name] = spec[name]
        if "alpha_req" in wanted:
            out["alpha_req_range"] = spec["alpha_req_range"]
        out["effective_dim"] = spec["effective_dim"]  # free with the eigenvalues
        warnings += warns
    cls, warns = class_report(st, W, wanted)
    out.update(cls)
    return out, warnings + warns


def _listed(a) -> list:
    return [None if not math.isfinite(float(x)) else float(x) for x in a]


def measures_of_gram_rows(rows: Any, rtol: float, wanted: tuple) -> dict:
    """The representation diagnostics of each step of stacked per-batch
    states (``policy.GramRows``, float64, host): the spectral ones and the
    effective dimension from ``rows.eig`` (the n x n Gram's eigenvalues: the
    nonzero spectrum of M), NC2 from ``rows.DDt`` and ``rows.counts``. Lists,
    one entry a step, None where not wanted or undefined; NC3 needs the head's
    weights, which per-batch states do not carry (None)."""
    steps = int(rows.norm_m.shape[0])
    out: dict = {name: [None] * steps for name in MEASURES + ("effective_dim",)}
    if rows.eig is not None:
        v = spectral_values(rows.eig, rtol)
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
