"""The one-batch route (every=1): groups of steps reduced at once from each batch's n x n Gram."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional

import numpy as np

from .._engine import adapt as _adapt
from .._engine.backend import centered_grams
from .._state import default_precision
from .capture import StepBuffer
from ..torch.threads import BlasThreads
from ..finish import rtol_for
from ..finish.policy import check_rtol
from ..finish.samplespace import GramRows, finish_steps

__all__ = []


@contextlib.contextmanager
def _ieee_matmul(device_type: str) -> Iterator[None]:
    """True float32 matrix products for the duration of the block, on the
    buffers' backend (CUDA or oneDNN on the CPU), then the caller's setting
    back. Training loops often allow TF32 or bf16 for their own float32
    products (``torch.set_float32_matmul_precision("high")``, or
    ``allow_tf32``); the Monitor's fp32 DLR (within 1e-6) needs IEEE
    products. Nothing is touched where IEEE is already the setting (torch's
    default). The setting is changed through the API the caller used: torch
    >= 2.9 refuses to mix the legacy and the per-backend ones."""
    import torch

    backend = getattr(torch.backends.cuda if device_type == "cuda" else torch.backends.mkldnn, "matmul", None)
    current = getattr(backend, "fp32_precision", None)  # per-backend API (torch >= 2.9); mirrors the legacy one
    effective = getattr(torch.backends, "fp32_precision", "none") if current == "none" else current
    try:
        legacy: Optional[str] = torch.get_float32_matmul_precision()
    except RuntimeError:  # the per-backend API is in use: reading the legacy one raises
        legacy = None
    if effective in ("ieee", "none") or (effective is None and legacy == "highest"):
        yield
    elif legacy is not None:
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(legacy)
    else:
        backend.fp32_precision = "ieee"
        try:
            yield
        finally:
            backend.fp32_precision = current


class StepMeta(NamedTuple):
    """What a buffered one-batch window's record says besides its values."""

    step: int     # the step label of the record
    time: float   # seconds since the Monitor started


class GroupMeta(NamedTuple):
    """What finishing a reduced group's rows needs besides them (``finish_group``)."""

    steps: List[StepMeta]  # one per reduced step, in order
    n: int                 # the rows of each step's batch
    c: int                 # the side of A and Q: the outputs C, or n in sample space; 0 without outputs
    k: int                 # the class columns (the classes, or n when renumbered in each step); 0 without labels
    rtol: float
    sample_space: bool     # more outputs than samples: n x n forms
    e: int                 # the eigenvalues of each step's Gram (n, or 0 when not asked for)
    p: int = 0             # the features of each step's batch
    r: int = 0             # the uncentered Gram's eigenvalues kept for RankMe (min(n, p), or 0)


class BatchGroup(StepBuffer):
    """One-batch windows (``window=1`` with fewer rows than features, as with
    every=1) waiting to be reduced together: ``reduce`` turns all of them at
    once into a handful of small float64 matrices per step, with batched
    products, so that the per-step cost is the copy and the fixed costs of the
    reduction (Python, kernel launches, cold caches after the training step)
    are paid once per group."""

    def __init__(self, parts: Dict[str, Any], lag: int, classes: int, eig: bool = False,
                 raw_eig: bool = False) -> None:
        super().__init__(parts, lag)
        self.lag = lag
        feats, outs = parts["features"], parts.get("outputs")  # no outputs: a features-only Monitor
        self.x, self.f, self.y = self.bufs["features"], self.bufs.get("outputs"), self.bufs.get("labels")
        self.eig = eig  # the Gram's eigenvalues too (representation diagnostics)
        # and the uncentered Gram's (RankMe), the min(n, p) largest
        self.raw = min(int(feats.shape[0]), int(feats.shape[1])) if eig and raw_eig else 0
        self.classes = classes
        # NC1 needs only the classes present in a batch, at most n of them: with
        # more classes than samples (ImageNet's 1,000 and a batch of 256) each
        # step's classes are renumbered 0..n-1, so that its k x k matrices are
        # n x n (a 1,000-class k x k pair is 16 MB a step, and its host eigh
        # costs more than the training step).
        self.label_cols = min(classes, int(feats.shape[0]))
        # more outputs than samples: n x n forms
        self.sample_space = outs is not None and int(outs.shape[1]) > int(feats.shape[0])
        self.grams: Any = None  # reduction scratch, made on the first reduce
        self.centered: Any = None
        self._centered_ready = False  # ``centered`` holds this reduction's centered steps

    def reduce(self, prec: str, threads: BlasThreads, core: bool = False, rtol: Optional[float] = None) -> Any:
        """See ``_reduce``; its products in true float32 whatever the training
        loop allows for its own (``_ieee_matmul``). ``core``: the Grams of CPU
        buffers through the core instead of torch (``CORE_GRAMS``).
        With outputs, one more column after the packed rows: each step's
        active features at ``rtol`` (``_active_features``)."""
        with _ieee_matmul(self.x.device.type):
            packed = self._reduce(prec, threads, core)
            if self.f is None:
                return packed
            import torch

            pdt = torch.float64 if prec == "fp64" else torch.float32
            active = self._active_features(len(self.metas), pdt, rtol_for(prec, rtol))
            return torch.cat([packed, active[:, None]], dim=1)

    def _active_features(self, j: int, pdt: Any, rtol: float) -> Any:
        """Each of the first ``j`` steps' active features (float64, one per
        step): the columns whose variance exceeds ``rtol`` times the largest,
        the rule of the full report's isotropic reference
        (``finish.isotropic.reference``, on the diagonal of M). From the
        centered scaled buffer (``_centered``: the torch route's own, made
        here on the core route); a step of NaN or Inf (zeroed) has none."""
        import torch

        Xc = self.centered[:j] if self.centered is not None and self._centered_ready else self._centered(j, pdt)
        ss = torch.linalg.vector_norm(Xc, dim=1).to(torch.float64).square_()  # steps x p: n times the variances
        return (ss > rtol * ss.amax(dim=1, keepdim=True)).sum(dim=1).to(torch.float64)

    def _centered(self, j: int, pdt: Any) -> Any:
        """The first ``j`` steps centered on their own means, in the product
        precision, in scratch kept across groups (see ``_grams``)."""
        import torch

        x = self.x
        if self.centered is None or self.centered.dtype != pdt:
            self.centered = torch.empty(x.shape, dtype=pdt, device=x.device)
        X = x[:j]
        Xc = torch.sub(X, torch.mean(X, dim=1, keepdim=True, dtype=pdt), out=self.centered[:j])
        Xc.sub_(Xc.mean(dim=1, keepdim=True))
        self._centered_ready = True
        return Xc

    def _reduce(self, prec: str, threads: BlasThreads, core: bool) -> Any:
        """The small matrices of every buffered step, one row each: the packed
        ``GramRows`` (a (steps, m) float64 tensor on the buffers' device).
        Issues no host synchronisation.

        Everything comes from the n x n Gram G = Xc Xc^T of each batch (the
        one product of size p; the rest is O(n^2 (C + K))), all products in
        the product precision: ||M||_F = ||G||_F; with C <= n outputs,
        A = Fc^T Fc and Q = B^T B = Fc^T G Fc (C x C); with more outputs than
        samples, A = Fc Fc^T and G itself (n x n: the projector onto the
        outputs' span in sample space); for NC1, with Yn the class-indicator
        matrix divided by the class counts, D = Yn^T Xc are the class means of
        Xc, so D D^T = Yn^T G Yn and D M D^T = (G Yn)^T (G Yn). Each batch is
        centered on its own mean before the products."""
        import torch

        f64 = torch.float64
        pdt = torch.float64 if prec == "fp64" else torch.float32
        j = len(self.metas)
        self._centered_ready = False
        finite = _to_unit_spread(self.x[:j])  # in place: the buffer is cleared after the reduction
        G, norm_m = self._grams(j, prec, pdt, threads, core)  # steps x n x n
        # G's eigenvalues are M's nonzero ones (docs/MATH.md, representation diagnostics)
        # (in the product precision: below fp32's cut of 1e-5 lambda_1 they are cut anyway)
        eig = torch.linalg.eigvalsh(G).to(f64).flip(-1).clamp_(min=0.0) if self.eig else None
        eig_raw = self._raw_eig(j, G, pdt) if self.raw else None
        if self.f is None:  # features only: a non-finite step is marked as below
            return GramRows(torch.where(finite, norm_m, torch.nan), None, None, eig=eig, eig_raw=eig_raw).pack()
        F64 = self.f[:j].to(f64, copy=True)
        Fc64 = F64.sub_(F64.mean(dim=1, keepdim=True))
        finite &= _to_unit_spread(Fc64)
        # a step with NaN or Inf in its head input or output: norm_m NaN marks
        # it (its record is None, with a warning), the other steps are unaffected
        norm_m = torch.where(finite, norm_m, torch.nan)
        Fc = Fc64.to(pdt)
        labels = self.y is not None and self.classes > 0
        valid, counts, Yn = self._labels(j, pdt) if labels else (None, None, None)
        if self.sample_space:
            A = torch.bmm(Fc, Fc.transpose(1, 2)).to(f64)
            Q = G.to(f64)
            Z = Yn
        else:
            A = torch.bmm(Fc.transpose(1, 2), Fc).to(f64)
            Z = torch.cat([Fc, Yn], dim=2) if labels else Fc
        if Z is not None:
            H = torch.bmm(G, Z)  # G [Fc | Yn]
            W = torch.bmm(Z.transpose(1, 2), H).to(f64)
        if not self.sample_space:
            c = int(Fc.shape[2])
            Q = W[:, :c, :c]
        rows = GramRows(norm_m, A, Q, eig=eig, eig_raw=eig_raw)
        if labels:
            off = 0 if self.sample_space else c
            E = H[:, :, off:]  # Xc D^T
            rows = rows._replace(counts=counts.to(f64), DDt=W[:, off:, off:],
                                 DMD=torch.bmm(E.transpose(1, 2), E).to(f64), invalid=(~valid).sum(dim=1).to(f64))
        return rows.pack()

    def _grams(self, j: int, prec: str, pdt: Any, threads: BlasThreads, core: bool) -> tuple:
        """The first ``j`` steps' centered n x n Grams (a view of scratch kept
        across groups: fresh temporaries of this size page-fault on every
        group) in the product precision, and their Frobenius norms (float64)."""
        import torch

        x = self.x
        if self.grams is None or self.grams.dtype != pdt:
            self.grams = torch.empty((x.shape[0], x.shape[1], x.shape[1]), dtype=pdt, device=x.device)
            self.centered = None
        X = x[:j]
        G = self.grams[:j]
        if core:
            # the core: float64 means, centering before narrowing, one syrk per
            # batch, on at most torch's thread count
            threads.set_for_work(j * int(x.shape[1]) ** 2 * int(x.shape[2]))
            norm_m = torch.empty(j, dtype=torch.float64)
            centered_grams(_adapt.as_matrix(X.reshape(-1, X.shape[2]), "features"), X.shape[1], prec, G, norm_m)
            return G, norm_m
        # Compensated centering on the device (docs/MATH.md, streaming estimator:
        # the batch mean "computed in float64 (or compensated)"): x - m is exact where x is within a factor 2 of
        # m (Sterbenz), and the second pass removes what the first mean's
        # rounding left, now at the scale of the spread: a mean of 1e4 with a
        # spread of 1e-2 still gives DLR to 1e-6. Two fast passes in the
        # product precision instead of a float64 copy of the buffer.
        Xc = self._centered(j, pdt)
        torch.bmm(Xc, Xc.transpose(1, 2), out=G)
        return G, torch.linalg.vector_norm(G, dim=(1, 2)).to(torch.float64)  # a float32 G's own accuracy

    def _raw_eig(self, j: int, G: Any, pdt: Any) -> Any:
        """The min(n, p) largest eigenvalues (float64, descending, >= 0) of each
        step's uncentered Gram X X^T (RankMe takes the embeddings as given),
        from the centered one: X = Xc + 1 mu^T, so X X^T = G + v 1^T + 1 v^T +
        ||mu||^2 1 1^T with v = Xc mu (O(n p) a step, no second n x n x p
        product), mu and the sum in float64."""
        import torch

        f64 = torch.float64
        mu = self.x[:j].mean(dim=1, dtype=f64)  # steps x p
        Xc = self.centered[:j] if self.centered is not None and self._centered_ready else self._centered(j, pdt)
        v = torch.bmm(Xc, mu.to(pdt)[:, :, None]).to(f64)  # steps x n x 1
        U = G.to(f64) + v + v.transpose(1, 2) + (mu * mu).sum(dim=1)[:, None, None]
        return torch.linalg.eigvalsh(U).flip(-1).clamp_(min=0.0)[:, :self.raw]

    def _labels(self, j: int, pdt: Any) -> tuple:
        """(valid, counts, Yn) of the first ``j`` steps: which labels lie in
        the classes, each class column's count, and the class-indicator matrix
        divided by the counts (steps x n x class columns)."""
        import torch

        k = self.classes
        lab = self.y[:j].long()
        valid = (lab >= 0) & (lab < k)
        kk = self.label_cols
        col = lab.clamp(0, k - 1) if kk == k else _batch_class_ids(lab, valid, k)
        Y = torch.zeros(lab.shape + (kk,), dtype=pdt, device=lab.device).scatter_(
            2, col[..., None], valid.to(pdt)[..., None])
        counts = Y.sum(dim=1)  # steps x kk
        return valid, counts, Y.div_(counts.clamp(min=1.0)[:, None, :])


def _to_unit_spread(X: Any) -> Any:
    """Scale each step of ``X`` (steps x n x m, in place) by the power of two
    nearest below its largest column range, so that its spread is about 1:
    exact (a power of two changes no mantissa), and DLR and NC1 do not depend
    on the scale, while the products of float32 Grams (G, Fc^T G Fc, the class
    means' D M D^T: fourth powers of the activations) neither overflow at
    activations of 1e9 nor underflow at 1e-12. A step with NaN or Inf values
    is zeroed. Returns which steps were finite (no host synchronisation)."""
    import torch

    spread = (torch.amax(X, dim=1).double() - torch.amin(X, dim=1).double()).amax(dim=1)
    finite = torch.isfinite(spread)
    usable = finite & (spread > 0)
    info = torch.finfo(X.dtype)  # the scale itself must be a normal number of X's type
    power = torch.where(usable, -torch.floor(torch.log2(torch.where(usable, spread, 1.0))), 0.0)
    power = power.clamp(math.log2(info.tiny), math.floor(math.log2(info.max)))
    X.mul_(torch.exp2(power).to(X.dtype)[:, None, None])
    X.masked_fill_(~finite[:, None, None], 0)
    return finite


def _batch_class_ids(lab: Any, valid: Any, k: int) -> Any:
    """Each sample's class renumbered within its own step, in order of class
    (steps x n, values in 0..n-1), with fixed shapes and no host sync: sort
    each row, count the distinct labels before each position. Samples with
    invalid labels share one number past the valid ones (they carry zero
    weight)."""
    import torch

    key, order = torch.where(valid, lab, k).sort(dim=1)
    new = torch.ones_like(key, dtype=torch.bool)
    new[:, 1:] = key[:, 1:] != key[:, :-1]
    return torch.empty_like(key).scatter_(1, order, new.cumsum(dim=1) - 1)


# The route of a CPU group's Gram matrices: None chooses by torch's thread
# count (benchmarks/bench_monitor.py, 2 cores: with torch on one thread the
# core's ssyrk and float64 centering cost 5.3-6.6% of a step against 7.6-9.6%
# for torch's batched product; with torch on two threads torch's product, on
# its own still-spinning OpenMP pool, costs 5.6-6.3% against 8.4-9.0% for
# the core's workers, which contend with that pool). True/False force the
# core/torch route (tests). Device buffers always take the torch route.
CORE_GRAMS: Optional[bool] = None


def core_route(x: Any) -> bool:
    """Whether the Grams of the buffer ``x`` are made by the core (``CORE_GRAMS``)."""
    import torch

    if x.device.type != "cpu":
        return False
    return CORE_GRAMS if CORE_GRAMS is not None else torch.get_num_threads() == 1


class OneBatchRoute:
    """The group of one-batch windows waiting for their reduction, and (on a
    GPU) the reduced groups on their way to the host. ``finish_records(meta,
    rows)`` finishes and emits a reduced group's records (``GroupMeta``)."""

    def __init__(self, lag: Optional[int], precision: Optional[str], rtol: Optional[float],
                 finish_records: Callable[[GroupMeta, np.ndarray], None], eig: bool = False,
                 raw_eig: bool = False) -> None:
        self.lag, self.precision, self.rtol = lag, precision, check_rtol(rtol)
        self.eig = eig  # reduce the Grams' eigenvalues too (spectral representation diagnostics)
        self.raw_eig = raw_eig  # and the uncentered Grams' (RankMe)
        self.finish_records = finish_records
        self.group: Optional[BatchGroup] = None
        self.inflight: list = []  # (meta, pinned host buffer, CUDA event) of records on their way
        self.classes: Optional[int] = None

    def add(self, feats: Any, outs: Any, labels: Any, head: Any, meta: StepMeta, threads: BlasThreads) -> None:
        """Queue one step; a step that does not fit the group reduces the group first."""
        import torch

        parts = {"features": feats}
        if outs is not None:
            parts["outputs"] = outs
        if labels is not None:
            parts["labels"] = labels
        g = self.group
        if g is not None and not g.fits(parts):
            self.reduce(threads)
            g = self.group = None
        if g is None:
            if labels is not None and self.classes is None:
                self.classes = (head.out_features if isinstance(head, torch.nn.Linear)
                                else int(labels.max()) + 1)  # one sync, on the first group only
            lag = self.lag if self.lag is not None else (16 if feats.device.type == "cpu" else 64)
            g = self.group = BatchGroup(parts, lag, self.classes or 0, self.eig, self.raw_eig)
        g.add(parts, meta)

    def due(self, step: int) -> bool:
        """Whether the group is full or its first step is ``lag`` steps old at ``step``."""
        g = self.group
        return g is not None and bool(g.metas) and (len(g.metas) >= g.capacity
                                                    or step - g.metas[0].step + 1 >= g.lag)

    def reduce(self, threads: BlasThreads) -> None:
        """Reduce the queued one-batch windows. On the CPU their records are
        finished and dispatched at once; on a GPU the small matrices are copied
        to pinned host memory behind a CUDA event, and a later ``poll`` finishes
        them once the event has passed: the training loop never waits."""
        import torch

        g = self.group
        if g is None or not g.metas:
            return
        x, f = g.x, g.f
        all64 = x.dtype == torch.float64 and (f is None or f.dtype == torch.float64)
        prec = default_precision(self.precision, all64)
        rtol = rtol_for(prec, self.rtol)
        try:
            packed = g.reduce(prec, threads, core_route(x), rtol)
            n = int(x.shape[1])
            meta = GroupMeta(list(g.metas), n, n if g.sample_space else (0 if f is None else int(f.shape[2])),
                             g.label_cols if g.y is not None else 0, rtol, g.sample_space, n if g.eig else 0,
                             int(x.shape[2]), g.raw)
        finally:
            g.clear()  # the buffers are reused by the next group (same stream: ordered)
        if packed.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=torch.float64, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(packed.device))
            self.inflight.append((meta, host, event))
        else:
            self.finish_records(meta, packed.numpy())

    def poll(self, wait: bool = False) -> None:
        """Finish and dispatch device records whose copy has landed (all of them when ``wait``)."""
        while self.inflight:
            meta, host, event = self.inflight[0]
            if not wait and not event.query():
                return
            event.synchronize()
            self.inflight.pop(0)
            self.finish_records(meta, host.numpy())


def finish_group(v: np.ndarray, meta: GroupMeta, measures: tuple = ()) -> tuple:
    """DLR, rank, NC1 and the representation diagnostics in ``measures`` of
    each row of ``BatchGroup.reduce`` (float64, host), as
    ``finish.samplespace.finish_steps`` gives them: the packed ``GramRows``,
    and with outputs (``meta.c`` > 0) one last column, each step's active
    features."""
    active = None
    if meta.c > 0:  # the last column: each step's active features (BatchGroup.reduce)
        v, active = v[:, :-1], v[:, -1]
    rows = GramRows.unpack(v, meta.c, meta.k, meta.e, meta.r)
    return finish_steps(rows, meta.n, meta.rtol, meta.sample_space, measures, active)
