"""bench/gpu.py: the GPU peak lookup, the FLOP count against a hand count, and one CPU smoke run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def gpu(bench_script):
    return bench_script("gpu")


@pytest.mark.parametrize(("name", "peak"), [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
])
def test_peak_of_known_gpus(gpu, name, peak):
    assert gpu.peak_tflops(name)[0] == peak


@pytest.mark.parametrize("name", ["Tesla T4", None, ""])
def test_unknown_gpu_or_none_has_no_peak_and_says_why(gpu, name):
    peak, why = gpu.peak_tflops(name)
    assert peak is None and why
    if name:
        assert name in why


def test_bart_flops_against_a_hand_count(gpu):
    # d_model 8, 2 heads (d_attn 8), FFN 16, 1+1 layers, vocabulary 10, tied head.
    shape = gpu.Shape("t", "bart", d_model=8, heads=2, d_ff=16, enc_layers=1, dec_layers=1, vocab=10)
    params = gpu.matmul_params(gpu.build_model(shape))
    # encoder: q, k, v, o 4*8*8 + fc1 8*16 + fc2 16*8; decoder: self 256 + cross 256 + FFN 256; cross k, v 2*8*8
    assert params == {"encoder": 512, "decoder": 768, "cross_kv": 128, "head": 80}
    flops = gpu.step_flops(params, shape, batch=2, source_len=5, target_len=3)
    dense = 6 * 2 * (512 * 5 + (768 - 128) * 3 + 128 * 5 + 80 * 3)  # = 64320
    attention = 12 * 2 * 8 * (1 * 5 * 5 + 1 * (3 * 3 + 3 * 5))  # = 9408
    assert flops == {"dense": dense, "attention": attention, "total": dense + attention}
    assert flops["total"] == 73728


def test_t5_gated_untied_flops_use_heads_times_d_kv(gpu):
    # d_model 8, 2 heads of d_kv 6 (d_attn 12 != d_model), gated-GELU FFN 16 (wi_0, wi_1, wo), untied head.
    shape = gpu.Shape("t", "t5", d_model=8, heads=2, d_ff=16, enc_layers=1, dec_layers=2, vocab=10, d_kv=6,
                      ffn="gated-gelu", tied=False)
    params = gpu.matmul_params(gpu.build_model(shape))
    attn, ffn = 4 * 8 * 12, 3 * 8 * 16  # 384 each
    assert params == {"encoder": attn + ffn, "decoder": 2 * (2 * attn + ffn), "cross_kv": 2 * 2 * 8 * 12, "head": 80}
    flops = gpu.step_flops(params, shape, batch=1, source_len=4, target_len=2)
    assert flops["attention"] == 12 * 1 * 12 * (1 * 16 + 2 * (4 + 8))
    assert flops["dense"] == 6 * (768 * 4 + (2304 - 384) * 2 + 384 * 4 + 80 * 2)


def test_smoke_needs_an_out_directory_away_from_the_results(gpu, tmp_path):
    with pytest.raises(SystemExit):
        gpu.parse_args(["--smoke"])
    with pytest.raises(SystemExit):
        gpu.parse_args(["--smoke", "--out", str(gpu.RESULTS)])
    with pytest.raises(SystemExit):
        gpu.parse_args(["--parts", "learner,nope"])
    args = gpu.parse_args(["--smoke", "--out", str(tmp_path), "--parts", "rollout"])
    assert args.parts == ["rollout"] and args.source_len < 512


@pytest.mark.slow
def test_smoke_run_of_learner_and_rollout_writes_its_results_only_to_out(tmp_path):
    before = {p: p.stat().st_mtime_ns for p in (REPO / "bench" / "results").glob("gpu_*.json")}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu.py"), "--smoke", "--out", str(tmp_path),
                           "--parts", "learner,rollout"], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "target: t5-large MFU >= 35%: unknown" in proc.stdout
    learner = json.loads((tmp_path / "gpu_learner.json").read_text())
    assert {"machine", "runs", "target", "flops_formula", "peak_bf16_tflops", "smoke"} <= set(learner)
    assert learner["smoke"] is True and learner["peak_bf16_tflops"] is None
    runs = {(r["model"], r["mode"]): r for r in learner["runs"]}
    assert set(runs) == {(m, mode) for m in ("bart-base", "bart-large", "t5-large", "flan-t5-xl")
                         for mode in ("plain", "fsdp")}
    for run in runs.values():
        assert run["status"] == "ok", run
        assert run["step_s_median"] > 0 and run["flops_per_step"]["total"] > 0 and run["mfu"] is None
    assert runs[("flan-t5-xl", "fsdp")]["activation_checkpointing"] is True
    assert "profile_top10" in runs[("t5-large", "plain")]
    assert learner["target"]["met"] is None and learner["target"]["target"] == 0.35

    rollout = json.loads((tmp_path / "gpu_rollout.json").read_text())
    assert {"machine", "models", "target", "workload"} <= set(rollout)
    for name in ("bart-base", "t5-large"):
        model = rollout["models"][name]
        assert model["status"] == "ok", model
        assert {"hf_generate", "ct2_int8", "ct2_float32"} <= set(model["variants"])
        for v in model["variants"].values():
            # EOS is masked until the last position: every row is exactly new_tokens long
            assert v["generated_tokens"] == rollout["workload"]["sources"] * 8 * rollout["workload"]["new_tokens"]
            assert v["tokens_per_s"] > 0
        assert model["best_ct2"].startswith("ct2_")
    assert set(rollout["target"]["value"]) == {"bart-base", "t5-large"}
    assert not (tmp_path / "gpu_e2e.json").exists()
    after = {p: p.stat().st_mtime_ns for p in (REPO / "bench" / "results").glob("gpu_*.json")}
    assert after == before, "a smoke run wrote into bench/results/"
