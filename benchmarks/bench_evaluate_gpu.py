"""What ``richness.evaluate`` adds to a plain inference loop on a GPU.

ResNet-50 (torchvision's, or the same architecture defined here when
torchvision is not installed) at 224 x 224, batch 256, bf16 autocast,
channels_last, on random images resident on the device (50,000 by default)
with random labels 0..999. One run alternates the plain loop (forward only)
with ``evaluate`` over the same batches (forward, head capture, streamed
moments, and the final report), ``--rounds`` times each; the overhead is the
median evaluate time over the median plain time, minus one (target: <= 2%).
Then the report alone: ``Moments.compute()`` at p = 2048, C = 1000 with labels
(the full report evaluate returns), timed ``--reports`` times (target: <= 40 ms).

    python benchmarks/bench_evaluate_gpu.py [--images 50000] [--rounds 3] [--json out.json]
    python benchmarks/bench_evaluate_gpu.py --device cpu --images 16 --batch 8 --size 32 \
        --rounds 1 --reports 1 --report-p 64 --report-c 10   # dry run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn as nn

import richness


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


def resnet50_here(num_classes: int = 1000) -> nn.Module:
    """torchvision.models.resnet50's architecture (layers 3-4-6-3, widths 64..512, fc 2048 -> 1000)."""
    layers, cin = [], 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(Bottleneck(cin, width, stride if b == 0 else 1))
            cin = 4 * width
    return nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                         nn.MaxPool2d(3, 2, 1), *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(2048, num_classes))


def resnet50() -> tuple:
    try:
        import torchvision

        return torchvision.models.resnet50(), "torchvision"
    except ImportError:
        return resnet50_here(), "defined here (torchvision not installed)"


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--images", type=int, default=50_000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--rounds", type=int, default=3, help="alternations of plain and evaluate")
    ap.add_argument("--reports", type=int, default=5, help="timed Moments.compute() calls")
    ap.add_argument("--report-p", type=int, default=2048, help="features of the timed report")
    ap.add_argument("--report-c", type=int, default=1000, help="outputs (and classes) of the timed report")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    torch.manual_seed(0)
    model, origin = resnet50()
    model = model.to(dev).to(memory_format=torch.channels_last).eval()
    amp = torch.bfloat16
    images = torch.randn(a.images, 3, a.size, a.size, device=dev, dtype=amp).contiguous(
        memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (a.images,), device=dev)
    batches = [(images[i:i + a.batch], labels[i:i + a.batch]) for i in range(0, a.images, a.batch)]
    print(f"ResNet-50 ({origin}) on {dev}, {a.images} images {a.size}x{a.size}, batch {a.batch}, "
          f"bf16 autocast, channels_last", flush=True)

    def plain() -> float:
        sync(dev)
        t0 = time.perf_counter()
        with torch.no_grad(), torch.autocast(dev.type, dtype=amp):
            for x, _ in batches:
                model(x)
        sync(dev)
        return time.perf_counter() - t0

    def with_richness() -> float:
        sync(dev)
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=amp):
            rep = richness.evaluate(model, batches, progress=False)
        sync(dev)
        assert rep is not None
        return time.perf_counter() - t0

    plain(), with_richness()  # warm-up: cuDNN plans, cuBLAS handles, backend scratch
    tp, te = [], []
    for _ in range(a.rounds):
        tp.append(plain())
        te.append(with_richness())
    p_med, e_med = statistics.median(tp), statistics.median(te)
    overhead = e_med / p_med - 1.0

    # The report alone at p = 2048, C = 1000 with labels (what evaluate computes at the end).
    n, p, C = 4 * a.report_p, a.report_p, a.report_c
    g = torch.Generator(device=dev).manual_seed(1)
    feats = torch.randn(n, p, device=dev, generator=g)
    outs = feats[:, :C] @ torch.randn(C, C, device=dev, generator=g) + torch.randn(n, C, device=dev, generator=g)
    ys = torch.randint(0, C, (n,), device=dev, generator=g)
    m = richness.Moments(C)
    for i in range(0, n, p):
        m.update(feats[i:i + p], outs[i:i + p], ys[i:i + p])
    m.compute()  # warm-up (cuSOLVER handles, workspace)
    tr = []
    for _ in range(a.reports):
        sync(dev)
        t0 = time.perf_counter()
        m.compute()
        sync(dev)
        tr.append(time.perf_counter() - t0)
    r_med = statistics.median(tr)

    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "model": origin,
           "images": a.images, "batch": a.batch, "size": a.size, "plain_s": tp, "evaluate_s": te,
           "overhead": overhead, "report_s": tr, "report_median_s": r_med}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(f"plain loop      median {p_med:8.3f} s  ({a.images / p_med:8.0f} img/s)  runs {[round(t, 3) for t in tp]}")
    print(f"evaluate        median {e_med:8.3f} s  ({a.images / e_med:8.0f} img/s)  runs {[round(t, 3) for t in te]}")
    print(f"overhead        {100 * overhead:+.2f} %   (target <= 2 %, final report included)")
    print(f"report alone    median {1e3 * r_med:8.1f} ms  (p={p}, C={C}, labels; target <= 40 ms at 2048/1000)")


if __name__ == "__main__":
    main()
