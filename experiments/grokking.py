"""Grokking: modular addition (a + b) mod P with a 2-layer transformer read at
the last position (inputs "a b =", P = 97), AdamW with weight decay, 40% of the
P^2 pairs for training, full-batch steps. Records DLR (training set, features =
final residual stream at the last position, head = unembedding), train and
test accuracy over steps. The paper: DLR falls at or before the test-accuracy
jump (0.51 before, 0.11 after).

    python experiments/grokking.py [--quick] [--out DIR] [--device cuda] [--steps N]
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

NAME = "grokking"


def transformer(P: int, d: int, heads: int, ff: int, layers: int = 2) -> Any:
    """Token + position embeddings, ``layers`` pre-norm transformer blocks, a
    final LayerNorm; ``body`` returns the last position (the features), ``head``
    the unembedding Linear (d -> P)."""
    import torch
    import torch.nn as nn

    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(P + 1, d)  # token P is "="
            self.pos = nn.Parameter(torch.randn(3, d) * 0.02)
            layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d)

        def forward(self, tokens):
            h = self.blocks(self.embed(tokens) + self.pos)
            return self.norm(h[:, -1])

    return C.net_class()(Body(), nn.Linear(d, P))


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    ap = C.parser(__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: 30 quick, 100 full)")
    ap.add_argument("--P", type=int, default=None, help="the modulus (a prime; default 13 quick, 97 full)")
    ap.add_argument("--frac", type=float, default=None, help="training fraction of the P^2 pairs")
    ap.add_argument("--every", type=int, default=None, help="measure every this many steps")
    ap.add_argument("--d", type=int, default=None, help="model width (features p = d)")
    ap.add_argument("--ff", type=int, default=None, help="MLP width of each block")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--wd", type=float, default=None, help="AdamW weight decay")
    args = ap.parse_args(argv)
    torch = C.setup(args)
    started = time.time()
    if args.quick:
        cfg = dict(P=13, d=32, heads=4, ff=64, frac=0.5, lr=3e-3, wd=1.0, steps=30, every=15)
    else:
        cfg = dict(P=97, d=128, heads=4, ff=512, frac=0.4, lr=1e-3, wd=1.0, steps=100, every=10)
    for key in ("steps", "P", "frac", "every", "d", "ff", "lr", "wd"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    P = cfg["P"]
    a, b = torch.meshgrid(torch.arange(P), torch.arange(P), indexing="ij")
    a, b = a.reshape(-1), b.reshape(-1)
    tokens = torch.stack([a, b, torch.full_like(a, P)], 1).to(args.device)
    labels = ((a + b) % P).to(args.device)
    perm = torch.randperm(P * P, generator=torch.Generator().manual_seed(args.seed)).to(args.device)
    n_tr = int(cfg["frac"] * P * P)
    tr, te = perm[:n_tr], perm[n_tr:]
    torch.manual_seed(args.seed)
    model = transformer(P, cfg["d"], cfg["heads"], cfg["ff"]).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["wd"], betas=(0.9, 0.98))
    history = []

    def record(step: int, loss: float) -> None:
        rep = C.measure(model, tokens[tr], labels[tr], batch=2000)
        row = {"step": step, "train_loss": C._f(loss), "dlr": C._f(rep.dlr), "dlr_normalized": C._f(rep.dlr_normalized),
               "nc1": C._f(rep.nc1), "rank": rep.rank, "effective_dim": C._f(rep.effective_dim),
               "train_acc": C.accuracy(model, tokens[tr], labels[tr], 2000),
               "test_acc": C.accuracy(model, tokens[te], labels[te], 2000)}
        history.append(row)
        C.log(f"step {step:5d}  loss {loss:.4f}  DLR {row['dlr']:.4f}  train {row['train_acc']:.3f}  "
              f"test {row['test_acc']:.3f}  eff.dim {row['effective_dim']:.1f}  ({time.time() - started:.0f} s)")

    loss_v = float("nan")
    for step in range(cfg["steps"] + 1):
        if step % cfg["every"] == 0:
            record(step, loss_v)
        if step == cfg["steps"]:
            break
        model.train()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(tokens[tr]), labels[tr])
        loss.backward()
        opt.step()
        loss_v = float(loss.detach())

    # Before/after grokking: the last record with test accuracy below 50% and the
    # first with test accuracy at or above 95% (None when it did not happen).
    before = [h for h in history if h["test_acc"] < 0.5 and h["train_acc"] > 0.99]
    after = [h for h in history if h["test_acc"] >= 0.95]
    jump = after[0]["step"] if after else None
    fell = [h for h in history if h["dlr"] is not None and before and h["dlr"] < 0.5 * before[0]["dlr"]]
    payload = {"settings": {**cfg, "n_train": n_tr, "n_test": P * P - n_tr}, "history": history,
               "memorised_step": before[0]["step"] if before else None,
               "before": before[-1] if before else None, "after": after[0] if after else None,
               "grokked": bool(after), "test_jump_step": jump,
               "dlr_halved_step": fell[0]["step"] if fell else None,
               "paper": {"before": {"dlr": 0.51, "test_acc": 0.052}, "after": {"dlr": 0.11, "test_acc": 0.998}},
               "measured_on": "training pairs, last position"}
    C.write_json(args, NAME, payload, started)

    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    st = [h["step"] for h in history]
    ax.plot(st, [h["dlr"] for h in history], "k-", lw=2, label="DLR (train pairs)")
    ax.plot(st, [h["train_acc"] for h in history], "C0--", label="train accuracy")
    ax.plot(st, [h["test_acc"] for h in history], "C1-", label="test accuracy")
    if jump is not None:
        ax.axvline(jump, color="gray", lw=0.8)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("step (full batch, AdamW)")
    ax.set_title(f"modular addition mod {P}, 2-layer transformer")
    ax.legend(fontsize=8)
    C.save_figure(fig, args, NAME)
    return payload


if __name__ == "__main__":
    main()
