"""richness.Monitor on the CPU with tiny models in small training loops: windows,
probes and one-batch records against the n x n oracles, its logs, its settings,
and the precision of its products under a loop that allows reduced precision.

Every number is checked against an independent computation: tests/reference.py's
n x n oracles on activations computed here by plain forward calls, or a
Moments fed those activations directly.
"""

import json
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import richness  # noqa: E402
from reference import dlr_naive, nc1_naive  # noqa: E402
from tiny_models import acts, hook_count, lm_feats, lm_setup, make  # noqa: E402


def train_with_monitor(mon_kwargs, steps=12, bs=48, seed=0, record_window=None):
    model, X, y = make(n=steps * bs, seed=seed, dtype=torch.float32)
    model.drop.p = 0.0
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grabbed = []
    h = model.fc.register_forward_hook(
        lambda m, a, o: grabbed.append((a[0].detach().clone(), o.detach().clone())) if model.training else None)
    with richness.Monitor(model, **mon_kwargs) as mon:
        for i in range(steps):
            xb, yb = X[i * bs:(i + 1) * bs], y[i * bs:(i + 1) * bs]
            loss = nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec = mon.step(labels=yb)
            if record_window is not None:
                record_window(i + 1, grabbed[-1], yb, rec, model)
    h.remove()
    return model, X, y, mon


def test_monitor_window_matches_oracle():
    every, window = 4, 2
    feats, labs, checks = [], [], []

    outs = []

    def check(step, HF, yb, rec, model):
        if (step - 1) % every >= every - window:
            feats.append(HF[0].double().numpy())
            outs.append(HF[1].double().numpy())
            labs.append(yb.numpy())
        if step % every == 0:
            Hw, Fw, yw = np.concatenate(feats), np.concatenate(outs), np.concatenate(labs)
            want, r = dlr_naive(Hw, Fw)  # the outputs of the steps that produced the features
            checks.append((rec, want, r, nc1_naive(Hw, yw), Hw.shape[0]))
            feats.clear()
            outs.clear()
            labs.clear()
        else:
            assert rec is None

    _, _, _, mon = train_with_monitor({"route": richness.Window(every, window)}, steps=12, record_window=check)
    assert len(checks) == 3 and len(mon.history) == 3
    for rec, want, r, nc1, n in checks:
        assert rec["n"] == n == 96 and rec["mode"] == "window" and rec["rank"] == r
        assert abs(rec["dlr"] - want) < 1e-5  # fp32 products
        assert abs(rec["nc1"] - nc1) < 1e-3 * nc1
    assert [r["step"] for r in mon.history] == [4, 8, 12]


def test_monitor_every_step_and_no_pending_references(tmp_path):
    csv_path, jsonl_path = tmp_path / "log.csv", tmp_path / "log.jsonl"

    class FakeWriter:
        def __init__(self):
            self.calls = []

        def add_scalar(self, tag, value, step):
            self.calls.append((tag, value, step))

    writer, seen = FakeWriter(), []
    model, X, y, mon = train_with_monitor({"route": richness.EveryStep(),
                                           "log": [csv_path, jsonl_path, writer, seen.append]}, steps=5)
    assert len(mon.history) == 5 and seen == mon.history
    assert mon._pending == [] and hook_count(model) == 0
    lines = [json.loads(s) for s in jsonl_path.read_text().splitlines()]
    assert lines == mon.history
    import csv

    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert [float(r["dlr"]) for r in rows] == [r["dlr"] for r in mon.history]
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5]
    assert ("richness/dlr", mon.history[2]["dlr"], 3) in writer.calls
    assert all(0.0 <= r["dlr"] <= 1.0 for r in mon.history)


def test_monitor_probe_mode_matches_evaluate_and_restores_modes():
    model, X, y = make(n=200, dtype=torch.float32)
    probe = (X[:120], y[:120])
    model.train()
    model.body[0].eval()
    mon = richness.Monitor(model, richness.Probe(probe, 3))
    try:
        for _ in range(6):
            model(X[:16])
            mon.step()
    finally:
        mon.close()
    assert model.training and not model.body[0].training and model.fc.training
    assert hook_count(model) == 0
    assert [r["step"] for r in mon.history] == [3, 6]
    H, F = acts(model, X[:120])
    want = dlr_naive(H, F)[0]
    assert abs(mon.history[0]["dlr"] - want) < 1e-5
    assert mon.history[0]["effective_dim"] > 1.0
    assert abs(mon.history[0]["nc1"] - nc1_naive(H, y[:120].numpy())) < 1e-3 * mon.history[0]["nc1"]


def test_monitor_rejects_bad_settings():
    model, _, _ = make()
    with pytest.raises(ValueError, match="every"):
        richness.Monitor(model, richness.Window(0))
    with pytest.raises(ValueError, match="window"):
        richness.Monitor(model, richness.Window(5, 6))
    with pytest.raises(ValueError, match=".csv or .jsonl"):
        richness.Monitor(model, log="out.txt")
    with pytest.raises(ValueError, match="no submodule"):
        richness.Monitor(model, head="fc2")
    assert hook_count(model) == 0


def test_monitor_close_warns_when_no_record_was_emitted(tmp_path):
    model, X, y = make(n=64, dtype=torch.float32)
    log = tmp_path / "short.jsonl"
    mon = richness.Monitor(model, richness.Window(10), log=str(log))
    for _ in range(3):  # the run ends before the first emission
        model(X[:8])
        mon.step(labels=y[:8])
    with pytest.warns(UserWarning, match=r"closed after 3 steps without a record.*every=10"):
        mon.close()
    assert log.read_text() == ""
    # a run that emitted closes quietly; an exception leaving the block is not covered up
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=r".*rows for p = \d+ features")  # the small window's own
        with richness.Monitor(model, richness.Window(2)) as mon:
            for _ in range(2):
                model(X[:8])
                mon.step(labels=y[:8])
        assert len(mon.history) == 1
        with pytest.raises(KeyError):
            with richness.Monitor(model, richness.Window(10)):
                raise KeyError("the training loop failed")


def test_monitor_default_window_is_idle_most_steps():
    model, X, y = make(n=64, dtype=torch.float32)
    mon = richness.Monitor(model, head="fc")
    assert mon.route == richness.Window(100, 10)
    active = []
    for s in range(100):
        active.append(mon.capturing)
        model(X[:8])
        mon.step()
    mon.close()
    assert sum(active) == 10 and active[-10:] == [True] * 10
    assert mon.history[0]["step"] == 100 and mon.history[0]["n"] == 80


def test_monitor_sequence_model_with_vocabulary_larger_than_features():
    model, ids, _, _ = lm_setup()  # lm_head: 6 features -> 11 outputs, so the head's weights are used
    model.train()
    with richness.Monitor(model, richness.Window(2, 2), head=richness.Head(tokens="last")) as mon:
        for s in range(2):
            model(ids[s * 20:(s + 1) * 20])
            mon.step()
    H, _ = lm_feats(model, ids)
    Hl = H[:, -1].numpy()
    W = model.lm_head.weight.detach().numpy()
    want, r = dlr_naive(Hl, Hl @ W.T)
    rec = mon.history[0]
    assert rec["n"] == 40 and rec["rank"] == r == 6
    assert abs(rec["dlr"] - want) < 1e-10


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_monitor_one_batch_windows_match_oracle_and_moments_path(dtype, tol, monkeypatch):
    # every=1 with n = 32 rows < p = 64 features: the n x n batch path
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 64), nn.Tanh(), nn.Linear(64, 5)).to(dtype)
    X = torch.randn(3, 32, 10, dtype=dtype)
    y = torch.randint(0, 5, (3, 32))

    def run():
        with richness.Monitor(model, richness.EveryStep()) as mon:
            for s in range(3):
                model(X[s])
                mon.step(labels=y[s])
        return mon.history

    fast = run()
    from richness.monitor import routes
    monkeypatch.setattr(routes._WindowRun, "_one_batch_fits", lambda self, *args: False)
    slow = run()
    for s, (a, b) in enumerate(zip(fast, slow)):
        with torch.no_grad():
            H = model[1](model[0](X[s])).double().numpy()
            F = model(X[s]).double().numpy()
        want, r = dlr_naive(H, F)
        assert a["n"] == b["n"] == 32 and a["rank"] == b["rank"] == r
        assert abs(a["dlr"] - want) < tol and abs(b["dlr"] - want) < tol
        nc = nc1_naive(H, y[s].numpy())
        assert abs(a["nc1"] - nc) < tol * 10 * nc and abs(b["nc1"] - nc) < tol * 10 * nc


def test_monitor_ignores_no_grad_forwards_and_counts_eval_mode_training():
    model, X, y = make(n=96, dtype=torch.float32)
    model.drop.p = 0.0
    model.eval()  # e.g. fine-tuning with frozen batch-norm statistics: still training steps
    with richness.Monitor(model, richness.Window(2, 2), head="fc") as mon:
        for s in range(2):
            with torch.no_grad():
                model(X[:5])  # a validation forward: ignored
            model(X[s * 48:(s + 1) * 48])
            mon.step(labels=y[s * 48:(s + 1) * 48])
    H, F = acts(model, X)
    assert mon.history[0]["n"] == 96
    assert abs(mon.history[0]["dlr"] - dlr_naive(H, F)[0]) < 1e-5


def _one_batch_records(lag, sizes, dtype=torch.float64, seed=0, labels=True):
    """A head-only model fed inputs we own: every step's record against the
    oracle on a copy taken at that step; the inputs are zeroed in place after
    each step (a monitor that kept references instead of copies would see it)."""
    torch.manual_seed(seed)
    head = nn.Linear(64, 5).to(dtype)
    seen, want = [], []
    with richness.Monitor(head, richness.EveryStep(lag)) as mon:
        for s, n in enumerate(sizes):
            X = torch.randn(n, 64, dtype=dtype) + 3.0
            y = torch.randint(0, 5, (n,))
            with torch.no_grad():
                F = head(X)
            H = X.double().numpy().copy()
            want.append((dlr_naive(H, F.double().numpy()), nc1_naive(H, y.numpy()) if labels else None, n))
            with torch.enable_grad():
                head(X.requires_grad_(False))
            mon.step(labels=y if labels else None)
            X.zero_()  # the monitor holds copies
            seen.append(len(mon.history))
            with torch.no_grad():
                head.weight.add_(0.05 * torch.randn_like(head.weight))  # the function moves each step
    return mon.history, want, seen


@pytest.fixture(params=["core", "torch"])
def gram_route(request, monkeypatch):
    """The one-batch Monitor path's Gram: through the core (CPU buffers) or
    through torch (GPU buffers; run here on the CPU)."""
    from richness.monitor import onebatch as _onebatch

    monkeypatch.setattr(_onebatch, "CORE_GRAMS", request.param == "core")
    return request.param


def test_monitor_one_batch_products_stay_ieee_under_a_loop_allowing_tf32(gram_route, monkeypatch):
    # A training loop that allows reduced-precision float32 products (the legacy API's "medium": TF32
    # on CUDA, bf16 through oneDNN on the CPU) does not lower the Monitor's: its batched products run
    # at "highest", and the loop's own setting is back after each reduction.
    seen = []
    real = torch.bmm

    def spy(*a, **k):
        seen.append(torch.get_float32_matmul_precision())
        return real(*a, **k)

    monkeypatch.setattr(torch, "bmm", spy)
    torch.set_float32_matmul_precision("medium")
    try:
        hist, want, _ = _one_batch_records(4, [32] * 6, torch.float32)
        after = torch.get_float32_matmul_precision()
    finally:
        torch.set_float32_matmul_precision("highest")
    assert seen and set(seen) == {"highest"}
    assert after == "medium"
    # the GPU buffers' branch, through the same legacy API: TF32 off inside, back on after
    from richness.monitor.onebatch import _ieee_matmul

    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with _ieee_matmul("cuda"):
            inside = torch.backends.cuda.matmul.allow_tf32
        restored = torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    assert inside is False and restored is True
    assert len(hist) == 6
    for rec, ((d, r), _, _) in zip(hist, want):
        assert rec["rank"] == r and abs(rec["dlr"] - d) < 2e-5


def test_monitor_one_batch_products_stay_ieee_with_the_per_backend_api():
    # torch >= 2.9's per-backend setting (torch.backends.mkldnn.matmul.fp32_precision = "bf16"): the
    # Monitor switches it, not the legacy one (mixing the two makes torch raise), and restores it.
    # In a subprocess: the per-backend API, once used, stays in use for the process.
    if not hasattr(torch.backends.mkldnn.matmul, "fp32_precision"):
        pytest.skip("torch < 2.9 has no per-backend float32 precision (covered by the legacy test)")
    script = textwrap.dedent("""
        import json, torch, richness
        from richness.monitor import onebatch as _onebatch
        _onebatch.CORE_GRAMS = False
        mm = torch.backends.mkldnn.matmul
        mm.fp32_precision = "bf16"
        seen, real = [], torch.bmm
        def spy(*a, **k):
            seen.append(mm.fp32_precision)
            return real(*a, **k)
        torch.bmm = spy
        head = torch.nn.Linear(64, 5)
        with richness.Monitor(head, richness.EveryStep(2)) as mon:
            for _ in range(4):
                head(torch.randn(32, 64) + 3.0)
                mon.step(labels=torch.randint(0, 5, (32,)))
        cm = torch.backends.cuda.matmul  # the GPU buffers' branch (the setting exists without a GPU)
        cm.fp32_precision = "tf32"
        with _onebatch._ieee_matmul("cuda"):
            cuda_inside = (cm.fp32_precision, mm.fp32_precision)
        print(json.dumps({"seen": sorted(set(seen)), "after": mm.fp32_precision, "records": len(mon.history),
                          "dlr": [r["dlr"] for r in mon.history], "cuda_inside": cuda_inside,
                          "cuda_after": cm.fp32_precision}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["seen"] == ["ieee"] and got["after"] == "bf16"
    assert got["records"] == 4 and all(0.0 <= d <= 1.0 for d in got["dlr"])
    assert got["cuda_inside"] == ["ieee", "bf16"] and got["cuda_after"] == "tf32"


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_monitor_grouped_one_batch_records_match_oracle_in_step_order(dtype, tol, gram_route):
    sizes = [32] * 21 + [20, 20] + [80] + [32] * 3  # a smaller batch, a batch with n >= p (Moments path)
    hist, want, seen = _one_batch_records(8, sizes, dtype)
    assert [r["step"] for r in hist] == list(range(1, len(sizes) + 1))
    for rec, ((d, r), nc1, n) in zip(hist, want):
        assert rec["n"] == n and rec["rank"] == r
        assert abs(rec["dlr"] - d) < tol
        assert abs(rec["nc1"] - nc1) < 10 * tol * nc1
    # records arrive at most `lag` steps late, and the first group waits for 8 steps
    assert seen[:7] == [0] * 7 and seen[7] == 8
    assert all(s >= i + 1 - 8 for i, s in enumerate(seen))
    assert seen[23] == 24  # the n >= p step emits at once, after the queued ones


def test_monitor_lag_one_equals_grouped():
    a, want, seen = _one_batch_records(1, [32] * 6, labels=False)
    b, _, _ = _one_batch_records(16, [32] * 6, labels=False)
    assert seen == [1, 2, 3, 4, 5, 6]
    for ra, rb, ((d, r), _, _) in zip(a, b, want):
        assert ra["nc1"] is None and rb["nc1"] is None
        assert ra["rank"] == rb["rank"] == r
        assert abs(ra["dlr"] - rb["dlr"]) < 1e-12 and abs(ra["dlr"] - d) < 1e-10


class Given(nn.Module):
    """A head whose output is set before each forward: the Monitor sees any
    input (bfloat16 too) and any output as the head's."""

    def forward(self, x):
        return self.out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 5e-3)])
def test_monitor_one_batch_centering_survives_a_large_mean(dtype, tol, gram_route):
    # docs/MATH.md, streaming estimator: float32 features with a mean of 1e4 and a
    # spread of 1e-2 give DLR to 1e-6 (one-pass float32 centering gives 6e-2);
    # bfloat16 features (spacing 64 near 1e4 cannot hold that case) with a mean
    # of 10 and a spread of 1.
    torch.manual_seed(0)
    head = Given()
    model = nn.Sequential(head)
    mean, spread = (1e4, 1e-2) if dtype == torch.float32 else (10.0, 1.0)
    want = []
    with richness.Monitor(model, richness.EveryStep(4), head="0") as mon:
        for _ in range(6):
            X = (mean + spread * torch.randn(40, 64) @ torch.randn(64, 64) / 8).to(dtype)
            F = torch.randn(40, 5) + X[:, :5].float() / spread
            H = X.double().numpy()
            want.append(dlr_naive(H, F.double().numpy()))
            head.out = F  # the head's input and output: X and F
            model(X)
            mon.step()
    assert len(mon.history) == 6
    for rec, (d, r) in zip(mon.history, want):
        assert rec["rank"] == r
        assert abs(rec["dlr"] - d) < tol


def test_monitor_one_batch_more_outputs_than_samples(gram_route):
    # C = 40 outputs > n = 16 samples (< p = 64): the projector is formed in sample space
    torch.manual_seed(1)
    head = nn.Linear(64, 40).double()
    with torch.no_grad():  # outputs of rank 8 < n - 1: the projector is not the whole centered space
        head.weight.copy_(torch.randn(40, 8, dtype=torch.float64) @ torch.randn(8, 64, dtype=torch.float64))
    want = []
    with richness.Monitor(head, richness.EveryStep(3)) as mon:
        for s in range(5):
            X = torch.randn(16, 64, dtype=torch.float64) @ torch.randn(64, 64, dtype=torch.float64)
            y = torch.randint(0, 6, (16,))
            y[:6] = torch.arange(6)
            with torch.no_grad():
                F = head(X)
            want.append((dlr_naive(X.numpy(), F.numpy()), nc1_naive(X.numpy(), y.numpy())))
            head(X)
            mon.step(labels=y)
    assert mon._run.one_batch.group is None and len(mon.history) == 5
    for rec, ((d, r), nc1) in zip(mon.history, want):
        assert rec["rank"] == r == 8
        assert abs(rec["dlr"] - d) < 1e-10
        assert abs(rec["nc1"] - nc1) < 1e-8 * nc1


def test_monitor_one_batch_more_classes_than_samples(gram_route, monkeypatch):
    # 1,000 classes (the head's outputs), batches of 16: NC1 uses each step's own classes, renumbered
    # 0..15, so the per-step matrices are 16 x 16, not 1,000 x 1,000; values equal the oracle's, and
    # a step with a label outside the head's classes gets no NC1.
    from richness.monitor.onebatch import BatchGroup

    widths = []
    real = BatchGroup.reduce

    def spy(self, *a):
        out = real(self, *a)
        widths.append(int(out.shape[1]))
        return out

    monkeypatch.setattr(BatchGroup, "reduce", spy)
    torch.manual_seed(3)
    n, p, k = 16, 1024, 1000  # C <= p: the head's outputs are streamed (C > p would use its weights)
    head = nn.Linear(p, k).double()
    want = []
    with richness.Monitor(head, richness.EveryStep(4)) as mon:
        for s in range(6):
            X = torch.randn(n, p, dtype=torch.float64) * torch.linspace(0.1, 3.0, p, dtype=torch.float64) + 2.0
            y = torch.randint(0, k, (n,))
            y[:6] = torch.tensor([999, 999, 3, 3, 500, 0])  # repeats, and the first and last classes
            if s == 4:
                y[7] = k  # outside the head's classes
            with torch.no_grad():
                F = head(X)
            want.append((dlr_naive(X.numpy(), F.numpy()), None if s == 4 else nc1_naive(X.numpy(), y.numpy())))
            head(X)
            mon.step(labels=y)
    assert len(mon.history) == 6
    for rec, ((d, r), nc1) in zip(mon.history, want):
        assert rec["rank"] == r and abs(rec["dlr"] - d) < 1e-10
        if nc1 is None:
            assert rec["nc1"] is None
        else:
            assert abs(rec["nc1"] - nc1) < 1e-8 * nc1
    # per step: ||M||, A and Q (n x n each: sample space), counts, D D^T and D M D^T (n x n), invalid count,
    # and the active features (the isotropic reference's p)
    assert widths and all(w == 1 + 2 * n * n + n + 2 * n * n + 1 + 1 for w in widths)


def test_monitor_window_buffer_with_uneven_batches_matches_oracle():
    # window steps are buffered (copies) and added as one batch at emission; a
    # batch of another size flushes the buffer into the Moments first
    torch.manual_seed(2)
    head = nn.Linear(8, 4).double()
    sizes = [30, 30, 12, 30, 30, 30, 5, 30]
    want, H, F, Y = [], [], [], []
    with richness.Monitor(head, richness.Window(4, 3)) as mon:
        for s, n in enumerate(sizes, start=1):
            X = torch.randn(n, 8, dtype=torch.float64) * 3 + 1
            y = torch.randint(0, 4, (n,))
            if (s - 1) % 4 >= 1:
                with torch.no_grad():
                    H.append(X.numpy().copy())
                    F.append(head(X).numpy())
                    Y.append(y.numpy())
            head(X)
            mon.step(labels=y)
            X.zero_()
            if s % 4 == 0:
                Hw, Fw, Yw = np.concatenate(H), np.concatenate(F), np.concatenate(Y)
                want.append((dlr_naive(Hw, Fw), nc1_naive(Hw, Yw), len(Hw)))
                H, F, Y = [], [], []
    assert [r["step"] for r in mon.history] == [4, 8]
    for rec, ((d, r), nc1, n) in zip(mon.history, want):
        assert rec["n"] == n and rec["rank"] == r
        assert abs(rec["dlr"] - d) < 1e-10 and abs(rec["nc1"] - nc1) < 1e-8 * nc1


def test_monitor_group_flush_and_bad_lag():
    model, _, _ = make()
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="lag"):
            richness.Monitor(model, richness.Window(lag=bad))
    torch.manual_seed(0)
    head = nn.Linear(64, 5).double()
    mon = richness.Monitor(head, richness.EveryStep(100))
    for _ in range(3):
        head(torch.randn(16, 64, dtype=torch.float64))
        mon.step()
    assert mon.history == []
    mon.flush()
    assert [r["step"] for r in mon.history] == [1, 2, 3]
    mon.close()
    assert len(mon.history) == 3


def test_monitor_one_batch_labels_outside_head_range_give_no_nc1():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 64), nn.Tanh(), nn.Linear(64, 5)).double()
    X = torch.randn(32, 10, dtype=torch.float64)
    with richness.Monitor(model, richness.EveryStep()) as mon:
        model(X)
        mon.step(labels=torch.arange(32) % 7)  # classes 5 and 6 do not exist in a 5-way head
    with torch.no_grad():
        H, F = model[1](model[0](X)).numpy(), model(X).numpy()
    assert mon.history[0]["nc1"] is None
    assert abs(mon.history[0]["dlr"] - dlr_naive(H, F)[0]) < 1e-10


@pytest.mark.parametrize("first_step", [0, 1, 1000])
def test_one_batch_lateness_does_not_depend_on_first_step(first_step):
    """every=1 records arrive at most `lag` steps late whatever step number the
    records start from (a resumed run, Lightning's 0-based steps)."""
    torch.manual_seed(0)
    head = nn.Linear(64, 5).double()
    seen = []
    with richness.Monitor(head, richness.EveryStep(4), first_step=first_step) as mon:
        for s in range(10):
            head(torch.randn(16, 64, dtype=torch.float64) + 3.0)
            mon.step(labels=torch.randint(0, 5, (16,)))
            seen.append(len(mon.history))
    assert seen == [0, 0, 0, 4, 4, 4, 4, 8, 8, 8]
    assert [r["step"] for r in mon.history] == list(range(first_step, first_step + 10))


class RaisesAfterHead(nn.Module):
    """An MLP whose forward raises after the head ran when ``fail`` is set (a
    check on the logits, a loss computed inside forward, an out-of-memory error)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU())
        self.fc = nn.Linear(16, 4)
        self.fail = False

    def forward(self, x):
        out = self.fc(self.body(x))
        if self.fail:
            self.fail = False
            raise RuntimeError("logits check failed")
        return out


def _data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g, dtype=torch.float64), torch.randint(0, 4, (n,), generator=g)


def _raising_setup(count, rows=128, extra=0):
    """A RaisesAfterHead model and ``count`` batches of ``rows`` (``extra`` more rows of X after them)."""
    torch.manual_seed(0)
    model = RaisesAfterHead().double()
    X, y = _data(count * rows + extra)
    return model, X, [(X[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows]) for i in range(count)]


def _window_oracle(model, batches):
    with torch.no_grad():
        H = torch.cat([model.body(x) for x, _ in batches]).numpy()
        F = torch.cat([model.fc(model.body(x)) for x, _ in batches]).numpy()
    y = torch.cat([y for _, y in batches]).numpy()
    return dlr_naive(H, F)[0], nc1_naive(H, y)


@pytest.mark.parametrize("with_labels", [True, False])
def test_monitor_forward_raising_after_the_head_leaves_nothing(with_labels):
    # Window of 2 steps of 128 rows; at step 3 a 32-row forward raises after the head and the loop
    # moves on to the next batch. Its activations used to join the window (n = 288, or with labels
    # a row-count error that dropped the whole step).
    model, X, batches = _raising_setup(4, extra=32)
    with richness.Monitor(model, richness.Window(2, 2)) as mon:
        for step, (xb, yb) in enumerate(batches, 1):  # no optimizer: the weights stay, the oracle is exact
            if step == 3:
                model.fail = True
                with pytest.raises(RuntimeError, match="logits check"):
                    model(X[-32:])
            model(xb).sum().backward()
            mon.step(labels=yb if with_labels else None)
    assert [r["n"] for r in mon.history] == [256, 256]
    for rec, window in zip(mon.history, (batches[:2], batches[2:])):
        dlr, nc1 = _window_oracle(model, window)
        assert abs(rec["dlr"] - dlr) < 1e-10
        if with_labels:
            assert abs(rec["nc1"] - nc1) < 1e-8 * nc1


def test_monitor_nested_and_direct_head_calls_are_kept():
    # The head called by training code outside the model's forward, and a model forward nested in
    # another call of the model, are still captured; a raising outer call drops its inner captures.
    model, _, parts = _raising_setup(3, rows=64)
    with richness.Monitor(model, richness.EveryStep(), head="fc") as mon:
        model.fc(model.body(parts[0][0]))  # direct
        mon.step(labels=parts[0][1])
        model.fail = False
        outer = torch.nn.Sequential(model)  # the monitored model nested in a larger one
        outer(parts[1][0])
        mon.step(labels=parts[1][1])
        model.fail = True
        with pytest.raises(RuntimeError):
            outer(parts[2][0][:10])
        model(parts[2][0])
        mon.step(labels=parts[2][1])
    assert [r["n"] for r in mon.history] == [64, 64, 64]
    for rec, part in zip(mon.history, parts):
        assert abs(rec["dlr"] - _window_oracle(model, [part])[0]) < 1e-10


def test_monitor_step_skipped_after_its_forward_is_not_recorded():
    # The forward returned, then the loss (or backward) failed and the loop skipped step(): with
    # labels, the step's captures are the latest forwards that match them; the earlier ones are
    # dropped with a warning instead of refusing the step.
    model, _, batches = _raising_setup(3)
    with richness.Monitor(model, richness.EveryStep()) as mon:
        model(batches[0][0][:48])  # skipped: no step() for it
        model(batches[0][0])
        with pytest.warns(UserWarning, match=r"1 training forward\(s\) of the head \(48 samples\)"):
            mon.step(labels=batches[0][1])
        half = [batches[1][0][:64], batches[1][0][64:]]  # gradient accumulation: two forwards, one step
        for xb in half:
            model(xb)
        mon.step(labels=batches[1][1])
    assert [r["n"] for r in mon.history] == [128, 128]
    for rec, window in zip(mon.history, batches):
        assert abs(rec["dlr"] - _window_oracle(model, [window])[0]) < 1e-10


def test_monitor_refuses_labels_that_do_not_match_and_changes_nothing():
    model, _, batches = _raising_setup(3)
    with richness.Monitor(model, richness.Window(2, 2)) as mon:
        model(batches[0][0])
        mon.step(labels=batches[0][1])
        model(batches[1][0])
        for bad in (batches[1][1][:100], batches[1][1][0], torch.zeros(128, 2, 2, dtype=torch.long)):
            with pytest.raises(ValueError, match=r"Monitor\.step: .*(100 rows, but .* gave 128 rows|single value"
                                                 r"|1-D).*not counted"):
                mon.step(labels=bad)
            assert mon.steps == 1 and mon.history == []
        mon.step(labels=batches[1][1])  # the retry with the right labels records the step
        assert mon.steps == 2 and [r["n"] for r in mon.history] == [256]
        assert abs(mon.history[0]["dlr"] - _window_oracle(model, batches[:2])[0]) < 1e-10
        # a refused step that the loop moves past: its captures do not reach the next step
        model(batches[2][0][:32])
        with pytest.raises(ValueError, match="labels have 7 rows"):
            mon.step(labels=batches[2][1][:7])
        model(batches[2][0])
        mon.step(labels=batches[2][1])
        model(batches[0][0])
        mon.step(labels=batches[0][1])
    assert [r["n"] for r in mon.history] == [256, 256]
    assert abs(mon.history[1]["dlr"] - _window_oracle(model, [batches[2], batches[0]])[0]) < 1e-10


def test_monitor_rejects_a_bad_rtol_when_made():
    # the same check as Moments.compute and the torchmetrics DLR, before any step runs
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    for bad in (0.0, 1.0, 2.0, "1e-5"):
        with pytest.raises(ValueError, match=r"rtol must be a number in \(0, 1\)"):
            richness.Monitor(model, rtol=bad)




def _window_run(head, batches, every, window, labels=True, **kw):
    """Monitor(head) over ``batches`` (x, y); returns the history and, per
    emitted window, the float64 oracle (DLR, rank, NC1 or None, n)."""
    want, H, F, Y = [], [], [], []
    with richness.Monitor(head, richness.Window(every, window), **kw) as mon:
        for s, (x, y) in enumerate(batches, start=1):
            if (s - 1) % every >= every - window:
                with torch.no_grad():
                    H.append(x.double().numpy())
                    F.append(head(x).double().numpy())
                    Y.append(y.numpy())
            head(x)
            mon.step(labels=y if labels else None)
            if s % every == 0:
                Hw, Fw, Yw = np.concatenate(H), np.concatenate(F), np.concatenate(Y)
                d, r = dlr_naive(Hw, Fw)
                want.append((d, r, nc1_naive(Hw, Yw) if labels else None, len(Hw)))
                H, F, Y = [], [], []
    return mon.history, want


@pytest.mark.parametrize("precision", [None, "fp64"])
def test_monitor_window_float32_with_a_large_mean_matches_oracle(precision):
    # The window's Moments centers on float64 batch means: a mean of 1e4 with a
    # spread of 1e-2 in float32 features still gives DLR and NC1 of the float32
    # values.
    torch.manual_seed(3)
    head = nn.Linear(96, 6)
    with torch.no_grad():
        head.weight.mul_(100.0)
    batches = [(1e4 + 1e-2 * torch.randn(40, 96), torch.randint(0, 6, (40,))) for _ in range(8)]
    hist, want = _window_run(head, batches, every=4, window=3, precision=precision)
    assert [r["step"] for r in hist] == [4, 8]
    tol = 1e-10 if precision == "fp64" else 2e-5
    for rec, (d, r, nc1, n) in zip(hist, want):
        assert rec["n"] == n == 120 and rec["rank"] == r
        assert abs(rec["dlr"] - d) < tol and abs(rec["nc1"] - nc1) < 1e3 * tol * nc1
        lo, hi = rec["dlr_rtol_range"]
        assert 0.0 <= lo <= 1.0 and 0.0 <= hi <= 1.0


def test_monitor_window_leaves_out_what_moments_refuse():
    # Rows the Moments would refuse (non-finite features, negative labels) are
    # left out of their window with a warning naming the step and the Moments'
    # reason: the window's record comes from its other step, the next window
    # is recorded as usual, and nothing raises out of step().
    torch.manual_seed(4)
    head = nn.Linear(16, 3).double()
    good = [(torch.randn(20, 16, dtype=torch.float64), torch.randint(0, 3, (20,))) for _ in range(4)]
    nan_x = good[1][0].clone()
    nan_x[5, 2] = float("nan")
    for bad, match in (((nan_x, good[1][1]), "non-finite"), ((good[1][0], good[1][1] - 1), "labels out of range")):
        with richness.Monitor(head, richness.Window(2, 2)) as mon:
            head(good[0][0])
            mon.step(labels=good[0][1])
            head(bad[0])
            with pytest.warns(richness.RichnessWarning, match=f"step 2: .*{match}"):
                mon.step(labels=bad[1])
            for x, y in good[2:]:
                head(x)
                mon.step(labels=y)
        assert [r["step"] for r in mon.history] == [2, 4]
        assert [r["n"] for r in mon.history] == [20, 40]
        for rec, part in zip(mon.history, (good[:1], good[2:])):
            H = torch.cat([x for x, _ in part]).numpy()
            with torch.no_grad():
                F = head(torch.cat([x for x, _ in part])).numpy()
            assert abs(rec["dlr"] - dlr_naive(H, F)[0]) < 1e-10


def test_monitor_window_with_targets_and_constant_features():
    # Float targets (no NC1) and a window of constant features (DLR undefined: None)
    torch.manual_seed(5)
    head = nn.Linear(12, 4).double()
    batches = [(torch.randn(25, 12, dtype=torch.float64), torch.randn(25, 2, dtype=torch.float64)) for _ in range(2)]
    batches += [(torch.ones(25, 12, dtype=torch.float64), torch.randn(25, 2, dtype=torch.float64)) for _ in range(2)]
    with richness.Monitor(head, richness.Window(2, 2)) as mon:
        for x, t in batches:
            head(x)
            mon.step(labels=t)
    H = torch.cat([x for x, _ in batches[:2]]).numpy()
    with torch.no_grad():
        F = head(torch.cat([x for x, _ in batches[:2]])).numpy()
    first, second = mon.history
    assert abs(first["dlr"] - dlr_naive(H, F)[0]) < 1e-10 and first["nc1"] is None
    assert second["n"] == 50 and second["dlr"] is None and second["rank"] is None


def test_monitor_window_on_many_classes_and_a_changing_shape():
    # More classes than the window has (absent classes), and a window whose
    # batch size changes in the middle, against the float64 oracle.
    torch.manual_seed(6)
    head = nn.Linear(40, 30)
    sizes = [24, 24, 24, 24, 24, 16, 24, 24]
    batches = [(torch.randn(n, 40) * 2 + 1, torch.randint(0, 30, (n,))) for n in sizes]
    hist, want = _window_run(head, batches, every=4, window=4)
    assert len(hist) == 2
    for rec, (d, r, nc1, n) in zip(hist, want):
        assert rec["n"] == n and rec["rank"] == r
        assert abs(rec["dlr"] - d) < 2e-5 and abs(rec["nc1"] - nc1) < 1e-3 * nc1


def test_monitor_window_reuses_its_state_arrays_only_while_the_sizes_fit(monkeypatch):
    # Each window's state is written into the arrays of the one before when the
    # sizes are the same (no new allocation), and into new ones when the class
    # count changes; every record matches the float64 oracle, so no window
    # reads another's values.
    from richness import Moments

    exports = []
    real = Moments.export_into

    def spy(self, arrays):
        exports.append(id(arrays["M"]))
        return real(self, arrays)

    monkeypatch.setattr(Moments, "export_into", spy)
    torch.manual_seed(7)
    head = nn.Linear(24, 5).double()
    classes = [3, 3, 3, 3, 6, 6, 6, 6, 2, 2]  # labels below this count, two steps a window
    batches = [(torch.randn(30, 24, dtype=torch.float64) * (1 + s), torch.randint(0, k, (30,)))
               for s, k in enumerate(classes)]
    hist, want = _window_run(head, batches, every=2, window=2)
    assert [r["step"] for r in hist] == [2, 4, 6, 8, 10]
    for rec, (d, r, nc1, n) in zip(hist, want):
        assert rec["n"] == n == 60 and rec["rank"] == r
        assert abs(rec["dlr"] - d) < 1e-10 and abs(rec["nc1"] - nc1) < 1e-8 * nc1
    # the exports tried: windows 2 and 3 into window 1's arrays (window 3 has 6
    # classes: refused, new arrays), windows 4 and 5 into window 3's (window 5
    # has 2 classes: refused, new arrays)
    assert len(exports) == 4 and exports[0] == exports[1] and exports[2] == exports[3] != exports[0]
