"""Overhead of the representation diagnostics on the Monitor's routes, side by side in one run:
the features-only Monitor (``layer=``, no head, no labels) and ``measures=`` beside DLR, on the
training step of ``bench_monitor.py`` (MLP 784-512-512-10, batch 128, SGD), with its
round-robin timing. The layer is the second hidden ReLU (p = 512): every=1 takes the n x n Gram
route (128 < 512) and reads the measures from its eigenvalues.

    python benchmarks/bench_monitor_layer.py [--steps 600] [--threads N] [--json out.json]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_monitor  # noqa: E402
import richness  # noqa: E402

SPECTRAL = ("rankme", "alpha_req", "participation_ratio")

bench_monitor.CONFIGS = {
    "off": (None, False),
    "default (every=100, window=10), labels": (dict(), True),
    "default, labels, measures=all": (dict(head=richness.Head(measures="all")), True),
    "layer, default (every=100, window=10)": (dict(layer="3"), False),
    "every=1, labels (DLR + NC1)": (dict(route=richness.EveryStep()), True),
    "every=1, labels, measures=spectral": (dict(route=richness.EveryStep(), head=richness.Head(measures=SPECTRAL)),
                                           True),
    "layer, every=1 (Gram eigenvalues)": (dict(route=richness.EveryStep(), layer="3"), False),
}

if __name__ == "__main__":
    bench_monitor.main()
