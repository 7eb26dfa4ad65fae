"""SFT from a warm start (EncoderDecoderModel from all-MiniLM-L6-v2, Rothe et al. 2020) vs the from-scratch
`small` preset, on the WordNet definition-modelling task, with the same budget of process CPU seconds.

    python bench/warm_start.py [--cpu-budget 360] [--size 8000] [--workdir runs/bench-warm-start]

Arms (both: SFT through rlt2t.jobs.sft_job, batch 16, one torch thread, no validation monitor during training):
  scratch  tokenizer.kind=subword (byte-level BPE trained on the training file), model.preset=small (BART family);
  warm     `rlt2t warm-start --encoder all-MiniLM-L6-v2` (encoder and decoder from MiniLM, fresh cross-attention),
           tokenizer.kind=pretrained (MiniLM's WordPiece).
Budget: each arm's CPU seconds per SFT step are measured on its own model and batches first (3 warm-up + 6 timed
steps), then it trains for budget / (seconds per step) steps; the CPU seconds each SFT job really used (setup and
checkpoint writes included) are reported beside it. CPU seconds, not wall-clock: the development machine is shared
and its wall clock says more about the neighbours than about the models. Then greedy decoding of the validation and
test splits (task score (1 - w)·CIDEr-D + w·BLEU-4 with w = metric.bleu_weight, CIDEr-D, BLEU-4).
Saves bench/results/warm_start.json with the machine description.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import save  # noqa: E402

from rlt2t.cmd_warm_start import MINILM, encoder_directory  # noqa: E402
from rlt2t.common.collate import encode_examples  # noqa: E402
from rlt2t.common.config import Config, load_config  # noqa: E402
from rlt2t.common.families import warm_start  # noqa: E402
from rlt2t.common.io import atomic_directory  # noqa: E402
from rlt2t.common.policy import load_policy  # noqa: E402
from rlt2t.common.tokenization import load_tokenizer, save_tokenizer  # noqa: E402
from rlt2t.common.tracking import quiet_transformers  # noqa: E402
from rlt2t.jobs import build_tokenizer_job, eval_job, load_split, make_wordnet_data, sft_job  # noqa: E402
from rlt2t.learner.stages import make_collate, make_sft_step  # noqa: E402

BATCH = 16


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process so far, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Acc:  # the step function only needs accelerator.backward
    @staticmethod
    def backward(loss):
        loss.backward()


def seconds_per_step(cfg: Config, warmup: int = 3, timed: int = 6) -> float:
    """Median CPU seconds of one SFT step (forward, backward, clip, AdamW) of this arm on its training batches."""
    policy = load_policy(cfg.model, cfg.tokenizer_dir, seed=cfg.run.seed)
    model = policy.model.train()
    train = load_split(cfg, "train")[: BATCH * (warmup + timed)]
    enc = encode_examples(policy.tokenizer, [e.source for e in train], [e.target for e in train],
                          cfg.data.max_source_len, cfg.data.max_target_len)
    collate = make_collate(policy.tokenizer.pad_token_id, model.config)
    step = make_sft_step(cfg.sft, model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft.lr)
    times = []
    for i in range(warmup + timed):
        items = [{"input_ids": s, "labels": t} for s, t in
                 zip(enc.sources[i * BATCH:(i + 1) * BATCH], enc.targets[i * BATCH:(i + 1) * BATCH], strict=True)]
        t0 = cpu_seconds()
        step(model, collate(items), _Acc)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.sft.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(cpu_seconds() - t0)
    return statistics.median(times)


def arm_config(work: Path, data: Path, name: str, extra: list[str]) -> Config:
    return load_config([], [
        f"run.dir={work / name}", f"data.train={data}/train.jsonl", f"data.valid={data}/valid.jsonl",
        f"data.test={data}/test.jsonl", "run.threads=1", "run.progress=false", "run.log_every=50",
        f"sft.batch_size={BATCH}", "sft.epochs=100", "sft.warmup_ratio=0.05", "metric.monitor_size=0",
        "eval.max_new_tokens=48", "eval.batch_size=32", *extra,
    ])


def run_arm(name: str, cfg: Config, budget: float) -> dict:
    per_step = seconds_per_step(cfg)
    steps = max(1, int(budget / per_step))
    cfg.sft.max_steps = steps
    t0, w0 = cpu_seconds(), time.perf_counter()
    sft_job(cfg)
    used, wall = cpu_seconds() - t0, time.perf_counter() - w0
    row = {"arm": name, "parameters_m": None, "cpu_s_per_step": round(per_step, 3), "steps": steps,
           "examples_seen": steps * BATCH, "sft_cpu_s": round(used, 1), "sft_wall_s": round(wall, 1)}
    for split in ("valid", "test"):
        cfg.eval.split = split
        metrics = eval_job(cfg, label=f"{name}")
        row[split] = {k: round(v, 4) for k, v in metrics.items()}
    row["parameters_m"] = round(load_policy(cfg.model, cfg.tokenizer_dir).num_parameters() / 1e6, 2)
    print(f"{name:>8}: {row['parameters_m']}M params, {per_step:.2f} CPU-s/step, {steps} steps "
          f"({used:.0f} CPU-s used); valid task {row['valid']['task_score']:.4f}, test task "
          f"{row['test']['task_score']:.4f}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-budget", type=float, default=360.0, help="SFT CPU seconds per arm")
    ap.add_argument("--size", type=int, default=8000, help="WordNet rows (train + valid + test)")
    ap.add_argument("--workdir", default="runs/bench-warm-start")
    ap.add_argument("--warm-lr", type=float, default=1e-4, help="SFT peak learning rate of the warm start")
    ap.add_argument("--scratch-lr", type=float, default=1e-3, help="SFT peak learning rate of the scratch model")
    ap.add_argument("--eval-limit", type=int, default=0, help="decode only the first N of each split (0: all)")
    args = ap.parse_args()
    quiet_transformers()
    torch.set_num_threads(1)
    work = Path(args.workdir).resolve()
    data = work / "data"
    base = load_config([], [f"run.dir={work}"])
    if not (data / "train.jsonl").is_file():
        make_wordnet_data(base, size=args.size)
    limit = [f"eval.limit={args.eval_limit}"]

    scratch = arm_config(work, data, "scratch", ["tokenizer.kind=subword", "model.preset=small", "model.family=bart",
                                                  f"sft.lr={args.scratch_lr}", *limit])
    if not scratch.tokenizer_dir.is_dir():
        build_tokenizer_job(scratch)

    model_dir = work / "minilm2minilm"
    if not (model_dir / "config.json").is_file():
        encoder = encoder_directory(MINILM)
        tok = load_tokenizer(encoder)
        with atomic_directory(model_dir) as tmp:
            warm_start(encoder, tok).save_pretrained(tmp)
            save_tokenizer(tok, tmp)
    warm = arm_config(work, data, "warm", [f"model.path={model_dir}", "model.preset=null",
                                           "tokenizer.kind=pretrained", f"tokenizer.path={model_dir}",
                                           f"sft.lr={args.warm_lr}", *limit])

    rows = [run_arm("scratch", scratch, args.cpu_budget), run_arm("warm", warm, args.cpu_budget)]
    payload = {
        "benchmark": "warm_start", "task": "WordNet definition modelling (rlt2t data wordnet)",
        "rows": args.size, "budget": {"kind": "process CPU seconds of SFT steps", "cpu_s": args.cpu_budget},
        "batch": BATCH, "torch_threads": 1, "decoding": "greedy", "eval_limit": args.eval_limit,
        "bleu_weight": base.metric.bleu_weight, "results": rows,
    }
    print("saved", save("warm_start", payload))


if __name__ == "__main__":
    main()
