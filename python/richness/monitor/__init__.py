"""Per-step monitoring of a training run: ``Monitor`` (``monitor.py``) wires
the head's captures (``capture.py``) into one of two routes, the window of the
last steps (``window.py``) or one batch per step (``onebatch.py``), and writes
records to sinks (``sinks.py``)."""

from .monitor import Monitor

__all__ = ["Monitor"]
