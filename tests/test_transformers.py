"""Hugging Face models built from tiny configs in code (no downloads): BERT, GPT-2,
ViT and ResNet measured by ``richness.evaluate`` and, in ``Trainer.train()`` runs,
by ``richness.transformers.RichnessCallback``. Every number is checked against the
float64 n x n oracles of tests/reference.py on head activations captured by this
test's own forward hooks.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import richness  # noqa: E402
from reference import dlr_naive, nc1_naive  # noqa: E402

VOCAB, T, HID = 40, 8, 16


def token_batches(n=48, bs=16, seed=0, pad=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, T), generator=g)
    lengths = torch.randint(4, T + 1, (n,), generator=g) if pad else torch.full((n,), T)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return ids, mask, g


def bert():
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HID, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=T, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg)
    ids, mask, g = token_batches()
    y = torch.randint(0, 3, (ids.shape[0],), generator=g)
    return model, model.classifier, [{"input_ids": ids[i:i + 16], "attention_mask": mask[i:i + 16],
                                      "labels": y[i:i + 16]} for i in range(0, ids.shape[0], 16)]


def vit():
    cfg = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=HID, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=32, num_labels=3)
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(cfg)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(48, 3, 8, 8, generator=g), torch.randint(0, 3, (48,), generator=g)
    return model, model.classifier, [{"pixel_values": x[i:i + 16], "labels": y[i:i + 16]} for i in range(0, 48, 16)]


def resnet():
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, HID], depths=[1, 1],
                                    layer_type="basic", num_labels=3)
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(cfg)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(48, 3, 16, 16, generator=g), torch.randint(0, 3, (48,), generator=g)
    head = [m for m in model.classifier.modules() if isinstance(m, torch.nn.Linear)][0]
    return model, head, [{"pixel_values": x[i:i + 16], "labels": y[i:i + 16]} for i in range(0, 48, 16)]


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=HID, n_layer=1, n_head=2, n_positions=T,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids, mask, _ = token_batches(n=32)
    labels = ids.masked_fill(mask == 0, -100)  # HF's collators: padding labelled -100
    return model, model.lm_head, [{"input_ids": ids[i:i + 16], "attention_mask": mask[i:i + 16],
                                   "labels": labels[i:i + 16]} for i in range(0, 32, 16)]


def grab(model, head, batches):
    """The head's input and output on every batch, by this test's own hook (eval mode, no grad)."""
    seen = []
    h = head.register_forward_hook(lambda m, a, o: seen.append((a[0].double().numpy().copy(),
                                                                o.double().numpy().copy())))
    model.eval()
    with torch.no_grad():
        for b in batches:
            model(**{k: v for k, v in b.items() if k != "labels"})
    h.remove()
    return seen


def next_token_rows(H, F, batch):
    """Causal-LM rows: positions 0..T-2 labelled with the next token, without -100 or padding."""
    lab, mask = batch["labels"].numpy(), batch["attention_mask"].numpy().astype(bool)
    keep = (lab[:, 1:] >= 0) & mask[:, :-1] & mask[:, 1:]
    return H[:, :-1][keep], F[:, :-1][keep], lab[:, 1:][keep]


def as_double(model, batches):
    model.double()  # float64 end to end: the oracle's outputs carry no float32 rounding
    return [{k: (v.double() if v.is_floating_point() else v) for k, v in b.items()} for b in batches]


@pytest.mark.parametrize("build", [bert, vit, resnet])
def test_evaluate_classifiers_match_the_oracle(build):
    model, head, batches = build()
    batches = as_double(model, batches)
    seen = grab(model, head, batches)
    H = np.concatenate([s[0] for s in seen])
    F = np.concatenate([s[1] for s in seen])
    y = np.concatenate([b["labels"].numpy() for b in batches])
    assert H.ndim == 2 and H.shape[1] == HID
    rep = richness.evaluate(model, batches, progress=False, precision="fp64")
    want, rank = dlr_naive(H, F)
    assert rep.n == H.shape[0] and rep.rank == rank
    assert abs(rep.dlr - want) < 1e-9
    assert abs(rep.nc1 - nc1_naive(H, y)) < 1e-7 * nc1_naive(H, y)


def test_evaluate_causal_lm_shifts_labels_and_warns_when_not_asked():
    model, head, batches = gpt2()
    batches = as_double(model, batches)
    seen = grab(model, head, batches)
    rows = [next_token_rows(H, F, b) for (H, F), b in zip(seen, batches)]
    H, F, y = (np.concatenate([r[i] for r in rows]) for i in range(3))
    rep = richness.evaluate(model, batches, progress=False, precision="fp64", shift_labels=True)
    want, rank = dlr_naive(H, F)
    assert rep.n == H.shape[0] and rep.rank == rank
    assert abs(rep.dlr - want) < 1e-9
    assert abs(rep.nc1 - nc1_naive(H, y)) < 1e-7 * nc1_naive(H, y)
    # HF's convention (labels = input_ids) used unshifted: a warning naming the fix
    plain = [{**b, "labels": b["input_ids"]} for b in batches]
    with pytest.warns(UserWarning, match="labels equal the input_ids.*shift_labels=True"):
        richness.evaluate(model, plain, progress=False, tokens="last")


class LogSpy(transformers.TrainerCallback):
    """Stands where report_to integrations stand: before user callbacks in the Trainer's list."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append((state.global_step, dict(logs)))


def train(tmp_path, model, head, rows, steps, bs, accumulate, **callback_options):
    """``Trainer.train()`` for ``steps`` optimizer steps with a RichnessCallback; returns the
    trainer, the spy's logs and, per training forward, this test's captured head input/output
    and the forward's keyword arguments."""
    from richness.transformers import RichnessCallback

    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=bs,
                                          gradient_accumulation_steps=accumulate, max_steps=steps,
                                          learning_rate=0.05, report_to="none", use_cpu=True, save_strategy="no",
                                          logging_steps=1000, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    spy = LogSpy()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[spy])
    cb = RichnessCallback(trainer, **callback_options)
    trainer.add_callback(cb)
    forwards = []
    h1 = model.register_forward_pre_hook(
        lambda m, a, kw: forwards.append({"kw": kw}) if torch.is_grad_enabled() else None, with_kwargs=True)
    h2 = head.register_forward_hook(
        lambda m, a, o: forwards[-1].update(H=a[0].detach().double().numpy().copy(),
                                            F=o.detach().double().numpy().copy()) if torch.is_grad_enabled() else None)
    trainer.train()
    h1.remove()
    h2.remove()
    return trainer, spy, forwards, cb


def logged(entries):
    return {step: logs for step, logs in entries if "richness/dlr" in logs}


def test_trainer_logs_bert_dlr_and_nc1_through_its_own_logging(tmp_path):
    model, head, batches = bert()
    rows = [{k: v[i] for k, v in b.items()} for b in batches for i in range(v_len(b))]
    every = window = 2
    trainer, spy, forwards, cb = train(tmp_path, model, head, rows, steps=4, bs=6, accumulate=2,
                                       route=richness.Window(every, window))
    assert len(forwards) == 8  # 4 steps of 2 micro-batches
    got = logged(spy.logs)
    assert sorted(got) == [2, 4]  # the Trainer's global_step after the record's optimizer step
    history = {e["step"]: e for e in trainer.state.log_history if "richness/dlr" in e}
    assert sorted(history) == [2, 4]
    for step in (2, 4):
        window_forwards = forwards[(step - window) * 2:step * 2]
        H = np.concatenate([f["H"] for f in window_forwards])
        F = np.concatenate([f["F"] for f in window_forwards])
        y = np.concatenate([f["kw"]["labels"].numpy() for f in window_forwards])
        want, rank = dlr_naive(H, F)
        for logs in (got[step], history[step]):
            assert logs["richness/n"] == H.shape[0] == 24
            assert logs["richness/rank"] == rank
            assert abs(logs["richness/dlr"] - want) < 1e-5  # fp32 products
            assert abs(logs["richness/nc1"] - nc1_naive(H, y)) < 1e-3 * nc1_naive(H, y)
    assert [r["step"] for r in cb.monitor.history] == [2, 4]


def v_len(batch):
    return next(iter(batch.values())).shape[0]


def test_trainer_causal_lm_labels_are_shifted(tmp_path):
    model, head, batches = gpt2()
    rows = [{k: v[i] for k, v in b.items()} for b in batches for i in range(v_len(b))]
    # fp64 products: float32 products would cut a small logit eigenvalue (rtol 1e-5)
    # two micro-batches a step, padded differently: each forward's positions follow its own mask
    trainer, spy, forwards, cb = train(tmp_path, model, head, rows, steps=2, bs=4, accumulate=2,
                                       route=richness.Window(2, 2), precision="fp64")
    assert len(forwards) == 4
    assert cb._shift  # GPT2LMHeadModel is one of the Trainer's causal LMs
    got = logged(spy.logs)
    assert sorted(got) == [2]
    parts = [next_token_rows(f["H"], f["F"], {k: v for k, v in f["kw"].items()}) for f in forwards]
    H = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[2] for p in parts])
    # vocabulary > features: the record uses the head's weights at emission (after the last step)
    W = model.lm_head.weight.detach().double().numpy()
    want, rank = dlr_naive(H, H @ W.T)
    assert got[2]["richness/n"] == H.shape[0] and got[2]["richness/rank"] == rank
    assert abs(got[2]["richness/dlr"] - want) < 1e-9
    assert abs(got[2]["richness/nc1"] - nc1_naive(H, y)) < 1e-7 * nc1_naive(H, y)


def test_trainer_callback_warns_when_told_not_to_shift_labels_that_equal_the_inputs(tmp_path):
    model, head, batches = gpt2()
    rows = [{"input_ids": b["input_ids"][i], "attention_mask": b["attention_mask"][i], "labels": b["input_ids"][i]}
            for b in batches for i in range(v_len(b))]
    with pytest.warns(UserWarning, match=r"labels equal the input_ids.*RichnessCallback\(shift_labels=True\)"):
        train(tmp_path, model, head, rows, steps=1, bs=8, accumulate=1, route=richness.EveryStep(),
              shift_labels=False)


def test_callback_needs_the_trainer():
    from richness.transformers import RichnessCallback

    with pytest.raises(TypeError, match="transformers.Trainer the callback is added to"):
        RichnessCallback(torch.nn.Linear(2, 2), richness.Window(10))  # the model given for the trainer
