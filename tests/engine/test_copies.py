"""Copies and pickles: ``copy.copy``, ``copy.deepcopy`` and ``pickle`` of a
``Moments`` give an equal, independent object; a torch model with a
``Monitor`` or a torchmetrics ``DLR(head=...)`` attached deep-copies and
``torch.save``s whole, and the copy is not monitored while the original
still is (checked with real forwards against tests/reference.py's n x n
oracle). The CUDA backend's copies are tested under the emulator
(tests/engine/test_cuda_emu.py), Lightning's in tests/test_lightning.py."""

import copy
import io
import pickle

import numpy as np
import pytest

import richness
from richness._state import precisions
from reference import dlr_naive, nc1_naive, states_equal
from conftest import linear_data


def data():
    X, F, y = linear_data(n=240, p=8, c=3, classes=4)
    return X, F, y, np.random.default_rng(1).normal(size=(240, 2))  # and float targets


def pickled(obj):
    return pickle.loads(pickle.dumps(obj))


COPIES = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": pickled}




def same_jackknife(a, b):
    """Whether two grouped Moments give bit-equal jackknife values: each
    leave-one-group-out replicate reads every other group's state."""
    ra, rb = a.compute(uncertainty=True), b.compute(uncertainty=True)
    return (ra.dlr, ra.dlr_stderr, ra.dlr_jackknife) == (rb.dlr, rb.dlr_stderr, rb.dlr_jackknife)


def filled(kind):
    """A Moments of each kind with the first 160 rows, fed in 40-row batches."""
    X, F, y, T = data()
    if kind == "empty":
        return richness.Moments(4)
    m = {"fp64": lambda: richness.Moments(4),
         "fp32": lambda: richness.Moments(4, precision="fp32"),
         "groups": lambda: richness.Moments(4, groups=3),
         "groups_seeded": lambda: richness.Moments(4, groups=3, group_seed=9)}[kind]()  # fills every group
    for i in range(0, 160, 40):
        m.update(X[i:i + 40], F[i:i + 40], y[i:i + 40], T[i:i + 40])
    return m


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("kind", ["empty", "fp64", "fp32", "groups", "groups_seeded"])
def test_moments_copies_are_equal_and_independent(how, kind):
    X, F, y, T = data()
    orig = filled(kind)
    before = orig.state_dict()
    dup = COPIES[how](orig)
    assert type(dup) is richness.Moments and dup is not orig and dup.num_classes == orig.num_classes
    assert states_equal(dup.state_dict(), before)
    if kind.startswith("groups"):  # the groups, through the jackknife that reads each of them
        assert same_jackknife(dup, orig)
    # independent: more data in the copy leaves the original exactly as it was
    for i in range(160, 240, 40):
        dup.update(X[i:i + 40], F[i:i + 40], y[i:i + 40], T[i:i + 40])
    assert states_equal(orig.state_dict(), before)
    assert dup.n == 80 + (0 if kind == "empty" else 160)
    first = 160 if kind == "empty" else 0
    want = dlr_naive(X[first:], F[first:])[0]
    rep = dup.compute()
    assert abs(rep.dlr - want) < (1e-6 if kind == "fp32" else 1e-10)
    assert abs(rep.nc1 - nc1_naive(X[first:], y[first:])) < (1e-5 if kind == "fp32" else 1e-9) * rep.nc1
    if kind != "empty":  # and the original still holds exactly its own 160 rows
        assert abs(orig.compute().dlr - dlr_naive(X[:160], F[:160])[0]) < (1e-6 if kind == "fp32" else 1e-10)
    if kind.startswith("groups"):  # the copy goes on with the same rotation (or random draws) as the original
        orig.update(X[160:200], F[160:200], y[160:200], T[160:200])
        orig.update(X[200:], F[200:], y[200:], T[200:])
        assert same_jackknife(dup, orig)


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("precision", precisions())
def test_moments_copies_keep_every_precision(how, precision):
    """A state of each product precision (tf32 and bf16 come from a GPU; a
    CPU Moments holds them loaded): the copy keeps it, and so its rank cut."""
    X, F, y, T = data()
    src = filled("fp64").state_dict()
    m = richness.Moments()
    m.load_state_dict(dict(src, precision=precision))
    dup = COPIES[how](m)
    assert states_equal(dup.state_dict(), m.state_dict()) and dup.state_dict()["precision"] == precision
    assert dup.compute().rtol == m.compute().rtol


def test_moments_copy_and_pickle_of_a_pickle():
    m = filled("groups")
    again = pickled(copy.deepcopy(pickled(m)))
    assert states_equal(again.state_dict(), m.state_dict())
    assert "_lock" in vars(again) and again._lock is not m._lock


# -- models with a Monitor or a DLR metric attached --------------------------------------

torch = pytest.importorskip("torch")
nn = torch.nn


from tiny_models import MLP  # noqa: E402  (module-level: torch.save pickles it by reference)


def Net():
    """In eval mode (no dropout: the oracle recomputes the head's input);
    the Monitor still captures its forwards run with gradients."""
    return MLP(6, 12, 3).eval()


def saved(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


MODEL_COPIES = {"deepcopy": copy.deepcopy, "torch.save": saved}


def batch(seed, n=40, d=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def head_rows(net, xs):
    """The head's inputs and outputs on ``xs``, computed apart from any hook."""
    with torch.no_grad():
        H = torch.cat([net.body(x) for x in xs])
        return H.numpy(), net.fc(H).numpy()


@pytest.mark.parametrize("how", MODEL_COPIES)
@pytest.mark.parametrize("head", [None, "fc"])
@pytest.mark.parametrize("when", ["before_first_forward", "inside_the_window"])
def test_model_with_a_monitor_copies_and_the_copy_is_not_monitored(how, head, when):
    torch.manual_seed(0)
    net = Net().double()
    xs = [batch(s) for s in range(4)]
    with richness.Monitor(net, richness.Window(2, 2), head=head) as mon:
        twin = MODEL_COPIES[how](net) if when == "before_first_forward" else None
        for step, (x, y) in enumerate(xs[:2]):
            net(x)
            if twin is None:
                twin = MODEL_COPIES[how](net)
            out = twin(xs[2 + step][0])  # the copy's forwards, with gradients, inside the window
            out.sum().backward()
            mon.step(labels=y)
        (rec,) = mon.history
    assert type(twin) is MLP and twin is not net
    H, F = head_rows(net, [x for x, _ in xs[:2]])
    assert rec["n"] == 80 and abs(rec["dlr"] - dlr_naive(H, F)[0]) < 1e-10
    assert abs(rec["nc1"] - nc1_naive(H, np.concatenate([y.numpy() for _, y in xs[:2]]))) < 1e-8 * rec["nc1"]
    # the copy computes what the original does, and can be monitored on its own
    with torch.no_grad():
        assert torch.equal(twin(xs[3][0]), net(xs[3][0]))
    with richness.Monitor(twin, richness.EveryStep(), head=head) as own:
        twin(xs[3][0])
        own.step()
        own.flush()
    H3, F3 = head_rows(twin, [xs[3][0]])
    assert abs(own.history[0]["dlr"] - dlr_naive(H3, F3)[0]) < 1e-10


def test_monitor_with_a_file_sink_still_copies_its_model(tmp_path):
    """The Monitor (open files, locks, threads) is never reached by the copy."""
    torch.manual_seed(0)
    net = Net().double()
    with richness.Monitor(net, richness.EveryStep(), log=str(tmp_path / "dlr.jsonl")) as mon:
        net(batch(0)[0])
        mon.step()
        twin = saved(copy.deepcopy(net))
        assert pickle.loads(pickle.dumps(twin)) is not None
    assert len(mon.history) == 1


tm = pytest.importorskip("torchmetrics")


@pytest.mark.parametrize("how", MODEL_COPIES)
def test_model_with_a_dlr_metric_copies_and_the_copy_feeds_nothing(how):
    from richness.torchmetrics import DLR

    torch.manual_seed(0)
    net = Net().double()
    metric = DLR(head=net.fc)
    xs = [batch(s) for s in range(3)]
    out = net(xs[0][0])
    twin = MODEL_COPIES[how](net)
    twin(xs[1][0])  # must not replace the original's captured features
    metric.update(out, xs[0][1])
    out = net(xs[2][0])
    twin(xs[1][0])
    metric(out, xs[2][1])
    H, _ = head_rows(net, [xs[0][0], xs[2][0]])
    W, b = net.fc.weight.detach().numpy(), net.fc.bias.detach().numpy()
    assert abs(float(metric.compute()) - dlr_naive(H, H @ W.T + b)[0]) < 1e-10


class WithMetrics(nn.Module):
    """The Lightning idiom: the metrics are a submodule of the model."""

    def __init__(self):
        super().__init__()
        from torchmetrics import MetricCollection

        from richness.torchmetrics import DLR

        self.net = Net()  # eval mode: no dropout
        self.metrics = MetricCollection({"dlr": DLR(head=self.net.fc)})

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("how", MODEL_COPIES)
def test_model_holding_its_metrics_copies_with_its_own_head(how):
    torch.manual_seed(0)
    model = WithMetrics().double()
    xs = [batch(s) for s in range(3)]
    model.metrics.update(model(xs[0][0]), xs[0][1])
    twin = MODEL_COPIES[how](model)
    # each model's metric reads its own head: the copy's is the copy's
    assert twin.metrics["dlr"].head is twin.net.fc and model.metrics["dlr"].head is model.net.fc
    twin.metrics.update(twin(xs[1][0]), xs[1][1])
    model.metrics.update(model(xs[2][0]), xs[2][1])
    W, b = model.net.fc.weight.detach().numpy(), model.net.fc.bias.detach().numpy()
    H, _ = head_rows(model.net, [xs[0][0], xs[2][0]])
    assert abs(float(model.metrics.compute()["dlr"]) - dlr_naive(H, H @ W.T + b)[0]) < 1e-10
    H2, _ = head_rows(model.net, [xs[0][0], xs[1][0]])
    assert abs(float(twin.metrics.compute()["dlr"]) - dlr_naive(H2, H2 @ W.T + b)[0]) < 1e-10


class MetricsFirst(nn.Module):
    """The metrics registered before the network that holds their head: a deep
    copy reaches the metric before the head."""

    def __init__(self):
        super().__init__()
        from torchmetrics import MetricCollection

        from richness.torchmetrics import DLR

        net = Net()
        self.metrics = MetricCollection({"dlr": DLR(head=net.fc)})
        self.net = net

    def forward(self, x):
        return self.net(x)


def test_deep_copy_reaching_the_metric_before_its_head_follows_its_own_head():
    torch.manual_seed(0)
    model = MetricsFirst().double()
    assert [n for n, _ in model.named_children()] == ["metrics", "net"]
    xs = [batch(s) for s in range(3)]
    model.metrics.update(model(xs[0][0]), xs[0][1])
    twin = copy.deepcopy(model)
    assert twin.metrics["dlr"].head is twin.net.fc and model.metrics["dlr"].head is model.net.fc
    with torch.no_grad():  # the copy trains apart: its weights move, the original's do not
        twin.net.fc.weight.mul_(1.5).add_(0.3)
    twin.metrics.update(twin(xs[1][0]), xs[1][1])
    model.metrics.update(model(xs[2][0]), xs[2][1])
    W, b = model.net.fc.weight.detach().numpy(), model.net.fc.bias.detach().numpy()
    H, _ = head_rows(model.net, [xs[0][0], xs[2][0]])
    assert abs(float(model.metrics.compute()["dlr"]) - dlr_naive(H, H @ W.T + b)[0]) < 1e-10
    W2, b2 = twin.net.fc.weight.detach().numpy(), twin.net.fc.bias.detach().numpy()
    H2, _ = head_rows(twin.net, [xs[0][0], xs[1][0]])
    assert abs(float(twin.metrics.compute()["dlr"]) - dlr_naive(H2, H2 @ W2.T + b2)[0]) < 1e-10
