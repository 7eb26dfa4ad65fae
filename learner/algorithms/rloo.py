"""RLOO: REINFORCE with a leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlt2t.learner.algorithms.base import PolicyGradient

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor

    from rlt2t.common.config import PolicyGradientConfig


class RLOO(PolicyGradient):
    """REINFORCE leave-one-out: each sample's reward, shaped by −β times its summed k1 to the reference, minus
    the mean shaped reward of the source's other K − 1 samples (K >= 2)."""

    name = "rloo"
    min_samples = 2

    def advantages(self, rewards: Tensor, *, seq_kl: Tensor, beta: float, greedy_rewards: Tensor | None,
                   pg: PolicyGradientConfig, all_sum: Callable[[Tensor], Tensor]) -> Tensor:
        from rlt2t.learner.losses import leave_one_out_advantages

        # The KL as a reward: every sample's reward and its leave-one-out baseline are shaped alike.
        return leave_one_out_advantages(rewards - beta * seq_kl)
