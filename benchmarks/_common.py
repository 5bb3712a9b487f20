"""Functions shared by the benchmark scripts (compare.py; cpu_side_by_side.py keeps its own).

Nothing here is part of the package. Three things every benchmark needs and
must get right the same way:

* peak memory of a process: VmHWM from /proc/self/status. Not ru_maxrss,
  which keeps the parent's peak across fork+exec, so a fresh interpreter
  started from a big parent would report the parent's size;
* data larger than memory: a raw float32 file read through np.memmap in
  batches, with the pages of each finished batch dropped from the process
  (MADV_DONTNEED), so that VmHWM counts the method, not the file;
* the exact answer: DLR from float64 co-moments of a two-pass float64
  computation (docs/MATH.md, feature-space form), the yardstick for every error.
"""

from __future__ import annotations

import json
import mmap
import os
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np


# -- output --------------------------------------------------------------------

def print_and_save(result: dict, path: Optional[str] = None) -> None:
    """A benchmark's result as indented JSON on stdout, and into ``path`` when one is given."""
    print(json.dumps(result, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


# -- memory --------------------------------------------------------------------

def proc_status_mb(key: str = "VmHWM") -> float:
    """A /proc/self/status field in MB (VmHWM: peak resident set; VmRSS: now)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    raise KeyError(key)


# -- exact answers ---------------------------------------------------------------

def dlr_from_comoments(M: np.ndarray, B: np.ndarray, A: np.ndarray, rtol: float = 1e-10) -> float:
    """DLR = 1 - tr(B A^+ B^T) / (||M||_F sqrt(r)), r = #{a_i > rtol a_max} (docs/MATH.md,
    feature-space form), in float64."""
    M, B, A = (np.asarray(a, dtype=np.float64) for a in (M, B, A))
    a, U = np.linalg.eigh((A + A.T) / 2)
    keep = a > rtol * a.max()
    BU = B @ U[:, keep]
    return float(1.0 - np.sum(BU * BU / a[keep]) / (np.linalg.norm(M) * np.sqrt(keep.sum())))


def dlr_from_raw_sums(n: int, sx, sf, S, XF, FF, rtol: float = 1e-5) -> float:
    """What a user of the plain accumulation loop does at the end: raw sums
    (sum x, sum f, X^T X, X^T F, F^T F) widened to float64, then
    M = S - n mu mu^T etc. The cancellation in that subtraction is the
    precision the loop loses when features have a mean (docs/MATH.md, streaming
    estimator)."""
    sx, sf, S, XF, FF = (np.asarray(a, dtype=np.float64) for a in (sx, sf, S, XF, FF))
    mu, nu = sx / n, sf / n
    M = S - n * np.outer(mu, mu)
    B = XF - n * np.outer(mu, nu)
    A = FF - n * np.outer(nu, nu)
    return dlr_from_comoments(M, B, A, rtol)


def dlr_head_from_raw_sums(n: int, sx, S, W, rtol: float = 1e-5) -> float:
    """Linear-head shortcut from raw sums: B = M W^T, A = W M W^T."""
    sx, S, W = (np.asarray(a, dtype=np.float64) for a in (sx, S, W))
    mu = sx / n
    M = S - n * np.outer(mu, mu)
    B = M @ W.T
    return dlr_from_comoments(M, B, W @ B, rtol)


def exact_comoments(batches) -> Tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """float64 co-moments (n, M, B, A) of a stream of (x, f) batches, exact to float64 rounding:
    batch-centered float64 products merged with Chan's formula (a two-pass
    result without holding the data; tests check this form against the n x n oracle)."""
    n = 0
    mu = nu = M = B = A = None
    for x, f in batches:
        x = np.asarray(x, dtype=np.float64)
        f = np.asarray(f, dtype=np.float64)
        b = x.shape[0]
        mx, mf = x.mean(0), f.mean(0)
        xc, fc = x - mx, f - mf
        Mb, Bb, Ab = xc.T @ xc, xc.T @ fc, fc.T @ fc
        if n == 0:
            n, mu, nu, M, B, A = b, mx, mf, Mb, Bb, Ab
            continue
        tot = n + b
        dx, df = mx - mu, mf - nu
        w = n * b / tot
        M = M + Mb + w * np.outer(dx, dx)
        B = B + Bb + w * np.outer(dx, df)
        A = A + Ab + w * np.outer(df, df)
        mu, nu, n = mu + dx * b / tot, nu + df * b / tot, tot
    return n, M, B, A


def naive_dlr(X: np.ndarray, F: np.ndarray) -> Tuple[float, float]:
    """The n x n formula in float64: K = H X X^T H, P = Q Q^T with Q an
    orthonormal basis of H F; DLR = 1 - <K, P>_F / (||K||_F ||P||_F).
    Returns (dlr, bytes of the two n x n matrices). A test oracle: O(n^2) memory."""
    X = np.asarray(X, dtype=np.float64)
    F = np.asarray(F, dtype=np.float64)
    Xc = X - X.mean(0)
    Q = orthonormal_centered(F)
    K = Xc @ Xc.T
    P = Q @ Q.T
    cka = float(np.vdot(K, P) / (np.linalg.norm(K) * np.linalg.norm(P)))
    return 1.0 - cka, K.nbytes + P.nbytes


def orthonormal_centered(F: np.ndarray, rtol: float = 1e-10) -> np.ndarray:
    """Orthonormal basis (n x r, float64) of the span of the centered outputs H F:
    Q Q^T is the projector of docs/MATH.md ("Which projector"), so linear
    CKA(X, Q) = 1 - DLR."""
    F = np.asarray(F, dtype=np.float64)
    U, s, _ = np.linalg.svd(F - F.mean(0), full_matrices=False)
    return U[:, s * s > rtol * s[0] * s[0]]


# -- data ----------------------------------------------------------------------

def generate(path: str, n: int, p: int, c: int, seed: int = 0, chunk: int = 65536) -> dict:
    """Raw float32 files ``path.x`` (n x p) and ``path.f`` (n x c) plus ``path.json``.

    The same model as cpu_side_by_side.make_data: correlated Gaussian features
    (z @ mix) with a mean of 0.5 and a linear head f = x W^T + b. Written chunk
    by chunk; reused when the files exist with the same shape and seed."""
    meta = {"n": n, "p": p, "c": c, "seed": seed, "x": path + ".x", "f": path + ".f", "head": path + ".head.npz"}
    if os.path.exists(path + ".json"):
        with open(path + ".json") as fh:
            if json.load(fh) == meta and os.path.getsize(meta["x"]) == 4 * n * p:
                return meta
    rng = np.random.default_rng(seed)
    mix = (rng.normal(size=(p, p)) / np.sqrt(p)).astype(np.float32)
    W = (rng.normal(size=(c, p)) / np.sqrt(p)).astype(np.float32)
    b = rng.normal(size=c).astype(np.float32)
    np.savez(meta["head"], W=W, b=b)
    with open(meta["x"], "wb") as fx, open(meta["f"], "wb") as ff:
        for s in range(0, n, chunk):
            m = min(chunk, n - s)
            x = rng.standard_normal(size=(m, p), dtype=np.float32) @ mix + np.float32(0.5)
            fx.write(np.ascontiguousarray(x, dtype=np.float32).tobytes())
            ff.write(np.ascontiguousarray(x @ W.T + b, dtype=np.float32).tobytes())
    with open(path + ".json", "w") as fh:
        json.dump(meta, fh)
    return meta


class Stream:
    """Batches (x, f) of the first ``n`` rows of memory-mapped float32 files.

    After a batch has been used its pages are dropped from this process
    (MADV_DONTNEED; they stay in the page cache), so a method's peak resident
    memory does not grow with n because of the mapping itself."""

    def __init__(self, xpath: str, fpath: Optional[str], rows: int, p: int, c: int, n: int, batch: int):
        self.X = np.memmap(xpath, dtype=np.float32, mode="r", shape=(rows, p))
        self.F = np.memmap(fpath, dtype=np.float32, mode="r", shape=(rows, c)) if fpath else None
        self.n, self.batch = min(n, rows), batch

    @staticmethod
    def _release(mm: np.memmap, start: int, stop: int) -> None:
        width = mm.shape[1] * mm.itemsize
        lo = (start * width) // mmap.PAGESIZE * mmap.PAGESIZE
        hi = stop * width
        mm._mmap.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def __iter__(self):
        for s in range(0, self.n, self.batch):
            e = min(s + self.batch, self.n)
            yield self.X[s:e], (self.F[s:e] if self.F is not None else None)
            self._release(self.X, s, e)
            if self.F is not None:
                self._release(self.F, s, e)


def warm_page_cache(paths: Sequence[str], max_bytes: int = 8 << 30) -> None:
    """Read files once so that every method streams them from the page cache."""
    for path in paths:
        with open(path, "rb", buffering=0) as fh:
            done = 0
            while done < max_bytes and fh.read(64 << 20):
                done += 64 << 20


# -- timing ----------------------------------------------------------------------

def interleaved(cases: Dict[str, Callable[[], float]], repeats: int) -> Dict[str, List[float]]:
    """Run every case once per round, ``repeats`` rounds, so that drifts in the
    load of a shared machine hit all cases alike. Each case returns its own
    time in seconds (setup excluded)."""
    times: Dict[str, List[float]] = {k: [] for k in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            times[name].append(fn())
    return times


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def timed(fn: Callable, *args, **kwargs) -> Tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out
