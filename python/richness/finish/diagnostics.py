"""Representation diagnostics from the same state: RankMe, alpha-ReQ, the
participation ratio, NC2 (equinorm, equiangle), NC3 and LiDAR (docs/MATH.md,
representation diagnostics), each as published.

The spectral measures are functions of eigenvalues (per batch, of the n x n
Gram, which has the same nonzero spectrum): RankMe of the uncentered second
moment M + n mu mu^T (the embeddings as given: Garrido et al. 2023, eq. 1),
alpha-ReQ and the participation ratio of the centered M; O(p) once the
eigenvalues are known. NC2 needs the K x K Gram of the centered class means, NC3 the head
as well; LiDAR (``lidar.py``) the class sums with object ids as labels and a
p x p eigendecomposition of its own. Every function takes numpy arrays or torch tensors (``_xp.ns``); the
spectral and NC2 ones batch stacked states over leading axes and give NaN
where a value is undefined, which the callers turn into None and a warning.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, Optional

import numpy as np

from .._checks import is_int
from ._xp import eigh_desc, f64, kept, norm, ns
from .lidar import LIDAR_DELTA, check_delta, lidar_with_reason
from .nc1 import class_means
from .spectrum import RANKME_EPS, entropy_rank

__all__ = ["DEFAULT_MEASURES", "MEASURES", "SPECTRAL", "spectral_values"]

SPECTRAL = ("rankme", "alpha_req", "participation_ratio")
CLASS_MEANS = ("nc2_equinorm", "nc2_equiangle", "nc3")
# Measures with labels of their own meaning (LiDAR's are object ids, its augmentations sharing one) and
# a p x p eigendecomposition of their own: computed only where named (or with "all"), never by default.
OPT_IN = ("lidar",)
MEASURES = SPECTRAL + CLASS_MEANS + OPT_IN
# What compute() finishes with the spectrum when measures= is not given.
DEFAULT_MEASURES = tuple(m for m in MEASURES if m not in OPT_IN)

# alpha-ReQ's fit as the authors' code runs it (reptrix.alpha.get_powerlaw): k = 11..100, weights 1/k.
ALPHA_REQ_RANGE = (11, 100)
ALPHA_REQ_WEIGHTS = ("1/k", "uniform")
# Fewer eigenvalues than this in alpha-ReQ's range: the value comes with a warning.
ALPHA_REQ_FEW = 20
# alpha-ReQ fits the eigenvalues above this fraction of the rank cut (rtol lambda_1): a hundredth
# of it, above the products' rounding (fp32 products: about 2e-9 lambda_1 measured, against a cut
# of 1e-5), so that the real eigenvalues the rank cut drops still count.
ALPHA_REQ_FLOOR = 1e-2
NC_CONVENTIONS = ("paper", "papyan_script")
DEFAULT_OPTIONS: Dict[str, Any] = {"alpha_req_range": ALPHA_REQ_RANGE, "alpha_req_weights": "1/k",
                                   "nc_convention": "paper", "lidar_delta": LIDAR_DELTA}


def check_options(options: Any) -> dict:
    """``compute(measure_options=...)`` checked, the defaults filled in:
    ``alpha_req_range`` (first, last) 1-based eigenvalue indices, last None for
    all of them (default (11, 100)); ``alpha_req_weights`` ``"1/k"`` (default)
    or ``"uniform"``; ``nc_convention`` ``"paper"`` (default) or
    ``"papyan_script"`` (NC1-NC3 as the widely copied measurement script
    computes them; docs/MATH.md, representation diagnostics);
    ``lidar_delta`` the ridge added to LiDAR's within-object covariance, a
    number >= 0 in the features' squared units (default
    ``lidar.LIDAR_DELTA``). ValueError naming what is wrong."""
    if options is None:
        return dict(DEFAULT_OPTIONS)
    if not isinstance(options, dict):
        raise TypeError(f"measure_options must be a dict or None, got {type(options).__name__}")
    bad = [k for k in options if k not in DEFAULT_OPTIONS]
    if bad:
        raise ValueError(f"unknown measure_options {bad}: choose from {list(DEFAULT_OPTIONS)}")
    out = {**DEFAULT_OPTIONS, **options}
    rng = out["alpha_req_range"]
    ok = isinstance(rng, (tuple, list)) and len(rng) == 2 and all(
        v is None or is_int(v) for v in rng)
    if ok:
        first, last = rng
        ok = first is not None and first >= 1 and (last is None or last >= first + 1)
    if not ok:
        raise ValueError(f"alpha_req_range must be (first, last) with 1 <= first < last (last None: to the end), "
                         f"got {rng!r}")
    out["alpha_req_range"] = (int(rng[0]), None if rng[1] is None else int(rng[1]))
    if out["alpha_req_weights"] not in ALPHA_REQ_WEIGHTS:
        raise ValueError(f"alpha_req_weights must be one of {ALPHA_REQ_WEIGHTS}, got {out['alpha_req_weights']!r}")
    if out["nc_convention"] not in NC_CONVENTIONS:
        raise ValueError(f"nc_convention must be one of {NC_CONVENTIONS}, got {out['nc_convention']!r}")
    out["lidar_delta"] = check_delta(out["lidar_delta"])
    return out


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


def rankme_values(lam_u):
    """RankMe as published (Garrido et al. 2023, eq. 1): exp(-sum_k p_k log
    p_k), p_k = s_k / sum_j s_j + eps (eps = 1e-7, inside the log as well), s
    the singular values of the embeddings as given: ``lam_u`` the
    eigenvalues of the uncentered second moment M + n mu mu^T, descending,
    the min(n, p) of them over the last axis (any positive multiple; clipped
    at 0, no rank cut). NaN where they are all 0."""
    xp = ns(lam_u)
    lam = xp.clip(f64(lam_u), 0.0, None)
    top = lam[..., :1]
    return entropy_rank(xp.sqrt(lam / xp.where(top > 0.0, top, 1.0)), RANKME_EPS)


def alpha_req_fit(lam, rtol: float, first: int = ALPHA_REQ_RANGE[0], last: Optional[int] = ALPHA_REQ_RANGE[1],
                  weighted: bool = True) -> tuple:
    """alpha-ReQ as the authors' code fits it (reptrix.alpha.get_powerlaw):
    least squares of log lambda_k = c - alpha log k over k = first..last,
    weighted by 1/k (``weighted``), ``lam`` the centered eigenvalues,
    descending, over the last axis. The range is clipped to the eigenvalues
    present: above ``ALPHA_REQ_FLOOR * rtol * lambda_1`` (a hundredth of the
    rank cut; not the cut itself). Returns arrays (alpha, R^2, count, last
    k used): NaN where fewer than two are in range. R^2 is reptrix's
    (sklearn's r2_score: unweighted, of log lambda_k against the fitted line)
    over the fit's own k."""
    xp = ns(lam)
    lam = f64(lam)
    m = int(lam.shape[-1])
    top = lam[..., :1]
    rel = lam / xp.where(top > 0.0, top, 1.0)
    k = np.arange(1.0, m + 1)
    span = (k >= first) & (k <= (m if last is None else last))
    k_x = xp.asarray(k) if xp is not np else k
    inr = (rel > ALPHA_REQ_FLOOR * rtol) & (top > 0.0) & (xp.asarray(span) if xp is not np else span)
    w = f64(inr) / k_x if weighted else f64(inr)
    x = -xp.log(k_x)
    y = xp.log(xp.where(inr, rel, 1.0))
    count = f64(inr.sum(axis=-1))
    sw = w.sum(axis=-1)
    sw1 = xp.where(sw > 0.0, sw, 1.0)
    xw, yw = (w * x).sum(axis=-1) / sw1, (w * y).sum(axis=-1) / sw1
    dx, dy = x - xw[..., None], y - yw[..., None]
    sxx, sxy = (w * dx * dx).sum(axis=-1), (w * dx * dy).sum(axis=-1)
    ok = (count >= 2.0) & (sxx > 0.0)
    alpha = xp.where(ok, sxy / xp.where(ok, sxx, 1.0), math.nan)
    cnt1 = xp.where(count > 0.0, count, 1.0)
    ybar = xp.where(inr, y, 0.0).sum(axis=-1) / cnt1
    resid = xp.where(inr, dy - alpha[..., None] * dx, 0.0)
    ss_res = (resid * resid).sum(axis=-1)
    ss_tot = xp.where(inr, (y - ybar[..., None]) ** 2, 0.0).sum(axis=-1)
    # r2_score's convention where the eigenvalues in range are all equal: 1 for a perfect fit, else 0
    r2 = xp.where(ss_tot > 0.0, 1.0 - ss_res / xp.where(ss_tot > 0.0, ss_tot, 1.0), f64(ss_res <= 0.0))
    r2 = xp.where(ok, r2, math.nan)
    return alpha, r2, count, first + count - 1.0


def spectral_values(lam, rtol: float, lam_u: Any = None, lam_c: Any = None, options: Optional[dict] = None) -> dict:
    """RankMe, alpha-ReQ (its R^2, count and last k), the participation
    ratio and the effective dimension over the last axis (leading axes:
    stacked states). ``lam``: eigenvalues of M, descending, >= 0 (of the
    uncentered operator with ``compute(centered=False)``), for the
    participation ratio (eigenvalues at or below the rank cut ``rtol *
    lam_1`` count as 0) and the effective dimension (all of them);
    ``lam_c``: the centered ones for alpha-ReQ (default ``lam``); ``lam_u``:
    the uncentered ones for RankMe, the min(n, p) of them (RankMe NaN
    without). Arrays, NaN where undefined (docs/MATH.md, representation
    diagnostics)."""
    opts = DEFAULT_OPTIONS if options is None else options
    xp = ns(lam)
    lam = f64(lam)
    top = lam[..., :1]
    rel = lam / xp.where(top > 0.0, top, 1.0)
    keep = kept(lam, rtol)
    kept_rel = xp.where(keep, rel, 0.0)
    s1, s2 = kept_rel.sum(axis=-1), (kept_rel * kept_rel).sum(axis=-1)
    pr = xp.where(s2 > 0.0, s1 * s1 / xp.where(s2 > 0.0, s2, 1.0), math.nan)
    first, last = opts["alpha_req_range"]
    alpha, r2, count, hi = alpha_req_fit(lam if lam_c is None else lam_c, rtol, first, last,
                                         opts["alpha_req_weights"] == "1/k")
    rankme = rankme_values(lam_u) if lam_u is not None else top[..., 0] * math.nan
    eff = entropy_rank(rel)
    return {"rankme": rankme, "alpha_req": alpha, "alpha_req_r2": r2, "alpha_req_k": count,
            "alpha_req_last": hi, "participation_ratio": pr, "effective_dim": eff}


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


def nc3_value(D, present, W) -> tuple:
    """(NC3 or None, warning or None): || W / ||W||_F - U / ||U||_F ||_F^2 with
    U = D and W the head's rows of the classes present (docs/MATH.md, NC3)."""
    xp = ns(D)
    index = xp.nonzero(present)[0] if xp is np else xp.nonzero(present)[:, 0]
    if int(W.shape[0]) <= int(index.max()):
        return None, (f"NC3 not reported: the head has {int(W.shape[0])} rows but labels reach class "
                      f"{int(index.max())}; pass the head with a row for every class")
    Wc = W[index]
    nu, nw = norm(D), norm(Wc)
    if not (nu > 0.0 and nw > 0.0):
        what = "the class means coincide" if not nu > 0.0 else "the head's rows of the classes present are 0"
        return None, f"NC3 undefined: {what} (nothing to compare; no action needed)"
    Dd = D / nu - Wc / nw
    return float((Dd * Dd).sum()), None


def eigenvalues_of_state(st: dict, centered: bool = True, single: bool = False):
    """Eigenvalues of M (or of the uncentered M + n mu mu^T), descending,
    clipped at 0: the spectral measures need no eigenvectors. ``single``:
    solve in float32 on M divided by its largest diagonal entry (the
    measures are scale-free), for a state of float32 products, whose
    eigenvalues below 1e-5 lambda_1 are cut anyway in the participation
    ratio: about 1.7x faster at p = 512 (docs/MATH.md, representation
    diagnostics). RankMe and alpha-ReQ read eigenvalues below that cut and
    never take this route."""
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


def spectral_report(lam, rtol: float, wanted: tuple = SPECTRAL, lam_u: Any = None, lam_c: Any = None,
                    options: Optional[dict] = None) -> tuple:
    """(values, warnings) of the spectral measures from one state's
    eigenvalues (``spectral_values``): Python floats, None where undefined
    (with a warning)."""
    opts = DEFAULT_OPTIONS if options is None else options
    v = spectral_values(lam, rtol, lam_u, lam_c, opts)
    out: dict = {name: _scalar(v[name]) for name in SPECTRAL}
    out["effective_dim"] = _scalar(v["effective_dim"])
    out["alpha_req_r2"] = _scalar(v["alpha_req_r2"])
    K = int(v["alpha_req_k"])
    first, last = opts["alpha_req_range"]
    out["alpha_req_range"] = (first, int(v["alpha_req_last"])) if out["alpha_req"] is not None else None
    warnings = []
    span = f"k = {first}..{'p' if last is None else last}"
    if out["participation_ratio"] is None:
        warnings.append(("RankMe, alpha-ReQ and the participation ratio undefined: the spectrum is all zero"
                         if out["rankme"] is None else
                         "alpha-ReQ and the participation ratio undefined: the centered spectrum is all zero")
                        + " (constant features: check that the layer measured is the one meant)")
    elif "alpha_req" in wanted and out["alpha_req"] is None:
        warnings.append(f"alpha-ReQ undefined: {K} eigenvalue(s) in its range {span} (a fit needs two; "
                        f"measure_options={{'alpha_req_range': (1, None)}} fits from the first)")
    elif "alpha_req" in wanted and K < ALPHA_REQ_FEW:
        warnings.append(f"alpha-ReQ fitted on {K} eigenvalues (k = {first}..{int(v['alpha_req_last'])} of its "
                        f"range {span}): fewer than {ALPHA_REQ_FEW}, the exponent is uncertain; read it with "
                        "alpha_req_r2, or widen measure_options={'alpha_req_range': ...} if the spectrum allows")
    return out, warnings


def script_class_means(D):
    """The class means as the widely copied neural-collapse script centres
    them: on the mean of the class means (not the sample mean)."""
    return D - D.mean(axis=0)[None, :]


def nc2_script(D) -> tuple:
    """(equinorm, equiangle) as the script computes them from the centered
    class means D (classes present): rows centred on their own mean,
    std with ddof = 1. NaN where undefined."""
    xp = ns(D)
    U = script_class_means(D)
    C = int(U.shape[0])
    norms = xp.sqrt((U * U).sum(axis=1))
    if C < 2 or not bool((norms > 0.0).all()):
        return math.nan, math.nan
    mean = float(norms.mean())
    equinorm = math.sqrt(float(((norms - mean) ** 2).sum()) / (C - 1)) / mean
    V = U / norms[:, None]
    G = V @ V.T + 1.0 / (C - 1)
    off = float(xp.abs(G).sum()) - float(xp.abs(xp.diagonal(G)).sum())
    return equinorm, off / (C * (C - 1))


def nc1_script(st: dict, rtol: float) -> Optional[float]:
    """NC1 as the script computes it: tr(Sigma_W Sigma_B^+), not divided by
    C, Sigma_B = U^T U / C of the class means centred on their own mean (U),
    its pseudo-inverse over its top C - 1 eigenvalues (those above the rank
    cut). Sigma_W is NC1's (within-class scatter / n). None with fewer than
    two classes."""
    if int(st["k"]) <= 0:
        return None
    D, present, counts = class_means(st)
    C = int(D.shape[0])
    if C < 2:
        return None
    xp = ns(D)
    U = script_class_means(D)
    g, V = eigh_desc(U @ U.T)
    keep = kept(g, rtol)
    keep = keep & (xp.asarray(np.arange(C)) < C - 1 if xp is not np else np.arange(C) < C - 1)
    if not bool(keep.any()):
        return None
    Vk = V[:, keep]
    gk = g[keep]
    # unit eigenvectors of Sigma_B: v_i = U^T u_i / sqrt(g_i); v^T M v = u^T U M U^T u / g,
    # d_k . v = (D U^T u)_k / sqrt(g); Sigma_B's eigenvalue is g / C
    UV = U.T @ Vk
    vmv = (UV * (st["M"] @ UV)).sum(axis=0) / gk
    dv = D @ UV
    between = (counts[:, None] * dv * dv).sum(axis=0) / gk
    vwv = (vmv - between) / float(st["n"])
    return max(float((vwv * C / gk).sum()), 0.0)


def class_report(st: dict, W: Any, wanted: tuple, asked: bool = False, convention: str = "paper") -> tuple:
    """(values, warnings) of the NC2 and NC3 measures in ``wanted`` from one
    state; None (with a warning) where undefined, and where ``asked`` (named
    by the caller) without labels or a head. ``convention`` ``"papyan_script"``:
    the script's class-mean centring and ddof (``check_options``)."""
    out: dict = {name: None for name in CLASS_MEANS}
    warnings: list = []
    if not any(name in wanted for name in CLASS_MEANS):
        return out, warnings
    if int(st["k"]) <= 0:
        if asked:
            warnings.append(f"{', '.join(n for n in CLASS_MEANS if n in wanted)} not reported: they need labels "
                            "(update(..., labels=...))")
        return out, warnings
    D, present, counts = class_means(st)
    C = int(D.shape[0])
    if C < 2:
        warnings.append(f"NC2 and NC3 undefined: {C} class(es) with samples (they compare two or more); "
                        "add samples of the other classes to measure them")
        return out, warnings
    script = convention == "papyan_script"
    if "nc2_equinorm" in wanted or "nc2_equiangle" in wanted:
        equinorm, equiangle = nc2_script(D) if script else nc2_from_grams(D @ D.T, counts)
        out["nc2_equinorm"], out["nc2_equiangle"] = _scalar(equinorm), _scalar(equiangle)
        if out["nc2_equinorm"] is None:
            warnings.append("NC2 undefined: a class mean equals the " +
                            ("mean of the class means" if script else "global mean") +
                            " (its direction is undefined; no action needed)")
        for name in ("nc2_equinorm", "nc2_equiangle"):
            if name not in wanted:
                out[name] = None
    if "nc3" in wanted and W is not None:
        out["nc3"], warning = nc3_value(script_class_means(D) if script else D, present, W)
        warnings += [warning] if warning else []
    elif "nc3" in wanted and asked:
        warnings.append("NC3 not reported: it compares the head with the class means; pass the head "
                        "(compute(head_weights=...))")
    return out, warnings


def measure_values(st: dict, W: Any, rtol: float, wanted: tuple, lam: Any = None, centered: bool = True,
                   single: bool = False, options: Optional[dict] = None, asked: bool = False) -> tuple:
    """(values, warnings) of the measures in ``wanted`` from a state dict:
    ``lam`` the eigenvalues of M (descending; any positive multiple; of
    M + n mu mu^T with ``centered=False``) when the spectrum was computed,
    else they are computed here when a spectral measure is wanted. RankMe
    takes the uncentered eigenvalues and alpha-ReQ the centered ones whatever
    ``centered`` says (each as published); the participation ratio and the
    effective dimension follow ``centered``. Values are Python floats, None
    where not wanted or undefined; ``alpha_req_range`` is (first, last k
    fitted), ``alpha_req_r2`` the fit's R^2. ``single``: see
    ``eigenvalues_of_state``, for the participation ratio alone (RankMe and
    alpha-ReQ read eigenvalues far below fp32's rank cut: float64 there).
    ``options``: ``check_options``'s dict; ``asked``: ``wanted`` was named by
    the caller (NC2/NC3 without labels, NC3 without a head then warn).
    LiDAR (``lidar.lidar_with_reason``) reads the labels as object ids; where
    it is wanted and undefined, the reason is among the warnings."""
    opts = DEFAULT_OPTIONS if options is None else options
    out: dict = {name: None for name in MEASURES}
    out["alpha_req_range"] = out["alpha_req_r2"] = None
    warnings: list = []
    if any(name in wanted for name in SPECTRAL):
        exact = "rankme" in wanted or "alpha_req" in wanted
        spec = eigenvalues_of_state(st, centered, single and not exact) if lam is None else lam
        lam_c = None
        if "alpha_req" in wanted and not centered:
            lam_c = eigenvalues_of_state(st, True)
        lam_u = None
        if "rankme" in wanted:
            lam_u = spec if not centered else eigenvalues_of_state(st, False)
            lam_u = lam_u[..., :min(int(st["n"]), int(st["p"]))]
        values, warns = spectral_report(spec, rtol, wanted, lam_u, lam_c, opts)
        for name in SPECTRAL:
            if name in wanted:
                out[name] = values[name]
        if "alpha_req" in wanted:
            out["alpha_req_range"], out["alpha_req_r2"] = values["alpha_req_range"], values["alpha_req_r2"]
        out["effective_dim"] = values["effective_dim"]  # free with the eigenvalues
        warnings += warns
    cls, warns = class_report(st, W, wanted, asked, opts["nc_convention"])
    out.update(cls)
    if "lidar" in wanted:
        out["lidar"], why = lidar_with_reason(st, opts.get("lidar_delta", LIDAR_DELTA))
        warns += [why] if why else []
    return out, warnings + warns
