"""richness.evaluate on the CPU with tiny models: DLR, curves and NC1 of one
pass over a loader, head finding, batch formats, token selection, and the
model left as it was found (hooks removed, train/eval modes restored).

Every number is checked against an independent computation: tests/reference.py's
n x n oracles on activations computed here by plain forward calls, or a
Moments fed those activations directly.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import richness  # noqa: E402
from reference import dlr_naive, nc1_naive  # noqa: E402
from tiny_models import MLP, acts, hook_count, lm_feats, lm_setup, loader, make  # noqa: E402


def test_evaluate_matches_oracle_and_direct_moments():
    model, X, y = make()
    model.train()  # evaluate must switch to eval (dropout off) and back
    rep = richness.evaluate(model, loader(X, y), progress=False)
    assert model.training and model.drop.training
    H, F = acts(model, X)
    want, r = dlr_naive(H, F)
    assert rep.n == 240 and rep.rank == r == 4
    assert abs(rep.dlr - want) < 1e-12
    assert abs(rep.nc1 - nc1_naive(H, y.numpy())) < 1e-9 * nc1_naive(H, y.numpy())
    m = richness.Moments()
    m.update(H, F, labels=y.numpy())
    direct = m.compute()
    np.testing.assert_allclose(rep.eigenvalues, direct.eigenvalues, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(rep.utilization, direct.utilization, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(rep.quality, direct.quality, rtol=1e-9, atol=1e-12)
    assert hook_count(model) == 0


def test_evaluate_held_out_and_head_by_name_and_module():
    model, X, y = make(n=300)
    Xt, yt = X[200:], y[200:]
    X, y = X[:200], y[:200]
    a = richness.evaluate(model, loader(X, y), test_loader=loader(Xt, yt), head="fc", progress=False)
    b = richness.evaluate(model, loader(X, y), test_loader=loader(Xt, yt), head=model.fc, progress=False)
    H, F = acts(model, X)
    Ht, Ft = acts(model, Xt)
    m, t = richness.Moments(), richness.Moments()
    m.update(H, F, labels=y.numpy())
    t.update(Ht, Ft, labels=yt.numpy())
    ref = m.compute(test=t)
    for rep in (a, b):
        assert abs(rep.dlr - ref.dlr) < 1e-12
        np.testing.assert_allclose(rep.test_utilization, ref.test_utilization, rtol=1e-9)
        np.testing.assert_allclose(rep.test_quality, ref.test_quality, rtol=1e-9)
        np.testing.assert_allclose(rep.test_eigenfunction_norms, ref.test_eigenfunction_norms, rtol=1e-9)


class ScaledHead(nn.Module):
    """A non-linear read-out: outputs are streamed, not derived from weights."""

    def __init__(self, h, c):
        super().__init__()
        self.lin = nn.Linear(h, c)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def test_evaluate_non_linear_head_streams_outputs():
    model, X, y = make()
    model.fc = ScaledHead(16, 4).double()
    rep = richness.evaluate(model, loader(X), head="fc", progress=False, precision="fp64")
    model.eval()
    with torch.no_grad():
        H = model.body(X).numpy()
        F = model(X).numpy()
    want, _ = dlr_naive(H, F)
    assert abs(rep.dlr - want) < 1e-12
    assert rep.nc1 is None


def test_float_labels_are_targets():
    model, X, _ = make()
    t = torch.randn(240, 2, dtype=torch.float64)
    rep = richness.evaluate(model, loader(X, t), progress=False)
    H, F = acts(model, X)
    m = richness.Moments()
    m.update(H, F, targets=t.numpy())
    np.testing.assert_allclose(rep.quality, m.compute().quality, rtol=1e-9)


def test_head_not_found_lists_candidates():
    class PostProcessed(MLP):
        def forward(self, x):
            return torch.log_softmax(super().forward(x), dim=1)

    model = PostProcessed().double()
    X = torch.randn(40, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"'fc' \(Linear 16 -> 4\)"):
        richness.evaluate(model, loader(X), progress=False)
    assert hook_count(model) == 0
    with pytest.raises(ValueError, match="no submodule named 'nope'.*'fc'"):
        richness.evaluate(model, loader(X), head="nope", progress=False)
    with pytest.raises(TypeError, match="submodule or its dotted name"):
        richness.evaluate(model, loader(X), head=np.zeros((4, 16)), progress=False)
    # with the head named, the post-processed model works
    rep = richness.evaluate(model, loader(X), head="fc", progress=False)
    H, _ = acts(model, X)
    with torch.no_grad():
        F = model.fc(torch.tensor(H)).numpy()
    assert abs(rep.dlr - dlr_naive(H, F)[0]) < 1e-12


def test_hooks_removed_and_modes_restored_after_exception():
    model, X, y = make()
    model.train()
    model.body.eval()  # a mixed mode must come back exactly

    def bad_loader():
        yield X[:32], y[:32]
        yield X[32:64], y[32:64]
        raise RuntimeError("disk on fire")

    for head in (None, "fc"):
        with pytest.raises(RuntimeError, match="disk on fire"):
            richness.evaluate(model, bad_loader(), head=head, progress=False)
        assert hook_count(model) == 0
        assert model.training and model.fc.training and not model.body.training
    # a failing forward also cleans up
    with pytest.raises(RuntimeError):
        richness.evaluate(model, loader(torch.randn(10, 3, dtype=torch.float64)), progress=False)
    assert hook_count(model) == 0


def test_progress_bar_reports_samples(capsys):
    pytest.importorskip("tqdm")
    model, X, y = make()
    richness.evaluate(model, loader(X, y), progress=True)
    err = capsys.readouterr().err
    assert "sample/s" in err


def test_dict_batches_and_batch_fn():
    model, X, y = make()

    class KW(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    kw = KW(model)
    batches = [{"x": X[i:i + 50], "labels": y[i:i + 50]} for i in range(0, 240, 50)]
    a = richness.evaluate(kw, batches, progress=False)
    b = richness.evaluate(model, [(X[i:i + 50], y[i:i + 50]) for i in range(0, 240, 50)], progress=False,
                          batch_fn=lambda bt: (bt[0], bt[1]))
    H, F = acts(model, X)
    want = dlr_naive(H, F)[0]
    assert abs(a.dlr - want) < 1e-12 and abs(b.dlr - want) < 1e-12
    assert abs(a.nc1 - nc1_naive(H, y.numpy())) < 1e-9 * a.nc1


# -- sequence models -----------------------------------------------------------


@pytest.mark.parametrize("mode", ["all", "last", "mask"])
def test_sequence_token_selection(mode):
    model, ids, mask, lengths = lm_setup()
    batches = [{"input_ids": ids[i:i + 8], "attention_mask": mask[i:i + 8]} for i in range(0, 40, 8)]
    H, F = lm_feats(model, ids)
    if mode == "all":  # padding excluded through attention_mask
        rep = richness.evaluate(model, batches, progress=False, tokens="all")
        Hs, Fs = H[mask], F[mask]
    elif mode == "last":  # last non-padding position of each sequence
        rep = richness.evaluate(model, batches, progress=False, tokens="last")
        rows = torch.arange(40)
        Hs, Fs = H[rows, lengths - 1], F[rows, lengths - 1]
    else:  # a fixed boolean mask over positions, applied on top of nothing else
        keep = torch.tensor([False, True, True, False, True, False, True])
        rep = richness.evaluate(model, [{"input_ids": b["input_ids"]} for b in batches], progress=False, tokens=keep)
        Hs, Fs = H[:, keep].reshape(-1, 6), F[:, keep].reshape(-1, 11)
    want, r = dlr_naive(Hs.numpy(), Fs.numpy())
    assert rep.n == Hs.shape[0]
    assert rep.rank == r
    assert abs(rep.dlr - want) < 1e-10


def test_sequence_per_token_labels_follow_mask():
    model, ids, mask, _ = lm_setup()
    labels = torch.randint(0, 5, (40, 7))
    batches = [{"input_ids": ids[i:i + 8], "attention_mask": mask[i:i + 8], "labels": labels[i:i + 8]}
               for i in range(0, 40, 8)]
    rep = richness.evaluate(model, batches, progress=False)
    H, _ = lm_feats(model, ids)
    assert abs(rep.nc1 - nc1_naive(H[mask].numpy(), labels[mask].numpy())) < 1e-8 * rep.nc1
    with pytest.raises(ValueError, match="tokens mask"):
        richness.evaluate(model, batches, progress=False, tokens=torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="tokens must be"):
        richness.evaluate(model, batches, progress=False, tokens="first")


# -- head finding --------------------------------------------------------------


def test_head_found_when_another_linear_runs_after_it():
    class AuxAfter(MLP):
        def __init__(self):
            super().__init__()
            self.aux = nn.Linear(16, 3)

        def forward(self, x):
            h = self.body(x)
            out = self.fc(h)
            self.aux(h)  # runs after the head; the head's output is still the model's output
            return out

    torch.manual_seed(2)
    model = AuxAfter().double()
    X = torch.randn(90, 8, dtype=torch.float64)
    rep = richness.evaluate(model, loader(X), progress=False)
    H, F = acts(model, X)
    assert rep.n == 90 and abs(rep.dlr - dlr_naive(H, F)[0]) < 1e-12
    assert hook_count(model) == 0
