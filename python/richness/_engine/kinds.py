"""The kinds of mergeable state, one table for every route that merges
many states of any kind: ``richness merge`` (saved files, fully validated)
and ``richness.dask`` (state dicts its own tasks exported, between workers).

A kind is a class with ``state_dict()``, ``load_state_dict(d)``,
``_load_own_state_dict(d)`` (the same, for a state the library exported
itself, without the O(p^3) checks such a state passes by construction),
``merge(other)``, ``save(path)``, ``load(path)`` and ``n``, whose save files
carry their format name in the archive's ``meta`` entry. Registering a new
kind here is all those routes need: files are dispatched on their format,
state dicts merged through the class's own loading and ``merge`` (so each
kind keeps one implementation of its merge).
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from . import bounded_io as _bounded_io
from . import statefile as _statefile


@dataclass(frozen=True)
class Kind:
    """One kind of state.

    name: what messages call it ("moments").
    format: the format name its save files carry (``meta["format"]``).
    cls: a zero-argument callable returning the class (imported on first use).
    widths: what merging depends on, from an object: a dict of ints.
    check: raise ValueError when states of these widths cannot merge.
    report: the report of an object as plain JSON types.
    """

    name: str
    format: str
    cls: Callable[[], Any]
    widths: Callable[[Any], Dict[str, int]]
    check: Callable[[List[Dict[str, int]]], None]
    report: Callable[[Any], dict]


KINDS: Dict[str, Kind] = {}


def register(kind: Kind) -> None:
    KINDS[kind.name] = kind


def get(name: str) -> Kind:
    return KINDS[name]


def _moments_class() -> type:
    from .moments import Moments

    return Moments


def _moments_widths(m: Any) -> Dict[str, int]:
    from .. import _state

    return _state.widths_of(m.state_dict())


def _moments_check(metas: List[Dict[str, int]]) -> None:
    from .. import _state

    _state.check_compatible(metas)


register(Kind("moments", _statefile.FORMAT, _moments_class, _moments_widths, _moments_check,
              lambda m: m.compute().to_dict()))


def file_format(path: str) -> Optional[str]:
    """The format name a saved file's ``meta`` entry gives, or None where the
    file is not such an archive (the kind's own ``load`` then says why)."""
    try:
        with _bounded_io.open_regular(path) as f, zipfile.ZipFile(f) as zf:
            members = _bounded_io.npz_members(zf, path)
            meta = members.get("meta")
            if meta is None or meta.header.dtype.kind != "u" or meta.header.nbytes > _statefile._META_MAX:
                return None
            doc = json.loads(_bounded_io.read_member(zf, meta).tobytes().decode())
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, KeyError, NotImplementedError, RuntimeError,
            zipfile.LargeZipFile, UnicodeDecodeError):
        return None
    fmt = doc.get("format") if isinstance(doc, dict) else None
    return fmt if isinstance(fmt, str) else None


def kind_of_file(path: str) -> Kind:
    """The kind of a saved file; a file of no known format goes to the
    default kind, whose ``load`` refuses it naming the problem."""
    fmt = file_format(path)
    for kind in KINDS.values():
        if kind.format == fmt:
            return kind
    return KINDS["moments"]


def kind_of(obj: Any) -> Kind:
    """The kind of a state object (TypeError for anything else)."""
    for kind in KINDS.values():
        if isinstance(obj, kind.cls()):
            return kind
    raise TypeError(f"not a richness state: {type(obj).__name__}")


def merge_own_dicts(kind_name: str, states: List[dict]) -> dict:
    """The merge of several state dicts of one kind that this library's own
    steps exported (``richness.dask``'s tasks), as a state dict: each loaded
    into the kind's class by ``_load_own_state_dict`` (every check but the
    O(p^3) ones) and merged by its own ``merge``."""
    cls = get(kind_name).cls()
    acc = cls()
    acc._load_own_state_dict(states[0])
    for st in states[1:]:
        other = cls()
        other._load_own_state_dict(st)
        acc.merge(other)
    return acc.state_dict()


def _similarity_class() -> type:
    from .similarity import Similarity

    return Similarity


def _similarity_widths(s: Any) -> Dict[str, Any]:
    return {"n": s.n, "names": tuple(s.names), "widths": tuple(s.widths), "estimator": s.estimator}


def _similarity_check(metas: List[Dict[str, Any]]) -> None:
    live = sorted({(m["names"], m["widths"]) for m in metas if m["n"] > 0})
    if len(live) > 1:
        raise ValueError("states hold different representations: "
                         + " and ".join(f"names {list(a)} of widths {list(b)}" for a, b in live))
    kept = sorted({m.get("estimator", "exact") for m in metas if m["n"] > 0})
    if len(kept) > 1:
        raise ValueError(f"states keep different estimators: {' and '.join(repr(e) for e in kept)} (a Similarity's "
                         "estimator is fixed when it is made)")


register(Kind("similarity", "richness.similarity", _similarity_class, _similarity_widths, _similarity_check,
              lambda s: s.compute().to_dict()))
