"""GPU path of learned rewards (`make gpu-smoke`): a reward model and the registry score on CUDA as on CPU,
and a reward model trains there through the stage loop. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from rlt2t.common.checkpoint import save_checkpoint
from rlt2t.common.config import ModelConfig, RewardConfig, RewardModelConfig, RunConfig
from rlt2t.common.policy import load_policy
from rlt2t.common.preferences import rank_list_group
from rlt2t.common.reward_model import init_reward_model
from rlt2t.common.rewards import build_reward
from rlt2t.common.tokenization import save_tokenizer
from rlt2t.learner.reward_model import evaluate_groups, train_reward_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_reward_model_scores_and_trains_on_cuda(ids_tokenizer_dir, tmp_path):
    policy = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0)
    policy.model.save_pretrained(tmp_path / "policy")
    save_tokenizer(policy.tokenizer, tmp_path / "policy")
    model = init_reward_model(tmp_path / "policy", max_source_len=16, max_candidate_len=16, dropout=0.0, seed=0)
    groups = [rank_list_group(f"{i} 1 2", [f"7 {i}", f"{i} 3 4", f"{i} 5 6 8"]) for i in range(40)]
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert evaluate_groups(model, groups[32:])["pair_accuracy"] < 0.5  # the untrained model ranks them wrong
    run = RunConfig(dir=str(tmp_path), device="cuda", progress=False)
    # 3 epochs at 1e-3 learn the ranking (held-out pair accuracy 0 -> 1 on CPU, reward gap ~0.13)
    train_reward_model(model, groups[:32], groups[32:], RewardModelConfig(epochs=3, batch_size=8, lr=1e-3), run,
                       tmp_path / "rm")
    assert {p.device.type for p in model.parameters()} == {"cuda"}  # trained there
    assert any(not torch.equal(before[k], v.cpu()) for k, v in model.state_dict().items()), "no weight moved"
    assert evaluate_groups(model, groups[32:])["pair_accuracy"] > 0.5
    save_checkpoint(tmp_path / "rm2", "epoch-0001", model=model.cpu(), tokenizer=model.tokenizer, step=1)
    sources, cands = ["1 2 3"] * 3, ["7 7", "8", "9 10 11"]
    terms = [{"kind": "reward_model", "path": str(tmp_path / "rm2")}]
    on_cpu = build_reward(RewardConfig(terms=terms), device="cpu").score(sources, cands)
    gpu_reward = build_reward(RewardConfig(terms=terms), device="cuda")
    ((_, _, term),) = gpu_reward.terms
    assert {p.device.type for p in term.model.parameters()} == {"cuda"}
    on_gpu = gpu_reward.score(sources, cands)
    assert on_gpu == pytest.approx(on_cpu.tolist(), abs=1e-4)
