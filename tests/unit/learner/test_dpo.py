"""DPO / IPO (learner/algorithms/dpo.py): the loss by hand, its settings section, and a Learner (world size 1)
taking steps on preference pairs: at the start the policy is its reference (h = 0), then it learns the pairs,
scoring chosen and rejected with one encoder pass exactly as separate passes would."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlt2t.common.collate import IGNORE_INDEX
from rlt2t.common.config import ConfigError, ModelConfig, RLConfig, load_config
from rlt2t.common.policy import load_policy
from rlt2t.common.scoring import token_scores
from rlt2t.common.types import PreferencePair
from rlt2t.learner.algorithms.dpo import DPOSettings, preference_loss
from rlt2t.learner.learner import Learner

MODEL = ModelConfig(preset="tiny", family="bart", dropout=0.1)  # dropout in the config: DPO turns it off
PAIRS = [PreferencePair(f"p{i}", source=" ".join(str(10 + (i * 7 + j) % 50) for j in range(3 + i % 3)),
                        chosen=" ".join(str(10 + (i + j) % 50) for j in range(2 + i % 2)),
                        rejected=" ".join(str(40 + (i * 5 + j) % 20) for j in range(3)))
         for i in range(8)]


def test_the_losses_by_hand():
    h = torch.tensor([0.0, 2.0, -1.0])
    sig = DPOSettings(beta=0.5)
    expected = [-math.log(1 / (1 + math.exp(-0.5 * x))) for x in (0.0, 2.0, -1.0)]
    torch.testing.assert_close(preference_loss(h, sig), torch.tensor(expected))
    smooth = DPOSettings(beta=0.5, label_smoothing=0.2)
    expected = [0.8 * -math.log(1 / (1 + math.exp(-0.5 * x))) + 0.2 * -math.log(1 / (1 + math.exp(0.5 * x)))
                for x in (0.0, 2.0, -1.0)]
    torch.testing.assert_close(preference_loss(h, smooth), torch.tensor(expected))
    ipo = DPOSettings(beta=0.5, loss="ipo")  # pulled to h = 1 / (2 * 0.5) = 1
    torch.testing.assert_close(preference_loss(h, ipo), torch.tensor([1.0, 1.0, 4.0]))


def test_the_settings_section_is_rl_dpo():
    cfg = load_config(overrides=["rl.algorithm=dpo", "rl.dpo.beta=0.3", "rl.dpo.loss=ipo", "rl.dpo.pairs=[a.jsonl]"])
    assert cfg.rl.section() == DPOSettings(beta=0.3, loss="ipo", pairs=["a.jsonl"])
    assert load_config(overrides=["rl.algorithm=dpo"]).rl.section() == DPOSettings()  # defaults when absent
    with pytest.raises(ConfigError, match=r"rl.dpo.beta: Input should be greater than 0"):
        load_config(overrides=["rl.algorithm=dpo", "rl.dpo.beta=0"])
    with pytest.raises(ConfigError, match=r"rl.dpo.betta: unknown key"):
        load_config(overrides=["rl.algorithm=dpo", "rl.dpo.betta=0.2"])
    with pytest.raises(ConfigError, match="rl.pg.sft_coef: DPO's loss has no likelihood term"):
        load_config(overrides=["rl.algorithm=dpo", "rl.pg.sft_coef=0.1"])
    # its own learning rate when rl.lr is left unset (a derived value, said so); an explicit one stays
    assert load_config(overrides=["rl.algorithm=dpo"]).rl.lr == 2e-5
    assert any(line.startswith("rl.lr: 2e-05") for line in load_config(overrides=["rl.algorithm=dpo"]).derived)
    assert load_config(overrides=["rl.algorithm=dpo", "rl.lr=1e-4"]).rl.lr == 1e-4
    assert load_config(overrides=["rl.algorithm=grpo"]).rl.lr == 2e-4
    # the section survives a dump and a reload (a run's saved config)
    from rlt2t.common.config import Config

    dumped = cfg.model_dump(mode="json")
    assert dumped["rl"]["dpo"]["beta"] == 0.3
    assert Config.model_validate(dumped).rl.section().loss == "ipo"


@pytest.fixture(scope="module")
def init_dir(ids_tokenizer_dir, tmp_path_factory) -> Path:
    policy = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0)
    out = tmp_path_factory.mktemp("init")
    policy.model.save_pretrained(out)
    policy.tokenizer.save_pretrained(out)
    return out


def _learner(init_dir: Path, model: ModelConfig = MODEL, **dpo) -> Learner:
    rl = RLConfig(algorithm="dpo", batch_size=8, lr=3e-3, warmup_ratio=0.0, dpo=dpo)
    return Learner(model, None, rl, init_checkpoint=str(init_dir), rank=0, world_size=1, total_steps=40, seed=0,
                   max_source_len=16, max_target_len=16)


def _sequence_logprob(model, tokenizer, pair_source: str, target: str) -> float:
    enc = tokenizer([pair_source], return_tensors="pt")
    labels = tokenizer(text_target=[target], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(**enc, labels=labels).logits
    return float(token_scores(logits, labels, "logprobs", IGNORE_INDEX).sum())


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_a_learner_learns_the_preferences(init_dir, loss):
    learner = _learner(init_dir, loss=loss)
    first = learner.train_step(PAIRS)
    # the start is the reference: every log-ratio is 0 (dropout is off)
    assert first["reward_margin"] == 0.0 and first["reward_accuracy"] == 0.0
    assert first["loss"] == pytest.approx(math.log(2) if loss == "sigmoid" else (1 / (2 * 0.1)) ** 2, rel=1e-5)
    # the logged log-probs are those of separate teacher-forced passes of the start (one encoder pass for both)
    start = load_policy(MODEL, checkpoint=init_dir)
    start.model.eval()
    expected = sum(_sequence_logprob(start.model, start.tokenizer, p.source, p.chosen) for p in PAIRS) / len(PAIRS)
    assert first["logp_chosen"] == pytest.approx(expected, abs=1e-4)
    for _ in range(15):
        last = learner.train_step(PAIRS)
    assert last["reward_accuracy"] == 1.0 and last["loss"] < first["loss"]
    if loss == "sigmoid":  # pushes the margin on
        assert last["reward_margin"] > 0.5
    else:  # pulls h to 1 / (2 beta): the margin beta * h to 0.5, not beyond
        assert 0.3 < last["reward_margin"] < 0.6
    # the reference stayed the start: the policy's own preference moved, measured outside the learner
    policy = learner.policy.model.eval()
    moved = [(_sequence_logprob(policy, start.tokenizer, p.source, p.chosen)
              - _sequence_logprob(policy, start.tokenizer, p.source, p.rejected))
             - (_sequence_logprob(start.model, start.tokenizer, p.source, p.chosen)
                - _sequence_logprob(start.model, start.tokenizer, p.source, p.rejected)) for p in PAIRS]
    assert all(m > 0 for m in moved)


def test_pair_weights_weigh_the_loss(init_dir):
    heavy = [PreferencePair(p.example_id, p.source, p.chosen, p.rejected, weight=2.0 if i == 0 else 1e-6)
             for i, p in enumerate(PAIRS)]
    learner = _learner(init_dir)
    learner.train_step(heavy)
    learner.train_step(heavy)
    metrics = learner.train_step(heavy)
    start = load_policy(MODEL, checkpoint=init_dir)
    policy = learner.policy.model.eval()

    def gain(p):
        return (_sequence_logprob(policy, start.tokenizer, p.source, p.chosen)
                - _sequence_logprob(start.model.eval(), start.tokenizer, p.source, p.chosen))

    # the pair carrying the weight moved most towards its chosen target
    assert gain(PAIRS[0]) > max(gain(p) for p in PAIRS[1:]), metrics


def test_under_lora_the_reference_is_the_base_with_the_adapters_off(init_dir):
    lora = ModelConfig(preset="tiny", family="bart", dropout=0.0, lora={"enabled": True, "r": 4})
    learner = _learner(init_dir, model=lora)
    assert learner.objective.reference is None and learner.objective.frozen_modules() == []
    first = learner.train_step(PAIRS)
    assert first["reward_margin"] == 0.0  # adapters start at zero: policy = base
    for _ in range(10):
        last = learner.train_step(PAIRS)
    assert last["reward_accuracy"] == 1.0 and last["reward_margin"] > 0
