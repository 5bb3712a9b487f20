"""torch.distributed: 2 gloo processes on the CPU against one process.

One spawn runs every check (Moments.all_reduce in float64 and float32, a rank
with no samples (with and without groups), ranks with different label ranges, a
rank holding an invalid state, evaluate(distributed=True)
with a DistributedSampler, and the torchmetrics DLR under DDP sync); rank 0
writes what it measured to a JSON file the test then compares.
"""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import richness  # noqa: E402
from reference import dlr_naive, nc1_naive  # noqa: E402
from conftest import free_port  # noqa: E402

N, P, C = 600, 12, 4


def _data(dtype=np.float64):
    rng = np.random.default_rng(7)
    X = rng.normal(size=(N, P)) @ rng.normal(size=(P, P)) + 5.0
    W = rng.normal(size=(C, P))
    F = X @ W.T + 0.3 * rng.normal(size=(N, C))
    y = rng.integers(0, 5, N)
    return X.astype(dtype), F.astype(dtype), y, W


def _model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(P, 16), torch.nn.Tanh(), torch.nn.Linear(16, C)).double()


def _worker(rank, world, port, out_path):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = {}
        X, F, y, W = _data()
        shard = np.array_split(np.arange(N), world)[rank]
        # float64, uneven batches per rank; rank 1 sees classes 0..4, rank 0 only 0..2
        ys = y.copy()
        ys[: N // 2] %= 3
        m = richness.Moments()
        for idx in np.array_split(shard, 3 + rank):
            m.update(X[idx], F[idx], labels=ys[idx])
        m.all_reduce()
        st = m.state_dict()
        res["f64"] = {"dlr": m.compute().dlr, "nc1": m.compute().nc1, "n": st["n"], "k": st["k"],
                      "M": st["M"].tolist(), "mean": st["mean"].tolist(), "B": st["B"].tolist()}
        # float32 inputs
        m32 = richness.Moments()
        m32.update(X[shard].astype(np.float32), F[shard].astype(np.float32))
        m32.all_reduce()
        res["f32"] = m32.compute().dlr
        # a rank with no samples
        me = richness.Moments()
        if rank == 1:
            me.update(X, F)
        me.all_reduce()
        res["empty_rank"] = {"n": me.n, "dlr": me.compute().dlr}
        # mismatched widths raise on every rank
        bad = richness.Moments()
        bad.update(X[:, : P - rank], F)
        try:
            bad.all_reduce()
            res["mismatch"] = "no error"
        except ValueError as e:
            res["mismatch"] = str(e)
        res["mismatch_n"] = bad.n  # the state is left as it was
        # different num_classes: every rank raises before any data moves
        nc = richness.Moments(num_classes=5 + rank)
        nc.update(X[shard], F[shard], labels=y[shard])
        try:
            nc.all_reduce()
            res["num_classes"] = "no error"
        except ValueError as e:
            res["num_classes"] = str(e)
        res["num_classes_n"] = nc.n
        # groups survive the reduction: group i of each rank merged with group i of the others (the groups'
        # sizes have no public view)
        g = richness.Moments(groups=3)
        for idx in np.array_split(shard, 6):
            g.update(X[idx], F[idx])
        g.all_reduce()
        rep = g.compute(uncertainty=True)
        res["groups"] = {"n": g.n, "sizes": [s["n"] for s in g._backend.group_states()], "dlr": rep.dlr,
                         "stderr": rep.dlr_stderr}
        # groups with a rank that saw no data: it merges as k empty groups
        ge = richness.Moments(groups=3)
        if rank == 1:
            for idx in np.array_split(np.arange(N), 6):
                ge.update(X[idx], F[idx])
        ge.all_reduce()
        res["groups_empty_rank"] = {"n": ge.n, "sizes": [s["n"] for s in ge._backend.group_states()],
                                    "dlr": ge.compute(uncertainty=True).dlr}
        # a rank holding an impossible state (a negative variance): every rank refuses
        from richness._engine.distributed import all_reduce_states

        good = richness.Moments()
        good.update(X[shard], F[shard])
        st = good.state_dict()
        if rank == 1:
            st["M"] = st["M"] - 2 * np.diag(np.diag(st["M"]))
        try:
            all_reduce_states([st])
            res["invalid"] = "no error"
        except ValueError as e:
            res["invalid"] = str(e)
        # evaluate(distributed=True) with a DistributedSampler
        model = _model()
        ds = torch.utils.data.TensorDataset(torch.tensor(X), torch.tensor(y))
        sampler = torch.utils.data.distributed.DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False)
        loader = torch.utils.data.DataLoader(ds, batch_size=64, sampler=sampler)
        rep = richness.evaluate(model, loader, progress=False, distributed=True)
        res["evaluate"] = {"dlr": rep.dlr, "n": rep.n, "nc1": rep.nc1}
        rep = richness.evaluate(model, loader, progress=False)  # the default: merged inside a process group
        res["evaluate_default"] = {"dlr": rep.dlr, "n": rep.n, "nc1": rep.nc1}
        # Monitor(distributed=True): each rank's window merged at emission
        torch.manual_seed(5)
        net = _model()
        xs = torch.tensor(X[:256]).reshape(4, 2, 32, P)[:, rank]  # step s: rank r takes rows of block (s, r)
        with richness.Monitor(net, richness.Window(2, 2, distributed=True)) as mon:
            for s in range(4):
                net(xs[s])
                mon.step(labels=torch.tensor(y[:256]).reshape(4, 2, 32)[s, rank])
        res["monitor"] = mon.history
        # torchmetrics under DDP: compute() gathers the ranks' states and merges them
        try:
            from richness.torchmetrics import DLR

            metric = DLR()
            for idx in np.array_split(shard, 2):
                metric.update(torch.tensor(F[idx]), features=torch.tensor(X[idx]))
            res["torchmetrics"] = float(metric.compute())
            res["torchmetrics_local_n"] = metric.report().n  # unsynced again after compute
        except ImportError:
            res["torchmetrics"] = None
        with open(out_path.replace(".json", f".{rank}.json"), "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()




@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "rank.json"
    mp.spawn(_worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    ranks = []
    for r in range(2):
        with open(str(out).replace(".json", f".{r}.json")) as f:
            ranks.append(json.load(f))
    ranks[0]["ranks"] = ranks
    return ranks[0]


def test_all_reduce_float64_matches_single_process(dist_results):
    X, F, y, _ = _data()
    ys = y.copy()
    ys[: N // 2] %= 3
    single = richness.Moments()
    single.update(X, F, labels=ys)
    st = single.state_dict()
    got = dist_results["f64"]
    assert got["n"] == N and got["k"] == 5
    np.testing.assert_allclose(np.array(got["M"]), st["M"], rtol=1e-10, atol=1e-10 * np.abs(st["M"]).max())
    np.testing.assert_allclose(np.array(got["B"]), st["B"], rtol=1e-10, atol=1e-10 * np.abs(st["B"]).max())
    np.testing.assert_allclose(np.array(got["mean"]), X.mean(0), rtol=1e-12)
    want, _ = dlr_naive(X, F)
    assert abs(got["dlr"] - want) < 1e-10
    assert abs(got["nc1"] - nc1_naive(X, ys)) < 1e-8 * max(1.0, nc1_naive(X, ys))


def test_all_reduce_float32_and_empty_rank(dist_results):
    X, F, _, _ = _data()
    want, _ = dlr_naive(X, F)
    assert abs(dist_results["f32"] - want) < 1e-6
    assert dist_results["empty_rank"]["n"] == N
    assert abs(dist_results["empty_rank"]["dlr"] - want) < 1e-12


def test_all_reduce_mismatch_is_a_clear_error_on_every_rank(dist_results):
    for r, res in enumerate(dist_results["ranks"]):
        assert "feature widths" in res["mismatch"]
        assert res["mismatch_n"] == N
        assert "num_classes" in res["num_classes"] and "[5, 6]" in res["num_classes"]
        assert res["num_classes_n"] == len(np.array_split(np.arange(N), 2)[r])


def test_all_reduce_keeps_groups(dist_results):
    X, F, _, _ = _data()
    want, _ = dlr_naive(X, F)
    for res in dist_results["ranks"]:
        g = res["groups"]
        assert g["n"] == N and sum(g["sizes"]) == N and min(g["sizes"]) > 0
        assert abs(g["dlr"] - want) < 1e-10
        assert g["stderr"] is not None and g["stderr"] > 0
    # the same reduction on every rank
    assert dist_results["ranks"][0]["groups"] == dist_results["ranks"][1]["groups"]


def test_all_reduce_groups_with_an_empty_rank(dist_results):
    X, F, _, _ = _data()
    want, _ = dlr_naive(X, F)
    for res in dist_results["ranks"]:
        g = res["groups_empty_rank"]
        assert g["n"] == N and g["sizes"] == [200, 200, 200]  # rank 1's six updates, two a group
        assert abs(g["dlr"] - want) < 1e-10


def test_all_reduce_refuses_an_invalid_state_on_every_rank(dist_results):
    for r, res in enumerate(dist_results["ranks"]):
        assert "rank(s) [1] hold an invalid state" in res["invalid"]
        assert ("negative variance" in res["invalid"]) == (r == 1)  # the holder says what is wrong


def test_evaluate_distributed_sampler(dist_results):
    X, _, y, _ = _data()
    model = _model()
    with torch.no_grad():
        H = model[1](model[0](torch.tensor(X))).numpy()
        Fm = model(torch.tensor(X)).numpy()
    want, _ = dlr_naive(H, Fm)
    for got in (dist_results["evaluate"], dist_results["evaluate_default"]):
        assert got["n"] == N
        assert abs(got["dlr"] - want) < 1e-10
        assert abs(got["nc1"] - nc1_naive(H, y)) < 1e-8 * max(1.0, nc1_naive(H, y))


def test_monitor_distributed_window(dist_results):
    X, _, y, _ = _data()
    torch.manual_seed(5)
    net = _model()
    recs = dist_results["monitor"]
    assert [r["step"] for r in recs] == [2, 4]
    for r, rows in zip(recs, (slice(0, 128), slice(128, 256))):
        with torch.no_grad():
            H = net[1](net[0](torch.tensor(X[rows]))).numpy()
            Fm = net(torch.tensor(X[rows])).numpy()
        assert r["n"] == 128
        assert abs(r["dlr"] - dlr_naive(H, Fm)[0]) < 1e-10
        assert abs(r["nc1"] - nc1_naive(H, y[rows])) < 1e-8 * r["nc1"]


def test_torchmetrics_ddp_sync_is_exact(dist_results):
    if dist_results["torchmetrics"] is None:
        pytest.skip("torchmetrics not installed")
    X, F, _, _ = _data()
    want, _ = dlr_naive(X, F)
    assert abs(dist_results["torchmetrics"] - want) < 1e-10
    assert dist_results["torchmetrics_local_n"] == N // 2
