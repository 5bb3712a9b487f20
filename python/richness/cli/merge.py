"""``richness merge OUT IN [IN ...]``: saved states merged into one file.

Every input is read and validated, and checked against the others, before
anything is written; OUT is then written atomically (a temp file renamed over
it), so a refused merge leaves no OUT behind. Files are dispatched on the
kind their archive names (``richness._kinds``); inputs of different kinds, or
of one kind that cannot merge (other widths, other fixed classes), are one
error line naming both files."""

from __future__ import annotations

import argparse
import json
import os
from typing import List

from .. import _kinds
from . import UserError, reason
from .commands import _same_file
from .shards import expand


def _load(kind: "_kinds.Kind", path: str):
    try:
        return kind.cls().load(path)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except (TypeError, ValueError) as e:
        msg = reason(e)
        raise UserError(msg if msg.startswith(path) else f"{path}: {msg}") from None


def _inputs(specs: List[str], out: str) -> List[str]:
    paths = [f for spec in specs for f in (expand(spec) or [])]
    for i, p in enumerate(paths):
        if _same_file(out, p):
            raise UserError(f"{out}: is also an input; write the merge to another file (it is written only "
                            "after every input was read)")
        for q in paths[:i]:
            if _same_file(p, q):
                raise UserError(f"{p}: given twice (as {q}); its samples would count twice")
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
    paths = _inputs(args.inputs, args.out)
    kinds, widths, counts = [], [], []
    for i, path in enumerate(paths):  # every input validated and checked before anything is written
        kind = _kinds.kind_of_file(path)
        obj = _load(kind, path)
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
    merged = _load(kind, paths[0])
    for path in paths[1:]:  # one state at a time beside the merge: memory of two states
        try:
            merged.merge(_load(kind, path))
        except (TypeError, ValueError) as e:
            raise UserError(f"{path}: cannot be merged into {', '.join(paths[:paths.index(path)])} ({e})") from None
    if merged.n != sum(counts):
        raise UserError(f"{args.out}: the merge holds {merged.n} samples, the inputs {sum(counts)}; nothing written")
    report = None
    if args.json:  # before writing: a merge whose report fails writes nothing
        try:
            report = kind.report(merged)
        except ValueError as e:
            raise UserError(f"{args.out}: the merged state ({merged.n} samples) has no report: {e}") from None
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
