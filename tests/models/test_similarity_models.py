"""richness.similarity over two small torch models against the test's own hooks and the n x n oracles."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import richness  # noqa: E402
from reference import cka_debiased_naive, cka_naive  # noqa: E402


def models():
    torch.manual_seed(0)
    cnn = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(6, 5, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(5 * 8 * 8, 4))
    mlp = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, 7))
    return {"cnn": cnn, "mlp": mlp}


def loader(n=90, bs=17):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64) + 3.0
    y = torch.zeros(n, dtype=torch.long)
    return [(X[i:i + bs], y[i:i + bs]) for i in range(0, n, bs)]


def own_hooks(ms, layers, batches, pool):
    """Every layer's whole output over the data, collected by hooks of the test itself."""
    out = {}
    handles = []
    for mname, m in ms.items():
        for ln in layers[mname]:
            def fn(_m, _a, o, key=f"{mname}.{ln}"):
                o = o.detach()
                o = o.flatten(2).mean(2) if (o.ndim == 4 and pool == "mean") else o.reshape(o.shape[0], -1)
                out.setdefault(key, []).append(o.double().numpy())
            handles.append(m.get_submodule(ln).register_forward_hook(fn))
    with torch.no_grad():
        for x, _ in batches:
            for m in ms.values():
                m(x.to(next(m.parameters()).dtype))
    for h in handles:
        h.remove()
    return {k: np.concatenate(v) for k, v in out.items()}


@pytest.mark.parametrize("pool", ["mean", "flatten"])
def test_two_models_match_oracle(pool):
    ms = {k: v.double() for k, v in models().items()}
    layers = {"cnn": ["1", "3", "5"], "mlp": ["1", "3"]}
    batches = loader()
    rep = richness.similarity(ms, batches, layers, pool=pool, progress=False)
    acts = own_hooks(ms, layers, batches, pool)
    assert rep.names == ["cnn.1", "cnn.3", "cnn.5", "mlp.1", "mlp.3"] and rep.n == 90
    assert rep.widths == [acts[k].shape[1] for k in rep.names]
    for i, a in enumerate(rep.names):
        for j, b in enumerate(rep.names):
            assert rep.cka[i, j] == pytest.approx(cka_naive(acts[a], acts[b]), rel=1e-9, abs=1e-12)
            assert rep.cka_debiased[i, j] == pytest.approx(cka_debiased_naive(acts[a], acts[b]), rel=1e-8,
                                                           abs=1e-10)
    for m in ms.values():  # every hook is gone
        assert all(not mod._forward_hooks for mod in m.modules())


def test_float32_models_and_per_model_inputs():
    ms = models()
    batches = loader()
    # the MLP sees the images upside down: its own input function
    flip = lambda b: b[0].flip(2).float()  # noqa: E731
    rep = richness.similarity(ms, batches, {"cnn": ["3"], "mlp": ["1"]}, inputs={"cnn": lambda b: b[0].float(),
                                                                                "mlp": flip}, progress=False)
    acts = own_hooks({"cnn": ms["cnn"]}, {"cnn": ["3"]}, [(x.float(), y) for x, y in batches], "flatten")
    acts |= own_hooks({"mlp": ms["mlp"]}, {"mlp": ["1"]}, [(x.flip(2).float(), y) for x, y in batches], "flatten")
    a, b = acts["cnn.3"], acts["mlp.1"]
    assert rep.pair("cnn.3", "mlp.1").cka == pytest.approx(cka_naive(a, b), abs=2e-6)
    assert rep.pair("cnn.3", "mlp.1").cka_debiased == pytest.approx(cka_debiased_naive(a, b), abs=2e-6)


def test_single_module_and_refusals():
    ms = {k: v.double() for k, v in models().items()}
    cnn = ms["cnn"]
    rep = richness.similarity(cnn, loader(), ["1", "5"], progress=False)
    assert rep.names == ["model.1", "model.5"]
    with pytest.raises(ValueError, match="no submodule 'nope'.*'1'"):
        richness.similarity(cnn, loader(), ["nope"], progress=False)
    with pytest.raises(ValueError, match="pool='flatten'.*GiB"):
        big = torch.nn.Sequential(torch.nn.Identity())
        richness.similarity(big, [torch.zeros(2, 3, 200, 200)], ["0"], pool="flatten", progress=False)
    assert all(not mod._forward_hooks for mod in big.modules())
    with pytest.raises(ValueError, match="first"):
        richness.similarity(cnn, loader(), ["1"], pool="first", progress=False)
    assert all(not mod._forward_hooks for mod in cnn.modules())
    with pytest.raises(ValueError, match="missing"):
        richness.similarity(ms, loader(), {"cnn": ["1"]}, progress=False)


DIST = """
import json, os, sys
sys.path.insert(0, {tests!r})
import numpy as np, torch.distributed as dist
import richness
from test_similarity import reps
dist.init_process_group("gloo")
rank = dist.get_rank()
data = reps(21, n=80, offset=500.0)
s = richness.Similarity()
rows = slice(0, 13) if rank == 0 else slice(13, 80)
s.update({{k: v[rows] for k, v in data.items()}})
s.all_reduce()
r = s.compute()
t = richness.Similarity()
t.update({{("r0" if rank == 0 else "other"): data["r0"][:5]}})
try:
    t.all_reduce()
    err = None
except ValueError as e:
    err = str(e)
json.dump({{"n": r.n, "cka": r.cka.tolist(), "deb": r.cka_debiased.tolist(), "err": err, "t_n": t.n}},
          open(f"{out}.{{rank}}", "w"))
dist.destroy_process_group()
# the results are written: skip the interpreter's teardown, where a gloo thread still joinable at
# exit can abort the process ("terminate called without an active exception")
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
"""


def test_all_reduce_two_ranks(tmp_path):
    from conftest import torchrun
    from test_similarity import oracle, reps

    ranks = torchrun(tmp_path, DIST)
    b, d = oracle(reps(21, n=80, offset=500.0))
    for res in ranks:
        assert res["n"] == 80
        np.testing.assert_allclose(res["cka"], b, rtol=1e-9)
        np.testing.assert_allclose(res["deb"], d, rtol=1e-9)
        assert "different representations" in res["err"] and res["t_n"] == 5


def test_plot_similarity(tmp_path):
    pytest.importorskip("matplotlib")
    import richness.plot

    ms = {k: v.double() for k, v in models().items()}
    rep = richness.similarity(ms, loader(), {"cnn": ["1", "3"], "mlp": ["1"]}, progress=False)
    paths = richness.plot.similarity(rep, tmp_path / "heat", measure="cka_debiased")
    assert all(os.path.getsize(p) > 1000 for p in paths)
    with open(paths[1]) as f:
        svg = f.read()
    assert "debiased" in svg and "cnn" in svg and "mlp" in svg
    assert f"{rep.cka_debiased[0, 2]:.2f}" in svg
    with pytest.raises(TypeError, match="SimilarityReport"):
        richness.plot.similarity({"cka": 1}, tmp_path / "x")
