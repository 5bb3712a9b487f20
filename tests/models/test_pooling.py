"""Pooling a layer's output into one row per sample (torch/batches.pool_rows), in the layout its module decides."""

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from richness.torch.batches import FLATTEN_LIMIT, layer_layouts, layer_pooler, layer_rows, module_layout, pool_rows  # noqa: E402,E501


def test_mean_over_positions_and_tokens():
    maps = torch.randn(5, 3, 4, 6)
    assert torch.allclose(pool_rows(maps, "m"), maps.permute(0, 2, 3, 1).reshape(5, 24, 3).mean(1))
    seq = torch.randn(5, 7, 4)
    assert torch.allclose(pool_rows(seq, "s", layout="tokens"), seq.sum(1) / 7)
    assert torch.allclose(pool_rows(seq, "s", layout="channels"), seq.sum(2) / 4)
    rows = torch.randn(5, 4)
    assert pool_rows(rows, "r") is rows
    assert torch.allclose(pool_rows((seq, "cache"), "hf", layout="tokens"), seq.mean(1))
    # channels_last memory keeps the logical (N, C, H, W) layout
    assert torch.allclose(pool_rows(maps.to(memory_format=torch.channels_last), "m"), pool_rows(maps, "m"))
    # (N, H, W, C) of a Linear applied to a channels-last map: averaged over H and W
    hwc = torch.randn(5, 4, 6, 3)
    assert torch.allclose(pool_rows(hwc, "l", layout="tokens"), hwc.reshape(5, 24, 3).mean(1))
    # torch's batch_first=False (T, N, D)
    tnd = torch.randn(7, 5, 4)
    assert torch.allclose(pool_rows(tnd, "a", layout="sequence", n=5), tnd.mean(0))
    assert torch.equal(pool_rows(tnd, "a", "flatten", layout="sequence"), tnd.transpose(0, 1).reshape(5, 28))


def test_tokens_and_flatten():
    seq = torch.randn(5, 7, 4)
    assert torch.equal(pool_rows(seq, "s", "first", layout="tokens"), seq[:, 0])
    assert torch.equal(pool_rows(seq, "s", "last", layout="tokens"), seq[:, 6])
    assert torch.equal(pool_rows(seq, "s", "last", layout="channels"), seq[:, :, 3])
    assert torch.equal(pool_rows(seq, "s", "flatten"), seq.reshape(5, 28))  # flattening needs no layout
    with pytest.raises(ValueError, match="tokens"):
        pool_rows(torch.randn(5, 3, 4, 4), "conv", "first")


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match=r"'big'.*GiB.*pool='mean'"):
        pool_rows(torch.zeros(2, 2, FLATTEN_LIMIT // 2 + 1), "big", "flatten")
    wide = torch.zeros(2, FLATTEN_LIMIT + 1)  # rows already: flattening them changes nothing
    assert pool_rows(wide, "wide", "flatten") is wide
    with pytest.raises(ValueError, match="not a tensor"):
        pool_rows({"a": 1}, "d")
    with pytest.raises(ValueError, match="pool must be one of"):
        pool_rows(torch.zeros(2, 3), "x", "max")
    with pytest.raises(ValueError, match="3 rows but the batch has 2"):
        pool_rows(torch.zeros(3, 4), "x", n=2)
    with pytest.raises(ValueError, match="shape"):
        pool_rows(torch.zeros(3), "x")
    with pytest.raises(ValueError, match="head saw 2"):
        layer_rows(torch.zeros(3, 4), 2, "x")
    with pytest.raises(ValueError, match=r"'blk'.*3-D.*layout='tokens' or layout='channels'"):
        pool_rows(torch.zeros(3, 4, 5), "blk")


class Block(nn.Module):
    def forward(self, x):
        return x * 2


def test_module_layouts():
    assert module_layout(nn.Conv1d(2, 3, 3)) == "channels"
    assert module_layout(nn.ConvTranspose1d(2, 3, 3)) == "channels"
    for m in (nn.BatchNorm1d(3), nn.InstanceNorm1d(3), nn.MaxPool1d(2), nn.AvgPool1d(2), nn.AdaptiveAvgPool1d(4),
              nn.GroupNorm(1, 3), nn.Conv2d(2, 3, 3), nn.Upsample(scale_factor=2)):
        assert module_layout(m) == "channels", m
    for m in (nn.Linear(2, 3), nn.Embedding(4, 3), nn.LayerNorm(3), nn.MultiheadAttention(4, 2, batch_first=True),
              nn.TransformerEncoderLayer(4, 2, batch_first=True), nn.LSTM(3, 4, batch_first=True)):
        assert module_layout(m) == "tokens", m
    for m in (nn.MultiheadAttention(4, 2), nn.TransformerEncoderLayer(4, 2), nn.GRU(3, 4),
              nn.TransformerEncoder(nn.TransformerEncoderLayer(4, 2), 1, enable_nested_tensor=False)):
        assert module_layout(m) == "sequence", m
    # a Sequential is its last child that says; activations and dropout keep their input's layout
    assert module_layout(nn.Sequential(nn.Conv1d(2, 3, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.Dropout())) == "channels"
    assert module_layout(nn.Sequential(nn.Linear(2, 3), nn.GELU())) == "tokens"
    for m in (nn.ReLU(), nn.Identity(), Block(), nn.Sequential(nn.Conv1d(2, 3, 3), Block())):
        assert module_layout(m) is None, m


def test_layouts_given_and_contradicted():
    assert layer_layouts(None, [("a",), ("b",)], "f") == [None, None]
    assert layer_layouts("tokens", [("a",), ("b",)], "f") == ["tokens", "tokens"]
    assert layer_layouts({"m.b": "channels"}, [("a", "m.a"), ("b", "m.b")], "f") == [None, "channels"]
    with pytest.raises(ValueError, match=r"f: layout names \['c'\].*\['a'\]"):
        layer_layouts({"c": "tokens"}, [("a",)], "f")
    with pytest.raises(ValueError, match="layout must be one of"):
        layer_layouts("nhwc", [("a",)], "f")
    with pytest.raises(ValueError, match="names one layer twice"):
        layer_layouts({"a": "tokens", "m.a": "tokens"}, [("a", "m.a")], "f")
    with pytest.raises(ValueError, match=r"layout='tokens' for layer 'c'.*Conv1d.*channels"):
        layer_pooler("c", nn.Conv1d(2, 3, 3), "mean", "tokens")
    x = torch.randn(4, 3, 5)
    assert torch.equal(layer_pooler("b", Block(), "mean", "channels")(x), x.mean(dim=2))
    assert torch.equal(layer_pooler("c", nn.Conv1d(2, 3, 3), "mean")(x), x.mean(dim=2))
    assert torch.equal(layer_pooler("l", nn.Linear(2, 5), "mean")(x), x.mean(dim=1))


def test_elementwise_layers_take_the_layout_of_what_feeds_them():
    net = nn.Sequential(nn.Sequential(nn.Conv1d(2, 3, 3), nn.BatchNorm1d(3)), nn.ReLU(),
                        nn.Sequential(nn.Dropout(), nn.GELU()), nn.Linear(5, 4), nn.Tanh(), Block(), nn.ReLU())

    class Chain(nn.Sequential):  # a forward of its own: its children need not run in a chain
        def forward(self, x):
            return self[1](x)

    other = Chain(nn.Linear(2, 2), nn.ReLU())
    assert module_layout(net[1], net, "1") == "channels"
    assert module_layout(net[2][1], net, "2.1") == "channels"  # through the Sequential's input
    assert module_layout(net[4], net, "4") == "tokens"
    assert module_layout(net[6], net, "6") is None  # after a custom module
    assert module_layout(other[1], other, "1") is None
    assert module_layout(net[1]) is None  # no model: nothing to go by
