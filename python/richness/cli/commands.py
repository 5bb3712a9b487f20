"""The commands ``richness eval``, ``richness plot`` and ``richness info``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from typing import Optional

from .. import _io
from . import UserError
from .readers import ArrayFile, head_weights, open_or_bundle, split_spec, width

log = logging.getLogger("richness")

# Rows per chunk are capped so that one chunk of one stream stays under this.
_CHUNK_BYTES = 1 << 28


def _bar(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="sample", unit_scale=True, desc=desc, dynamic_ncols=True, file=sys.stderr)


def _stream(feats: ArrayFile, outs: Optional[ArrayFile], labels: Optional[ArrayFile], targets: Optional[ArrayFile],
            *, chunk: int, precision: Optional[str], num_classes: Optional[int], progress: bool, desc: str):
    from .. import Moments

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
    if feats.rows < 2:
        raise UserError(f"{feats.label}: need at least 2 samples, got {feats.rows}")
    try:
        m = Moments(num_classes, precision=precision)
    except ValueError as e:
        raise UserError(str(e)) from None
    streams = [f for f in (feats, outs, labels, targets) if f is not None]
    # rows per chunk: at most _CHUNK_BYTES per stream, whatever the width
    chunk = max(1, min(chunk, _CHUNK_BYTES // max(max(f.row_bytes() for f in streams), 1)))
    # the state (and one chunk of every stream) must fit before anything is read
    widths = {"p": width(feats), "c": width(outs) if outs else -1, "t": width(targets) if targets else -1,
              "k": num_classes or -1}
    _io.check_memory(_io.state_bytes(widths) + chunk * sum(f.row_bytes() for f in streams),
                     f"{feats.label}: the state at p={widths['p']}"
                     + (f" with {num_classes} classes" if num_classes else ""))
    bar = _bar(feats.rows, progress, desc)
    try:
        for a in range(0, feats.rows, chunk):
            b = min(a + chunk, feats.rows)
            args = [feats.chunk(a, b), outs.chunk(a, b) if outs else None, labels.chunk(a, b) if labels else None,
                    targets.chunk(a, b) if targets else None]
            try:
                m.update(*args)
            except (ValueError, TypeError, MemoryError) as e:
                msg = str(e)
                src = feats
                for word, f in (("labels", labels), ("outputs", outs), ("targets", targets)):
                    if f is not None and msg.startswith(word):
                        src = f
                raise UserError(f"{src.label}: rows {a}..{b - 1}: {msg}") from None
            for f in (feats, outs, labels, targets):
                if f is not None:
                    f.release(b)
            if bar is not None:
                bar.update(b - a)
    finally:
        if bar is not None:
            bar.close()
    return m


def eval_cmd(args: argparse.Namespace) -> int:
    _check_eval_args(args)
    feats = ArrayFile(args.features, default_key="features")
    # a bundle (FILE without :KEY) also supplies its outputs, labels and targets
    bundle = None if feats.explicit_key else feats
    outs = open_or_bundle(args.outputs, bundle, "outputs")
    labels = open_or_bundle(args.labels, bundle, "labels")
    targets = open_or_bundle(args.targets, bundle, "targets")
    if args.test_features is not None:
        for given, train, what in ((args.test_outputs, outs, "outputs"), (args.test_labels, labels, "labels"),
                                   (args.test_targets, targets, "targets")):
            if given is not None and train is None:
                raise UserError(f"--test-{what} {given}: the training set has no {what} (give --{what})")
    for f, what in ((feats, "features"), (outs, "outputs"), (labels, "labels"), (targets, "targets")):
        if f is not None:
            log.info("%s: %s, shape %s, %s", what, f.label, f.shape, "bfloat16" if f.bf16 else f.dtype)
    W = head_weights(args.head)
    if W is not None and W.shape[1] != feats.shape[1]:
        raise UserError(f"{args.head}: head weights have {W.shape[1]} input columns but {feats.label} has "
                        f"{feats.shape[1]} features")
    progress = not args.no_progress
    m = _stream(feats, outs, labels, targets, chunk=args.chunk, precision=args.precision,
                num_classes=args.num_classes, progress=progress, desc="richness eval")
    test = None
    if args.test_features is not None:
        tfeats = ArrayFile(args.test_features, default_key="features")
        tbundle = None if tfeats.explicit_key else tfeats
        if tfeats.shape[1:] != feats.shape[1:]:
            raise UserError(f"{tfeats.label}: has {tfeats.shape[1:]} features per sample, the training set "
                            f"{feats.shape[1:]}")
        touts = open_or_bundle(args.test_outputs, tbundle, "outputs") if outs is not None else None
        tlabels = open_or_bundle(args.test_labels, tbundle, "labels") if labels is not None else None
        ttargets = open_or_bundle(args.test_targets, tbundle, "targets") if targets is not None else None
        for train, held, what in ((outs, touts, "outputs"), (targets, ttargets, "targets")):
            if held is not None and width(held) != width(train):
                raise UserError(f"{held.label}: held-out {what} have {width(held)} columns but the training "
                                f"{what} ({train.label}) have {width(train)}")
        test = _stream(tfeats, touts, tlabels, ttargets, chunk=args.chunk, precision=args.precision,
                       num_classes=args.num_classes, progress=progress, desc="richness eval (held-out)")
    try:
        rep = m.compute(head=W, test=test, rtol=args.rtol)
    except ValueError as e:
        raise UserError(f"{feats.label}: {e}") from None
    if outs is None and W is None:
        print(f"richness: note: no outputs or --head given for {feats.label}: spectrum and curves only, no DLR",
              file=sys.stderr)
    # the report first: a state that cannot be written must not lose it
    if args.json:
        print(json.dumps(rep.to_dict()), flush=True)
        for w in rep.warnings:  # stdout is JSON for a program; the caveats also go where a person looks
            log.warning("warning: %s", w)
    else:
        print(rep)
        _print_reference(rep)
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


def _same_file(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)  # hard links
    except OSError:
        return False


def _check_eval_args(args: argparse.Namespace) -> None:
    """Refuse what would silently do something else than asked, before any data is read."""
    if args.test_features is None:
        for opt in ("test_outputs", "test_labels", "test_targets"):
            if getattr(args, opt) is not None:
                raise UserError(f"--{opt.replace('_', '-')} needs --test-features")
    inputs = [split_spec(spec)[0] for spec in (args.features, args.outputs, args.labels, args.targets, args.head,
                                                args.test_features, args.test_outputs, args.test_labels,
                                                args.test_targets) if spec is not None]
    saves = [(opt, path) for opt, path in (("--save", args.save), ("--save-test", args.save_test)) if path]
    for opt, path in saves:
        for src in inputs:
            if _same_file(path, src):
                raise UserError(f"{opt} {path}: is an input file ({src}); saving would overwrite it")
    if len(saves) == 2 and _same_file(args.save, args.save_test):
        raise UserError(f"--save and --save-test name the same file ({args.save}); the held-out state would "
                        "overwrite the training state")


def _print_reference(rep) -> None:
    """DLR beside the lazy end it is read against: isotropic features of the same n, active
    features and logit rank (a fully lazy random network at small n prints DLR well below 1)."""
    if rep.dlr is None or rep.dlr_isotropic is None:
        return
    ratio = "n/a" if rep.dlr_normalized is None else f"{rep.dlr_normalized:.3f}"
    print(f"isotropic reference {rep.dlr_isotropic:.4f}   DLR/iso {ratio}")  # DLR itself is on the report's line
    print("how to read: DLR/iso near 1 = as lazy as isotropic (random) features at this n, p and rank; "
          "near 0 = rich (docs/READING_DLR.md)")


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
                rep = m.compute(head=W, test=test)
                paths = plot.curves(rep, out, title=args.title or f"{name}: DLR "
                                    + ("n/a" if rep.dlr is None else f"{rep.dlr:.3f}") + f", n = {rep.n}")
            else:
                raise UserError(f"{path}: unknown input; give a saved state (.npz) or a Monitor log (.jsonl/.csv)")
    except ValueError as e:
        msg = str(e)
        raise UserError(msg if msg.startswith(path) or (args.test and msg.startswith(args.test)) else f"{path}: {msg}") \
            from None
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
        print('torch: not installed (evaluate/Monitor need pip install "richness[torch]")')
    return 0
