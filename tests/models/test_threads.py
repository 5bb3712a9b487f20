"""The thread policy of the core's updates (richness.torch.threads.BlasThreads) as
evaluate and Monitor apply it: never more threads than torch's pool, one for
small products, and the core's count restored afterwards.
"""

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import richness  # noqa: E402
from richness import _core  # noqa: E402
from tiny_models import loader  # noqa: E402


def spy_update_threads(monkeypatch) -> list:
    """(rows, the core's thread count) of every Moments.update from now on."""
    seen = []
    orig = richness.Moments.update

    def spy(self, features, *args, **kwargs):
        seen.append((int(features.shape[0]), _core.blas_get_num_threads()))
        return orig(self, features, *args, **kwargs)

    monkeypatch.setattr(richness.Moments, "update", spy)
    return seen


def test_blas_threads_never_exceed_torch_and_are_restored(monkeypatch):
    seen = spy_update_threads(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 512), nn.ReLU(), nn.Linear(512, 3))
    X = torch.randn(700, 8)
    before = _core.blas_get_num_threads()
    old = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            seen.clear()
            richness.evaluate(model, loader(X, bs=600), progress=False)
            # 600 x 512^2 multiply-adds is above the small-product cut: torch's count;
            # the last 100 rows are below it: one thread
            assert seen == [(600, t), (100, 1)]
    finally:
        torch.set_num_threads(old)
    assert _core.blas_get_num_threads() == before


def test_monitor_window_update_threads(monkeypatch):
    # the Monitor's window is added as one batch; one core worker below 2^30
    # multiply-adds (torch's threads are still spinning from the step), torch's
    # count above
    seen = spy_update_threads(monkeypatch)
    torch.manual_seed(0)
    head = nn.Linear(1024, 3)
    before, old = _core.blas_get_num_threads(), torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with richness.Monitor(head, richness.Window(2, 2)) as mon:
            for rows in (300, 300, 512, 512):  # windows of 600 and 1,024 rows (p = 1,024)
                head(torch.randn(rows, 1024))
                mon.step()
        assert seen == [(600, 1), (1024, 2)]
        assert [r["n"] for r in mon.history] == [600, 1024]
    finally:
        torch.set_num_threads(old)
    assert _core.blas_get_num_threads() == before
