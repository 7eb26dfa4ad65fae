"""SFT step time and examples/s for the tiny, small and base presets on this machine.

    python bench/sft_step.py [--presets tiny,small,base] [--batch 16]

A step = forward + backward + clip + AdamW step on a batch of synthetic-task examples (the demo's
data shapes). Prints a table and saves bench/results/sft_step.json with the machine description.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import save  # noqa: E402

from rlt2t.common.collate import collate_seq2seq, encode_texts  # noqa: E402
from rlt2t.common.config import ModelConfig, SFTConfig  # noqa: E402
from rlt2t.common.policy import load_policy  # noqa: E402
from rlt2t.common.synth import generate_synthetic  # noqa: E402
from rlt2t.common.tokenization import build_ids_tokenizer, save_tokenizer  # noqa: E402
from rlt2t.common.tracking import quiet_transformers  # noqa: E402
from rlt2t.learner.stages import make_sft_step  # noqa: E402

ID_VOCAB = 1894
"""The ids tokenizer's vocabulary of these benchmarks' synthetic-task models."""


class _Acc:  # the step function only needs accelerator.backward
    @staticmethod
    def backward(loss):
        loss.backward()


def bench(preset: str, tok_dir: Path, batch: int, warmup: int, steps: int) -> dict:
    policy = load_policy(ModelConfig(preset=preset), tok_dir, seed=0)
    model = policy.model.train()
    examples = generate_synthetic(batch * 4, seed=1)
    src, _ = encode_texts(policy.tokenizer, [e.source for e in examples], 128)
    tgt, _ = encode_texts(policy.tokenizer, [e.target for e in examples], 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = make_sft_step(SFTConfig(), model)
    times = []
    for i in range(warmup + steps):
        j = (i * batch) % len(src)
        b = collate_seq2seq(src[j : j + batch], tgt[j : j + batch], policy.tokenizer.pad_token_id)
        t0 = time.perf_counter()
        step(model, b, _Acc)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"preset": preset, "parameters_m": round(policy.num_parameters() / 1e6, 2), "batch": batch,
            "steps_timed": steps, "step_s_median": round(med, 4), "step_s_min": round(min(times), 4),
            "examples_per_s": round(batch / med, 1),
            "mean_source_tokens": round(sum(map(len, src)) / len(src), 1),
            "mean_target_tokens": round(sum(map(len, tgt)) / len(tgt), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny,small,base")
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    quiet_transformers()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        save_tokenizer(build_ids_tokenizer(ID_VOCAB), tmp)
        for preset in args.presets.split(","):
            warmup, steps = (1, 4) if preset == "base" else (3, 15)
            rows.append(bench(preset, Path(tmp), args.batch, warmup, steps))
            r = rows[-1]
            print(f"{r['preset']:>6}  {r['parameters_m']:>7.2f}M params  step {r['step_s_median'] * 1000:8.1f} ms  "
                  f"{r['examples_per_s']:8.1f} examples/s  (batch {r['batch']})", flush=True)
    print("saved", save("sft_step", {"benchmark": "sft_step", "results": rows}))


if __name__ == "__main__":
    main()
