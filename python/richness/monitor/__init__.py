"""Per-step monitoring of a training run: ``Monitor`` (``monitor.py``) counts
steps, holds the hooks (``capture.py``) and writes records to sinks
(``sinks.py``); its route (``routes.py``: ``Window``, ``EveryStep``,
``Probe``) says which batches make a record and when, through the window's
Moments (``window.py``) or one batch per step (``onebatch.py``), and what it
reads, ``Head`` or ``Layer`` (``layer.py``)."""

from .monitor import Monitor
from .routes import EveryStep, Head, Layer, Probe, Window

__all__ = ["Monitor", "Window", "EveryStep", "Probe", "Head", "Layer"]
