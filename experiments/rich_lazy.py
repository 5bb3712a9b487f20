"""Rich vs lazy (the paper's Figure 1): the same network on MNIST-5k trained
fully (rich) or with only its last layer trained on frozen random features
(lazy). Records DLR, NC1, utilization Pi_hat(C) and accuracies; DLR should be
much lower for full training.

    python experiments/rich_lazy.py [--quick] [--out DIR] [--device cuda]
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

NAME = "rich_lazy"


def run_one(torch: Any, arch: str, mode: str, data: tuple, cfg: Dict[str, Any], seed: int,
            device: str) -> Dict[str, Any]:
    """Train one network (rich: all layers; lazy: head only) and measure it."""
    x_tr, y_tr, x_te, y_te = data
    torch.manual_seed(seed)
    if arch == "mlp":
        model = C.mlp([784] + [cfg["width"]] * 2).to(device)
        xt, xe = x_tr, x_te
    else:
        model = C.small_cnn(width=cfg["cnn_width"]).to(device)
        xt, xe = x_tr.reshape(-1, 1, 28, 28), x_te.reshape(-1, 1, 28, 28)
    params = model.parameters() if mode == "rich" else model.head.parameters()
    if mode == "lazy":
        for p in model.body.parameters():
            p.requires_grad_(False)
    opt = torch.optim.SGD(params, lr=cfg["lr"], momentum=0.9)
    epochs = cfg["epochs"] if arch == "mlp" else cfg["cnn_epochs"]
    losses = C.train_epochs(model, xt, y_tr, epochs=epochs, batch=cfg["batch"], opt=opt,
                            loss_fn=torch.nn.functional.cross_entropy, seed=seed)
    report = C.measure(model, xt, y_tr)
    res = C.summary(report, 10)
    res.update(arch=arch, mode=mode, train_acc=C.accuracy(model, xt, y_tr), test_acc=C.accuracy(model, xe, y_te),
               final_loss=losses[-1], utilization=[float(u) for u in report.utilization[:64]])
    C.log(f"{arch:4s} {mode:5s} DLR {res['dlr']:.4f} (normalized {res['dlr_normalized']:.3f})  NC1 {res['nc1']:.3f}  "
          f"Pi_hat(C) {res['utilization_at_C']:.3f}  train {res['train_acc']:.3f}  test {res['test_acc']:.3f}")
    return res


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    ap = C.parser(__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=None, help="MLP epochs (default 2 quick, 15 full)")
    ap.add_argument("--width", type=int, default=None, help="MLP width = p (default 48 quick, 256 full)")
    ap.add_argument("--archs", default=None, help="comma-separated: mlp,cnn (default mlp quick, both full)")
    args = ap.parse_args(argv)
    torch = C.setup(args)
    started = time.time()
    if args.quick:
        cfg = dict(n_train=400, n_test=200, width=48, cnn_width=4, epochs=2, cnn_epochs=1, batch=100, lr=0.05,
                   archs=["mlp"])
    else:
        cfg = dict(n_train=4000, n_test=1000, width=256, cnn_width=16, epochs=15, cnn_epochs=5, batch=128, lr=0.05,
                   archs=["mlp", "cnn"])
    if args.epochs is not None:
        cfg["epochs"] = args.epochs
    if args.width is not None:
        cfg["width"] = args.width
    if args.archs is not None:
        cfg["archs"] = args.archs.split(",")
    data = C.mnist(cfg["n_train"], cfg["n_test"], seed=args.seed, device=args.device)
    runs = [run_one(torch, arch, mode, data, cfg, args.seed, args.device)
            for arch in cfg["archs"] for mode in ("rich", "lazy")]
    payload = {"settings": {k: v for k, v in cfg.items()}, "runs": runs,
               "paper": {"rich": {"dlr": 0.0087, "test_acc": 0.100}, "lazy": {"dlr": 0.63, "test_acc": 0.744}},
               "measured_on": "training set (features of the trained network, head = last Linear)"}
    C.write_json(args, NAME, payload, started)

    plt = C.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"{r['arch']}\n{r['mode']}" for r in runs]
    C.dlr_accuracy_bars(axes[0], runs, labels, dlr_label="DLR (0 rich, 1 lazy)")
    axes[0].set_title("full training (rich) vs last layer only (lazy)")
    for r in runs:
        u = r["utilization"]
        axes[1].plot(range(1, len(u) + 1), u, label=f"{r['arch']} {r['mode']}",
                     ls="-" if r["mode"] == "rich" else "--")
    axes[1].axvline(10, color="gray", lw=0.8)
    axes[1].set_xlabel("k (eigenfunctions, descending eigenvalue)")
    axes[1].set_ylabel("utilization Pi_hat(k)")
    axes[1].set_ylim(0, 1.02)
    axes[1].legend(fontsize=8)
    C.save_figure(fig, args, NAME)
    return payload


if __name__ == "__main__":
    main()
