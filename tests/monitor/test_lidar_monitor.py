"""LiDAR in the features-only Monitor (``Layer(measures=["lidar"])``): the
object ids given to ``step``, renumbered per step within a window, against
the float64 oracle of tests/finish/test_lidar.py on the raw rows; None with
a warning without ids; ids that do not fit refused before the step counts."""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import richness  # noqa: E402
from tiny_models import TwoViews  # noqa: E402
from test_lidar import lidar_naive  # noqa: E402


def train(route, steps, B, d, p, ids=True, layer=None, seed=0):
    """Two views per step (the layer runs twice); the Monitor's history, the
    step's rows and the object ids the oracle gives them (each step's own
    objects), and the warnings."""
    torch.manual_seed(seed)
    model = TwoViews(d, p)
    layer = richness.Layer("enc", measures=["lidar", "rankme"]) if layer is None else layer
    rows, objects = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with richness.Monitor(model, route, layer=layer) as mon:
            for s in range(steps):
                x = 3.0 * torch.randn(B, d, dtype=torch.float64)
                v1, v2 = x + 0.3 * torch.randn_like(x), x + 0.3 * torch.randn_like(x)
                model(v1)
                model(v2)
                with torch.no_grad():
                    rows.append(torch.cat([model.enc(v1), model.enc(v2)]).numpy())
                step_ids = torch.arange(B).repeat(2) * 7 + 100  # any integers: object b of this step
                objects.append(np.tile(np.arange(B), 2) + s * B)
                mon.step(labels=step_ids if ids else None)
    return mon.history, rows, objects, [str(w.message) for w in caught]


@pytest.mark.parametrize("every, window, B, p", [(2, 2, 24, 6), (3, 2, 10, 8), (1, 1, 6, 16)])
def test_records_carry_lidar(every, window, B, p):
    # (1, 1, 6, 16): a batch of 12 rows for 16 features, which the one-batch route would take; LiDAR
    # windows go to the Moments
    hist, rows, objects, _ = train(richness.Window(every, window), 6, B, 5, p)
    assert len(hist) == 6 // every
    for k, rec in enumerate(hist):
        steps = range(k * every + every - window, (k + 1) * every)
        H = np.concatenate([rows[s] for s in steps])
        ids = np.concatenate([objects[s] for s in steps])
        assert rec["n"] == H.shape[0] == 2 * B * window
        want = lidar_naive(H, ids)
        assert abs(rec["lidar"] - want) <= 1e-8 * want, (rec["lidar"], want)
        assert rec["rankme"] is not None and rec["nc1"] is None and rec["dlr"] is None


def test_without_ids_lidar_is_none_and_warned():
    hist, _, _, warned = train(richness.Window(2, 2), 4, 16, 5, 6, ids=False)
    assert [r["lidar"] for r in hist] == [None, None] and all(r["rankme"] is not None for r in hist)
    assert sum("lidar" in w and "object ids" in w for w in warned) == 1


def test_ids_ignored_without_lidar():
    layer = richness.Layer("enc", measures=["rankme"])
    hist, _, _, _ = train(richness.Window(2, 2), 4, 16, 5, 6, layer=layer)
    assert all(r["lidar"] is None for r in hist) and all(r["nc1"] is None for r in hist)


def test_ids_that_do_not_fit_are_refused():
    torch.manual_seed(1)
    model = TwoViews(5, 6)
    with richness.Monitor(model, richness.Window(2, 2), layer=richness.Layer("enc", measures=["lidar"])) as mon:
        x = torch.randn(8, 5, dtype=torch.float64)
        model(x)
        model(x + 0.1)
        with pytest.raises(ValueError, match="not counted"):
            mon.step(labels=torch.arange(8))  # one id per row of both views: 16
        with pytest.raises(ValueError, match="integers"):
            mon.step(labels=torch.zeros(16))
        assert mon.steps == 0
        mon.step(labels=torch.arange(8).repeat(2))
        assert mon.steps == 1
        model(x)
        model(x - 0.1)
        mon.step(labels=torch.arange(8).repeat(2))
    assert len(mon.history) == 1 and mon.history[0]["n"] == 32 and mon.history[0]["lidar"] is not None


def test_layer_measures_and_distributed():
    assert richness.Layer("enc", measures=["lidar"]).measures == ("lidar",)
    with pytest.raises(ValueError, match="need labels"):
        richness.Layer("enc", measures=["nc2_equinorm", "lidar"])
    with pytest.raises(ValueError, match="per step and rank"):
        richness.Monitor(TwoViews(5, 6), richness.Window(2, 2, distributed=True),
                         layer=richness.Layer("enc", measures=["lidar"]))


def test_csv_column(tmp_path):
    import csv

    torch.manual_seed(2)
    model = TwoViews(5, 6)
    path = tmp_path / "log.csv"
    with richness.Monitor(model, richness.Window(2, 2), layer=richness.Layer("enc", measures=["lidar"]),
                          log=str(path)) as mon:
        for _ in range(2):
            x = torch.randn(16, 5, dtype=torch.float64)
            model(x + 0.1 * torch.randn_like(x))
            model(x + 0.1 * torch.randn_like(x))
            mon.step(labels=torch.arange(16).repeat(2))
    with open(path, newline="") as f:
        row = next(csv.DictReader(f))
    assert float(row["lidar"]) == pytest.approx(mon.history[0]["lidar"], rel=1e-12)
