"""Similarity(estimator="minibatch" / "both"): the minibatch CKA of Nguyen, Raghu and Kornblith (2021) against
the test's own HSIC_1 on the explicit n_b x n_b Grams of each batch, and against ckatorch's functions on the
same batches."""

import copy
import importlib
import importlib.util
import json
import pickle
import sys
import types
import warnings

import numpy as np
import pytest

import richness
from reference import cka_debiased_naive, cka_naive, states_equal
from richness import Similarity


# -- the references ------------------------------------------------------------------------------------

def hsic1(K, L):
    """Song et al. (2012), eq. (5): the unbiased HSIC of two n x n Grams, written out with explicit
    matrices: K~, L~ the Grams with zeroed diagonals."""
    n = K.shape[0]
    Kt = K - np.diag(np.diag(K))
    Lt = L - np.diag(np.diag(L))
    one = np.ones((n, 1))
    trace = np.trace(Kt @ Lt)
    middle = (one.T @ Kt @ one).item() * (one.T @ Lt @ one).item() / ((n - 1) * (n - 2))
    right = 2.0 / (n - 2) * (one.T @ Kt @ Lt @ one).item()
    return (trace + middle - right) / (n * (n - 3))


def minibatch_reference(data, cuts, center=False):
    """sum_b HSIC_1(K_b^i, K_b^j) / sqrt(sum_b HSIC_1(K_b^i, K_b^i) sum_b HSIC_1(K_b^j, K_b^j)) over the
    batches rows[cuts[b]:cuts[b + 1]] of 4 rows or more; K_b = X_b X_b^T in float64 on the raw rows (with
    ``center``, on the rows less their batch mean: the same value, which HSIC_1 does not change, without the
    digits a large common offset cancels in the raw Grams). Returns the matrix, the batches that entered and
    those left out."""
    names = list(data)
    k = len(names)
    H = np.zeros((k, k))
    entered = skipped = 0
    for a, b in zip(cuts[:-1], cuts[1:]):
        if b - a == 0:
            continue
        if b - a < 4:
            skipped += 1
            continue
        entered += 1
        rows = [np.asarray(data[nm][a:b], dtype=np.float64) for nm in names]
        if center:
            rows = [x - x.mean(0) for x in rows]
        grams = [x @ x.T for x in rows]
        H += np.array([[hsic1(Ki, Kj) for Kj in grams] for Ki in grams])
    with np.errstate(invalid="ignore"):  # a self-HSIC that is not positive gives NaN
        return H / np.sqrt(np.outer(np.diag(H), np.diag(H))), entered, skipped


def reps(seed=0, n=150, widths=(6, 4, 3), offset=2.0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(n, 5))
    out = {}
    for i, w in enumerate(widths):
        out[f"r{i}"] = (base @ rng.normal(size=(5, w)) + (0.5 + i) * rng.normal(size=(n, w)) + offset).astype(dtype)
    return out


def stream(data, cuts, estimator="minibatch", convert=None, precision=None):
    s = Similarity(estimator=estimator, precision=precision)
    for a, b in zip(cuts[:-1], cuts[1:]):
        s.update({k: (v[a:b] if convert is None else convert(v[a:b])) for k, v in data.items()})
    return s


def computed(s):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", richness.RichnessWarning)
        return s.compute()


# batches of different sizes: 1, 2 and 3 rows (left out), 4 (the smallest that enters), larger ones
CUTS = [0, 1, 5, 7, 40, 43, 100, 104, 150]

# Float64 inputs (or precision="fp64"): float64 Gram products, the reference's to rounding (measured 1.4e-15 or
# less). Float32 inputs: float32 products of the batch-centred rows, to 4e-9 or less here (measured); 1e-6 is
# what the docs promise and what is asserted.
TIGHT = {"rtol": 1e-10, "atol": 1e-12}
FP32 = {"rtol": 0, "atol": 1e-6}


def test_the_test_reference_is_the_shared_oracle_and_shift_invariant():
    # the written-out HSIC_1 above against tests/reference.py's, and its known property: unchanged when every
    # row is shifted by one constant row (so minibatch CKA of raw rows needs no centring)
    from reference import hsic_unbiased_naive

    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(9, 4)), rng.normal(size=(9, 3))
    K, L = x @ x.T, y @ y.T
    assert hsic1(K, L) == pytest.approx(hsic_unbiased_naive(K, L), rel=1e-12)
    xs, ys = x + 5.0, y - 3.0
    assert hsic1(xs @ xs.T, ys @ ys.T) == pytest.approx(hsic1(K, L), rel=1e-9)


# -- the values ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,precision", [(np.float64, None), (np.float32, None), (np.float32, "fp64")])
def test_batches_of_different_sizes_match_the_reference(dtype, precision):
    data = reps(1, dtype=dtype)
    want, entered, skipped = minibatch_reference(data, CUTS)
    assert (entered, skipped) == (5, 3)
    s = stream(data, CUTS, precision=precision)
    with pytest.warns(richness.RichnessWarning, match="3 batches of fewer than 4 rows left out.*5 entered"):
        r = s.compute()
    assert (r.n, r.batches, r.skipped, s.batches, s.skipped) == (150, 5, 3, 5, 3)
    assert r.cka is None and r.cka_debiased is None
    np.testing.assert_allclose(r.cka_minibatch, want, **(FP32 if dtype == np.float32 and precision is None else TIGHT))
    assert any("left out" in w for w in r.warnings)


@pytest.mark.parametrize("offset", [1e3, -5e4])
def test_float32_rows_far_from_the_origin(offset):
    # the raw Grams of such rows are dominated by the offset, which HSIC_1 cancels: in float32 products that
    # would leave few digits; the batch-centred rows keep them
    data = reps(22, offset=offset, dtype=np.float32)
    want, _, _ = minibatch_reference(data, CUTS, center=True)
    raw, _, _ = minibatch_reference(data, CUTS)
    assert not np.allclose(raw, want, rtol=0, atol=1e-5)  # the raw float64 Grams already lose digits here
    np.testing.assert_allclose(computed(stream(data, CUTS)).cka_minibatch, want, **FP32)


@pytest.mark.parametrize("factor", [1e25, 1e-25])
def test_float32_values_past_the_float32_product_range(factor):
    # |x| beyond 2^40 (or below 2^-40): that representation's Gram products are float64, so its float32 squares
    # neither over- nor underflow; CKA does not change with a representation's scale
    data = reps(23, dtype=np.float32)
    want, _, _ = minibatch_reference(data, CUTS)
    data["r1"] = (data["r1"].astype(np.float64) * factor).astype(np.float32)
    np.testing.assert_allclose(computed(stream(data, CUTS)).cka_minibatch, want, **FP32)


def test_precision_fp32_takes_float32_products_of_float64_rows():
    data = reps(24)
    want, _, _ = minibatch_reference(data, CUTS)
    got = computed(stream(data, CUTS, precision="fp32")).cka_minibatch
    np.testing.assert_allclose(got, want, **FP32)
    assert np.abs(got - want).max() > 1e-13  # not the float64 products


def test_the_value_depends_on_the_batching_and_is_not_the_full_cka():
    data = reps(2)
    a = computed(stream(data, [0, 50, 100, 150])).cka_minibatch
    b = computed(stream(data, [0, 30, 60, 90, 120, 150])).cka_minibatch
    assert np.abs(a - b).max() > 1e-3
    full = cka_debiased_naive(data["r0"], data["r1"])
    assert abs(a[0, 1] - full) > 1e-4
    # one batch of every row is the debiased CKA of all rows
    one = computed(stream(data, [0, 150])).cka_minibatch
    assert one[0, 1] == pytest.approx(full, rel=1e-9)


def test_only_small_batches_give_nan_with_a_warning():
    data = reps(3, n=9)
    s = stream(data, [0, 3, 6, 9])
    with pytest.warns(richness.RichnessWarning, match="none entered"):
        r = s.compute()
    assert np.isnan(r.cka_minibatch).all() and (r.n, r.batches, r.skipped) == (9, 0, 3)
    assert r.to_dict()["cka_minibatch"][0][1] is None


def test_a_constant_representation_gives_nan_for_its_pairs():
    data = reps(4, n=40)
    data["c"] = np.full((40, 2), 3.0)
    with pytest.warns(richness.RichnessWarning, match=r"self-HSIC of \['c'\] is not positive"):
        r = stream(data, [0, 20, 40]).compute()
    assert np.isnan(r.cka_minibatch[3]).all() and np.isfinite(r.cka_minibatch[:3, :3]).all()


def test_both_keeps_the_exact_state_unchanged_and_the_minibatch_sums():
    data = reps(5)
    exact, both, mini = (stream(data, CUTS, e) for e in ("exact", "both", "minibatch"))
    rb, re_, rm = computed(both), computed(exact), computed(mini)
    assert np.array_equal(rb.cka, re_.cka) and np.array_equal(rb.cka_debiased, re_.cka_debiased, equal_nan=True)
    assert np.array_equal(rb.cka_minibatch, rm.cka_minibatch)
    assert re_.cka_minibatch is None and re_.batches is None and re_.skipped is None
    assert states_equal(both.state_dict()["moments"], exact.state_dict()["moments"])
    sb, sm = both.state_dict(), mini.state_dict()
    assert states_equal(sb["minibatch"], sm["minibatch"])
    # the exact fields against the n x n oracles of all rows
    np.testing.assert_allclose(rb.cka[0, 2], cka_naive(data["r0"], data["r2"]), rtol=1e-10)
    np.testing.assert_allclose(rb.cka_debiased[0, 2], cka_debiased_naive(data["r0"], data["r2"]), rtol=1e-10)
    # exact pays nothing for the estimator: its state dict and report are as before
    assert set(exact.state_dict()) == {"names", "widths", "shift", "scale", "moments"}
    assert set(re_.to_dict()) == {"names", "cka", "cka_debiased", "n", "widths"}


def test_minibatch_holds_no_joint_state():
    data = reps(6, widths=(300, 200))
    s = stream(data, [0, 50, 100, 150])
    st = s.state_dict()
    assert st["estimator"] == "minibatch" and st["moments"]["n"] == 0 and st["moments"]["p"] == -1
    assert st["shift"].size == 0 and st["scale"].size == 0
    held = sum(np.asarray(v).nbytes for v in st["moments"].values() if isinstance(v, np.ndarray))
    assert held == 0 and st["minibatch"]["hsic"].shape == (2, 2)
    # the exact state of the same rows holds (300 + 200 + 2)^2 float64 values
    assert stream(data, [0, 150], "exact").state_dict()["moments"]["M"].shape == (502, 502)


def test_any_width():
    rng = np.random.default_rng(7)
    data = {"wide": rng.normal(size=(24, 60_000)).astype(np.float32), "narrow": rng.normal(size=(24, 5))}
    data["narrow"][:, 0] += data["wide"][:, :100].sum(1)
    cuts = [0, 8, 16, 24]
    want, _, _ = minibatch_reference(data, cuts)
    np.testing.assert_allclose(computed(stream(data, cuts)).cka_minibatch, want, **FP32)
    np.testing.assert_allclose(computed(stream(data, cuts, precision="fp64")).cka_minibatch, want, rtol=1e-9)


def test_pair_between_str_and_to_dict():
    data = reps(8)
    r = computed(stream(data, CUTS, "both"))
    p = r.pair("r0", "r1")
    assert (p.cka, p.cka_debiased) == (r.cka[0, 1], r.cka_debiased[0, 1])
    assert p.cka_minibatch == r.cka_minibatch[0, 1] and "cka_minibatch=" in repr(p)
    assert pickle.loads(pickle.dumps(p)).cka_minibatch == p.cka_minibatch
    blk = r.between("r0", "r2")
    assert blk.cka_minibatch.shape == (1, 1) and blk.cka_minibatch[0, 0] == r.cka_minibatch[0, 2]
    assert "minibatch linear CKA (unbiased HSIC summed over 5 batches)" in str(blk)
    text = str(r)
    assert "minibatch estimator over 5 batches (3 of fewer than 4 rows left out)" in text
    assert "debiased linear CKA" in text and "linear CKA (biased)" in text
    d = json.loads(json.dumps(r.to_dict()))
    assert (d["batches"], d["skipped"]) == (5, 3)
    np.testing.assert_array_equal(np.array(d["cka_minibatch"]), r.cka_minibatch)
    m = computed(stream(data, CUTS))
    p = m.pair("r0", "r1")
    assert (p.cka, p.cka_debiased) == (None, None) and m.between("r0", "r1").cka is None
    assert "cka" not in m.to_dict() and "linear CKA (biased)" not in str(m)


def test_estimator_is_checked():
    for bad in ("fast", "Exact", None, 1):
        with pytest.raises(ValueError, match="estimator must be one of"):
            Similarity(estimator=bad)


# -- ckatorch on the same batches ----------------------------------------------------------------------

def ckatorch_functions():
    """``(hsic1, cka_batch)`` of the installed ckatorch. Its package imports its plotting (seaborn) first;
    where that is missing, its core and hsic modules (torch only) are loaded from the installed files."""
    try:
        from ckatorch.core import cka_batch
        from ckatorch.hsic import hsic1 as ck_hsic1
        return ck_hsic1, cka_batch
    except ImportError:
        pass
    spec = importlib.util.find_spec("ckatorch")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("ckatorch is not installed")
    name = "_ckatorch_core"
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules[name] = pkg
    core = importlib.import_module(f"{name}.core")
    return importlib.import_module(f"{name}.hsic").hsic1, core.cka_batch


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_equal_batches_match_ckatorch_cka_batch(dtype):
    torch = pytest.importorskip("torch")
    _, cka_batch = ckatorch_functions()
    data = reps(9, n=160, dtype=dtype)
    cuts = list(range(0, 161, 32))
    r = computed(stream(data, cuts))
    names = list(data)
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            x = torch.from_numpy(data[a]).reshape(5, 32, -1)  # (batches, rows, width), as cka_batch takes them
            y = torch.from_numpy(data[b]).reshape(5, 32, -1)
            theirs = float(cka_batch(x, y))
            # ckatorch casts to float64: float64 inputs agree to rounding (measured 4e-16, asserted 1e-10);
            # float32 ones to what float32 products keep (measured 4e-9), the 1e-6 promised
            assert abs(r.cka_minibatch[i, j] - theirs) < (1e-10 if dtype == np.float64 else 1e-6), (a, b)


def test_batches_of_different_sizes_match_ckatorch_hsic1():
    torch = pytest.importorskip("torch")
    ck_hsic1, _ = ckatorch_functions()
    data = reps(10)
    r = computed(stream(data, CUTS))
    names = list(data)
    H = np.zeros((3, 3))
    for a, b in zip(CUTS[:-1], CUTS[1:]):
        if b - a < 4:
            continue
        grams = [torch.from_numpy(data[nm][a:b]) @ torch.from_numpy(data[nm][a:b]).T for nm in names]
        for i in range(3):
            for j in range(3):
                H[i, j] += float(ck_hsic1(grams[i][None], grams[j][None])[0])
    theirs = H / np.sqrt(np.outer(np.diag(H), np.diag(H)))
    assert np.abs(r.cka_minibatch - theirs).max() < 1e-10


# -- torch tensors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_torch_tensors(dtype):
    torch = pytest.importorskip("torch")
    data = reps(11, dtype=np.float32 if dtype == "float32" else np.float64)
    want, _, _ = minibatch_reference(data, CUTS)
    s = stream(data, CUTS, "both", convert=torch.from_numpy)
    r = computed(s)
    tol = FP32 if dtype == "float32" else TIGHT
    np.testing.assert_allclose(r.cka_minibatch, want, **tol)
    on_numpy = computed(stream(data, CUTS, "both"))
    np.testing.assert_allclose(r.cka_minibatch, on_numpy.cka_minibatch, **tol)
    assert isinstance(s.state_dict()["minibatch"]["hsic"], np.ndarray)


def test_torch_wide_rows_in_large_batches():
    # width 700 and 100-row batches: the CPU float32 Grams formed by blocks of rows
    torch = pytest.importorskip("torch")
    data = reps(25, widths=(700, 520, 3), dtype=np.float32)
    cuts = [0, 100, 150]
    want, _, _ = minibatch_reference(data, cuts)
    r = computed(stream(data, cuts, convert=torch.from_numpy))
    np.testing.assert_allclose(r.cka_minibatch, want, **FP32)
    np.testing.assert_allclose(computed(stream(data, cuts)).cka_minibatch, want, **FP32)


# -- merge, copies, files ------------------------------------------------------------------------------

@pytest.mark.parametrize("estimator", ["minibatch", "both"])
def test_merge_in_any_order_and_round_trips(estimator, tmp_path):
    data = reps(12)
    want, _, _ = minibatch_reference(data, CUTS)
    parts = [(0, 4), (3, 7), (6, 9)]  # the slices of CUTS each state streams: whole batches of CUTS

    def part(i):
        lo, hi = parts[i]
        return stream(data, CUTS[lo:hi], estimator)

    a, b, c = (part(i) for i in range(3))
    before = [x.state_dict() for x in (a, b, c)]
    for order in ((a, b, c), (c, a, b), (b, c, a)):
        m = Similarity()  # an empty state takes the first one's estimator
        for x in order:
            m.merge(x)
        r = computed(m)
        assert m.estimator == estimator and (r.n, r.batches, r.skipped) == (150, 5, 3)
        np.testing.assert_allclose(r.cka_minibatch, want, rtol=1e-10, atol=1e-12)
    for x, st in zip((a, b, c), before):
        assert states_equal(x.state_dict(), st)
    whole = stream(data, CUTS, estimator)
    for cp in (copy.copy(whole), copy.deepcopy(whole), pickle.loads(pickle.dumps(whole))):
        assert states_equal(cp.state_dict(), whole.state_dict()) and cp.estimator == estimator
    path = tmp_path / "s.npz"
    whole.save(path)
    back = Similarity.load(path)
    assert back.estimator == estimator and states_equal(back.state_dict(), whole.state_dict())
    t = Similarity()
    t.load_state_dict(whole.state_dict())
    assert states_equal(t.state_dict(), whole.state_dict())
    # both go on alike
    more = reps(13, n=40)
    for o in (whole, back, t):
        o.update(more)
    assert states_equal(back.state_dict(), whole.state_dict()) and states_equal(t.state_dict(), whole.state_dict())
    # an empty state of this estimator saves and loads as such
    Similarity(estimator=estimator).save(tmp_path / "empty.npz")
    empty = Similarity.load(tmp_path / "empty.npz")
    assert empty.estimator == estimator and empty.n == 0


def test_merge_refuses_another_estimator_and_the_kinds_table_says_so():
    from richness._engine import kinds

    data = reps(14)
    mini, exact, both = (stream(data, [0, 50, 150], e) for e in ("minibatch", "exact", "both"))
    st = mini.state_dict()
    for other in (exact, both):
        with pytest.raises(ValueError, match="cannot merge: this Similarity keeps the estimator 'minibatch'"):
            mini.merge(other)
    assert states_equal(mini.state_dict(), st)
    kind = kinds.get("similarity")
    with pytest.raises(ValueError, match="different estimators"):
        kind.check([kind.widths(mini), kind.widths(exact)])
    kind.check([kind.widths(mini), kind.widths(Similarity())])  # an empty state merges with any
    merged = kinds.merge_own_dicts("similarity", [st, mini.state_dict()])
    assert merged["estimator"] == "minibatch" and merged["minibatch"]["batches"] == 4


def test_richness_merge_of_minibatch_files(tmp_path, capsys):
    from richness.cli import main

    data = reps(15)
    want, _, _ = minibatch_reference(data, CUTS)
    stream(data, CUTS[:5]).save(tmp_path / "a.npz")
    stream(data, CUTS[4:]).save(tmp_path / "b.npz")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", richness.RichnessWarning)
        assert main(["merge", str(tmp_path / "m.npz"), str(tmp_path / "a.npz"), str(tmp_path / "b.npz"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert (rep["n"], rep["batches"], rep["skipped"], "cka" in rep) == (150, 5, 3, False)
    np.testing.assert_allclose(np.array(rep["cka_minibatch"]), want, rtol=1e-10, atol=1e-12)
    r = computed(Similarity.load(tmp_path / "m.npz"))
    np.testing.assert_allclose(r.cka_minibatch, want, rtol=1e-10, atol=1e-12)
    stream(data, CUTS[4:], "exact").save(tmp_path / "e.npz")
    assert main(["merge", str(tmp_path / "x.npz"), str(tmp_path / "a.npz"), str(tmp_path / "e.npz")]) == 2
    assert "different estimators" in capsys.readouterr().err and not (tmp_path / "x.npz").exists()


def _v2_file(path, s):
    """A file as ``Similarity.save`` wrote it before the minibatch estimator (format version 2)."""
    from richness import _state
    from richness._engine import statefile

    st = s.state_dict()
    mst = st["moments"]
    arrays = {k: np.asarray(mst[k]) for k in _state.FIELD_NAMES}
    arrays["shift"], arrays["scale"] = st["shift"], st["scale"]
    extra = {"names": st["names"], "widths": st["widths"]}
    meta = {"format": "richness.similarity", "version": 2, **{k: mst[k] for k in _state.SCALARS}, **extra,
            "sha256": statefile._digest(arrays, mst, extra)}
    statefile.write_archive(path, meta, arrays)


def test_a_file_of_the_previous_format_loads_as_exact(tmp_path):
    data = reps(16)
    s = stream(data, [0, 70, 150], "exact")
    _v2_file(tmp_path / "v2.npz", s)
    back = Similarity.load(tmp_path / "v2.npz")
    assert back.estimator == "exact" and states_equal(back.state_dict(), s.state_dict())
    r = computed(back)
    np.testing.assert_allclose(r.cka[0, 1], cka_naive(data["r0"], data["r1"]), rtol=1e-10)
    assert r.cka_minibatch is None
    # and the state dicts of before (no estimator entry) load as exact
    t = Similarity(estimator="minibatch")
    t.load_state_dict(s.state_dict())
    assert t.estimator == "exact"


def test_files_with_a_bad_minibatch_entry_are_refused(tmp_path):
    from richness._engine import statefile

    s = stream(reps(17), CUTS)
    path = tmp_path / "m.npz"
    s.save(path)
    raw = dict(np.load(path))
    meta = json.loads(raw["meta"].tobytes().decode())
    assert meta["version"] == 3 and meta["estimator"] == "minibatch" and meta["minibatch"]["n"] == 150
    for change in ({"estimator": "fast"}, {"minibatch": {"batches": 5, "skipped": 3}}, {"version": 2}):
        bad = {**meta, **change}
        arrays = {k: v for k, v in raw.items() if k != "meta"}
        statefile.write_archive(tmp_path / "bad.npz", bad, arrays)
        with pytest.raises(ValueError, match="bad.npz"):
            Similarity.load(tmp_path / "bad.npz")


def test_load_state_dict_refusals_leave_the_state():
    data = reps(18)
    good = stream(data, CUTS).state_dict()
    t = stream(data, [0, 80, 150])
    before = t.state_dict()
    mb = good["minibatch"]
    bads = [{**good, "estimator": "fast"},
            {k: v for k, v in good.items() if k != "minibatch"},
            {**good, "minibatch": {**mb, "hsic": mb["hsic"][:2, :2]}},
            {**good, "minibatch": {**mb, "hsic": mb["hsic"] + np.triu(np.ones((3, 3)), 1)}},
            {**good, "minibatch": {**mb, "batches": 40}},
            {**good, "minibatch": {**mb, "n": -1}},
            {**good, "minibatch": {k: v for k, v in mb.items() if k != "skipped"}},
            {**stream(data, CUTS, "both").state_dict(), "estimator": "minibatch"},
            {**stream(data, CUTS, "exact").state_dict(), "minibatch": mb}]
    for bad in bads:
        with pytest.raises(ValueError, match="similarity state"):
            t.load_state_dict(bad)
        assert states_equal(t.state_dict(), before) and t.estimator == "minibatch"


# -- bad input -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("estimator", ["minibatch", "both"])
def test_bad_input_leaves_the_state_unchanged(estimator):
    data = reps(19, n=60)
    s = stream(data, [0, 20, 40], estimator)
    before = s.state_dict()
    rest = {k: v[40:] for k, v in data.items()}
    nan = {**rest, "r1": rest["r1"].copy()}
    nan["r1"][3, 0] = np.nan
    huge = {**rest, "r2": rest["r2"] * 1e70}
    tiny = {**rest, "r2": rest["r2"] * 1e-70}
    cases = [({**rest, "r1": rest["r1"][:, :-1]}, ValueError, "widths"),
             ({**rest, "r1": rest["r1"][:-1]}, ValueError, "different row counts"),
             (nan, ValueError, "contains 1 NaN"),
             (huge, ValueError, "'r2' has a largest magnitude of .* outside"),
             (tiny, ValueError, "'r2' has a largest magnitude of .* outside"),
             ({"r0": rest["r0"], "r1": rest["r1"]}, ValueError, "missing"),
             ({**rest, "r0": rest["r0"].astype(np.int64)}, TypeError, "floating")]
    for batch, exc, match in cases:
        with pytest.raises(exc, match=match):
            s.update(batch)
        assert states_equal(s.state_dict(), before)
    s.update(rest)
    want, _, _ = minibatch_reference(data, [0, 20, 40, 60])
    np.testing.assert_allclose(computed(s).cka_minibatch, want, rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the exact part's refusal
def test_both_adds_nothing_when_the_exact_state_refuses_after_the_minibatch_terms():
    # float32 values fixed near 1 by the first batch, then a batch at 1e30: its minibatch terms are finite
    # (1e120), its squared row norms at the state's float32 scale are not, so the exact part refuses it
    rng = np.random.default_rng(20)
    first = {"a": rng.normal(size=(10, 4)).astype(np.float32), "b": rng.normal(size=(10, 3)).astype(np.float32)}
    s = Similarity(estimator="both")
    s.update(first)
    before = s.state_dict()
    with pytest.raises(ValueError, match="too large"):
        s.update({"a": (rng.normal(size=(10, 4)) * 1e30).astype(np.float32), "b": first["b"]})
    assert states_equal(s.state_dict(), before)


# -- richness.dask and richness.similarity ---------------------------------------------------------------

def test_dask_row_chunks_are_the_batches():
    da = pytest.importorskip("dask.array")
    import richness.dask as rd

    data = reps(21)
    cuts = [0, 40, 80, 120, 150]
    arrays = {k: da.from_array(v, chunks=(40, -1)) for k, v in data.items()}
    s = rd.similarity(arrays, estimator="minibatch", split_every=2)
    want, _, _ = minibatch_reference(data, cuts)
    assert s.estimator == "minibatch" and s.batches == 4
    np.testing.assert_allclose(computed(s).cka_minibatch, want, rtol=1e-10, atol=1e-12)


def test_richness_similarity_over_a_loader_past_the_flatten_limit():
    torch = pytest.importorskip("torch")
    from richness.torch.batches import FLATTEN_LIMIT

    torch.manual_seed(0)
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(128, 5))
    g = torch.Generator().manual_seed(1)
    X = torch.randn(70, 3, 48, 48, generator=g)
    loader = [(X[i:i + 16], None) for i in range(0, 70, 16)]  # 16, 16, 16, 16 and a last batch of 6
    assert 8 * 48 * 48 > FLATTEN_LIMIT
    with pytest.raises(ValueError, match="past the limit"):
        richness.similarity(conv, loader, ["1", "4"], progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", richness.RichnessWarning)
        rep = richness.similarity(conv, loader, ["1", "4"], progress=False, estimator="minibatch")
    acts = {"1": [], "4": []}
    hooks = [conv.get_submodule(k).register_forward_hook(
        lambda _m, _a, o, k=k: acts[k].append(o.detach().reshape(o.shape[0], -1).numpy())) for k in acts]
    with torch.no_grad():
        for x, _ in loader:
            conv(x)
    for h in hooks:
        h.remove()
    data = {k: np.concatenate(v) for k, v in acts.items()}
    want, entered, _ = minibatch_reference(data, [0, 16, 32, 48, 64, 70])
    assert rep.names == ["model.1", "model.4"] and rep.widths == [8 * 48 * 48, 5] and rep.batches == entered == 5
    assert rep.cka is None
    np.testing.assert_allclose(rep.cka_minibatch, want, **FP32)  # a float32 model
