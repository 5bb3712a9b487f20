"""The rules every command of the command line applies to the files it names,
checked before any data is read:

* a file is known by what it is, not how it is spelled: its device and inode
  where it exists, and its path with every link resolved (a symlink, a hard
  link, ``./a.npy`` and ``a.npy`` are one file; so are a file not yet written
  and ``sub/../`` of it);
* an input reached twice within one set of samples (a ``part-latest.npy``
  symlink beside the parts, a hard link, two spellings) is refused: its samples
  would count twice (:func:`distinct`);
* a file a command writes is never one of its inputs, nor another file the
  same command writes, and one that exists is replaced only with ``--force``
  (:func:`check_targets`);
* a file read twice (checked in a first scan, read in a second pass) must be
  the file the scan saw (:class:`Seen`).
"""

from __future__ import annotations

import os
from typing import Dict, FrozenSet, Hashable, Iterable, Optional, Sequence, Set, Tuple

from . import UserError

__all__ = []


def identity(path: str) -> FrozenSet[Hashable]:
    """What ``path`` names: its path with every link resolved, and its
    (device, inode) where it exists (links followed). Two paths name the same
    file when their identities share an element (``same``)."""
    keys: Set[Hashable] = {("path", os.path.realpath(path))}
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        pass
    else:
        keys.add((st.st_dev, st.st_ino))
    return frozenset(keys)


class _Known:
    """Paths by identity: which one already seen names the same file as another."""

    def __init__(self) -> None:
        self.by_key: Dict[Hashable, str] = {}

    def find(self, keys: FrozenSet[Hashable]) -> Optional[str]:
        return next((self.by_key[k] for k in keys if k in self.by_key), None)

    def add(self, keys: FrozenSet[Hashable], path: str) -> None:
        for k in keys:
            self.by_key.setdefault(k, path)


def distinct(paths: Iterable[str], what: str = "") -> None:
    """Refuse a file that ``paths`` reach twice (``what``: the argument they come from)."""
    known = _Known()
    for p in paths:
        keys = identity(p)
        first = known.find(keys)
        if first is not None:
            how = "the same path" if os.path.abspath(p) == os.path.abspath(first) else \
                "a link or another spelling of it"
            where = f" in {what}" if what else ""
            raise UserError(f"{p}: the same file as {first}{where} ({how}); its samples would count twice")
        known.add(keys, p)


def check_targets(targets: Sequence[Tuple[str, Optional[str]]], inputs: Iterable[str], *, force: bool,
                  usage: str = "") -> None:
    """The files a command will write, as (option, path) pairs (a None path is
    not written): none may be an input or another target; one that exists is
    refused unless ``force`` (``usage``: the command's form, shown then)."""
    given = [(opt, path, identity(path)) for opt, path in targets if path]
    sources = _Known()
    for p in inputs:
        sources.add(identity(p), p)
    for i, (opt, path, keys) in enumerate(given):
        name = f"{opt} {path}" if opt else path
        found = sources.find(keys)
        if found is not None:
            also = "" if os.path.abspath(found) == os.path.abspath(path) else f" ({found})"
            raise UserError(f"{name}: is an input file{also}; writing would overwrite it (write to another file)")
        for other, q, other_keys in given[:i]:
            if keys & other_keys:
                raise UserError(f"{other or q} and {opt or path} name the same file ({path}); one would "
                                "overwrite the other")
    for opt, path, _ in given:
        name = f"{opt} {path}" if opt else path
        if os.path.isdir(path):
            raise UserError(f"{name}: is a directory; give a file name")
        if os.path.lexists(path) and not force:
            form = f" ({usage})" if usage else ""
            raise UserError(f"{name}: exists{form}; give --force to replace it")


class Seen:
    """What a file was when a first pass looked at it: device, inode, size and
    modification time (and whatever else the caller adds, e.g. its shape)."""

    def __init__(self, path: str, st: Optional[os.stat_result] = None, **more) -> None:
        st = os.stat(path) if st is None else st
        self.path = path
        self.facts: Dict[str, object] = {"file": (st.st_dev, st.st_ino), "size": st.st_size,
                                         "modified": st.st_mtime_ns, **more}

    def check_now(self, label: Optional[str] = None) -> None:
        """Refuse the file when it is not, now, the file that was seen (another
        file, another size or modification time): it changed while it was read."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise UserError(f"{label or self.path}: gone since it was first read ({e.strerror or e}); is another "
                            "process still writing it?") from None
        now = Seen(self.path, st)
        now.facts.update({k: v for k, v in self.facts.items() if k not in now.facts})
        self.check(now, label)

    def check(self, now: "Seen", label: Optional[str] = None) -> None:
        """Refuse ``now`` when it is not what was seen: one line naming the file and what changed."""
        words = {"file": "another file (device and inode) under that name", "modified": "modification time"}
        changed = [f"{k} {self.facts[k]} -> {now.facts.get(k)}" if k in ("size", "shape", "key", "dtype")
                   else words.get(k, k) for k in self.facts if now.facts.get(k) != self.facts[k]]
        if changed:
            raise UserError(f"{label or self.path}: changed since it was first read ({', '.join(changed)}); "
                            "is another process still writing it? Run again once it is complete")
