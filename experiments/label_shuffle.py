"""Label shuffling: the same network trained on MNIST with its true labels and
with the training labels randomly permuted (memorisation). The paper (CIFAR-10
ResNet18) reports DLR low in both (0.031 true, 0.034 shuffled) while test
accuracy is 95.0% vs 9.5%: richness is not generalisation.

Full mode uses a ReLU MLP (memorising random labels with a CNN takes more
epochs than 2 shared CPU cores allow in a few minutes); ``--arch cnn`` runs the
small CNN instead. Training stops when train accuracy reaches 99% or after the
epoch budget.

    python experiments/label_shuffle.py [--quick] [--out DIR] [--device cuda] [--arch mlp|cnn]
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

NAME = "label_shuffle"


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    ap = C.parser(__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=["mlp", "cnn"], default="mlp")
    ap.add_argument("--epochs", type=int, default=None,
                    help="train both runs exactly this many epochs (no stop at 99%% training accuracy)")
    args = ap.parse_args(argv)
    torch = C.setup(args)
    started = time.time()
    if args.quick:
        cfg = dict(n_train=200, n_test=200, width=64, epochs=3, batch=50, lr=2e-3)
    else:
        cfg = dict(n_train=2000, n_test=1000, width=512, epochs=120, batch=100, lr=1e-3)
    cfg["arch"] = args.arch
    cfg["stop_at_99"] = args.epochs is None
    if args.epochs is not None:
        cfg["epochs"] = args.epochs
    x_tr, y_tr, x_te, y_te = C.mnist(cfg["n_train"], cfg["n_test"], seed=args.seed, device=args.device,
                                     image=args.arch == "cnn")
    gen = torch.Generator().manual_seed(args.seed + 1)
    y_shuf = y_tr[torch.randperm(len(y_tr), generator=gen).to(args.device)]
    runs = []
    for name, labels in (("true", y_tr), ("shuffled", y_shuf)):
        torch.manual_seed(args.seed)
        if args.arch == "mlp":
            model = C.mlp([784, cfg["width"], cfg["width"]]).to(args.device)
        else:
            model = C.small_cnn(width=16).to(args.device)
        opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
        done = {"epochs": 0}

        class Stop(Exception):
            pass

        def on_epoch(ep: int) -> None:
            done["epochs"] = ep + 1
            if cfg["stop_at_99"] and (ep + 1) % 5 == 0 and C.accuracy(model, x_tr, labels) >= 0.99:
                raise Stop

        try:
            C.train_epochs(model, x_tr, labels, epochs=cfg["epochs"], batch=cfg["batch"], opt=opt,
                           loss_fn=torch.nn.functional.cross_entropy, seed=args.seed, on_epoch=on_epoch)
        except Stop:
            pass
        rep = C.measure(model, x_tr, labels)  # the labels it was trained on
        res = C.summary(rep, 10)
        res.update(labels=name, epochs=done["epochs"], train_acc=C.accuracy(model, x_tr, labels),
                   test_acc=C.accuracy(model, x_te, y_te))
        runs.append(res)
        C.log(f"{name:8s} epochs {res['epochs']:3d}  DLR {res['dlr']:.4f} (normalized {res['dlr_normalized']:.3f})  "
              f"NC1 {res['nc1']:.3f}  Pi_hat(C) {res['utilization_at_C']:.3f}  train {res['train_acc']:.3f}  "
              f"test {res['test_acc']:.3f}")
    payload = {"settings": cfg, "runs": runs,
               "paper": {"true": {"dlr": 0.031, "test_acc": 0.950}, "shuffled": {"dlr": 0.034, "test_acc": 0.095}},
               "measured_on": "training set with the labels used in training"}
    C.write_json(args, NAME, payload, started)

    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    C.dlr_accuracy_bars(ax, runs, [f"{r['labels']} labels" for r in runs])
    ax.set_title(f"MNIST {args.arch}, true vs shuffled labels")
    C.save_figure(fig, args, NAME)
    return payload


if __name__ == "__main__":
    main()
