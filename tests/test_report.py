"""What a printed Report says: DLR beside its isotropic reference, their ratio and how to read them (one
wording, shared with ``richness eval``), the sizes, and each warning once, with what to do about it."""

import math
import warnings

import numpy as np
import pytest

import richness
from richness.cli import main
from reference import dlr_naive

HOW_TO_READ = ("how to read: DLR/iso near 1 = as lazy as isotropic (random) features at this n, p and rank; "
               "near 0 = rich (docs/READING_DLR.md)")


def iso_naive(n, p, r):
    """Expected DLR of isotropic Gaussian features, from the Wishart moments (docs/READING_DLR.md):
    m = n - 1, DLR_iso = 1 - sqrt(r) (m + p - r) / sqrt(m p (m + p + 1))."""
    m = n - 1
    r = min(r, m, p)
    return 1.0 - math.sqrt(r) * (m + p - r) / math.sqrt(m * p * (m + p + 1))


def lazy_data(n=200, p=40, C=10, dead=0, seed=4):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, p))
    X[:, :dead] = 0.0  # dead units: not active, not part of the reference's p
    return X, X @ rng.normal(size=(p, C))


def test_str_shows_dlr_beside_its_isotropic_reference_and_how_to_read():
    n, p, C, dead = 200, 40, 10, 3
    X, F = lazy_data(n, p, C, dead)
    m = richness.Moments()
    m.update(X, outputs=F)
    rep = m.compute()
    want, rank = dlr_naive(X, F)
    iso = iso_naive(n, p - dead, rank)
    lines = str(rep).splitlines()
    assert lines[0] == f"DLR {want:.4f}  (0 = rich, 1 = lazy)   rank {rank}   n {n}"
    assert lines[1] == f"isotropic reference {iso:.4f}   DLR/iso {want / iso:.3f}"
    assert lines[2] == HOW_TO_READ
    assert lines[3].startswith(f"p {p} ({p - dead} active)   C {C}   NC1 n/a   effective dim ")
    assert sum(HOW_TO_READ in ln for ln in lines) == 1 and sum("isotropic reference" in ln for ln in lines) == 1


def test_str_without_dlr_has_no_reference_and_counts_the_head():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, 6))
    m = richness.Moments()
    m.update(X)
    text = str(m.compute())
    assert text.startswith("DLR n/a") and "isotropic reference" not in text and "how to read" not in text
    assert "\np 6 (6 active)   NC1 n/a" in text  # no outputs: no C
    W = rng.normal(size=(9, 6))  # a head of C = 9 > p rows (the many-outputs route)
    assert "   C 9   " in str(m.compute(head_weights=W))


def test_repr_puts_dlr_beside_its_reference_and_ipython_prints_the_text():
    X, F = lazy_data()
    m = richness.Moments()
    m.update(X, outputs=F)
    rep = m.compute()
    assert repr(rep).startswith(f"Report(dlr={rep.dlr!r}, dlr_isotropic={rep.dlr_isotropic!r}, "
                                f"dlr_normalized={rep.dlr_normalized!r}, rank=")

    class Printer:
        def __init__(self):
            self.out = []

        def text(self, s):
            self.out.append(s)

    pr = Printer()
    rep._repr_pretty_(pr, False)
    assert pr.out == [str(rep)]


def test_layers_and_jackknife_lines():
    rng = np.random.default_rng(2)
    X, F = lazy_data(n=400, p=8, C=3)
    m = richness.Moments(groups=4)
    for i in range(4):
        m.update(X[i * 100:(i + 1) * 100], outputs=F[i * 100:(i + 1) * 100])
    rep = m.compute(uncertainty=True)
    low, high = rep.dlr_interval
    assert (f"DLR stderr {rep.dlr_stderr:.4f}   95% interval {low:.4f} .. {high:.4f}   "
            f"bias-corrected {rep.dlr_jackknife:.4f}   (jackknife)") in str(rep).splitlines()
    H = np.tanh(X @ rng.normal(size=(8, 50)))  # 400 < 10 x 50: a caveat of the layer's own
    lm = richness.Moments()
    lm.update(H, outputs=F)
    rep.layers = {"hidden": lm.compute()}
    want, rank = dlr_naive(H, F)
    iso = iso_naive(400, 50, rank)
    line = [ln for ln in str(rep).splitlines() if ln.startswith("layer ")]
    assert line == [f"layer 'hidden': DLR {want:.4f}   isotropic reference {iso:.4f}   DLR/iso {want / iso:.3f}"
                    f"   rank {rank}   p 50   (1 warning: report.layers['hidden'].warnings)"]


def test_stored_warning_is_printed_in_full_when_not_issued():
    X, F = lazy_data(n=60, p=12, C=3)  # n < 10 p
    m = richness.Moments()
    m.update(X, outputs=F)
    with warnings.catch_warnings():
        warnings.simplefilter("error", richness.RichnessWarning)  # compute() stores its caveats, issues none
        rep = m.compute()
    assert any(w.startswith("n = 60 is below 10 x p") for w in rep.warnings)
    text = str(rep)
    for w in rep.warnings:
        assert text.count(w) == 1 and f"warning: {w}" in text.splitlines()
    assert "already issued" not in text


def test_evaluate_warning_reaches_the_user_once():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
    X = torch.randn(40, 6, dtype=torch.float64)  # n = 40 < 10 p = 160
    with pytest.warns(richness.RichnessWarning) as rec:
        rep = richness.evaluate(model, [X[:20], X[20:]], progress=False)
    assert any(w.startswith("n = 40 is below 10 x p") for w in rep.warnings)
    assert [str(r.message) for r in rec if r.category is richness.RichnessWarning] == rep.warnings  # issued once
    text = str(rep)
    assert not any(w in text for w in rep.warnings)  # and not printed a second time
    assert text.splitlines()[-1] == (f"warnings: {len(rep.warnings)} already issued as RichnessWarning "
                                     "(texts in report.warnings)")
    assert rep.to_dict()["warnings"] == rep.warnings


def test_jackknife_warning_reaches_the_user_once_beside_a_stored_one():
    rng = np.random.default_rng(1)
    batches = [(rng.normal(size=(30, 12)), rng.normal(size=(30, 2)) if g == 0 else np.ones((30, 2)))
               for g in range(3)]
    m = richness.Moments(groups=3)
    for X, F in batches:
        m.update(X, outputs=F)
    with pytest.warns(richness.RichnessWarning) as rec:
        rep = m.compute(uncertainty=True)
    issued = [str(r.message) for r in rec if r.category is richness.RichnessWarning]
    assert len(issued) == 1 and "no error bars" in issued[0]
    stored_only = [w for w in rep.warnings if w not in issued]
    assert any(w.startswith("n = 90 is below 10 x p = 120") for w in stored_only)  # stored, not issued
    text = str(rep)
    assert issued[0] not in text
    for w in stored_only:
        assert text.count(w) == 1
    assert text.splitlines()[-1] == "warnings: 1 more already issued as RichnessWarning (texts in report.warnings)"


def test_eval_prints_the_reference_once_through_the_report(tmp_path, capsys):
    X, F = lazy_data()
    np.savez(tmp_path / "lazy.npz", features=X, outputs=F)
    assert main(["eval", str(tmp_path / "lazy.npz"), "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    want, rank = dlr_naive(X, F)
    iso = iso_naive(200, 40, rank)
    assert out[:3] == [f"DLR {want:.4f}  (0 = rich, 1 = lazy)   rank {rank}   n 200",
                       f"isotropic reference {iso:.4f}   DLR/iso {want / iso:.3f}", HOW_TO_READ]
    assert sum(ln == HOW_TO_READ for ln in out) == 1


# -- every caveat says what to do (or that nothing needs doing) --------------------------------


def test_rank_cut_warning_names_an_action():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(500, 10))
    F = X[:, :3].copy()
    F[:, 2] = F[:, 0] + 2e-5 * rng.normal(size=500)  # a direction within a decade of the cut
    m = richness.Moments()
    m.update(X, outputs=F)
    rep = m.compute()  # A's third eigenvalue is 9e-11 of its first: within a decade of the default cut 1e-10
    (w,) = [w for w in rep.warnings if "rank cut" in w]
    low, high = rep.dlr_rtol_range
    assert f"DLR moves from {low:.4f} to {high:.4f}" in w
    assert "quote that range (dlr_rtol_range) with DLR, or pass an rtol that falls in a gap" in w


def test_sample_size_warning_names_an_action():
    X, F = lazy_data(n=60, p=12, C=3)
    m = richness.Moments()
    m.update(X, outputs=F)
    (w,) = m.compute(spectrum=False).warnings
    assert w.startswith("n = 60 is below 10 x p = 120 (p = 12)")
    assert w.endswith("read it against that reference (dlr_normalized), or add samples")


def test_nc1_precision_warning_names_an_action():
    from richness.finish.policy import nc1_reported

    value, w = nc1_reported({"k": 3, "precision": "bf16"}, 1e-2)
    assert value is None and w.endswith("precision='fp32' or 'fp64' measures it")


def test_merge_warning_names_an_action():
    rng = np.random.default_rng(0)
    g = richness.Moments(groups=2)
    for _ in range(2):
        g.update(rng.normal(size=(10, 3)))
    plain = richness.Moments()
    with pytest.warns(richness.RichnessWarning, match=r"to keep them, merge into a Moments\(groups=2\)"):
        plain.merge(g)
