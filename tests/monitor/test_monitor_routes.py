"""The Monitor's routes and what it reads (``Window``, ``EveryStep``, ``Probe``, ``Head``, ``Layer``):
each checks its own options when made, is a fixed value that pickles and serves several Monitors,
and the records it gives match the float64 n x n oracles on the rows of each window."""

import inspect
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import richness  # noqa: E402
from richness import EveryStep, Head, Layer, Monitor, Probe, Window  # noqa: E402
from reference import dlr_naive, nc1_naive  # noqa: E402


@pytest.mark.parametrize("make, error, match", [
    (lambda: Window(0), ValueError, "every must be a positive integer, got 0"),
    (lambda: Window(every=True), ValueError, "every must be a positive integer"),
    (lambda: Window(4, 5), ValueError, r"window must be an integer in \[1, every=4\], got 5"),
    (lambda: Window(4, lag=0), ValueError, "lag must be a positive integer or None, got 0"),
    (lambda: Window(distributed=1), TypeError, "distributed must be True, False or None"),
    (lambda: EveryStep(2.0), ValueError, "lag must be a positive integer or None"),
    (lambda: Probe(3.0), TypeError, "probe must be a tensor, an"),
    (lambda: Probe(torch.ones(4, 3), every=0), ValueError, "every must be a positive integer"),
    (lambda: Probe(torch.ones(4, 3), batch_fn=3), TypeError, "batch_fn must be a callable"),
    (lambda: Head(tokens="first"), ValueError, "tokens must be 'all', 'last'"),
    (lambda: Head(wide="logits"), ValueError, "wide must be 'weights' or 'outputs'"),
    (lambda: Head(measures="nope"), ValueError, "unknown measures"),
    (lambda: Head(3), TypeError, "head must be a submodule or its dotted name"),
    (lambda: Layer(""), ValueError, "layer must name a submodule"),
    (lambda: Layer(None), TypeError, "layer must be a submodule or its dotted name"),
    (lambda: Layer("body", pool="max"), ValueError, "pool must be one of"),
    (lambda: Layer("body", layout="rows"), ValueError, "layout must be one of"),
    (lambda: Layer("body", measures="nc3"), ValueError, "need labels"),
    (lambda: Window().replace(every_n=3), TypeError, "Window has no option 'every_n'"),
    (lambda: Window().replace(window=200), ValueError, r"window must be an integer in \[1, every=100\]"),
])
def test_each_object_checks_its_options_when_made(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_routes_are_fixed_values():
    w = Window(10, 4, lag=3)
    assert (w.every, w.window, w.lag, w.distributed) == (10, 4, 3, None)
    assert Window(10) == Window(10, 10) and Window(20).window == 10 and Window(np.int64(6)).every == 6
    assert EveryStep(2) == EveryStep(lag=2) and EveryStep() != Window(1, 1)
    assert (EveryStep().every, EveryStep().window) == (1, 1)
    assert w.replace(window=2) == Window(10, 2, lag=3) and w == Window(10, 4, lag=3)  # a copy: w unchanged
    assert repr(w) == "Window(every=10, window=4, lag=3, distributed=None)"
    with pytest.raises(AttributeError, match="fixed value"):
        w.every = 5
    assert Head(measures="all").measures == richness.finish.MEASURES and Head().measures == ()
    assert Layer("body").measures == richness.finish.diagnostics.SPECTRAL


def test_monitor_takes_the_route_and_refuses_what_is_not_one():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    with pytest.raises(TypeError, match="route must be a Window, EveryStep or Probe, got dict"):
        Monitor(model, {"every": 4})
    with pytest.raises(ValueError, match="features-only Monitor"):
        Monitor(model, Probe(torch.ones(6, 4), every=2), layer="0")
    with pytest.raises(ValueError, match="features-only Monitor"):
        Monitor(model, head="1", layer=Layer("0"))
    with Monitor(model, Window(5, 2), head=Head("1")) as mon:
        assert mon.route == Window(5, 2) and mon.head is model[1]
        assert repr(mon) == "Monitor(head='1', route=Window(every=5, window=2, lag=None, distributed=None), steps=0)"
        for _ in range(5):
            model(torch.randn(20, 4)).sum().backward()
            mon.step()
    assert len(mon.history) == 1


def test_the_constructor_has_at_most_ten_parameters():
    assert len(inspect.signature(Monitor.__init__).parameters) <= 10


def _train(route, seed=0, steps=8, bs=24, **kw):
    """SGD on a small MLP (p = 32 features at the head, n = 24 rows a step) under a Monitor on
    ``route``; returns its records and each step's float64 head input, output and labels."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed + 1)
    seen = []
    h = model[2].register_forward_hook(lambda m, a, o: seen.append((a[0].detach().double().numpy().copy(),
                                                                    o.detach().double().numpy().copy())))
    labels = []
    with Monitor(model, route, **kw) as mon:
        for _ in range(steps):
            x, y = torch.randn(bs, 6, generator=g), torch.randint(0, 5, (bs,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            labels.append(y.numpy())
            mon.step(labels=y)
    h.remove()
    return [{k: v for k, v in r.items() if k != "time"} for r in mon.history], seen, labels


@pytest.mark.parametrize("route, every, window", [
    (Window(4, 2), 4, 2),       # the window's Moments
    (Window(4, 4), 4, 4),
    (EveryStep(3), 1, 1),       # n = 24 < p = 32: each step's n x n Gram, in groups of 3
    (Window(1, 1, lag=1), 1, 1),
])
def test_records_match_the_float64_oracle_on_each_window(route, every, window):
    recs, seen, labels = _train(route)
    assert [r["step"] for r in recs] == list(range(every, 9, every))
    for rec in recs:
        rows = range(rec["step"] - window, rec["step"])
        H = np.concatenate([seen[i][0] for i in rows])
        F = np.concatenate([seen[i][1] for i in rows])
        y = np.concatenate([labels[i] for i in rows])
        want, rank = dlr_naive(H, F)
        assert rec["mode"] == "window" and rec["n"] == H.shape[0] and rec["rank"] == rank
        assert abs(rec["dlr"] - want) < 1e-5
        assert abs(rec["nc1"] - nc1_naive(H, y)) < 1e-4 * nc1_naive(H, y)


def test_a_route_object_serves_two_monitors_and_pickles():
    route = Window(4, 2)
    first, _, _ = _train(route)
    again, _, _ = _train(route)  # the same object, a second Monitor: nothing carried over
    assert first == again and len(first) == 2
    copy = pickle.loads(pickle.dumps(route))
    assert copy == route and copy is not route
    assert _train(copy)[0] == first
    every = EveryStep(3)
    with warnings_ignored():
        both = [_train(every, seed=s)[0] for s in (0, 0)]
    assert both[0] == both[1] == _train(pickle.loads(pickle.dumps(every)))[0]
    for value in (Head("2", tokens="last", measures="all"), Layer("1", pool="flatten", layout="tokens")):
        assert pickle.loads(pickle.dumps(value)) == value


def test_a_probe_route_pickled_gives_the_same_records():
    torch.manual_seed(3)
    x, y = torch.randn(200, 6), torch.randint(0, 5, (200,))
    route = Probe((x, y), every=2)
    copy = pickle.loads(pickle.dumps(route))
    assert torch.equal(copy.data[0], x) and copy.every == 2
    got = [_train(r, steps=4)[0] for r in (route, copy)]
    assert got[0] == got[1] and [r["mode"] for r in got[0]] == ["probe", "probe"]
    assert all(r["effective_dim"] is not None for r in got[0])


def test_the_lightning_callback_takes_the_route():
    pytest.importorskip("lightning")
    from richness.lightning import RichnessCallback

    cb = RichnessCallback(EveryStep(2), head="net.fc")
    assert cb.route == EveryStep(2)
    assert RichnessCallback().route == Window()
    with pytest.raises(TypeError, match="route must be a Window, EveryStep or Probe"):
        RichnessCallback(100)


class warnings_ignored:
    """Small-window warnings are the point of other tests."""

    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)
