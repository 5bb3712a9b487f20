"""The representation diagnostics at their edges on the Monitor (a constant layer output: None
with one warning, window and every=1 routes), a one-row head, and the Lightning callback with a
head and ``measures=`` against reference.py's float64 oracles on activations the test captures."""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import richness
from reference import nc2_naive, nc3_naive, participation_ratio_naive, rankme_naive
from tiny_models import lightning_module  # noqa: E402

SPECTRAL = ("rankme", "alpha_req", "participation_ratio")


def dead_layer_model():
    """Linear + ReLU with a bias far below the inputs' reach: the ReLU's output is exactly 0."""
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).double()
    with torch.no_grad():
        model[0].bias.fill_(-100.0)
    return model


@pytest.mark.parametrize("every,window,bs", [(2, 2, 30), (1, 1, 8)])  # window route; every=1 (n < p) route
def test_constant_layer_output_is_none_with_one_warning(every, window, bs):
    torch.manual_seed(0)
    model = dead_layer_model()
    with pytest.warns(UserWarning, match="rankme, alpha_req, participation_ratio undefined at step") as caught:
        with richness.Monitor(model, richness.Window(every, window, lag=1), layer="1") as mon:
            for _ in range(4):
                model(torch.randn(bs, 6, dtype=torch.float64)).sum().backward()
                mon.step()
    assert len(mon.history) == 4 // every
    assert all(rec[name] is None for rec in mon.history for name in SPECTRAL)
    assert sum("undefined at step" in str(w.message) for w in caught) == 1  # once per Monitor


def test_defined_records_raise_no_undefined_warning():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    seen = []
    model[1].register_forward_hook(lambda m, a, o: seen.append(o.detach().numpy().copy()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with richness.Monitor(model, richness.Window(2, 2), layer="1") as mon:
            for _ in range(2):
                model(torch.randn(80, 6, dtype=torch.float64)).sum().backward()  # n = 160 = 10 p
                mon.step()
    (rec,) = mon.history
    H = np.concatenate(seen)
    assert rec["rankme"] == pytest.approx(rankme_naive(H), rel=1e-8)
    assert rec["participation_ratio"] == pytest.approx(participation_ratio_naive(H), rel=1e-8)


def test_one_row_head_and_one_class():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 4))
    m = richness.Moments()
    m.update(X, labels=np.zeros(60, dtype=np.int64))
    rep = m.compute(head_weights=rng.normal(size=(1, 4)))  # C = 1: NC2 and NC3 compare two or more classes
    assert rep.nc2_equinorm is None and rep.nc2_equiangle is None and rep.nc3 is None
    assert any("1 class" in w for w in rep.warnings)
    assert rep.rankme == pytest.approx(rankme_naive(X), rel=1e-9)  # the spectrum is still defined


def test_lightning_callback_with_head_and_measures():
    pl = pytest.importorskip("lightning.pytorch")
    from richness.lightning import RichnessCallback

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(10, 40), nn.Tanh())
            self.fc = nn.Linear(40, 4)
            self.double()

        def forward(self, x):
            return self.fc(self.body(x))

    torch.manual_seed(2)
    module = lightning_module(pl, Net())
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(30, 10, generator=g, dtype=torch.float64), torch.randint(0, 4, (30,), generator=g))
            for _ in range(4)]
    seen = []
    module.net.fc.register_forward_hook(
        lambda m, a, o: seen.append(a[0].detach().numpy().copy()) if torch.is_grad_enabled() else None)
    cb = RichnessCallback(richness.Window(2, 2), head=richness.Head("net.fc", measures="all"))
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, callbacks=[cb],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    rec = cb.monitor.history[-1]
    H = np.concatenate(seen[2:4])
    y = np.concatenate([b[1].numpy() for b in data[2:4]])
    equinorm, equiangle = nc2_naive(H, y)
    want = {"rankme": rankme_naive(H), "participation_ratio": participation_ratio_naive(H),
            "nc2_equinorm": equinorm, "nc2_equiangle": equiangle,
            "nc3": nc3_naive(H, y, module.net.fc.weight.detach().numpy())}  # the head at emission: the last step
    for name, v in want.items():
        assert rec[name] == pytest.approx(v, rel=1e-8), name
    assert rec["dlr"] is not None and rec["alpha_req"] is not None
