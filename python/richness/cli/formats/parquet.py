"""``.parquet``: one column read forward in record batches by pyarrow, one sample
per row, vectors as list columns."""

from __future__ import annotations

from typing import List, Optional, cast

import numpy as np

from .. import UserError
from .base import ArrayFile

__all__ = ["ParquetFile"]


class ParquetFile(ArrayFile):
    """A Parquet file: one column (``FILE:KEY``, the default key, or the only one),
    read forward in record batches; a list column (fixed or variable size, all
    rows of the first row's width) is 2-D. Column chunks stored in other files
    are refused."""

    def _open(self, path: str) -> None:
        pa = self.require("pyarrow")
        pq = self.require("pyarrow.parquet")
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
