"""Where Monitor records go: CSV and JSONL files, TensorBoard writers,
Weights & Biases and MLflow runs, callables."""

from __future__ import annotations

import csv
import json
import os
from typing import Any, Callable

from .._optional import require_mlflow, require_wandb
from ..finish.diagnostics import MEASURES  # the representation diagnostics: None in a record unless measured

__all__ = []

FIELDS = ("step", "mode", "n", "dlr", "dlr_isotropic", "dlr_normalized", "rank", "nc1", "effective_dim") + MEASURES \
    + ("time",)
# the numbers a record sends to a tracker (Lightning's loggers, Hugging Face's Trainer, W&B, MLflow)
SCALARS = ("dlr", "dlr_isotropic", "dlr_normalized", "nc1", "effective_dim", "rank", "n") + MEASURES
# what a TensorBoard writer gets of a record
TENSORBOARD = ("dlr", "dlr_isotropic", "dlr_normalized", "nc1", "effective_dim") + MEASURES


def scalars(rec: dict, prefix: str) -> dict:
    """``{f"{prefix}/dlr": value, ...}`` for the record's numbers that are set."""
    return {f"{prefix}/{k}": float(rec[k]) for k in SCALARS if rec.get(k) is not None}


class _CsvSink:
    """Rows of ``FIELDS``; a file that already has rows keeps its own header's
    columns (a log begun by a version with fewer fields stays readable)."""

    def __init__(self, path: str) -> None:
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        fields: tuple = FIELDS
        if not new:
            try:
                with open(path, newline="") as f:
                    header = next(csv.reader(f), None)
            except (OSError, UnicodeDecodeError, csv.Error):
                header = None  # not a log of ours: appended to as before
            if header and "step" in header:
                fields = tuple(header)
        self.f = open(path, "a", newline="")
        self.w = csv.DictWriter(self.f, fieldnames=fields, extrasaction="ignore")
        if new:
            self.w.writeheader()
            self.f.flush()

    def __call__(self, rec: dict) -> None:
        self.w.writerow({k: ("" if rec.get(k) is None else rec.get(k)) for k in self.w.fieldnames})
        self.f.flush()

    def close(self) -> None:
        self.f.close()


class _JsonlSink:
    def __init__(self, path: str) -> None:
        self.f = open(path, "a")

    def __call__(self, rec: dict) -> None:
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


class _TensorBoardSink:
    def __init__(self, writer: Any, prefix: str) -> None:
        self.writer, self.prefix = writer, prefix

    def __call__(self, rec: dict) -> None:
        for key in TENSORBOARD:
            v = rec.get(key)
            if v is not None:
                self.writer.add_scalar(f"{self.prefix}/{key}", v, rec["step"])

    def close(self) -> None:
        pass


class _WandbSink:
    """A W&B run (``wandb.run`` for ``log="wandb"``). The values are logged against their own
    step metric ``{prefix}/step`` (``define_metric``), not W&B's global step: a training loop that
    logs its own values at its own rate cannot make W&B drop these as out of order."""

    def __init__(self, run: Any, prefix: str) -> None:
        if run is None:
            wandb = require_wandb("Monitor(log='wandb')")
            run = wandb.run
            if run is None:
                raise ValueError("Monitor(log='wandb') needs an active W&B run: call wandb.init(...) first "
                                 "(or pass the run object as log=)")
        self.run, self.prefix = run, prefix
        run.define_metric(f"{prefix}/step")
        run.define_metric(f"{prefix}/*", step_metric=f"{prefix}/step")

    def __call__(self, rec: dict) -> None:
        values = scalars(rec, self.prefix)
        if values:
            self.run.log({**values, f"{self.prefix}/step": rec["step"]})

    def close(self) -> None:
        pass  # the run belongs to the caller: wandb.finish() is theirs to call


class _MlflowSink:
    """MLflow's active run (``mlflow.log_metrics``; MLflow starts a run if none is active),
    each value at the record's step."""

    def __init__(self, prefix: str) -> None:
        self.mlflow, self.prefix = require_mlflow("Monitor(log='mlflow')"), prefix

    def __call__(self, rec: dict) -> None:
        values = scalars(rec, self.prefix)
        if values:
            self.mlflow.log_metrics(values, step=int(rec["step"]))

    def close(self) -> None:
        pass  # the run belongs to the caller


def _is_wandb_run(obj: Any) -> bool:
    return type(obj).__module__.startswith("wandb.") and hasattr(obj, "log") and hasattr(obj, "define_metric")


class _CallbackSink:
    def __init__(self, fn: Callable[[dict], Any]) -> None:
        self.fn = fn

    def __call__(self, rec: dict) -> None:
        self.fn(rec)

    def close(self) -> None:
        pass


def make_sinks(log: Any, prefix: str) -> list:
    if log is None:
        return []
    if isinstance(log, (list, tuple)):
        return [s for item in log for s in make_sinks(item, prefix)]
    if isinstance(log, str) and log == "wandb":
        return [_WandbSink(None, prefix)]
    if isinstance(log, str) and log == "mlflow":
        return [_MlflowSink(prefix)]
    if _is_wandb_run(log):
        return [_WandbSink(log, prefix)]
    if isinstance(log, (str, os.PathLike)):
        path = os.fspath(log)
        if path.endswith(".csv"):
            return [_CsvSink(path)]
        if path.endswith(".jsonl") or path.endswith(".json"):
            return [_JsonlSink(path)]
        raise ValueError(f"log file {path!r}: use a .csv or .jsonl name (or 'wandb', 'mlflow')")
    if hasattr(log, "add_scalar"):
        return [_TensorBoardSink(log, prefix)]
    if callable(log):
        return [_CallbackSink(log)]
    raise TypeError("log must be a .csv/.jsonl path, 'wandb', 'mlflow', a W&B run, a callable, a SummaryWriter "
                    f"or a list of them, got {type(log).__name__}")
