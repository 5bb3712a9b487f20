"""Batch normalisation: a VGG-style CNN (six 3x3 conv layers in three blocks)
on MNIST-5k with and without BatchNorm, same plain-SGD budget. The paper
(CIFAR-100 VGG-16) reports without BN 21.7% / DLR 0.66 (lazy), with BN
72.0% / DLR 0.073 (rich).

    python experiments/batchnorm.py [--quick] [--out DIR] [--device cuda]
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

from richness.baselines import InitSimilarity  # noqa: E402

NAME = "batchnorm"


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = C.parser(__doc__.splitlines()[0]).parse_args(argv)
    torch = C.setup(args)
    started = time.time()
    if args.quick:
        cfg = dict(n_train=200, n_test=100, vgg=[4, "M", 8, "M"], feat=32, epochs=1, batch=50, lr=0.02)
    else:
        cfg = dict(n_train=2000, n_test=1000, vgg=[16, 16, "M", 32, 32, "M", 64, 64, "M"], feat=128, epochs=5,
                   batch=64, lr=0.02)
    x_tr, y_tr, x_te, y_te = C.mnist(cfg["n_train"], cfg["n_test"], seed=args.seed, device=args.device, image=True)
    runs = []
    for bn in (False, True):
        torch.manual_seed(args.seed)
        model = C.vgg(cfg["vgg"], bn=bn, feat=cfg["feat"]).to(args.device)
        init_feats = C.features(model, x_tr)
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
        losses = C.train_epochs(model, x_tr, y_tr, epochs=cfg["epochs"], batch=cfg["batch"], opt=opt,
                                loss_fn=torch.nn.functional.cross_entropy, seed=args.seed)
        rep = C.measure(model, x_tr, y_tr)
        s = InitSimilarity()
        s.update(C.features(model, x_tr), init_feats)
        res = C.summary(rep, 10)
        res.update(bn=bn, s_init=s.compute(), losses=losses, train_acc=C.accuracy(model, x_tr, y_tr),
                   test_acc=C.accuracy(model, x_te, y_te))
        runs.append(res)
        C.log(f"BN {str(bn):5s}  DLR {res['dlr']:.4f} (normalized {res['dlr_normalized']:.3f})  NC1 {res['nc1']:.3f}  "
              f"S_init {res['s_init']:.3f}  train {res['train_acc']:.3f}  test {res['test_acc']:.3f}  "
              f"({time.time() - started:.0f} s)")
    payload = {"settings": cfg, "runs": runs,
               "paper": {"without_bn": {"dlr": 0.66, "test_acc": 0.217}, "with_bn": {"dlr": 0.073, "test_acc": 0.720}},
               "measured_on": "training set (eval-mode BN)"}
    C.write_json(args, NAME, payload, started)

    plt = C.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = ["without BN" if not r["bn"] else "with BN" for r in runs]
    C.dlr_accuracy_bars(axes[0], runs, names)
    for r, nm in zip(runs, names):
        axes[1].plot(range(1, len(r["losses"]) + 1), r["losses"], "o-", label=nm)
    axes[1].set_xlabel("epoch")
    axes[1].set_ylabel("training loss")
    axes[1].set_yscale("log")
    axes[1].legend(fontsize=8)
    C.save_figure(fig, args, NAME)
    return payload


if __name__ == "__main__":
    main()
