"""Learner step time of the rank-RL loss: shared encoder (one encoder pass) vs naive (three full passes).

    python bench/learner_step.py [--family bart|t5] [--steps 6] [--warmup 2] [--threads 0]

A step = zero_grad + forward (CE(gold) + 0.2 * rank loss) + backward + AdamW step, on a BART with
d_model 512, 6+6 layers, 8 heads, FFN 2048 and a vocabulary of 2000 (built from a BartConfig, dropout
on, train mode), or with ``--family t5`` a T5 of the t5-small shape (d_model 512, 6+6 layers, 8 heads of 64,
FFN 2048 ReLU, relative attention with 32 buckets, tied embeddings, vocabulary 2000; saved as
learner_step_t5.json). Batch 8, sources of 128 random ids; gold, a and b labels 48 ids long, a and b equal up
to position 9 and different from position 10 on. Each variant trains its own copy of the same initial
weights with its own AdamW. Steps are interleaved (shared, naive, shared, naive, ...) so that machine
drift hits both alike; medians are reported. Issue target: speedup (naive / shared) >= 1.7x.
Saves bench/results/learner_step.json with the machine description.
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
from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import save  # noqa: E402

from rlt2t.common.tracking import quiet_transformers  # noqa: E402
from rlt2t.learner.rank_step import RankBatch, RankLossOutput, naive_rank_loss, shared_encoder_rank_loss  # noqa: E402

VOCAB = 2000
FIRST_DATA_ID = 4  # ids 0-3 are BartConfig's bos/pad/eos/unk defaults: keep random text off them
TARGET_SPEEDUP = 1.7
LossFn = Callable[..., RankLossOutput]


def bench_model(seed: int, family: str = "bart") -> BartForConditionalGeneration | T5ForConditionalGeneration:
    """The benchmark's BART (d_model 512, 6+6 layers, 8 heads, FFN 2048, vocab 2000) or T5 (t5-small's shape,
    vocab 2000), in train mode."""
    torch.manual_seed(seed)
    if family == "t5":
        return T5ForConditionalGeneration(T5Config(
            vocab_size=VOCAB, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6, num_heads=8,
            relative_attention_num_buckets=32, feed_forward_proj="relu", dropout_rate=0.1, pad_token_id=0,
            eos_token_id=1, decoder_start_token_id=0,
        )).train()
    config = BartConfig(
        vocab_size=VOCAB, d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
        decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, max_position_embeddings=256,
        dropout=0.1, normalize_before=False,
    )
    return BartForConditionalGeneration(config).train()


def bench_batch(batch: int, source_len: int, target_len: int, diverge_at: int, seed: int,
                eos: int = BartConfig().eos_token_id) -> RankBatch:
    """Random ids: sources [B, S], gold / a / b labels [B, T] ending with EOS, a != b from `diverge_at` on."""
    if not 0 <= diverge_at < target_len - 1:
        raise ValueError(f"diverge_at must be in [0, target_len - 1 = {target_len - 1}), got {diverge_at}")
    g = torch.Generator().manual_seed(seed)

    def ids(rows: int, cols: int) -> torch.Tensor:
        return torch.randint(FIRST_DATA_ID, VOCAB, (rows, cols), generator=g)

    gold, a = ids(batch, target_len), ids(batch, target_len)
    b = a.clone()
    # Shift by a non-zero offset modulo the data range: every position from diverge_at on really differs.
    span = VOCAB - FIRST_DATA_ID
    offset = torch.randint(1, span, (batch, target_len - diverge_at), generator=g)
    b[:, diverge_at:] = (a[:, diverge_at:] - FIRST_DATA_ID + offset) % span + FIRST_DATA_ID
    for labels in (gold, a, b):
        labels[:, -1] = eos
    return RankBatch(input_ids=ids(batch, source_len), attention_mask=torch.ones(batch, source_len, dtype=torch.long),
                     gold_labels=gold, labels_a=a, labels_b=b, use_rank=torch.ones(batch, dtype=torch.bool))


def timed_step(fn: LossFn, model: torch.nn.Module, opt: torch.optim.Optimizer, batch: RankBatch) -> float:
    """Seconds for one zero_grad + forward + backward + AdamW step."""
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    out = fn(model, batch, loss_weight=0.2)
    out.loss.backward()
    opt.step()
    return time.perf_counter() - t0


@torch.no_grad()
def loss_gap(model: torch.nn.Module, batch: RankBatch) -> float:
    """|shared - naive| loss in eval mode (no dropout), where the two must agree: checks like is compared."""
    model.eval()
    gap = (shared_encoder_rank_loss(model, batch).loss - naive_rank_loss(model, batch).loss).abs().item()
    model.train()
    return gap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=["bart", "t5"], default="bart", help="model family (default bart)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per variant (>= 5 for the report; default 6)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--source-len", type=int, default=128)
    ap.add_argument("--target-len", type=int, default=48)
    ap.add_argument("--diverge-at", type=int, default=10, help="first position where a and b differ")
    ap.add_argument("--no-save", action="store_true", help="print only; leave bench/results/ alone")
    args = ap.parse_args()
    for name in ("steps", "batch", "source_len", "target_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.threads < 0:
        ap.error("--warmup and --threads must be >= 0")
    quiet_transformers()
    if args.threads:
        torch.set_num_threads(args.threads)

    base = bench_model(seed=0, family=args.family)
    batch = bench_batch(args.batch, args.source_len, args.target_len, args.diverge_at, seed=1,
                        eos=base.config.eos_token_id)
    gap = loss_gap(base, batch)
    variants: dict[str, tuple[LossFn, torch.nn.Module]] = {
        "shared_encoder": (shared_encoder_rank_loss, base),
        "naive": (naive_rank_loss, copy.deepcopy(base)),
    }
    opts = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, (_, model) in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(args.warmup + args.steps):
        # Interleaved (A B A B ...): a slow patch of the machine costs both variants alike.
        now = {name: timed_step(fn, model, opts[name], batch) for name, (fn, model) in variants.items()}
        if i >= args.warmup:
            for name, seconds in now.items():
                times[name].append(seconds)
        print(f"step {i + 1}/{args.warmup + args.steps}{' (warmup)' if i < args.warmup else ''}: "
              + "  ".join(f"{n} {s:.3f}s" for n, s in now.items()), flush=True)

    med = {name: statistics.median(t) for name, t in times.items()}
    speedup = med["naive"] / med["shared_encoder"]
    pair_ratios = [n / s for s, n in zip(times["shared_encoder"], times["naive"], strict=True)]
    params_m = sum(p.numel() for p in base.parameters()) / 1e6
    print(f"\n{args.family.upper()} {params_m:.1f}M params, batch {args.batch}, source {args.source_len}, "
          f"targets {args.target_len}, {torch.get_num_threads()} threads, {args.steps} timed steps each")
    for name in variants:
        print(f"{name:>15}: median {med[name] * 1000:9.1f} ms   min {min(times[name]) * 1000:9.1f} ms")
    verdict = "meets" if speedup >= TARGET_SPEEDUP else "misses"
    print(f"speedup (naive / shared): {speedup:.2f}x ({verdict} the {TARGET_SPEEDUP}x target); "
          f"per-pair ratios {min(pair_ratios):.2f}-{max(pair_ratios):.2f}; eval-mode loss gap {gap:.2e}")
    if args.no_save:
        return
    payload = {
        "benchmark": "learner_step",
        "model": {"family": args.family, "d_model": 512, "layers": "6+6", "heads": 8, "ffn": 2048, "vocab": VOCAB,
                  "positions": "relative (32 buckets)" if args.family == "t5" else "learned",
                  "parameters_m": round(params_m, 2)},
        "batch": args.batch, "source_len": args.source_len, "target_len": args.target_len,
        "diverge_at": args.diverge_at, "threads": torch.get_num_threads(), "warmup": args.warmup,
        "steps_timed": args.steps, "order": "interleaved shared, naive per step",
        "step": "zero_grad + forward (CE + 0.2*rank, logprobs) + backward + AdamW step",
        "step_s": {name: [round(t, 4) for t in ts] for name, ts in times.items()},
        "step_s_median": {name: round(m, 4) for name, m in med.items()},
        "speedup_median": round(speedup, 3),
        "speedup_per_pair": [round(r, 3) for r in pair_ratios],
        "target_speedup": TARGET_SPEEDUP, "meets_target": speedup >= TARGET_SPEEDUP,
        "eval_mode_loss_gap": gap,
    }
    print("saved", save("learner_step" if args.family == "bart" else f"learner_step_{args.family}", payload))


if __name__ == "__main__":
    main()
