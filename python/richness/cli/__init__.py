"""Command line: ``richness demo | eval | merge | plot | info`` (also ``python -m richness``).

User errors (a missing file, a wrong shape, a bad key, a folder that cannot be
written) print one line naming the file and the problem and exit with code 2,
without a traceback. Progress and notes go to the ``richness`` logger
(``-v`` shows the info level).

The parser and the reporting of errors are here; the commands are in
:mod:`richness.cli.commands` (eval, plot, info), :mod:`richness.cli.merge` and
:mod:`richness.cli.demo`, the file readers in :mod:`richness.cli.formats`, sharded
inputs (globs, directories) in :mod:`richness.cli.shards`, and the rules every command
applies to the files it names (a file written is never an input and replaces an existing
one only with ``--force``; an input reached twice is refused; a file changed between its
check and its read is an error) in :mod:`richness.cli.files`. They are imported when the
parser is built, so that they can raise :class:`UserError` from this module.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from typing import List, Optional

from .._state import INT64_MAX

__all__ = ["UserError", "main"]

log = logging.getLogger("richness")


class UserError(Exception):
    """An error in what the user asked for: one line, exit code 2."""


def reason(e: BaseException) -> str:
    """An exception as text, its type's name when it has no message."""
    return str(e) or type(e).__name__


class _Parser(argparse.ArgumentParser):
    """argparse with a usage error as one ``richness: error:`` line, exit 2."""

    def error(self, message: str):
        self.exit(2, f"richness: error: {message} (see {self.prog} --help)\n")


def _number(convert, lo, hi, what: str):
    """An argparse type: ``convert(text)`` within [lo, hi] (nan is refused)."""
    def parse(text: str):
        try:
            v = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return v
    return parse


def _integer(lo: int, hi: int, what: str):
    return _number(int, lo, hi, what)


def _real(lo: float, hi: float, what: str):
    return _number(float, lo, hi, what)


def precision_arg(name: str) -> str:
    """A product precision named on the command line, checked by the precision table's one rule
    (``_state.precision_mode``); a GPU-only mode is refused by the core, with its own message, when
    the command makes its state on the CPU."""
    from .. import _state

    try:
        return _state.precision_mode(name).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _alphas(text: str) -> List[float]:
    from .demo import ALPHA_RANGE

    one = _real(*ALPHA_RANGE, f"alphas in [{ALPHA_RANGE[0]:g}, {ALPHA_RANGE[1]:g}]")
    return [one(a.strip()) for a in text.split(",")] if text.strip() else []




def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    from . import commands, demo, merge

    p = _Parser(prog="richness", description="Measure how rich or lazy training was (DLR).")
    p.add_argument("--version", action="version", version=f"richness {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="also log what is read and done (to stderr)")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="rich vs lazy networks on built-in data, a target-downscaled sweep, plots")
    d.add_argument("--epochs", type=_integer(1, 10**6, "a positive number of epochs"), default=20,
                   help="epochs of the rich/lazy classifiers")
    d.add_argument("--steps", type=_integer(1, 10**8, "a positive number of steps"), default=400,
                   help="full-batch steps per network of the alpha sweep")
    d.add_argument("--seed", type=_integer(0, INT64_MAX, "a non-negative integer"), default=0,
                   help="seed of the data and the initialisations (default 0)")
    d.add_argument("--alphas", type=_alphas, default="0.1,0.3,1,10",
                   help=f"comma-separated target scales of the sweep, each in [{demo.ALPHA_RANGE[0]:g}, "
                        f"{demo.ALPHA_RANGE[1]:g}] ('' to skip it)")
    d.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "richness-demo"),
                   help="folder for the plots (default richness-demo/ in the temporary folder, not the current one)")
    d.add_argument("--no-plots", action="store_true", help="print the results only, write no plots")
    d.add_argument("--no-progress", action="store_true", help="no progress bars (tqdm)")
    d.set_defaults(func=demo.demo)

    e = sub.add_parser("eval", help="DLR, spectrum and curves from saved features/outputs/labels",
                       description="Stream arrays from .npy, .npz, .safetensors, .pt (torch.load, weights only), "
                                   ".h5/.hdf5 (h5py) or .parquet (pyarrow) files (FILE or FILE:KEY) in chunks. A "
                                   "bundle (any but .npy) with arrays named features, outputs, labels, targets "
                                   "supplies them all. Parquet: one sample per row, vectors as list columns. "
                                   "Every array "
                                   "argument also takes a quoted glob or a directory (its files, of one format; "
                                   "names starting with _ or . skipped): shards read in sorted order and paired by "
                                   "position across the arguments, each file once. A file changed between the "
                                   "first check and its read is an error.")
    e.add_argument("features", help="features (samples x p): FILE or FILE:KEY, a bundle, or shards ('DIR/*.npy', DIR)")
    e.add_argument("--outputs", help="outputs / logits (samples x C)")
    e.add_argument("--labels", help="integer class labels (samples,)")
    e.add_argument("--targets", help="float regression targets (samples,) or (samples x T)")
    e.add_argument("--head", help="linear head weights W (C x p): DLR without streaming outputs")
    e.add_argument("--test-features", help="held-out features (Nystrom-extended curves)")
    e.add_argument("--test-outputs", help="held-out outputs (with --outputs and --test-features)")
    e.add_argument("--test-labels", help="held-out labels (with --labels and --test-features)")
    e.add_argument("--test-targets", help="held-out targets (with --targets and --test-features)")
    e.add_argument("--num-classes", type=_integer(1, INT64_MAX, "a positive number of classes"), default=None,
                   help="fix the classes to 0..N-1 (default: grow with the largest label)")
    e.add_argument("--precision", type=precision_arg, default=None, metavar="{fp64,fp32}",
                   help="precision of the products (default: fp64 for float64 files, else fp32)")
    e.add_argument("--rtol", type=_real(0.0, 1.0, "a relative cut in [0, 1]"), default=None,
                   help="eigenvalue cut (default by precision)")
    e.add_argument("--chunk", type=_integer(1, INT64_MAX, "a positive number of rows"), default=8192,
                   help="rows per chunk (default 8192)")
    e.add_argument("--json", action="store_true", help="print the report as one JSON object")
    e.add_argument("--save", help="write the training state (.npz) for `richness plot` or later merges (a new "
                                  "file, not an input; --force replaces an existing one)")
    e.add_argument("--save-test", help="write the held-out state (.npz)")
    e.add_argument("--force", action="store_true", help="replace an existing --save / --save-test file")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    e.set_defaults(func=commands.eval_cmd)

    mg = sub.add_parser("merge", help="merge saved states into one (exact: the state of all their samples)",
                        description="Merge states saved by `richness eval --save` or Moments.save (e.g. one per "
                                    "shard or machine). Every input is validated first; OUT is written atomically, "
                                    "and not at all when any input is refused. OUT comes first, is never one of "
                                    "the inputs, and an existing OUT is replaced only with --force.")
    mg.add_argument("out", metavar="OUT", help="the merged state (.npz): a new file (--force replaces one)")
    mg.add_argument("inputs", metavar="IN", nargs="+", help="saved states: files, quoted globs or directories "
                                                            "(each file once)")
    mg.add_argument("--json", action="store_true", help="print the merged state's report as one JSON object")
    mg.add_argument("--head", help="linear head weights W (C x p) for the report's DLR when the states hold no "
                                   "outputs (as `richness eval --head`)")
    mg.add_argument("--force", action="store_true", help="replace an existing OUT")
    mg.set_defaults(func=merge.merge_cmd)

    pl = sub.add_parser("plot", help="curves from a saved state, or DLR over steps from a Monitor log")
    pl.add_argument("input", help="a state saved by `richness eval --save` / Moments.save, or a .jsonl/.csv log")
    pl.add_argument("--test", help="held-out state (.npz) for the dashed held-out curves")
    pl.add_argument("--head", help="linear head weights (C x p) when the state has no outputs")
    pl.add_argument("-o", "--output", help="output prefix (writes PREFIX.png and PREFIX.svg)")
    pl.add_argument("--title", help="the figure's title (default: the file name and its DLR)")
    pl.add_argument("--force", action="store_true", help="replace existing PREFIX.png / PREFIX.svg")
    pl.set_defaults(func=commands.plot_cmd)

    from . import cka

    cka.add_parser(sub)

    i = sub.add_parser("info", help="version, backends, BLAS, GPU architectures")
    i.set_defaults(func=commands.info)
    return p


def _fail(msg: str) -> int:
    """One line on stderr, exit code 2."""
    print(f"richness: error: {' '.join(msg.split())}", file=sys.stderr)
    return 2


def main(argv: Optional[list] = None) -> int:
    """Run the ``richness`` command line (the console script) on ``argv``
    (default: ``sys.argv[1:]``) and return the exit code: 0 on success, 2 for a
    refused input (one ``richness: error: ...`` line on stderr), 130 when
    interrupted. A usage error raises ``SystemExit(2)`` from argparse."""
    args = build_parser().parse_args(argv)  # a usage error: one line, SystemExit(2)
    # the library logs nowhere by default (NullHandler); the command line shows
    # warnings, and info with -v, on stderr
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("richness: %(message)s"))
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO if args.verbose else logging.WARNING)
    try:
        return args.func(args)
    except UserError as e:
        return _fail(str(e))
    except MemoryError as e:
        return _fail(str(e) or "out of memory")
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        return _fail(f"{where}{e.strerror or reason(e)}")
    except (ValueError, TypeError) as e:  # the library's refusal of an input
        return _fail(reason(e))
    except KeyboardInterrupt:
        print("richness: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a failure nothing above foresaw: still one line; -v logs the traceback
        log.info("traceback of the failure below", exc_info=True)
        return _fail(f"{type(e).__name__}: {reason(e)} (richness -v ... shows where)")
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
