"""richness.lightning.RichnessCallback in a short CPU Lightning run, and the
Monitor behaviour it relies on (first_step, the warning for a head that never
runs). DLR values are checked against tests/reference.py's n x n oracle on
the head's inputs and outputs recorded by an independent hook."""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import richness  # noqa: E402
from reference import dlr_naive  # noqa: E402
from tiny_models import sgd_train  # noqa: E402


class Net(nn.Module):
    def __init__(self, d=6, h=12, c=3):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, h), nn.Tanh())
        self.fc = nn.Linear(h, c)
        self.unused = nn.Linear(h, c)

    def forward(self, x):
        return self.fc(self.body(x))


def batches(steps=4, bs=40, d=6, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(bs, d, generator=g, dtype=torch.float64),
             torch.randint(0, c, (bs,), generator=g)) for _ in range(steps)]


class _Record:
    """The test's own hook on the head: (input, output) of every forward with
    gradients. A class, so that a model carrying it still pickles (a copied
    model records into its copy of the list)."""

    def __init__(self, store):
        self.store = store

    def __call__(self, mod, args, out):
        if torch.is_grad_enabled():
            self.store.append((args[0].detach().clone().numpy(), out.detach().clone().numpy()))


def record_head(module, store):
    return module.register_forward_hook(_Record(store))


# -- Monitor: step base and the idle-head warning --------------------------------

def test_monitor_first_step_labels_records_only():
    torch.manual_seed(0)
    net = Net().double()
    seen = []
    record_head(net.fc, seen)
    data = batches()
    with richness.Monitor(net, richness.Window(2, 2), first_step=0) as mon:
        sgd_train(net, mon, data)
    assert [r["step"] for r in mon.history] == [1, 3]  # emitted after the 2nd and 4th steps
    for rec, k in zip(mon.history, (0, 2)):
        H = np.vstack([seen[k][0], seen[k + 1][0]])
        F = np.vstack([seen[k][1], seen[k + 1][1]])
        assert abs(rec["dlr"] - dlr_naive(H, F)[0]) < 1e-10
    with pytest.raises(ValueError, match="first_step"):
        richness.Monitor(net, first_step=1.5)


def test_monitor_warns_once_when_its_head_never_runs():
    torch.manual_seed(0)
    net = Net().double()
    with richness.Monitor(net, richness.Window(2, 1), head="unused") as mon:
        with pytest.warns(UserWarning, match=r"'unused' \(Linear\) has not run.*head="):
            sgd_train(net, mon, batches(steps=2))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once: no second warning
            sgd_train(net, mon, batches(steps=2))
    assert mon.history == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a head that runs: no warning
        warnings.filterwarnings("ignore", message=r".*rows for p = \d+ features")  # but the small window's
        with richness.Monitor(net, richness.Window(2, 1), head="fc") as mon:
            sgd_train(net, mon, batches(steps=4))
    assert len(mon.history) == 2


# -- Lightning ----------------------------------------------------------------------

def _lightning():
    try:
        import lightning.pytorch as pl
    except ImportError:
        pl = pytest.importorskip("pytorch_lightning")
    return pl


def _module(pl, direct_forward=True, metrics=None, log_forward=False):
    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = Net().double()
            self.metrics = metrics(self.net) if metrics is not None else None

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self(x) if direct_forward else self.net.fc(self.net.body(x))
            loss = nn.functional.cross_entropy(out, y)
            self.log("loss", loss)
            if self.metrics is not None and log_forward:  # the batch values, through forward
                self.log_dict(self.metrics(out.detach(), y))
            elif self.metrics is not None:
                self.metrics.update(out.detach(), y)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Module()


def _logger(pl):
    from lightning_utilities.core.rank_zero import rank_zero_only  # noqa: F401  (installed with Lightning)

    class Memory(pl.loggers.Logger):
        def __init__(self):
            super().__init__()
            self.rows = []

        @property
        def name(self):
            return "memory"

        @property
        def version(self):
            return 0

        def log_hyperparams(self, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            self.rows.append((step, dict(metrics)))

    return Memory()


def _fit(pl, module, callbacks, steps=4, accumulate=1):
    data = batches(steps=steps * accumulate)
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    logger = _logger(pl)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=logger, callbacks=callbacks,
                         log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accumulate_grad_batches=accumulate)
    trainer.fit(module, loader)
    return trainer, logger


def _window_dlr(seen, *calls):
    """The oracle DLR of the head's inputs and outputs over the given forward calls."""
    H = np.vstack([seen[k][0] for k in calls])
    F = np.vstack([seen[k][1] for k in calls])
    return dlr_naive(H, F)[0]


def test_callback_logs_dlr_at_the_trainers_step():
    pl = _lightning()
    from richness.lightning import RichnessCallback

    module = _module(pl)
    seen = []
    record_head(module.net.fc, seen)
    cb = RichnessCallback(richness.Window(2, 2))
    trainer, logger = _fit(pl, module, [cb])
    hist = cb.monitor.history
    assert [r["step"] for r in hist] == [1, 3]
    for rec, k in zip(hist, (0, 2)):
        assert abs(rec["dlr"] - _window_dlr(seen, k, k + 1)) < 1e-10
        assert rec["nc1"] is not None
    dlr_rows = {step: m["richness/dlr"] for step, m in logger.rows if "richness/dlr" in m}
    loss_steps = [step for step, m in logger.rows if "loss" in m]
    assert dlr_rows == {1: hist[0]["dlr"], 3: hist[1]["dlr"]}
    assert loss_steps == [0, 1, 2, 3]  # Lightning logs the batch that ends the window at the same step


def test_callback_with_gradient_accumulation_takes_all_micro_batches():
    pl = _lightning()
    from richness.lightning import RichnessCallback

    module = _module(pl)
    seen = []
    record_head(module.net.fc, seen)
    cb = RichnessCallback(richness.Window(2, 1))
    _fit(pl, module, [cb], steps=2, accumulate=2)
    (rec,) = cb.monitor.history
    assert rec["step"] == 1 and rec["n"] == 80  # the 2nd optimizer step: micro-batches 2 and 3
    assert abs(rec["dlr"] - _window_dlr(seen, 2, 3)) < 1e-10


def test_callback_warns_when_training_bypasses_the_forward():
    pl = _lightning()
    from richness.lightning import RichnessCallback

    cb = RichnessCallback(richness.Window(2, 1))
    with pytest.warns(UserWarning, match="no forward of the model has run.*head="):
        _fit(pl, _module(pl, direct_forward=False), [cb])
    assert cb.monitor.history == []
    cb = RichnessCallback(richness.Window(2, 1), head="net.fc")  # naming the head fixes it
    _fit(pl, _module(pl, direct_forward=False), [cb])
    assert len(cb.monitor.history) == 2


def test_metric_collection_in_a_lightning_run():
    pl = _lightning()
    pytest.importorskip("torchmetrics")
    from torchmetrics import MetricCollection
    from torchmetrics.classification import MulticlassAccuracy

    from richness.torchmetrics import DLR

    def metrics(net):
        return MetricCollection({"acc": MulticlassAccuracy(num_classes=3), "dlr": DLR(head=net.fc),
                                 "dlr_streamed": DLR(head=net.body)})  # not linear: logits are streamed

    module = _module(pl, metrics=metrics)
    seen = []
    record_head(module.net.fc, seen)
    _fit(pl, module, [])
    got = module.metrics.compute()
    H = np.vstack([h for h, _ in seen])
    F = np.vstack([f for _, f in seen])
    W, b = module.net.fc.weight.detach().numpy(), module.net.fc.bias.detach().numpy()
    # a linear head: its weights at compute time on every step's features
    assert abs(float(got["dlr"]) - dlr_naive(H, H @ W.T + b)[0]) < 1e-10
    X = np.vstack([x.numpy() for x, _ in batches()])
    # the body's input (the data) against the logits each step produced
    assert abs(float(got["dlr_streamed"]) - dlr_naive(X, F)[0]) < 1e-10


def test_metric_collection_forward_logged_with_log_dict():
    pl = _lightning()
    pytest.importorskip("torchmetrics")
    from torchmetrics import MetricCollection

    from richness.torchmetrics import DLR

    module = _module(pl, metrics=lambda net: MetricCollection({"dlr": DLR(head=net.fc)}), log_forward=True)
    seen = []
    record_head(module.net.fc, seen)
    trainer, logger = _fit(pl, module, [])
    logged = {step: m["dlr"] for step, m in logger.rows if "dlr" in m}
    # each step's value: the batch's features against the head's weights of that forward
    assert sorted(logged) == [0, 1, 2, 3]
    for step in range(4):
        assert abs(logged[step] - _window_dlr(seen, step)) < 1e-10
    assert abs(float(module.metrics.compute()["dlr"]) - dlr_naive(
        np.vstack([h for h, _ in seen]),
        np.vstack([h for h, _ in seen]) @ module.net.fc.weight.detach().numpy().T
        + module.net.fc.bias.detach().numpy())[0]) < 1e-10


def test_callback_models_copy_and_save_mid_run_and_the_copy_is_not_monitored():
    """EMA/SWA idioms inside a run: the module deep-copied and torch.saved
    whole while the callback's Monitor is attached; the copies' forwards
    (with gradients, inside the window) never reach its window."""
    import copy
    import io

    pl = _lightning()
    from richness.lightning import RichnessCallback

    module = _module(pl)
    seen = []
    record_head(module.net.fc, seen)
    copies = []

    class Ema(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            buf = io.BytesIO()
            torch.save(pl_module, buf)
            buf.seek(0)
            for twin in (copy.deepcopy(pl_module), torch.load(buf, weights_only=False)):
                twin(batch[0] + 1.0).sum().backward()
                copies.append(twin)

    # torch.save pickles the class by name: give the test's local class one
    cls = type(module)
    cls.__qualname__ = cls.__name__ = "_SavedModule"
    globals()["_SavedModule"] = cls
    cb = RichnessCallback(richness.Window(2, 2))
    _fit(pl, module, [Ema(), cb])  # Ema runs first: its copies' forwards fall inside the window
    hist = cb.monitor.history
    assert len(copies) == 8 and len(seen) == 4 and [r["step"] for r in hist] == [1, 3]
    for rec, pair in zip(hist, ((0, 1), (2, 3))):
        assert rec["n"] == 80 and abs(rec["dlr"] - _window_dlr(seen, *pair)) < 1e-10
    with torch.no_grad():  # the copies are whole models
        x = batches()[0][0]
        assert all(torch.equal(c(x), copies[0](x)) for c in copies[:2])
