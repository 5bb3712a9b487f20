"""``richness merge OUT IN [IN ...]``: saved states merged into one file.

OUT is checked first (never an input; an existing OUT only with ``--force``),
each input file taken once. Every input is read and validated, and checked
against the others, before anything is written; OUT is then written
atomically (a temp file renamed over it), so a refused merge leaves no OUT
behind. Files are dispatched on the
kind their archive names (``richness._engine.kinds``); inputs of different kinds, or
of one kind that cannot merge (other widths, other fixed classes), are one
error line naming both files."""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Dict, List, Optional

from .._engine import kinds as _kinds
from . import UserError, reason
from .commands import head_weights
from .files import Seen, check_targets, distinct
from .formats import split_spec
from .shards import expand

__all__ = []

log = logging.getLogger("richness")


# The command's form, shown when OUT exists (an OUT forgotten makes the first input OUT).
USAGE = "the form is richness merge OUT IN [IN ...], OUT first"


def _load(kind: "_kinds.Kind", path: str, seen: Dict[str, Optional[Seen]]):
    """The state in ``path``, which must be the file first seen there (not
    rewritten since, nor while it was read)."""
    if path not in seen:
        try:
            seen[path] = Seen(path)
        except OSError:
            seen[path] = None  # load says why
    try:
        obj = kind.cls().load(path)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except (TypeError, ValueError) as e:
        msg = reason(e)
        raise UserError(msg if msg.startswith(path) else f"{path}: {msg}") from None
    before = seen[path]
    if before is not None:
        before.check_now()
    return obj


def _inputs(args: argparse.Namespace) -> List[str]:
    """The input files, each once, and OUT checked against them, before any is read."""
    paths = [f for spec in args.inputs for f in (expand(spec) or [])]
    distinct(paths)
    sources = paths + ([split_spec(args.head)[0]] if args.head else [])
    check_targets([("", args.out)], sources, force=args.force, usage=USAGE)
    return paths


def _incompatible(kinds, widths, paths, i: int) -> UserError:
    """The error of input ``i``, which cannot join the inputs before it:
    named with the first earlier input it cannot merge with."""
    kind = kinds[i]
    for j in range(i):
        if kinds[j] is not kind:
            return UserError(f"{paths[j]} and {paths[i]} cannot be merged: a {kinds[j].name} state and a "
                             f"{kind.name} state")
    why = ""
    for j in range(i):
        try:
            kind.check([widths[j], widths[i]])
        except ValueError as e:
            return UserError(f"{paths[j]} and {paths[i]} cannot be merged: {e}")
    try:
        kind.check(widths[:i + 1])
    except ValueError as e:
        why = str(e)
    return UserError(f"{paths[0]} and {paths[i]} cannot be merged (with the inputs between them): {why}")


def merge_cmd(args: argparse.Namespace) -> int:
    if args.head and not args.json:
        raise UserError(f"--head {args.head}: gives the report's DLR; add --json to print the report")
    paths = _inputs(args)
    seen: Dict[str, Optional[Seen]] = {}
    kinds, widths, counts = [], [], []
    for i, path in enumerate(paths):  # every input validated and checked before anything is written
        kind = _kinds.kind_of_file(path)
        obj = _load(kind, path, seen)
        kinds.append(kind)
        widths.append(kind.widths(obj))
        counts.append(obj.n)
        del obj
        if kind is not kinds[0]:
            raise _incompatible(kinds, widths, paths, i)
        try:
            kind.check(widths)
        except ValueError:
            raise _incompatible(kinds, widths, paths, i) from None
    kind = kinds[0]
    W = None
    if args.head:
        if kind.name != "moments":
            raise UserError(f"--head {args.head}: a head applies to moments states; {paths[0]} is a {kind.name} "
                            "state")
        W = head_weights(args.head)
        if W.shape[1] != widths[0]["p"]:
            raise UserError(f"{args.head}: head weights have {W.shape[1]} input columns but the states have "
                            f"{widths[0]['p']} features")
    merged = _load(kind, paths[0], seen)
    for path in paths[1:]:  # one state at a time beside the merge: memory of two states
        try:
            merged.merge(_load(kind, path, seen))
        except (TypeError, ValueError) as e:
            raise UserError(f"{path}: cannot be merged into {', '.join(paths[:paths.index(path)])} ({e})") from None
    if merged.n != sum(counts):
        raise UserError(f"{args.out}: the merge holds {merged.n} samples, the inputs {sum(counts)}; nothing written")
    report = None
    if args.json:  # before writing: a merge whose report fails writes nothing
        try:
            report = kind.report(merged) if W is None else merged.compute(head_weights=W).to_dict()
        except ValueError as e:
            raise UserError(f"{args.out}: the merged state ({merged.n} samples) has no report: {e}") from None
        if kind.name == "moments" and W is None and widths[0].get("c", -1) < 0 and report.get("dlr") is None:
            log.warning("warning: %s: DLR is null: the states hold no outputs (none were streamed: head mode); "
                        "give --head W.npy (the head's weights, C x p) for the DLR", args.out)
    try:
        merged.save(args.out)
    except OSError as e:
        raise UserError(f"{args.out}: cannot write the state ({e.strerror or reason(e)})") from None
    except ValueError as e:
        raise UserError(f"{args.out}: {e}") from None
    if report is not None:
        print(json.dumps(report), flush=True)
    else:
        print(f"merged {len(paths)} {kind.name} states ({merged.n} samples) into {os.fspath(args.out)}")
    return 0
