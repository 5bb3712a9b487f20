"""Grokking: modular addition (a + b) mod P with a 2-layer transformer read at
the last position (inputs "a b ="), AdamW with weight decay, full-batch steps on
a fraction of the P^2 pairs, measured during training by ``richness.Monitor``.

Two Monitors on Probe routes (one on the training pairs, one on the held-out
pairs) emit every ``--every`` steps: DLR (features = final residual stream at
the last position, head = unembedding), the rank of the learned function span,
the effective dimension and NC1. Each record adds train and test accuracy, the
isotropic reference DLR_iso (isotropic features of the same n, active features
and rank) and DLR / DLR_iso. Every ``--rank-every`` steps DLR on the training
pairs is also finished at several rank cuts (the rank-sensitivity report).

The output is ``alpha * (f(x) - f_0(x))`` (f_0 = the network at
initialisation; Kumar et al., "Grokking as the transition from lazy to rich
training dynamics", ICLR 2024): a large alpha makes the early phase lazy, since
the output fits with a parameter change of order 1/alpha. Inputs are fixed
(full batch), so f_0 is computed once. DLR reads the head's functions W phi(x).

Long runs checkpoint (model, optimizer, schedule, RNG and the series, written
atomically) every ``--checkpoint-every`` steps and write the partial JSON;
``--resume`` continues from the checkpoint (``--steps`` may be raised).

    python experiments/grokking.py [--quick] [--out DIR] [--device cuda] [--steps N] [--alpha A] [--resume]
    python experiments/grokking.py --paper --device cuda     # the paper's setting: mod 97, wd 1, 40% of pairs
    python experiments/grokking.py --overlay a.json b.json ... --tag NAME   # seeds overlaid on one step axis
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

NAME = "grokking"
# The settings a checkpoint must share with the run that resumes it (steps may grow).
FIXED = ("P", "d", "heads", "ff", "frac", "lr", "wd", "alpha", "every", "warmup", "clip", "rank_every", "seed",
         "scale_lr")
PRESETS = {
    "quick": dict(P=13, d=32, heads=4, ff=64, frac=0.5, lr=3e-3, wd=1.0, alpha=1.0, steps=30, every=5,
                  warmup=0, clip=0.0, rank_every=15, checkpoint_every=10),
    # CPU setting of the documented runs (docs/REPRODUCTION.md, grokking).
    "full": dict(P=59, d=128, heads=4, ff=512, frac=0.5, lr=1e-3, wd=3.0, alpha=1.0, steps=3000, every=25,
                 warmup=0, clip=0.0, rank_every=250, checkpoint_every=250),
    # The paper's setting: mod 97, weight decay 1, 40% of the pairs (tens of thousands of steps: a GPU).
    "paper": dict(P=97, d=128, heads=4, ff=512, frac=0.4, lr=1e-3, wd=1.0, alpha=1.0, steps=30000, every=100,
                  warmup=0, clip=0.0, rank_every=1000, checkpoint_every=1000),
}
RTOL_FACTORS = (1e-3, 1e-2, 1e-1, 1.0, 1e1, 1e2, 1e3)  # rank cuts relative to the default


def transformer(P: int, d: int, heads: int, ff: int, layers: int = 2) -> Any:
    """Token + position embeddings, ``layers`` pre-norm transformer blocks, a
    final LayerNorm; ``body`` returns the last position (the features), ``head``
    the unembedding Linear (d -> P)."""
    import torch
    import torch.nn as nn

    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(P + 1, d)  # token P is "="
            self.pos = nn.Parameter(torch.randn(3, d) * 0.02)
            layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d)

        def forward(self, tokens):
            h = self.blocks(self.embed(tokens) + self.pos)
            return self.norm(h[:, -1])

    return C.net_class()(Body(), nn.Linear(d, P))


def arguments(argv: Optional[List[str]]) -> Any:
    ap = C.parser(__doc__.splitlines()[0])
    ap.add_argument("--paper", action="store_true", help="the paper's setting (mod 97, wd 1, 40%% of the pairs)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (quick 30, full 3000, paper 30000)")
    ap.add_argument("--P", type=int, default=None, help="the modulus (a prime)")
    ap.add_argument("--frac", type=float, default=None, help="training fraction of the P^2 pairs")
    ap.add_argument("--every", type=int, default=None, help="measure every this many steps")
    ap.add_argument("--d", type=int, default=None, help="model width (features p = d)")
    ap.add_argument("--heads", type=int, default=None, help="attention heads")
    ap.add_argument("--ff", type=int, default=None, help="MLP width of each block")
    ap.add_argument("--lr", type=float, default=None, help="AdamW learning rate (after the warmup)")
    ap.add_argument("--wd", type=float, default=None, help="AdamW weight decay")
    ap.add_argument("--alpha", type=float, default=None, help="output scale: alpha * (f - f_0); larger = lazier")
    ap.add_argument("--scale-lr", action="store_true",
                    help="divide lr by alpha (weight decay unchanged): Adam's steps are normalised, so the output "
                         "then moves as at alpha = 1, gradient and decay alike, while the parameters move alpha "
                         "times less (the lazy limit as alpha grows)")
    ap.add_argument("--warmup", type=int, default=None, help="linear learning-rate warmup steps")
    ap.add_argument("--clip", type=float, default=None, help="gradient-norm clipping (0: none)")
    ap.add_argument("--rank-every", type=int, default=None,
                    help="finish DLR at several rank cuts every this many steps (a multiple of --every)")
    ap.add_argument("--checkpoint-every", type=int, default=None,
                    help="checkpoint and write the partial JSON every this many steps (a multiple of --every)")
    ap.add_argument("--checkpoint-dir", default=None, help="checkpoint folder (default <out>/checkpoints)")
    ap.add_argument("--stop-after-jump", type=float, default=0.0, metavar="K",
                    help="end the run at the first checkpoint at or past K times the test-jump step (0: run all steps)")
    ap.add_argument("--resume", action="store_true", help="continue from this run's checkpoint")
    ap.add_argument("--overlay", nargs="+", default=None, metavar="JSON",
                    help="only plot these result files on one step axis (to <out>/grokking_<tag>.png)")
    args = ap.parse_args(argv)
    if args.threads is None:
        args.threads = 1  # one core per run: the machine is shared
    if args.checkpoint_dir is None:
        args.checkpoint_dir = os.path.join(args.out, "checkpoints")
    return args


def settings(args: Any) -> Dict[str, Any]:
    cfg = dict(PRESETS["quick" if args.quick else "paper" if args.paper else "full"])
    for key in ("P", "d", "heads", "ff", "frac", "lr", "wd", "alpha", "steps", "every", "warmup", "clip",
                "rank_every", "checkpoint_every"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    cfg["seed"] = args.seed
    cfg["scale_lr"] = bool(args.scale_lr)
    if args.scale_lr:
        cfg["lr"] = cfg["lr"] / cfg["alpha"]
    for key in ("rank_every", "checkpoint_every"):
        if cfg[key] % cfg["every"]:
            raise SystemExit(f"--{key.replace('_', '-')} {cfg[key]} must be a multiple of --every {cfg['every']}")
    if cfg["alpha"] <= 0:
        raise SystemExit(f"--alpha must be positive, got {cfg['alpha']}")
    return cfg


def jump_summary(history: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Memorisation (first record with train accuracy >= 99%), the test jump
    (first record with test accuracy >= 95%) and DLR around them."""
    mem = next((h for h in history if h["train_acc"] >= 0.99), None)
    jump = next((h for h in history if h["test_acc"] >= 0.95), None)
    out: Dict[str, Any] = {"memorised_step": mem["step"] if mem else None,
                           "test_jump_step": jump["step"] if jump else None, "grokked": jump is not None}
    if jump is not None:
        last = history[-1]["step"]
        out["steps_over_jump"] = round(last / max(jump["step"], 1), 2)
        half = next((h for h in history if h["test_acc"] >= 0.5), jump)
        out["test_half_step"] = half["step"]
    return out


POINT_FIELDS = ("step", "train_acc", "test_acc", "dlr", "dlr_normalized", "test_dlr", "rank", "effective_dim", "nc1",
                "rankme", "alpha_req", "participation_ratio")


def readings(run: Dict[str, Any]) -> Dict[str, Any]:
    """The records at memorisation, just before the test rise (the last record
    with test accuracy below the plateau + 10 points; the plateau is the test
    accuracy at memorisation, the pairs whose swap was trained on), at the
    jump (test >= 95%) and at 2x and 3x the jump step, and the last record;
    with the rank-cut sweeps nearest to them."""
    h = run["history"]
    summary = jump_summary(h)
    out: Dict[str, Any] = {"settings": run["settings"], "tag": run.get("args", {}).get("tag"), **summary,
                           "last_step": h[-1]["step"], "points": {}}
    mem = next((r for r in h if r["train_acc"] >= 0.99), None)
    if mem is None:
        return out
    plateau = mem["test_acc"]
    rise = next((r for r in h if r["step"] > mem["step"] and r["test_acc"] >= plateau + 0.1), None)
    points = {"memorised": mem}
    if rise is not None:
        before = [r for r in h if mem["step"] <= r["step"] < rise["step"]]
        points["before_rise"] = before[-1]
        out["plateau_dlr_range"] = [min(r["dlr"] for r in before), max(r["dlr"] for r in before)]
    jump = summary["test_jump_step"]
    if jump is not None:
        for name, step in (("jump", jump), ("2x_jump", 2 * jump), ("3x_jump", 3 * jump)):
            at = [r for r in h if r["step"] >= step]
            if at:
                points[name] = at[0]
    points["last"] = h[-1]
    out["plateau_test_acc"] = plateau
    out["points"] = {k: {f: v.get(f) for f in POINT_FIELDS} for k, v in points.items()}
    cuts = run.get("rank_cuts") or []
    if cuts:
        for name, v in out["points"].items():
            near = min(cuts, key=lambda c: abs(c["step"] - v["step"]))
            v["rank_cuts"] = near
    return out


def _save_atomic(obj: Any, path: str) -> None:
    import torch

    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def run(args: Any) -> Dict[str, Any]:
    import torch
    import richness
    from richness.finish import isotropic_dlr

    torch = C.setup(args)
    started = time.time()
    cfg = settings(args)
    dev = args.device
    P = cfg["P"]
    a, b = torch.meshgrid(torch.arange(P), torch.arange(P), indexing="ij")
    a, b = a.reshape(-1), b.reshape(-1)
    tokens = torch.stack([a, b, torch.full_like(a, P)], 1).to(dev)
    labels = ((a + b) % P).to(dev)
    perm = torch.randperm(P * P, generator=torch.Generator().manual_seed(args.seed)).to(dev)
    n_tr = int(cfg["frac"] * P * P)
    x_tr, y_tr, x_te, y_te = tokens[perm[:n_tr]], labels[perm[:n_tr]], tokens[perm[n_tr:]], labels[perm[n_tr:]]
    torch.manual_seed(args.seed)
    model = transformer(P, cfg["d"], cfg["heads"], cfg["ff"]).to(dev)
    with torch.no_grad():  # f_0 on the fixed inputs: the centring of alpha * (f - f_0)
        f0_tr, f0_te = model(x_tr), model(x_te)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["wd"], betas=(0.9, 0.98))
    warm = max(cfg["warmup"], 0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    history: List[Dict[str, Any]] = []
    rank_cuts: List[Dict[str, Any]] = []
    start, elapsed = 0, 0.0
    stem = C.stem(args, NAME)
    ckpt_path = os.path.join(args.checkpoint_dir, f"{stem}.pt")
    if args.resume:
        if not os.path.exists(ckpt_path):
            raise SystemExit(f"--resume: no checkpoint at {ckpt_path}")
        ck = torch.load(ckpt_path, map_location=dev, weights_only=False)
        differ = {k: (ck["settings"].get(k, False), cfg[k]) for k in FIXED if ck["settings"].get(k, False) != cfg[k]}
        if differ:
            raise SystemExit(f"--resume: the checkpoint was made with other settings (checkpoint, now): {differ}")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        f0_tr, f0_te = ck["f0_tr"].to(dev), ck["f0_te"].to(dev)
        torch.set_rng_state(ck["rng"])
        if ck.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(ck["cuda_rng"])
        history, rank_cuts, start, elapsed = ck["history"], ck["rank_cuts"], ck["step"], ck["seconds"]
        C.log(f"resumed at step {start} ({len(history)} records)")
    alpha = cfg["alpha"]

    def scaled(x, f0):
        return alpha * (model(x) - f0)

    def accuracy_and_active(x, y, f0):
        """Accuracy of alpha (f - f_0) and the number of active features
        (variance above rtol times the largest, as the isotropic reference counts them)."""
        was = model.training
        model.eval()
        with torch.no_grad():
            feats = model.body(x)
            acc = float(((alpha * (model.head(feats) - f0)).argmax(1) == y).float().mean())
            var = feats.double().var(0)
        model.train(was)
        return acc, var

    rtol_ref = {}

    def add_reference(rec: Dict[str, Any], var, prefix: str = "") -> None:
        rtol = rtol_ref["rtol"]
        p_active = int((var > rtol * var.max()).sum())
        rank, dlr = rec.get(prefix + "rank"), rec.get(prefix + "dlr")
        iso = isotropic_dlr(rec[prefix + "n"], p_active, rank) if rank else None
        rec[prefix + "active_features"] = p_active
        rec[prefix + "dlr_isotropic"] = C._f(iso)
        rec[prefix + "dlr_normalized"] = C._f(dlr / iso) if dlr is not None and iso else None

    def rank_sweep(step: int) -> None:
        """DLR on the training pairs finished at several rank cuts (one pass, one Moments)."""
        was = model.training
        model.eval()
        with torch.no_grad():
            feats = model.body(x_tr)
        model.train(was)
        m = richness.Moments(P)
        m.update(feats, labels=y_tr)
        row: Dict[str, Any] = {"step": step, "cuts": []}
        for factor in RTOL_FACTORS:
            rep = m.compute(head_weights=model.head, rtol=rtol_ref["rtol"] * factor, spectrum=False)
            row["cuts"].append({"rtol": rtol_ref["rtol"] * factor, "dlr": C._f(rep.dlr), "rank": rep.rank})
        rank_cuts.append(row)

    def record(step: int, loss: float, rec_tr: Dict[str, Any], rec_te: Dict[str, Any]) -> None:
        train_acc, var_tr = accuracy_and_active(x_tr, y_tr, f0_tr)
        test_acc, var_te = accuracy_and_active(x_te, y_te, f0_te)
        row = {"step": step, "train_loss": C._f(loss), "train_acc": train_acc, "test_acc": test_acc,
               "lr": opt.param_groups[0]["lr"]}
        for key in ("n", "dlr", "rank", "nc1", "effective_dim") + C.DIAGNOSTICS:
            row[key] = rec_tr.get(key)
            row["test_" + key] = rec_te.get(key)
        add_reference(row, var_tr)
        add_reference(row, var_te, "test_")
        row["seconds"] = round(elapsed + time.time() - t_run, 1)
        history.append(row)
        if step % cfg["rank_every"] == 0:
            rank_sweep(step)
        C.log(f"step {step:6d}  loss {loss:.4f}  DLR {_s(row['dlr'])} (test {_s(row['test_dlr'])}, "
              f"iso {_s(row['dlr_isotropic'])})  rank {row['rank']}  eff.dim {_s(row['effective_dim'], 1)}  "
              f"train {train_acc:.3f}  test {test_acc:.3f}  ({row['seconds']:.0f} s)")

    t_run = time.time()
    if start == 0:
        # Step 0, before any update: the same finishing as the Monitor's Probe route.
        reps = [richness.evaluate(model, [(x, y)], head="head", progress=False) for x, y in ((x_tr, y_tr), (x_te, y_te))]
        rtol_ref["rtol"] = reps[0].rtol
        cfg["rtol"] = reps[0].rtol
        as_rec = lambda r: {"n": r.n, "dlr": C._f(r.dlr), "rank": r.rank, "nc1": C._f(r.nc1),  # noqa: E731
                            "effective_dim": C._f(r.effective_dim),
                            **{name: C._f(getattr(r, name)) for name in C.DIAGNOSTICS}}
        record(0, float("nan"), as_rec(reps[0]), as_rec(reps[1]))
    else:
        rtol_ref["rtol"] = ck["settings"]["rtol"]
        cfg["rtol"] = rtol_ref["rtol"]

    def checkpoint(step: int) -> None:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        _save_atomic({"settings": cfg, "step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
                      "scheduler": sched.state_dict(), "f0_tr": f0_tr, "f0_te": f0_te, "rng": torch.get_rng_state(),
                      "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                      "history": history, "rank_cuts": rank_cuts, "seconds": elapsed + time.time() - t_run},
                     ckpt_path)

    def payload(step: int) -> Dict[str, Any]:
        return {"settings": {**cfg, "n_train": n_tr, "n_test": P * P - n_tr}, "step": step,
                "complete": step >= cfg["steps"], **jump_summary(history), "history": history,
                "rank_cuts": rank_cuts, "data": f"modular addition (a + b) mod {P}: all {P * P} pairs, "
                                                f"{n_tr} for training",
                "paper": {"before": {"dlr": 0.51, "test_acc": 0.052}, "after": {"dlr": 0.11, "test_acc": 0.998}},
                "measured_on": "training and held-out pairs, last position; head = unembedding",
                "train_seconds": round(elapsed + time.time() - t_run, 1)}

    pending: Dict[str, Any] = {}
    mon_tr = richness.Monitor(model, richness.Probe((x_tr, y_tr), every=cfg["every"]), head="head",
                              first_step=start + 1, log=lambda r: pending.__setitem__("tr", r))
    mon_te = richness.Monitor(model, richness.Probe((x_te, y_te), every=cfg["every"]), head="head",
                              first_step=start + 1, log=lambda r: pending.__setitem__("te", r))
    with mon_tr, mon_te:
        model.train()
        for step in range(start + 1, cfg["steps"] + 1):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(scaled(x_tr, f0_tr), y_tr)
            loss.backward()
            if cfg["clip"] > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
            opt.step()
            sched.step()
            mon_tr.step(labels=y_tr)
            mon_te.step(labels=y_te)
            if pending:
                record(step, float(loss.detach()), pending.pop("tr"), pending.pop("te"))
            if step % cfg["checkpoint_every"] == 0 or step == cfg["steps"]:
                jump = jump_summary(history)["test_jump_step"]
                if args.stop_after_jump > 0 and jump is not None and step >= args.stop_after_jump * jump:
                    cfg["steps"] = step  # the run ends here: its length was set by the jump
                checkpoint(step)
                C.write_json(args, NAME, payload(step), started)
                if step == cfg["steps"]:
                    break
    out = payload(cfg["steps"])
    C.write_json(args, NAME, out, started)
    plot([out], args, NAME)
    return out


def _s(v: Optional[float], digits: int = 4) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def plot(runs: List[Dict[str, Any]], args: Any, name: str) -> str:
    """DLR (training pairs), DLR / DLR_iso and test accuracy; the span's rank
    (over the number of classes) and the effective dimension (over d); DLR at
    coarser rank cuts. One step axis, runs overlaid."""
    plt = C.pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    many_d = len({r["settings"]["d"] for r in runs}) > 1
    for i, run in enumerate(runs):
        h = run["history"]
        st = [r["step"] for r in h]
        s = run["settings"]
        lab = f"seed {s['seed']}" + (f", d {s['d']}" if many_d else "")
        col = f"C{i}"
        axes[0].plot(st, [r["dlr"] for r in h], "-", color=col, lw=1.8, label=f"DLR ({lab})")
        axes[0].plot(st, [r["dlr_normalized"] for r in h], "--", color=col, lw=1.0,
                     label="DLR / DLR_iso" if i == 0 else None)
        axes[0].plot(st, [r["test_acc"] for r in h], ":", color=col, lw=1.5, label="test accuracy" if i == 0 else None)
        axes[1].plot(st, [r["rank"] / s["P"] if r["rank"] is not None else None for r in h], "-", color=col,
                     label=f"span rank / C ({lab})")
        axes[1].plot(st, [r["effective_dim"] / s["d"] if r["effective_dim"] else None for r in h], "--", color=col,
                     lw=1.0, label="effective dim / d" if i == 0 else None)
        cuts = run.get("rank_cuts") or []
        for j, (factor, style) in enumerate(((1.0, "-"), (1e2, "--"), (1e3, ":"))):
            pts = [(c["step"], cut["dlr"]) for c in cuts for cut in c["cuts"]
                   if math.isclose(cut["rtol"], s["rtol"] * factor)]
            if pts:
                axes[2].plot(*zip(*pts), style, color=col, marker=".",
                             label=f"rtol {s['rtol'] * factor:.0e}" if i == 0 else None)
        if run.get("test_jump_step") is not None:
            for ax in axes:
                ax.axvline(run["test_jump_step"], color=col, lw=0.6, alpha=0.6)
    s = runs[0]["settings"]
    axes[0].set_ylim(0, 1.35)
    axes[0].set_title(f"mod {s['P']}, {s['frac']:.0%} of pairs, d {s['d']}, wd {s['wd']:g}, alpha {s['alpha']:g} "
                      "(vertical lines: test >= 95%)", fontsize=9)
    axes[1].set_ylim(0, 1.05)
    axes[2].set_ylim(0, None)
    axes[2].set_ylabel("DLR at rank cut", fontsize=8)
    axes[2].set_xlabel("step (full batch, AdamW)")
    for ax in axes:
        ax.legend(fontsize=7, ncol=2)
    return C.save_figure(fig, args, name)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = arguments(argv)
    if args.overlay:
        started = time.time()
        runs = []
        for path in args.overlay:
            with open(path) as fh:
                runs.append(json.load(fh))
        os.makedirs(args.out, exist_ok=True)
        plot(runs, args, NAME)
        out = {"overlay": [os.path.basename(p) for p in args.overlay], "readings": [readings(r) for r in runs]}
        for path, r in zip(out["overlay"], out["readings"]):
            C.log(f"{path}: memorised {r['memorised_step']}, test >= 95% at {r['test_jump_step']}, "
                  f"last step {r['last_step']}")
            for name, v in r["points"].items():
                C.log(f"  {name:12s} step {v['step']:6d}  test {v['test_acc']:.3f}  DLR {_s(v['dlr'])}  "
                      f"DLR/iso {_s(v['dlr_normalized'])}  test DLR {_s(v['test_dlr'])}  rank {v['rank']}  "
                      f"eff.dim {_s(v['effective_dim'], 1)}  NC1 {_s(v['nc1'])}")
        C.write_json(args, NAME, out, started)
        return out
    return run(args)


if __name__ == "__main__":
    main()
