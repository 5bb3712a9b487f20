"""What every file reader of the command line shares: :class:`ArrayFile`, a
1-D or 2-D array in a file, read in row chunks, and :class:`Format`, a
registered format (its suffixes, its reader class, the optional package it
needs). One module per format subclasses :class:`ArrayFile`; the registry
(:mod:`richness.cli.formats`) picks the subclass by the file's suffix."""

from __future__ import annotations

import importlib
import os
import zipfile
from typing import Any, Callable, List, NamedTuple, Optional, Tuple, Type, cast

import numpy as np

from ..._engine import bounded_io as _bounded_io
from .. import UserError, reason
from ..files import Seen
from ..raw import RawRows

__all__ = ["ArrayFile", "Format"]

# Errors a reader raises on a damaged or hostile file.
UNREADABLE = (OSError, ValueError, zipfile.BadZipFile, KeyError, EOFError, RuntimeError, NotImplementedError,
              zipfile.LargeZipFile)


class Format(NamedTuple):
    """A registered file format."""

    name: str                    # short name (e.g. "h5")
    reader: Type["ArrayFile"]    # the class that opens and reads it
    suffixes: Tuple[str, ...]    # lower case, with the dot; the first one names the format in messages
    needs: Optional[str]         # the optional package it reads with (None: numpy alone)
    install: Optional[str]       # the command that installs it (``pip_extra``)
    shown: str                   # how the list of supported suffixes spells it (e.g. ".h5/.hdf5")


def split_spec(spec: str) -> Tuple[str, Optional[str]]:
    """``FILE`` or ``FILE:KEY`` -> (path, key or None)."""
    if not os.path.exists(spec) and ":" in spec:
        path, key = spec.rsplit(":", 1)
        return path, key
    return spec, None


def stat_input(path: str, expected: str) -> os.stat_result:
    """The status of the input file ``path``, taken before any byte of it is read,
    or a refusal: no such file, a directory (``expected``: the suffixes read), not
    a regular file, an empty one."""
    if not os.path.exists(path):
        raise UserError(f"{path}: no such file")
    if os.path.isdir(path):
        raise UserError(f"{path}: is a directory, expected a {expected} file")
    try:
        st = _bounded_io.stat_regular(path)
    except (OSError, ValueError) as e:
        raise UserError(reason(e) if str(e).startswith(path) else f"{path}: {reason(e)}") from None
    if st.st_size == 0:
        raise UserError(f"{path}: empty file (0 bytes)")
    return st


class ArrayFile:
    """A 1-D or 2-D array in a file of one format, read in row chunks.

    Only regular files are read, and every size is taken from the file's own
    headers and directory and checked against each other before any data is
    read. Nothing is memory-mapped while it is read (a mapped file truncated
    by another process would kill this one with SIGBUS): raw data at a known
    offset is read a chunk of rows at a time by ordinary reads
    (:class:`~richness.cli.raw.RawRows`, through :meth:`_raw`), and a file
    that turns out shorter than its header is a one-line error.

    A format's subclass implements ``_open(path)``: it finds the array (a file
    of several arrays picks one with :meth:`_pick`, which honours ``FILE:KEY``),
    sets ``shape`` and ``dtype``, and then either calls :meth:`_raw`, or sets
    ``_reader`` (a callable giving rows a..b-1) or ``array`` (the array held
    whole). An object to close with the file goes in ``_keep``; ``bf16`` marks
    bfloat16 bits stored as uint16 (widened per chunk). Errors in
    :data:`UNREADABLE` become one line naming the file; the shape checks, the
    chunks, closing and the identity checks are this class's."""

    shape: Tuple[Any, ...]  # set by _open; checked to be ints >= 0, 1-D or 2-D, before the file is used
    dtype: np.dtype

    def __init__(self, fmt: Format, path: str, key: Optional[str], stat: os.stat_result,
                 default_key: Optional[str] = None) -> None:
        self.format, self.path, self.key, self.default_key = fmt, path, key, default_key
        self.label = path if key is None else f"{path}:{key}"
        self.explicit_key = key is not None
        self.stat = stat  # before any byte is read: what the checks saw
        self.bf16 = False
        self.array: Optional[np.ndarray] = None
        self.names: List[str] = []  # the file's named arrays (empty for a one-array file)
        self._reader: Optional[Callable[[int, int], np.ndarray]] = None  # rows a..b-1, for arrays not held whole
        self._keep: Any = None  # an open file (h5py, or the .npz's) behind _reader
        try:
            self._open(path)
            if not all(isinstance(s, int) and s >= 0 for s in self.shape):
                raise UserError(f"{self.label}: the file gives an impossible shape {self.shape}")
            if len(self.shape) not in (1, 2):
                raise UserError(f"{self.label}: expected a 1-D or 2-D array, got shape {self.shape}")
        except BaseException as e:
            self.close()  # a refused file keeps no descriptor open
            if isinstance(e, UNREADABLE):
                msg = reason(e)
                raise UserError(msg if msg.startswith(path) else f"{self.label}: cannot read ({msg})") from None
            raise

    # for the formats' subclasses
    def _open(self, path: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not open files")

    def require(self, module: str):
        """Import ``module``, an optional package the format reads with, or fail
        naming the pip extra that installs it."""
        try:
            return importlib.import_module(module)
        except ImportError:
            fmt = self.format
            install = f": {fmt.install}" if fmt.install else ""
            raise UserError(f"reading {fmt.suffixes[0]} files needs {fmt.needs or module}{install}") from None

    def _pick(self, names: List[str], noun: str) -> str:
        """The key asked for (or the default, or the only array) among ``names``."""
        self.names = list(names)
        key = self.key
        if key is None:
            if self.default_key is not None and self.default_key in names:
                key = self.default_key
            elif len(names) == 1:
                key = names[0]
            else:
                raise UserError(f"{self.path}: holds {len(names)} {noun}s ({', '.join(names)}); "
                                f"name one as {self.path}:KEY")
        if key not in names:
            raise UserError(f"{self.path}: no {noun} {key!r}; it has {', '.join(names) or 'none'}")
        self.key, self.label = key, f"{self.path}:{key}"
        return key

    def _raw(self, f, offset: int, shape, strides, dtype) -> None:
        """Read the array at ``offset`` of the open file ``f`` by chunks of rows."""
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self._reader = RawRows(f, self.label, offset, self.shape, tuple(strides), self.dtype)

    # reading
    @property
    def rows(self) -> int:
        return self.shape[0]

    def check_float(self, what: str) -> None:
        if not (self.bf16 or self.dtype.kind == "f"):
            raise UserError(f"{self.label}: {what} must be floating point, got {self.dtype}")

    def row_bytes(self) -> int:
        """Bytes of one row as a chunk holds it (bfloat16 widens to float32)."""
        width = self.shape[1] if len(self.shape) == 2 else 1
        return width * (4 if self.bf16 else self.dtype.itemsize)

    def chunk(self, a: int, b: int, reuse: bool = False) -> np.ndarray:
        """Rows ``a..b-1``. ``reuse``: raw row-major data may come in a buffer
        that the next ``chunk(..., reuse=True)`` overwrites (:class:`RawRows`)."""
        try:
            if isinstance(self._reader, RawRows):
                x = self._reader(a, b, reuse=reuse)
            else:
                x = self._reader(a, b) if self._reader is not None else cast(np.ndarray, self.array)[a:b]
        except UserError:
            raise
        except UNREADABLE as e:
            raise UserError(f"{self.label}: rows {a}..{b - 1}: cannot read ({reason(e)})") from None
        if self.bf16:  # bfloat16 bits -> float32
            x = (x.astype(np.uint32) << 16).view(np.float32)
        return x

    def close(self) -> None:
        """Let go of the file (its descriptor and open reader); chunks already
        read stay valid (each is its own buffer)."""
        if isinstance(self._reader, RawRows):
            self._reader.close()
        self.array, self._reader = None, None
        keep, self._keep = self._keep, None
        if keep is not None and hasattr(keep, "close"):  # an old pyarrow's ParquetFile has no close()
            keep.close()

    def __enter__(self) -> "ArrayFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def seen(self) -> Seen:
        """The file as opened: identity, size, modification time, the array's key, shape and dtype."""
        return Seen(self.path, self.stat, key=self.key, shape=self.shape, dtype=str(self.dtype), bf16=self.bf16)

    def check_unchanged(self) -> None:
        """Refuse a file changed since it was opened (rewritten while it was read)."""
        self.seen().check_now(self.label)

    def release(self, b: int) -> None:
        """The rows before ``b`` will not be read again (raw data: dropped from the page cache)."""
        if isinstance(self._reader, RawRows):
            self._reader.release(b)
