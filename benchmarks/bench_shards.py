"""Sharded float16 features: ``richness eval`` on the shards in one process
against ``richness.dask.moments`` on a LocalCluster of 1 and 2
single-threaded worker processes, same files, same run.

Writes ``--shards`` .npy files of float16 features (low-rank plus noise plus
a mean), their int64 labels (``--classes`` classes) and float32 head weights
(classes x p), then, in this order:

* the CLI in a fresh interpreter, its core on 1 thread and on 2
  (OPENBLAS_NUM_THREADS), ``richness eval 'DIR/features-*.npy' --labels
  'DIR/labels-*.npy' --head W --json``: wall time of ``main``, the same less
  the finishing (``Moments.compute``), and the process's peak resident set
  (VmHWM);
* ``richness.dask.moments`` on a ``LocalCluster(n_workers=k,
  threads_per_worker=1, processes=True)`` for k = 1, 2 (the nanny runs each
  worker's BLAS, so the core, on one thread), the shards read by the
  README's "list of .npy files" recipe (each memory-mapped by the worker that
  reads it; ``--copy-reads``: read into memory by ``np.load``, as the recipe
  did before), one chunk per shard; with the default ``chunks_per_task``
  (about two tasks per worker thread), one state per shard, and one per
  ``--chunks-per-task`` shards (default 5); then ``compute(head_weights=W)``.
  Wall time from building the graph to the report, and to the reduced
  ``Moments`` (the cluster's start is given apart) and each worker's peak resident set (VmHWM, read on the
  worker after the run; it includes the worker's own interpreter, whose
  resident set before the run is given too). The driver runs in a fresh
  interpreter with the CLI run's BLAS threads (the finishing runs there).

Each round runs the CLI and the three dask runs at 1, then at 2, each after reading every file once (the
shards in the page cache for every run alike); ``--repeat`` rounds (default 2).

    python benchmarks/bench_shards.py [--dir DIR (default: richness-shards in the temp folder)] [--shards 20]
                                      [--rows 15000] [--features 1024] [--classes 1000] [--keep] [--copy-reads]

The files are deleted afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import sys
import time

import numpy as np

from _common import print_and_save
from bench_eval_large import CHILD  # richness.cli.main in a fresh interpreter, its wall time and VmHWM

# The same, with the time of Moments.compute (the finishing) noted apart.
TIMED_CHILD = """
import time, richness
_compute = richness.Moments.compute
def compute(self, *a, **k):
    t = time.time()
    try:
        return _compute(self, *a, **k)
    finally:
        print(f"@@finish_s={time.time() - t:.2f}", file=sys.stderr)
richness.Moments.compute = compute
""" + CHILD


def proc_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def generate(folder: str, shards: int, rows: int, p: int, classes: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    rank = 64
    basis = rng.standard_normal((rank, p), dtype=np.float32) * np.linspace(3.0, 0.3, rank, dtype=np.float32)[:, None]
    for i in range(shards):
        z = rng.standard_normal((rows, rank), dtype=np.float32)
        x = z @ basis
        x += rng.standard_normal(x.shape, dtype=np.float32)
        x += 1.0
        np.save(os.path.join(folder, f"features-{i:05d}.npy"), x.astype(np.float16))
        np.save(os.path.join(folder, f"labels-{i:05d}.npy"), rng.integers(0, classes, rows))
    np.save(os.path.join(folder, "head.npy"),
            (rng.standard_normal((classes, p)) / np.sqrt(p)).astype(np.float32))


def warm(folder: str) -> None:
    """Read every file once, so that each run starts with the shards in the
    page cache: the CLI drops the pages it has read (posix_fadvise
    DONTNEED), which would leave the run after it to read from the disk."""
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb", buffering=0) as f:
            while f.read(1 << 23):
                pass


def run_cli(folder: str, threads: int) -> dict:
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-c", "import sys" + TIMED_CHILD, "eval", os.path.join(folder, "features-*.npy"), "--labels",
           os.path.join(folder, "labels-*.npy"), "--head", os.path.join(folder, "head.npy"), "--json",
           "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0 or "@@" not in r.stderr:
        sys.exit(f"eval failed: {r.stderr[-2000:]}")
    stats = dict(kv.split("=") for kv in r.stderr.strip().splitlines()[-1].split()[1:])
    finish = float(next(ln for ln in r.stderr.splitlines() if ln.startswith("@@finish_s=")).split("=")[1])
    rep = json.loads(r.stdout)
    return {"route": f"CLI, 1 process, {threads} core thread{'s' if threads > 1 else ''}",
            "wall_s": float(stats["wall_s"]), "reduce_s": round(float(stats["wall_s"]) - finish, 2),
            "peak_mb": [float(stats["vmhwm_mb"])], "dlr": rep["dlr"],
            "nc1": rep["nc1"], "n": rep["n"]}


def run_dask(folder: str, workers: int, per_task: int, mmap: bool = True) -> dict:
    """``per_task`` 0: the default ``chunks_per_task``."""
    import dask
    import dask.array as da
    import distributed

    import richness.dask

    t0 = time.time()
    cluster = distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                       dashboard_address=None, silence_logs=40)
    client = distributed.Client(cluster)
    start_s = time.time() - t0
    try:
        client.wait_for_workers(workers)
        before = client.run(proc_mb, "VmRSS")
        blas = client.run(lambda: __import__("richness")._core.blas_info())
        t0 = time.time()
        paths = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.startswith("features-"))
        lpaths = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.startswith("labels-"))
        # the README's recipe for a list of .npy files: shapes from the headers, data read on the workers
        read = {"mmap_mode": "r"} if mmap else {}
        heads = [np.load(p, mmap_mode="r") for p in paths]
        feats = da.concatenate([da.from_delayed(dask.delayed(np.load)(p, **read), h.shape, h.dtype)
                                for p, h in zip(paths, heads)])
        lheads = [np.load(p, mmap_mode="r") for p in lpaths]
        labels = da.concatenate([da.from_delayed(dask.delayed(np.load)(p, **read), h.shape, h.dtype)
                                 for p, h in zip(lpaths, lheads)])
        del heads, lheads
        m = richness.dask.moments(feats, labels=labels, **({"chunks_per_task": per_task} if per_task else {}))
        reduce_s = time.time() - t0
        rep = m.compute(head_weights=np.load(os.path.join(folder, "head.npy")))
        wall = time.time() - t0
        peak = client.run(proc_mb, "VmHWM")
    finally:
        client.close()
        cluster.close()
    grouping = ("default chunks_per_task" if not per_task else
                f"{per_task} shard{'s' if per_task > 1 else ''} per state")
    return {"route": f"richness.dask, LocalCluster {workers} worker{'s' if workers > 1 else ''} x 1 thread, "
                     f"{grouping}", "reads": "mmap" if mmap else "np.load copy",
            "wall_s": round(wall, 2), "reduce_s": round(reduce_s, 2), "peak_mb": sorted(peak.values()),
            "before_mb": sorted(before.values()),
            "cluster_start_s": round(start_s, 1), "dlr": rep.dlr, "nc1": rep.nc1, "n": rep.n,
            "blas": sorted(set(blas.values()))}


def dask_in_child(folder: str, workers: int, threads: int, per_task: int, mmap: bool) -> dict:
    """run_dask in a fresh interpreter whose own BLAS (the finishing's) has
    ``threads`` threads, as the CLI run it is compared with."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads))
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--dir", folder, "--dask-child", str(workers),
                        "--chunks-per-task", str(per_task)] + ([] if mmap else ["--copy-reads"]),
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"dask run failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "richness-shards"))
    ap.add_argument("--shards", type=int, default=20)
    ap.add_argument("--rows", type=int, default=15000, help="rows per shard")
    ap.add_argument("--features", type=int, default=1024)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--repeat", type=int, default=2, help="rounds of the eight runs")
    ap.add_argument("--chunks-per-task", type=int, default=5, help="shards per state in the grouped dask runs")
    ap.add_argument("--copy-reads", action="store_true", help="the dask runs read each shard into memory (np.load) "
                    "instead of memory-mapping it")
    ap.add_argument("--dask-child", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dask_child:
        print(json.dumps(run_dask(args.dir, args.dask_child, args.chunks_per_task, not args.copy_reads)))
        return
    os.makedirs(args.dir, exist_ok=True)
    need = args.shards * args.rows * (args.features * 2 + 8)
    if shutil.disk_usage(args.dir).free < 1.5 * need:
        sys.exit(f"not enough disk in {args.dir} for {need / 1e9:.1f} GB")
    t0 = time.time()
    if not os.path.exists(os.path.join(args.dir, "head.npy")):
        generate(args.dir, args.shards, args.rows, args.features, args.classes)
    gen_s = time.time() - t0
    try:
        load = [os.getloadavg()]
        runs = []
        for _ in range(args.repeat):
            for k in (1, 2):
                for per in (None, 0, 1, args.chunks_per_task):
                    warm(args.dir)
                    runs.append(run_cli(args.dir, k) if per is None else
                                dask_in_child(args.dir, k, k, per, not args.copy_reads))
        load.append(os.getloadavg())
    finally:
        if not args.keep:
            shutil.rmtree(args.dir)
    out = {"shards": args.shards, "rows": args.shards * args.rows, "features": args.features,
           "classes": args.classes, "generate_s": round(gen_s, 1), "runs": runs, "load_avg": load,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print_and_save(out, args.json)


if __name__ == "__main__":
    main()
