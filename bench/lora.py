"""Full fine-tuning vs LoRA: learner step time, peak memory, and bytes and seconds per weight publish.

    python bench/lora.py [--preset base] [--r 8] [--batch 8] [--steps 5] [--warmup 2] [--name lora]

Each mode runs in a fresh process (peak memory is per process): the `--preset` model from scratch, a learner
step = forward + backward + clip + AdamW step on synthetic-task batches (the SFT step; the trainable
parameters alone in the optimizer). A weight publish is what the learner hands the rollout workers: full
fine-tuning, a CPU copy of the whole state dict (as ``RankLearner.weights``); LoRA, the adapter-only state
dict (``rlt2t.common.lora.adapter_state_dict``). Its seconds = extract the CPU copy + pickle (what the object
store serialises) + unpickle and apply to a worker's model (``load_state_dict`` / ``load_adapter_state_dict``).
Peak memory: ``torch.cuda.max_memory_allocated`` on CUDA, else the process's peak RSS. The RL part (validation
score after the same number of RL steps) needs the RL learner's LoRA wiring and is not measured here.
Prints a table and saves bench/results/<name>.json with the machine description.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import save  # noqa: E402

from rlt2t.common.collate import collate_seq2seq, encode_texts  # noqa: E402
from rlt2t.common.config import LoraConfig, ModelConfig, SFTConfig  # noqa: E402
from rlt2t.common.lora import adapter_state_dict, apply_lora, load_adapter_state_dict, state_dict_bytes  # noqa: E402
from rlt2t.common.policy import load_policy  # noqa: E402
from rlt2t.common.synth import generate_synthetic  # noqa: E402
from rlt2t.common.tokenization import build_ids_tokenizer, save_tokenizer  # noqa: E402
from rlt2t.common.tracking import quiet_transformers  # noqa: E402
from rlt2t.learner.stages import make_sft_step  # noqa: E402


class _Acc:  # the step function only needs accelerator.backward
    @staticmethod
    def backward(loss):
        loss.backward()


def _publish(model, worker, lora: bool) -> tuple[dict, float, int]:
    """One weight publish: (state, seconds, pickled bytes)."""
    t0 = time.perf_counter()
    state = adapter_state_dict(model) if lora else {k: v.detach().to("cpu", copy=True)
                                                    for k, v in model.state_dict().items()}
    blob = pickle.dumps(state, protocol=5)
    received = pickle.loads(blob)
    if lora:
        load_adapter_state_dict(worker, received)
    else:
        worker.load_state_dict(received, strict=True)
    return state, time.perf_counter() - t0, len(blob)


def run_mode(mode: str, args: argparse.Namespace, tok_dir: str) -> dict:
    quiet_transformers()
    torch.set_num_threads(args.threads) if args.threads else None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = ModelConfig(preset=args.preset)
    lora = mode == "lora"
    policy = load_policy(cfg, tok_dir, seed=0)
    worker = load_policy(cfg, tok_dir, seed=1).model
    model = policy.model
    if lora:
        lora_cfg = LoraConfig(enabled=True, r=args.r, alpha=2.0 * args.r)
        model, worker = apply_lora(model, lora_cfg, seed=0), apply_lora(worker, lora_cfg, seed=1)
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    step = make_sft_step(SFTConfig(), model)
    examples = generate_synthetic(args.batch * 4, seed=1)
    src, _ = encode_texts(policy.tokenizer, [e.source for e in examples], 128)
    tgt, _ = encode_texts(policy.tokenizer, [e.target for e in examples], 64)
    times = []
    for i in range(args.warmup + args.steps):
        j = (i * args.batch) % len(src)
        cpu_batch = collate_seq2seq(src[j : j + args.batch], tgt[j : j + args.batch], policy.tokenizer.pad_token_id)
        batch = {k: v.to(device) for k, v in cpu_batch.items()}
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(model, batch, _Acc)
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    publishes = [_publish(model, worker, lora) for _ in range(args.publishes)]
    state = publishes[0][0]
    opt_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"mode": mode, "preset": args.preset, "device": device.type, "lora_r": args.r if lora else None,
            "parameters_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
            "trainable_m": round(sum(p.numel() for p in params) / 1e6, 3), "batch": args.batch,
            "step_s_median": round(statistics.median(times), 4), "step_s_min": round(min(times), 4),
            "peak_memory_mib": round(peak / 2**20, 1), "optimizer_state_mib": round(opt_bytes / 2**20, 2),
            "publish_tensors": len(state), "publish_bytes": state_dict_bytes(state),
            "publish_pickled_bytes": publishes[0][2],
            "publish_s_median": round(statistics.median(p[1] for p in publishes), 4)}


def _child(mode, args, tok_dir, queue):
    queue.put(run_mode(mode, args, tok_dir))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="base", choices=["tiny", "small", "base"])
    ap.add_argument("--r", type=int, default=8, help="LoRA rank (alpha = 2r, the targets: q/v projections)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="timed learner steps per mode")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--publishes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    ap.add_argument("--modes", default="full,lora")
    ap.add_argument("--name", default="lora", help="results file stem")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    with tempfile.TemporaryDirectory() as tok_dir:
        save_tokenizer(build_ids_tokenizer(1894), tok_dir)
        for mode in args.modes.split(","):
            queue = ctx.Queue()
            proc = ctx.Process(target=_child, args=(mode, args, tok_dir, queue))
            proc.start()
            rows.append(queue.get())
            proc.join()
            r = rows[-1]
            print(f"{r['mode']:>5} {r['preset']} ({r['parameters_m']}M, {r['trainable_m']}M trainable): step "
                  f"{r['step_s_median'] * 1000:.1f} ms, peak {r['peak_memory_mib']:.0f} MiB, optimizer state "
                  f"{r['optimizer_state_mib']:.1f} MiB, publish {r['publish_bytes'] / 2**20:.2f} MiB in "
                  f"{r['publish_s_median'] * 1000:.1f} ms", flush=True)
    by_mode = {r["mode"]: r for r in rows}
    summary = {}
    if {"full", "lora"} <= set(by_mode):
        full, lora = by_mode["full"], by_mode["lora"]
        summary = {"publish_bytes_ratio": round(full["publish_bytes"] / lora["publish_bytes"], 1),
                   "publish_s_ratio": round(full["publish_s_median"] / max(lora["publish_s_median"], 1e-9), 1),
                   "step_s_ratio": round(full["step_s_median"] / lora["step_s_median"], 2),
                   "peak_memory_ratio": round(full["peak_memory_mib"] / lora["peak_memory_mib"], 2)}
        print("full / lora:", ", ".join(f"{k} {v}" for k, v in summary.items()))
    payload = {"benchmark": "lora", "args": vars(args), "results": rows, "full_over_lora": summary}
    print("saved", save(args.name, payload))


if __name__ == "__main__":
    main()
