"""Learner step time of the group policy gradients: shared encoder (one encoder pass for the K samples of
each source) vs K full passes (each re-encoding the source).

    python bench/group_step.py [--steps 6] [--warmup 2] [--k 6] [--threads 0] [--device cuda]

A step = zero_grad + forward of K label rows per source + the clipped policy loss (GRPO advantages, token
mean) + backward + AdamW step, on bench/learner_step.py's BART (d_model 512, 6+6 layers, 8 heads, FFN
2048, vocabulary 2000), dropout off as in the policy-gradient learner. Batch 8 sources of 128 random ids,
K = 6 samples of 48 ids each. Both variants train their own copy of the same weights; steps are
interleaved so machine drift hits both alike; medians are reported. The encoder is a third of the model's
FLOPs per source and the naive variant repeats it K times, so the arithmetic limit is about 2.1x at K = 6;
issue target: >= 1.8x. Saves bench/results/group_step.json (group_step_<device>.json off the CPU, or
--name) with the machine description. On a GPU each step is timed after torch.cuda.synchronize.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learner_step import FIRST_DATA_ID, VOCAB, bench_model  # noqa: E402
from machine_info import save  # noqa: E402

from rlt2t.common.tracking import quiet_transformers  # noqa: E402
from rlt2t.learner.group_step import GroupOutput, group_forward, naive_group_forward  # noqa: E402
from rlt2t.learner.losses import clipped_policy_loss, normalised_advantages  # noqa: E402

TARGET_SPEEDUP = 1.8
Forward = Callable[..., GroupOutput]


def bench_batch(size: int, k: int, source_len: int, target_len: int, seed: int, device: torch.device):
    g = torch.Generator().manual_seed(seed)
    sources = torch.randint(FIRST_DATA_ID, VOCAB, (size, source_len), generator=g)
    labels = torch.randint(FIRST_DATA_ID, VOCAB, (k * size, target_len), generator=g)
    labels[:, -1] = 2  # EOS
    rewards = torch.rand(size, k, generator=g)
    batch = sources, torch.ones_like(sources), labels, normalised_advantages(rewards).t().reshape(-1)
    return tuple(t.to(device) for t in batch)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(forward: Forward, model, opt, batch, k: int) -> float:
    sources, mask, labels, advantages = batch
    sync(sources.device)
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    logits = forward(model, sources, mask, labels, k).logits
    logp = logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    loss, _ = clipped_policy_loss(logp, logp.detach(), advantages, torch.ones_like(labels), 0.2)
    loss.backward()
    opt.step()
    sync(sources.device)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--batch", type=int, default=8, help="sources per step")
    ap.add_argument("--k", type=int, default=6, help="samples per source")
    ap.add_argument("--source-len", type=int, default=128)
    ap.add_argument("--target-len", type=int, default=48)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--name", default=None, help="results file name (default group_step, or group_step_cuda)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch.cuda.is_available() is False on this machine")
    quiet_transformers()
    if args.threads:
        torch.set_num_threads(args.threads)
    base = bench_model(seed=0).eval().to(device)  # dropout off, as the policy-gradient learner runs
    batch = bench_batch(args.batch, args.k, args.source_len, args.target_len, seed=1, device=device)
    with torch.no_grad():
        shared = group_forward(base, *batch[:3], args.k).logits
        naive = naive_group_forward(base, *batch[:3], args.k).logits
        gap = (shared - naive).abs().max().item()
    variants = {"shared_encoder": (group_forward, base), "naive": (naive_group_forward, copy.deepcopy(base))}
    opts = {name: torch.optim.AdamW(model.parameters(), lr=1e-5) for name, (_, model) in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(args.warmup + args.steps):
        now = {name: timed_step(fn, model, opts[name], batch, args.k) for name, (fn, model) in variants.items()}
        if i >= args.warmup:
            for name, seconds in now.items():
                times[name].append(seconds)
        print(f"step {i + 1}/{args.warmup + args.steps}{' (warmup)' if i < args.warmup else ''}: "
              + "  ".join(f"{n} {s:.3f}s" for n, s in now.items()), flush=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    speedup = med["naive"] / med["shared_encoder"]
    verdict = "meets" if speedup >= TARGET_SPEEDUP else "misses"
    print(f"\nK={args.k}, batch {args.batch}, source {args.source_len}, targets {args.target_len}, "
          f"{args.device}, {torch.get_num_threads()} threads: shared {med['shared_encoder'] * 1000:.0f} ms, naive "
          f"{med['naive'] * 1000:.0f} ms, speedup {speedup:.2f}x ({verdict} the {TARGET_SPEEDUP}x target); "
          f"max logit gap {gap:.1e}")
    if args.no_save:
        return
    name = args.name or ("group_step" if device.type == "cpu" else f"group_step_{device.type}")
    print("saved", save(name, {
        "benchmark": "group_step", "device": args.device, "k": args.k, "batch": args.batch,
        "source_len": args.source_len, "target_len": args.target_len, "threads": torch.get_num_threads(),
        "steps_timed": args.steps,
        "model": {"d_model": 512, "layers": "6+6", "heads": 8, "ffn": 2048, "vocab": VOCAB},
        "step": "zero_grad + K-row forward + clipped policy loss (GRPO advantages) + backward + AdamW step",
        "step_s": {n: [round(t, 4) for t in ts] for n, ts in times.items()},
        "step_s_median": {n: round(m, 4) for n, m in med.items()}, "speedup_median": round(speedup, 3),
        "target_speedup": TARGET_SPEEDUP, "meets_target": speedup >= TARGET_SPEEDUP, "max_logit_gap": gap}))


if __name__ == "__main__":
    main()
