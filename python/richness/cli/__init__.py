"""Command line: ``richness demo | eval | plot | info`` (also ``python -m richness``).

User errors (a missing file, a wrong shape, a bad key, a folder that cannot be
written) print one line naming the file and the problem and exit with code 2,
without a traceback. Progress and notes go to the ``richness`` logger
(``-v`` shows the info level).
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import sys
import time
import zipfile
from typing import List, Optional

import numpy as np

from .. import _io

log = logging.getLogger("richness")


class UserError(Exception):
    """An error in what the user asked for: one line, exit code 2."""


# -- array files ----------------------------------------------------------------

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U8": np.uint8, "U16": np.uint16, "U32": np.uint32, "U64": np.uint64}
_PAGE = mmap.PAGESIZE
# Rows per chunk are capped so that one chunk of one stream stays under this.
_CHUNK_BYTES = 1 << 28
# Errors a reader raises on a damaged or hostile file.
_UNREADABLE = (OSError, ValueError, zipfile.BadZipFile, KeyError, EOFError, RuntimeError, NotImplementedError,
               zipfile.LargeZipFile)


_SUFFIXES = ".npy, .npz, .safetensors, .pt, .h5/.hdf5 or .parquet"


def _split_spec(spec: str):
    """``FILE`` or ``FILE:KEY`` -> (path, key or None)."""
    if not os.path.exists(spec) and ":" in spec:
        path, key = spec.rsplit(":", 1)
        return path, key
    return spec, None


def _reason(e: BaseException) -> str:
    return str(e) or type(e).__name__


def _optional(module: str, package: str, suffix: str):
    """Import an optional reader or fail naming the pip package."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"reading {suffix} files needs {package}: pip install {package}") from None


class ArrayFile:
    """A 1-D or 2-D array in a ``.npy``, ``.npz``, ``.safetensors``, ``.pt``,
    ``.h5``/``.hdf5`` or ``.parquet`` file, read in row chunks.

    Only regular files are read, and every size is taken from the file's own
    headers and directory and checked against each other before any data is
    read. ``.npy`` and uncompressed ``.npz`` members are memory-mapped; pages
    behind the cursor are dropped (madvise/posix_fadvise DONTNEED): file-backed
    pages of a mapping count in the resident set, so a plain memmap of a 5 GB
    file would end up resident. Compressed ``.npz`` members are decompressed
    forward, chunk by chunk. ``.safetensors`` files are read through the
    ``safetensors`` library (which validates the header and offsets), a chunk
    of rows at a time. ``.pt`` is loaded with ``torch.load(weights_only=True,
    mmap=True)`` (no pickled code runs). HDF5 datasets are sliced per chunk
    (h5py); a Parquet column is read forward in record batches (pyarrow), one
    sample per row, vectors as list columns."""

    def __init__(self, spec: str, default_key: Optional[str] = None) -> None:
        path, key = _split_spec(spec)
        self.path, self.key, self.default_key = path, key, default_key
        self.label = path if key is None else f"{path}:{key}"
        self.explicit_key = key is not None
        if not os.path.exists(path):
            raise UserError(f"{path}: no such file")
        if os.path.isdir(path):
            raise UserError(f"{path}: is a directory, expected a {_SUFFIXES} file")
        try:
            size = _io.check_regular(path)
        except (OSError, ValueError) as e:
            raise UserError(_reason(e) if str(e).startswith(path) else f"{path}: {_reason(e)}") from None
        if size == 0:
            raise UserError(f"{path}: empty file (0 bytes)")
        self.bf16 = False
        self.array: Optional[np.ndarray] = None
        self.names: List[str] = []  # the file's named arrays (empty for a one-array file)
        self._reader = None  # (a, b) -> rows a..b-1, for files that are not memory-mapped
        self._keep = None  # an open h5py file behind _reader
        self._mm = None
        self._fd = None
        self._released = 0
        low = path.lower()
        try:
            if low.endswith(".npy"):
                if key is not None:
                    raise UserError(f"{self.label}: a .npy file holds one array; drop ':{key}'")
                self._open_npy(path)
            elif low.endswith(".npz"):
                self._open_npz(path)
            elif low.endswith(".safetensors"):
                self._open_safetensors(path)
            elif low.endswith((".pt", ".pth")):
                self._open_torch(path)
            elif low.endswith((".h5", ".hdf5")):
                self._open_hdf5(path)
            elif low.endswith(".parquet"):
                self._open_parquet(path)
            else:
                raise UserError(f"{path}: unknown file type; use {_SUFFIXES}")
        except UserError:
            raise
        except _UNREADABLE as e:
            msg = _reason(e)
            raise UserError(msg if msg.startswith(path) else f"{self.label}: cannot read ({msg})") from None
        if not all(isinstance(s, int) and s >= 0 for s in self.shape):
            raise UserError(f"{self.label}: the file gives an impossible shape {self.shape}")
        if len(self.shape) not in (1, 2):
            raise UserError(f"{self.label}: expected a 1-D or 2-D array, got shape {self.shape}")

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

    # file formats
    def _map(self, f, offset: int, header: "_io.NpyHeader") -> None:
        """Map the array whose data starts at ``offset`` of the open file ``f``."""
        size = os.fstat(f.fileno()).st_size
        if offset + header.nbytes > size:
            raise UserError(f"{self.label}: truncated file ({size} bytes, the header promises "
                            f"{offset + header.nbytes})")
        self.shape, self.dtype = header.shape, header.dtype
        if header.nbytes == 0:
            self.array = np.zeros(header.shape, header.dtype)
            return
        self._fd = os.dup(f.fileno())
        self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
        self._offset = offset
        count = header.nbytes // header.dtype.itemsize
        a = np.frombuffer(self._mm, dtype=header.dtype, count=count, offset=offset)
        self.array = a.reshape(header.shape, order="F" if header.fortran else "C")
        self.fortran = header.fortran

    def _open_npy(self, path: str) -> None:
        with _io.open_regular(path) as f:
            try:
                header = _io.read_npy_header(f, self.label)
            except ValueError as e:
                msg = str(e)
                raise UserError(msg if "impossible shape" in msg or "object arrays" in msg
                                else f"{self.label}: not a .npy array ({msg})") from None
            self._map(f, header.header_bytes, header)

    def _open_npz(self, path: str) -> None:
        f = _io.open_regular(path)
        try:
            zf = zipfile.ZipFile(f)
            members = _io.npz_members(zf, path)
            member = members[self._pick(list(members), "array")]
            if member.info.compress_type == zipfile.ZIP_STORED:
                size = os.fstat(f.fileno()).st_size
                self._map(f, _io.stored_data_offset(f, member, size, self.label), member.header)
                return
            header = member.header
            self.shape, self.dtype = header.shape, header.dtype
            if header.fortran and len(header.shape) == 2 and header.shape[1] > 1:
                # column-major data cannot be read by rows: read it whole
                _io.check_memory(header.nbytes, f"{self.label} (a compressed column-major array)")
                self.array = _io.read_member(zf, member)
                return
            self._reader = _NpzRows(zf, member)
            self._keep = f
            f = None
        finally:
            if f is not None:
                f.close()

    def _open_safetensors(self, path: str) -> None:
        st = _optional("safetensors", "safetensors", ".safetensors")
        try:
            try:
                handle = st.safe_open(path, framework="numpy", backend="pread")
            except TypeError:  # a safetensors without the pread backend
                handle = st.safe_open(path, framework="numpy")
        except st.SafetensorError as e:
            raise UserError(f"{path}: not a valid safetensors file ({_reason(e)})") from None
        key = self._pick(list(handle.keys()), "tensor")
        sl = handle.get_slice(key)
        self.shape = tuple(int(s) for s in sl.get_shape())
        kind = sl.get_dtype()
        if kind == "BF16":  # numpy has no bfloat16: torch reads the bits, widened per chunk
            torch = _optional("torch", "torch", "bfloat16 .safetensors")
            self.bf16, self.dtype = True, np.dtype(np.uint16)
            tsl = st.safe_open(path, framework="pt").get_slice(key)
            self._reader = lambda a, b: tsl[a:b].view(torch.int16).numpy().view(np.uint16)
            return
        if kind not in _ST_DTYPES:
            raise UserError(f"{self.label}: unsupported dtype {kind}")
        self.dtype = np.dtype(_ST_DTYPES[kind])
        self._reader = lambda a, b: sl[a:b]

    def _open_torch(self, path: str) -> None:
        torch = _optional("torch", "torch", ".pt")
        import pickle

        try:
            try:  # mmap: tensors stay on disk until a chunk touches them
                obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                obj = torch.load(path, map_location="cpu", weights_only=True)  # the legacy (non-zip) format
        except pickle.UnpicklingError as e:
            raise UserError(f"{path}: not a file of tensors (torch.load with weights_only=True refused it: "
                            f"{str(e).splitlines()[0]})") from None
        if isinstance(obj, torch.Tensor):
            if self.key is not None:
                raise UserError(f"{self.label}: the file holds one tensor; drop ':{self.key}'")
            t = obj
        elif isinstance(obj, dict):
            tensors = {str(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}
            t = tensors[self._pick(list(tensors), "tensor")]
        else:
            raise UserError(f"{path}: holds a {type(obj).__name__}; expected a tensor or a dict of tensors")
        t = t.detach()
        from .._adapt import refuse_unreadable

        try:
            refuse_unreadable(t, "it")
        except TypeError as e:
            raise UserError(f"{self.label}: {e}") from None
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16: keep the bits, widened per chunk
            self.bf16 = True
            t = t.view(torch.int16)
            self.array = t.numpy().view(np.uint16)
        else:
            try:
                self.array = t.numpy()
            except TypeError as e:
                raise UserError(f"{self.label}: unsupported dtype ({e})") from None
        self.shape, self.dtype = tuple(self.array.shape), self.array.dtype

    def _open_hdf5(self, path: str) -> None:
        h5py = _optional("h5py", "h5py", ".h5")
        f = h5py.File(path, "r")
        names: List[str] = []
        f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        try:
            ds = f[self._pick(names, "dataset")]
        except UserError:
            f.close()
            raise
        self.shape, self.dtype = tuple(int(s) for s in ds.shape), ds.dtype
        self._keep = f
        self._reader = lambda a, b: ds[a:b]  # h5py reads only the slice

    def _open_parquet(self, path: str) -> None:
        pa = _optional("pyarrow", "pyarrow", ".parquet")
        pq = _optional("pyarrow.parquet", "pyarrow", ".parquet")
        pf = pq.ParquetFile(path)
        key = self._pick(list(pf.schema_arrow.names), "column")
        typ = pf.schema_arrow.field(key).type
        is_list = pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ)
        value = typ.value_type if is_list else typ
        try:
            self.dtype = np.dtype(value.to_pandas_dtype())
        except (NotImplementedError, TypeError):
            raise UserError(f"{self.label}: unsupported column type {typ}") from None
        rows = pf.metadata.num_rows
        width = None
        if pa.types.is_fixed_size_list(typ):
            width = typ.list_size
        elif is_list and rows:
            first = next(pf.iter_batches(batch_size=1, columns=[key])).column(0)
            width = len(first[0]) if first[0].is_valid else 0
        self.shape = (rows, width) if is_list else (rows,)
        self._reader = _ParquetColumn(pf, key, width, self.label)

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

    def chunk(self, a: int, b: int) -> np.ndarray:
        try:
            x = self._reader(a, b) if self._reader is not None else self.array[a:b]
        except UserError:
            raise
        except _UNREADABLE as e:
            raise UserError(f"{self.label}: rows {a}..{b - 1}: cannot read ({_reason(e)})") from None
        if self.bf16:  # bfloat16 bits -> float32
            x = (x.astype(np.uint32) << 16).view(np.float32)
        return x

    def release(self, b: int) -> None:
        """Drop the mapped pages of rows before ``b`` from memory."""
        if self._mm is None or getattr(self, "fortran", False):
            return
        rowbytes = self.dtype.itemsize * (int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1)
        end = (self._offset + b * rowbytes) // _PAGE * _PAGE
        if end <= self._released:
            return
        start = self._released
        try:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (AttributeError, OSError, ValueError):
            pass
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(self._fd, start, end - start, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
        self._released = end


class _NpzRows:
    """Rows a..b-1 of a compressed .npz member, decompressed forward (a chunk
    before the cursor restarts). The member's size was checked against its
    header, so a read never goes past it: a short member raises EOFError."""

    def __init__(self, zf: zipfile.ZipFile, member: "_io.NpzMember") -> None:
        self.zf, self.member = zf, member
        h = member.header
        self.row_shape = h.shape[1:]
        width = 1
        for s in self.row_shape:
            width *= s
        self.row_bytes = width * h.dtype.itemsize
        self.f = None
        self._restart()

    def _restart(self) -> None:
        if self.f is not None:
            self.f.close()
        self.f = self.zf.open(self.member.info)
        self._read(self.member.header.header_bytes)
        self.pos = 0

    def _read(self, n: int) -> bytes:
        parts, left = [], n
        while left:
            piece = self.f.read(min(left, 1 << 24))
            if not piece:
                raise EOFError(f"the member ends {left} bytes early")
            parts.append(piece)
            left -= len(piece)
        return b"".join(parts)

    def __call__(self, a: int, b: int) -> np.ndarray:
        if a < self.pos:
            self._restart()
        while self.pos < a:  # skip forward without holding the skipped rows
            step = max(1, min(a - self.pos, (1 << 24) // max(self.row_bytes, 1)))
            self._read(step * self.row_bytes)
            self.pos += step
        data = self._read((b - a) * self.row_bytes)
        self.pos = b
        h = self.member.header
        return np.frombuffer(data, dtype=h.dtype).reshape((b - a,) + self.row_shape)


class _ParquetColumn:
    """Rows a..b-1 of one Parquet column, read forward in record batches (a
    chunk before the cursor restarts the scan). List columns become 2-D."""

    def __init__(self, pf, key: str, width: Optional[int], label: str) -> None:
        self.pf, self.key, self.width, self.label = pf, key, width, label
        # about 16M values per record batch, whatever the width
        self.batch = max(1, min(65536, (1 << 24) // max(width or 1, 1)))
        self._restart()

    def _restart(self) -> None:
        self.it = self.pf.iter_batches(batch_size=self.batch, columns=[self.key])
        self.start, self.buf = 0, None

    def _convert(self, col, first: int) -> np.ndarray:
        if col.null_count:
            raise UserError(f"{self.label}: rows {first}..{first + len(col) - 1} hold {col.null_count} nulls")
        if self.width is None:
            return col.to_numpy(zero_copy_only=False)
        if hasattr(col, "value_lengths"):  # variable-length lists must all have the first row's width
            lengths = col.value_lengths().to_numpy(zero_copy_only=False)
            bad = np.flatnonzero(lengths != self.width)
            if bad.size:
                raise UserError(f"{self.label}: row {first + int(bad[0])} has {int(lengths[bad[0]])} values, "
                                f"row 0 has {self.width}")
        return col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), self.width)

    def __call__(self, a: int, b: int) -> np.ndarray:
        if a < self.start:
            self._restart()
        parts = []
        while True:
            lo = self.start
            hi = lo + (0 if self.buf is None else len(self.buf))
            if self.buf is not None and hi > a and lo < b:
                parts.append(self.buf[max(a, lo) - lo: min(b, hi) - lo])
            if hi >= b:
                break
            col = next(self.it).column(0)
            self.start, self.buf = hi, self._convert(col, hi)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _open(spec: Optional[str], bundle: Optional[ArrayFile], key: str) -> Optional[ArrayFile]:
    """An explicit file, else the array ``key`` of the bundle the features came from, when it has one."""
    if spec is not None:
        return ArrayFile(spec)
    if bundle is None or key not in bundle.names:
        return None
    return ArrayFile(f"{bundle.path}:{key}")


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
    widths = {"p": _width(feats), "c": _width(outs) if outs else -1, "t": _width(targets) if targets else -1,
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


def _head_weights(spec: Optional[str]):
    if spec is None:
        return None
    f = ArrayFile(spec)
    f.check_float("head weights")
    if len(f.shape) != 2:
        raise UserError(f"{f.label}: head weights must be 2-D (outputs, features), got shape {f.shape}")
    _io.check_memory(2 * 8 * f.rows * f.shape[1], f"{f.label}: the head weights (read whole, as float64)")
    return np.array(f.chunk(0, f.rows), dtype=np.float64)


def eval_cmd(args: argparse.Namespace) -> int:
    _check_eval_args(args)
    feats = ArrayFile(args.features, default_key="features")
    # a bundle (FILE without :KEY) also supplies its outputs, labels and targets
    bundle = None if feats.explicit_key else feats
    outs = _open(args.outputs, bundle, "outputs")
    labels = _open(args.labels, bundle, "labels")
    targets = _open(args.targets, bundle, "targets")
    if args.test_features is not None:
        for given, train, what in ((args.test_outputs, outs, "outputs"), (args.test_labels, labels, "labels"),
                                   (args.test_targets, targets, "targets")):
            if given is not None and train is None:
                raise UserError(f"--test-{what} {given}: the training set has no {what} (give --{what})")
    for f, what in ((feats, "features"), (outs, "outputs"), (labels, "labels"), (targets, "targets")):
        if f is not None:
            log.info("%s: %s, shape %s, %s", what, f.label, f.shape, "bfloat16" if f.bf16 else f.dtype)
    W = _head_weights(args.head)
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
        touts = _open(args.test_outputs, tbundle, "outputs") if outs is not None else None
        tlabels = _open(args.test_labels, tbundle, "labels") if labels is not None else None
        ttargets = _open(args.test_targets, tbundle, "targets") if targets is not None else None
        for train, held, what in ((outs, touts, "outputs"), (targets, ttargets, "targets")):
            if held is not None and _width(held) != _width(train):
                raise UserError(f"{held.label}: held-out {what} have {_width(held)} columns but the training "
                                f"{what} ({train.label}) have {_width(train)}")
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
    inputs = [_split_spec(spec)[0] for spec in (args.features, args.outputs, args.labels, args.targets, args.head,
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


def _width(f: ArrayFile) -> int:
    return f.shape[1] if len(f.shape) == 2 else 1


def _print_reference(rep) -> None:
    """DLR beside the lazy end it is read against: isotropic features of the same n, active
    features and logit rank (a fully lazy random network at small n prints DLR well below 1)."""
    if rep.dlr is None or rep.dlr_isotropic is None:
        return
    ratio = "n/a" if rep.dlr_normalized is None else f"{rep.dlr_normalized:.3f}"
    print(f"DLR {rep.dlr:.4f}   isotropic reference {rep.dlr_isotropic:.4f}   DLR/iso {ratio}")
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
    try:
        if low.endswith((".jsonl", ".json", ".csv")):
            paths = plot.history(plot.read_log(path), out, title=args.title or os.path.basename(path))
        elif low.endswith(".npz"):
            m = Moments.load(path)
            test = Moments.load(args.test) if args.test else None
            W = _head_weights(args.head)
            rep = m.compute(head=W, test=test)
            paths = plot.curves(rep, out, title=args.title or f"{os.path.basename(path)}: DLR "
                                + ("n/a" if rep.dlr is None else f"{rep.dlr:.3f}") + f", n = {rep.n}")
        else:
            raise UserError(f"{path}: unknown input; give a saved state (.npz) or a Monitor log (.jsonl/.csv)")
    except ValueError as e:
        msg = str(e)
        raise UserError(msg if msg.startswith(path) or (args.test and msg.startswith(args.test)) else f"{path}: {msg}") \
            from None
    for p in paths:
        print(p)
    return 0


def _load_digits(seed: int):
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        return None
    d = load_digits()
    X = d.data.astype(np.float64) / 16.0
    y = d.target.astype(np.int64)
    idx = np.random.default_rng(seed).permutation(len(y))
    return X[idx], y[idx], "scikit-learn digits (1,797 real 8x8 images)"


def _synthetic(seed: int):
    rng = np.random.default_rng(seed)
    n, d, k = 2000, 64, 10
    centers = rng.normal(size=(k, d)) * 0.6
    y = rng.integers(0, k, n)
    X = centers[y] + rng.normal(size=(n, d))
    return X, y, "generated Gaussian clusters (scikit-learn not installed)"


def _train_mlp(X, y, *, width: int, epochs: int, train_features: bool, seed: int, lr: float = 0.05,
               batch: int = 128, tick=None):
    """A ReLU network with two hidden layers (d -> width -> width -> classes) on
    standardised inputs, minibatch SGD with momentum on cross-entropy, float32.
    train_features=False freezes everything but the head at initialisation
    (lazy). (Full-batch training of one hidden layer on digits barely moved
    the features: DLR 0.256 rich vs 0.258 lazy.)"""
    rng = np.random.default_rng(seed)
    shift, scale = X.mean(0), X.std(0) + 1e-8
    Xs = ((X - shift) / scale).astype(np.float32)
    n, d = Xs.shape
    k = int(y.max()) + 1
    dims = [d, width, width, k]
    Ws = [(rng.normal(size=(i, o)) * np.sqrt(2.0 / i)).astype(np.float32) for i, o in zip(dims[:-1], dims[1:])]
    Ws[-1] *= np.float32(np.sqrt(0.5))
    bs = [np.zeros(o, np.float32) for o in dims[1:]]
    params = Ws + bs
    vel = [np.zeros_like(q) for q in params]
    Y = np.eye(k, dtype=np.float32)[y]
    L = len(Ws)
    trained = range(L) if train_features else [L - 1]
    for _ in range(epochs):
        perm = rng.permutation(n)
        for s0 in range(0, n, batch):
            idx = perm[s0:s0 + batch]
            acts, pre = [Xs[idx]], []
            for layer in range(L):
                z = acts[-1] @ Ws[layer] + bs[layer]
                pre.append(z)
                acts.append(np.maximum(z, 0.0) if layer < L - 1 else z)
            P = np.exp(acts[-1] - acts[-1].max(axis=1, keepdims=True))
            P /= P.sum(axis=1, keepdims=True)
            G = (P - Y[idx]) / len(idx)
            grads = {}
            for layer in range(L - 1, -1, -1):
                grads[layer] = (acts[layer].T @ G, G.sum(0))
                if layer == min(trained):
                    break
                G = (G @ Ws[layer].T) * (pre[layer - 1] > 0)
            for layer in trained:
                for i, g in ((layer, grads[layer][0]), (L + layer, grads[layer][1])):
                    vel[i] = 0.9 * vel[i] - lr * g
                    params[i] += vel[i]
        if tick is not None:
            tick(1)

    W64 = [w.astype(np.float64) for w in Ws]
    b64 = [v.astype(np.float64) for v in bs]

    def forward(A):
        H = (np.asarray(A, dtype=np.float64) - shift) / scale
        for layer in range(L - 1):
            H = np.maximum(H @ W64[layer] + b64[layer], 0.0)
        return H, H @ W64[-1] + b64[-1]

    return forward, (W64[-1].T, b64[-1])


def _train_mse(X, y, *, alpha: float, width: int, steps: int, seed: int, lr: float = 0.05, tick=None):
    """Target-downscaled training (Chizat et al.'s laziness knob): squared error
    toward centered one-hot targets divided by ``alpha``, on the change of the
    network since initialisation, f - f_0. Larger alpha: the weights need to
    move less, training is lazier. Returns forward(A) -> (features, f - f_0)."""
    rng = np.random.default_rng(seed)
    n, d = X.shape
    k = int(y.max()) + 1
    P0 = [(rng.normal(size=(d, width)) * np.sqrt(2.0 / d)).astype(np.float32), np.zeros(width, np.float32),
          (rng.normal(size=(width, k)) * np.sqrt(1.0 / width)).astype(np.float32), np.zeros(k, np.float32)]
    P = [q.copy() for q in P0]
    Y = ((np.eye(k)[y] - 1.0 / k) / alpha).astype(np.float32)
    Xf = X.astype(np.float32)  # float32 training; forward() below evaluates in float64

    def net(A, Q):
        H = np.maximum(A @ Q[0] + Q[1], 0.0)
        return H, H @ Q[2] + Q[3]

    F0 = net(Xf, P0)[1]
    vel = [np.zeros_like(q) for q in P]
    for step in range(steps):
        Z = Xf @ P[0] + P[1]
        H = np.maximum(Z, 0.0)
        G = (H @ P[2] + P[3] - F0 - Y) / n
        GZ = (G @ P[2].T) * (Z > 0)
        for i, g in enumerate((Xf.T @ GZ, GZ.sum(0), H.T @ G, G.sum(0))):
            vel[i] = 0.9 * vel[i] - lr * g
            P[i] += vel[i]
        if tick is not None and (step + 1) % 10 == 0:
            tick(10)

    def forward(A):
        A = np.asarray(A, dtype=np.float64)
        H, F = net(A, [q.astype(np.float64) for q in P])
        return H, F - net(A, [q.astype(np.float64) for q in P0])[1]

    return forward


def _measure(forward, Xtr, ytr, Xte, yte):
    from .. import Moments

    Htr, Ftr = forward(Xtr)
    Hte, Fte = forward(Xte)
    m = Moments(num_classes=10)
    m.update(Htr, Ftr, labels=ytr)
    test = Moments(num_classes=10)
    test.update(Hte, Fte, labels=yte)
    return m.compute(test=test), float((Fte.argmax(1) == yte).mean())


def _demo_bar(total: int, desc: str, unit: str, enabled: bool):
    """A tqdm bar on stderr (nothing when tqdm is missing or progress is off)."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True, file=sys.stderr)


def _with_bar(fn, total: int, desc: str, unit: str, enabled: bool, **kw):
    bar = _demo_bar(total, desc, unit, enabled)
    try:
        return fn(**kw, tick=bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()


def demo(args: argparse.Namespace) -> int:
    from .. import Moments

    t0 = time.time()
    alphas = args.alphas
    progress = not args.no_progress
    data = _load_digits(args.seed) or _synthetic(args.seed)
    X, y, source = data
    split = int(0.7 * len(y))
    Xtr, ytr, Xte, yte = X[:split], y[:split], X[split:], y[split:]
    print(f"data: {source}; {len(ytr)} train / {len(yte)} test samples")
    print("network: 64 -> 256 -> 256 -> 10 ReLU, minibatch SGD with momentum, cross-entropy; "
          "lazy = only the head trained")
    if args.no_plots:
        print("plots: off (--no-plots)\n")
    else:
        print(f"plots go to {os.path.join(args.out, '')} (curves.png/.svg, sweep.png/.svg; --out to change)\n")
    rows, reports = [], {}
    for name, train_features in (("full training (rich)", True), ("last layer only (lazy)", False)):
        forward, head = _with_bar(_train_mlp, args.epochs, name, "epoch", progress, X=Xtr, y=ytr, width=256,
                                  epochs=args.epochs, train_features=train_features, seed=args.seed)
        rep, acc = _measure(forward, Xtr, ytr, Xte, yte)
        Htr, _ = forward(Xtr)
        mh = Moments(num_classes=10)
        mh.update(Htr, labels=ytr)
        assert abs(rep.dlr - mh.compute(head=head).dlr) < 1e-8  # linear head: streamed == shortcut
        reports[name] = rep
        rows.append((name, rep.dlr, rep.dlr_normalized, rep.nc1, acc, rep.effective_dim, rep.utilization[9]))
    print(f"{'setting':<24} {'DLR':>7} {'DLR/iso':>8} {'NC1':>8} {'test acc':>9} {'eff. dim':>9} {'Pi_hat(C)':>10}")
    for name, d, dn, nc, acc, eff, u in rows:
        print(f"{name:<24} {d:7.3f} {dn:8.3f} {nc:8.3f} {acc:9.3f} {eff:9.1f} {u:10.3f}")
    print("how to read: DLR 0 = rich (features collapse onto the learned functions), 1 = lazy (kernel regime);")
    print(f"  DLR/iso 1 = as lazy as isotropic features (DLR {1 - np.sqrt(10 / 256):.3f} as n grows); "
          "NC1 lower = classes more collapsed (docs/READING_DLR.md)")

    sweep = []
    if alphas:
        print("\ntarget-downscaled sweep: squared error toward y / alpha on f - f_0 (larger alpha = lazier)")
        print(f"{'alpha':>8} {'DLR':>7} {'NC1':>8} {'test acc':>9} {'eff. dim':>9}")
        for a in alphas:
            forward = _with_bar(_train_mse, args.steps, f"alpha {a:g}", "step", progress, X=Xtr, y=ytr, alpha=a,
                                width=256, steps=args.steps, seed=args.seed)
            rep, acc = _measure(forward, Xtr, ytr, Xte, yte)
            sweep.append((a, rep.dlr, rep.nc1, acc))
            print(f"{a:8g} {rep.dlr:7.3f} {rep.nc1:8.3f} {acc:9.3f} {rep.effective_dim:9.1f}")
    if not args.no_plots:
        try:
            from .. import plot

            paths = plot.curves(reports, os.path.join(args.out, "curves"),
                                title="digits, 64-256-256-10 MLP: rich vs lazy (dashed: held-out)")
            if sweep:
                a, d, nc, acc = zip(*sweep)
                paths += plot.sweep(a, {"DLR (0 = rich, 1 = lazy)": d, "NC1": nc, "test accuracy": acc},
                                    os.path.join(args.out, "sweep"), xlabel="alpha (targets y / alpha)",
                                    title="target-downscaled sweep")
            print("\nplots: " + ", ".join(paths))
        except ImportError as e:
            print(f"\nplots skipped: {e}")
        except OSError as e:
            raise UserError(f"{args.out}: cannot write the plots ({e.strerror or e})") from None
    print(f"done in {time.time() - t0:.1f} s")
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


# The sweep's alphas scale the targets by 1/alpha. Below about 0.03 the SGD
# step (lr 0.05) on targets that large kills every ReLU (alpha 0.01: constant
# features); above 1000 the network no longer moves (DLR at 100 and 1000 agree).
_ALPHA_RANGE = (0.05, 1e3)


def _alphas(text: str) -> List[float]:
    one = _real(*_ALPHA_RANGE, f"alphas in [{_ALPHA_RANGE[0]:g}, {_ALPHA_RANGE[1]:g}]")
    return [one(a.strip()) for a in text.split(",")] if text.strip() else []


_INT64_MAX = 2**63 - 1


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = _Parser(prog="richness", description="Measure how rich or lazy training was (DLR).")
    p.add_argument("--version", action="version", version=f"richness {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="also log what is read and done (to stderr)")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="rich vs lazy networks on built-in data, a target-downscaled sweep, plots")
    d.add_argument("--epochs", type=_integer(1, 10**6, "a positive number of epochs"), default=20,
                   help="epochs of the rich/lazy classifiers")
    d.add_argument("--steps", type=_integer(1, 10**8, "a positive number of steps"), default=400,
                   help="full-batch steps per network of the alpha sweep")
    d.add_argument("--seed", type=_integer(0, _INT64_MAX, "a non-negative integer"), default=0)
    d.add_argument("--alphas", type=_alphas, default="0.1,0.3,1,10",
                   help=f"comma-separated target scales of the sweep, each in [{_ALPHA_RANGE[0]:g}, "
                        f"{_ALPHA_RANGE[1]:g}] ('' to skip it)")
    d.add_argument("--out", default="richness-demo", help="folder for the plots (default richness-demo/)")
    d.add_argument("--no-plots", action="store_true")
    d.add_argument("--no-progress", action="store_true", help="no progress bars (tqdm)")
    d.set_defaults(func=demo)

    e = sub.add_parser("eval", help="DLR, spectrum and curves from saved features/outputs/labels",
                       description="Stream arrays from .npy, .npz, .safetensors, .pt (torch.load, weights only), "
                                   ".h5/.hdf5 (h5py) or .parquet (pyarrow) files (FILE or FILE:KEY) in chunks. A "
                                   "bundle (any but .npy) with arrays named features, outputs, labels, targets "
                                   "supplies them all. Parquet: one sample per row, vectors as list columns.")
    e.add_argument("features", help="features (samples x p): FILE or FILE:KEY, or a bundle")
    e.add_argument("--outputs", help="outputs / logits (samples x C)")
    e.add_argument("--labels", help="integer class labels (samples,)")
    e.add_argument("--targets", help="float regression targets (samples,) or (samples x T)")
    e.add_argument("--head", help="linear head weights W (C x p): DLR without streaming outputs")
    e.add_argument("--test-features", help="held-out features (Nystrom-extended curves)")
    e.add_argument("--test-outputs")
    e.add_argument("--test-labels")
    e.add_argument("--test-targets")
    e.add_argument("--num-classes", type=_integer(1, _INT64_MAX, "a positive number of classes"), default=None)
    e.add_argument("--precision", choices=["fp64", "fp32"], default=None,
                   help="precision of the products (default: fp64 for float64 files, else fp32)")
    e.add_argument("--rtol", type=_real(0.0, 1.0, "a relative cut in [0, 1]"), default=None,
                   help="eigenvalue cut (default by precision)")
    e.add_argument("--chunk", type=_integer(1, _INT64_MAX, "a positive number of rows"), default=8192,
                   help="rows per chunk (default 8192)")
    e.add_argument("--json", action="store_true", help="print the report as one JSON object")
    e.add_argument("--save", help="write the training state (.npz) for `richness plot` or later merges")
    e.add_argument("--save-test", help="write the held-out state (.npz)")
    e.add_argument("--no-progress", action="store_true")
    e.set_defaults(func=eval_cmd)

    pl = sub.add_parser("plot", help="curves from a saved state, or DLR over steps from a Monitor log")
    pl.add_argument("input", help="a state saved by `richness eval --save` / Moments.save, or a .jsonl/.csv log")
    pl.add_argument("--test", help="held-out state (.npz) for the dashed held-out curves")
    pl.add_argument("--head", help="linear head weights (C x p) when the state has no outputs")
    pl.add_argument("-o", "--output", help="output prefix (writes PREFIX.png and PREFIX.svg)")
    pl.add_argument("--title")
    pl.set_defaults(func=plot_cmd)

    i = sub.add_parser("info", help="version, backends, BLAS, GPU architectures")
    i.set_defaults(func=info)
    return p


def _fail(msg: str) -> int:
    """One line on stderr, exit code 2."""
    print(f"richness: error: {' '.join(msg.split())}", file=sys.stderr)
    return 2


def main(argv: Optional[list] = None) -> int:
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
        return _fail(f"{where}{e.strerror or _reason(e)}")
    except (ValueError, TypeError) as e:  # the library's refusal of an input
        return _fail(_reason(e))
    except KeyboardInterrupt:
        print("richness: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a failure nothing above foresaw: still one line; -v logs the traceback
        log.info("traceback of the failure below", exc_info=True)
        return _fail(f"{type(e).__name__}: {_reason(e)} (richness -v ... shows where)")
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
