"""The command ``richness cka A B [C ...]``: exact linear CKA between saved representations."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any, Dict, List

import numpy as np

from .._engine import bounded_io as _bounded_io
from .._engine.similarity import ESTIMATORS
from ..finish.similarity import MEASURES
from . import UserError, precision_arg
from .commands import _CHUNK_BYTES, _bar
from .files import Seen, check_targets, distinct
from .formats import ArrayFile, open_array, split_spec
from .shards import expand

__all__ = []


def _open(spec: str) -> ArrayFile:
    f = open_array(spec)
    try:
        f.check_float("a representation")
        if len(f.shape) != 2:
            raise UserError(f"{f.label}: a representation must be 2-D (samples, width), got shape {f.shape}")
        if f.shape[1] == 0:
            raise UserError(f"{f.label}: width 0: a representation needs at least one column")
    except BaseException:
        f.close()
        raise
    return f


def _shards(specs: list) -> list:
    """Each representation's shards (``shards.expand``: a file, a quoted glob or a
    directory), as lists of one length: shard i of every representation holds
    the same samples. A file reached twice within one argument is refused."""
    lists = [expand(spec) for spec in specs]
    for spec, files in zip(specs, lists):
        distinct([split_spec(f)[0] for f in files], spec)
    counts = {spec: len(files) for spec, files in zip(specs, lists)}
    if len(set(counts.values())) > 1:
        raise UserError("the representations come in different numbers of files (shards are paired by "
                        f"position): {counts}")
    return lists


def _distinct_arrays(files: List[ArrayFile]) -> None:
    """Refuse one array (the same file, the same key once resolved) given as two representations."""
    seen: Dict[tuple, str] = {}
    for f in files:
        which = (f.seen().facts["file"], f.key)  # the file as opened (links followed)
        if which in seen:
            raise UserError(f"{f.label}: the same representation as {seen[which]} (one file and array given "
                            "twice); give each representation once")
        seen[which] = f.label


def _measures(text: str) -> Any:
    """``--measures``: a comma-separated list of measure names, or ``all``; the names are checked by
    ``Similarity.compute`` (the one home of which measures exist and which state each needs)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError("no measure named; give names separated by commas, or 'all'")
    return "all" if names == ["all"] else names


def cka_cmd(args: argparse.Namespace) -> int:
    from .._engine.similarity import Similarity

    if len(args.inputs) < 2:
        raise UserError(f"{args.inputs[0]}: one representation; CKA compares at least two "
                        "(richness cka REPR REPR [REPR ...])")
    lists = _shards(args.inputs)
    check_targets([("--save", args.save)], [split_spec(f)[0] for files in lists for f in files], force=args.force)
    # Every shard is opened and checked before any data is read: the same
    # widths as shard 1, the same rows across the representations of a shard.
    shards: List[list] = []
    seen: List[List[Seen]] = []  # each file as the scan saw it: the read finds the same
    for i in range(len(lists[0])):
        files = []
        try:
            for spec in (rep[i] for rep in lists):
                files.append(_open(spec))
            _distinct_arrays(files)
            rows = {f.label: f.rows for f in files}
            if len(set(rows.values())) > 1:
                raise UserError(f"the representations hold different numbers of samples: {rows}")
            if shards:
                for f, (label, _, width, _) in zip(files, shards[0]):
                    if f.shape[1] != width:
                        raise UserError(f"{f.label}: width {f.shape[1]}, but shard 1 ({label}) has width {width}")
            shards.append([(f.label, f.rows, f.shape[1], f.row_bytes()) for f in files])
            seen.append([f.seen() for f in files])
        finally:
            for f in files:  # reopened when read: thousands of shards need no descriptors meanwhile
                f.close()
    first = shards[0]
    names = [label if len(files) == 1 else spec for (label, *_), files, spec in zip(first, lists, args.inputs)]
    n = sum(shard[0][1] for shard in shards)
    if n == 0:
        raise UserError(f"{', '.join(names)}: the representations hold no samples (0 rows); nothing to compare")
    P = sum(width for _, _, width, _ in first) + len(first)
    if args.estimator == "exact":
        chunk = max(1, min(args.chunk, _CHUNK_BYTES // max(sum(nbytes for *_, nbytes in first), 1)))
    else:  # the chunks are the minibatch estimator's batches: their size is the user's, not a memory choice
        chunk = args.chunk
    state = 8.0 * P * P * 3 if args.estimator != "minibatch" else 0.0
    grams = 16.0 * len(first) * min(chunk, n) ** 2 if args.estimator != "exact" else 0.0
    _bounded_io.check_memory(state + grams + min(chunk, n) * 8.0 * P,
                             f"the joint state of width {P}" if args.estimator != "minibatch"
                             else f"batches of {min(chunk, n)} rows of total width {P} and their Grams")
    s = Similarity(precision=args.precision, estimator=args.estimator)
    bar = _bar(n, not args.no_progress, "richness cka")
    try:
        for i in range(len(shards)):
            files = []
            try:
                for spec, before in zip((rep[i] for rep in lists), seen[i]):
                    files.append(_open(spec))
                    before.check(files[-1].seen(), files[-1].label)  # the file the scan checked
                _read_shard(s, files, names, chunk, bar, len(shards) > 1)
                for f in files:  # and not rewritten while it was read
                    f.check_unchanged()
            finally:
                for f in files:
                    f.close()
    finally:
        if bar is not None:
            bar.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            rep = s.compute(measures=args.measures)
        except ValueError as e:
            raise UserError(str(e)) from None
    if args.json:
        print(json.dumps(rep.to_dict()), flush=True)
    else:
        print(f"n = {rep.n}" + (f", {rep.batches} batches of at most {chunk} rows in the minibatch estimator"
                                if rep.batches is not None else ""))
        for i, name in enumerate(rep.names):
            print(f"  [{i}] {name} (width {rep.widths[i]})")
        for measure, mat in rep.values.items():
            print(MEASURES[measure].title)
            print("      " + "".join(f"{f'[{j}]':>9}" for j in range(len(rep.names))))
            for i in range(len(rep.names)):
                print(f"  [{i}] " + "".join(f"{v:9.5f}" if np.isfinite(v) else f"{'nan':>9}" for v in mat[i]))
        sys.stdout.flush()
    for w in caught:
        print(f"richness: warning: {w.message}", file=sys.stderr)
    if args.save:
        try:
            s.save(args.save)
        except OSError as e:
            raise UserError(f"{args.save}: cannot write the state ({e.strerror or e})") from None
        if not args.json:
            print(f"state saved to {args.save}")
    return 0


def _read_shard(s, files: List[ArrayFile], names: List[str], chunk: int, bar, sharded: bool) -> None:
    count = files[0].rows
    for a in range(0, count, chunk):
        b = min(a + chunk, count)
        batch = {name: f.chunk(a, b) for name, f in zip(names, files)}
        try:
            s.update(batch)
        except (ValueError, TypeError) as e:
            where = files[0].label if sharded else ""
            raise UserError(f"{where + ': ' if where else ''}rows {a}..{b - 1}: {e}") from None
        for f in files:
            f.release(b)
        if bar is not None:
            bar.update(b - a)


def add_parser(sub) -> None:
    from . import INT64_MAX, _integer

    c = sub.add_parser("cka", help="exact linear CKA between representations of the same samples",
                       description="Each argument is one representation (samples x width) of the same samples, "
                                   "FILE or FILE:KEY in any format `richness eval` reads, or shards (a quoted "
                                   "glob or a directory), streamed in chunks. Prints the k x k matrix of each "
                                   "measure (linear CKA exact over all samples by default, any n; CCA, SVCCA, "
                                   "PWCCA, Procrustes, shape, regression R^2, minibatch CKA on request).")
    c.add_argument("inputs", nargs="+", metavar="REPR", help="representations (at least two, each once)")
    c.add_argument("--measures", type=_measures, default=None, metavar="M[,M...]",
                   help="the measures to compute, comma-separated, or 'all' (default: cka,cka_debiased; with "
                        "--estimator minibatch cka_minibatch): " + ", ".join(MEASURES))
    c.add_argument("--estimator", choices=ESTIMATORS, default="exact",
                   help="exact (default: the joint state, every measure over all samples), minibatch (the CKA "
                        "libraries' estimator, cka_minibatch, with the chunks of --chunk rows as its batches: "
                        "no p x p state, any width), or both")
    c.add_argument("--json", action="store_true", help="print the report (names, each measure, n, widths)")
    c.add_argument("--save", help="write the similarity state (.npz), mergeable with Similarity.load/merge (a new "
                                  "file, not an input; --force replaces an existing one)")
    c.add_argument("--force", action="store_true", help="replace an existing --save file")
    c.add_argument("--precision", type=precision_arg, default=None, metavar="{fp64,fp32}",
                   help="precision of the products (default: fp64 for float64 files, else fp32)")
    c.add_argument("--chunk", type=_integer(1, INT64_MAX, "a positive number of rows"), default=8192,
                   help="rows per chunk (default 8192)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar (stderr)")
    c.set_defaults(func=cka_cmd)
