"""The representation diagnostics on every route: the Monitor with a head (window and every=1)
and features-only (``layer=``), its sinks, the Lightning and Hugging Face callbacks, the
torchmetrics metric and the command line; values against reference.py's float64 oracles on
activations captured by the test's own hooks."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import richness
from reference import (
    alpha_req_naive,
    effective_dim_naive,
    nc2_naive,
    nc3_naive,
    participation_ratio_naive,
    rankme_naive,
    spectrum_naive,
)
from tiny_models import lightning_module, sgd_train  # noqa: E402

SPECTRAL = ("rankme", "alpha_req", "participation_ratio")


class ConvNet(nn.Module):
    """A conv body whose 4-D output the features-only Monitor pools, and a linear head."""

    def __init__(self, dtype=torch.float64, width=24):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU())
        self.fc = nn.Linear(width, 4)
        self.to(dtype)

    def forward(self, x):
        return self.fc(self.body(x).mean(dim=(2, 3)))


class MLP(nn.Module):
    def __init__(self, d=10, h=40, c=4):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, h), nn.Tanh())
        self.fc = nn.Linear(h, c)
        self.double()

    def forward(self, x):
        return self.fc(self.body(x))


def spectral_oracle(H, rtol):
    return {"rankme": rankme_naive(H), "alpha_req": alpha_req_naive(H, rtol)[0],
            "participation_ratio": participation_ratio_naive(H),
            "effective_dim": effective_dim_naive(spectrum_naive(H)[0])}


def batches(steps, bs, shape, c=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn((bs,) + shape, generator=g, dtype=dtype), torch.randint(0, c, (bs,), generator=g))
            for _ in range(steps)]


def train(model, mon, data, seen=None, module=None, pooled=False):
    """SGD steps with ``mon.step``; ``seen`` collects ``module``'s training outputs (pooled over
    space when ``pooled``) through the test's own hook."""
    hook = None
    if seen is not None:
        def keep(mod, args, out):
            if torch.is_grad_enabled():
                seen.append((out.mean(dim=(2, 3)) if pooled else args[0]).detach().double().numpy().copy())
        hook = module.register_forward_hook(keep)
    sgd_train(model, mon, data, lr=0.05)
    if hook is not None:
        hook.remove()


def close(a, b, tol):
    assert a is not None and b is not None
    assert abs(a - b) <= tol * max(1.0, abs(b)), (a, b)


# -- the Monitor with a head -----------------------------------------------------------

def test_monitor_window_records_all_measures(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    data = batches(3, 30, (10,))
    seen = []
    log = [str(tmp_path / "m.jsonl"), str(tmp_path / "m.csv")]
    with richness.Monitor(model, richness.Window(3, 3), head=richness.Head(measures="all"), log=log) as mon:
        train(model, mon, data, seen, model.fc)
    (rec,) = mon.history
    H = np.concatenate(seen)
    y = np.concatenate([b[1].numpy() for b in data])
    want = spectral_oracle(H, 1e-10)
    equinorm, equiangle = nc2_naive(H, y)
    want.update(nc2_equinorm=equinorm, nc2_equiangle=equiangle,
                nc3=nc3_naive(H, y, model.fc.weight.detach().numpy()))  # the head's weights at emission
    for name, v in want.items():
        close(rec[name], v, 1e-8)
    line = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[0])
    assert line["rankme"] == rec["rankme"] and line["nc3"] == rec["nc3"]
    header, row = (tmp_path / "m.csv").read_text().splitlines()[:2]
    cols = dict(zip(header.split(","), row.split(",")))
    assert float(cols["alpha_req"]) == pytest.approx(rec["alpha_req"], rel=1e-12)


def test_monitor_default_has_no_measures():
    model = MLP()
    with richness.Monitor(model, richness.Window(2, 2)) as mon:
        train(model, mon, batches(2, 30, (10,)))
    (rec,) = mon.history
    assert all(rec[name] is None for name in SPECTRAL + ("nc2_equinorm", "nc3"))
    assert rec["dlr"] is not None


def test_monitor_every_1_reads_the_gram_eigenvalues():
    torch.manual_seed(1)
    model = MLP(h=40)
    data = batches(5, 16, (10,))  # n = 16 < p = 40: the one-batch route
    seen = []
    head = richness.Head(measures=SPECTRAL + ("nc2_equinorm",))
    with richness.Monitor(model, richness.EveryStep(3), head=head) as mon:
        train(model, mon, data, seen, model.fc)
    assert [r["step"] for r in mon.history] == [1, 2, 3, 4, 5]
    for rec, H, (_, y) in zip(mon.history, seen, data):
        for name, v in spectral_oracle(H, 1e-10).items():
            close(rec[name], v, 1e-8)
        close(rec["nc2_equinorm"], nc2_naive(H, y.numpy())[0], 1e-8)
        assert rec["nc3"] is None and rec["nc2_equiangle"] is None  # not asked; NC3 needs weights


# -- the features-only Monitor -----------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-8), (torch.float32, 2e-3)])
@pytest.mark.parametrize("every,window,bs", [(4, 2, 20), (1, 1, 12)])
def test_features_only_monitor_matches_oracle(dtype, tol, every, window, bs):
    torch.manual_seed(2)
    model = ConvNet(dtype)  # p = 24: bs 12 takes the every=1 Gram route, 20 x 2 the window
    data = batches(4, bs, (3, 5, 5), dtype=dtype)
    seen = []
    with richness.Monitor(model, richness.Window(every, window, lag=2), layer="body") as mon:
        train(model, mon, data, seen, model.body, pooled=True)
    assert len(mon.history) == 4 // every
    rtol = 1e-10 if dtype == torch.float64 else 1e-5
    for j, rec in enumerate(mon.history):
        last = (j + 1) * every
        H = np.concatenate(seen[last - window:last])
        assert rec["n"] == H.shape[0] and rec["dlr"] is None and rec["nc1"] is None
        for name, v in spectral_oracle(H, rtol).items():
            if v is None:  # alpha-ReQ at n = 12: one centered eigenvalue in k = 11..100
                assert rec[name] is None and name == "alpha_req" and H.shape[0] <= 12
            else:
                close(rec[name], v, tol)


def test_features_only_monitor_without_labels_or_head_module():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 8)).double()  # an SSL projector
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    model[1].register_forward_hook(lambda m, a, o: seen.append(o.detach().numpy().copy()))
    with richness.Monitor(model, richness.Window(2, 2), layer="1") as mon:
        for _ in range(4):
            z = model(torch.randn(50, 6, dtype=torch.float64))
            loss = (z ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    assert len(mon.history) == 2
    close(mon.history[1]["rankme"], rankme_naive(np.concatenate(seen[2:4])), 1e-8)


@pytest.mark.filterwarnings("ignore:richness.Monitor closed")
def test_features_only_monitor_refuses_bad_layers():
    model = ConvNet()
    with pytest.raises(ValueError, match="no submodule named 'nope'.*candidates"):
        richness.Monitor(model, layer="nope")
    with pytest.raises(ValueError, match="drop head="):
        richness.Monitor(model, head="fc", layer="body")
    with pytest.raises(ValueError, match="need labels"):
        richness.Monitor(model, layer=richness.Layer("body", measures=("rankme", "nc3")))

    class Dict(nn.Module):
        def forward(self, x):
            return {"h": x}

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.fc = Dict(), nn.Linear(5, 2)

        def forward(self, x):
            return self.fc(self.enc(x)["h"])

    net = Net()
    with richness.Monitor(net, richness.EveryStep(), layer="enc") as mon:
        with pytest.raises(ValueError, match="layer 'enc'.* returned a dict, not a tensor"):
            net(torch.randn(4, 5))
        assert mon.history == []


# -- callbacks, metric, command line ------------------------------------------------------

def test_lightning_callback_takes_layer():
    pl = pytest.importorskip("lightning.pytorch")
    from richness.lightning import RichnessCallback

    module = lightning_module(pl, MLP())
    seen = []
    module.net.body.register_forward_hook(
        lambda m, a, o: seen.append(o.detach().numpy().copy()) if torch.is_grad_enabled() else None)
    cb = RichnessCallback(richness.Window(2, 2), layer="net.body")
    loader = torch.utils.data.DataLoader(batches(4, 30, (10,)), batch_size=None)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, callbacks=[cb],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    hist = cb.monitor.history
    assert len(hist) == 2 and hist[0]["dlr"] is None
    close(hist[1]["rankme"], rankme_naive(np.concatenate(seen[2:4])), 1e-8)


def test_transformers_callback_takes_layer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from richness.transformers import RichnessCallback

    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=8, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 50, (8,), generator=g), "labels": torch.tensor(i % 3)}
            for i in range(24)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=6, max_steps=4,
                                          learning_rate=0.01, report_to="none", use_cpu=True, save_strategy="no",
                                          logging_steps=1000, disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    cb = RichnessCallback(trainer, richness.Window(2, 2), layer=richness.Layer("bert.encoder.layer.0", layout="tokens"))
    trainer.add_callback(cb)
    seen = []
    h = model.bert.encoder.layer[0].register_forward_hook(
        lambda m, a, o: seen.append((o[0] if isinstance(o, tuple) else o).detach().mean(dim=1).double().numpy())
        if torch.is_grad_enabled() else None)
    trainer.train()
    h.remove()
    hist = cb.monitor.history
    assert len(hist) == 2
    close(hist[1]["rankme"], rankme_naive(np.concatenate(seen[2:4])), 2e-3)
    logged = [e for e in trainer.state.log_history if "richness/rankme" in e]
    assert [e["richness/rankme"] for e in logged] == [r["rankme"] for r in hist]


def test_torchmetrics_measures():
    pytest.importorskip("torchmetrics")
    from richness.torchmetrics import DLR

    rng = np.random.default_rng(4)
    X = rng.normal(size=(300, 8)) @ rng.normal(size=(8, 8)) + 1.0
    y = rng.integers(0, 3, 300)
    W = rng.normal(size=(3, 8))
    metric = DLR(head_weights=torch.from_numpy(W), measures="all")
    for i in range(0, 300, 100):
        metric.update(torch.from_numpy(X[i:i + 100] @ W.T), torch.from_numpy(y[i:i + 100]),
                      features=torch.from_numpy(X[i:i + 100]))
    out = metric.compute()
    assert set(out) == {"dlr", "rankme", "alpha_req", "participation_ratio", "nc2_equinorm", "nc2_equiangle", "nc3",
                        "lidar"}
    close(float(out["rankme"]), rankme_naive(X), 1e-9)
    close(float(out["nc2_equiangle"]), nc2_naive(X, y)[1], 1e-9)
    close(float(out["nc3"]), nc3_naive(X, y, W), 1e-9)
    plain = DLR(head_weights=torch.from_numpy(W))
    plain.update(torch.from_numpy(X @ W.T), features=torch.from_numpy(X))
    assert float(plain.compute()) == pytest.approx(float(out["dlr"]), rel=1e-10)
    with pytest.raises(ValueError, match="unknown measures"):
        DLR(measures=["rank"])


def test_cli_text_and_json_carry_the_fields(tmp_path, capsys):
    from richness.cli import main

    rng = np.random.default_rng(5)
    X = rng.normal(size=(400, 6)) @ rng.normal(size=(6, 6))
    y = rng.integers(0, 3, 400)
    np.savez(tmp_path / "d.npz", features=X, outputs=X @ rng.normal(size=(6, 3)), labels=y)
    assert main(["eval", str(tmp_path / "d.npz"), "--json", "--no-progress"]) == 0
    rep = json.loads(capsys.readouterr().out)
    close(rep["rankme"], rankme_naive(X), 1e-9)
    close(rep["nc2_equinorm"], nc2_naive(X, y)[0], 1e-9)
    assert rep["alpha_req"] is None and rep["alpha_req_range"] is None  # p = 6: nothing in k = 11..100
    assert rep["nc3"] is None  # no head given
    assert main(["eval", str(tmp_path / "d.npz"), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "RankMe" in text and "alpha-ReQ" in text and "NC2 equinorm" in text


def test_tracker_sinks_send_the_measures():
    from richness.monitor.sinks import make_sinks, scalars

    rec = {"step": 3, "mode": "window", "n": 10, "dlr": None, "rank": None, "nc1": None, "effective_dim": 2.0,
           "rankme": 3.5, "alpha_req": 1.25, "participation_ratio": 2.5, "nc2_equinorm": None,
           "nc2_equiangle": None, "nc3": None, "time": 0.0}
    assert scalars(rec, "r") == {"r/effective_dim": 2.0, "r/n": 10.0, "r/rankme": 3.5, "r/alpha_req": 1.25,
                                 "r/participation_ratio": 2.5}

    class Writer:
        def __init__(self):
            self.rows = []

        def add_scalar(self, tag, value, step):
            self.rows.append((tag, value, step))

    w = Writer()
    (sink,) = make_sinks(w, "r")
    sink(rec)
    assert ("r/rankme", 3.5, 3) in w.rows and ("r/alpha_req", 1.25, 3) in w.rows
