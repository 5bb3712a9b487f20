"""Heads applied to every position and pooled afterwards (Hugging Face's
*ForSequenceClassification decoders: GPT-2's ``score`` on each token, the logits
taken at the last non-padding token): found without head=, measured at the
positions the model pools, in evaluate, the Monitor and the Trainer callback.
The oracle reads the head's input and output with its own hooks and pools them
by the padding itself, then takes the float64 n x n formulas of reference.py."""

import tempfile
import warnings

import numpy as np
import pytest

import richness
from reference import dlr_naive, nc1_naive

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PAD = 0


def tiny_classifier(dtype=torch.float64):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=12, num_labels=3,
                                  pad_token_id=PAD, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2ForSequenceClassification(cfg).to(dtype)


def padded(n=24, T=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 40, (n, T), generator=g)
    lengths = torch.randint(3, T + 1, (n,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    ids[~mask] = PAD
    return ids, mask.long(), torch.randint(0, 3, (n,), generator=g)


class Oracle:
    """The head's input and output at each sequence's last non-padding token,
    from hooks of its own (every training forward, or every forward)."""

    def __init__(self, model, training_only=False):
        self.rows, self.ids = [], None
        self.training_only = training_only
        self.handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                        model.score.register_forward_hook(self._score)]

    def _pre(self, mod, args, kwargs):
        self.ids = kwargs.get("input_ids", args[0] if args else None)

    def _score(self, mod, args, out):
        if self.training_only and not torch.is_grad_enabled():
            return
        last = ((self.ids != PAD).long() * torch.arange(self.ids.shape[1])).argmax(dim=1)
        rows = torch.arange(self.ids.shape[0])
        self.rows.append((args[0][rows, last].detach().double().numpy(), out[rows, last].detach().double().numpy()))

    def take(self, i, j):
        H = np.concatenate([r[0] for r in self.rows[i:j]])
        F = np.concatenate([r[1] for r in self.rows[i:j]])
        return H, F

    def remove(self):
        for h in self.handles:
            h.remove()


def test_evaluate_finds_the_pooled_head_and_its_positions():
    model = tiny_classifier()
    ids, mask, y = padded()
    batches = [{"input_ids": ids[i:i + 8], "attention_mask": mask[i:i + 8], "labels": y[i:i + 8]}
               for i in range(0, 24, 8)]
    oracle = Oracle(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # finite-n caveat of the tiny data
        rep = richness.evaluate(model, batches, progress=False)
    oracle.remove()
    H, F = oracle.take(-3, None)  # the last pass (the head was found on the first batch, run again)
    assert rep.n == 24
    assert rep.dlr == pytest.approx(dlr_naive(H, F)[0], abs=1e-10)
    assert rep.nc1 == pytest.approx(nc1_naive(H, y.numpy()), rel=1e-8)


@pytest.mark.parametrize("every", [1, 3])
def test_monitor_measures_the_pooled_positions(every):
    model = tiny_classifier()
    model.train()
    ids, mask, y = padded(n=48)
    oracle = Oracle(model, training_only=True)
    recs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with richness.Monitor(model, richness.Window(every), log=recs.append) as mon:
            for i in range(0, 48, 8):
                model(input_ids=ids[i:i + 8], attention_mask=mask[i:i + 8])
                mon.step(labels=y[i:i + 8])
    oracle.remove()
    assert [r["step"] for r in recs] == list(range(every, 7, every))
    for r in recs:
        H, F = oracle.take(r["step"] - every, r["step"])
        labels = y[(r["step"] - every) * 8:r["step"] * 8].numpy()
        assert r["n"] == 8 * every
        assert r["dlr"] == pytest.approx(dlr_naive(H, F)[0], abs=1e-10)
        assert r["nc1"] == pytest.approx(nc1_naive(H, labels), rel=1e-8)


def test_trainer_with_a_sequence_classifier_logs_the_pooled_positions():
    pytest.importorskip("accelerate")
    from richness.transformers import RichnessCallback

    model = tiny_classifier(torch.float32)
    ids, mask, y = padded(n=32)
    train_set = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": y[i]} for i in range(32)]
    oracle = Oracle(model, training_only=True)
    labels_seen = []
    model.register_forward_pre_hook(lambda m, a, kw: labels_seen.append(kw["labels"]) if torch.is_grad_enabled()
                                    else None, with_kwargs=True)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(out, max_steps=4, per_device_train_batch_size=8, report_to="none",
                                              use_cpu=True, save_strategy="no", disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=train_set)
        trainer.add_callback(RichnessCallback(trainer, richness.Window(2)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    oracle.remove()
    logged = [e for e in trainer.state.log_history if "richness/dlr" in e]
    assert [e["step"] for e in logged] == [2, 4]
    for e in logged:
        H, F = oracle.take(e["step"] - 2, e["step"])
        labels = torch.cat(labels_seen[e["step"] - 2:e["step"]]).numpy()
        assert e["richness/n"] == 16
        # float32 activations: fp32 products and their cut (README, Precision)
        assert e["richness/dlr"] == pytest.approx(dlr_naive(H, F, rtol=1e-5)[0], abs=1e-5)
        assert e["richness/nc1"] == pytest.approx(nc1_naive(H, labels, rtol=1e-5), rel=1e-3)
