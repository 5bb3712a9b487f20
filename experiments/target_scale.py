"""Target downscaling: an MLP on MNIST-5k trained with squared error on one-hot
targets divided by alpha (alpha in 1, 2, 4, 8, 16, 32; larger alpha = lazier).
DLR should rise with alpha. NC1, kernel similarity to initialisation S_init,
the parameter norm and the distance to initialisation are recorded alongside.

The head starts at zero, so the initial function is 0 for every alpha and
y -> y/alpha is the output-scale knob of lazy training (Chizat et al. 2019):
the head must grow to O(1/alpha) and the feature gradients, proportional to
head x residual, shrink like 1/alpha^2. Plain SGD (no momentum, no adaptive
steps, which would undo the scaling).

    python experiments/target_scale.py [--quick] [--out DIR] [--device cuda]
"""

from __future__ import annotations

import copy
import os
import sys
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

from richness.baselines import InitSimilarity, parameter_norm  # noqa: E402

NAME = "target_scale"


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    ap = C.parser(__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=None, help="epochs per alpha (default 2 quick, 20 full)")
    ap.add_argument("--head-init", choices=["zero", "standard"], default="zero",
                    help="zero (default: f_0 = 0 for every alpha) or PyTorch's default head initialisation")
    args = ap.parse_args(argv)
    torch = C.setup(args)
    started = time.time()
    if args.quick:
        cfg = dict(n_train=300, n_test=200, width=32, epochs=2, batch=100, lr=0.1, alphas=[1, 4, 32])
    else:
        cfg = dict(n_train=4000, n_test=1000, width=256, epochs=20, batch=100, lr=0.1,
                   alphas=[1, 2, 4, 8, 16, 32])
    if args.epochs is not None:
        cfg["epochs"] = args.epochs
    cfg["head_init"] = args.head_init
    x_tr, y_tr, x_te, y_te = C.mnist(cfg["n_train"], cfg["n_test"], seed=args.seed, device=args.device)
    onehot = torch.nn.functional.one_hot(y_tr, 10).float()
    runs = []
    for alpha in cfg["alphas"]:
        torch.manual_seed(args.seed)  # the same initial network for every alpha
        model = C.mlp([784, cfg["width"], cfg["width"]], zero_head=args.head_init == "zero").to(args.device)
        init = copy.deepcopy(model)
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
        targets = onehot / alpha
        # Squared error summed over outputs, averaged over samples.
        loss_fn = lambda out, t: ((out - t) ** 2).sum(1).mean()  # noqa: E731
        idx = torch.arange(len(x_tr), device=args.device)
        losses = C.train_epochs(model, x_tr, idx, epochs=cfg["epochs"], batch=cfg["batch"], opt=opt,
                                loss_fn=lambda out, i: loss_fn(out, targets[i]), seed=args.seed)
        report = C.measure(model, x_tr, y_tr)
        s = InitSimilarity()
        s.update(C.features(model, x_tr), C.features(init, x_tr))
        res = C.summary(report, 10)
        out = C.predict(model, x_tr)
        res.update(alpha=alpha, s_init=s.compute(), param_norm=parameter_norm(model),
                   param_distance=parameter_norm(model, reference=init),
                   body_distance=parameter_norm(model.body, reference=init.body),
                   relative_train_loss=float(((out - targets) ** 2).sum(1).mean() / (targets ** 2).sum(1).mean()),
                   train_acc=C.accuracy(model, x_tr, y_tr), test_acc=C.accuracy(model, x_te, y_te),
                   final_loss=losses[-1])
        runs.append(res)
        C.log(f"alpha {alpha:3d}  DLR {res['dlr']:.4f}  NC1 {res['nc1']:.3f}  S_init {res['s_init']:.4f}  "
              f"|theta| {res['param_norm']:.3f}  |theta-theta0| {res['param_distance']:.4f}  "
              f"rel loss {res['relative_train_loss']:.3f}  train {res['train_acc']:.3f}  test {res['test_acc']:.3f}")
    payload = {"settings": cfg, "runs": runs,
               "paper": "DLR rises monotonically with alpha; NC1 moves the way that would wrongly signal richer "
                        "training; S_init and parameter norm do not move",
               "measured_on": "training set"}
    C.write_json(args, NAME, payload, started)

    plt = C.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    al = [r["alpha"] for r in runs]
    axes[0].plot(al, [r["dlr"] for r in runs], "o-", label="DLR")
    axes[0].plot(al, [r["s_init"] for r in runs], "s--", label="S_init (CKA to init)")
    axes[0].plot(al, [r["test_acc"] for r in runs], "^:", label="test accuracy")
    axes[0].set_ylim(0, 1.02)
    axes[1].plot(al, [r["nc1"] for r in runs], "o-", color="C3", label="NC1")
    axes[2].plot(al, [r["param_norm"] for r in runs], "o-", color="C4", label="||theta||")
    axes[2].plot(al, [r["param_distance"] for r in runs], "s--", color="C5", label="||theta - theta_0||")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("alpha (targets y / alpha)")
        ax.legend(fontsize=8)
    axes[1].set_yscale("log")
    axes[0].set_title("larger alpha = lazier")
    C.save_figure(fig, args, NAME)
    return payload


if __name__ == "__main__":
    main()
