"""The README's CKA heatmap: 8 layers of a small CNN against 4 of an MLP, both
trained on scikit-learn's digits (1,797 8 x 8 images), compared on all of them
by ``richness.similarity`` (exact linear CKA, one pass).

    python benchmarks/cka_heatmap.py [--out benchmarks/results/cka_heatmap]
"""

import argparse
import json
from collections import OrderedDict

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import richness


def cnn() -> nn.Module:
    return nn.Sequential(OrderedDict(
        conv1=nn.Conv2d(1, 16, 3, padding=1), relu1=nn.ReLU(),
        conv2=nn.Conv2d(16, 16, 3, padding=1), relu2=nn.ReLU(),
        conv3=nn.Conv2d(16, 32, 3, padding=1, stride=2), relu3=nn.ReLU(),
        conv4=nn.Conv2d(32, 32, 3, padding=1), relu4=nn.ReLU(),
        pool=nn.AdaptiveAvgPool2d(1), flat=nn.Flatten(), fc=nn.Linear(32, 10)))


def mlp() -> nn.Module:
    return nn.Sequential(OrderedDict(
        flat=nn.Flatten(), fc1=nn.Linear(64, 128), relu1=nn.ReLU(), fc2=nn.Linear(128, 64), relu2=nn.ReLU(),
        head=nn.Linear(64, 10)))


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int) -> float:
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=gen).split(64):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/cka_heatmap")
    ap.add_argument("--epochs", type=int, default=15)
    args = ap.parse_args()
    torch.manual_seed(0)
    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(d.target)
    models = {"cnn": cnn(), "mlp": mlp()}
    acc = {name: train(m, x, y, args.epochs) for name, m in models.items()}
    layers = {"cnn": ["conv1", "relu1", "conv2", "relu2", "conv3", "relu3", "conv4", "fc"],
              "mlp": ["fc1", "fc2", "relu2", "head"]}
    loader = [(x[i:i + 256], y[i:i + 256]) for i in range(0, len(x), 256)]
    report = richness.similarity(models, loader, layers, pool="mean", progress=False)
    paths = richness.plot.similarity(report, args.out, title="linear CKA (biased), digits, n = 1,797")
    with open(args.out + ".json", "w") as f:
        json.dump({"train_accuracy": acc, **report.to_dict()}, f, indent=1)
    print(json.dumps({"train_accuracy": acc, "paths": paths,
                      "cnn.fc vs mlp.head": report.pair("cnn.fc", "mlp.head").cka}, indent=1))


if __name__ == "__main__":
    main()
