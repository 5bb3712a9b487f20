"""Learning-rate sweep: a ReLU MLP on MNIST-5k trained with plain SGD for a
fixed budget at learning rates over three decades. The paper: the learning
rate with the best test accuracy sits at the lowest DLR.

    python experiments/lr_sweep.py [--quick] [--out DIR] [--device cuda]
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

NAME = "lr_sweep"


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = C.parser(__doc__.splitlines()[0]).parse_args(argv)
    torch = C.setup(args)
    started = time.time()
    if args.quick:
        cfg = dict(n_train=300, n_test=200, width=32, epochs=2, batch=100, lrs=[0.01, 0.1, 1.0])
    else:
        cfg = dict(n_train=4000, n_test=1000, width=256, epochs=8, batch=100,
                   lrs=[0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0])
    x_tr, y_tr, x_te, y_te = C.mnist(cfg["n_train"], cfg["n_test"], seed=args.seed, device=args.device)
    runs = []
    for lr in cfg["lrs"]:
        torch.manual_seed(args.seed)
        model = C.mlp([784, cfg["width"], cfg["width"]]).to(args.device)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        losses = C.train_epochs(model, x_tr, y_tr, epochs=cfg["epochs"], batch=cfg["batch"], opt=opt,
                                loss_fn=torch.nn.functional.cross_entropy, seed=args.seed)
        if not math.isfinite(losses[-1]) or not all(torch.isfinite(p).all() for p in model.parameters()):
            runs.append({"lr": lr, "diverged": True, "dlr": None, "test_acc": None})
            C.log(f"lr {lr:g}: diverged")
            continue
        rep = C.measure(model, x_tr, y_tr)
        res = C.summary(rep, 10)
        res.update(lr=lr, diverged=False, final_loss=losses[-1], train_acc=C.accuracy(model, x_tr, y_tr),
                   test_acc=C.accuracy(model, x_te, y_te))
        runs.append(res)
        C.log(f"lr {lr:6g}  DLR {res['dlr']:.4f} (normalized {res['dlr_normalized']:.3f})  NC1 {res['nc1']:.3f}  "
              f"train {res['train_acc']:.3f}  test {res['test_acc']:.3f}")
    ok = [r for r in runs if not r["diverged"]]
    best_acc = max(ok, key=lambda r: r["test_acc"])["lr"] if ok else None
    low_dlr = min(ok, key=lambda r: r["dlr"])["lr"] if ok else None
    payload = {"settings": cfg, "runs": runs, "best_test_acc_lr": best_acc, "lowest_dlr_lr": low_dlr,
               "paper": "the optimal learning rate sits at the lowest DLR", "measured_on": "training set"}
    C.write_json(args, NAME, payload, started)

    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["lr"] for r in ok], [r["dlr"] for r in ok], "ko-", label="DLR")
    ax.plot([r["lr"] for r in ok], [r["test_acc"] for r in ok], "C1s--", label="test accuracy")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("learning rate (SGD)")
    ax.legend(fontsize=8)
    ax.set_title("learning-rate sweep, MNIST MLP")
    C.save_figure(fig, args, NAME)
    return payload


if __name__ == "__main__":
    main()
