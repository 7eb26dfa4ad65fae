"""An EOS the sampler forces at the length limit is no action of the policy (it has probability 1 under the
sampling process): it carries no KL term, in the loss, the shaped reward or the adaptive controller's reading
(docs/design.md, "Masks exclude padding and the EOS a sampler forces")."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from torch import nn
from transformers import BartConfig

from rlt2t.common.config import RLConfig, RolloutConfig
from rlt2t.learner.batch import GroupBatch
from rlt2t.learner.group_step import GroupOutput
from rlt2t.learner.objectives import PolicyGradientObjective

VOCAB, T, D = 6, 3, 4


class _Logits(nn.Module):
    """A 'policy' whose logits are one parameter per (row, position): no model, just the objective's maths."""

    def __init__(self) -> None:
        super().__init__()
        self.config = BartConfig(d_model=D)
        self.w = nn.Parameter(torch.randn(2, T, VOCAB, generator=torch.Generator().manual_seed(0)))


class _Runner:
    device = torch.device("cpu")

    def __init__(self, objective: PolicyGradientObjective, model: _Logits) -> None:
        self.objective, self.model = objective, model

    def forward(self, input_ids, attention_mask, labels, k):
        logits = self.model.w[: labels.shape[0]]
        head = self.objective.module.value_head
        values = None if head is None else head(torch.ones(labels.shape[0], T, D))
        return GroupOutput(logits, values)

    def optimize(self, loss):
        loss.backward()
        self.model.zero_grad()
        return 0.0

    def all_sum(self, value):
        return value

    def all_min(self, value):
        return value

    def autocast(self):
        return contextlib.nullcontext()


@pytest.mark.parametrize("algorithm", ["rloo", "ppo", "grpo"])
def test_a_forced_eos_carries_no_kl(algorithm):
    model = _Logits()
    objective = PolicyGradientObjective(RLConfig(algorithm=algorithm), RolloutConfig(num_samples=2),
                                        types.SimpleNamespace(model=model, tokenizer=None), seed=0)
    labels = torch.tensor([[3, 4, 2], [3, 2, -100]])  # row 0 hit the length limit: EOS (2) forced; row 1 drew it
    drawn = labels != -100
    drawn[0, 2] = False
    with torch.no_grad():
        logp = model.w.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0] * (labels != -100)
    reference = logp.clone()
    reference[0, 2] -= 5.0  # the reference disagrees only on the token nobody drew
    batch = GroupBatch(input_ids=torch.zeros(1, 2, dtype=torch.long), attention_mask=torch.ones(1, 2, dtype=torch.long),
                       labels=labels, sample_logprobs=logp.clone(), loss_mask=drawn,
                       rewards=torch.tensor([[1.0, 1.0]]), reference_logprobs=reference)
    coef = objective.kl.coef
    metrics = objective.step(_Runner(objective, model), batch, [], 0)
    for key in ("kl_k1", "kl_k3", "kl_seq"):  # before: k1 1.0, k3 ~0.8 per token, 2.5 nats per sequence
        assert metrics[key] == pytest.approx(0.0, abs=1e-6), key
    assert objective.kl.coef <= coef  # the controller read a KL of 0 (below target): it can only lower β
    if algorithm == "rloo":  # equal rewards and no KL: nothing to learn
        assert metrics["advantage_std"] == pytest.approx(0.0, abs=1e-6)
