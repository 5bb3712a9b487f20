"""Tiny torch models and loaders shared by the tests of evaluate and Monitor,
with plain forward calls that compute their activations independently of
richness (the oracles of tests/reference.py take those).
"""

import torch

nn = torch.nn


class MLP(nn.Module):
    def __init__(self, d=8, h=16, c=4):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, h), nn.ReLU())
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(h, c)

    def forward(self, x):
        return self.fc(self.drop(self.body(x)))


def make(n=240, d=8, c=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=dtype) * 2 + 1
    y = torch.randint(0, c, (n,), generator=g)
    torch.manual_seed(seed)
    model = MLP(d, 16, c).to(dtype)
    return model, X, y


def loader(X, y=None, bs=32):
    ds = torch.utils.data.TensorDataset(X, y) if y is not None else torch.utils.data.TensorDataset(X)
    return torch.utils.data.DataLoader(ds, batch_size=bs)


def acts(model, X):
    model.eval()
    with torch.no_grad():
        H = model.body(X)
        return H.double().numpy(), model.fc(H).double().numpy()


def hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


class TinyLM(nn.Module):
    def __init__(self, vocab=11, d=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask=None):
        h = torch.tanh(self.mix(self.emb(input_ids)))
        h = h + h.cumsum(dim=1) * 0.1
        return {"logits": self.lm_head(h)}


def lm_setup():
    torch.manual_seed(1)
    model = TinyLM().double()
    ids = torch.randint(0, 11, (40, 7))
    lengths = torch.randint(3, 8, (40,))
    mask = torch.arange(7)[None, :] < lengths[:, None]
    return model, ids, mask, lengths


def lm_feats(model, ids):
    with torch.no_grad():
        h = torch.tanh(model.mix(model.emb(ids)))
        h = h + h.cumsum(dim=1) * 0.1
        return h, model.lm_head(h)


def sgd_train(model, mon, data, lr=0.1):
    """Plain SGD steps over ``data`` ((x, y) batches), ``mon.step(labels=y)`` after each."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in data:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mon.step(labels=y)


def lightning_module(pl, net, lr=0.05):
    """A LightningModule training ``net`` (as ``.net``) by cross-entropy with SGD."""

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, i):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)

    return Module()


class TwoViews(nn.Module):
    """An encoder ``enc`` (d -> p) and a projection head (p -> 4), float64: a features-only
    Monitor reads ``enc``, a two-view step runs it on both views."""

    def __init__(self, d, p):
        super().__init__()
        self.enc = nn.Linear(d, p).double()
        self.proj = nn.Linear(p, 4).double()

    def forward(self, x):
        return self.proj(self.enc(x))
