"""What the torch integrations (``evaluate``, ``similarity``) share: a model's
device, eval mode for the duration of a pass, progress bars in samples, and
whether to merge the states of all ranks."""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Optional

from .._checks import check_bool_or_none
from .._optional import require_torch, require_tqdm

__all__ = []


def model_device(model: Any) -> Any:
    import torch

    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


@contextlib.contextmanager
def eval_mode(model: Any):
    """Eval mode for the duration; every module's own training flag restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, t in modes:
            m.training = t


def progress_bar(loader: Iterable, desc: str) -> Any:
    """A tqdm bar in samples, its total the loader's dataset length when it has one."""
    total = None
    ds = getattr(loader, "dataset", None)
    if ds is not None:
        try:
            total = len(ds)
        except TypeError:
            total = None
    return require_tqdm("richness.evaluate")(total=total, unit="sample", unit_scale=True, desc=desc,
                                              dynamic_ncols=True, leave=False)


def merge_ranks(distributed: Optional[bool], caller: str = "evaluate") -> bool:
    """``caller(distributed=...)`` (``evaluate``, ``similarity``): None = whether a
    process group is initialised; messages name ``caller``."""
    check_bool_or_none(distributed, f"{caller}: distributed")
    torch = require_torch(f"richness.{caller}")
    initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed is None:
        return initialised
    if distributed and not initialised:
        raise RuntimeError(f"{caller}(distributed=True) needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group); the default distributed=None merges only "
                           "when there is one")
    return distributed
