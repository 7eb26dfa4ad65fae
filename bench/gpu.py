"""GPU benchmark (issue #40): learner MFU, rollout sampling throughput and one end-to-end GRPO job on one GPU.

    python bench/gpu.py [--parts learner,rollout,e2e] [--budget-s 480] [--strategy ddp|fsdp]
    python bench/gpu.py --smoke --out /tmp/gpu-smoke [--parts learner,rollout]    # CPU check, tiny shapes

Written for one H100 / H200 (16 cores, offline: every model is built from its config with random weights) and
about 8 minutes of wall time in all; each part runs in its own subprocess (a fresh CUDA allocator, so peak memory
is that part's, and a crash or out-of-memory stays in its part). Parts that would start after --budget-s are
skipped with the reason recorded. Saves bench/results/gpu_<part>.json (learner, rollout, e2e) with the machine
description; --smoke (tiny shapes, a few steps, float32, on the CPU even where CUDA is present) saves to --out
instead and never into bench/results/.

learner: one learner step (zero_grad, forward with the cross-entropy of the labels, backward, grad-norm clip 1.0,
AdamW) on a fixed random batch, source length 512, target length 128, dropout 0.1, in bf16, for the shapes of
BART-base (d_model 768, 6+6 layers, 12 heads, FFN 3072, vocab 50265; batch 64), BART-large (1024, 12+12, 16
heads, FFN 4096; batch 32), T5-large (d_model 1024, d_kv 64, d_ff 4096 ReLU, 24+24 layers, 16 heads, vocab 32128,
tied embeddings; batch 32) and Flan-T5-XL (d_model 2048, d_kv 64, d_ff 5120 gated-GELU, 24+24, 32 heads, vocab
32128, untied head; batch 8). Batches are chosen to fit an 80 GB H100 (estimate in bench/findings/gpu.md); an
out-of-memory halves the batch once and retries (recorded). Two modes:

- `plain`: fp32 parameters under ``torch.autocast(bfloat16)``, the DDP learner's way with
  run.mixed_precision=bf16 (world size 1, so no DDP wrapper);
- `fsdp`: FSDP2 on a one-rank process group, as the sharded learner applies it (rlt2t.learner.sharding.shard:
  ``fully_shard`` on each encoder and decoder layer, then on the root,
  ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``). Flan-T5-XL
  runs with activation checkpointing (its fp32 weights, gradients and AdamW moments are ~46 GB before any
  activation); its `plain` run is attempted too and records an out-of-memory instead of failing.

Warm-up steps, then timed steps between ``torch.cuda.synchronize()`` calls; the median is reported with
``torch.cuda.max_memory_allocated``. Model FLOPs per step (recomputation under checkpointing not counted):

    dense = 6 * B * (P_enc * S + (P_dec - P_xkv) * T + P_xkv * S + P_head * T)
    attn  = 12 * B * d_attn * (L_enc * S^2 + L_dec * (T^2 + T * S))

P_enc, P_dec: the weight matrices (2-D parameters) of the encoder and decoder layers, embeddings excluded
(biases and norms, a fraction of a percent, are left out too); P_xkv: the decoder's cross-attention key and value
projections, which run over the S source positions, not the T targets; P_head = d_model * vocab (the LM head,
over the targets, tied or not); d_attn = heads * d_kv; the attention term counts QK^T and AV (2 multiply-adds
each, x3 for forward and backward) over the full, not the causal half, score matrices. MFU = FLOPs per step /
step seconds / the GPU's dense bf16 peak (PEAK_BF16_TFLOPS by ``torch.cuda.get_device_name``; an unknown GPU
gets MFU null with the reason). tokens/s = B * (S + T) / step seconds. A torch.profiler table of the top 10
kernels by CUDA time over one T5-large step is saved with the part. Issue target: T5-large MFU >= 35 % in bf16.

rollout: K = 8 samples per source, pure sampling (top-k off, temperature 1), 32 sources of 256 tokens, exactly
128 new tokens per sample (EOS masked until then: ``min_new_tokens`` in HF, ``min_decoding_length`` in
CTranslate2, both = the maximum; random weights would otherwise stop at random lengths), for the BART-base and
T5-large shapes: HF ``generate(do_sample=True, top_k=0, num_return_sequences=8)`` on bf16 weights against
CTranslate2 (the model exported by rlt2t.common.ct2.export_policy, translate_batch with sampling_topk=0,
num_hypotheses=8) with compute types int8_float16 and bfloat16. Generated tokens are counted up to the first EOS.
Median of 2 timed runs after one warm-up. Issue target: the best CTranslate2 >= 3x HF generate. CTranslate2's
wheels run on CUDA 12's cuBLAS: where libcublas.so.12 cannot be loaded (a CUDA 13 machine), its rows are left out
and ``ct2_cuda_problem`` says why.

e2e: GRPO with a from-scratch BART-base-shape policy (model.preset=base, model.family=bart) on the synthetic task,
rl.strategy from --strategy, on the one GPU with configs/gpu-1.yaml's placement (learner, rollout and reward
workers sharing it). Two measurements: (1) the step split, synchronously in this process on the GPU (as
bench/pipeline.py's G and L): per batch, RolloutWorker.sample, RewardWorker.score, Learner.train_step, and
publish = Learner.publish_weights + RolloutWorker.set_weights; (2) the real job (rlt2t.driver.train on a local
Ray, what `rlt2t train` runs) for one epoch: wall per step, the learner's step_s and learner_busy from
<run>/logs/rl/metrics.jsonl, and the driver's publish calls timed around ``_Publisher.publish`` (the job logs
no rollout, reward or publish seconds itself). Issue target: publish <= 5 % of the step.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import RESULTS, machine  # noqa: E402

PARTS = ("learner", "rollout", "e2e")
TARGET_MFU = 0.35  # T5-large learner step, bf16
TARGET_CT2_SPEEDUP = 3.0  # best CTranslate2 compute type vs HF generate
TARGET_PUBLISH_SHARE = 0.05  # publish seconds / step seconds
# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from NVIDIA's data sheets; the first name contained in
# torch.cuda.get_device_name wins, so the specific names come before "H100".
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0), ("H200", 989.0), ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.0),
    ("H800", 989.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("A10G", 70.0),
)


def peak_tflops(device_name: str | None) -> tuple[float | None, str]:
    """(dense bf16 peak in TFLOP/s, where it comes from) for a ``torch.cuda.get_device_name``; (None, why) when the
    GPU is not in PEAK_BF16_TFLOPS or there is none."""
    if not device_name:
        return None, "no CUDA device: MFU needs a GPU's peak"
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops, f"{key} dense bf16 peak (NVIDIA data sheet)"
    return None, f"unknown GPU {device_name!r}: add its dense bf16 peak to PEAK_BF16_TFLOPS"


# --------------------------------------------------------------------------------------------------
# Model shapes and FLOPs
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    name: str
    family: str  # bart | t5
    d_model: int
    heads: int
    d_ff: int
    enc_layers: int
    dec_layers: int
    vocab: int
    d_kv: int = 0  # t5; bart: d_model / heads
    ffn: str = "gelu"  # bart: gelu; t5: relu | gated-gelu
    tied: bool = True  # t5: False = v1.1 / Flan-T5 (no decoder-output scaling); transformers 5 ties T5's head anyway
    batch: int = 8
    checkpointing: bool = False  # activation checkpointing (the FSDP run of the 3B shape)
    modes: tuple[str, ...] = ("plain", "fsdp")

    @property
    def d_attn(self) -> int:
        return self.heads * (self.d_kv or self.d_model // self.heads)


SHAPES: tuple[Shape, ...] = (
    Shape("bart-base", "bart", 768, 12, 3072, 6, 6, 50265, batch=64),
    Shape("bart-large", "bart", 1024, 16, 4096, 12, 12, 50265, batch=32),
    Shape("t5-large", "t5", 1024, 16, 4096, 24, 24, 32128, d_kv=64, ffn="relu", batch=32),
    Shape("flan-t5-xl", "t5", 2048, 32, 5120, 24, 24, 32128, d_kv=64, ffn="gated-gelu", tied=False, batch=8,
          checkpointing=True),
)
PROFILED = "t5-large"


def smoke_shape(s: Shape) -> Shape:
    """The same family, FFN kind, tying and modes at a CPU size: d_model 64, 4 heads, 2+2 layers, vocab 256."""
    return replace(s, d_model=64, heads=4, d_ff=128, enc_layers=2, dec_layers=2, vocab=256,
                   d_kv=16 if s.family == "t5" else 0, batch=2)


def build_model(shape: Shape, *, dropout: float = 0.1, device: str = "cpu", special: dict[str, int] | None = None,
                seed: int = 0) -> torch.nn.Module:
    """A randomly initialised BART or T5 of ``shape`` (fp32), built directly on ``device``; ``special``: pad / bos /
    eos ids of a tokenizer (default: the configs' own)."""
    from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

    sp = special or {}
    torch.manual_seed(seed)
    if shape.family == "t5":
        config: Any = T5Config(
            vocab_size=shape.vocab, d_model=shape.d_model, d_kv=shape.d_kv, d_ff=shape.d_ff,
            num_layers=shape.enc_layers, num_decoder_layers=shape.dec_layers, num_heads=shape.heads,
            feed_forward_proj=shape.ffn, tie_word_embeddings=shape.tied, dropout_rate=dropout,
            pad_token_id=sp.get("pad", 0), eos_token_id=sp.get("eos", 1), decoder_start_token_id=sp.get("pad", 0))
        cls: Any = T5ForConditionalGeneration
    else:
        config = BartConfig(
            vocab_size=shape.vocab, d_model=shape.d_model, encoder_layers=shape.enc_layers,
            decoder_layers=shape.dec_layers, encoder_attention_heads=shape.heads, decoder_attention_heads=shape.heads,
            encoder_ffn_dim=shape.d_ff, decoder_ffn_dim=shape.d_ff, max_position_embeddings=1024, dropout=dropout,
            pad_token_id=sp.get("pad", 1), bos_token_id=sp.get("bos", 0), eos_token_id=sp.get("eos", 2),
            decoder_start_token_id=sp.get("eos", 2), forced_eos_token_id=None)
        cls = BartForConditionalGeneration
    with torch.device(device):  # initialised where it runs: a 3B model's CPU init alone takes minutes
        model = cls(config)
    model.generation_config.forced_eos_token_id = None  # rows run to the length asked (see the docstring)
    return model


_EMBEDDING_NAMES = ("shared", "embed_tokens", "embed_positions", "relative_attention_bias", "lm_head")
_CROSS_KV = ("encoder_attn.k_proj.", "encoder_attn.v_proj.", "EncDecAttention.k.", "EncDecAttention.v.")


def matmul_params(model: torch.nn.Module) -> dict[str, int]:
    """Weight-matrix parameters by where they run: ``encoder`` (over sources), ``decoder`` (its layers, the
    cross-attention key/value projections included), ``cross_kv`` (those projections alone: they run over the
    sources), ``head`` (d_model x vocab). Embeddings, biases and norms are left out."""
    out = {"encoder": 0, "decoder": 0, "cross_kv": 0}
    for name, p in model.named_parameters():
        if p.dim() < 2 or any(e in name for e in _EMBEDDING_NAMES):
            continue
        part = "encoder" if ".encoder." in f".{name}" else "decoder" if ".decoder." in f".{name}" else None
        if part is None:
            raise ValueError(f"matmul_params: parameter {name} is in neither the encoder nor the decoder")
        out[part] += p.numel()
        if any(k in name for k in _CROSS_KV):
            out["cross_kv"] += p.numel()
    out_emb = model.get_output_embeddings()
    out["head"] = out_emb.weight.numel() if out_emb is not None else 0
    return out


def step_flops(params: dict[str, int], shape: Shape, batch: int, source_len: int, target_len: int) -> dict[str, int]:
    """Model FLOPs of one training step (forward + backward, 3x the forward): ``dense`` (6 per parameter per token
    it runs over) + ``attention`` (QK^T and AV over full score matrices); see the module docstring."""
    b, s, t = batch, source_len, target_len
    dense = 6 * b * (params["encoder"] * s + (params["decoder"] - params["cross_kv"]) * t + params["cross_kv"] * s
                     + params["head"] * t)
    attention = 12 * b * shape.d_attn * (shape.enc_layers * s * s + shape.dec_layers * (t * t + t * s))
    return {"dense": dense, "attention": attention, "total": dense + attention}


FLOPS_NOTE = ("model FLOPs per step = dense + attention; dense = 6*B*(P_enc*S + (P_dec - P_xkv)*T + P_xkv*S + "
              "P_head*T), P_* = weight matrices (2-D parameters, embeddings excluded, biases and norms left out) of "
              "the encoder layers, the decoder layers, the decoder's cross-attention key/value projections (run over "
              "the S source positions), and the LM head d_model*vocab (over the T targets, tied or not); attention = "
              "12*B*d_attn*(L_enc*S^2 + L_dec*(T^2 + T*S)), d_attn = heads*d_kv, QK^T and AV over full (not causal "
              "half) score matrices, x3 for forward + backward; recomputation under activation checkpointing not "
              "counted (MFU, not hardware FLOPs utilisation)")


# --------------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------------


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None


def ct2_cuda_problem(version: str) -> str | None:
    """Why CTranslate2 cannot run on this machine's GPU, or None. Its Linux wheels (4.x) open CUDA 12's cuBLAS
    (libcublas.so.12) when they first run a model on the GPU: a machine with CUDA 13 alone (a cu13 torch) fails
    there, after the model loaded."""
    import ctypes

    try:
        ctypes.CDLL("libcublas.so.12")
    except OSError as e:
        return (f"libcublas.so.12 cannot be loaded ({e}): CTranslate2 {version}'s wheel runs on CUDA 12's cuBLAS "
                f"(torch here: CUDA {torch.version.cuda})")
    return None


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def over_budget(deadline: float) -> bool:
    return time.time() > deadline


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


# --------------------------------------------------------------------------------------------------
# learner
# --------------------------------------------------------------------------------------------------


def init_one_rank_group(device: str) -> Any:
    """A one-rank process group (nccl on CUDA, gloo on the CPU) and its device mesh, for FSDP2."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
    return init_device_mesh(device, (1,))


def shard(model: torch.nn.Module, device: str, bf16: bool, checkpointing: bool) -> torch.nn.Module:
    """FSDP2 as the sharded learner applies it (rlt2t.learner.sharding.shard: a unit per layer, the model as the
    root), on the one-rank process group."""
    from rlt2t.common.config import FSDPConfig
    from rlt2t.learner.sharding import shard as shard_policy

    shard_policy(model, model, FSDPConfig(activation_checkpointing=checkpointing), device=torch.device(device),
                 mixed_precision="bf16" if bf16 else "no")
    return model


def learner_batch(shape: Shape, batch: int, source_len: int, target_len: int, device: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, shape.vocab, (batch, source_len), generator=g)
    labels = torch.randint(4, shape.vocab, (batch, target_len), generator=g)
    # use_cache=False: a decoder cache is state a recomputed (checkpointed) layer would see twice
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device), "labels": labels.to(device),
            "use_cache": False}


def run_learner_config(shape: Shape, mode: str, batch: int, args: argparse.Namespace, device: str, mesh: Any,
                       profile: bool) -> dict[str, Any]:
    """Build, warm up and time one (shape, mode, batch); raises on out-of-memory (the caller records it)."""
    bf16 = device == "cuda"
    model = build_model(shape, device=device).train()
    params = matmul_params(model)
    n_params = sum(p.numel() for p in model.parameters())
    checkpointing = shape.checkpointing and mode == "fsdp"
    if mode == "fsdp":
        model = shard(model, device, bf16, checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    data = learner_batch(shape, batch, args.source_len, args.target_len, device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16 and mode == "plain") if device == "cuda" \
        else contextlib.nullcontext()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = model(**data).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    times = []
    for i in range(args.warmup + args.steps):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    table = None
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with torch_profile(activities=activities) as prof:
            step()
            sync(device)
        key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=10)
    flops = step_flops(params, shape, batch, args.source_len, args.target_len)
    med = statistics.median(times)
    out = {"batch": batch, "parameters_m": round(n_params / 1e6, 1), "matmul_params": params, "flops_per_step": flops,
           "activation_checkpointing": checkpointing, "step_s": [round(t, 4) for t in times],
           "step_s_median": round(med, 4), "tokens_per_s": round(batch * (args.source_len + args.target_len) / med, 1),
           "achieved_tflops": round(flops["total"] / med / 1e12, 2), "max_memory_allocated_gib": peak_gib(device)}
    if table is not None:
        out["profile_top10"] = table
    return out


def learner_part(args: argparse.Namespace, device: str, deadline: float) -> dict[str, Any]:
    peak, peak_source = peak_tflops(torch.cuda.get_device_name(0) if device == "cuda" else None)
    shapes = [smoke_shape(s) for s in SHAPES] if args.smoke else list(SHAPES)
    mesh = None
    runs: list[dict[str, Any]] = []
    print(f"\nlearner: source {args.source_len}, target {args.target_len}, {args.warmup} warm-up + {args.steps} timed "
          f"steps, {'bf16' if device == 'cuda' else 'float32'} on {device}; peak {peak} TFLOP/s ({peak_source})")
    print(f"{'model':>12} {'mode':>5} {'batch':>5} {'step s':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} "
          f"{'peak GiB':>8}  status", flush=True)
    for original, shape in zip(SHAPES, shapes, strict=True):
        for mode in shape.modes:
            row: dict[str, Any] = {"model": original.name, "shape": asdict(shape), "mode": mode}
            if over_budget(deadline):
                row |= {"status": "skipped", "reason": "time budget (--budget-s) spent"}
                runs.append(row)
                print(f"{original.name:>12} {mode:>5} {'':>5} {'':>8} {'':>10} {'':>8} {'':>6} {'':>8}  skipped "
                      "(budget)", flush=True)
                continue
            if mode == "fsdp" and mesh is None:
                mesh = init_one_rank_group(device)
            batch, tried = shape.batch, []
            while True:
                tried.append(batch)
                try:
                    free_memory(device)
                    res = run_learner_config(shape, mode, batch, args, device, mesh,
                                             profile=original.name == PROFILED and mode == "plain")
                    row |= {"status": "ok", **res}
                    break
                except Exception as e:  # out-of-memory: halve once, then record; anything else: record
                    if not is_oom(e):
                        row |= {"status": "error", "reason": f"{type(e).__name__}: {str(e)[:500]}"}
                        break
                    oom = f"out of memory at batch {batch} ({str(e).splitlines()[0][:200]})"
                    if batch > 1 and len(tried) < 2:
                        row.setdefault("oom", []).append(oom)
                        batch //= 2
                        continue
                    row |= {"status": "oom", "reason": oom}
                    break
                finally:
                    free_memory(device)
            row["batches_tried"] = tried
            if row["status"] == "ok":
                row["mfu"] = round(row["achieved_tflops"] / peak, 4) if peak else None
                if not peak:
                    row["mfu_reason"] = peak_source
            runs.append(row)
            print(f"{original.name:>12} {mode:>5} {row.get('batch', batch):>5} {fmt(row.get('step_s_median'), '8.3f')} "
                  f"{fmt(row.get('tokens_per_s'), '10.0f')} {fmt(row.get('achieved_tflops'), '8.1f')} "
                  f"{fmt(row['mfu'] * 100 if row.get('mfu') is not None else None, '5.1f'):>5}% "
                  f"{fmt(row.get('max_memory_allocated_gib'), '8.1f')}  {row['status']}"
                  + (f" ({row['reason']})" if row.get("reason") else ""), flush=True)
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    target_runs = {r["mode"]: r for r in runs if r["model"] == PROFILED}
    plain = target_runs.get("plain", {})
    value = plain.get("mfu")
    met = None if value is None else value >= TARGET_MFU
    target = {"what": f"{PROFILED} learner MFU in bf16, plain mode (the DDP learner's way)", "target": TARGET_MFU,
              "value": value, "fsdp_value": target_runs.get("fsdp", {}).get("mfu"), "met": met}
    if met is False:
        target["bound_by"] = "see profile_top10 of the t5-large plain run (the kernels that take the step's time)"
    elif met is None:
        target["why_unknown"] = plain.get("mfu_reason") or plain.get("reason") or "no t5-large plain run"
    for r in runs:
        if "profile_top10" in r:
            clock = "CUDA" if device == "cuda" else "CPU"
            print(f"\nprofile, one {r['model']} {r['mode']} step (top 10 by self {clock} time):\n{r['profile_top10']}")
    print(f"target: {PROFILED} MFU >= {TARGET_MFU:.0%}: "
          + ("unknown" if met is None else f"{value:.1%}, {'met' if met else 'missed'}"), flush=True)
    return {"benchmark": "gpu_learner", "device": device, "peak_bf16_tflops": peak, "peak_source": peak_source,
            "precision": "bf16 (plain: fp32 params + autocast; fsdp: MixedPrecisionPolicy bf16 params, fp32 reduce)"
            if device == "cuda" else "float32 (CPU smoke)",
            "source_len": args.source_len, "target_len": args.target_len, "warmup": args.warmup, "steps": args.steps,
            "step": "zero_grad + forward (CE of the labels, dropout 0.1) + backward + clip_grad_norm_(1.0) + AdamW",
            "flops_formula": FLOPS_NOTE, "tokens_per_s_formula": "B * (S + T) / median step seconds",
            "runs": runs, "target": target}


# --------------------------------------------------------------------------------------------------
# rollout
# --------------------------------------------------------------------------------------------------


ROLLOUT_SHAPES = ("bart-base", "t5-large")


def rollout_part(args: argparse.Namespace, device: str, deadline: float) -> dict[str, Any]:
    import ctranslate2

    from rlt2t.common.collate import collate_seq2seq, encode_texts
    from rlt2t.common.ct2 import Ct2Policy, export_policy
    from rlt2t.common.policy import Policy
    from rlt2t.common.tokenization import build_ids_tokenizer

    k, sources, src_len, new = args.k, args.sources, args.rollout_source_len, args.new_tokens
    ct2_device = "cuda" if device == "cuda" and ctranslate2.get_cuda_device_count() > 0 else "cpu"
    supported = sorted(ctranslate2.get_supported_compute_types(ct2_device))
    wanted = ("int8_float16", "bfloat16") if ct2_device == "cuda" else ("int8", "float32")
    compute_types = [c for c in wanted if c in supported]
    ct2_problem = ct2_cuda_problem(ctranslate2.__version__) if ct2_device == "cuda" else None
    if ct2_problem:
        print(f"rollout: CTranslate2 cannot use the GPU: {ct2_problem}; HF generate alone is measured", flush=True)
        compute_types = []
    data_tokens = 200 if args.smoke else 1894
    tok = build_ids_tokenizer(num_data_tokens=data_tokens, num_sentinels=10 if args.smoke else 100)
    special = {"pad": tok.pad_token_id, "bos": tok.bos_token_id, "eos": tok.eos_token_id}
    import random

    rng = random.Random(1)
    texts = [" ".join(str(rng.randrange(data_tokens)) for _ in range(src_len - 1)) for _ in range(sources)]
    print(f"\nrollout: {sources} sources x {src_len} tokens, K={k}, {new} new tokens per sample (EOS masked until "
          f"then), top-k off, temperature 1; HF {'bf16' if device == 'cuda' else 'float32'} on {device}, "
          f"CTranslate2 {compute_types} on {ct2_device} "
          f"(supported there: {supported}); median of {args.repeats}", flush=True)
    print(f"{'model':>10} {'variant':>20} {'median s':>9} {'gen tokens':>10} {'tokens/s':>10} {'vs HF':>7}", flush=True)
    models: dict[str, Any] = {}

    def counted(rows: list[list[int]]) -> int:
        return sum(next((i + 1 for i, t in enumerate(r) if t == tok.eos_token_id), len(r)) for r in rows)

    def timed(fn: Any) -> tuple[list[float], int]:
        rows = fn()  # warm-up
        times = []
        for _ in range(args.repeats):
            sync(device)
            t0 = time.perf_counter()
            rows = fn()
            sync(device)
            times.append(time.perf_counter() - t0)
        return times, counted(rows)

    for name in ROLLOUT_SHAPES:
        shape = next(s for s in SHAPES if s.name == name)
        shape = smoke_shape(shape) if args.smoke else shape
        if over_budget(deadline):
            models[name] = {"status": "skipped", "reason": "time budget (--budget-s) spent"}
            print(f"{name:>10} skipped (budget)", flush=True)
            continue
        entry: dict[str, Any] = {"shape": asdict(shape), "variants": {}}
        models[name] = entry
        variants = entry["variants"]
        stack = contextlib.ExitStack()
        try:
            free_memory(device)
            model = build_model(shape, dropout=0.0, device=device, special=special).eval()
            ids, _ = encode_texts(tok, texts, src_len)
            batch = {key: v.to(device) for key, v in collate_seq2seq(ids, None, tok.pad_token_id).items()}
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="rlt2t-bench-gpu-"))
            # Exported from the fp32 weights, as float16 on the GPU (CTranslate2 derives the int8 / bf16 compute
            # types at load) and float32 on the CPU.
            export = export_policy(Policy(model, tok, "bench"), Path(tmp) / "ct2",
                                   "float16" if ct2_device == "cuda" else "float32")
            if device == "cuda":
                model.to(torch.bfloat16)
            held = {"model": model, "batch": batch}
            del model, batch

            def hf_generate(held: dict[str, Any] = held) -> list[list[int]]:
                with torch.inference_mode():
                    out = held["model"].generate(**held["batch"], do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                                                 num_return_sequences=k, max_new_tokens=new, min_new_tokens=new)
                return [r[1:] for r in out.tolist()]  # drop the decoder start token

            times, tokens = timed(hf_generate)
            variants["hf_generate"] = {"dtype": "bfloat16" if device == "cuda" else "float32", "seconds": times,
                                       "generated_tokens": tokens}
            held.clear()
            free_memory(device)
            for ct in compute_types:
                ct2 = Ct2Policy(export, device=ct2_device, compute_type=ct, max_source_len=src_len)
                tokens_in = ct2.source_tokens(texts)

                def ct2_sample(ct2: Ct2Policy = ct2, tokens_in: list[list[str]] = tokens_in) -> list[list[int]]:
                    res = ct2.translator.translate_batch(
                        tokens_in, beam_size=1, num_hypotheses=k, sampling_topk=0, sampling_temperature=1.0,
                        max_decoding_length=new, min_decoding_length=new, max_input_length=0,
                        return_scores=True, return_end_token=True)
                    return [ct2.token_ids(h) for r in res for h in r.hypotheses]

                times, tokens = timed(ct2_sample)
                variants[f"ct2_{ct}"] = {"device": ct2_device, "compute_type": ct, "seconds": times,
                                         "generated_tokens": tokens}
                del ct2
        except Exception as e:
            entry["status"] = "oom" if is_oom(e) else "error"
            entry["reason"] = f"{type(e).__name__}: {str(e)[:500]}"
            print(f"{name:>10} {entry['status']}: {entry['reason']}", flush=True)
        finally:
            stack.close()
            free_memory(device)
        entry.setdefault("status", "ok")
        base = None
        for vname, v in variants.items():
            v["seconds_median"] = round(statistics.median(v["seconds"]), 4)
            v["seconds"] = [round(t, 4) for t in v["seconds"]]
            v["tokens_per_s"] = round(v["generated_tokens"] / v["seconds_median"], 1)
            v["rows"] = sources * k
            v["mean_tokens_per_row"] = round(v["generated_tokens"] / (sources * k), 2)
            base = v["tokens_per_s"] if vname == "hf_generate" else base
            v["speedup_vs_hf"] = round(v["tokens_per_s"] / base, 3) if base else None
            print(f"{name:>10} {vname:>20} {v['seconds_median']:9.3f} {v['generated_tokens']:10d} "
                  f"{v['tokens_per_s']:10.0f} {fmt(v['speedup_vs_hf'], '6.2f')}x", flush=True)
        ct2_runs = {n: v for n, v in variants.items() if n.startswith("ct2_")}
        best = max(ct2_runs, key=lambda n: ct2_runs[n]["tokens_per_s"], default=None)
        entry["best_ct2"] = best
        entry["best_ct2_speedup"] = ct2_runs[best]["speedup_vs_hf"] if best else None
    speedups = {n: m.get("best_ct2_speedup") for n, m in models.items()}
    known = [s for s in speedups.values() if s is not None]
    met = (all(s >= TARGET_CT2_SPEEDUP for s in known) if len(known) == len(speedups) else None) if known else None
    for n, s in speedups.items():
        print(f"target: {n} best CTranslate2 >= {TARGET_CT2_SPEEDUP}x HF generate: "
              + ("unknown" if s is None else f"{s:.2f}x, {'met' if s >= TARGET_CT2_SPEEDUP else 'missed'}"), flush=True)
    return {"benchmark": "gpu_rollout", "device": device, "ct2_device": ct2_device,
            "ct2_version": ctranslate2.__version__, "ct2_supported_compute_types": supported,
            "ct2_cuda_problem": ct2_problem,
            "workload": {"sources": sources, "source_len": src_len, "k": k, "new_tokens": new, "top_k": 0,
                         "temperature": 1.0, "repeats": args.repeats, "warmup": 1,
                         "eos": "masked until new_tokens (HF min_new_tokens, CTranslate2 min_decoding_length, both = "
                                "the maximum): random weights would stop at random lengths; generated tokens are "
                                "counted up to the first EOS",
                         "hf": "generate(do_sample=True, top_k=0, num_return_sequences=K) on bf16 weights (float32 "
                               "on the CPU)",
                         "ct2": "translate_batch(beam_size=1, sampling_topk=0, num_hypotheses=K) on pre-tokenized "
                                "sources (tokenization not timed; HF's is not either)"},
            "models": models,
            "target": {"what": "best CTranslate2 compute type's generated tokens/s / HF generate's, each model",
                       "target": TARGET_CT2_SPEEDUP, "value": speedups, "met": met}}


# --------------------------------------------------------------------------------------------------
# e2e
# --------------------------------------------------------------------------------------------------


def e2e_config(workdir: Path, tok_dir: Path, args: argparse.Namespace, device: str) -> Any:
    from rlt2t.common.config import load_config

    repo = Path(__file__).resolve().parents[1]
    steps, batch = args.e2e_steps, args.e2e_batch
    common = [
        f"run.dir={workdir / 'run'}", "run.progress=false", "run.log_every=1", f"tokenizer.path={tok_dir}",
        "model.path=null", f"model.preset={'tiny' if args.smoke else 'base'}", "model.family=bart",
        "rl.algorithm=grpo", "rl.epochs=1", f"rl.train_subset={steps * batch}", f"rl.batch_size={batch}",
        f"rl.chunk_size={batch}", f"rollout.num_samples={args.k}", f"rollout.max_new_tokens={args.e2e_new_tokens}",
        "data.max_source_len=128", f"data.max_target_len={args.e2e_new_tokens}", "metric.monitor_size=0",
        f"rl.strategy={args.strategy}", "rl.learners=1", "rl.rollout_workers=1", "rl.reward_workers=1",
    ]
    if device == "cuda":
        return load_config([repo / "configs" / "gpu-1.yaml"], common)
    return load_config(["tiny"], [*common, "run.device=cpu", "rl.learner_cpus=1", "rl.rollout_cpus=1",
                                  "rl.reward_cpus=0.5", "rl.learner_gpus=0", "rl.rollout_gpus=0", "rl.reward_gpus=0"])


def e2e_sync_split(cfg: Any, train: list[Any], ckpt: Path, device: str, steps: int) -> dict[str, Any]:
    """Rollout, reward, learner and publish seconds per step, one after the other in this process."""
    from rlt2t.actors.reward import RewardWorker
    from rlt2t.actors.rollout import RolloutWorker
    from rlt2t.common.data import reference_sets
    from rlt2t.common.metrics import DocumentFrequency
    from rlt2t.common.policy import load_policy
    from rlt2t.learner.learner import Learner

    r = cfg.rl
    start = load_policy(cfg.model, cfg.tokenizer_dir, checkpoint=ckpt).model.state_dict()
    rollout = RolloutWorker(cfg.model, str(cfg.tokenizer_dir), cfg.rollout, seed=cfg.run.seed,
                            max_source_len=cfg.data.max_source_len, spec=r.rollout_spec, start_weights=start,
                            device=device)
    rollout.set_weights(0, start)
    reward = RewardWorker(cfg.reward, DocumentFrequency.from_references(reference_sets(train)))
    learner = Learner(cfg.model, str(cfg.tokenizer_dir), r, cfg.rollout, init_checkpoint=str(ckpt), rank=0,
                      world_size=1, total_steps=steps, seed=cfg.run.seed, max_source_len=cfg.data.max_source_len,
                      max_target_len=cfg.data.max_target_len, mixed_precision=cfg.run.mixed_precision)
    learner.join(learner.rendezvous_address())  # rl.strategy=fsdp: a process group of one, as the job forms it
    if r.preflight:
        learner.preflight()
    split: dict[str, list[float]] = {"rollout": [], "reward": [], "learner": [], "publish": []}
    for i in range(steps):
        chunk = train[i * r.batch_size : (i + 1) * r.batch_size]
        sync(device)
        t0 = time.perf_counter()
        sampled = rollout.sample(chunk)
        sync(device)
        t1 = time.perf_counter()
        scored = reward.score(sampled)
        t2 = time.perf_counter()
        learner.train_step(scored)
        sync(device)
        t3 = time.perf_counter()
        _, weights = learner.publish_weights()
        rollout.set_weights(i + 1, weights)
        sync(device)
        t4 = time.perf_counter()
        for key, a, b in (("rollout", t0, t1), ("reward", t1, t2), ("learner", t2, t3), ("publish", t3, t4)):
            split[key].append(round(b - a, 4))
    learner.shutdown()  # the process group it joined
    del rollout, learner
    per_step = {k: statistics.median(v[1:] if len(v) > 1 else v) for k, v in split.items()}  # step 1 warms up
    total = sum(per_step.values())
    return {"seconds": split, "median_s_per_step": {k: round(v, 4) for k, v in per_step.items()},
            "step_s": round(total, 4), "share": {k: round(v / total, 4) for k, v in per_step.items()},
            "publish_share": round(per_step["publish"] / total, 4), "first_step_excluded": len(split["rollout"]) > 1}


def e2e_job(cfg: Any, train: list[Any], ckpt: Path) -> dict[str, Any]:
    """The RL job for one epoch on a local Ray; the driver's publish calls and the epoch wall are timed around the
    job's own methods (timing wrappers only)."""
    import ray

    from rlt2t import driver
    from rlt2t.groups import init_ray

    t0 = time.perf_counter()
    init_ray(cfg)
    ray_start = time.perf_counter() - t0
    marks: dict[str, float] = {}
    publishes: list[dict[str, float]] = []
    real_epoch, real_publish = driver._Job._run_epoch, driver._Publisher.publish

    def timed_epoch(self: Any, *a: Any, **kw: Any) -> Any:
        marks["epoch_start"] = time.perf_counter()
        try:
            return real_epoch(self, *a, **kw)
        finally:
            marks["epoch_end"] = time.perf_counter()

    def timed_publish(self: Any, version: int, weights: Any = None) -> None:
        new = version not in self.refs
        t = time.perf_counter()
        real_publish(self, version, weights)
        if new:
            publishes.append({"version": version, "seconds": round(time.perf_counter() - t, 4),
                              "in_epoch": "epoch_start" in marks and "epoch_end" not in marks})

    driver._Job._run_epoch, driver._Publisher.publish = timed_epoch, timed_publish
    try:
        t_call = time.perf_counter()
        result = driver.train(cfg, train, [], init=ckpt)
        total = time.perf_counter() - t_call
    finally:
        driver._Job._run_epoch, driver._Publisher.publish = real_epoch, real_publish
        ray.shutdown()
    rows = [json.loads(x) for x in (cfg.run_dir / "logs" / "rl" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [x for x in rows if x.get("kind") == "train"]
    epoch = marks["epoch_end"] - marks["epoch_start"]
    steps = max(1, result.steps)
    in_epoch = [p["seconds"] for p in publishes if p["in_epoch"]]
    step_s = [round(x["step_s"], 4) for x in train_rows]
    wall_per_step = epoch / steps
    return {"steps": result.steps, "epoch_wall_s": round(epoch, 2), "wall_s_per_step": round(wall_per_step, 4),
            "learner_step_s": step_s, "learner_step_s_median": round(statistics.median(step_s), 4) if step_s else None,
            "learner_busy": train_rows[-1].get("learner_busy") if train_rows else None,
            "publishes": publishes, "publish_s_per_step": round(sum(in_epoch) / steps, 4),
            "publish_share": round(sum(in_epoch) / steps / wall_per_step, 4) if wall_per_step else None,
            "ray_start_s": round(ray_start, 2), "train_total_s": round(total, 2),
            "note": "publish = the driver's _Publisher.publish calls inside the epoch (rank 0's publish_weights "
                    "and the object-store put; the rollout workers install the weights inside their next sample "
                    "task, which this does not see); the job logs no rollout or reward seconds"}


def e2e_part(args: argparse.Namespace, device: str, deadline: float) -> dict[str, Any]:
    from rlt2t.common.config import ModelConfig
    from rlt2t.common.io import atomic_directory
    from rlt2t.common.policy import load_policy
    from rlt2t.common.synth import generate_synthetic
    from rlt2t.common.tokenization import build_ids_tokenizer, save_tokenizer

    if over_budget(deadline):
        print("\ne2e: skipped (budget)", flush=True)
        return {"benchmark": "gpu_e2e", "status": "skipped", "reason": "time budget (--budget-s) spent"}
    out: dict[str, Any] = {"benchmark": "gpu_e2e", "device": device, "strategy": args.strategy,
                           "algorithm": "grpo", "steps": args.e2e_steps, "batch_sources": args.e2e_batch, "k": args.k,
                           "max_new_tokens": args.e2e_new_tokens,
                           "policy": f"from scratch, model.preset={'tiny' if args.smoke else 'base'}, family bart",
                           "config": "tiny + CPU overrides" if device == "cpu" else "configs/gpu-1.yaml"}
    print(f"\ne2e: GRPO, {'tiny' if args.smoke else 'base'} BART, {args.e2e_steps} steps x {args.e2e_batch} sources "
          f"x K={args.k}, {args.e2e_new_tokens} new tokens, rl.strategy={args.strategy}, on {device}", flush=True)
    with tempfile.TemporaryDirectory(prefix="rlt2t-bench-gpu-e2e-") as tmp:
        workdir = Path(tmp)
        tok_dir, ckpt = workdir / "tokenizer", workdir / "init"
        with atomic_directory(tok_dir) as d:
            save_tokenizer(build_ids_tokenizer(1894), d)
        cfg = e2e_config(workdir, tok_dir, args, device)
        policy = load_policy(ModelConfig(preset=cfg.model.preset, family="bart"), tok_dir, seed=0)
        with atomic_directory(ckpt) as d:
            policy.model.save_pretrained(d)
            save_tokenizer(policy.tokenizer, d)
        del policy
        train = generate_synthetic(max(args.e2e_steps * args.e2e_batch, 64), seed=1)
        out["config_dump"] = {"rl": cfg.rl.model_dump(mode="json"), "run": cfg.run.model_dump(mode="json"),
                              "rollout": cfg.rollout.model_dump(mode="json")}
        try:
            out["sync_split"] = e2e_sync_split(cfg, train, ckpt, device, min(args.e2e_steps, 4))
        except Exception as e:
            out["sync_split"] = {"status": "oom" if is_oom(e) else "error", "reason": f"{type(e).__name__}: {e}"[:600]}
        free_memory(device)
        s = out["sync_split"]
        if "median_s_per_step" in s:
            m = s["median_s_per_step"]
            print(f"{'split (sync)':>14} rollout {m['rollout']:.3f}s  reward {m['reward']:.3f}s  learner "
                  f"{m['learner']:.3f}s  publish {m['publish']:.3f}s  = {s['step_s']:.3f}s/step; publish "
                  f"{s['publish_share']:.1%}", flush=True)
        else:
            print(f"split (sync): {s['status']}: {s['reason']}", flush=True)
        if over_budget(deadline):
            out["job"] = {"status": "skipped", "reason": "time budget (--budget-s) spent"}
        else:
            try:
                out["job"] = e2e_job(cfg, train, ckpt)
            except Exception as e:
                out["job"] = {"status": "error", "reason": f"{type(e).__name__}: {e}"[:600]}
        j = out["job"]
        if "wall_s_per_step" in j:
            print(f"{'job (Ray)':>14} {j['steps']} steps in {j['epoch_wall_s']:.1f}s = "
                  f"{j['wall_s_per_step']:.3f}s/step; "
                  f"learner step {fmt(j['learner_step_s_median'], '.3f')}s, busy {fmt(j['learner_busy'], '.1%')}; "
                  f"publish {j['publish_s_per_step']:.3f}s/step = {fmt(j['publish_share'], '.1%')}", flush=True)
        else:
            print(f"job: {j['status']}: {j['reason']}", flush=True)
    share = j.get("publish_share", s.get("publish_share"))
    met = None if share is None else share <= TARGET_PUBLISH_SHARE
    out["target"] = {"what": "publish seconds / step seconds (the job's; the synchronous split's when the job did "
                             "not run)", "target": TARGET_PUBLISH_SHARE, "value": share,
                     "value_sync_split": s.get("publish_share"), "met": met}
    print(f"target: publish <= {TARGET_PUBLISH_SHARE:.0%} of the step: "
          + ("unknown" if share is None else f"{share:.1%}, {'met' if met else 'missed'}"), flush=True)
    return out


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------


def run_part(part: str, args: argparse.Namespace) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    from rlt2t.common.tracking import quiet_transformers

    quiet_transformers()
    deadline = args.deadline
    return {"learner": learner_part, "rollout": rollout_part, "e2e": e2e_part}[part](args, device, deadline)


def save_part(part: str, payload: dict[str, Any], out_dir: Path | None) -> Path:
    from rlt2t.common.io import atomic_write_json

    path = (out_dir or RESULTS) / f"gpu_{part}.json"
    atomic_write_json(path, {"machine": machine(), **payload})
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated parts (default: {','.join(PARTS)})")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few steps, float32 on the CPU; needs --out")
    ap.add_argument("--out", type=Path, default=None, help="directory for gpu_<part>.json (default bench/results/; "
                                                           "required with --smoke)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall seconds for all parts (default 480)")
    ap.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp", help="e2e: rl.strategy (default ddp)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        ap.error(f"--parts: unknown {unknown} (known: {', '.join(PARTS)})")
    args.parts = parts
    if args.smoke and args.out is None:
        ap.error("--smoke needs --out DIR (smoke results never go into bench/results/)")
    if args.out is not None and args.out.resolve() == RESULTS.resolve() and args.smoke:
        ap.error("--smoke: --out must not be bench/results/")
    # Workload sizes: the GPU's, or the smoke run's.
    sizes = dict(source_len=32, target_len=8, warmup=1, steps=2, k=8, sources=4, rollout_source_len=16,
                 new_tokens=8, repeats=1, e2e_steps=3, e2e_batch=8, e2e_new_tokens=8) if args.smoke else \
        dict(source_len=512, target_len=128, warmup=3, steps=5, k=8, sources=32, rollout_source_len=256,
             new_tokens=128, repeats=2, e2e_steps=12, e2e_batch=32, e2e_new_tokens=64)
    for key, value in sizes.items():
        setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        result = run_part(args.worker, args)
        args.result.write_text(json.dumps(result))
        return
    deadline = time.time() + args.budget_s
    t_all = time.perf_counter()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    saved = {}
    for part in args.parts:
        with tempfile.TemporaryDirectory(prefix="rlt2t-bench-gpu-") as tmp:
            result_file = Path(tmp) / "result.json"
            cmd = [sys.executable, __file__, "--worker", part, "--result", str(result_file), "--deadline",
                   str(deadline), "--parts", part, "--strategy", args.strategy, "--budget-s", str(args.budget_s)]
            if args.smoke:
                cmd += ["--smoke", "--out", str(args.out)]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, check=False)  # its table streams to this terminal
            took = round(time.perf_counter() - t0, 1)
            if proc.returncode != 0 or not result_file.is_file():
                payload: dict[str, Any] = {"benchmark": f"gpu_{part}", "status": "error",
                                           "reason": f"part subprocess exited {proc.returncode} (see its output)"}
            else:
                payload = json.loads(result_file.read_text())
        payload |= {"part_wall_s": took, "smoke": args.smoke}
        saved[part] = save_part(part, payload, args.out)
        print(f"{part}: {took:.0f} s, saved {saved[part]}", flush=True)
    print(f"all parts: {time.perf_counter() - t_all:.0f} s (budget {args.budget_s:.0f} s)")
    if any(json.loads(p.read_text()).get("status") == "error" for p in saved.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
