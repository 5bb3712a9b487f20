"""richness.similarity's pass over a loader: the default flattens feature maps into one row per sample,
as the CKA literature does (Kornblith et al. 2019), checked against a float64 numpy CKA of the
activations captured by the test's own hooks; models that share a module; empty loaders; what it says
outside a process group; no hook left on the models after an error."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import richness  # noqa: E402
from richness.torch.batches import FLATTEN_LIMIT  # noqa: E402


def cka(X, Y):
    """Biased linear CKA (Kornblith et al. 2019, eq. 5) of two row sets, float64, feature-space form."""
    X = np.asarray(X, np.float64).reshape(len(X), -1)
    Y = np.asarray(Y, np.float64).reshape(len(Y), -1)
    X, Y = X - X.mean(0), Y - Y.mean(0)
    return float(np.linalg.norm(Y.T @ X) ** 2 / (np.linalg.norm(X.T @ X) * np.linalg.norm(Y.T @ Y)))


def own_outputs(model, names, batches):
    """Each named layer's whole output over the batches, from hooks of the test itself."""
    out = {n: [] for n in names}
    hs = [model.get_submodule(n).register_forward_hook(
        lambda m, a, o, n=n: out[n].append(o.detach().double().numpy().copy())) for n in names]
    with torch.no_grad():
        for x in batches:
            model(x)
    for h in hs:
        h.remove()
    return {n: np.concatenate(v) for n, v in out.items()}


def no_hooks(*models):
    return all(not m._forward_hooks and not m._forward_pre_hooks for model in models for m in model.modules())


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 5)).double()


def images(n=60, bs=20):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(n, 3, 6, 6, generator=g, dtype=torch.float64)
    return [X[i:i + bs] for i in range(0, n, bs)]


def test_default_flattens_feature_maps_as_the_cka_literature():
    model, data = cnn(), images()
    rep = richness.similarity(model, data, ["0", "1", "2", "6"], progress=False)
    acts = own_outputs(model, ["0", "1", "2", "6"], data)
    assert rep.widths == [4 * 36, 4 * 36, 6 * 36, 5]
    names = ["0", "1", "2", "6"]
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            assert rep.cka[i, j] == pytest.approx(cka(acts[a], acts[b]), rel=1e-9, abs=1e-12)
    # averaging over positions is another quantity
    mean = richness.similarity(model, data, ["0", "2"], pool="mean", progress=False)
    assert mean.cka[0, 1] == pytest.approx(cka(acts["0"].mean(axis=(2, 3)), acts["2"].mean(axis=(2, 3))),
                                           rel=1e-9)
    assert abs(mean.cka[0, 1] - rep.cka[0, 2]) > 0.05
    # a 1-D convolution's (N, C, L) map is flattened the same way
    conv1d = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Tanh()).double()
    seqs = [torch.randn(15, 2, 9, dtype=torch.float64) for _ in range(3)]
    rep = richness.similarity(conv1d, seqs, ["0", "1"], progress=False)
    acts = own_outputs(conv1d, ["0", "1"], seqs)
    assert rep.widths == [21, 21]
    assert rep.cka[0, 1] == pytest.approx(cka(acts["0"], acts["1"]), rel=1e-9)


def test_past_the_width_limit_the_error_names_the_way_on_and_leaves_no_hook():
    big = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU()).train()
    x = torch.zeros(2, 3, 40, 40)  # 16 x 40 x 40 = 25,600 columns
    assert 16 * 40 * 40 > FLATTEN_LIMIT
    with pytest.raises(ValueError, match=r"'model.0'.*25,600 columns.*GiB.*pool='mean'"):
        richness.similarity(big, [x], ["0"], progress=False)
    assert no_hooks(big) and all(m.training for m in big.modules())
    rep = richness.similarity(big, [torch.randn(8, 3, 40, 40)], ["0"], pool="mean", progress=False)
    assert rep.widths == [16]


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(self.fc(x))


def test_models_sharing_a_module_are_each_captured_in_their_own_forward():
    torch.manual_seed(2)
    enc = nn.Linear(5, 7)
    a = nn.Sequential(enc, nn.ReLU(), nn.Linear(7, 3)).double()
    b = nn.Sequential(enc, nn.Tanh()).double()  # the same encoder
    g = torch.Generator().manual_seed(3)
    data = [torch.randn(25, 5, generator=g, dtype=torch.float64) for _ in range(4)]
    rep = richness.similarity({"a": a, "b": b}, data, {"a": ["0", "2"], "b": ["0", "1"]}, progress=False)
    acts_a, acts_b = own_outputs(a, ["0", "2"], data), own_outputs(b, ["0", "1"], data)
    acts = {"a.0": acts_a["0"], "a.2": acts_a["2"], "b.0": acts_b["0"], "b.1": acts_b["1"]}
    assert rep.n == 100
    for i, x in enumerate(rep.names):
        for j, y in enumerate(rep.names):
            assert rep.cka[i, j] == pytest.approx(cka(acts[x], acts[y]), rel=1e-9, abs=1e-12)
    # the shared module hooked in one model only, run by the other as well
    rep = richness.similarity({"a": a, "b": b}, data, {"a": ["0"], "b": ["1"]}, progress=False)
    assert rep.pair("a.0", "b.1").cka == pytest.approx(cka(acts["a.0"], acts["b.1"]), rel=1e-9)
    assert no_hooks(a, b)
    # a module that runs twice in one model's forward is still refused, naming the model
    twice = Twice()
    with pytest.raises(ValueError, match=r"'model.fc' ran twice in one forward pass of model 'model'"):
        richness.similarity(twice, [torch.randn(4, 4)], ["fc"], progress=False)
    assert no_hooks(twice)


def test_empty_loaders_say_so():
    model = cnn()
    with pytest.raises(ValueError, match="similarity: the loader gave no batches"):
        richness.similarity(model, [], ["0"], progress=False)
    with pytest.raises(ValueError, match="similarity: the loader gave no batches"):
        richness.similarity(model, iter(()), ["0"], progress=False)
    assert no_hooks(model)


def test_distributed_outside_a_process_group_names_similarity():
    model = cnn()
    with pytest.raises(RuntimeError, match=r"^similarity\(distributed=True\) needs an initialised"):
        richness.similarity(model, images(), ["0"], distributed=True, progress=False)
    with pytest.raises(TypeError, match="^similarity: distributed must be"):
        richness.similarity(model, images(), ["0"], distributed="yes", progress=False)
    assert no_hooks(model)


def test_errors_mid_pass_leave_no_hook_and_restore_modes():
    model = cnn().train()
    model[1].eval()  # a module of its own mode

    def failing():
        yield images()[0]
        raise RuntimeError("the loader broke")

    with pytest.raises(RuntimeError, match="the loader broke"):
        richness.similarity(model, failing(), ["0", "3"], progress=False)
    assert no_hooks(model)
    assert model.training and not model[1].training and model[2].training
    other = Unused()
    with pytest.raises(ValueError, match=r"layers \['n.spare'\] did not run"):
        richness.similarity({"m": model, "n": other}, images(), {"m": ["0"], "n": ["spare"]}, progress=False)
    assert no_hooks(model, other)


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.spare = nn.Flatten(), nn.Linear(2, 2)

    def forward(self, x):
        return self.used(x)


def test_flattened_sequences_of_changing_length_are_named():
    torch.manual_seed(4)
    emb = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3))
    data = [torch.randint(0, 10, (6, 5)), torch.randint(0, 10, (6, 7))]
    with pytest.raises(ValueError, match=r"'model.1' flattened to 21 columns in this batch and 15 before.*"
                                         r"pool='mean'"):
        richness.similarity(emb, data, ["1"], progress=False)
    rep = richness.similarity(emb, data, ["0", "1"], pool="mean", progress=False)
    with torch.no_grad():
        e = [emb[0](x) for x in data]
        h = [emb[1](t) for t in e]
    want = cka(np.concatenate([t.mean(1).double().numpy() for t in e]),
               np.concatenate([t.mean(1).double().numpy() for t in h]))
    assert rep.cka[0, 1] == pytest.approx(want, abs=2e-6)
    assert no_hooks(emb)
