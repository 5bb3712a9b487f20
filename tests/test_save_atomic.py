"""Moments.save is atomic: a process killed in the middle of a save leaves the
previous file loadable (or the complete new one), and at most a temp file.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np

import richness
from reference import dlr_naive


def test_saved_state_survives_kill_between_saves(tmp_path):
    path = tmp_path / "state.npz"
    script = textwrap.dedent(f"""
        import numpy as np, richness, sys
        rng = np.random.default_rng(0)
        m = richness.Moments()
        m.update(rng.normal(size=(50, 8)), rng.normal(size=(50, 3)))
        m.save({str(path)!r})
        print("first", m.n, flush=True)
        big = richness.Moments()
        big.update(rng.normal(size=(2000, 700)))
        while True:  # second save, killed somewhere inside it
            big.save({str(path)!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().split() == ["first", "50"]
    time.sleep(0.4)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    m = richness.Moments.load(path)  # still valid: the old state or a complete new one
    assert m.n in (50, 2000)
    if m.n == 50:
        rng = np.random.default_rng(0)
        X, F = rng.normal(size=(50, 8)), rng.normal(size=(50, 3))
        assert abs(m.compute().dlr - dlr_naive(X, F)[0]) < 1e-12
    leftovers = [f for f in os.listdir(tmp_path) if f != "state.npz"]
    assert all(f.startswith(".state.npz.richness-") for f in leftovers)  # only a temp file can remain
