"""Similarity at extreme scales, its names and states, the streamed one-shot cka, the report's table and blocks.

Every CKA is checked against float64 numpy formulas from the raw n x p arrays (written out here, independent of
the package): the biased one from the centred cross-products, the debiased one from the n x n Gram matrices.
"""

import tracemalloc
import warnings

import numpy as np
import pytest

import richness
from richness import Similarity
from test_similarity import stream


def biased_ref(x, y):
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    x = x / np.abs(x).max()  # CKA does not depend on the scale; the reference squares values near 1
    y = y / np.abs(y).max()
    xc, yc = x - x.mean(0), y - y.mean(0)
    return np.linalg.norm(xc.T @ yc) ** 2 / (np.linalg.norm(xc.T @ xc) * np.linalg.norm(yc.T @ yc))


def hsic1(K, L):
    n = K.shape[0]
    K, L = K - np.diag(np.diag(K)), L - np.diag(np.diag(L))
    one = np.ones(n)
    return (np.trace(K @ L) + (one @ K @ one) * (one @ L @ one) / ((n - 1) * (n - 2))
            - 2.0 / (n - 2) * one @ K @ L @ one) / (n * (n - 3))


def debiased_ref(x, y):
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    x = x / np.abs(x).max()
    y = y / np.abs(y).max()
    x, y = x - x.mean(0), y - y.mean(0)  # HSIC_1 is shift-invariant; centred, the Gram matrices lose no digits
    K, L = x @ x.T, y @ y.T
    return hsic1(K, L) / np.sqrt(hsic1(K, K) * hsic1(L, L))


def reps(seed=0, n=90, widths=(6, 4, 3), offset=0.0):
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(n, 5))
    return {f"r{i}": base @ rng.normal(size=(5, w)) + (0.5 + i) * rng.normal(size=(n, w)) + offset
            for i, w in enumerate(widths)}


def refs(data):
    names = list(data)
    b = np.array([[biased_ref(data[a], data[c]) for c in names] for a in names])
    d = np.array([[debiased_ref(data[a], data[c]) for c in names] for a in names])
    return b, d


def close(report, data, rtol=1e-9, atol=1e-11):
    b, d = refs(data)
    np.testing.assert_allclose(report.cka, b, rtol=rtol, atol=atol)
    np.testing.assert_allclose(report.cka_debiased, d, rtol=rtol, atol=atol)


# -- every CKA is scale-free ------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1e38, 1e-42, 1e-90, 1e200, 1e-200])
def test_cka_does_not_depend_on_the_scale(scale):
    data = {k: v * scale for k, v in reps(1).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no false "constant representations" warning
        r = stream(data, (30, 31)).compute()
    close(r, data)
    x, y = data["r0"], data["r1"]
    assert richness.cka(x, y) == pytest.approx(biased_ref(x, y), rel=1e-9)
    assert richness.cka(x, y, debiased=True) == pytest.approx(debiased_ref(x, y), rel=1e-9)


@pytest.mark.parametrize("scale", [1e38, 1e-42, 1e-60])
def test_the_finish_scales_before_squaring(scale, monkeypatch):
    import richness._engine.similarity as sim

    monkeypatch.setattr(sim, "_SAFE_LOG2", 10 ** 6, raising=False)  # a state held at the given scale
    data = {k: v * scale for k, v in reps(15).items()}
    s = stream(data, (45,))
    st = s.state_dict()
    assert (st["scale"] == 1.0).all()
    del st["scale"]  # as a state written before scales were kept
    t = Similarity()
    t.load_state_dict(st)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        close(t.compute(), data)


def test_representations_at_different_scales_in_one_state():
    data = reps(2)
    data = {"r0": data["r0"] * 1e38, "r1": data["r1"] * 1e-42, "r2": data["r2"]}
    close(stream(data, (40,)).compute(), data)


def test_extreme_scales_merge_save_and_load(tmp_path):
    data = {k: v * 1e-90 for k, v in reps(3, offset=700.0).items()}
    # a part whose first batch is one row (scaled by its magnitude) and one scaled by its spread
    a = stream({k: v[:1] for k, v in data.items()}, ())
    a.update({k: v[1:40] for k, v in data.items()})
    b = stream({k: v[40:] for k, v in data.items()}, ())
    assert (a.state_dict()["scale"] != b.state_dict()["scale"]).all()
    b.save(tmp_path / "b.npz")
    a.merge(Similarity.load(tmp_path / "b.npz"))
    close(a.compute(), data)
    t = Similarity()
    t.load_state_dict(a.state_dict())
    close(t.compute(), data)


def test_float32_representation_that_moments_accepts():
    rng = np.random.default_rng(4)
    x = rng.uniform(-5e8, 5e8, size=(200, 100)).astype(np.float32)  # squared row norms near 1e19
    y = (x[:, :6] @ rng.normal(size=(6, 3))).astype(np.float32) + rng.normal(size=(200, 3)).astype(np.float32) * 1e9
    m = richness.Moments()
    m.update(x)  # accepted there
    s = Similarity()
    s.update({"x": x[:120], "y": y[:120]})
    s.update({"x": x[120:], "y": y[120:]})
    r = s.compute()
    assert r.cka[0, 1] == pytest.approx(biased_ref(x, y), rel=1e-5)
    assert r.cka_debiased[0, 1] == pytest.approx(debiased_ref(x, y), rel=1e-4)


def test_too_large_names_the_representation_and_its_magnitude():
    data = reps(5)
    s = stream({k: v[:50] for k, v in data.items()}, ())
    before = s.state_dict()
    big = {k: v[50:] for k, v in data.items()}
    big["r1"] = big["r1"] * 1e200
    with pytest.raises(ValueError, match=r"representation 'r1' is too large.*largest magnitude [0-9.]+e\+200"):
        s.update(big)
    after = s.state_dict()
    assert after["moments"]["n"] == before["moments"]["n"]
    np.testing.assert_array_equal(after["moments"]["M"], before["moments"]["M"])
    s.update({k: v[50:] for k, v in data.items()})
    close(s.compute(), data)


DIST = """
import json, os, sys
import numpy as np
import torch.distributed as dist
sys.path.insert(0, {tests!r})
import richness
from test_similarity_edges import reps
dist.init_process_group("gloo")
rank = dist.get_rank()
data = {{k: v * 1e-90 for k, v in reps(21, n=80, offset=700.0).items()}}
s = richness.Similarity()
s.update({{k: v[:1] for k, v in data.items()}} if rank == 0 else {{k: v[1:30] for k, v in data.items()}})
if rank == 0:
    s.update({{k: v[30:] for k, v in data.items()}})
s.all_reduce()
r = s.compute()
json.dump({{"n": r.n, "cka": r.cka.tolist(), "deb": r.cka_debiased.tolist()}},
          open(f"{out}.{{rank}}", "w"))
dist.destroy_process_group()
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
"""


def test_all_reduce_of_ranks_at_different_scales(tmp_path):
    pytest.importorskip("torch.distributed")
    from conftest import torchrun

    ranks = torchrun(tmp_path, DIST)
    data = {k: v * 1e-90 for k, v in reps(21, n=80, offset=700.0).items()}
    b, d = refs(data)
    for res in ranks:
        assert res["n"] == 80
        np.testing.assert_allclose(res["cka"], b, rtol=1e-9)
        np.testing.assert_allclose(res["deb"], d, rtol=1e-9)


def test_a_later_batch_too_small_for_the_state_names_the_representations():
    data = reps(16)
    s = stream({k: v[:50] for k, v in data.items()}, ())
    n = s.n
    with pytest.raises(ValueError, match=r"representations \['r0', 'r1', 'r2'\] vary by at most [0-9.]+e-2[0-9]{2}"):
        s.update({k: v[50:] * 1e-250 for k, v in data.items()})
    assert s.n == n


# -- names ----------------------------------------------------------------------------------------------------


def test_same_names_in_another_order_are_the_same_batch():
    data = reps(6)
    a = stream(data, (30, 60))
    b = Similarity()
    b.update({k: v[:30] for k, v in data.items()})
    b.update({k: data[k][30:60] for k in ("r2", "r0", "r1")})
    b.update({k: data[k][60:] for k in ("r1", "r2", "r0")})
    assert b.names == ["r0", "r1", "r2"]
    ra, rb = a.compute(), b.compute()
    np.testing.assert_array_equal(rb.cka, ra.cka)
    np.testing.assert_array_equal(rb.cka_debiased, ra.cka_debiased)
    close(rb, data)


def test_dask_refuses_keys_that_are_not_strings():
    da = pytest.importorskip("dask.array")
    import richness.dask as rd

    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(40, 3)), rng.normal(size=(40, 2))
    with pytest.raises(TypeError, match=r"names must be strings, got \[1\]"):
        rd.similarity({1: da.from_array(x, chunks=(20, -1)), "1": da.from_array(y, chunks=(20, -1))})


def test_empty_compute_raises_a_subclass_callers_can_catch():
    from richness._engine.similarity import EmptySimilarityError

    with pytest.raises(EmptySimilarityError, match="no samples"):
        Similarity().compute()
    assert issubclass(EmptySimilarityError, ValueError)


# -- a state's widths are checked against its own columns -------------------------------------------------------


def permuted(widths=(6, 4), seed=8, dtype=np.float64, offset=0.0):
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(80, 3))
    data = {"a": base @ rng.normal(size=(3, widths[0])) + rng.normal(size=(80, widths[0])) + offset,
            "b": base @ rng.normal(size=(3, widths[1])) + 2.0 * rng.normal(size=(80, widths[1])) + offset}
    return {k: v.astype(dtype) for k, v in data.items()}


def test_load_refuses_permuted_widths_and_leaves_the_state():
    data = permuted()
    st = stream(data, (30,)).state_dict()
    st["widths"] = [4, 6]
    other = reps(9)
    t = stream(other, ())
    with pytest.raises(ValueError, match=r"widths \[4, 6\] do not match the state's columns.*'a'"):
        t.load_state_dict(st)
    close(t.compute(), other)  # unchanged


def test_file_with_permuted_widths_refused(tmp_path):
    s = stream(permuted(), (30,))
    s._widths = [4, 6]  # a file whose checksum covers the wrong widths
    s.save(tmp_path / "bad.npz")
    with pytest.raises(ValueError, match=r"bad\.npz.*do not match the state's columns"):
        Similarity.load(tmp_path / "bad.npz")


def test_merge_of_exported_states_refuses_permuted_widths():
    from richness._engine import kinds as _kinds

    data = permuted()
    good = stream({k: v[:40] for k, v in data.items()}).state_dict()
    bad = stream({k: v[40:] for k, v in data.items()}).state_dict()
    good["widths"] = bad["widths"] = [4, 6]
    with pytest.raises(ValueError, match="do not match the state's columns"):
        _kinds.merge_own_dicts("similarity", [good, bad])


@pytest.mark.parametrize("dtype,offset", [(np.float32, 1e4), (np.float32, 0.0), (np.float64, 1e6)])
def test_valid_states_load(dtype, offset):
    data = permuted(dtype=dtype, offset=offset)
    s = stream(data, (1, 2, 50))
    t = Similarity()
    t.load_state_dict(s.state_dict())
    assert t.widths == [6, 4]


# -- the one-shot function streams its rows ---------------------------------------------------------------------


def test_cka_streams_memory_mapped_arrays(tmp_path, monkeypatch):
    import richness._engine.similarity as sim

    monkeypatch.setattr(sim, "_CHUNK_BYTES", 1 << 20, raising=False)
    rng = np.random.default_rng(10)
    n, p, q = 20000, 100, 60
    x = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32, shape=(n, p))
    y = np.lib.format.open_memmap(tmp_path / "y.npy", mode="w+", dtype=np.float32, shape=(n, q))
    w = rng.normal(size=(p, q)).astype(np.float32)
    for a in range(0, n, 5000):
        x[a:a + 5000] = rng.normal(size=(5000, p)) + 3.0
        y[a:a + 5000] = x[a:a + 5000] @ w * 0.1 + rng.normal(size=(5000, q))
    x.flush()
    y.flush()
    del x, y
    x = np.load(tmp_path / "x.npy", mmap_mode="r")
    y = np.load(tmp_path / "y.npy", mmap_mode="r")
    data_bytes = x.nbytes + y.nbytes
    tracemalloc.start()
    try:
        value = richness.cka(x, y)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 0.25 * data_bytes, f"peak {peak / 1e6:.1f} MB for {data_bytes / 1e6:.1f} MB of data"
    assert value == pytest.approx(biased_ref(x, y), rel=1e-5)


def test_cka_chunks_give_the_reference(monkeypatch):
    import richness._engine.similarity as sim

    monkeypatch.setattr(sim, "_CHUNK_BYTES", 800, raising=False)  # a few rows per chunk
    data = reps(11, offset=30.0)
    x, y = data["r0"], data["r2"]
    assert richness.cka(x, y) == pytest.approx(biased_ref(x, y), rel=1e-9)
    assert richness.cka(x, y, debiased=True) == pytest.approx(debiased_ref(x, y), rel=1e-9)
    with pytest.raises(ValueError, match="different row counts"):
        richness.cka(x, y[:-1])


# -- the report: a table, and one model against another ---------------------------------------------------------


def test_report_prints_a_table_with_names_values_and_warnings_once():
    data = reps(12)
    r = stream(data, (40,)).compute()
    text = str(r)
    assert repr(r) == text
    b, d = refs(data)
    for name, w in zip(r.names, r.widths):
        assert f"{name} (width {w})" in text
    assert "n = 90" in text
    assert f"{b[0, 1]:.4f}" in text and f"{d[1, 2]:.4f}" in text
    assert "debiased" in text
    small = {k: v[:3] for k, v in data.items()}
    with pytest.warns(richness.RichnessWarning):
        rs = stream(small, ()).compute()
    assert rs.warnings and str(rs).count("at least 4 samples") == 1


def models_data(seed=13):
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(70, 4))
    names = ["m1.l1", "m1.l2", "m2.l1", "m2.block.0", "m2.l3", "m10.l1"]
    return {nm: base @ rng.normal(size=(4, 3 + i)) + (0.3 + 0.4 * i) * rng.normal(size=(70, 3 + i))
            for i, nm in enumerate(names)}


def test_between_gives_the_block_of_one_model_against_another():
    data = models_data()
    r = stream(data, (20,)).compute()
    blk = r.between("m1", "m2")
    assert blk.rows == ["m1.l1", "m1.l2"] and blk.cols == ["m2.l1", "m2.block.0", "m2.l3"]  # not m10.l1
    want_b = np.array([[biased_ref(data[a], data[c]) for c in blk.cols] for a in blk.rows])
    want_d = np.array([[debiased_ref(data[a], data[c]) for c in blk.cols] for a in blk.rows])
    np.testing.assert_allclose(blk.cka, want_b, rtol=1e-9)
    np.testing.assert_allclose(blk.cka_debiased, want_d, rtol=1e-9)
    assert r.between("m10", "m1.l2").rows == ["m10.l1"] and r.between("m10", "m1.l2").cols == ["m1.l2"]
    assert "m1.l2" in str(blk) and f"{want_b[1, 2]:.4f}" in str(blk)
    with pytest.raises(KeyError, match="'m3'.*models"):
        r.between("m3", "m1")


def _captured(monkeypatch):
    pytest.importorskip("matplotlib")
    import richness.plot as rp

    figs = []
    real = rp._save

    def save(fig, prefix):
        figs.append(fig)
        return real(fig, prefix)

    monkeypatch.setattr(rp, "_save", save)
    return rp, figs


def test_plot_draws_a_block_with_its_models_on_the_axes(tmp_path, monkeypatch):
    rp, figs = _captured(monkeypatch)
    r = stream(models_data(), ()).compute()
    paths = rp.similarity(r.between("m1", "m2"), tmp_path / "block")
    assert all((tmp_path / f"block{e}").exists() for e in (".png", ".svg")) and len(paths) == 2
    ax = figs[0].axes[0]
    assert "m1" in ax.get_ylabel() and "m2" in ax.get_xlabel()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["l1", "l2"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["l1", "block.0", "l3"]
    assert ax.images[0].get_array().shape == (2, 3)


def test_plot_draws_names_with_dollar_signs_as_written(tmp_path, monkeypatch):
    rp, figs = _captured(monkeypatch)
    data = reps(14)
    data = {"m$1.r$\\frac{1}$": data["r0"], "cost $5": data["r1"], "$x_1$": data["r2"]}
    r = stream(data, ()).compute()
    paths = rp.similarity(r, tmp_path / "dollars")
    assert len(paths) == 2 and (tmp_path / "dollars.png").exists()
    blk = r.between("m$1", "$x_1$")
    rp.similarity(blk, tmp_path / "dollar_block")
    assert (tmp_path / "dollar_block.png").exists()
