"""richness.cka and richness.Similarity against the n x n float64 oracles of tests/reference.py."""

import copy
import pickle
import warnings

import numpy as np
import pytest

import richness
from reference import cka_debiased_naive, cka_naive
from richness import Similarity


def reps(seed=0, n=120, widths=(6, 4, 3), offset=0.0):
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(n, 5))
    out = {}
    for i, w in enumerate(widths):
        out[f"r{i}"] = base @ rng.normal(size=(5, w)) + (0.5 + i) * rng.normal(size=(n, w)) + offset
    return out


def oracle(data):
    names = list(data)
    k = len(names)
    b, d = np.ones((k, k)), np.ones((k, k))
    for i in range(k):
        for j in range(k):
            b[i, j] = cka_naive(data[names[i]], data[names[j]])
            d[i, j] = cka_debiased_naive(data[names[i]], data[names[j]])
    return b, d


def stream(data, cuts=(), **kw):
    """A Similarity updated with ``data`` in batches cut at the rows ``cuts``."""
    s = Similarity(**kw)
    edges = [0, *cuts, len(next(iter(data.values())))]
    for a, b in zip(edges[:-1], edges[1:]):
        s.update({k: v[a:b] for k, v in data.items()})
    return s


def close(report, data, rtol=1e-10, atol=1e-12):
    b, d = oracle(data)
    np.testing.assert_allclose(report.cka, b, rtol=rtol, atol=atol)
    np.testing.assert_allclose(report.cka_debiased, d, rtol=rtol, atol=atol)


@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_cka_function_matches_oracle(offset):
    data = reps(1, offset=offset)
    x, y = data["r0"], data["r1"]
    assert richness.cka(x, y) == pytest.approx(cka_naive(x, y), rel=1e-10)
    assert richness.cka(x, y, debiased=True) == pytest.approx(cka_debiased_naive(x, y), rel=1e-10)


def test_oracle_debiased_is_shift_invariant():
    data = reps(2)
    x, y = data["r0"], data["r1"]
    raw = cka_debiased_naive(x + 3.0, y - 2.0, center=False)
    assert raw == pytest.approx(cka_debiased_naive(x, y), rel=1e-10)


@pytest.mark.parametrize("offset", [0.0, 1e4])
@pytest.mark.parametrize("cuts", [(), (1, 2, 50), (7, 8, 100, 119)])
def test_streamed_uneven_batches(offset, cuts):
    data = reps(3, offset=offset)
    r = stream(data, cuts).compute()
    assert r.names == ["r0", "r1", "r2"] and r.widths == [6, 4, 3] and r.n == 120
    close(r, data, rtol=1e-9, atol=1e-11)
    p = r.pair("r0", "r2")
    assert (p.cka, p.cka_debiased) == (pytest.approx(r.cka[0, 2]), pytest.approx(r.cka_debiased[0, 2]))


def test_float32_inputs():
    data = {k: (v + 1e4).astype(np.float32) for k, v in reps(4).items()}
    r = stream(data, (30, 31)).compute()
    close(r, {k: v.astype(np.float64) for k, v in data.items()}, rtol=1e-5, atol=2e-6)


def test_torch_cpu_batches():
    torch = pytest.importorskip("torch")
    data = reps(5, offset=100.0)
    s = Similarity()
    for a, b in ((0, 40), (40, 120)):
        s.update({k: torch.from_numpy(v[a:b]) for k, v in data.items()})
    close(s.compute(), data, rtol=1e-9)


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 2, 0)])
def test_merge_any_order_and_shifts(order):
    data = reps(6, offset=50.0)
    # each part starts at its own first batch, so every part has a different shift
    parts = [stream({k: v[a:b] for k, v in data.items()}, ()) for a, b in ((0, 30), (30, 31), (31, 120))]
    parts[1] = stream({k: v[30:31] for k, v in data.items()}, ())
    acc = copy.deepcopy(parts[order[0]])
    for i in order[1:]:
        acc.merge(parts[i])
    close(acc.compute(), data, rtol=1e-9, atol=1e-11)


def test_merge_into_empty_and_of_empty():
    data = reps(7)
    full = stream(data, (60,))
    e = Similarity()
    e.merge(full)
    close(e.compute(), data)
    full.merge(Similarity())
    close(full.compute(), data)


def test_state_dict_save_load_copy_pickle(tmp_path):
    data = reps(8, offset=1e4)
    s = stream(data, (10, 90))
    t = Similarity()
    t.load_state_dict(s.state_dict())
    close(t.compute(), data, rtol=1e-9)
    path = tmp_path / "s.npz"
    s.save(path)
    u = Similarity.load(path)
    close(u.compute(), data, rtol=1e-9)
    for c in (copy.copy(s), copy.deepcopy(s), pickle.loads(pickle.dumps(s))):
        close(c.compute(), data, rtol=1e-9)
        c.update({k: v[:5] for k, v in data.items()})
        assert c.n == 125 and s.n == 120
    # a loaded half merges with the other half
    a = stream({k: v[:70] for k, v in data.items()}, ())
    a.save(path)
    b = Similarity.load(path)
    b.merge(stream({k: v[70:] for k, v in data.items()}, ()))
    close(b.compute(), data, rtol=1e-9)


def test_files_refused(tmp_path):
    data = reps(9)
    m = richness.Moments()
    m.update(data["r0"])
    mp = tmp_path / "m.npz"
    m.save(mp)
    with pytest.raises(ValueError, match="richness.moments"):
        Similarity.load(mp)
    sp = tmp_path / "s.npz"
    stream(data, ()).save(sp)
    raw = bytearray(sp.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    bad = tmp_path / "bad.npz"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="bad.npz"):
        Similarity.load(bad)
    trunc = tmp_path / "trunc.npz"
    trunc.write_bytes(sp.read_bytes()[:200])
    with pytest.raises(ValueError, match="trunc.npz"):
        Similarity.load(trunc)


def test_reset():
    data = reps(10)
    s = stream(data, ())
    s.reset()
    assert s.n == 0 and s.names == []
    s.update({"a": data["r0"], "b": data["r2"]})
    assert s.compute().names == ["a", "b"]


def _bad_updates(data):
    n = 120
    rng = np.random.default_rng(0)
    nan = data["r0"][:10].copy()
    nan[3, 2] = np.nan
    inf = data["r1"][:10].copy()
    inf[0, 0] = np.inf
    return [
        ({"r0": data["r0"][:10], "r1": data["r1"][:10]}, "missing"),
        ({**{k: v[:10] for k, v in data.items()}, "extra": rng.normal(size=(10, 2))}, "added"),
        ({"r0": data["r0"][:10], "r1": data["r1"][:9], "r2": data["r2"][:10]}, "row counts"),
        ({"r0": nan, "r1": data["r1"][:10], "r2": data["r2"][:10]}, "NaN"),
        ({"r0": data["r0"][:10], "r1": inf, "r2": data["r2"][:10]}, "NaN or Inf"),
        ({"r0": np.zeros((10, 0)), "r1": data["r1"][:10], "r2": data["r2"][:10]}, "width 0"),
        ({"r0": data["r0"][:10, :2], "r1": data["r1"][:10], "r2": data["r2"][:10]}, "widths"),
        ({"r0": data["r0"][:10, 0], "r1": data["r1"][:10], "r2": data["r2"][:10]}, "2-D"),
        ({"r0": data["r0"][:10].astype(int), "r1": data["r1"][:10], "r2": data["r2"][:10]}, "floating"),
        ([data["r0"][:n]], "mapping"),
        ({}, "empty"),
    ]


def test_bad_updates_leave_state_unchanged():
    data = reps(11)
    s = stream(data, (50,))
    before = s.state_dict()
    for bad, msg in _bad_updates(data):
        with pytest.raises((ValueError, TypeError), match=msg):
            s.update(bad)
        after = s.state_dict()
        assert after["names"] == before["names"] and after["widths"] == before["widths"]
        np.testing.assert_array_equal(after["moments"]["M"], before["moments"]["M"])
        assert after["moments"]["n"] == before["moments"]["n"]
    close(s.compute(), data)


def test_first_update_refused_leaves_empty():
    s = Similarity()
    x = np.ones((5, 2))
    x[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        s.update({"a": x, "b": np.ones((5, 1))})
    assert s.n == 0 and s.names == []


def test_merge_refusals_leave_state_unchanged():
    data = reps(12)
    s = stream(data, ())
    other_names = stream({"r0": data["r0"], "r1": data["r1"], "zz": data["r2"]}, ())
    other_widths = stream({"r0": data["r0"], "r1": data["r1"], "r2": data["r2"][:, :2]}, ())
    for o in (other_names, other_widths):
        with pytest.raises(ValueError, match="cannot merge.*r2.*other"):
            s.merge(o)
    with pytest.raises(TypeError, match="Similarity"):
        s.merge(richness.Moments())
    close(s.compute(), data)


def test_load_state_dict_refusals():
    data = reps(13)
    s = stream(data, ())
    st = s.state_dict()
    t = stream(data, (3,))
    for bad in ({**st, "names": ["a", "a", "b"]}, {**st, "widths": [6, 4]}, {**st, "shift": st["shift"][:-1]},
                {k: v for k, v in st.items() if k != "shift"}, {**st, "extra": 1}):
        with pytest.raises(ValueError):
            t.load_state_dict(bad)
    close(t.compute(), data)


def test_load_state_dict_refuses_a_crafted_joint_gram():
    # a state dict from outside still gets the semi-definiteness check: one
    # covariance of the joint state raised past Cauchy-Schwarz (every variance
    # and the symmetry as before) is refused, and the state is unchanged
    data = reps(14)
    st = stream(data, ()).state_dict()
    M = st["moments"]["M"].copy()
    M[0, 1] = M[1, 0] = 1.5 * np.sqrt(M[0, 0] * M[1, 1])
    bad = {**st, "moments": {**st["moments"], "M": M}}
    t = stream(data, (3,))
    with pytest.raises(ValueError, match="'M' is not positive semi-definite"):
        t.load_state_dict(bad)
    close(t.compute(), data)


def test_small_n_debiased_nan_with_warning():
    s = Similarity()
    s.update({"a": np.arange(6.0).reshape(3, 2), "b": np.array([[1.0], [0.0], [2.0]])})
    with pytest.warns(richness.RichnessWarning, match="at least 4"):
        r = s.compute()
    assert np.isnan(r.cka_debiased).all()
    assert r.to_dict()["cka_debiased"][0][1] is None
    assert np.isfinite(r.cka).all()


def test_to_dict_keys():
    data = reps(14)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = stream(data, ()).compute().to_dict()
    assert set(d) == {"names", "cka", "cka_debiased", "n", "widths"}
    b, u = oracle(data)
    np.testing.assert_allclose(np.array(d["cka"]), b, rtol=1e-10)
    np.testing.assert_allclose(np.array(d["cka_debiased"]), u, rtol=1e-10)


def test_import_does_not_need_torch():
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; import richness; "
            "import numpy as np; x = np.random.default_rng(0).normal(size=(50, 3)); "
            "print(round(richness.cka(x, x @ np.ones((3, 2))), 6)); s = richness.Similarity()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout) > 0


_MEM = """
import resource, sys
import numpy as np
import richness
n, batch = int(sys.argv[1]), 2000
s = richness.Similarity()
rng = np.random.default_rng(0)
for start in range(0, n, batch):
    x = rng.normal(size=(batch, 64))
    s.update({"a": x, "b": x[:, :32] + rng.normal(size=(batch, 32)), "c": rng.normal(size=(batch, 48))})
s.compute()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def test_peak_memory_flat_in_n():
    import subprocess
    import sys

    def peak(n):
        out = subprocess.run([sys.executable, "-c", _MEM, str(n)], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1]) * 1024

    small, large = peak(20_000), peak(200_000)
    # 200,000 x 144 float64 would be 230 MB held; streamed, the peak grows by far less than that
    assert large - small < 20e6, (small, large)
