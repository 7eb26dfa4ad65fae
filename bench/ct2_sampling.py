"""Sampling throughput (candidates/s) of CTranslate2 int8 vs Hugging Face, plus greedy throughput and memory.

    python bench/ct2_sampling.py [--repeats 3] [--threads 2] [--no-save]

Model: a BART of 45M parameters (d_model 512, 6+6 layers, 8 heads, FFN 2048, vocabulary 2000 = our `ids`
tokenizer with 1894 data tokens), random weights, built from a BartConfig. Random weights stop at random
lengths, so the EOS logit gets a -1e4 bias (in the weights, so every backend sees it) and no forced EOS:
every candidate is exactly 48 tokens and each variant does the same work.

Workload (the rank-RL rollout): 32 sources of 64 random tokens x K = 6 samples x 48 tokens, top-k 3,
temperature 0.8, 2 threads. Variants:

- `hf_generate`: ``model.generate(do_sample=True, top_k=3, temperature=0.8, num_return_sequences=6)``;
- `hf_sample_candidates`: rlt2t's per-row-seeded KV-cached sampler (the torch rollout backend);
- `ct2_*`: :func:`rlt2t.common.ct2.sample_ct2` over the int8 export, with the thread / batching /
  compute-type settings in the name (intra = OpenMP threads per batch, inter = batches in parallel).

Greedy: 32 sources x 48 tokens, HF ``generate`` vs CT2 int8.

``--family t5``: the same workload on a T5 of the t5-small shape (45M parameters: d_model 512, 6+6 layers, 8 heads,
FFN 2048, relative attention, the same 2000-token vocabulary), saved as ct2_sampling_t5.json. T5 has no logit bias
to suppress EOS with, so every variant asks for exactly 48 tokens instead (``min_new_tokens`` in HF,
``min_decoding_length`` in CT2; both mask EOS until then); rlt2t's own sampler has no such option and is left out.
Each variant runs in its own subprocess (fresh allocator, so ``ru_maxrss`` is that variant's peak); the table gives
the peak RSS and the peak above the process's RSS after imports. Times are medians of ``--repeats`` timed runs
after one warmup. Issue target: CT2 int8 sampling >= 2x hf_generate. Saves bench/results/ct2_sampling.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOURCES, K, NEW_TOKENS, SOURCE_LEN = 32, 6, 48, 64
TOP_K, TEMPERATURE = 3, 0.8
TARGET_SPEEDUP = 2.0
# name -> (kind, options); ct2 options: compute_type, intra_threads, inter_threads, max_batch_size, batch_type
VARIANTS: dict[str, tuple[str, dict]] = {
    "hf_generate": ("hf_generate", {}),
    "hf_sample_candidates": ("hf_sample_candidates", {}),
    "ct2_int8_intra2": ("ct2", dict(compute_type="int8", intra_threads=2, inter_threads=1, max_batch_size=0)),
    "ct2_int8_float32_intra2": ("ct2", dict(compute_type="int8_float32", intra_threads=2, inter_threads=1,
                                            max_batch_size=0)),
    "ct2_int8_inter2_mb16": ("ct2", dict(compute_type="int8", intra_threads=1, inter_threads=2, max_batch_size=16)),
    "ct2_int8_intra2_mb8": ("ct2", dict(compute_type="int8", intra_threads=2, inter_threads=1, max_batch_size=8)),
    "ct2_float32_intra2": ("ct2", dict(compute_type="float32", intra_threads=2, inter_threads=1, max_batch_size=0)),
    "hf_greedy": ("hf_greedy", {}),
    "ct2_int8_greedy": ("ct2_greedy", dict(compute_type="int8", intra_threads=2, inter_threads=1, max_batch_size=0)),
}


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


T5_VARIANTS = ("hf_generate", "ct2_int8_intra2", "ct2_int8_inter2_mb16", "hf_greedy", "ct2_int8_greedy")


def build(workdir: Path, family: str = "bart") -> tuple[Path, Path, float]:
    """The benchmark model (HF dir) and its int8 export; returns both paths and the parameter count (M)."""
    import torch
    from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

    from rlt2t.common.ct2 import export_ct2
    from rlt2t.common.tokenization import build_ids_tokenizer, save_tokenizer

    tok = build_ids_tokenizer(num_data_tokens=1894, num_sentinels=100)
    torch.manual_seed(0)
    if family == "t5":
        model = T5ForConditionalGeneration(T5Config(
            vocab_size=len(tok), d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6, num_heads=8,
            feed_forward_proj="relu", dropout_rate=0.0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
            decoder_start_token_id=tok.pad_token_id,
        )).eval()
        hf = workdir / "hf"
        model.save_pretrained(hf)
        save_tokenizer(tok, hf)
        t0 = time.perf_counter()
        export = export_ct2(hf, workdir / "ct2-int8", "int8")
        print(f"export (int8) took {time.perf_counter() - t0:.2f} s")
        return hf, export, sum(p.numel() for p in model.parameters()) / 1e6
    config = BartConfig(
        vocab_size=len(tok), d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
        decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, max_position_embeddings=256,
        dropout=0.0, normalize_before=False, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.eos_token_id, forced_eos_token_id=None,
    )
    model = BartForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.final_logits_bias[0, tok.eos_token_id] = -1e4  # never stop early: fixed-length candidates
    model.generation_config.forced_eos_token_id = None
    hf = workdir / "hf"
    model.save_pretrained(hf)
    save_tokenizer(tok, hf)
    t0 = time.perf_counter()
    export = export_ct2(hf, workdir / "ct2-int8", "int8")
    print(f"export (int8) took {time.perf_counter() - t0:.2f} s")
    return hf, export, sum(p.numel() for p in model.parameters()) / 1e6


def sources() -> list[str]:
    import random

    rng = random.Random(1)
    return [" ".join(str(rng.randrange(1894)) for _ in range(SOURCE_LEN - 1)) for _ in range(SOURCES)]


def worker(kind: str, options: dict, hf: Path, export: Path, repeats: int, threads: int, family: str = "bart") -> dict:
    """Run one variant in this process; returns timings, token counts and memory."""
    import torch

    torch.set_num_threads(threads)
    from rlt2t.common.collate import collate_seq2seq, encode_texts
    from rlt2t.common.config import ModelConfig
    from rlt2t.common.ct2 import Ct2Policy, sample_ct2
    from rlt2t.common.policy import load_policy
    from rlt2t.common.sampling import sample_candidates
    from rlt2t.common.tracking import quiet_transformers

    quiet_transformers()
    base_rss = rss_mib()
    texts = sources()
    min_new = NEW_TOKENS if family == "t5" else 0  # T5: EOS masked until the length (no logit bias to use)
    if kind.startswith("ct2"):
        ct2 = Ct2Policy(export, max_source_len=256, batch_type="examples", **options)
        if kind == "ct2" and family == "t5":
            def run() -> list[list[int]]:
                per_source = ct2.generate(texts, num_hypotheses=K, max_new_tokens=NEW_TOKENS, sampling_topk=TOP_K,
                                          sampling_temperature=TEMPERATURE, min_new_tokens=NEW_TOKENS, seed=0)
                return [list(h.token_ids) for hyps in per_source for h in hyps]
        elif kind == "ct2":
            def run() -> list[list[int]]:
                return sample_ct2(ct2, texts, K, TOP_K, TEMPERATURE, NEW_TOKENS, seed=0)
        else:
            def run() -> list[list[int]]:
                return [list(h[0].token_ids) for h in ct2.generate(texts, max_new_tokens=NEW_TOKENS,
                                                                     min_new_tokens=min_new)]
    else:
        policy = load_policy(ModelConfig(dropout=0.0), checkpoint=hf)
        model = policy.model.eval()
        ids, _ = encode_texts(policy.tokenizer, texts, 256)
        batch = collate_seq2seq(ids, None, policy.tokenizer.pad_token_id)

        def rows(out: torch.Tensor) -> list[list[int]]:
            return [r[1:] for r in out.tolist()]  # drop the decoder start token

        if kind == "hf_generate":
            def run() -> list[list[int]]:
                with torch.inference_mode():
                    return rows(model.generate(**batch, do_sample=True, top_k=TOP_K, temperature=TEMPERATURE,
                                               num_return_sequences=K, max_new_tokens=NEW_TOKENS,
                                               min_new_tokens=min_new))
        elif kind == "hf_sample_candidates":
            def run() -> list[list[int]]:
                gens = [torch.Generator().manual_seed(i) for i in range(SOURCES * K)]
                return [r.token_ids for r in sample_candidates(policy.model, batch["input_ids"],
                                                               batch["attention_mask"], K, TOP_K, TEMPERATURE,
                                                               NEW_TOKENS, gens)]
        else:
            def run() -> list[list[int]]:
                with torch.inference_mode():
                    return rows(model.generate(**batch, do_sample=False, num_beams=1, max_new_tokens=NEW_TOKENS,
                                               min_new_tokens=min_new))
    out = run()  # warmup
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    tokens = sum(len(r) for r in out)
    return {"kind": kind, "options": options, "rows": len(out), "mean_tokens": tokens / len(out),
            "seconds": times, "seconds_median": seconds, "candidates_per_s": len(out) / seconds,
            "tokens_per_s": tokens / seconds, "peak_rss_mib": rss_mib(), "rss_after_imports_mib": base_rss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=["bart", "t5"], default="bart", help="model family (default bart)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per variant (median reported; default 3)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the HF variants (default 2)")
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--no-save", action="store_true", help="print only; leave bench/results/ alone")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--paths", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.repeats < 1 or args.threads < 1:
        ap.error("--repeats and --threads must be >= 1")
    if args.worker:
        hf, export = args.paths.split(",")
        kind, options = VARIANTS[args.worker]
        print("RESULT " + json.dumps(worker(kind, options, Path(hf), Path(export), args.repeats, args.threads,
                                            args.family)))
        return
    names = [n for n in args.only.split(",") if n] or list(T5_VARIANTS if args.family == "t5" else VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"--only: unknown variants {unknown} (known: {', '.join(VARIANTS)})")

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine_info import save

    from rlt2t.common.tracking import quiet_transformers

    quiet_transformers()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rlt2t-bench-ct2-") as tmp:
        hf, export, params_m = build(Path(tmp), args.family)
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
        for name in names:
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", name, "--paths", f"{hf},{export}", "--repeats",
                 str(args.repeats), "--threads", str(args.threads), "--family", args.family],
                capture_output=True, text=True, env=env, check=False)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                raise SystemExit(f"variant {name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
            results[name] = json.loads(line.removeprefix("RESULT "))
            r = results[name]
            print(f"{name:>26}: {r['candidates_per_s']:8.1f} cand/s {r['tokens_per_s']:9.0f} tok/s  "
                  f"median {r['seconds_median']:6.2f} s  peak RSS {r['peak_rss_mib']:6.0f} MiB", flush=True)

    sampling = {n: r for n, r in results.items() if r["kind"] in ("hf_generate", "hf_sample_candidates", "ct2")}
    print(f"\n{args.family.upper()} {params_m:.1f}M params; {SOURCES} sources x {K} samples x {NEW_TOKENS} tokens, "
          f"top-k {TOP_K}, temperature {TEMPERATURE}, {args.threads} threads, median of {args.repeats}")
    header = f"{'variant':>26} {'cand/s':>8} {'tok/s':>8} {'vs hf_generate':>15} {'peak MiB':>9} {'above imports':>14}"
    print(header)
    base = results.get("hf_generate", {}).get("candidates_per_s")
    greedy_base = results.get("hf_greedy", {}).get("candidates_per_s")
    for name, r in results.items():
        ref = greedy_base if r["kind"] in ("hf_greedy", "ct2_greedy") else base
        ratio = f"{r['candidates_per_s'] / ref:.2f}x" if ref else "-"
        print(f"{name:>26} {r['candidates_per_s']:8.1f} {r['tokens_per_s']:8.0f} {ratio:>15} "
              f"{r['peak_rss_mib']:9.0f} {r['peak_rss_mib'] - r['rss_after_imports_mib']:14.0f}")
    ct2_best = max((n for n, r in sampling.items() if r["kind"] == "ct2"),
                   key=lambda n: sampling[n]["candidates_per_s"], default=None)
    speedup = sampling[ct2_best]["candidates_per_s"] / base if ct2_best and base else None
    if speedup is not None:
        verdict = "meets" if speedup >= TARGET_SPEEDUP else "misses"
        print(f"best CT2 sampling: {ct2_best}, {speedup:.2f}x hf_generate ({verdict} the {TARGET_SPEEDUP}x target)")
    if args.no_save:
        return
    payload = {
        "benchmark": "ct2_sampling",
        "model": {"family": args.family, "d_model": 512, "layers": "6+6", "heads": 8, "ffn": 2048, "vocab": 2000,
                  "parameters_m": round(params_m, 2)},
        "workload": {"sources": SOURCES, "k": K, "new_tokens": NEW_TOKENS, "source_len": SOURCE_LEN, "top_k": TOP_K,
                     "temperature": TEMPERATURE, "threads": args.threads, "repeats": args.repeats,
                     "eos": ("masked until 48 tokens (min_new_tokens / min_decoding_length)" if args.family == "t5"
                             else "suppressed by a -1e4 logit bias; no forced EOS")},
        "results": results, "best_ct2_sampling": ct2_best,
        "speedup_vs_hf_generate": round(speedup, 3) if speedup else None,
        "target_speedup": TARGET_SPEEDUP, "meets_target": bool(speedup and speedup >= TARGET_SPEEDUP),
    }
    print("saved", save("ct2_sampling" if args.family == "bart" else f"ct2_sampling_{args.family}", payload))


if __name__ == "__main__":
    main()
