"""The Monitor under bad activation values (NaN, Inf, spreads whose squares
underflow, co-moments that overflow) on every route, the finite-sample
reference in its records (dlr_isotropic, dlr_normalized) and in every sink,
the one warning for windows below 10 x p rows, and the rows a features-only
step contributes (two views: both).

Values are checked against tests/reference.py's float64 n x n oracle on the
raw rows, and the isotropic reference against finish.isotropic.isotropic_dlr
called here on active-feature counts computed here in float64.
"""

import csv
import json
import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import richness  # noqa: E402
from tiny_models import TwoViews  # noqa: E402
from richness.finish.isotropic import isotropic_dlr  # noqa: E402
from reference import center_rows, dlr_naive, participation_ratio_naive  # noqa: E402

RTOL = 1e-6  # given to every Monitor here, so that the oracle cuts at the same place


class Net(nn.Module):
    """The head's input is the model's input: the test knows every row."""

    def __init__(self, p, c=5, dtype=torch.float64):
        super().__init__()
        self.body = nn.Identity()
        self.head = nn.Linear(p, c).to(dtype)

    def forward(self, x):
        return self.head(self.body(x))


def batches(steps, n, p, dtype=torch.float64, seed=0, classes=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, p, generator=g, dtype=dtype), torch.randint(0, classes, (n,), generator=g))
            for _ in range(steps)]


def spoil(x, how):
    x = x.clone()
    if how == "nan":
        x[3, 1] = float("nan")
    elif how == "inf":
        x[0, 0] = float("inf")
    elif how == "tiny":  # float32: squares underflow the products
        x = x * 1e-20
    elif how == "huge":  # float32: co-moments overflow
        x = x * 1e30
    return x


def run(model, data, route, labels=True, **kw):
    """Train-like forwards (gradients on) and a step per batch; the Monitor's
    history and the RichnessWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with richness.Monitor(model, route, rtol=RTOL, **kw) as mon:
            for x, y in data:
                model(x)
                mon.step(labels=y if labels else None)
    return mon.history, [str(w.message) for w in caught if issubclass(w.category, richness.RichnessWarning)]


def oracle(model, rows):
    """The float64 DLR and rank of the head's input and output over ``rows``."""
    H = torch.cat(rows).double()
    with torch.no_grad():
        F = model.head.double()(H) if model.head.weight.dtype == torch.float64 else model.head(H.float()).double()
    return dlr_naive(H.numpy(), F.numpy(), rtol=RTOL)


def active(H):
    """Features whose float64 variance exceeds RTOL times the largest (dead units excluded)."""
    var = center_rows(H).var(axis=0)
    return int((var > RTOL * var.max()).sum())


# -- bad activation values: no route raises out of step() ------------------------------------------------

BAD = ["nan", "inf"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("how", BAD + ["tiny", "huge"])
@pytest.mark.parametrize("labels", [True, False])
def test_every_step_with_batch_at_least_the_width_keeps_training(dtype, how, labels):
    # every=1 with batch >= width goes through the window's Moments: a step
    # they refuse gets a record with n 0 and dlr, rank and nc1 None and a
    # warning naming it; the other steps' records are those of a clean run.
    if dtype == torch.float64 and how in ("tiny", "huge"):
        pytest.skip("float64 products take 1e-20 and 1e30")
    p = 8
    model = Net(p, dtype=dtype)
    data = batches(4, 24, p, dtype=dtype)
    bad = list(data)
    bad[1] = (spoil(data[1][0], how), data[1][1])
    hist, warned = run(model, bad, richness.EveryStep(), labels=labels)
    clean, _ = run(model, data, richness.EveryStep(), labels=labels)
    assert [r["step"] for r in hist] == [1, 2, 3, 4]
    assert hist[1]["n"] == 0 and hist[1]["dlr"] is None and hist[1]["rank"] is None and hist[1]["nc1"] is None
    assert hist[1]["dlr_isotropic"] is None and hist[1]["dlr_normalized"] is None
    for i in (0, 2, 3):
        assert hist[i] == {**clean[i], "time": hist[i]["time"]}
        d, r = oracle(model, [data[i][0]])
        assert hist[i]["rank"] == r and abs(hist[i]["dlr"] - d) < (1e-10 if dtype == torch.float64 else 2e-5)
    assert any("step 2:" in w and "left out" in w for w in warned), warned


@pytest.mark.parametrize("how", BAD)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_window_leaves_the_bad_step_out_and_keeps_its_state(how, dtype):
    # window=3: the window's record is that of its other two steps exactly (the
    # Moments of their rows as one batch), and the next window is untouched.
    p = 6
    model = Net(p, dtype=dtype)
    data = batches(6, 20, p, dtype=dtype, seed=1)
    bad = list(data)
    bad[1] = (spoil(data[1][0], how), data[1][1])
    hist, warned = run(model, bad, richness.Window(3, 3))
    clean, _ = run(model, data, richness.Window(3, 3))
    assert [r["step"] for r in hist] == [3, 6] and hist[0]["n"] == 40
    # the first window: the Moments of steps 1 and 3 as one batch
    m = richness.Moments()
    rows = [data[0], data[2]]
    with torch.no_grad():
        m.update(torch.cat([x for x, _ in rows]), model(torch.cat([x for x, _ in rows])),
                 torch.cat([y for _, y in rows]))
    rep = m.compute(rtol=RTOL, spectrum=False)  # finished in numpy, the Monitor in torch: float64 rounding apart
    assert hist[0]["rank"] == rep.rank and abs(hist[0]["dlr"] - rep.dlr) < 1e-13
    assert abs(hist[0]["nc1"] - rep.nc1) < 1e-12 * rep.nc1
    d, r = oracle(model, [data[0][0], data[2][0]])
    assert hist[0]["rank"] == r and abs(hist[0]["dlr"] - d) < (1e-10 if dtype == torch.float64 else 2e-5)
    # the second window: as in the clean run, bit for bit
    assert hist[1] == {**clean[1], "time": hist[1]["time"]}
    assert [w for w in warned if "left out" in w] and all("step 2:" in w for w in warned if "left out" in w)


def test_window_with_every_step_bad_records_none():
    model = Net(6)
    data = [(spoil(x, "nan"), y) for x, y in batches(4, 20, 6, seed=2)]
    hist, warned = run(model, data, richness.Window(2, 2))
    assert [(r["step"], r["n"], r["dlr"], r["nc1"]) for r in hist] == [(2, 0, None, None), (4, 0, None, None)]
    assert sum("left out" in w for w in warned) == 4


@pytest.mark.parametrize("every", [1, 2])
def test_features_only_monitor_keeps_training(every):
    # layer=: window route (batch >= width) and one-batch route (batch < width)
    for n, p in ((24, 8), (6, 16)):
        model = Net(p)
        data = batches(4, n, p, seed=3)
        bad = list(data)
        bad[1] = (spoil(data[1][0], "nan"), data[1][1])
        layer = richness.Layer("body", measures=["participation_ratio"])
        hist, warned = run(model, bad, richness.Window(every, every), labels=False, layer=layer)
        clean, _ = run(model, data, richness.Window(every, every), labels=False, layer=layer)
        assert [r["step"] for r in hist] == [r["step"] for r in clean]
        assert warned and any("2" in w for w in warned)
        if every == 1:  # the bad step's own record
            assert hist[1]["step"] == 2 and hist[1]["n"] == 0 and hist[1]["participation_ratio"] is None
            same = [0, 2, 3]
        else:  # the first window: step 1's rows alone
            assert hist[0]["n"] == n
            assert abs(hist[0]["participation_ratio"] - participation_ratio_naive(data[0][0].numpy())) < 1e-10
            same = [1]
        for i in same:
            assert hist[i] == {**clean[i], "time": hist[i]["time"]}


def test_one_batch_route_warns_with_the_step_and_records_none():
    model = Net(32)
    data = batches(3, 8, 32, seed=4)
    bad = list(data)
    bad[2] = (spoil(data[2][0], "inf"), data[2][1])
    hist, warned = run(model, bad, richness.EveryStep(1))
    assert [r["step"] for r in hist] == [1, 2, 3]
    assert hist[2]["n"] == 0 and hist[2]["dlr"] is None and hist[2]["dlr_isotropic"] is None
    assert any("step(s) 3" in w for w in warned)
    for i in (0, 1):
        d, r = oracle(model, [data[i][0]])
        assert hist[i]["rank"] == r and abs(hist[i]["dlr"] - d) < 1e-10


def test_probe_with_bad_values_records_none_and_programming_errors_still_raise():
    p = 6
    x = torch.randn(30, p, dtype=torch.float64)
    y = torch.randint(0, 5, (30,))
    hist, warned = run(Net(p), batches(2, 10, p), richness.Probe((spoil(x, "nan"), y), every=1))
    assert [(r["step"], r["mode"], r["n"], r["dlr"]) for r in hist] == [(1, "probe", 0, None), (2, "probe", 0, None)]
    assert any("step 1:" in w and "probe" in w and "non-finite" in w for w in warned)
    # a diverged head (NaN weights; a linear head's features are streamed, its weights used at the end)
    model = Net(p)
    with torch.no_grad():
        model.head.weight.fill_(float("nan"))
    hist, warned = run(model, batches(1, 10, p), richness.Probe((x, y), every=1))
    assert [(r["n"], r["dlr"], r["rank"]) for r in hist] == [(30, None, None)]
    assert any("step 1:" in w and "probe" in w for w in warned)
    # labels that are not classes are the caller's mistake, not the model's: refused as before
    with pytest.raises(ValueError, match="labels out of range"):
        run(Net(p), batches(1, 10, p), richness.Probe((x, torch.full((30,), -3)), every=1))


def test_wrong_arguments_to_step_still_raise():
    model = Net(6)
    with richness.Monitor(model, richness.EveryStep()) as mon:
        model(torch.randn(20, 6, dtype=torch.float64))
        with pytest.raises(ValueError, match="labels"):
            mon.step(labels=torch.zeros(7, dtype=torch.long))
        assert mon.steps == 0  # refused: not counted
        mon.step(labels=torch.zeros(20, dtype=torch.long))
    assert len(mon.history) == 1


# -- the isotropic reference in records ------------------------------------------------------------------

def _with_dead_unit(data):
    out = []
    for x, y in data:
        x = x.clone()
        x[:, 0] = 0.5  # a dead unit: the reference counts active features only
        out.append((x, y))
    return out


def test_window_records_carry_the_isotropic_reference():
    p = 8
    model = Net(p)
    data = _with_dead_unit(batches(4, 30, p, seed=5))
    hist, _ = run(model, data, richness.Window(2, 2))
    for rec, part in zip(hist, (data[:2], data[2:])):
        H = torch.cat([x for x, _ in part]).numpy()
        d, r = oracle(model, [x for x, _ in part])
        assert rec["n"] == 60 and rec["rank"] == r and abs(rec["dlr"] - d) < 1e-10
        assert active(H) == p - 1
        iso = isotropic_dlr(60, active(H), r)
        assert rec["dlr_isotropic"] == iso
        assert rec["dlr_normalized"] == rec["dlr"] / iso
        # and the full report of the same rows agrees
        m = richness.Moments()
        with torch.no_grad():
            m.update(torch.cat([x for x, _ in part]), model(torch.cat([x for x, _ in part])))
        rep = m.compute(rtol=RTOL)
        assert abs(rep.dlr_isotropic - rec["dlr_isotropic"]) < 1e-12
        assert abs(rep.dlr_normalized - rec["dlr_normalized"]) < 1e-9


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_batch_records_carry_the_isotropic_reference(dtype):
    p = 40
    model = Net(p, dtype=dtype)
    data = _with_dead_unit(batches(3, 12, p, dtype=dtype, seed=6))
    hist, _ = run(model, data, richness.EveryStep(2))
    assert len(hist) == 3
    for rec, (x, _) in zip(hist, data):
        d, r = oracle(model, [x])
        assert rec["rank"] == r
        assert active(x.double().numpy()) == p - 1
        iso = isotropic_dlr(12, p - 1, r)
        assert rec["dlr_isotropic"] == iso
        assert rec["dlr_normalized"] == rec["dlr"] / iso


def test_probe_records_carry_the_reports_reference():
    p = 6
    model = Net(p)
    x = torch.randn(80, p, dtype=torch.float64)
    hist, _ = run(model, batches(2, 10, p), richness.Probe(x, every=2))
    with torch.no_grad():
        F = model(x)
    d, r = dlr_naive(x.numpy(), F.numpy(), rtol=RTOL)
    iso = isotropic_dlr(80, active(x.numpy()), r)
    (rec,) = hist
    assert abs(rec["dlr_isotropic"] - iso) < 1e-15 and abs(rec["dlr_normalized"] - d / iso) < 1e-9


def test_features_only_records_have_no_reference():
    hist, _ = run(Net(8), batches(2, 30, 8), richness.Window(2, 2), labels=False, layer="body")
    assert hist[0]["dlr"] is None and hist[0]["dlr_isotropic"] is None and hist[0]["dlr_normalized"] is None


# -- the sinks write them --------------------------------------------------------------------------------

class Writer:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))


def test_every_sink_writes_the_reference(tmp_path):
    model = Net(8)
    data = batches(4, 30, 8, seed=7)
    seen, writer = [], Writer()
    hist, _ = run(model, data, richness.Window(2, 2),
                  log=[str(tmp_path / "m.csv"), str(tmp_path / "m.jsonl"), writer, seen.append])
    assert len(hist) == 2 and all(r["dlr_isotropic"] is not None for r in hist)
    with open(tmp_path / "m.csv") as f:
        rows = list(csv.DictReader(f))
    with open(tmp_path / "m.jsonl") as f:
        lines = [json.loads(line) for line in f]
    for rec, row, line, got in zip(hist, rows, lines, seen):
        for key in ("dlr_isotropic", "dlr_normalized"):
            assert float(row[key]) == rec[key] and line[key] == rec[key] and got[key] == rec[key]
            assert (f"richness/{key}", rec[key], rec["step"]) in writer.scalars
    from richness.monitor.sinks import scalars

    assert scalars(hist[0], "p")["p/dlr_isotropic"] == hist[0]["dlr_isotropic"]
    assert scalars(hist[0], "p")["p/dlr_normalized"] == hist[0]["dlr_normalized"]


def test_csv_begun_with_fewer_fields_keeps_its_columns(tmp_path):
    path = tmp_path / "old.csv"
    path.write_text("step,mode,n,dlr,rank,nc1,effective_dim,time\n1,window,10,0.5,2,,,0.1\n")
    run(Net(8), batches(2, 30, 8), richness.Window(2, 2), log=str(path))
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and list(rows[1]) == ["step", "mode", "n", "dlr", "rank", "nc1", "effective_dim", "time"]
    assert None not in rows[1] and rows[1]["step"] == "2"
    assert [r["step"] for r in richness.plot.read_log(path)] == [1.0, 2.0]


def test_lightning_and_hugging_face_callbacks_log_the_reference():
    from richness.monitor.sinks import scalars

    rec = {"step": 3, "dlr": 0.25, "dlr_isotropic": 0.5, "dlr_normalized": 0.5, "n": 60}
    pl = pytest.importorskip("lightning.pytorch")
    from richness.lightning import RichnessCallback

    class Logger:
        rows = []

        def log_metrics(self, metrics, step=None):
            self.rows.append((step, metrics))

    class Trainer:
        is_global_zero = True
        loggers = [Logger()]

    cb = RichnessCallback()
    cb._trainer = Trainer()
    cb._to_loggers(rec)
    assert Logger.rows == [(3, scalars(rec, "richness"))]
    assert Logger.rows[0][1]["richness/dlr_isotropic"] == 0.5 and Logger.rows[0][1]["richness/dlr_normalized"] == 0.5
    del pl
    pytest.importorskip("transformers")
    from richness.transformers import RichnessCallback as HFCallback

    class HFTrainer:
        logged = []

        def log(self, values):
            self.logged.append(values)

        def add_callback(self, cb):
            pass

    hf = HFCallback(HFTrainer())
    hf._to_trainer(rec)
    assert HFTrainer.logged == [scalars(rec, "richness")]
    assert HFTrainer.logged[0]["richness/dlr_isotropic"] == 0.5


# -- small windows are warned about once -----------------------------------------------------------------

def _small(msgs):
    return [m for m in msgs if "rows for p =" in m]


@pytest.mark.parametrize("route, rows, warn", [
    (richness.Window(2, 2), 2 * 30, True),    # 60 rows for p = 8: below 10 p = 80
    (richness.Window(3, 3), 3 * 30, False),   # 90 rows: enough
    (richness.EveryStep(), 30, True),         # every step: each batch alone
])
def test_small_windows_warn_once_naming_the_fix(route, rows, warn):
    p = 8
    hist, warned = run(Net(p), batches(6, 30, p), route)
    assert hist and all(r["n"] == rows for r in hist)
    small = _small(warned)
    assert len(small) == (1 if warn else 0)
    if warn:
        assert f"n = {rows} rows for p = {p}" in small[0] and "window=" in small[0] and "every=" in small[0]
        w = int(small[0].split("window=")[1].split(" ")[0])
        assert w * 30 >= 10 * p and (w - 1) * 30 < 10 * p  # the window named reaches 10 p rows


def test_one_batch_route_warns_once_too():
    hist, warned = run(Net(32), batches(5, 8, 32), richness.EveryStep(2))
    assert len(hist) == 5 and len(_small(warned)) == 1


# -- the rows of a features-only step ----------------------------------------------------------------------

@pytest.mark.parametrize("every, window, B, p", [(2, 2, 20, 8), (1, 1, 6, 32)])
def test_features_only_step_counts_both_views(every, window, B, p):
    # SimCLR-style: the model runs once per view before each step; the step's
    # rows are both views' (n = 2 x batch a step), and so are its values.
    torch.manual_seed(8)
    d = 12
    model = TwoViews(d, p)
    steps = []
    with richness.Monitor(model, richness.Window(every, window),
                          layer=richness.Layer("enc", measures=["participation_ratio"])) as mon:
        for _ in range(4):
            x = torch.randn(B, d, dtype=torch.float64)
            v1, v2 = x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)
            model(v1)
            model(v2)
            with torch.no_grad():
                steps.append(torch.cat([model.enc(v1), model.enc(v2)]).numpy())
            mon.step()
    assert [r["n"] for r in mon.history] == [2 * B * window] * (4 // every)
    for k, rec in enumerate(mon.history):
        H = np.concatenate(steps[k * every + every - window:(k + 1) * every])
        assert H.shape[0] == 2 * B * window
        want = participation_ratio_naive(H)
        assert math.isclose(rec["participation_ratio"], want, rel_tol=1e-8)
