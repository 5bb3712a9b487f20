"""The file formats ``richness eval`` and ``richness cka`` read arrays from, by suffix.

Each format is one module here with a subclass of :class:`~.base.ArrayFile`
(which opens a file of that format and finds the array in it), and one
:func:`register` call below that names its suffixes, its reader class and the
optional package it needs (with the pip extra that installs it). The rest of the
command line knows files only through this registry: :func:`open_array` opens
``FILE`` or ``FILE:KEY`` with the reader its suffix names, :func:`find` tells a
file's format (a directory of shards holds one), and :func:`suffix_list` spells
the supported suffixes in messages.

Adding a format: write ``formats/<name>.py`` with a subclass of
:class:`~.base.ArrayFile` whose ``_open(path)`` finds the array (``self._pick``
for ``FILE:KEY`` among named arrays), sets ``shape`` and ``dtype`` and either
calls ``self._raw`` (raw data at a file offset: read by ordinary reads, never
mapped) or sets ``self._reader`` (rows a..b-1) or ``self.array``; an optional
package is imported with ``self.require(module)``. Then add one
``register(name, Reader, suffixes, needs=..., install=pip_extra(extra))`` call
below (and the extra in pyproject.toml). Chunking, shape and dtype checks,
``FILE:KEY`` selection, closing, the checks that a file did not change while it
was read, and the one-line refusals are the base class's; nothing else in the
command line changes.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Type

from ..._optional import pip_extra
from .. import UserError
from .base import ArrayFile, Format, split_spec, stat_input
from .base import UNREADABLE  # noqa: F401 (still importable from here; not part of __all__)
from .h5 import Hdf5File
from .npy import NpyFile
from .npz import NpzFile
from .parquet import ParquetFile
from .pt import TorchFile
from .safetensors import SafetensorsFile

__all__ = ["ArrayFile", "Format", "find", "formats", "open_array", "register", "suffix_list", "unregister"]

_FORMATS: Dict[str, Format] = {}  # by name, in the order registered


def register(name: str, reader: Type[ArrayFile], suffixes: Sequence[str], *, needs: Optional[str] = None,
             install: Optional[str] = None, shown: Optional[str] = None) -> Format:
    """Read files whose names end in one of ``suffixes`` (with the dot; any case)
    with ``reader``. ``needs``: the optional package it reads with, and
    ``install`` the command that installs it (``pip_extra(extra)``), named when it
    is missing; ``shown``: how the list of supported suffixes spells the format
    (default: its suffixes joined by ``/``)."""
    sufs = tuple(s.lower() for s in suffixes)
    if name in _FORMATS:
        raise ValueError(f"a file format named {name!r} is already registered")
    if not sufs or not all(s.startswith(".") and len(s) > 1 for s in sufs):
        raise ValueError(f"suffixes of {name!r} must start with a dot, got {tuple(suffixes)}")
    for other in _FORMATS.values():
        taken = set(sufs) & set(other.suffixes)
        if taken:
            raise ValueError(f"{', '.join(sorted(taken))}: already read as {other.name!r}")
    fmt = Format(name, reader, sufs, needs, install, shown or "/".join(sufs))
    _FORMATS[name] = fmt
    return fmt


def unregister(name: str) -> Format:
    """Forget the format ``name``; returns it."""
    return _FORMATS.pop(name)


def formats() -> List[Format]:
    """The registered formats, in the order registered."""
    return list(_FORMATS.values())


def find(path: str) -> Optional[Format]:
    """The format of the file ``path`` by its suffix (the longest registered one it
    ends in, any case), None when no format reads it."""
    low = path.lower()
    best: Optional[Format] = None
    length = 0
    for fmt in _FORMATS.values():
        for s in fmt.suffixes:
            if len(s) > length and low.endswith(s):
                best, length = fmt, len(s)
    return best


def suffix_list() -> str:
    """The supported suffixes as messages spell them: ".npy, .npz, ... or .parquet"."""
    shown = [fmt.shown for fmt in _FORMATS.values()]
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"


def open_array(spec: str, default_key: Optional[str] = None) -> ArrayFile:
    """The array ``spec`` names (``FILE`` or ``FILE:KEY``), opened by its format's
    reader and checked before any data is read. ``default_key``: the array taken
    from a file of several when no key is given and the file has one of that name."""
    path, key = split_spec(spec)
    stat = stat_input(path, suffix_list())
    fmt = find(path)
    if fmt is None:
        raise UserError(f"{path}: unknown file type; use {suffix_list()}")
    return fmt.reader(fmt, path, key, stat, default_key)


register("npy", NpyFile, [".npy"])
register("npz", NpzFile, [".npz"])
register("safetensors", SafetensorsFile, [".safetensors"], needs="safetensors", install=pip_extra("safetensors"))
register("pt", TorchFile, [".pt", ".pth"], needs="torch", install=pip_extra("torch"), shown=".pt")
register("h5", Hdf5File, [".h5", ".hdf5"], needs="h5py", install=pip_extra("h5py"))
register("parquet", ParquetFile, [".parquet"], needs="pyarrow", install=pip_extra("pyarrow"))
