"""pytest-benchmark suite for the CPU hot paths (not part of the test run).

    python -m pytest benchmarks/test_bench_core.py --benchmark-columns=median,iqr

Each case streams the same float32 batch; compare medians within one run.
"""

import numpy as np
import pytest

import richness

P, C, BATCH = 1024, 100, 4096


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, P), dtype=np.float32) + np.float32(0.5)
    w = (rng.normal(size=(C, P)) / np.sqrt(P)).astype(np.float32)
    return x, (x @ w.T).astype(np.float32), w


def test_update_head_mode(benchmark, batch):
    m = richness.Moments()
    benchmark(m.update, batch[0])


def test_update_streamed_outputs(benchmark, batch):
    m = richness.Moments()
    benchmark(m.update, batch[0], batch[1])


def test_torch_addmm_loop(benchmark, batch):
    torch = pytest.importorskip("torch")
    x, f = torch.from_numpy(batch[0]), torch.from_numpy(batch[1])
    S, XF, FF = torch.zeros(P, P), torch.zeros(P, C), torch.zeros(C, C)
    sx, sf = torch.zeros(P), torch.zeros(C)

    def step():
        S.addmm_(x.T, x)
        XF.addmm_(x.T, f)
        FF.addmm_(f.T, f)
        sx.add_(x.sum(0))
        sf.add_(f.sum(0))

    benchmark(step)


def test_compute_dlr_head(benchmark, batch):
    m = richness.Moments()
    m.update(batch[0])
    benchmark(lambda: m.compute(head_weights=(batch[2], None)))
