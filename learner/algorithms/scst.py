"""SCST: self-critical sequence training (Rennie et al. 2017)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlt2t.learner.algorithms.base import PolicyGradient

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor

    from rlt2t.common.config import PolicyGradientConfig


class SCST(PolicyGradient):
    """Self-critical sequence training: each sample's advantage is its reward minus the reward of the source's
    greedy decode (the rollouts decode it too). The KL to the reference is a loss term, β·k3: a greedy baseline
    has no KL to shape it with, and shaping only the samples would bias every advantage negative as the KL
    grows."""

    name = "scst"
    greedy_baseline = True
    kl_in_loss = True

    def advantages(self, rewards: Tensor, *, seq_kl: Tensor, beta: float, greedy_rewards: Tensor | None,
                   pg: PolicyGradientConfig, all_sum: Callable[[Tensor], Tensor]) -> Tensor:
        from rlt2t.learner.losses import baseline_advantages

        return baseline_advantages(rewards, greedy_rewards)
