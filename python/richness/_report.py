"""The Report that ``Moments.compute`` returns."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Iterable, List, Optional

import numpy as np

# How to read DLR against its isotropic reference: printed under it by ``str(report)`` (and so by
# ``richness eval``); docs/READING_DLR.md says more.
HOW_TO_READ = ("how to read: DLR/iso near 1 = as lazy as isotropic (random) features at this n, p and rank; "
               "near 0 = rich (docs/READING_DLR.md)")


@dataclass(repr=False)
class Report:
    """Richness of one state of a network, finished from streamed moments.

    dlr: 1 - CKA(feature kernel, projector onto the learned functions); 0 = rich
        (low rank), 1 = lazy. None when neither outputs nor a head were given.
    rank: number of logit directions kept by the cut ``a_i > rtol * a_max``.
    logit_eigenvalues: eigenvalues of the centered output Gram A, descending.
    n: number of samples.
    nc1: neural-collapse NC1 = tr(Sigma_W Sigma_B^+) / K; None without labels
        or at precisions that cannot resolve it (see ``warnings``).
    eigenvalues: rho_k of Sigma = M / n, descending (all p; the curves use the
        ``feature_rank`` above the cut). The spectrum fields and curves are
        None with ``compute(spectrum=False)``.
    relative_eigenvalues: rho_k / rho_1.
    effective_dim: exp(-sum q_k log q_k), q_k = rho_k / sum rho.
    quality: cumulative quality Pi*(k), k = 1..p (targets or one-hot labels).
    utilization: cumulative utilization Pi_hat(k) (outputs or head).
    test_quality, test_utilization: the same on a held-out state (Nystrom
        extension; monotone but NOT bounded by 1).
    test_eigenfunction_norms: ||e_k||^2 on the held-out set (1 on training).
    feature_rank: number of feature eigenvalues above ``rtol * rho_1``.
    rtol: the eigenvalue cut used; precision: of the products that formed the
        state; centered: whether the spectrum is of the centered operator.
    dlr_rtol_range: DLR with rtol / 10 and rtol * 10 (how much the rank cut matters).
    active_features: features whose variance exceeds rtol times the largest
        (dead units excluded): the p of the finite-sample reference.
    p: number of features; num_outputs: number of learned functions C (output
        columns, or the head's rows); None without outputs or a head.
    dlr_isotropic: DLR that isotropic features of the same n, number of active
        features and logit rank would give (the lazy end at this n, p, C).
    dlr_normalized: dlr / dlr_isotropic: about 1 for lazy (isotropic-like),
        0 for rich, comparable across p, C and n (docs/READING_DLR.md).
    dlr_stderr, dlr_interval, dlr_jackknife: delete-one-group jackknife standard
        error, 95% interval and bias-corrected DLR (``compute(uncertainty=True)``
        on a ``Moments(groups=k)``).
    rankme: RankMe as published (Garrido et al. 2023, eq. 1): exp(-sum p_k
        log p_k), p_k = s_k / sum s + 1e-7, s the min(n, p) singular values
        of the feature matrix as given (NOT centered: the eigenvalues of
        M + n mu mu^T), every one of them (no rank cut); whatever
        ``centered`` says.
    alpha_req: alpha-ReQ as the authors' code fits it (Agrawal et al. 2022;
        ``reptrix``): log lambda_k = c - alpha log k by least squares weighted
        by 1/k over ``alpha_req_range`` = (first, last k fitted), by default
        k = 11..100 clipped to the centered eigenvalues present (above a
        hundredth of the rank cut); ``compute(measure_options=...)`` changes
        the range and weights.
    alpha_req_r2: that fit's R^2 (unweighted, of log lambda_k, over the
        fitted k; reptrix's definition).
    participation_ratio: (sum lambda)^2 / sum lambda^2.
    nc2_equinorm, nc2_equiangle: NC2 of the class means centered on the
        sample mean (std / mean of their norms, ddof 0; mean |cos + 1 / (C - 1)|
        over pairs): 0 at a simplex ETF (Papyan et al. 2020). Need labels.
        ``measure_options={"nc_convention": "papyan_script"}``: NC1-NC3 as the
        widely copied measurement script computes them (docs/MATH.md).
    nc3: || W / ||W|| - U / ||U|| ||_F^2, head against class means (labels and
        ``compute(head_weights=...)``). These seven are computed from the spectrum
        and class sums already there; with ``spectrum=False`` only those asked
        for with ``measures=`` (docs/MATH.md, representation diagnostics).
    lidar: LiDAR (Thilak et al., ICLR 2024), with labels that are object ids
        (the augmentations of one input share one): exp(-sum q_k log q_k),
        q_k = lambda_k / sum lambda + 1e-7 over the p eigenvalues of
        Sigma_w^-1/2 Sigma_b Sigma_w^-1/2, Sigma_b the covariance of the
        object means (1 / (N - 1)), Sigma_w the pooled within-object
        covariance plus ``lidar_delta`` I (``measure_options``; default 1e-4).
        Only with ``measures=["lidar", ...]`` or ``"all"`` (docs/MATH.md, LiDAR).
    measures_stderr: with ``uncertainty=True``, the jackknife standard error
        of each of those measures that is set, by name.
    layers: ``evaluate(..., layers=[...])``: layer name -> Report of that layer's
        activations against the model's outputs (DLR by depth).
    warnings: plain-language caveats (finite n, rank cut, NC1 precision), each
        naming what to do. ``richness.evaluate`` and ``compute(uncertainty=True)``
        also issue theirs as a ``RichnessWarning``; ``str(report)`` then counts
        those instead of repeating them, and prints the others in full.

    ``str(report)`` (``print``, IPython and Jupyter) is the readable summary:
    DLR beside its isotropic reference and their ratio, how to read them, the
    sizes and the measures that are set; ``repr`` lists every field.
    """

    dlr: Optional[float]
    rank: Optional[int]
    logit_eigenvalues: Optional[np.ndarray]
    n: int
    nc1: Optional[float]
    eigenvalues: Optional[np.ndarray]
    relative_eigenvalues: Optional[np.ndarray]
    effective_dim: Optional[float]
    quality: Optional[np.ndarray] = None
    utilization: Optional[np.ndarray] = None
    test_quality: Optional[np.ndarray] = None
    test_utilization: Optional[np.ndarray] = None
    test_eigenfunction_norms: Optional[np.ndarray] = None
    feature_rank: Optional[int] = None
    rtol: float = 0.0
    precision: str = "fp64"
    centered: bool = True
    dlr_rtol_range: Optional[tuple] = None
    active_features: Optional[int] = None
    p: Optional[int] = None
    num_outputs: Optional[int] = None
    dlr_isotropic: Optional[float] = None
    dlr_normalized: Optional[float] = None
    dlr_stderr: Optional[float] = None
    dlr_interval: Optional[tuple] = None
    dlr_jackknife: Optional[float] = None
    rankme: Optional[float] = None
    alpha_req: Optional[float] = None
    alpha_req_range: Optional[tuple] = None
    alpha_req_r2: Optional[float] = None
    participation_ratio: Optional[float] = None
    nc2_equinorm: Optional[float] = None
    nc2_equiangle: Optional[float] = None
    nc3: Optional[float] = None
    lidar: Optional[float] = None
    measures_stderr: Optional[dict] = None
    layers: Optional[dict] = None
    warnings: List[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """Plain Python types (lists for arrays): ready for ``json.dumps``."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, np.ndarray):
                v = v.tolist()
            elif isinstance(v, np.generic):
                v = v.item()
            elif isinstance(v, (list, tuple)):
                v = list(v)
            elif isinstance(v, dict):
                v = {k: (x.to_dict() if isinstance(x, Report) else x) for k, x in v.items()}
            out[f.name] = v
        return out

    def __repr__(self) -> str:
        """Every field, arrays summarised (shape and first values): a Report
        of p = 2048 features stays a few lines."""
        def short(v):
            if isinstance(v, np.ndarray):
                head = ", ".join(f"{x:.4g}" for x in v.ravel()[:3])
                return f"array(shape={v.shape}, [{head}{', ...' if v.size > 3 else ''}])"
            if isinstance(v, dict):
                return "{" + ", ".join(f"{k!r}: Report(dlr={getattr(x, 'dlr', x)!r}, ...)" for k, x in v.items()) + "}"
            return repr(v)

        names = [f.name for f in fields(self)]  # DLR first, beside its isotropic reference and their ratio
        first = [name for name in ("dlr", "dlr_isotropic", "dlr_normalized") if name in names]
        names = first + [name for name in names if name not in first]
        return "Report(" + ", ".join(f"{name}={short(getattr(self, name))}" for name in names) + ")"

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        """IPython and Jupyter show a Report as ``print`` does."""
        printer.text("Report(...)" if cycle else str(self))

    def _mark_issued(self, messages: Iterable[str]) -> None:
        """Record that these texts of ``warnings`` were also issued as a
        ``RichnessWarning``: ``str(report)`` counts them instead of repeating
        them (not a field: ``to_dict`` and equality are unchanged)."""
        self.__dict__.setdefault("_issued", set()).update(messages)

    def __str__(self) -> str:
        lines = [f"DLR {_fmt(self.dlr)}  (0 = rich, 1 = lazy)   rank {self.rank}   n {self.n}"]
        lines += reference_lines(self)
        lines.append("   ".join(self._size_parts() + [
            f"NC1 {_fmt(self.nc1)}", f"effective dim {_fmt(self.effective_dim)}", f"feature rank {self.feature_rank}",
            f"precision {self.precision}", f"rtol {self.rtol:g}"]))
        if self.dlr_stderr is not None:
            lines.append(self._jackknife_line())
        lines += self._measure_lines()
        lines += self._layer_lines()
        lines += self._warning_lines()
        return "\n".join(lines)

    def _size_parts(self) -> List[str]:
        """p (with the active features the reference uses) and C, where known."""
        parts = []
        if self.p is not None:
            active = "" if self.active_features is None else f" ({self.active_features} active)"
            parts.append(f"p {self.p}{active}")
        elif self.active_features is not None:
            parts.append(f"active features {self.active_features}")
        if self.num_outputs is not None:
            parts.append(f"C {self.num_outputs}")
        return parts

    def _jackknife_line(self) -> str:
        parts = [f"DLR stderr {self.dlr_stderr:.4f}"]
        if self.dlr_interval is not None:
            lo, hi = self.dlr_interval
            parts.append(f"95% interval {lo:.4f} .. {hi:.4f}")
        if self.dlr_jackknife is not None:
            parts.append(f"bias-corrected {self.dlr_jackknife:.4f}")
        return "   ".join(parts) + "   (jackknife)"

    def _layer_lines(self) -> List[str]:
        """One line per layer of ``layers``: its DLR beside its own isotropic reference."""
        out = []
        for name, rep in (self.layers or {}).items():
            if not isinstance(rep, Report):
                continue
            text = f"layer {name!r}: DLR {_fmt(rep.dlr)}"
            if rep.dlr is not None and rep.dlr_isotropic is not None:
                text += f"   isotropic reference {rep.dlr_isotropic:.4f}   DLR/iso {_ratio(rep.dlr_normalized)}"
            text += f"   rank {rep.rank}"
            if rep.p is not None:
                text += f"   p {rep.p}"
            if rep.warnings:
                count = len(rep.warnings)
                text += f"   ({count} warning{'s' if count > 1 else ''}: report.layers[{name!r}].warnings)"
            out.append(text)
        return out

    def _warning_lines(self) -> List[str]:
        """Each warning not issued as a ``RichnessWarning`` in full; those that were, counted (the
        user has seen them once already)."""
        issued = self.__dict__.get("_issued", ())
        lines = [f"warning: {w}" for w in self.warnings if w not in issued]
        count = sum(1 for w in self.warnings if w in issued)
        if count:
            lines.append(f"warnings: {count} {'more ' if lines else ''}already issued as RichnessWarning "
                         "(texts in report.warnings)")
        return lines

    def _measure_lines(self) -> List[str]:
        """One text line of the representation diagnostics that are set (none when all are None)."""
        names = (("RankMe", "rankme"), ("alpha-ReQ", "alpha_req"),
                 ("participation ratio", "participation_ratio"), ("NC2 equinorm", "nc2_equinorm"),
                 ("NC2 equiangle", "nc2_equiangle"), ("NC3", "nc3"), ("LiDAR", "lidar"))
        stderr = self.measures_stderr or {}
        parts = []
        for label, name in names:
            value = getattr(self, name, None)  # a measure this Report may not carry
            if value is None:
                continue
            text = f"{label} {value:.4f}"
            if stderr.get(name) is not None:
                text += f" +- {stderr[name]:.4f}"
            if name == "alpha_req":
                fit = []
                if self.alpha_req_range is not None:
                    fit.append(f"k {self.alpha_req_range[0]}..{self.alpha_req_range[1]}")
                r2 = getattr(self, "alpha_req_r2", None)
                if r2 is not None:
                    fit.append(f"R^2 {r2:.3f}")
                text += f" ({', '.join(fit)})" if fit else ""
            parts.append(text)
        return ["   ".join(parts)] if parts else []


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.4f}"


def _ratio(v) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def reference_lines(report: Report) -> List[str]:
    """DLR's isotropic reference and their ratio, and how to read them: the
    lazy end DLR is read against, isotropic features of the same n, active
    features and logit rank (a fully lazy random network at small n has DLR
    well below 1). No lines without DLR."""
    if report.dlr is None or report.dlr_isotropic is None:
        return []
    return [f"isotropic reference {report.dlr_isotropic:.4f}   DLR/iso {_ratio(report.dlr_normalized)}", HOW_TO_READ]
