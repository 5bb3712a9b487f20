"""Monitor records sent to Weights & Biases (offline run) and MLflow (local file
store), read back through each tracker's own files or client and checked
against the float64 n x n oracle on the head activations that this test's own
hook captured during training.
"""

import glob
import json
import struct
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import richness  # noqa: E402
from richness.finish import rtol_for  # noqa: E402
from richness.finish.isotropic import isotropic_dlr  # noqa: E402
from reference import center_rows, dlr_naive, nc1_naive  # noqa: E402
from test_monitor import train_with_monitor  # noqa: E402
from tiny_models import make  # noqa: E402

EVERY, WINDOW, STEPS, BS = 2, 2, 4, 40


def isotropic_reference(H, F, rtol):
    """DLR of isotropic features at H's n, its active features (float64 variance above rtol
    times the largest) and the logits' rank at the cut rtol."""
    var = center_rows(H).var(axis=0)
    return isotropic_dlr(H.shape[0], int((var > rtol * var.max()).sum()), dlr_naive(H, F, rtol)[1])


def train(log, iso=None):
    """STEPS SGD steps under a Monitor(model, Window(2, 2)) sending to ``log``; the oracle's
    DLR and NC1 of each window, from the head's input and output grabbed by a hook (and in
    ``iso`` by step, its isotropic reference at the float32 products' cut)."""
    window, want = [], {}

    def check(step, HF, yb, rec, model):
        window.append((HF[0].double().numpy(), HF[1].double().numpy(), yb.numpy()))
        if step % EVERY == 0:
            H, F, labels = (np.concatenate([w[i] for w in window[-WINDOW:]]) for i in range(3))
            want[step] = (dlr_naive(H, F)[0], nc1_naive(H, labels), H.shape[0])
            if iso is not None:
                iso[step] = isotropic_reference(H, F, rtol_for("fp32"))

    *_, mon = train_with_monitor({"route": richness.Window(EVERY, WINDOW), "log": log}, steps=STEPS, bs=BS,
                                 seed=3, record_window=check)
    assert [r["step"] for r in mon.history] == sorted(want)
    return want


def wandb_history(run_dir):
    """The history rows of an offline run, read from its .wandb file (LevelDB-style log
    blocks of W&B's protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(f"{run_dir}/wandb/offline-run-*/run-*.wandb")
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    pos, block, buf, rows = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer
            pos += left
            continue
        _, size, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if size == 0 and kind == 0:
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + size]
        pos += 7 + size
        if kind in (1, 4):  # a full record, or the last piece of one
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({it.key or "/".join(it.nested_key): json.loads(it.value_json)
                             for it in rec.history.item})
    return rows


@pytest.mark.parametrize("how", ["active run", "run object"])
def test_wandb_offline_run_receives_the_records(tmp_path, monkeypatch, how):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run = wandb.init(project="richness-test", dir=str(tmp_path), mode="offline")
    try:
        # the training loop's own values at its own step count must not push ours out of order
        for s in range(10):
            run.log({"loss": 1.0 / (s + 1)})
        iso = {}
        want = train("wandb" if how == "active run" else run, iso)
        summary = dict(run.summary)
    finally:
        run.finish()
        wandb.teardown()  # the service writes the run's file when it stops
    rows = [r for r in wandb_history(tmp_path) if "richness/dlr" in r]
    assert [r["richness/step"] for r in rows] == sorted(want)
    for r in rows:
        dlr, nc1, n = want[r["richness/step"]]
        assert abs(r["richness/dlr"] - dlr) < 1e-5  # float32 products
        assert abs(r["richness/nc1"] - nc1) < 1e-3 * nc1
        assert r["richness/n"] == n
        assert abs(r["richness/dlr_isotropic"] - iso[r["richness/step"]]) < 1e-12
        assert abs(r["richness/dlr_normalized"] - dlr / iso[r["richness/step"]]) < 1e-5 / iso[r["richness/step"]]
    last = want[max(want)]
    assert abs(summary["richness/dlr"] - last[0]) < 1e-5


def test_wandb_without_an_active_run_is_a_clear_error():
    wandb = pytest.importorskip("wandb")
    assert wandb.run is None
    model, _, _ = make()
    with pytest.raises(ValueError, match=r"needs an active W&B run: call wandb.init"):
        richness.Monitor(model, log="wandb")


def test_mlflow_file_store_receives_the_records(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3.x keeps the file store opt-in
    uri = f"file:{tmp_path / 'mlruns'}"
    mlflow.set_tracking_uri(uri)
    try:
        mlflow.set_experiment("richness-test")
        iso = {}
        with mlflow.start_run() as run:
            want = train(["mlflow", str(tmp_path / "log.jsonl")], iso)
        client = MlflowClient(tracking_uri=uri)
        dlr = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "richness/dlr")}
        ref = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "richness/dlr_isotropic")}
        rel = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "richness/dlr_normalized")}
        nc1 = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "richness/nc1")}
        n = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "richness/n")}
    finally:
        mlflow.set_tracking_uri(None)
    assert sorted(dlr) == sorted(want)
    for step, (d, c, size) in want.items():
        assert abs(dlr[step] - d) < 1e-5  # float32 products
        assert abs(nc1[step] - c) < 1e-3 * c
        assert n[step] == size
        assert abs(ref[step] - iso[step]) < 1e-12 and abs(rel[step] - d / iso[step]) < 1e-5 / iso[step]
    # the other sink of the list got the same records
    with open(tmp_path / "log.jsonl") as f:
        logged = [json.loads(line) for line in f]
    assert [r["dlr"] for r in logged] == [dlr[r["step"]] for r in logged]


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_missing_tracker_names_its_extra(monkeypatch, tracker):
    monkeypatch.setitem(sys.modules, tracker, None)  # import fails as if not installed
    model, _, _ = make()
    with pytest.raises(ImportError, match=rf'pip install "richness\[{tracker}\]"'):
        richness.Monitor(model, log=tracker)
