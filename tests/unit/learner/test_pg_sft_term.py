"""The policy gradients' likelihood term (rl.pg.sft_coef): cross-entropy on each source's gold target, decoded as
one more row per source on the samples' encoder pass, added to every optimizer step."""

from __future__ import annotations

import contextlib
import copy
import types

import pydantic
import pytest
import torch

from rlt2t.common.collate import IGNORE_INDEX, encode_texts
from rlt2t.common.config import RLConfig, RolloutConfig
from rlt2t.common.types import SampledGroup, ScoredGroup
from rlt2t.learner.losses import gold_cross_entropy
from rlt2t.learner.objectives import PolicyGradientObjective

K = 3
SOURCES = ["11 12 13 14", "20 21", "30 31 32 33 34 35"]
# Gold targets longer and shorter than the samples (at most 6 tokens with EOS); SHORT_GOLDS: a batch whose gold
# rows are all narrower than its sample rows, so the widening pads the gold rows instead.
GOLDS = ["40 41 42 43 44 45 46 47 48", "50", "52 53 54"]
SHORT_GOLDS = ["40", "50", "52"]


def _runner(objective: PolicyGradientObjective) -> types.SimpleNamespace:
    """One learner rank without DDP (a StepRunner): optimize() records the gradient and leaves the weights alone."""
    grads: list[dict[str, torch.Tensor]] = []
    module = objective.module

    def optimize(loss: torch.Tensor) -> float:
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
        module.zero_grad()
        return 0.0

    return types.SimpleNamespace(device=torch.device("cpu"), forward=lambda *args: module(*args), optimize=optimize,
                                 all_sum=lambda v: v, all_min=lambda v: v, autocast=contextlib.nullcontext,
                                 grads=grads)


def _items(policy, golds: list[str] = GOLDS) -> list[ScoredGroup]:
    g = torch.Generator().manual_seed(0)
    eos = policy.tokenizer.eos_token_id
    items = []
    for i, (source, gold) in enumerate(zip(SOURCES, golds, strict=True)):
        ids = tuple(tuple(torch.randint(12, 60, (int(n),), generator=g).tolist()) + (eos,)
                    for n in torch.randint(1, 6, (K,), generator=g))
        group = SampledGroup(example_id=str(i), source=source, reference=gold, candidates=("x",) * K,
                             token_ids=ids, sample_logprobs=tuple((-1.0,) * len(t) for t in ids),
                             forced_eos=(False,) * K, policy_version=0)
        items.append(ScoredGroup(group=group, rewards=tuple(float(r) for r in range(K))))
    return items


def _objective(policy, coef: float, algorithm: str = "grpo") -> PolicyGradientObjective:
    rl = RLConfig(algorithm=algorithm, kl={"coef": 0.0}, pg={"sft_coef": coef, "epochs": 1, "minibatches": 1})
    return PolicyGradientObjective(rl, RolloutConfig(num_samples=K), policy, seed=0)


def test_the_batch_carries_the_gold_targets_only_when_the_term_is_on(tiny_policy):
    items = _items(tiny_policy)
    on = _objective(tiny_policy, 0.5).collate(items, max_source_len=16, max_target_len=6)
    off = _objective(tiny_policy, 0.0).collate(items, max_source_len=16, max_target_len=6)
    assert off.gold_labels is None
    expected, _ = encode_texts(tiny_policy.tokenizer, GOLDS, 6, target=True)
    assert on.gold_labels is not None and on.gold_labels.shape == (3, 6)  # the 9-token gold cut to 6, EOS kept
    for row, ids in zip(on.gold_labels.tolist(), expected, strict=True):
        assert row[: len(ids)] == ids and all(v == IGNORE_INDEX for v in row[len(ids):])
    assert on.gold_labels[0, -1] == tiny_policy.tokenizer.eos_token_id
    torch.testing.assert_close(on.labels, off.labels)
    picked = on.select(torch.tensor([2, 0]))
    assert picked.gold_labels is not None
    torch.testing.assert_close(picked.gold_labels, on.gold_labels[[2, 0]])


@pytest.mark.parametrize("golds", [GOLDS, SHORT_GOLDS], ids=["gold-wider", "gold-narrower"])
def test_the_gold_row_shares_the_encoder_pass_and_leaves_the_samples_logits_alone(tiny_policy, golds):
    model = tiny_policy.model.eval()
    objective = _objective(tiny_policy, 1.0)
    batch = objective.collate(_items(tiny_policy, golds), max_source_len=16, max_target_len=16)
    assert batch.gold_labels is not None
    assert (batch.gold_labels.shape[1] > batch.labels.shape[1]) == (golds is GOLDS)
    runner = _runner(objective)
    out, gold_logits = objective._forward(runner, batch)
    plain = runner.forward(batch.input_ids, batch.attention_mask, batch.labels, K)
    valid = batch.labels != IGNORE_INDEX
    assert out.logits.shape == plain.logits.shape
    torch.testing.assert_close(out.logits[valid], plain.logits[valid], atol=1e-5, rtol=1e-5)
    # the gold rows against a plain forward of the model on (source, gold): Hugging Face's own loss
    assert gold_logits is not None and gold_logits.shape[:2] == batch.gold_labels.shape
    with torch.no_grad():
        full = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.gold_labels)
    gold_valid = batch.gold_labels != IGNORE_INDEX
    torch.testing.assert_close(gold_logits[gold_valid], full.logits[gold_valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gold_cross_entropy(gold_logits, batch.gold_labels), full.loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_the_step_adds_the_weighted_gold_cross_entropy_to_the_gradient(tiny_policy, algorithm):
    coef = 0.7
    items = _items(tiny_policy)
    policy = copy.copy(tiny_policy)
    policy.model = tiny_policy.model.eval()
    with_term = _objective(policy, coef, algorithm)
    without = _objective(policy, 0.0, algorithm)
    if with_term.module.value_head is not None:  # the same critic in both, so only the term differs
        without.module.value_head.load_state_dict(with_term.module.value_head.state_dict())
    runs = {}
    for name, objective in (("with", with_term), ("without", without)):
        batch = objective.collate(items, max_source_len=16, max_target_len=16)
        runner = _runner(objective)
        runs[name] = (objective.step(runner, batch, items, 0), runner.grads)
    (metrics, grads), (base_metrics, base_grads) = runs["with"], runs["without"]
    assert len(grads) == len(base_grads) == 1  # one epoch, one minibatch
    assert "sft_loss" in metrics and "sft_loss" not in base_metrics
    assert "sft_loss" in with_term.metric_keys and "sft_loss" not in without.metric_keys
    # by hand: the gold cross-entropy of the weights the first optimizer step saw (the runner moves nothing)
    model = policy.model
    batch = with_term.collate(items, max_source_len=16, max_target_len=16)
    ce = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.gold_labels).loss
    ce.backward()
    ce = ce.detach()
    ce_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    assert metrics["sft_loss"] == pytest.approx(float(ce), rel=1e-5)
    assert metrics["loss"] == pytest.approx(base_metrics["loss"] + coef * float(ce), rel=1e-4, abs=1e-5)
    for name, grad in grads[0].items():
        prefix = "model."
        expected = base_grads[0][name] + coef * ce_grads.get(name.removeprefix(prefix), torch.zeros_like(grad))
        torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-4, msg=name)


def test_a_negative_coefficient_and_rank_rl_are_refused_by_name():
    with pytest.raises(pydantic.ValidationError, match="sft_coef"):
        RLConfig(pg={"sft_coef": -0.1})
    with pytest.raises(pydantic.ValidationError, match=r"rl\.pg\.sft_coef: rank RL"):
        RLConfig(algorithm="rank", pg={"sft_coef": 0.5})
    assert RLConfig(algorithm="rank").pg.sft_coef == 0  # the default stays valid for every algorithm


def test_nlpo_with_minibatches_takes_the_term_in_every_step(tiny_policy):
    # NLPO's action mask indexes the sample rows only; 2 epochs x 2 minibatches each decode their sources' gold rows.
    rl = RLConfig(algorithm="nlpo", kl={"coef": 0.0}, pg={"sft_coef": 0.5, "target_kl": 0.0})
    policy = copy.copy(tiny_policy)
    policy.model = tiny_policy.model.eval()
    objective = PolicyGradientObjective(rl, RolloutConfig(num_samples=K), policy, seed=0)
    items = _items(policy)
    batch = objective.collate(items, max_source_len=16, max_target_len=16)
    runner = _runner(objective)
    metrics = objective.step(runner, batch, items, 0)
    assert metrics["optimizer_steps"] == 4 and len(runner.grads) == 4
    assert 0 < metrics["sft_loss"] < 20 and "mask_leak" in metrics
