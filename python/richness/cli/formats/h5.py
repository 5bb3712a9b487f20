"""``.h5``/``.hdf5``: HDF5 datasets sliced per chunk by h5py."""

from __future__ import annotations

import os
from typing import List

from .. import UserError
from .base import ArrayFile

__all__ = ["Hdf5File"]


class Hdf5File(ArrayFile):
    """An HDF5 file: one dataset (``FILE:KEY`` by its path in the file, the default
    key, or the only one), sliced per chunk by h5py. Datasets whose data lies in
    other files (virtual, external) or that have none are refused."""

    def _open(self, path: str) -> None:
        h5py = self.require("h5py")
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
