"""richness.torchmetrics.DLR against the n x n oracle (tests/reference.py):
accumulation, forward, compute, torchmetrics' state machinery (sync with
padded ranks, merge_state, state_dict, device moves, copies) and
MetricCollection."""

import copy
import functools
import pickle
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchmetrics")
nn = torch.nn

from richness.torchmetrics import DLR  # noqa: E402
from reference import dlr_naive, nc1_naive  # noqa: E402
from conftest import linear_data  # noqa: E402

data = functools.partial(linear_data, seed=4, shift=3.0, noise=0.5)




def t(a):
    return torch.tensor(a)


def feed(metric, X, F, y, step=70, order=None):
    starts = list(range(0, len(X), step))
    for i in (starts if order is None else order(starts)):
        metric.update(t(F[i:i + step]), t(y[i:i + step]), features=t(X[i:i + step]))


def states(metric):
    return {k: v.clone() for k, v in metric.metric_state.items()}


def same_states(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_exact_in_any_order_and_compute_is_pure():
    X, F, y = data()
    want = dlr_naive(X, F)[0]
    a, b = DLR(), DLR()
    feed(a, X, F, y)
    feed(b, X, F, y, order=lambda s: reversed(s))
    v1, v2 = float(a.compute()), float(a.compute())
    a._computed = None  # recompute from the state, not the cache
    v3 = float(a.compute())
    assert v1 == v2 == v3 and abs(v1 - want) < 1e-12 and abs(float(b.compute()) - want) < 1e-12
    rep = a.report()
    assert rep.n == 300 and abs(rep.nc1 - nc1_naive(X, y)) < 1e-9 * rep.nc1
    assert a.compute().dtype == torch.float64


def test_forward_gives_the_batch_value_and_adds_the_batch_without_growing_the_state():
    X, F, y = data()
    a, b = DLR(), DLR()
    for i in range(0, 300, 70):
        args = (t(F[i:i + 70]), t(y[i:i + 70]))
        val = a(*args, features=t(X[i:i + 70]))
        assert abs(float(val) - dlr_naive(X[i:i + 70], F[i:i + 70])[0]) < 1e-10
        b.update(*args, features=t(X[i:i + 70]))
        # the same fields and shapes as plain updates: nothing appended per call
        sa, sb = states(a), states(b)
        assert {k: v.shape for k, v in sa.items()} == {k: v.shape for k, v in sb.items()}
        for k in sa:
            assert torch.allclose(sa[k].double(), sb[k].double(), rtol=1e-12, atol=1e-9), k
    assert abs(float(a.compute()) - dlr_naive(X, F)[0]) < 1e-12


def test_bad_batch_raises_and_leaves_the_state():
    X, F, y = data()
    a = DLR()
    feed(a, X, F, y)
    before = states(a)
    with pytest.raises(ValueError):
        a.update(t(F[:5]), features=t(X[:5, :4]))  # other feature width
    with pytest.raises(ValueError):
        a.update(t(F[:5]))  # no features and no head
    with pytest.raises(ValueError):
        a.update(None, features=t(X[:5]))  # no outputs and no head
    assert same_states(before, states(a))
    assert abs(float(a.compute()) - dlr_naive(X, F)[0]) < 1e-12


def test_the_state_tensors_are_the_state_after_every_batch():
    # Read directly after each batch (no compute, no state_dict): the float64
    # co-moments of the rows so far, with the class arrays growing with the labels.
    X, F, y = data()
    y = np.where(np.arange(300) < 100, y % 2, y)  # two classes first, more later
    a = DLR()
    for i in range(0, 300, 50):
        a.update(t(F[i:i + 50]), t(y[i:i + 50]), features=t(X[i:i + 50]))
        Xs, Fs, ys = X[:i + 50], F[:i + 50], y[:i + 50]
        Xc, Fc = Xs - Xs.mean(axis=0), Fs - Fs.mean(axis=0)
        assert int(a.widths[0]) == i + 50
        assert np.allclose(a.mean.numpy(), Xs.mean(axis=0), rtol=1e-12, atol=1e-12)
        assert np.allclose(a.M.numpy(), Xc.T @ Xc, rtol=1e-10, atol=1e-10)
        assert np.allclose(a.B.numpy(), Xc.T @ Fc, rtol=1e-10, atol=1e-10)
        assert np.allclose(a.A.numpy(), Fc.T @ Fc, rtol=1e-10, atol=1e-10)
        k = ys.max() + 1
        assert a.class_counts.tolist() == np.bincount(ys, minlength=k).tolist()
        sums = np.stack([Xs[ys == c].sum(axis=0) for c in range(k)])
        assert np.allclose(a.class_sums.numpy(), sums, rtol=1e-12, atol=1e-9)


def test_in_place_writes_to_the_state_tensors_are_the_state():
    # copy_ into the tensors (torch bumps their version) replaces the state: the
    # next batch adds to what was written, not to what the metric held before.
    X, F, y = data()
    a, b = DLR(), DLR()
    feed(a, X[:140], F[:140], y[:140])
    feed(b, X[140:280] * 2.0, F[140:280], y[140:280])  # another state of the same widths
    for name, v in a.metric_state.items():
        getattr(b, name).copy_(v)
    feed(b, X[140:], F[140:], y[140:])
    assert abs(float(b.compute()) - dlr_naive(X, F)[0]) < 1e-12


def test_loaded_and_merged_tensors_are_not_written_by_later_batches():
    X, F, y = data()
    a = DLR()
    a.persistent(True)
    feed(a, X[:140], F[:140], y[:140])
    sd = a.state_dict()
    kept = {k: v.clone() for k, v in sd.items()}
    b, c = DLR(), DLR()
    b.load_state_dict(sd)
    c.merge_state(dict(sd))
    feed(b, X[140:], F[140:], y[140:])
    feed(c, X[140:], F[140:], y[140:])
    assert all(torch.equal(sd[k], kept[k]) for k in sd)
    want = dlr_naive(X, F)[0]
    assert abs(float(b.compute()) - want) < 1e-12 and abs(float(c.compute()) - want) < 1e-12


def test_empty_and_one_sample_compute_warn_and_give_nan():
    a = DLR()
    with pytest.warns(UserWarning, match="no samples"):
        assert torch.isnan(a.compute())
    X, F, y = data()
    a.update(t(F[:1]), features=t(X[:1]))
    with pytest.warns(UserWarning, match="one sample"):
        assert torch.isnan(a.compute())
    c = DLR()  # constant features: undefined, not an exception at the end of an epoch
    c.update(t(F[:20]), features=t(np.ones((20, 10))))
    with pytest.warns(UserWarning, match="undefined"):
        assert torch.isnan(c.compute())


def test_reset_then_reuse():
    X, F, y = data()
    a = DLR()
    feed(a, X[:100], F[:100], y[:100])
    a.reset()
    assert int(a.widths[0]) == 0 and a.M.numel() == 0
    feed(a, X, F, y)
    assert abs(float(a.compute()) - dlr_naive(X, F)[0]) < 1e-12


def test_head_weights_and_hook_with_metric_collection():
    from torchmetrics import MetricCollection
    from torchmetrics.classification import MulticlassAccuracy

    X, F, y = data(c=3)
    torch.manual_seed(0)
    body, fc = nn.Sequential(nn.Linear(10, 16), nn.Tanh()).double(), nn.Linear(16, 3).double()
    coll = MetricCollection({"acc": MulticlassAccuracy(num_classes=3), "dlr": DLR(head=fc)})
    free = MetricCollection({"acc": MulticlassAccuracy(num_classes=3), "dlr": DLR()})
    with torch.no_grad():
        for i in range(0, 300, 64):
            h = body(t(X[i:i + 64]))
            logits = fc(h)
            coll.update(logits, t(y[i:i + 64]))  # features from the head's hook
            free.update(logits, t(y[i:i + 64]), features=h)  # features passed, filtered to DLR
        H = body(t(X)).numpy()  # the head is not run here: its hook would keep this input
        want = dlr_naive(H, H @ fc.weight.numpy().T + fc.bias.numpy())[0]
    got, got_free = coll.compute(), free.compute()
    assert abs(float(got["dlr"]) - want) < 1e-12 and abs(float(got_free["dlr"]) - want) < 1e-12
    assert float(got["acc"]) == float(got_free["acc"])
    assert "head" not in dict(coll["dlr"].named_children())
    # the captured input is used once: an update without a new forward has no features
    with pytest.raises(ValueError, match="features"):
        coll["dlr"].update(t(F[:4]), t(y[:4]))
    # a non-linear head module: its input is captured, preds are streamed as outputs
    scaled = nn.Sequential(nn.Linear(16, 3)).double()
    m = DLR(head=scaled)
    with torch.no_grad():
        out = scaled(t(H)) * 2.0
    m.update(out, t(y))
    assert abs(float(m.compute()) - dlr_naive(H, out.numpy())[0]) < 1e-12


def test_head_input_of_another_batch_is_refused():
    fc = nn.Linear(10, 3).double()
    m = DLR(head=fc)
    X, F, y = data()
    with torch.no_grad():
        fc(t(X[:8]))
    with pytest.raises(ValueError, match="rows"):
        m.update(t(F[:5]), t(y[:5]))


def _fake_world(other):
    """A dist_sync_fn for two ranks: this metric's tensor and ``other``'s
    (torchmetrics gathers the states in registration order)."""
    pending = iter(list(other.metric_state.values()))

    def gather(tensor, group=None):
        return [tensor, next(pending)]

    return gather


def _synced_value(a, b):
    a.dist_sync_fn = _fake_world(b)
    a.distributed_available_fn = lambda: True
    a._computed = None
    return a.compute()


def test_sync_merges_ranks_of_different_shapes_exactly():
    X, F, y = data(n=400, classes=5)
    y0 = np.minimum(y[:200], 2)  # rank 0 sees 3 classes, rank 1 five: class arrays differ in length
    a, b = DLR(), DLR()
    feed(a, X[:200], F[:200], y0)
    feed(b, X[200:], F[200:], y[200:])
    local = float(a.compute())
    got = float(_synced_value(a, b))
    assert abs(got - dlr_naive(X, F)[0]) < 1e-12
    # unsynced again: the local state is back and accumulation goes on
    assert int(a.widths[0]) == 200 and a.widths.ndim == 1
    a.dist_sync_fn = None
    a.distributed_available_fn = lambda: False
    a._computed = None
    assert float(a.compute()) == local
    feed(a, X[200:], F[200:], y[200:])
    assert abs(float(a.compute()) - dlr_naive(X, F)[0]) < 1e-12


def test_sync_with_a_rank_that_saw_nothing():
    X, F, y = data()
    a, empty = DLR(), DLR()
    feed(a, X, F, y)
    assert abs(float(_synced_value(a, empty)) - dlr_naive(X, F)[0]) < 1e-12
    with pytest.warns(UserWarning, match="no samples"):  # nothing on either rank
        assert torch.isnan(_synced_value(DLR(), DLR()))


def test_merge_state_from_metric_and_dict():
    X, F, y = data()
    a, b, c = DLR(), DLR(), DLR()
    feed(a, X[:140], F[:140], y[:140])
    feed(b, X[140:], F[140:], y[140:])
    feed(c, X[140:], F[140:], y[140:])
    want = dlr_naive(X, F)[0]
    a2 = copy.deepcopy(a)
    a.merge_state(b)
    a2.merge_state(c.metric_state)
    assert abs(float(a.compute()) - want) < 1e-12 and abs(float(a2.compute()) - want) < 1e-12
    feed(a, X[:10], F[:10], y[:10])  # accumulation goes on after a merge
    assert abs(float(a.compute()) - dlr_naive(np.vstack([X, X[:10]]), np.vstack([F, F[:10]]))[0]) < 1e-12
    other = DLR()
    other.update(t(F[:5]), features=t(X[:5, :4]))
    before = states(a2)
    with pytest.raises(ValueError, match="feature widths"):
        a2.merge_state(other)
    assert same_states(before, states(a2))


def test_state_dict_round_trip_copies_and_dtype_requests():
    X, F, y = data()
    a = DLR()
    a.persistent(True)
    feed(a, X[:140], F[:140], y[:140])
    sd = a.state_dict()
    assert set(sd) == {"mean", "M", "out_mean", "B", "A", "tgt_mean", "Bt", "At", "class_counts", "class_sums",
                       "widths"}
    b = DLR()
    b.load_state_dict(sd)
    for m in (a, b, copy.deepcopy(a), pickle.loads(pickle.dumps(a)), a.clone()):
        m.set_dtype(torch.float32)  # the state keeps float64 sums and int64 widths
        m.to("cpu")
        assert m.M.dtype == torch.float64 and m.widths.dtype == torch.int64
        feed(m, X[140:], F[140:], y[140:])
        assert abs(float(m.compute()) - dlr_naive(X, F)[0]) < 1e-12


def test_float_target_is_streamed_as_regression_targets():
    X, F, y = data()
    a = DLR()
    a.update(t(F), t(F[:, 0]), features=t(X))  # float target: a regression target, not labels
    assert int(a.widths[3]) == 1 and int(a.widths[4]) == -1
    assert a.report().quality is not None


def test_plot_bounds():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    X, F, y = data()
    a = DLR()
    vals = [a(t(F[i:i + 70]), t(y[i:i + 70]), features=t(X[i:i + 70])) for i in range(0, 280, 70)]
    fig, ax = a.plot(vals)
    assert ax.get_ylim() == pytest.approx((-0.1, 1.1))  # the bounds, with torchmetrics' 10% margin
    fig, ax = a.plot()
    assert fig is not None
    assert DLR.plot_lower_bound == 0.0 and DLR.plot_upper_bound == 1.0


# -- the torchmetrics idioms with a head: forward, clones, live weights ---------------

def _head_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh()).double(), nn.Linear(16, 3).double()


def _linear_oracle(H, fc):
    W, b = fc.weight.detach().numpy(), fc.bias.detach().numpy()
    return dlr_naive(H, H @ W.T + b)[0]


def test_forward_with_a_head_takes_preds_and_target_alone_also_in_a_collection():
    from torchmetrics import MetricCollection
    from torchmetrics.classification import MulticlassAccuracy

    X, F, y = data()
    body, fc = _head_model()
    m = DLR(head=fc)
    coll = MetricCollection({"acc": MulticlassAccuracy(num_classes=3), "dlr": DLR(head=fc)})
    seen = []
    for i in range(0, 280, 70):
        with torch.no_grad():
            h = body(t(X[i:i + 70]))
            logits = fc(h)  # both metrics' hooks keep h
        val = m(logits, t(y[i:i + 70]))  # the torchmetrics idiom: metric(preds, target)
        out = coll(logits, t(y[i:i + 70]))
        want = _linear_oracle(h.numpy(), fc)
        assert abs(float(val) - want) < 1e-10 and abs(float(out["dlr"]) - want) < 1e-10
        seen.append(h.numpy())
    H = np.vstack(seen)
    assert abs(float(m.compute()) - _linear_oracle(H, fc)) < 1e-10
    assert abs(float(coll.compute()["dlr"]) - _linear_oracle(H, fc)) < 1e-10
    # a streamed-outputs metric: preds and features= through forward as through update
    free = DLR()
    val = free(t(F[:70]), t(y[:70]), features=t(X[:70]))
    assert abs(float(val) - dlr_naive(X[:70], F[:70])[0]) < 1e-10


def test_clone_keeps_the_head_so_a_validation_clone_measures_the_live_model():
    from torchmetrics import MetricCollection

    X, F, y = data()
    body, fc = _head_model()
    train = MetricCollection({"dlr": DLR(head=fc)}, prefix="train_")
    val = train.clone(prefix="val_")
    single = train["dlr"].clone()
    assert val["dlr"].head is fc and single.head is fc
    opt = torch.optim.SGD(list(body.parameters()) + list(fc.parameters()), lr=0.5)
    for i in range(0, 140, 70):  # training changes the weights after the clone was made
        logits = fc(body(t(X[i:i + 70])))
        train.update(logits.detach(), t(y[i:i + 70]))
        nn.functional.cross_entropy(logits, t(y[i:i + 70])).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():  # validation: the clones' hooks fire on the live model's forwards
        h = body(t(X[140:]))
        logits = fc(h)
    val.update(logits, t(y[140:]))
    single.update(logits, t(y[140:]))
    want = _linear_oracle(h.numpy(), fc)  # the weights now, not those at clone time
    assert abs(float(val.compute()["val_dlr"]) - want) < 1e-10
    assert abs(float(single.compute()) - want) < 1e-10


def test_compute_follows_the_heads_current_weights():
    X, F, y = data()
    body, fc = _head_model()
    m = DLR(head=fc)
    with torch.no_grad():
        h = body(t(X))
        m.update(fc(h), t(y))
    H = h.numpy()
    before = float(m.compute())
    assert abs(before - _linear_oracle(H, fc)) < 1e-10
    with torch.no_grad():  # an optimizer step, in place
        fc.weight[1:].mul_(0.0)
    after = float(m.compute())
    assert abs(after - _linear_oracle(H, fc)) < 1e-10 and abs(after - before) > 1e-3
    assert abs(float(m.report().dlr) - after) < 1e-12


@pytest.mark.parametrize("shape", [(20, 40, 3), (12, 40, 16), (60, 20, 3), (20, 10, 25)],
                         ids=["n<p, C<n: own co-moments", "n<p, C>n: sample space", "n>p, C<n: own co-moments",
                              "C>n>p: batch state"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("with_head", [False, True])
def test_forward_batch_value_on_every_route(shape, dtype, with_head):
    n, p, c = shape
    rng = np.random.default_rng(5)
    X = (rng.normal(size=(3 * n, p)) * np.linspace(0.5, 2.0, p) + 4.0).astype(dtype)
    fc = nn.Linear(p, c).double()
    W, b = fc.weight.detach().numpy(), fc.bias.detach().numpy()
    F = (X.astype(np.float64) @ rng.normal(size=(p, c)) + rng.normal(size=(3 * n, c))).astype(dtype)
    y = rng.integers(0, 3, 3 * n)
    m, ref = (DLR(head=fc), DLR(head=fc)) if with_head else (DLR(), DLR())
    tol = 1e-10 if dtype == "float64" else 2e-5
    for i in range(0, 3 * n, n):
        x64 = X[i:i + n].astype(np.float64)
        want = dlr_naive(x64, x64 @ W.T + b if with_head else F[i:i + n].astype(np.float64))[0]
        val = m(t(F[i:i + n]), t(y[i:i + n]), features=t(X[i:i + n]))
        ref.update(t(F[i:i + n]), t(y[i:i + n]), features=t(X[i:i + n]))
        assert val.dtype == torch.float64 and abs(float(val) - want) < tol
        sm, sr = states(m), states(ref)
        if c <= n or n < p:  # added by update itself
            assert same_states(sm, sr)
        else:  # the batch's own state, merged: equal up to rounding
            assert all(torch.allclose(sm[k].double(), sr[k].double(), rtol=1e-12, atol=1e-9) for k in sm)
    X64 = X.astype(np.float64)
    want = dlr_naive(X64, X64 @ W.T + b if with_head else F.astype(np.float64))[0]
    assert abs(float(m.compute()) - want) < tol


@pytest.mark.parametrize("rows", [128, 512], ids=["n<p", "n>p"])
@pytest.mark.parametrize("with_head", [False, True])
def test_forward_float32_value_where_outputs_are_exact_functions_of_the_features(rows, with_head):
    # Outputs an exact linear function of features with a common offset: A's pseudo-inverse
    # amplifies float32 rounding of the outputs' Gram (7e-7 here when A came from float32
    # products), so forward forms A from the float64 outputs; its value stays within 2e-7.
    rng = np.random.default_rng(3)
    X = (rng.standard_normal((2 * rows, 8)) @ rng.standard_normal((8, 320)) + 0.3 * rng.standard_normal((2 * rows, 320))
         + 2.0).astype(np.float32)
    W = rng.standard_normal((10, 320))
    F = (X.astype(np.float64) @ W.T).astype(np.float32)
    fc = nn.Linear(320, 10).double()
    with torch.no_grad():
        fc.weight.copy_(torch.from_numpy(W))
    m = DLR(head=fc) if with_head else DLR()
    for i in (0, rows):
        x64 = X[i:i + rows].astype(np.float64)
        want = dlr_naive(x64, x64 @ W.T + fc.bias.detach().numpy() if with_head else F[i:i + rows].astype(np.float64))[0]
        val = m(t(F[i:i + rows]), features=t(X[i:i + rows]))
        assert abs(float(val) - want) < 2e-7, (i, float(val), want)


def test_forward_bad_batch_and_constant_features():
    X, F, y = data(n=40, p=60)
    a = DLR()
    a(t(F[:20]), t(y[:20]), features=t(X[:20]))
    before = states(a)
    with pytest.raises(ValueError):
        a(t(F[20:30]), t(y[20:30]), features=t(X[20:30, :50]))  # other feature width
    with pytest.raises(ValueError):
        a(t(F[20:30]), t(y[20:26]), features=t(X[20:30]))  # labels of another length
    fc = nn.Linear(50, 3).double()
    h = DLR(head=fc)
    with pytest.raises(ValueError, match="input columns"):
        h(t(F[:20]), features=t(X[:20]))  # the head does not fit the features
    assert same_states(before, states(a)) and int(h.widths[0]) == 0
    with pytest.warns(UserWarning, match="undefined"):
        assert torch.isnan(a(t(F[20:30]), t(y[20:30]), features=t(np.ones((10, 60)))))


def test_dtype_requests_leave_states_and_values_float64():
    """As documented: set_dtype, .double(), .float(), .half() (also through a
    model holding the metric) change neither the states nor the values."""
    X, F, y = data()
    model = nn.Module()
    model.metric = DLR()
    feed(model.metric, X[:140], F[:140], y[:140])
    before = states(model.metric)
    for request in (lambda mod: mod.half(), lambda mod: mod.float(), lambda mod: mod.double(),
                    lambda mod: mod.metric.set_dtype(torch.float16)):
        request(model)
        assert same_states(before, states(model.metric))
    val = model.metric(t(F[140:210]), t(y[140:210]), features=t(X[140:210]).half())
    assert val.dtype == torch.float64 and model.metric.M.dtype == torch.float64
    want = dlr_naive(X[140:210].astype(np.float16).astype(np.float64), F[140:210])[0]
    assert abs(float(val) - want) < 1e-5


def test_dtype_requests_between_batches_keep_float64_states_and_reset_follows_the_state():
    X, F, y = data()
    a = DLR()
    feed(a, X[:140], F[:140], y[:140])
    a.to(torch.float32)  # torchmetrics' _apply would convert states here: ours are excluded
    a.set_dtype(torch.float16)
    a.half()
    assert all(v.dtype == (torch.int64 if k in ("widths", "class_counts") else torch.float64)
               for k, v in a.metric_state.items())
    feed(a, X[140:], F[140:], y[140:])
    assert abs(float(a.compute()) - dlr_naive(X, F)[0]) < 1e-12
    a.reset()  # right after a batch (the tensors not read since): an empty float64 state on the metric's device
    assert int(a.widths[0]) == 0 and a.M.dtype == torch.float64 and a.M.device == a.device
    feed(a, X, F, y)
    assert abs(float(a.compute()) - dlr_naive(X, F)[0]) < 1e-12


def test_forward_counts_as_an_update_and_clears_the_cached_compute():
    """forward adds the batch to the state: a compute() cached before it is not returned after it, and
    torchmetrics does not warn that compute ran before any update."""
    rng = np.random.default_rng(11)
    X = torch.tensor(rng.normal(size=(300, 6)) + 2.0)
    F = X @ torch.tensor(rng.normal(size=(6, 3))) + torch.tanh(X[:, :3]) + 0.3 * torch.tensor(rng.normal(size=(300, 3)))
    m = DLR()
    m.update(F[:100], features=X[:100])
    first = float(m.compute())
    m(F[100:], features=X[100:])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        after = float(m.compute())
    assert abs(first - dlr_naive(X[:100].numpy(), F[:100].numpy())[0]) < 1e-10
    assert abs(after - dlr_naive(X.numpy(), F.numpy())[0]) < 1e-10
    fresh = DLR()
    fresh(F, features=X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert abs(float(fresh.compute()) - dlr_naive(X.numpy(), F.numpy())[0]) < 1e-10
