"""Pictures of a Report or a Monitor log (matplotlib, optional dependency).

``curves`` draws the interpretability curves (docs/MATH.md, "Projections and curves"): cumulative quality
Pi*(k) and utilization Pi_hat(k) (training solid, held-out dashed) and the
relative eigenvalues rho_k / rho_1. ``history`` draws DLR (and NC1) over
training steps from ``Monitor`` records. Both write PNG and SVG.
"""

from __future__ import annotations

import csv
import io
import json
import os
import warnings
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import numpy as np

from ._engine import bounded_io as _bounded_io
from ._checks import is_int
from ._optional import pip_extra
from ._report import Report
from ._warnings import RichnessWarning

__all__ = ["curves", "depth", "history", "similarity", "sweep"]

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(f"richness plots need matplotlib: {pip_extra('plot')}") from None
    return plt


def _save(fig: Any, prefix: "str | os.PathLike") -> List[str]:
    prefix = os.fspath(prefix)
    for ext in (".png", ".svg"):
        if prefix.endswith(ext):
            prefix = prefix[: -len(ext)]
    folder = os.path.dirname(os.path.abspath(prefix))
    os.makedirs(folder, exist_ok=True)
    paths = [prefix + ".png", prefix + ".svg"]
    fig.savefig(paths[0], dpi=130, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight")
    _plt().close(fig)
    return paths


def curves(reports: Union[Report, Mapping[str, Report]], prefix: "str | os.PathLike", *,
           title: Optional[str] = None) -> List[str]:
    """Pi*(k), Pi_hat(k) and rho_k/rho_1 of one report or several (a dict
    label -> Report, drawn in one figure); writes ``prefix.png`` and
    ``prefix.svg`` and returns their paths."""
    plt = _plt()
    if isinstance(reports, Report):
        reports = {"": reports}
    if not reports:
        raise ValueError("curves needs at least one report")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    ax_q, ax_u, ax_r = axes
    held_out = False
    for i, (label, rep) in enumerate(reports.items()):
        c = _COLORS[i % len(_COLORS)]
        rel = rep.relative_eigenvalues
        if rep.feature_rank is None or rel is None:
            which = repr(label) if label else "the report"
            raise ValueError(f"curves needs reports with the spectrum; {which} was computed with spectrum=False")
        kmax = max(int(rep.feature_rank), 1)
        k = np.arange(1, kmax + 1)
        name = f"{label} " if label else ""
        dlr = "n/a" if rep.dlr is None else f"{rep.dlr:.3f}"
        for ax, train, test in ((ax_q, rep.quality, rep.test_quality), (ax_u, rep.utilization, rep.test_utilization)):
            if train is not None:
                ax.plot(k, train[:kmax], color=c, lw=2, label=f"{name}train (DLR {dlr})")
            if test is not None:
                held_out = True
                ax.plot(k, test[:kmax], color=c, lw=2, ls="--", label=f"{name}held-out")
        ax_r.plot(k, np.clip(rel[:kmax], 1e-300, None), color=c, lw=2,
                  label=f"{name}eff. dim {rep.effective_dim:.1f}")
    ax_q.set_title("cumulative quality Pi*(k): targets")
    ax_u.set_title("cumulative utilization Pi_hat(k): outputs")
    ax_r.set_title("relative eigenvalues")
    for ax in (ax_q, ax_u):
        ax.set_xscale("log")
        ax.set_xlabel("k (top-k feature eigenfunctions)")
        # Nystrom-extended curves are monotone but can exceed 1 (docs/MATH.md, held-out curves)
        ax.set_ylabel("cumulative projection (training: fraction of\nvariance; held-out dashed: can exceed 1)"
                      if held_out else "fraction of variance explained")
        if not held_out:
            ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8, loc="upper left")
        else:
            missing = "not available\n(no labels/targets)" if ax is ax_q else "not available\n(no outputs/head)"
            ax.text(0.5, 0.5, missing, ha="center", va="center", transform=ax.transAxes, color="gray")
    ax_r.set_xscale("log")
    ax_r.set_yscale("log")
    ax_r.set_xlabel("k")
    ax_r.set_ylabel("rho_k / rho_1")
    ax_r.grid(alpha=0.3, which="both")
    ax_r.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, prefix)


def _number(value: Any, key: str, where: str, optional: bool) -> Optional[float]:
    """A record's field as a float (None where ``optional`` allows); ValueError naming ``where``."""
    if value is None and optional:
        return None
    if not (is_int(value) or isinstance(value, float)):
        raise ValueError(f"{where}: {key} is not a number ({value!r})")
    return float(value)


def read_log(path: "str | os.PathLike") -> List[Dict[str, Any]]:
    """Monitor records from a ``.jsonl`` or ``.csv`` log (ValueError naming the
    file and line when it cannot be read, or when a record's ``step``,
    ``dlr``, ``nc1`` or ``dlr_isotropic`` is not a number)."""
    path = os.fspath(path)
    recs = []
    try:
        # regular files only: a device or a pipe could be endless or block for ever
        with io.TextIOWrapper(_bounded_io.open_regular(path), newline="") as f:
            if path.endswith(".csv"):
                for i, row in enumerate(csv.DictReader(f), start=2):
                    rec: Dict[str, Any] = {}
                    for k, v in row.items():
                        try:
                            rec[k] = None if v in ("", None) else (v if k == "mode" else float(v))
                        except (TypeError, ValueError):
                            raise ValueError(f"{path}: line {i}: {k} is not a number ({v!r})") from None
                    recs.append((i, rec))
            else:
                for i, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        recs.append((i, json.loads(line)))
                    except json.JSONDecodeError:
                        raise ValueError(f"{path}: line {i} is not JSON") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file (not UTF-8)") from None
    if not recs or not all(isinstance(r, dict) and "step" in r and "dlr" in r for _, r in recs):
        raise ValueError(f"{path}: not a Monitor log (records need 'step' and 'dlr')")
    for i, r in recs:
        _number(r["step"], "step", f"{path}: line {i}", optional=False)
        _number(r["dlr"], "dlr", f"{path}: line {i}", optional=True)
        _number(r.get("nc1"), "nc1", f"{path}: line {i}", optional=True)
        _number(r.get("dlr_isotropic"), "dlr_isotropic", f"{path}: line {i}", optional=True)
    return [r for _, r in recs]


def escape_mathtext(text: str) -> str:
    """``text`` shown as written in a matplotlib title or label (a file name
    with ``$...$`` would otherwise be parsed as mathematics)."""
    return text.replace("$", r"\$")


def _dlr_outside(steps: np.ndarray, dlr: np.ndarray, given: np.ndarray, where: str) -> str:
    """A note on the recorded (``given``) DLR values that are NaN or outside [0, 1]
    (none of them a DLR), also warned about (RichnessWarning); "" when there are none."""
    nan = given & np.isnan(dlr)
    out = given & ~nan & ((dlr < 0) | (dlr > 1))
    parts = []
    if out.any():
        first = int(np.flatnonzero(out)[0])
        parts.append(f"{int(out.sum())} DLR value(s) outside [0, 1] (first at step {steps[first]:g}: "
                     f"{dlr[first]:g}), drawn as they are")
    if nan.any():
        parts.append(f"{int(nan.sum())} NaN DLR value(s), not drawn")
    if not parts:
        return ""
    note = "; ".join(parts)
    warnings.warn(f"{where}{note} (a DLR lies in [0, 1]: these records are not valid measurements)",
                  RichnessWarning, stacklevel=3)
    return note


def history(records: Union[Sequence[Mapping[str, Any]], "str | os.PathLike"], prefix: "str | os.PathLike", *,
            title: Optional[str] = None) -> List[str]:
    """DLR over training steps (and NC1 on a log axis when present) from
    Monitor records or a log file; writes ``prefix.png`` and ``prefix.svg``."""
    plt = _plt()
    where = f"{records}: " if isinstance(records, (str, os.PathLike)) else ""
    if isinstance(records, (str, os.PathLike)):
        records = read_log(records)
    else:
        for i, r in enumerate(records):
            _number(r["step"], "step", f"record {i}", optional=False)
            _number(r.get("dlr"), "dlr", f"record {i}", optional=True)
            _number(r.get("nc1"), "nc1", f"record {i}", optional=True)
            _number(r.get("dlr_isotropic"), "dlr_isotropic", f"record {i}", optional=True)
    steps = np.array([float(r["step"]) for r in records])
    dlr = np.array([np.nan if r.get("dlr") is None else float(r["dlr"]) for r in records])
    nc1 = np.array([np.nan if r.get("nc1") is None else float(r["nc1"]) for r in records])
    # None is a step whose DLR was undefined (the Monitor warned then); NaN or a value outside [0, 1] is no DLR
    note = _dlr_outside(steps, dlr, np.array([r.get("dlr") is not None for r in records], bool), where)
    has_nc1 = bool(np.isfinite(nc1).any())
    fig, axes = plt.subplots(1, 2 if has_nc1 else 1, figsize=(11 if has_nc1 else 6, 4))
    axes = np.atleast_1d(axes)
    axes[0].plot(steps, dlr, "o-", color=_COLORS[0], lw=2, ms=3)
    iso = np.array([np.nan if r.get("dlr_isotropic") is None else float(r["dlr_isotropic"]) for r in records])
    if np.isfinite(iso).any():  # the records' isotropic reference (the same window's n, p and rank)
        axes[0].plot(steps, iso, "--", color="gray", lw=1.5, label="isotropic reference")
        axes[0].legend(loc="best", fontsize=8)
    axes[0].set_xlabel("training step")
    axes[0].set_ylabel("DLR (0 = rich, 1 = lazy)")
    finite = dlr[np.isfinite(dlr)]
    lo, hi = (min(0.0, float(finite.min())), max(1.0, float(finite.max()))) if finite.size else (0.0, 1.0)
    axes[0].set_ylim(lo, hi)
    if note:
        axes[0].axhspan(lo, 0.0, color="red", alpha=0.08)
        axes[0].axhspan(1.0, hi, color="red", alpha=0.08)
        axes[0].text(0.02, 0.02, note, transform=axes[0].transAxes, fontsize=7, color="red", va="bottom")
    axes[0].set_title("dynamical low-rank measure")
    axes[0].grid(alpha=0.3)
    if has_nc1:
        axes[1].plot(steps, nc1, "o-", color=_COLORS[1], lw=2, ms=3)
        axes[1].set_yscale("log")
        axes[1].set_xlabel("training step")
        axes[1].set_ylabel("NC1 (lower = more collapsed)")
        axes[1].set_title("neural collapse NC1")
        axes[1].grid(alpha=0.3, which="both")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, prefix)


def sweep(x: Iterable[float], series: Mapping[str, Iterable[float]], prefix: "str | os.PathLike", *,
          xlabel: str, title: Optional[str] = None, logx: bool = True,
          references: Optional[Mapping[str, Iterable[float]]] = None) -> List[str]:
    """Values over a swept parameter (one panel per series), PNG and SVG.

    ``references`` maps a series' name to a reference drawn dashed in its panel (for DLR: each
    point's isotropic reference, ``Report.dlr_isotropic``)."""
    plt = _plt()
    x = np.asarray(list(x), dtype=float)
    references = dict(references or {})
    unknown = sorted(set(references) - set(series))
    if unknown:
        raise ValueError(f"references name series that are not plotted: {unknown}")
    fig, axes = plt.subplots(1, len(series), figsize=(5.5 * len(series), 4))
    axes = np.atleast_1d(axes)
    for i, (ax, (name, ys)) in enumerate(zip(axes, series.items())):
        y = np.asarray(list(ys), dtype=float)
        ax.plot(x, y, "o-", color=_COLORS[i % len(_COLORS)], lw=2)
        shown = [y]
        if name in references:
            ref = np.asarray(list(references[name]), dtype=float)
            ax.plot(x, ref, "--", color="gray", lw=1.5, label="isotropic reference")
            ax.legend(loc="best", fontsize=8)
            shown.append(ref)
        if logx:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(name)
        ax.set_ylim(*_limits_from_zero(np.concatenate(shown)))  # values read against 0
        ax.grid(alpha=0.3, which="both")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, prefix)


def _limits_from_zero(values: np.ndarray) -> tuple:
    """y limits that start at 0 (or the smallest value, if negative) and leave a margin above the
    largest value, so that no point is drawn on the panel's edge."""
    finite = values[np.isfinite(values)]
    if not finite.size:
        return 0.0, 1.0
    lo, hi = min(0.0, float(finite.min())), max(0.0, float(finite.max()))
    pad = 0.05 * (hi - lo) if hi > lo else 0.05
    return lo - (pad if lo < 0 else 0.0), hi + pad


def depth(layers: Union[Report, Mapping[str, Report]], prefix: "str | os.PathLike", *,
          title: Optional[str] = None) -> List[str]:
    """DLR (and its isotropic reference) by depth: the Report of
    ``evaluate(..., layers=[...])`` or its ``.layers`` dict."""
    if isinstance(layers, Report):
        if not layers.layers:
            raise ValueError("the report has no layers: use evaluate(..., layers=[...])")
        layers = layers.layers
    plt = _plt()
    names = list(layers)
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(names) + 2), 4))
    ax.plot(x, [layers[k].dlr for k in names], "o-", color=_COLORS[0], lw=2, label="DLR")
    iso = [layers[k].dlr_isotropic for k in names]
    if all(v is not None for v in iso):
        ax.plot(x, iso, "--", color=_COLORS[1 % len(_COLORS)], lw=1.5, label="isotropic reference")
    ax.set_xticks(x)
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.set_xlabel("layer (input to output)")
    ax.set_ylabel("DLR against the output span (0 = rich, 1 = lazy)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return _save(fig, prefix)


def similarity(report: Any, path: "str | os.PathLike", *, measure: Optional[str] = None,
               values: Optional[bool] = None, title: Optional[str] = None) -> List[str]:
    """A heatmap of a ``SimilarityReport`` (``richness.similarity``,
    ``Similarity.compute``) or of one model against another
    (``SimilarityReport.between``, a ``SimilarityBlock``).

    ``measure``: which of the report's measures to draw (a name of
    ``richness.finish.similarity.MEASURES``, held in the report's ``values``):
    by default ``cka`` where the report holds it, else its first. Each
    measure has its own colour scale (its range: 0..1 for CKA, CCA and R^2,
    0..2 for the Procrustes distance, 0..pi/2 for the angular metric; the
    distances' colours reversed, so that alike is bright for every measure)
    and is named in the title.

    A report: k x k, each axis labelled by model and layer (the
    ``"model.layer"`` names, grouped by model with a line between models); for
    a measure that is not symmetric (``linreg_r2``) the rows predict the
    columns. A block: its rows' model down, its columns' model across, each
    axis named by its model and ticked by layer. Names are drawn as written
    (never as mathtext). The values are written in the cells when there are at
    most 12 rows and columns (``values`` forces it either way). Writes
    ``path.png`` and ``path.svg`` and returns their paths."""
    plt = _plt()
    from ._engine.similarity import SimilarityBlock, SimilarityReport

    if not isinstance(report, (SimilarityReport, SimilarityBlock)):
        raise TypeError(f"similarity expects a SimilarityReport or SimilarityBlock, got {type(report).__name__}")
    name, spec, mat = _similarity_measure(report, measure)
    if isinstance(report, SimilarityBlock):
        return _similarity_block(plt, report, path, name, spec, mat, values, title)
    names = list(report.names)
    k = len(names)
    models = [nm.split(".", 1)[0] if "." in nm else "" for nm in names]
    layers = [nm.split(".", 1)[1] if "." in nm else nm for nm in names]
    size = max(3.5, 0.55 * k + 2.0)
    fig, ax = plt.subplots(figsize=(size + 1.0, size))
    im = ax.imshow(mat, vmin=spec.lo, vmax=spec.hi, cmap="magma_r" if spec.distance else "magma",
                   interpolation="nearest")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label=name)
    ticks = [escape_mathtext(f"{m}\n{ln}" if m else ln) for m, ln in zip(models, layers)]
    ax.set_xticks(range(k), ticks, rotation=90 if k > 6 else 0, fontsize=8)
    ax.set_yticks(range(k), [t.replace("\n", " / ") for t in ticks], fontsize=8)
    ax.set_xlabel("model / layer" + ("" if spec.symmetric else " (predicted)"))
    ax.set_ylabel("model / layer" + ("" if spec.symmetric else " (predicting)"))
    for i in range(1, k):  # a line between models
        if models[i] != models[i - 1]:
            ax.axhline(i - 0.5, color="white", lw=1.5)
            ax.axvline(i - 0.5, color="white", lw=1.5)
    _similarity_values(ax, mat, values, spec)
    ax.set_title(title or f"{spec.title}, n = {report.n:,}")
    return _save(fig, path)


def _similarity_measure(report: Any, measure: Optional[str]) -> tuple:
    """(name, its ``Measure``, its matrix as floats) of the measure to draw from a report or block."""
    from .finish.similarity import MEASURES

    held = list(report.values)
    if measure is None:
        measure = "cka" if "cka" in held else held[0]
    if measure not in MEASURES:
        raise ValueError(f"unknown similarity measure {measure!r}; expected one of {list(MEASURES)}")
    if measure not in held:
        raise ValueError(f"the report holds no {measure} (it holds {held}): compute it with "
                         f"Similarity.compute(measures=[{measure!r}]) or richness.similarity(..., measures=...)")
    return measure, MEASURES[measure], np.asarray(report.values[measure], dtype=float)


def _similarity_values(ax: Any, mat: np.ndarray, values: Optional[bool], spec: Any) -> None:
    """The values written in the cells (by default when at most 12 rows and columns), dark on the
    bright end of the measure's colour scale."""
    if not (values if values is not None else max(mat.shape) <= 12):
        return
    for i in range(mat.shape[0]):
        for j in range(mat.shape[1]):
            v = mat[i, j]
            bright = (v - spec.lo) / (spec.hi - spec.lo)
            bright = 1.0 - bright if spec.distance else bright
            ax.text(j, i, "nan" if not np.isfinite(v) else f"{v:.2f}", ha="center", va="center", fontsize=7,
                    color="black" if np.isfinite(v) and bright > 0.6 else "white")


def _similarity_block(plt: Any, block: Any, path: "str | os.PathLike", name: str, spec: Any, mat: np.ndarray,
                      values: Optional[bool], title: Optional[str]) -> List[str]:
    """The heatmap of a ``SimilarityBlock``: rows (model ``row_label``) down,
    columns (model ``col_label``) across, ticked by the names less the model's prefix."""

    def short(names: List[str], label: str) -> List[str]:
        return [escape_mathtext(nm[len(label) + 1:] if nm.startswith(label + ".") else nm) for nm in names]

    h, w = mat.shape
    fig, ax = plt.subplots(figsize=(max(3.5, 0.55 * w + 2.0) + 1.0, max(3.5, 0.55 * h + 2.0)))
    im = ax.imshow(mat, vmin=spec.lo, vmax=spec.hi, cmap="magma_r" if spec.distance else "magma",
                   interpolation="nearest", aspect="auto")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label=name)
    ax.set_xticks(range(w), short(block.cols, block.col_label), rotation=90 if w > 6 else 0, fontsize=8)
    ax.set_yticks(range(h), short(block.rows, block.row_label), fontsize=8)
    ax.set_xlabel(f"{escape_mathtext(block.col_label)}: layer")
    ax.set_ylabel(f"{escape_mathtext(block.row_label)}: layer")
    _similarity_values(ax, mat, values, spec)
    ax.set_title(title or f"{spec.title}, {escape_mathtext(block.row_label)} against "
                          f"{escape_mathtext(block.col_label)}, n = {block.n:,}")
    return _save(fig, path)
