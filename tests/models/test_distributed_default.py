"""``evaluate(distributed=None)``: one script for one process and for many.

Single process (plain and under an ``Accelerator``) the report is local; under
``torchrun`` with 2 gloo ranks and an ``Accelerator`` preparing the loader, the
default merges the ranks' shards into the report of the whole data set. Both
are checked against the float64 n x n oracle on activations computed here.
(tests/engine/test_distributed.py covers the default under a plain
``torch.distributed`` process group.)
"""

import textwrap

import pytest

torch = pytest.importorskip("torch")

import richness  # noqa: E402
from reference import dlr_naive, nc1_naive  # noqa: E402
from conftest import torchrun  # noqa: E402

N, P, C = 96, 6, 3


def model_and_rows():
    """A small float64 MLP and seeded rows (X, y) for it."""
    g = torch.Generator().manual_seed(11)
    X = torch.randn(N, P, generator=g, dtype=torch.float64) * 2 + 1
    y = torch.randint(0, C, (N,), generator=g)
    torch.manual_seed(12)
    model = torch.nn.Sequential(torch.nn.Linear(P, 8), torch.nn.Tanh(), torch.nn.Linear(8, C)).double()
    return model, X, y


def oracle(model, X, y):
    with torch.no_grad():
        H = model[1](model[0](X)).numpy()
        F = model(X).numpy()
    return dlr_naive(H, F)[0], nc1_naive(H, y.numpy())


def loader(X, y, bs=16):
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=bs)


def test_default_is_local_without_a_process_group():
    model, X, y = model_and_rows()
    assert not torch.distributed.is_initialized()
    rep = richness.evaluate(model, loader(X, y), progress=False)
    dlr, nc1 = oracle(model, X, y)
    assert rep.n == N and abs(rep.dlr - dlr) < 1e-12 and abs(rep.nc1 - nc1) < 1e-9 * nc1
    with pytest.raises(RuntimeError, match=r"evaluate\(distributed=True\) needs an initialised torch.distributed process group"):
        richness.evaluate(model, loader(X, y), progress=False, distributed=True)
    with pytest.raises(TypeError, match="distributed must be True, False or None"):
        richness.evaluate(model, loader(X, y), progress=False, distributed="yes")


def test_single_process_accelerator():
    accelerate = pytest.importorskip("accelerate")
    model, X, y = model_and_rows()
    acc = accelerate.Accelerator(cpu=True)
    prepared_model, prepared = acc.prepare(model, loader(X, y))
    rep = richness.evaluate(prepared_model, prepared, progress=False)
    dlr, nc1 = oracle(model, X, y)
    assert rep.n == N and abs(rep.dlr - dlr) < 1e-12 and abs(rep.nc1 - nc1) < 1e-9 * nc1


SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import accelerate
    import richness
    sys.path.insert(0, {tests!r})
    from test_distributed_default import model_and_rows, loader

    acc = accelerate.Accelerator(cpu=True)   # torchrun's environment: a gloo process group
    torch.set_num_threads(1)
    model, X, y = model_and_rows()
    model, shard = acc.prepare(model, loader(X, y))
    local = richness.evaluate(model, shard, progress=False, distributed=False)
    rep = richness.evaluate(model, shard, progress=False)   # the same call as in one process
    out = {{"world": acc.num_processes, "group": torch.distributed.is_initialized(), "local_n": local.n,
            "n": rep.n, "dlr": rep.dlr, "nc1": rep.nc1}}
    with open({out!r} + f".{{acc.process_index}}", "w") as f:
        json.dump(out, f)
    acc.wait_for_everyone()
    torch.distributed.destroy_process_group()
    # The results are written; skip the interpreter's teardown, where a gloo thread still
    # joinable at exit can abort the process ("terminate called without an active exception")
    # after everything this test checks is done.
    sys.stdout.flush(); sys.stderr.flush()
    import os; os._exit(0)
""")




def test_torchrun_with_accelerate_merges_by_default(tmp_path):
    pytest.importorskip("accelerate")
    ranks = torchrun(tmp_path, SCRIPT)
    model, X, y = model_and_rows()
    dlr, nc1 = oracle(model, X, y)
    for res in ranks:
        assert res["world"] == 2 and res["group"]
        assert res["local_n"] == N // 2  # each rank's shard
        assert res["n"] == N  # merged: the report of the whole data set on every rank
        assert abs(res["dlr"] - dlr) < 1e-12 and abs(res["nc1"] - nc1) < 1e-9 * nc1
