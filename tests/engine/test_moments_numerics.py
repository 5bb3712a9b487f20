"""Numbers that must stay right at the edges: stray class labels, activations at
extreme scales or with NaN in one step of Monitor(every=1), NC1 near collapse in
float32, crafted states, fully padded sequences. Every value is compared with the
float64 n x n oracles of reference.py."""

import json
import re
import tracemalloc
import warnings

import numpy as np
import pytest

import richness
from reference import cumulative_curve, dlr_naive, eigenfunctions, nc1_naive, one_hot, pad_curve, \
    spectrum_naive

torch = pytest.importorskip("torch")


# -- class matrices: the classes present, not the largest label ---------------------

def test_a_stray_large_label_costs_the_classes_present():
    rng = np.random.default_rng(5)
    n, p = 300, 8
    X = rng.normal(size=(n, p)) + rng.normal(size=(4, p))[rng.integers(0, 4, n)] * 3
    F = X @ rng.normal(size=(p, 3))
    y = rng.integers(0, 4, n)
    y[:3] = 3000  # one stray label: K = 3001 classes, 5 present
    m = richness.Moments()
    m.update(X, outputs=F, labels=y)
    tracemalloc.start()
    try:
        rep = m.compute()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8e6  # a 3001 x 3001 float64 matrix alone is 72 MB
    assert rep.nc1 == pytest.approx(nc1_naive(X, y), rel=1e-9)
    rho, V, r = spectrum_naive(X)
    E = eigenfunctions(X, X.mean(axis=0), V[:, :r], rho[:r])
    present = np.unique(y)
    Y = one_hot(np.searchsorted(present, y), len(present))
    np.testing.assert_allclose(rep.quality, pad_curve(cumulative_curve(E, Y), p), rtol=0, atol=1e-10)


# -- Monitor(every=1): scale and non-finite steps -------------------------------------

def _one_batch_run(scale, labels, core, bad=None, lag=16, steps=6):
    """A linear head on features of the given scale, n = 16 < p = 40: the
    every=1 route. Returns the records, the oracle DLRs and NC1s, the warnings."""
    from richness.monitor import onebatch as monitor_module

    torch.manual_seed(1)
    n, p, C, K = 16, 40, 5, 4
    head = torch.nn.Linear(p, C)
    with torch.no_grad():
        head.weight.div_(scale)
    recs, want, want_nc1 = [], [], []
    old = monitor_module.CORE_GRAMS
    monitor_module.CORE_GRAMS = core
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with richness.Monitor(head, richness.EveryStep(lag), log=recs.append) as mon:
                for i in range(steps):
                    y = torch.arange(n) % K
                    x = (torch.randn(n, p) + torch.randn(K, p)[y] * 2) * scale
                    if bad is not None and i in bad:
                        x[3, 7] = bad[i]
                    out = head(x)
                    finite = bool(torch.isfinite(x).all())
                    xd, fd = x.double().numpy(), out.detach().double().numpy()
                    want.append(dlr_naive(xd, fd, rtol=1e-5)[0] if finite else None)
                    want_nc1.append(nc1_naive(xd, y.numpy(), rtol=1e-5) if finite else None)
                    mon.step(labels=y if labels else None)
    finally:
        monitor_module.CORE_GRAMS = old
    return recs, want, want_nc1, [str(w.message) for w in caught]


@pytest.mark.parametrize("core", [False, True])
@pytest.mark.parametrize("scale", [1e9, 1e-12])
def test_one_batch_route_is_scale_invariant(scale, core):
    recs, want, want_nc1, _ = _one_batch_run(scale, labels=True, core=core)
    assert [r["step"] for r in recs] == list(range(1, 7))
    for r, d, c in zip(recs, want, want_nc1):
        assert r["dlr"] == pytest.approx(d, abs=2e-5)
        assert r["nc1"] == pytest.approx(c, rel=1e-3)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e30])
def test_one_batch_route_non_finite_step_is_its_own_record(value):
    recs, want, _, messages = _one_batch_run(1.0, labels=False, core=False, bad={3: value}, lag=4, steps=8)
    assert [r["step"] for r in recs] == list(range(1, 9))
    for i, (r, d) in enumerate(zip(recs, want)):
        if i == 3 and value != 1e30:
            assert r["dlr"] is None and r["rank"] is None
        else:  # 1e30 is finite: that step's DLR is the oracle's, like the others
            assert r["dlr"] == pytest.approx(d, abs=2e-5)
    flagged = [m for m in messages if "NaN or Inf" in m]
    assert (flagged == ["richness.Monitor: the head's input or output had NaN or Inf values at step(s) 4: their "
                        "records have n 0 and dlr, rank and nc1 None"]) == (value != 1e30)


def test_one_batch_route_records_before_a_bad_step_reach_the_log(tmp_path):
    torch.manual_seed(0)
    head = torch.nn.Linear(40, 3)
    log = tmp_path / "r.jsonl"
    with pytest.warns(UserWarning, match="NaN or Inf values at step"):
        with richness.Monitor(head, richness.EveryStep(16), log=str(log)) as mon:
            for i in range(20):
                x = torch.randn(8, 40)
                if i == 12:
                    x[0, 0] = float("nan")
                head(x)
                mon.step()
    lines = [json.loads(s) for s in log.read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 21))
    assert [r["dlr"] is None for r in lines] == [i == 12 for i in range(20)]


# -- NC1 near collapse: float32 products resolve it to 10%, or say so ----

@pytest.mark.parametrize("K,p,n,bs", [(4, 16, 400, 400), (10, 64, 2000, 500), (3, 8, 300, 300)])
@pytest.mark.parametrize("spread,mean", [(1e-6, 0.0), (1e-4, 0.0), (1e-3, 0.0), (1e-2, 0.0), (1e-3, 1e6),
                                         (3e-2, 1e6), (1e-1, 0.0)])
def test_nc1_near_collapse_float32_is_right_or_flagged(K, p, n, bs, spread, mean):
    from reference import simplex_etf

    rng = np.random.default_rng(K * 1000 + int(-np.log10(spread) * 7) + int(mean > 0))
    y = np.repeat(np.arange(K), n // K)
    rng.shuffle(y)
    X = (simplex_etf(K, p, rng) + mean)[y] + spread * rng.normal(size=(n, p))
    X = X.astype(np.float32)
    want = nc1_naive(X, y)  # float64 oracle of the same float32 values
    for dtype in (np.float32, np.float64):
        m = richness.Moments()
        for i in range(0, n, bs):
            m.update(X[i:i + bs].astype(dtype), labels=y[i:i + bs])
        rep = m.compute(spectrum=False)
        flagged = [w for w in rep.warnings if w.startswith("NC1 = ")]
        if flagged:
            assert dtype is np.float32 and want < 1.5e-4 and "fp32 products" in flagged[0]
        else:
            # unflagged: within 10% (the caveat's criterion, docs/MATH.md, NC1)
            assert rep.nc1 == pytest.approx(want, rel=1e-1 if dtype is np.float32 else 1e-4)
    if spread <= 1e-4:  # deep in collapse: float32 products must say so
        m = richness.Moments()
        m.update(X, labels=y)
        assert any(w.startswith("NC1 = ") for w in m.compute(spectrum=False).warnings)


# -- crafted states: indefinite M, a cross-moment beyond Cauchy-Schwarz ---------------

def _legit_state():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(200, 3)) @ rng.normal(size=(3, 3)) + 1.0
    F = X @ rng.normal(size=(3, 2)) + rng.normal(size=(200, 2))
    m = richness.Moments()
    m.update(X, outputs=F, labels=rng.integers(0, 3, 200), targets=rng.normal(size=(200, 1)))
    return m


def _indefinite_m(st):
    Q = np.stack([np.ones(3) / np.sqrt(3), np.array([1.0, -1.0, 0.0]) / np.sqrt(2),
                  np.array([1.0, 1.0, -2.0]) / np.sqrt(6)], axis=1)
    M = Q @ np.diag([-75.0, 78.0, 244.0]) @ Q.T
    assert (np.diag(M) > 0).all() and np.linalg.eigvalsh(M)[0] < -74  # every variance positive, M indefinite
    st["M"] = (M + M.T) / 2


def _cross_beyond(key, gram):
    def edit(st):
        M, G = st["M"], st[gram]
        st[key] = st[key] * 1.0
        # the largest cross-moment Cauchy-Schwarz allows, times 1.5, on one entry
        st[key][0, 0] = 1.5 * np.sqrt(M[0, 0] * G[0, 0])
    return edit


def _class_mean_beyond(st):
    s = st["class_sums"].copy()
    # class 0's mean moved 3 standard deviations out, class 1's sum back by as much (the total still agrees)
    shift = 3.0 * np.sqrt(st["M"][0, 0] / st["n"]) * st["class_counts"][0]
    s[0, 0] += shift
    s[1, 0] -= shift
    st["class_sums"] = s


@pytest.mark.parametrize("edit,what", [(_indefinite_m, "'M' is not positive semi-definite"),
                                       (_cross_beyond("B", "A"), "[[M, B], [B^T, A]]"),
                                       (_cross_beyond("Bt", "At"), "[[M, Bt], [Bt^T, At]]"),
                                       (_class_mean_beyond, "within-class scatter")])
def test_crafted_states_are_refused_and_change_nothing(edit, what, tmp_path):
    from reference import states_equal

    st = _legit_state().state_dict()
    edit(st)
    target = _legit_state()
    target.update(np.ones((4, 3)) + np.arange(12.0).reshape(4, 3) ** 1.5, outputs=np.arange(8.0).reshape(4, 2) ** 2,
                  labels=np.array([0, 1, 2, 0]), targets=np.arange(4.0)[:, None])
    before = target.state_dict()
    with pytest.raises(ValueError, match=re.escape(what)):
        target.load_state_dict(st)
    assert states_equal(target.state_dict(), before)
    # the same state in a save file: refused on load
    from richness._engine import statefile as _statefile
    _statefile.save_state(st, tmp_path / "crafted.npz")
    with pytest.raises(ValueError, match=re.escape(what)):
        richness.Moments.load(tmp_path / "crafted.npz")


# -- tokens="last": a fully padded sequence is no sample ---------------------------------

def test_last_token_skips_fully_padded_sequences():
    from tiny_models import lm_feats, lm_setup

    model, ids, mask, lengths = lm_setup()
    mask[[3, 17, 30]] = False  # three sequences that are padding only
    labels = torch.randint(0, 4, (40,))
    batches = [{"input_ids": ids[i:i + 8], "attention_mask": mask[i:i + 8], "labels": labels[i:i + 8]}
               for i in range(0, 40, 8)]
    rep = richness.evaluate(model, batches, progress=False, tokens="last")
    H, F = lm_feats(model, ids)
    real = mask.any(dim=1)
    rows = torch.arange(40)[real]
    Hs, Fs = H[rows, lengths[real] - 1], F[rows, lengths[real] - 1]
    assert rep.n == 37
    assert rep.dlr == pytest.approx(dlr_naive(Hs.numpy(), Fs.numpy())[0], abs=1e-10)
    assert rep.nc1 == pytest.approx(nc1_naive(Hs.numpy(), labels[real].numpy()), rel=1e-8)


# -- what a reader sees: help texts, plot axes, the report's repr -----------------------

def test_every_command_line_option_has_help(capsys):
    from richness.cli import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, sub in subs.choices.items():
        for action in sub._actions:
            if action.__class__.__name__ != "_HelpAction":
                assert action.help, f"richness {name} {action.option_strings or action.dest} has no help text"


def test_report_repr_summarises_arrays():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(3000, 300))
    m = richness.Moments()
    m.update(X, outputs=X[:, :4] + rng.normal(size=(3000, 4)))
    rep = m.compute()
    text = repr(rep)
    assert len(text) < 2000 and "array(shape=(300,)" in text
    assert f"dlr={rep.dlr!r}" in text and "rank=4" in text


def test_plot_axes_read_against_zero_and_held_out_is_not_a_fraction(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    from richness import plot

    rng = np.random.default_rng(1)
    X = rng.normal(size=(200, 6))
    Xt = 5 * rng.normal(size=(100, 6))  # held-out features at 5 times the spread: projections past 1
    m, t = richness.Moments(), richness.Moments()
    m.update(X, outputs=X[:, :2], labels=(X[:, 0] > 0).astype(int))
    t.update(Xt, outputs=Xt[:, :2], labels=(Xt[:, 0] > 0).astype(int))
    rep = m.compute(test=t)
    assert rep.test_quality[-1] > 1  # the Nystrom-extended curve exceeds 1 here
    captured = {}
    real_save = plot._save

    def keep(fig, prefix):
        captured.setdefault("figs", []).append(fig)
        return real_save(fig, prefix)

    plot._save = keep
    try:
        plot.sweep([0.1, 1, 10], {"DLR": [0.6, 0.7, 0.8]}, tmp_path / "s2", xlabel="alpha")
        plot.curves(rep, tmp_path / "c")
    finally:
        plot._save = real_save
    sweep_fig, curves_fig = captured["figs"]
    assert sweep_fig.axes[0].get_ylim()[0] == 0.0
    labels = [ax.get_ylabel() for ax in curves_fig.axes[:2]]
    assert all("fraction of variance explained" not in lab and "can exceed 1" in lab for lab in labels)


# -- a linear head with more outputs than features: the choice is explicit ---------------

@pytest.mark.parametrize("wide_head", ["weights", "outputs"])
def test_wide_head_dlr_source_is_explicit_with_its_rank_cut_range(wide_head):
    from tiny_models import TinyLM

    torch.manual_seed(3)
    model = TinyLM().double()  # p = 6 features, C = 11 outputs
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    feats, outs = [], []

    def keep(mod, args, out):  # the oracle's own copy of the head's input and output
        feats.append(args[0].detach().reshape(-1, 6))
        outs.append(out.detach().reshape(-1, 11))

    model.lm_head.register_forward_hook(keep)
    recs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with richness.Monitor(model, richness.Window(2, 2), head=richness.Head(wide=wide_head), log=recs.append) as mon:
            for step in range(4):
                ids = torch.randint(0, 11, (8, 7))
                logits = model(ids)["logits"]
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), ids.reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad()
                mon.step()
                if step % 2 == 1:  # the emission: the head's weights now
                    W = model.lm_head.weight.detach().numpy().copy()
                    H = torch.cat(feats[-2:]).numpy()
                    F = H @ W.T if wide_head == "weights" else torch.cat(outs[-2:]).numpy()
                    want = [dlr_naive(H, F, rtol=r)[0] for r in (1e-10, 1e-11, 1e-9)]
                    rec = recs[-1]
                    assert rec["dlr_from"] == wide_head
                    assert rec["dlr"] == pytest.approx(want[0], abs=1e-10)
                    assert rec["dlr_rtol_range"] == pytest.approx(want[1:], abs=1e-10)
    assert len(recs) == 2
