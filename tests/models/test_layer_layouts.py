"""The module decides how a 3-D layer output is laid out: a Conv1d's (N, C, L) map is averaged over its
positions (width C), a sequence (N, T, D) over its tokens, in similarity, evaluate(layers=) and
Monitor(layer=); a custom module's 3-D output needs layout=. Checked against float64 numpy oracles of
activations captured by the tests' own hooks."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import richness  # noqa: E402
from reference import cka_naive, dlr_naive  # noqa: E402


def rankme(H, centered):
    """exp of the entropy of the singular values of H (its columns centered or as given) over their sum."""
    H = np.asarray(H, np.float64)
    s = np.linalg.svd(H - H.mean(0) if centered else H, compute_uv=False)
    s = s[s > 1e-10 * s[0]]
    q = s / s.sum()
    return float(np.exp(-np.sum(q * np.log(q))))


def close_to_rankme(got, H):
    """RankMe of the rows H, of the centered rows or of the rows as given (the published definition, up
    to its epsilon): pooling over the wrong axis gives another width and values far from either."""
    return any(got == pytest.approx(rankme(H, c), rel=1e-4) for c in (True, False))


def conv1d_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(3, 16, 5, padding=2), nn.ReLU(), nn.Conv1d(16, 8, 3, padding=1),
                         nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(8, 4)).double()


def signals(n=120, bs=40, L=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 3, L, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (n,), generator=g)
    return [(X[i:i + bs], y[i:i + bs]) for i in range(0, n, bs)]


def captured(model, names, batches, grad=False):
    """Each named submodule's whole output over ``batches``, from hooks of the test itself."""
    out = {n: [] for n in names}

    def keep(m, a, o, n):
        o = o[0] if isinstance(o, tuple) else o
        if isinstance(m, nn.MultiheadAttention) and not m.batch_first:
            o = o.transpose(0, 1)  # (T, N, D) -> (N, T, D)
        out[n].append(o.detach().numpy().copy())
    hs = [model.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: keep(m, a, o, n)) for n in names]
    with torch.set_grad_enabled(grad):
        for x, _ in batches:
            model(x)
    for h in hs:
        h.remove()
    return {n: np.concatenate(v) for n, v in out.items()}


def test_conv1d_is_averaged_over_positions_in_similarity():
    model, data = conv1d_net(), signals()
    rep = richness.similarity(model, data, ["0", "1", "2"], pool="mean", progress=False)
    acts = captured(model, ["0", "1", "2"], data)
    rows = {k: v.mean(axis=2) for k, v in acts.items()}  # (N, C, L) -> (N, C)
    assert rep.widths == [16, 16, 8]  # channels, not the 48 positions
    for i, a in enumerate(["0", "1", "2"]):
        for j, b in enumerate(["0", "1", "2"]):
            assert rep.cka[i, j] == pytest.approx(cka_naive(rows[a], rows[b]), rel=1e-9, abs=1e-12)
    # "last" is the last position of the map, not the last channel
    rep = richness.similarity(model, data, ["0", "2"], pool="last", progress=False)
    assert rep.widths == [16, 8]
    assert rep.cka[0, 1] == pytest.approx(cka_naive(acts["0"][:, :, -1], acts["2"][:, :, -1]), rel=1e-9)


def test_conv1d_is_averaged_over_positions_in_evaluate():
    model, data = conv1d_net(), signals()
    rep = richness.evaluate(model, data, layers=["0", "1"], progress=False)
    acts = captured(model, ["0", "1", "5"], data)
    for name in ("0", "1"):
        pooled = acts[name].mean(axis=2)
        want, r = dlr_naive(pooled, acts["5"])
        assert rep.layers[name].rank == r
        assert rep.layers[name].dlr == pytest.approx(want, abs=1e-10)


def test_conv1d_is_averaged_over_positions_in_the_monitor():
    model = conv1d_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = signals(n=160, bs=40)
    seen, tokens = [], []  # over positions; over channels, as if (N, T, D)

    def keep(m, a, o):
        seen.append(o.detach().numpy().mean(axis=2))
        tokens.append(o.detach().numpy().mean(axis=1))
    model[0].register_forward_hook(keep)
    with richness.Monitor(model, richness.Window(2, 2), layer="0") as mon:
        for x, _ in data:
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    assert len(mon.history) == 2
    H = np.concatenate(seen[2:4])
    assert H.shape == (80, 16)
    assert close_to_rankme(mon.history[1]["rankme"], H)
    assert not close_to_rankme(mon.history[1]["rankme"], np.concatenate(tokens[2:4]))


class Block(nn.Module):
    """A custom block returning (N, T, D) tokens: its module does not say so."""

    def __init__(self, d=6):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 6)
        self.block = Block()
        self.attn = nn.MultiheadAttention(6, 2)  # batch_first=False: (T, N, D) in and out
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = self.block(self.embed(x))
        t = h.transpose(0, 1)
        a = self.attn(t, t, t)[0].transpose(0, 1)
        return self.head(a.mean(dim=1))


def test_custom_3d_output_needs_a_layout_and_attention_is_read_as_tokens():
    torch.manual_seed(3)
    model = Tokens().double()
    g = torch.Generator().manual_seed(4)
    X = torch.randn(90, 5, 4, generator=g, dtype=torch.float64)  # 5 tokens
    data = [(X[i:i + 30], torch.zeros(30, dtype=torch.long)) for i in range(0, 90, 30)]
    with pytest.raises(ValueError, match=r"layer 'model.block' \(Block\).*3-D.*layout='tokens'"):
        richness.similarity(model, data, ["block", "attn"], pool="mean", progress=False)
    with pytest.raises(ValueError, match=r"layer 'block' \(Block\).*layout="):
        richness.evaluate(model, data, layers=["block"], progress=False)
    assert all(not m._forward_hooks for m in model.modules())
    rep = richness.similarity(model, data, ["block", "attn"], pool="mean", layout={"block": "tokens"},
                              progress=False)
    acts = captured(model, ["block", "attn"], data)
    block = acts["block"].mean(axis=1)  # (N, T, D)
    attn = acts["attn"].mean(axis=1)
    assert rep.widths == [6, 6]
    assert rep.cka[0, 1] == pytest.approx(cka_naive(block, attn), rel=1e-9)
    # a layout against what the module says is refused before anything runs
    with pytest.raises(ValueError, match=r"layout='channels' for layer 'model.attn'.*MultiheadAttention"):
        richness.similarity(model, data, ["attn"], pool="mean", layout="channels", progress=False)
    with pytest.raises(ValueError, match=r"layout names \['nope'\]"):
        richness.similarity(model, data, ["block"], pool="mean", layout={"nope": "tokens"}, progress=False)
    rep = richness.evaluate(model, data, layers=["block"], layout="tokens", progress=False)
    out = captured(model, ["head"], data)["head"]
    assert rep.layers["block"].dlr == pytest.approx(dlr_naive(block, out)[0], abs=1e-10)


def test_monitor_asks_for_the_layout_of_a_custom_block():
    torch.manual_seed(5)
    model = Tokens().double()
    x = torch.randn(12, 5, 4, dtype=torch.float64)
    with richness.Monitor(model, richness.EveryStep(), layer="block") as mon:
        with pytest.raises(ValueError, match=r"'block' \(Block\).*layout="):
            model(x)
    with pytest.raises(ValueError, match="layout='channels' for layer 'embed'"):
        richness.Monitor(model, layer=richness.Layer("embed", layout="channels"))
    with pytest.raises(ValueError, match="layout must be"):
        richness.Layer("block", layout="rows")  # checked where it is given
    seen = []
    model.block.register_forward_hook(lambda m, a, o: seen.append(o.detach().numpy().mean(axis=1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with richness.Monitor(model, richness.Window(2, 2), layer=richness.Layer("block", layout="tokens")) as mon:
        for _ in range(2):
            loss = model(torch.randn(40, 5, 4, dtype=torch.float64)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    assert close_to_rankme(mon.history[0]["rankme"], np.concatenate(seen[-2:]))
