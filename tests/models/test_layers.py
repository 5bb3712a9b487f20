"""evaluate(..., layers=[...]): DLR by depth in one pass, against the n x n oracle."""

import os

import pytest

torch = pytest.importorskip("torch")

import richness  # noqa: E402
from reference import dlr_naive, nc1_naive  # noqa: E402


def test_layer_profile_matches_oracle_per_layer(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 20), torch.nn.ReLU(),
        torch.nn.Linear(20, 12), torch.nn.Tanh(),
        torch.nn.Linear(12, 4)).double()
    X = torch.randn(400, 6, dtype=torch.float64)
    y = torch.randint(0, 4, (400,))
    loader = [(X[i:i + 64], y[i:i + 64]) for i in range(0, 400, 64)]
    rep = richness.evaluate(model, loader, layers=["1", model[3]], progress=False)
    assert list(rep.layers) == ["1", "3"]
    with torch.no_grad():
        h1 = model[1](model[0](X)).numpy()
        h3 = model[3](model[2](torch.from_numpy(h1))).numpy()
        out = model(X).numpy()
    for name, acts in (("1", h1), ("3", h3)):
        want, r = dlr_naive(acts, out)
        got = rep.layers[name]
        assert got.rank == r
        assert abs(got.dlr - want) < 1e-10
        assert abs(got.nc1 - nc1_naive(acts, y.numpy())) < 1e-8 * max(1.0, got.nc1)
    # the last layer's profile is the head's own DLR (its input is the features)
    assert abs(rep.layers["3"].dlr - rep.dlr) < 1e-10
    d = rep.to_dict()
    assert d["layers"]["1"]["dlr"] == rep.layers["1"].dlr
    pytest.importorskip("matplotlib")
    from richness import plot

    paths = plot.depth(rep.layers, tmp_path / "depth")
    assert paths and all(os.path.getsize(p) > 0 for p in paths)


def test_feature_maps_are_pooled_over_positions():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 5, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(5, 3)).double()
    X = torch.randn(300, 2, 6, 6, dtype=torch.float64)
    rep = richness.evaluate(model, [X[:150], X[150:]], layers=["1"], progress=False)
    with torch.no_grad():
        pooled = model[1](model[0](X)).mean(dim=(2, 3)).numpy()
        out = model(X).numpy()
    want, _ = dlr_naive(pooled, out)
    assert abs(rep.layers["1"].dlr - want) < 1e-10


def test_unknown_layer_is_a_clear_error():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match="no submodule 'nope'"):
        richness.evaluate(model, [torch.randn(8, 3)], layers=["nope"], progress=False)
