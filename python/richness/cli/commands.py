"""The commands ``richness eval``, ``richness plot`` and ``richness info``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from typing import Any, Dict, Optional

import numpy as np

from .._engine import bounded_io as _bounded_io
from .._engine import statefile as _statefile
from .._optional import pip_extra
from ..finish.spectrum import held_out_mismatch
from . import UserError
from .files import check_targets
from .formats import ArrayFile, open_array, split_spec
from .shards import Layout, Shard, Shards, scan

__all__ = []

log = logging.getLogger("richness")

# Rows per chunk are capped so that one chunk of one stream stays under this.
_CHUNK_BYTES = 1 << 28


def head_weights(spec: Optional[str]):
    """The head's weights (outputs x features) from the array file ``spec``, read
    whole as float64; None when no file is given."""
    if spec is None:
        return None
    f = open_array(spec)
    try:
        f.check_float("head weights")
        if len(f.shape) != 2:
            raise UserError(f"{f.label}: head weights must be 2-D (outputs, features), got shape {f.shape}")
        _bounded_io.check_memory(2 * 8 * f.rows * f.shape[1],
                                 f"{f.label}: the head weights (read whole, as float64)")
        return np.array(f.chunk(0, f.rows), dtype=np.float64)
    finally:
        f.close()


def _bar(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="sample", unit_scale=True, desc=desc, dynamic_ncols=True, file=sys.stderr)


def _check_shard(sh: Shard) -> None:
    """The checks of one shard's files, before any data is read."""
    feats, outs, labels, targets = sh
    feats.check_float("features")
    if len(feats.shape) != 2:
        raise UserError(f"{feats.label}: features must be 2-D (samples, features), got shape {feats.shape}")
    if outs is not None:
        outs.check_float("outputs")
    if targets is not None:
        targets.check_float("targets")
    if labels is not None:
        if labels.dtype.kind not in "iu" or labels.bf16:
            raise UserError(f"{labels.label}: labels must be integers, got {labels.dtype}")
        if len(labels.shape) != 1:
            raise UserError(f"{labels.label}: labels must be 1-D (one class per sample), got shape {labels.shape}")
    for other in (outs, labels, targets):
        if other is not None and other.rows != feats.rows:
            raise UserError(f"{other.label}: has {other.rows} rows but {feats.label} has {feats.rows}")


def _stream(shards: Shards, layout: Layout, *, chunk: int, precision: Optional[str], num_classes: Optional[int],
            progress: bool, desc: str):
    """One Moments over every shard of a set, each read in row chunks."""
    from .. import Moments

    if layout.rows < 2:
        raise UserError(f"{layout.label}: need at least 2 samples, got {layout.rows}")
    try:
        m = Moments(num_classes, precision=precision)
    except ValueError as e:
        raise UserError(str(e)) from None
    # rows per chunk: at most _CHUNK_BYTES per stream, whatever the width
    chunk = max(1, min(chunk, _CHUNK_BYTES // max(layout.row_bytes, 1)))
    # the state (and one chunk of every stream) must fit before anything is read
    widths = {**_widths(layout), "k": num_classes or -1}
    _bounded_io.check_memory(_statefile.state_bytes(widths) + chunk * layout.row_bytes,
                     f"{layout.label}: the state at p={widths['p']}"
                     + (f" with {num_classes} classes" if num_classes else ""))
    bar = _bar(layout.rows, progress, desc)
    try:
        for i in range(len(shards)):
            shard = shards.open(i)  # checked against what the scan saw
            try:
                _stream_shard(m, shard, chunk, bar)
                shards.check_unchanged(shard)  # and not rewritten while it was read
            finally:
                shard.close()
    finally:
        if bar is not None:
            bar.close()
    return m


def _widths(layout: Any) -> Dict[str, int]:
    """The widths of a scanned set's streams, as a state names them (``p``, ``c``, ``t``; -1: not streamed)."""
    sh = layout.shapes
    return {"p": sh["features"][0], "c": _width(sh.get("outputs")), "t": _width(sh.get("targets"))}


def _width(shape: Optional[tuple]) -> int:
    """The width of a stream from its shape without rows (-1: not streamed)."""
    if shape is None:
        return -1
    return shape[0] if shape else 1


def _source(e: BaseException, shard: Shard) -> ArrayFile:
    """The file of ``shard`` an update's error lies in: the stream the error
    names (``_core.InputError`` and ``DTypeError``, raised by the core and by
    the adapter before it, carry it as ``stream``); else the features' file
    (a refusal of the batch as a whole)."""
    stream = getattr(e, "stream", None) or "features"
    return getattr(shard, stream, None) or shard.features


def _stream_shard(m, shard: Shard, chunk: int, bar) -> None:
    feats = shard.features
    for a in range(0, feats.rows, chunk):
        b = min(a + chunk, feats.rows)
        # each chunk is added before the next is read, so the reads reuse one buffer a file
        args = [f.chunk(a, b, reuse=True) if f is not None else None for f in shard]
        try:
            m.update(*args)
        except (ValueError, TypeError, MemoryError) as e:
            raise UserError(f"{_source(e, shard).label}: rows {a}..{b - 1}: {e}") from None
        del args
        for f in shard.files():
            f.release(b)
        if bar is not None:
            bar.update(b - a)


def eval_cmd(args: argparse.Namespace) -> int:
    _check_eval_args(args)
    train = Shards(args.features, args.outputs, args.labels, args.targets)
    test_shards = None
    if args.test_features is not None:
        test_shards = Shards(args.test_features, args.test_outputs, args.test_labels, args.test_targets,
                             names=("--test-features", "--test-outputs", "--test-labels", "--test-targets"))
    # the files to write, checked against every input before anything is read
    inputs = train.files() + (test_shards.files() if test_shards is not None else [])
    if args.head is not None:
        inputs.append(split_spec(args.head)[0])
    check_targets([("--save", args.save), ("--save-test", args.save_test)], inputs, force=args.force)
    layout = scan(train, _check_shard, args.features)
    if test_shards is not None:
        for given, what in ((args.test_outputs, "outputs"), (args.test_labels, "labels"),
                            (args.test_targets, "targets")):
            if given is not None and what not in layout.streams:
                raise UserError(f"--test-{what} {given}: the training set has no {what} (give --{what})")
        test_shards.streams = layout.streams  # a held-out bundle supplies only the training set's streams
    for what in layout.streams:
        log.info("%s: %s", what, layout.described[what])
    W = head_weights(args.head)
    p = layout.shapes["features"][0]
    if W is not None and W.shape[1] != p:
        raise UserError(f"{args.head}: head weights have {W.shape[1]} input columns but {layout.label} has "
                        f"{p} features")
    test_layout = None
    if test_shards is not None:
        test_layout = scan(test_shards, _check_shard, args.test_features)
        bad = held_out_mismatch(_widths(layout), _widths(test_layout), head=W is not None)
        if bad is not None:
            what, have, want = bad
            if what == "features":
                raise UserError(f"{test_layout.label}: has {have} features per sample, the training set {want}")
            raise UserError(f"{test_layout.labels[what]}: held-out {what} have {have} columns but the training "
                            f"{what} ({layout.labels[what]}) have {want}")
    progress = not args.no_progress
    m = _stream(train, layout, chunk=args.chunk, precision=args.precision, num_classes=args.num_classes,
                progress=progress, desc="richness eval")
    test = None
    if test_shards is not None:
        assert test_layout is not None  # scanned with the held-out shards
        test = _stream(test_shards, test_layout, chunk=args.chunk, precision=args.precision,
                       num_classes=args.num_classes, progress=progress, desc="richness eval (held-out)")
    try:
        rep = m.compute(head_weights=W, test=test, rtol=args.rtol)
    except ValueError as e:
        raise UserError(f"{layout.label}: {e}") from None
    if "outputs" not in layout.streams and W is None:
        print(f"richness: note: no outputs or --head given for {layout.label}: spectrum and curves only, no DLR",
              file=sys.stderr)
    # the report first: a state that cannot be written must not lose it
    if args.json:
        print(json.dumps(rep.to_dict()), flush=True)
        for w in rep.warnings:  # stdout is JSON for a program; the caveats also go where a person looks
            log.warning("warning: %s", w)
    else:
        print(rep)  # DLR beside its isotropic reference and how to read them: Report.__str__, the one wording
        _print_curves(rep)
        sys.stdout.flush()
    for path, state in ((args.save, m), (args.save_test, test)):
        if path and state is not None:
            try:
                state.save(path)
            except OSError as e:
                raise UserError(f"{path}: cannot write the state ({e.strerror or e})") from None
            if not args.json:
                print(f"{'held-out state' if state is test else 'state'} saved to {path}")
    return 0


def _check_eval_args(args: argparse.Namespace) -> None:
    """Refuse what would silently do something else than asked, before any data is read."""
    if args.test_features is None:
        for opt in ("test_outputs", "test_labels", "test_targets"):
            if getattr(args, opt) is not None:
                raise UserError(f"--{opt.replace('_', '-')} needs --test-features")


def _print_curves(rep) -> None:
    k = rep.rank or 10
    k = min(k, rep.eigenvalues.shape[0])
    parts = []
    if rep.utilization is not None:
        parts.append(f"utilization Pi_hat({k}) {rep.utilization[k - 1]:.3f}")
    if rep.quality is not None:
        parts.append(f"quality Pi*({k}) {rep.quality[k - 1]:.3f}")
    if rep.test_utilization is not None:
        parts.append(f"held-out Pi_hat({k}) {rep.test_utilization[k - 1]:.3f}")
    if rep.test_quality is not None:
        parts.append(f"held-out Pi*({k}) {rep.test_quality[k - 1]:.3f}")
    if parts:
        print("   ".join(parts))


def plot_cmd(args: argparse.Namespace) -> int:
    from .. import Moments, plot

    path = args.input
    if not os.path.exists(path):
        raise UserError(f"{path}: no such file")
    out = args.output or os.path.splitext(path)[0] + "_richness"
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):  # as --save: nothing creates folders on the user's behalf
        raise UserError(f"{out}: cannot write the plots (No such file or directory)")
    prefix = out[:-4] if out.endswith((".png", ".svg")) else out  # as plot writes them
    inputs = [path] + [p for p in (args.test, args.head and split_spec(args.head)[0]) if p]
    check_targets([("", prefix + ".png"), ("", prefix + ".svg")], inputs, force=args.force)
    low = path.lower()
    name = plot.escape_mathtext(os.path.basename(path))  # a file name is shown as written, never as mathtext
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if low.endswith((".jsonl", ".json", ".csv")):
                paths = plot.history(plot.read_log(path), out, title=args.title or name)
            elif low.endswith(".npz"):
                m = Moments.load(path)
                test = Moments.load(args.test) if args.test else None
                W = head_weights(args.head)
                rep = m.compute(head_weights=W, test=test)
                paths = plot.curves(rep, out, title=args.title or f"{name}: DLR "
                                    + ("n/a" if rep.dlr is None else f"{rep.dlr:.3f}") + f", n = {rep.n}")
            else:
                raise UserError(f"{path}: unknown input; give a saved state (.npz) or a Monitor log (.jsonl/.csv)")
    except ValueError as e:
        msg = str(e)
        own = msg.startswith(path) or (args.test and msg.startswith(args.test))
        raise UserError(msg if own else f"{path}: {msg}") from None
    for w in caught:  # one line each, as every message of the command line
        log.warning("warning: %s%s", "" if str(w.message).startswith(path) else f"{path}: ", w.message)
    for p in paths:
        print(p)
    return 0

def info(args: argparse.Namespace) -> int:
    from .. import __version__, _core

    print(f"richness {__version__}")
    print(f"CPU backend: {_core.blas_info()}")
    try:
        from .. import _cuda  # noqa: F401

        print(f"CUDA backend: {_cuda.info()}")
    except ImportError as e:
        print(f"CUDA backend: not available ({e})")
    try:
        import torch

        cuda = torch.version.cuda or "no CUDA"
        archs = ", ".join(torch.cuda.get_arch_list()) if torch.cuda.is_available() else "none (no GPU visible)"
        print(f"torch {torch.__version__} ({cuda}), {torch.get_num_threads()} threads; GPU architectures: {archs}")
    except ImportError:
        print(f"torch: not installed (evaluate/Monitor need {pip_extra('torch')})")
    return 0
