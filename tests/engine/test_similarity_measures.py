"""Similarity.compute(measures=...): the similarity family finished from one streamed state, through
every route that carries it (compute, merges, richness.similarity, richness cka, plot.similarity),
against references computed from the raw rows (tests/finish/test_similarity_family.py's QR, SVD
and least-squares references)."""

import json
import pickle
import warnings

import numpy as np
import pytest

import richness
from richness import RichnessWarning, Similarity
from richness.cli import main
from reference import cka_debiased_naive, cka_naive
from test_similarity_family import references, related

FAMILY = ("cca_r2", "cca_rho", "svcca", "pwcca", "procrustes", "shape_angular", "linreg_r2")


def streamed(reps, cuts=(37, 150, 151, 300), **kw):
    s = Similarity(**kw)
    edges = [0, *cuts, len(reps[0])]
    for a, b in zip(edges[:-1], edges[1:]):
        s.update({f"r{i}": x[a:b] for i, x in enumerate(reps)})
    return s


def quiet(fn, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RichnessWarning)
        return fn(*a, **kw)


@pytest.mark.parametrize("seed", [0, 1])
def test_every_measure_from_one_streamed_state(seed):
    reps = related(seed)
    rep = quiet(streamed(reps, precision="fp64").compute, measures="all")
    assert list(rep.values) == ["cka", "cka_debiased", *FAMILY]
    ref = references(reps)
    for name in FAMILY:
        np.testing.assert_allclose(getattr(rep, name), ref[name], rtol=1e-9, atol=1e-9, err_msg=name)
    for i in range(3):
        for j in range(3):
            assert rep.cka[i, j] == pytest.approx(cka_naive(reps[i], reps[j]), rel=1e-9)
            assert rep.cka_debiased[i, j] == pytest.approx(cka_debiased_naive(reps[i], reps[j]), rel=1e-8, abs=1e-12)
    p = rep.pair("r0", "r2")  # row r0 predicts column r2
    assert p.linreg_r2 == pytest.approx(ref["linreg_r2"][0, 2], rel=1e-9) and p.svcca == rep.svcca[0, 2]


def test_only_what_is_asked_is_finished():
    s = streamed(related(3), precision="fp64")
    rep = s.compute(measures=["procrustes", "cca_r2"])
    assert list(rep.values) == ["cca_r2", "procrustes"]  # MEASURES order
    assert rep.cka is None and rep.svcca is None and rep.cca_r2 is not None
    assert set(rep.to_dict()) == {"names", "cca_r2", "procrustes", "n", "widths"}
    assert list(s.compute().values) == ["cka", "cka_debiased"]  # the default is unchanged
    assert list(rep.between("r0", "r1").values) == ["cca_r2", "procrustes"]


def test_options_reach_their_measures():
    reps = related(4)
    s = streamed(reps, precision="fp64")
    rep = quiet(s.compute, measures=["svcca", "linreg_r2"], svcca_keep=0.5, ridge=0.3)
    ref = references(reps, keep=0.5, ridge=0.3)
    np.testing.assert_allclose(rep.svcca, ref["svcca"], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(rep.linreg_r2, ref["linreg_r2"], rtol=1e-9, atol=1e-9)
    # a coarse rank cut drops r2's weak direction (a column at about a thousandth of its variance)
    fine, coarse = (quiet(s.compute, measures=["cca_r2"], rtol=r).cca_r2 for r in (None, 0.01))
    np.testing.assert_allclose(fine, references(reps)["cca_r2"], rtol=1e-9, atol=1e-9)
    assert abs(coarse[1, 2] - fine[1, 2]) > 1e-3


@pytest.mark.parametrize("kw, match", [
    (dict(measures=["cka", "nope"]), "unknown similarity measure 'nope'"),
    (dict(measures=["cka_minibatch"]), r"cka_minibatch needs the minibatch state.*estimator='minibatch' or 'both'"),
    (dict(measures=["svcca"], svcca_keep=0.0), "keep"),
    (dict(measures=["linreg_r2"], ridge=-1.0), "ridge"),
    (dict(measures=["cca_r2"], rtol=2.0), "rtol"),
])
def test_bad_requests_name_the_problem(kw, match):
    s = streamed(related(5))
    before = s.state_dict()
    with pytest.raises(ValueError, match=match):
        s.compute(**kw)
    after = s.state_dict()
    np.testing.assert_array_equal(before["moments"]["M"], after["moments"]["M"])


def test_exact_measures_need_the_exact_state():
    s = streamed(related(6), estimator="minibatch")
    with pytest.raises(ValueError, match=r"procrustes needs the exact state.*estimator='exact' or 'both'"):
        s.compute(measures=["procrustes"])
    assert list(quiet(s.compute, measures="all").values) == ["cka_minibatch"]
    both = quiet(streamed(related(6), estimator="both").compute, measures="all")
    assert list(both.values) == ["cka", "cka_debiased", "cka_minibatch", *FAMILY]


def test_split_and_merged_states_give_the_same_measures():
    reps = related(7)
    one = quiet(streamed(reps, cuts=(), precision="fp64").compute, measures=list(FAMILY))
    a = streamed([x[:123] for x in reps], cuts=(50,), precision="fp64")
    b = streamed([x[123:] for x in reps], cuts=(100,), precision="fp64")
    b.merge(a)
    merged = quiet(b.compute, measures=list(FAMILY))
    for name in FAMILY:
        np.testing.assert_allclose(merged.values[name], one.values[name], rtol=1e-10, atol=1e-12, err_msg=name)


def test_degenerate_values_warn_and_are_listed():
    rng = np.random.default_rng(8)
    reps = [rng.normal(size=(30, 18)), rng.normal(size=(30, 16)), np.ones((30, 2))]
    with pytest.warns(RichnessWarning) as caught:
        rep = streamed(reps, cuts=(10,)).compute(measures=["cca_rho", "procrustes"])
    text = " ".join(str(w.message) for w in caught)
    assert "r2" in text and np.isnan(rep.procrustes[2, 0]) and np.isnan(rep.cca_rho[0, 2])
    assert rep.cca_rho[0, 1] > 0.5  # 34 columns at n = 30: correlations of 1 by construction, warned
    assert any("1" in w and "r0" in w for w in rep.warnings)


def test_reports_pickle_and_old_pickles_load():
    rep = quiet(streamed(related(9)).compute, measures=["cka", "pwcca"])
    back = pickle.loads(pickle.dumps(rep))
    assert list(back.values) == ["cka", "pwcca"] and np.array_equal(back.pwcca, rep.pwcca)
    old = object.__new__(type(rep))  # a report pickled when each estimator was an attribute
    old.__setstate__({"names": rep.names, "widths": rep.widths, "n": rep.n, "cka": rep.cka,
                      "cka_debiased": None})
    assert list(old.values) == ["cka"] and old.cka_debiased is None and old.warnings == []
    with pytest.raises(AttributeError, match="no attribute 'ckaa'"):
        rep.ckaa


def test_richness_similarity_passes_measures():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4)).double()
    x = torch.randn(90, 6, dtype=torch.float64)
    loader = [x[i:i + 30] for i in range(0, 90, 30)]
    rep = quiet(richness.similarity, {"a": a}, loader, ["0", "2"], progress=False,
                measures=["cca_r2", "linreg_r2"])
    with torch.no_grad():
        h0, h2 = a[0](x).numpy(), a(x).numpy()
    ref = references([h0, h2])
    np.testing.assert_allclose(rep.cca_r2, ref["cca_r2"], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(rep.linreg_r2, ref["linreg_r2"], rtol=1e-9, atol=1e-9)
    assert rep.cka is None


def test_cli_measures_and_estimator(tmp_path, capsys):
    reps = related(10)
    for i, x in enumerate(reps):
        np.save(tmp_path / f"r{i}.npy", x)
    files = [str(tmp_path / f"r{i}.npy") for i in range(3)]
    assert main(["cka", *files, "--measures", "procrustes,linreg_r2", "--json", "--no-progress"]) == 0
    d = json.loads(capsys.readouterr().out)
    ref = references(reps)
    assert set(d) == {"names", "procrustes", "linreg_r2", "n", "widths"}
    np.testing.assert_allclose(np.array(d["linreg_r2"]), ref["linreg_r2"], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(np.array(d["procrustes"]), ref["procrustes"], rtol=1e-8, atol=1e-9)
    assert main(["cka", *files, "--measures", "all", "--estimator", "both", "--chunk", "64",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "7 batches of at most 64 rows" in out
    for title in ("linear CKA (biased)", "minibatch linear CKA", "PWCCA", "orthogonal Procrustes distance"):
        assert title in out
    assert main(["cka", *files, "--measures", "svcca", "--estimator", "minibatch", "--no-progress"]) == 2
    assert "svcca needs the exact state" in capsys.readouterr().err


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_plot_draws_any_measure(tmp_path):
    pytest.importorskip("matplotlib")
    rep = quiet(streamed(related(11)).compute, measures=["cka", "shape_angular", "linreg_r2"])
    png, svg = richness.plot.similarity(rep, tmp_path / "angle", measure="shape_angular")
    text = read(svg)
    assert "angular shape metric" in text and f"{rep.shape_angular[0, 1]:.2f}" in text
    _, svg = richness.plot.similarity(rep.between("r0", "r1"), tmp_path / "reg", measure="linreg_r2")
    assert "linear regression R2" in read(svg)
    with pytest.raises(ValueError, match=r"holds no pwcca .*measures=\['pwcca'\]"):
        richness.plot.similarity(rep, tmp_path / "x", measure="pwcca")
