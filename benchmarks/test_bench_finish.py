"""pytest-benchmark suite for the finishing step (not part of the test run).

    python -m pytest benchmarks/test_bench_finish.py --benchmark-columns=median,iqr

DLR alone (what Monitor and the jackknife call) against the full report, in
head mode and with streamed outputs, at p = 512 and C = 100 or 2000 (C > p:
the head is finished in p-space, docs/MATH.md, "Many outputs"). Compare medians
within one run; benchmarks/compare.py sweeps p and C.
"""

import numpy as np
import pytest

import richness
from richness import finish as _finish

P, N = 512, 4096


def _state(c):
    rng = np.random.default_rng(0)
    scale = np.exp(-np.arange(P) / (P / 8)).astype(np.float32)
    x = rng.standard_normal((N, P), dtype=np.float32) * scale + np.float32(0.5)
    w = (rng.normal(size=(c, P)) / np.sqrt(P)).astype(np.float32)
    f = x @ w.T + np.float32(0.01) * rng.standard_normal((N, c), dtype=np.float32)
    m = richness.Moments()
    for s in range(0, N, 4096):
        m.update(x[s:s + 4096], f[s:s + 4096])
    return m, w


@pytest.fixture(scope="module", params=[100, 2000], ids=["C100", "C2000"])
def state(request):
    return _state(request.param)


def test_dlr_only_head(benchmark, state):
    m, w = state
    w64 = w.astype(np.float64)
    benchmark(lambda: _finish.dlr_of_state(m.state_dict(), w64, _finish.rtol_for("fp32")))


def test_dlr_only_streamed(benchmark, state):
    m, _ = state
    benchmark(lambda: _finish.dlr_of_state(m.state_dict(), None, _finish.rtol_for("fp32")))


def test_report_head(benchmark, state):
    m, w = state
    benchmark.pedantic(lambda: m.compute(head_weights=(w, None)), rounds=5, iterations=1)


def test_report_streamed(benchmark, state):
    m, _ = state
    benchmark.pedantic(m.compute, rounds=5, iterations=1)
