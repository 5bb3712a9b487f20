"""Draw docs/images/rich_lazy.png, the picture at the top of README.md and docs/index.md.

It runs the trainers of ``richness demo`` (the same data, networks, seeds and settings):
a 64-256-256-10 ReLU network on scikit-learn's digits trained fully (rich) or with only
its head trained (lazy), and the target-downscaled sweep (squared error toward y / alpha;
larger alpha = lazier). Left: DLR of the two runs beside the isotropic reference (the DLR
that features with no structure would give at the same n, width and logit rank). Middle:
cumulative utilization Pi_hat(k) of the two runs. Right: DLR across the sweep with its
isotropic reference.

    pip install ".[demo]" && python docs/make_readme_figure.py      # about 10 s on 2 cores
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from richness.cli import demo as _demo

HERE = os.path.dirname(os.path.abspath(__file__))
RICH, LAZY = "#1f77b4", "#d62728"


def measure(seed: int = 0, epochs: int = 20, steps: int = 400, alphas=(0.1, 0.3, 1.0, 10.0)):
    """The demo's two runs and its sweep: ``(reports, sweep)``, sweep a list of (alpha, report)."""
    X, y, _ = _demo._load_digits(seed) or _demo._synthetic(seed)
    split = int(0.7 * len(y))
    Xtr, ytr, Xte, yte = X[:split], y[:split], X[split:], y[split:]
    reports = {}
    for name, train_features in (("rich", True), ("lazy", False)):
        forward, _ = _demo._train_mlp(Xtr, ytr, width=256, epochs=epochs, train_features=train_features, seed=seed)
        reports[name], _ = _demo._measure(forward, Xtr, ytr, Xte, yte)
    sweep = []
    for a in alphas:
        forward = _demo._train_mse(Xtr, ytr, alpha=a, width=256, steps=steps, seed=seed)
        sweep.append((a, _demo._measure(forward, Xtr, ytr, Xte, yte)[0]))
    return reports, sweep


def draw(reports, sweep, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(10.5, 2.9), gridspec_kw={"width_ratios": [0.8, 1.1, 1.1]})
    ax = axes[0]
    for i, (name, color) in enumerate((("rich", RICH), ("lazy", LAZY))):
        r = reports[name]
        ax.bar(i, r.dlr, width=0.55, color=color)
        ax.hlines(r.dlr_isotropic, i - 0.38, i + 0.38, colors="0.3", linestyles="--", linewidth=1.4)
        ax.text(i, r.dlr + 0.015, f"{r.dlr:.2f}", ha="center", va="bottom", fontsize=9)
    ax.text(0.5, reports["rich"].dlr_isotropic + 0.03, "isotropic reference", ha="center", fontsize=8, color="0.3")
    ax.set_xticks([0, 1], ["full training\n(rich)", "head only\n(lazy)"])
    ax.set_ylim(0, 1)
    ax.set_ylabel("DLR (0 rich, 1 lazy)")
    ax.set_title("DLR of two runs", fontsize=10)

    ax = axes[1]
    for name, color in (("rich", RICH), ("lazy", LAZY)):
        u = reports[name].utilization
        ax.plot(np.arange(1, len(u) + 1), u, color=color, linewidth=2, label=name)
    ax.axvline(10, color="0.6", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")
    ax.set_xlabel("k (top-k feature eigenfunctions)")
    ax.set_ylabel("utilization $\\hat\\Pi(k)$")
    ax.set_title("where the learned functions live", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")

    ax = axes[2]
    a = [s[0] for s in sweep]
    ax.plot(a, [s[1].dlr for s in sweep], "o-", color="k", linewidth=2, label="DLR")
    ax.plot(a, [s[1].dlr_isotropic for s in sweep], "--", color="0.5", label="isotropic reference")
    ax.set_xscale("log")
    ax.set_ylim(0, 1)
    ax.set_xlabel("alpha (targets y / alpha; larger = lazier)")
    ax.set_ylabel("DLR")
    ax.set_title("target-downscaled sweep", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
    fig.suptitle("richness demo: scikit-learn digits, 64-256-256-10 ReLU network", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "images", "rich_lazy.png"))
    args = parser.parse_args()
    reports, sweep = measure()
    for name, r in reports.items():
        print(f"{name}: DLR {r.dlr:.3f}, isotropic {r.dlr_isotropic:.3f}, DLR/iso {r.dlr_normalized:.3f}")
    for a, r in sweep:
        print(f"alpha {a:g}: DLR {r.dlr:.3f}, isotropic {r.dlr_isotropic:.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    draw(reports, sweep, args.out)
    print(f"{args.out}: {os.path.getsize(args.out)} bytes")


if __name__ == "__main__":
    main()
