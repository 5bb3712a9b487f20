"""Where Monitor records go: CSV and JSONL files, TensorBoard writers, callables."""

from __future__ import annotations

import csv
import json
import os
from typing import Any, Callable

FIELDS = ("step", "mode", "n", "dlr", "rank", "nc1", "effective_dim", "time")


class _CsvSink:
    def __init__(self, path: str) -> None:
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        self.f = open(path, "a", newline="")
        self.w = csv.DictWriter(self.f, fieldnames=FIELDS)
        if new:
            self.w.writeheader()
            self.f.flush()

    def __call__(self, rec: dict) -> None:
        self.w.writerow({k: ("" if rec.get(k) is None else rec.get(k)) for k in FIELDS})
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
        for key in ("dlr", "nc1", "effective_dim"):
            v = rec.get(key)
            if v is not None:
                self.writer.add_scalar(f"{self.prefix}/{key}", v, rec["step"])

    def close(self) -> None:
        pass


class _CallbackSink:
    def __init__(self, fn: Callable[[dict], Any]) -> None:
        self.fn = fn

    def __call__(self, rec: dict) -> None:
        self.fn(rec)

    def close(self) -> None:
        pass


def _make_sinks(log: Any, prefix: str) -> list:
    if log is None:
        return []
    if isinstance(log, (list, tuple)):
        return [s for item in log for s in _make_sinks(item, prefix)]
    if isinstance(log, (str, os.PathLike)):
        path = os.fspath(log)
        if path.endswith(".csv"):
            return [_CsvSink(path)]
        if path.endswith(".jsonl") or path.endswith(".json"):
            return [_JsonlSink(path)]
        raise ValueError(f"log file {path!r}: use a .csv or .jsonl name")
    if hasattr(log, "add_scalar"):
        return [_TensorBoardSink(log, prefix)]
    if callable(log):
        return [_CallbackSink(log)]
    raise TypeError(f"log must be a .csv/.jsonl path, a callable, a SummaryWriter or a list of them, "
                    f"got {type(log).__name__}")
