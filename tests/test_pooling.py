"""Pooling a layer's output into one row per sample (torch/batches.pool_rows)."""

import pytest

torch = pytest.importorskip("torch")

from richness.torch.batches import FLATTEN_LIMIT, layer_rows, pool_rows  # noqa: E402


def test_mean_over_positions_and_tokens():
    maps = torch.randn(5, 3, 4, 6)
    assert torch.allclose(pool_rows(maps, "m"), maps.permute(0, 2, 3, 1).reshape(5, 24, 3).mean(1))
    seq = torch.randn(5, 7, 4)
    assert torch.allclose(pool_rows(seq, "s"), seq.sum(1) / 7)
    rows = torch.randn(5, 4)
    assert pool_rows(rows, "r") is rows
    assert torch.allclose(pool_rows((seq, "cache"), "hf"), seq.mean(1))
    # channels_last memory keeps the logical (N, C, H, W) layout
    assert torch.allclose(pool_rows(maps.to(memory_format=torch.channels_last), "m"), pool_rows(maps, "m"))


def test_tokens_and_flatten():
    seq = torch.randn(5, 7, 4)
    assert torch.equal(pool_rows(seq, "s", "first"), seq[:, 0])
    assert torch.equal(pool_rows(seq, "s", "last"), seq[:, 6])
    assert torch.equal(pool_rows(seq, "s", "flatten"), seq.reshape(5, 28))
    with pytest.raises(ValueError, match="tokens"):
        pool_rows(torch.randn(5, 3, 4, 4), "conv", "first")


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match=r"'big'.*GiB.*pool='mean'"):
        pool_rows(torch.zeros(2, FLATTEN_LIMIT + 1), "big", "flatten")
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
