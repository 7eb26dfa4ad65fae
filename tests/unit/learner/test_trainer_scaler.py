"""Under fp16 the gradient scaler's state is part of the training state: a resumed run continues its loss
scale. There is no fp16 on CPU, so a CPU GradScaler stands in for accelerate's CUDA one."""

from __future__ import annotations

import pytest
import torch

from rlt2t.common.checkpoint import load_training_state, read_checkpoint
from rlt2t.common.collate import encode_texts
from rlt2t.common.config import ModelConfig, RunConfig, SFTConfig
from rlt2t.common.policy import load_policy
from rlt2t.learner import trainer
from rlt2t.learner.stages import run_sft


@pytest.fixture
def scalers(monkeypatch):
    """Every accelerator train_stage makes gets a CPU GradScaler whose scale doubles each clean step."""
    made: list[torch.amp.GradScaler] = []
    original = trainer.make_accelerator

    def with_scaler(run, **kwargs):
        accelerator = original(run, **kwargs)
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1)
        made.append(accelerator.scaler)
        return accelerator

    monkeypatch.setattr(trainer, "make_accelerator", with_scaler)
    return made


def test_resume_restores_the_gradient_scaler(tmp_path, ids_tokenizer_dir, scalers):
    mc = ModelConfig(preset="tiny", family="bart", dropout=0.0)
    policy = load_policy(mc, ids_tokenizer_dir, seed=0)
    tok = policy.tokenizer
    src = encode_texts(tok, [f"{i} {i + 1} {i + 2}" for i in range(10, 42)], 16)[0]
    tgt = encode_texts(tok, [f"{i}" for i in range(10, 42)], 8)[0]
    cfg = SFTConfig(epochs=2, batch_size=16, lr=1e-3, save_every_steps=1, keep_last=50)
    run = RunConfig(dir=str(tmp_path / "run"), seed=0, device="cpu", progress=False, log_every=1)
    run_sft(policy, src, tgt, cfg, run, tmp_path / "full")
    assert scalers[-1].get_scale() == 2.0**8  # four clean steps

    middle = tmp_path / "full" / "checkpoints" / "epoch-0001"
    assert load_training_state(middle)["scaler"]["scale"] == 2.0**6
    resumed = load_policy(mc, ids_tokenizer_dir, checkpoint=middle)
    run_sft(resumed, src, tgt, cfg, run, tmp_path / "resumed", resume_from=read_checkpoint(middle))
    assert scalers[-1].get_scale() == 2.0**8, "the resumed run restarted its loss scale"


def test_no_scaler_no_scaler_state(tmp_path, ids_tokenizer_dir):
    policy = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0)
    src = encode_texts(policy.tokenizer, ["1 2 3", "4 5 6"], 16)[0]
    cfg = SFTConfig(epochs=1, batch_size=2, lr=1e-3, save_every_steps=0)
    run = RunConfig(dir=str(tmp_path / "run"), seed=0, device="cpu", progress=False)
    result = run_sft(policy, src, src, cfg, run, tmp_path / "sft")
    assert "scaler" not in load_training_state(result.checkpoint)
