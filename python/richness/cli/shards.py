"""Sharded inputs of the command line: one array argument names one file, a
quoted glob (``'feats/part-*.npy'``) or a directory (all its files, of one
format). The matched files are taken in sorted order and paired by position
across the arguments: shard i of the features goes with shard i of the
outputs, labels and targets. Each shard is read by the per-file reader
(:func:`richness.cli.formats.open_array`) and passes every check a single
file passes; the shards of one argument must also agree with each other
(same streams, same widths). A ``:KEY`` after a glob or directory applies to
every file it matches."""

from __future__ import annotations

import glob
import os
from typing import Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, cast, overload

from . import UserError
from .files import Seen, distinct
from .formats import ArrayFile, find, open_array, split_spec

__all__ = []

STREAMS = ("features", "outputs", "labels", "targets")

def _format(path: str) -> str:
    """The format of a file, by its suffix (a directory of shards holds one format)."""
    fmt = find(path)
    if fmt is not None:
        return fmt.suffixes[0]
    return os.path.splitext(path)[1].lower() or "(no suffix)"


def open_or_bundle(spec: Optional[str], bundle: Optional[ArrayFile], key: str) -> Optional[ArrayFile]:
    """An explicit file, else the array ``key`` of the bundle the features came from, when it has one."""
    if spec is not None:
        return open_array(spec)
    if bundle is None or key not in bundle.names:
        return None
    return open_array(f"{bundle.path}:{key}")


def width(f: ArrayFile) -> int:
    return f.shape[1] if len(f.shape) == 2 else 1


# Names a directory or a glob of shards skips (as pyarrow's datasets do).
_HIDDEN = ("_", ".")


def _hidden(pattern: str, match: str) -> bool:
    """Whether ``match`` of a glob ``pattern`` lies under a name starting with
    ``_`` or ``.`` below the pattern's literal folder that the pattern does not
    spell out itself (glob already skips dot names for ``*``)."""
    parts = pattern.split(os.sep)
    root = 0
    while root < len(parts) - 1 and not glob.has_magic(parts[root]):
        root += 1
    pat = parts[root:]
    got = match.split(os.sep)[root:]
    if len(pat) != len(got):  # '**' matched several folders: none of its own may be hidden
        return any(g.startswith(_HIDDEN) for g in got) and not any(p.startswith(_HIDDEN) for p in pat)
    return any(g.startswith(_HIDDEN) and not p.startswith(_HIDDEN) for p, g in zip(pat, got))


@overload
def expand(spec: str) -> List[str]: ...
@overload
def expand(spec: None) -> None: ...
@overload
def expand(spec: Optional[str]) -> Optional[List[str]]: ...
def expand(spec: Optional[str]) -> Optional[List[str]]:
    """The files an argument names, as reader specs (``FILE`` or ``FILE:KEY``):
    itself when it is a file, else the sorted files a glob matches or a
    directory holds (regular files, all of one format). Names starting with
    ``_`` or ``.`` are skipped, as pyarrow's datasets skip them (``_SUCCESS``
    markers, ``_temporary`` folders, hidden files), unless the glob spells such
    a name out. An empty match is an error."""
    if spec is None:
        return None
    path, key = split_spec(spec)
    suffix = "" if key is None else f":{key}"
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if not n.startswith(_HIDDEN))
        files = [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))]
        if not files:
            raise UserError(f"{path}: a directory with no files (a directory of shards holds their files)")
        kinds: Dict[str, str] = {}
        for f in files:
            kinds.setdefault(_format(f), f)
        if len(kinds) > 1:
            a, b = list(kinds.values())[:2]
            raise UserError(f"{path}: holds files of several formats ({os.path.basename(a)}, "
                            f"{os.path.basename(b)}); a directory of shards holds one format (or give a glob)")
    elif glob.has_magic(path) and not os.path.exists(path):
        files = sorted(f for f in glob.glob(path, recursive=True) if not os.path.isdir(f) and not _hidden(path, f))
        if not files:
            raise UserError(f"{path}: no file matches (names starting with _ or . are skipped unless the "
                            "pattern spells them out)")
    else:
        return [spec]
    return [f + suffix for f in files]


class Shard(NamedTuple):
    """One shard's open files (None for a stream the set does not have)."""

    features: ArrayFile
    outputs: Optional[ArrayFile]
    labels: Optional[ArrayFile]
    targets: Optional[ArrayFile]

    def files(self) -> List[ArrayFile]:
        return [f for f in self if f is not None]

    def close(self) -> None:
        for f in self.files():
            f.close()


class Shards:
    """The shards of one set of samples (the training set or the held-out
    one): per stream the files it names, paired by position.

    ``streams``: the streams a bundle may supply when not given (default all);
    the held-out set takes only those the training set has."""

    def __init__(self, features: str, outputs: Optional[str] = None, labels: Optional[str] = None,
                 targets: Optional[str] = None, *, names: Sequence[str] = ("features", "--outputs", "--labels",
                                                                          "--targets"),
                 streams: Sequence[str] = STREAMS) -> None:
        given = dict(zip(STREAMS, (features, outputs, labels, targets)))
        self.names = dict(zip(STREAMS, names))
        self.specs: Dict[str, Optional[List[str]]] = {s: expand(given[s]) for s in STREAMS}
        self.streams = tuple(streams)
        for s in STREAMS:  # a shard reached twice (a link, another spelling) would count twice
            distinct([split_spec(spec)[0] for spec in self.specs[s] or []], f"{self.names[s]} {given[s]}")
        # what each file was when first opened (the scan): a later open must find the same
        self._seen: Dict[Tuple[int, str], Seen] = {}
        self._opened: Set[int] = set()
        feats = self.specs["features"]
        assert feats is not None
        for s in STREAMS[1:]:
            other = self.specs[s]
            if other is None or len(other) == len(feats):
                continue
            short, long_ = (s, "features") if len(other) < len(feats) else ("features", s)
            i = len(self.specs[short] or [])
            long_specs = cast(List[str], self.specs[long_])  # the longer list is given
            raise UserError(f"{long_specs[i]}: shard {i + 1} of {self.names[long_]} has no partner in "
                            f"{self.names[short]} {given[short]} ({len(other)} {s} files against {len(feats)} "
                            "features files; shards pair by position in sorted order)")

    def __len__(self) -> int:
        return len(self.specs["features"] or [])

    def files(self) -> List[str]:
        """Every input file of the set (paths, without keys)."""
        return [split_spec(spec)[0] for s in STREAMS for spec in (self.specs[s] or [])]

    def open(self, i: int) -> Shard:
        """Shard ``i``: its files, opened; a features bundle (any but .npy,
        named without :KEY) supplies the streams not given."""
        feats = open_array(self.specs["features"][i], default_key="features")  # type: ignore[index]
        bundle = None if feats.explicit_key else feats
        rest = []
        try:
            for s in STREAMS[1:]:
                spec = self.specs[s]
                rest.append(open_or_bundle(spec[i] if spec else None, bundle if s in self.streams else None, s))
            shard = Shard(feats, *rest)
            first = i not in self._opened
            for s, f in zip(STREAMS, shard):
                if first:
                    if f is not None:
                        self._seen[i, s] = f.seen()
                    continue
                before = self._seen.get((i, s))
                if (before is None) != (f is None):
                    raise UserError(f"{feats.label}: {'no longer holds' if f is None else 'holds'} {s} now, "
                                    "unlike when it was first read; is another process still writing it?")
                if before is not None and f is not None:
                    before.check(f.seen(), f.label)
            self._opened.add(i)
        except BaseException:
            Shard(feats, *rest, *([None] * (3 - len(rest)))).close()
            raise
        return shard

    def check_unchanged(self, shard: Shard) -> None:
        """Refuse a shard whose files changed while they were read."""
        for f in shard.files():
            f.check_unchanged()


class Layout(NamedTuple):
    """What every shard of a set agrees on, found before any data is read."""

    rows: int                 # over all shards
    shard_rows: List[int]
    streams: tuple            # the streams present
    shapes: Dict[str, tuple]  # shard 0's shapes (rows dropped)
    row_bytes: int            # the widest shard's bytes per row, all streams
    label: str                # the features as the user gave them: a file, or "GLOB (k shards)"
    labels: Dict[str, str]    # per stream: its file (shard 1's, "and k more shards")
    described: Dict[str, str]  # per stream: its file (shard 1's), the shape over all shards, the dtype


def scan(shards: Shards, check, given: str) -> Layout:
    """Open every shard, run ``check(shard)`` (the per-file checks) on it, and
    check it against shard 0: the same streams and widths. Each shard is
    closed again (a run over thousands of shards holds one open at a time)."""
    first: Optional[Shard] = None
    rows, row_bytes = [], 0
    streams: tuple = ()
    shapes: Dict[str, tuple] = {}
    label = given
    described: Dict[str, str] = {}
    labels: Dict[str, str] = {}
    for i in range(len(shards)):
        sh = shards.open(i)
        try:
            check(sh)
            present = tuple(s for s, f in zip(STREAMS, sh) if f is not None)
            here = {s: f.shape[1:] for s, f in zip(STREAMS, sh) if f is not None}
            if first is None:
                first, streams, shapes = sh, present, here
                label = sh.features.label if len(shards) == 1 else f"{given} ({len(shards)} shards)"
                for s, f in zip(STREAMS, sh):
                    if f is not None:
                        labels[s] = f.label if len(shards) == 1 else f"{f.label} and {len(shards) - 1} more shards"
                        described[s] = (f"{f.label}, shape {f.shape}" if len(shards) == 1 else
                                        f"{len(shards)} shards from {f.label}") + \
                                       f", {'bfloat16' if f.bf16 else f.dtype}"
            else:
                for s in STREAMS:
                    if (s in present) != (s in streams):
                        raise UserError(f"{sh.features.label}: shard {i + 1} {'has' if s in present else 'lacks'} "
                                        f"{s}, unlike shard 1 ({first.features.label}); every shard holds the "
                                        "same streams")
                    if s in present and here[s] != shapes[s]:
                        f0, f = getattr(first, s), getattr(sh, s)
                        raise UserError(f"{f.label}: {s} of width {width(f)}, but shard 1 ({f0.label}) has "
                                        f"{width(f0)}; every shard has the same widths")
            rows.append(sh.features.rows)
            row_bytes = max(row_bytes, sum(f.row_bytes() for f in sh.files()))
        finally:
            sh.close()
    if len(shards) > 1:
        described = {s: f"{d}, {sum(rows)} rows in all" for s, d in described.items()}
    return Layout(sum(rows), rows, streams, shapes, row_bytes, label, labels, described)
