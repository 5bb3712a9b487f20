"""torch's rate for the full product S.addmm_(x.T, x) on 4,096 x p float32, at 1 and 2 torch
threads: best of 10 after 3 warm-up calls, in G multiply-adds/s (p^2 x 4,096 per call)."""
import time

import torch

for th in (1, 2):
    torch.set_num_threads(th)
    for p in (1024, 2048):
        x = torch.randn(4096, p)
        S = torch.zeros(p, p)
        for _ in range(3):
            S.addmm_(x.T, x)
        best = 1e9
        for _ in range(10):
            t0 = time.perf_counter()
            S.addmm_(x.T, x)
            best = min(best, time.perf_counter() - t0)
        print(th, p, f"{p * p * 4096 / best / 1e9:.1f} G madd/s")
