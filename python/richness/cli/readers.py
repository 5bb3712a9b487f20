"""File readers of ``richness eval``: a 1-D or 2-D array streamed in row chunks from
``.npy``, ``.npz``, ``.safetensors``, ``.pt``, ``.h5``/``.hdf5`` or ``.parquet`` files, each
refusal a :class:`~richness.cli.UserError` naming the file."""

from __future__ import annotations

import os
import sys
import zipfile
from typing import IO, Any, Callable, List, Optional, cast

import numpy as np

from .. import _bounded_io
from .._optional import pip_extra
from . import UserError, reason
from .files import Seen
from .raw import RawRows, c_strides, mapped_file_offset, safetensors_offset


_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U8": np.uint8, "U16": np.uint16, "U32": np.uint32, "U64": np.uint64}
# Errors a reader raises on a damaged or hostile file.
_UNREADABLE = (OSError, ValueError, zipfile.BadZipFile, KeyError, EOFError, RuntimeError, NotImplementedError,
               zipfile.LargeZipFile)


_SUFFIXES = ".npy, .npz, .safetensors, .pt, .h5/.hdf5 or .parquet"


def split_spec(spec: str):
    """``FILE`` or ``FILE:KEY`` -> (path, key or None)."""
    if not os.path.exists(spec) and ":" in spec:
        path, key = spec.rsplit(":", 1)
        return path, key
    return spec, None


def _optional(module: str, package: str, suffix: str, extra: str):
    """Import an optional reader or fail naming the pip extra that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"reading {suffix} files needs {package}: {pip_extra(extra)}") from None


class ArrayFile:
    """A 1-D or 2-D array in a ``.npy``, ``.npz``, ``.safetensors``, ``.pt``,
    ``.h5``/``.hdf5`` or ``.parquet`` file, read in row chunks.

    Only regular files are read, and every size is taken from the file's own
    headers and directory and checked against each other before any data is
    read. Nothing is memory-mapped while it is read (a mapped file truncated by
    another process would kill this one with SIGBUS): ``.npy`` data, stored
    ``.npz`` members, ``.safetensors`` tensors and ``.pt`` tensors are read a
    chunk of rows at a time by ordinary reads at their offsets
    (:class:`~richness.cli.raw.RawRows`), and a file that turns out shorter
    than its header is a one-line error. Compressed ``.npz`` members are
    decompressed forward, chunk by chunk. ``.safetensors`` headers are
    validated by the ``safetensors`` library. ``.pt`` is opened with
    ``torch.load(weights_only=True, mmap=True)`` (no pickled code runs) only
    to find the tensor's offset in the file; the mapping is dropped before any
    data is read. HDF5 datasets are sliced per chunk (h5py; datasets whose
    data lies in other files are refused); a Parquet column is read forward in
    record batches (pyarrow), one sample per row, vectors as list columns."""

    def __init__(self, spec: str, default_key: Optional[str] = None) -> None:
        path, key = split_spec(spec)
        self.path, self.key, self.default_key = path, key, default_key
        self.label = path if key is None else f"{path}:{key}"
        self.explicit_key = key is not None
        if not os.path.exists(path):
            raise UserError(f"{path}: no such file")
        if os.path.isdir(path):
            raise UserError(f"{path}: is a directory, expected a {_SUFFIXES} file")
        try:
            self.stat = _bounded_io.stat_regular(path)  # before any byte is read: what the checks saw
        except (OSError, ValueError) as e:
            raise UserError(reason(e) if str(e).startswith(path) else f"{path}: {reason(e)}") from None
        size = self.stat.st_size
        if size == 0:
            raise UserError(f"{path}: empty file (0 bytes)")
        self.bf16 = False
        self.array: Optional[np.ndarray] = None
        self.names: List[str] = []  # the file's named arrays (empty for a one-array file)
        self._reader: Optional[Callable[[int, int], np.ndarray]] = None  # rows a..b-1, for arrays not held whole
        self._keep: Any = None  # an open file (h5py, or the .npz's) behind _reader
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
            if not all(isinstance(s, int) and s >= 0 for s in self.shape):
                raise UserError(f"{self.label}: the file gives an impossible shape {self.shape}")
            if len(self.shape) not in (1, 2):
                raise UserError(f"{self.label}: expected a 1-D or 2-D array, got shape {self.shape}")
        except BaseException as e:
            self.close()  # a refused file keeps no descriptor open
            if isinstance(e, _UNREADABLE):
                msg = reason(e)
                raise UserError(msg if msg.startswith(path) else f"{self.label}: cannot read ({msg})") from None
            raise

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
    def _raw(self, f, offset: int, shape, strides, dtype) -> None:
        """Read the array at ``offset`` of the open file ``f`` by chunks of rows."""
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self._reader = RawRows(f, self.label, offset, self.shape, tuple(strides), self.dtype)

    def _map(self, f, offset: int, header: "_bounded_io.NpyHeader") -> None:
        """The .npy array whose data starts at ``offset`` of the open file ``f``."""
        size = os.fstat(f.fileno()).st_size
        if offset + header.nbytes > size:
            raise UserError(f"{self.label}: truncated file ({size} bytes, the header promises "
                            f"{offset + header.nbytes})")
        self._raw(f, offset, header.shape, c_strides(header.shape, header.dtype.itemsize, header.fortran),
                  header.dtype)

    def _open_npy(self, path: str) -> None:
        with _bounded_io.open_regular(path) as f:
            try:
                header = _bounded_io.read_npy_header(f, self.label)
            except ValueError as e:
                msg = str(e)
                raise UserError(msg if "impossible shape" in msg or "object arrays" in msg
                                else f"{self.label}: not a .npy array ({msg})") from None
            self._map(f, header.header_bytes, header)

    def _open_npz(self, path: str) -> None:
        f = _bounded_io.open_regular(path)
        kept = False
        try:
            zf = zipfile.ZipFile(f)
            members = _bounded_io.npz_members(zf, path)
            member = members[self._pick(list(members), "array")]
            if member.info.compress_type == zipfile.ZIP_STORED:
                size = os.fstat(f.fileno()).st_size
                self._map(f, _bounded_io.stored_data_offset(f, member, size, self.label), member.header)
                return
            header = member.header
            self.shape, self.dtype = header.shape, header.dtype
            if header.fortran and len(header.shape) == 2 and header.shape[1] > 1:
                # column-major data cannot be read by rows: read it whole
                _bounded_io.check_memory(header.nbytes, f"{self.label} (a compressed column-major array)")
                self.array = _bounded_io.read_member(zf, member)
                return
            self._reader = _NpzRows(zf, member)
            self._keep, kept = f, True
        finally:
            if not kept:
                f.close()

    def _open_safetensors(self, path: str) -> None:
        st = _optional("safetensors", "safetensors", ".safetensors", "safetensors")
        try:  # the library validates the header (by pread where it can: no mapping); RawRows reads the data
            try:
                handle = st.safe_open(path, framework="numpy", backend="pread")
            except TypeError:  # a safetensors without the pread backend
                handle = st.safe_open(path, framework="numpy")
        except st.SafetensorError as e:
            raise UserError(f"{path}: not a valid safetensors file ({reason(e)})") from None
        key = self._pick(list(handle.keys()), "tensor")
        sl = handle.get_slice(key)
        shape = tuple(int(s) for s in sl.get_shape())
        kind = sl.get_dtype()
        del sl, handle
        dtype: np.dtype
        if kind == "BF16":  # numpy has no bfloat16: the bits are read, widened per chunk
            self.bf16, dtype = True, np.dtype(np.uint16)
        elif kind in _ST_DTYPES:
            dtype = np.dtype(_ST_DTYPES[kind])
        else:
            raise UserError(f"{self.label}: unsupported dtype {kind}")
        with _bounded_io.open_regular(path) as f:
            self._raw(f, safetensors_offset(f, key, self.label), shape, c_strides(shape, dtype.itemsize), dtype)

    def _open_torch(self, path: str) -> None:
        torch = _optional("torch", "torch", ".pt", "torch")
        import pickle

        mapped = True
        try:
            try:  # mmap: nothing of the data is read here
                obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                mapped = False
                _bounded_io.check_memory(os.path.getsize(path), f"{path} (a legacy-format .pt file, read whole)")
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
        del obj
        t = t.detach()
        from .._adapt import refuse_unreadable

        try:
            refuse_unreadable(t, "it")
        except TypeError as e:
            raise UserError(f"{self.label}: {e}") from None
        self.bf16 = t.dtype == torch.bfloat16  # numpy has no bfloat16: keep the bits, widened per chunk
        try:
            dtype = np.dtype(np.uint16) if self.bf16 else torch.empty(0, dtype=t.dtype).numpy().dtype
        except TypeError as e:
            raise UserError(f"{self.label}: unsupported dtype ({e})") from None
        shape = tuple(int(s) for s in t.shape)
        start = mapped_file_offset(t.untyped_storage().data_ptr(), path) if mapped and t.numel() else None
        if start is not None:  # read from the file by offset; the mapping goes with t
            if _torch_byteorder(path) != sys.byteorder:  # torch swapped its copy; the file's bytes are read
                dtype = dtype.newbyteorder()
            strides = tuple(int(s) * dtype.itemsize for s in t.stride())
            offset = start + t.storage_offset() * dtype.itemsize
            del t
            with _bounded_io.open_regular(path) as f:
                self._raw(f, offset, shape, strides, dtype)
            return
        if mapped and t.numel():  # where the mapping cannot be located: the tensor read whole, now
            _bounded_io.check_memory(t.untyped_storage().nbytes(), f"{self.label} (read whole)")
            t = t.clone()
        self.array = (t.view(torch.int16) if self.bf16 else t).numpy().view(dtype)
        self.shape, self.dtype = shape, dtype

    def _open_hdf5(self, path: str) -> None:
        h5py = _optional("h5py", "h5py", ".h5", "h5py")
        f = self._keep = h5py.File(path, "r")  # closed by close(), also when the file is refused
        names: List[str] = []
        f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        ds = f[self._pick(names, "dataset")]
        self._check_dataset(ds)
        self.shape, self.dtype = tuple(int(s) for s in ds.shape), ds.dtype
        self._reader = lambda a, b: ds[a:b]  # h5py reads only the slice

    def _check_dataset(self, ds) -> None:
        """Refuse an HDF5 dataset whose data is not this file's own bytes, or that has none."""
        if ds.is_virtual:
            sources = sorted({src.file_name for src in ds.virtual_sources()})
            raise UserError(f"{self.label}: a virtual dataset (its data is mapped from {', '.join(sources)}); "
                            "richness reads only data stored in the file itself")
        if ds.external:
            names = sorted({os.fsdecode(name) for name, _, _ in ds.external})
            raise UserError(f"{self.label}: its data is stored in external files ({', '.join(names)}); "
                            "richness reads only data stored in the file itself")
        if ds.shape is None:
            raise UserError(f"{self.label}: an empty dataset (HDF5 null dataspace: no shape, no data)")

    def _open_parquet(self, path: str) -> None:
        pa = _optional("pyarrow", "pyarrow", ".parquet", "pyarrow")
        pq = _optional("pyarrow.parquet", "pyarrow", ".parquet", "pyarrow")
        pf = self._keep = pq.ParquetFile(path)  # closed by close(), also when the file is refused
        key = self._pick(list(pf.schema_arrow.names), "column")
        md = pf.metadata
        chunks = [md.row_group(g).column(c) for g in range(md.num_row_groups) for c in range(md.num_columns)]
        others = sorted({c.file_path for c in chunks if c.file_path and c.path_in_schema.split(".")[0] == key})
        if others:
            raise UserError(f"{self.label}: its column chunks are stored in other files ({', '.join(others)}); "
                            "richness reads only data stored in the file itself")
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
        except _UNREADABLE as e:
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


def _torch_byteorder(path: str) -> str:
    """The byte order a zip-format .pt file records for its tensors (native where it records none)."""
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            if name.count("/") == 1 and name.endswith("/byteorder"):
                order = z.read(name).decode(errors="replace")
                return order if order in ("little", "big") else sys.byteorder
    return sys.byteorder


class _NpzRows:
    """Rows a..b-1 of a compressed .npz member, decompressed forward (a chunk
    before the cursor restarts). The member's size was checked against its
    header, so a read never goes past it: a short member raises EOFError."""

    def __init__(self, zf: zipfile.ZipFile, member: "_bounded_io.NpzMember") -> None:
        self.zf, self.member = zf, member
        h = member.header
        self.row_shape = h.shape[1:]
        width = 1
        for s in self.row_shape:
            width *= s
        self.row_bytes = width * h.dtype.itemsize
        self.f: Optional[IO[bytes]] = None
        self._restart()

    def _restart(self) -> None:
        if self.f is not None:
            self.f.close()
        self.f = self.zf.open(self.member.info)
        self._read(self.member.header.header_bytes)
        self.pos = 0

    def _read(self, n: int) -> bytes:
        assert self.f is not None  # opened by _restart
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
        self.start, self.buf = 0, cast(Optional[np.ndarray], None)

    def _convert(self, col, first: int) -> np.ndarray:
        if col.null_count:
            raise UserError(f"{self.label}: rows {first}..{first + len(col) - 1} hold {col.null_count} nulls")
        if self.width is None:
            return col.to_numpy(zero_copy_only=False)
        values = col.flatten()
        if values.null_count:  # a null element inside a list (to_numpy would make it NaN)
            import pyarrow.compute as pc

            at = int(values.is_null().to_numpy(zero_copy_only=False).argmax())
            row = first + int(pc.list_parent_indices(col)[at].as_py())
            raise UserError(f"{self.label}: row {row} holds a null value inside its list (nulls in rows "
                            f"{first}..{first + len(col) - 1}: {values.null_count})")
        if hasattr(col, "value_lengths"):  # variable-length lists must all have the first row's width
            lengths = col.value_lengths().to_numpy(zero_copy_only=False)
            bad = np.flatnonzero(lengths != self.width)
            if bad.size:
                raise UserError(f"{self.label}: row {first + int(bad[0])} has {int(lengths[bad[0]])} values, "
                                f"row 0 has {self.width}")
        return values.to_numpy(zero_copy_only=False).reshape(len(col), self.width)

    def __call__(self, a: int, b: int) -> np.ndarray:
        if a < self.start:
            self._restart()
        parts: List[np.ndarray] = []
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


def open_or_bundle(spec: Optional[str], bundle: Optional[ArrayFile], key: str) -> Optional[ArrayFile]:
    """An explicit file, else the array ``key`` of the bundle the features came from, when it has one."""
    if spec is not None:
        return ArrayFile(spec)
    if bundle is None or key not in bundle.names:
        return None
    return ArrayFile(f"{bundle.path}:{key}")


def head_weights(spec: Optional[str]):
    if spec is None:
        return None
    f = ArrayFile(spec)
    try:
        f.check_float("head weights")
        if len(f.shape) != 2:
            raise UserError(f"{f.label}: head weights must be 2-D (outputs, features), got shape {f.shape}")
        _bounded_io.check_memory(2 * 8 * f.rows * f.shape[1],
                                 f"{f.label}: the head weights (read whole, as float64)")
        return np.array(f.chunk(0, f.rows), dtype=np.float64)
    finally:
        f.close()


def width(f: ArrayFile) -> int:
    return f.shape[1] if len(f.shape) == 2 else 1
