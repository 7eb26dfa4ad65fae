"""GRPO: group-relative policy optimisation (Shao et al. 2024), the default algorithm."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlt2t.learner.algorithms.base import PolicyGradient

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor

    from rlt2t.common.config import PolicyGradientConfig


class GRPO(PolicyGradient):
    """Group-relative policy optimisation: each sample's reward minus its source's mean reward, divided by a
    spread chosen by rl.pg.grpo_scale (the batch's, the group's, or none: Dr. GRPO); K >= 2. The KL to the
    reference is a loss term, β·k3. The default: the benchmark's most consistent gain over continued SFT."""

    name = "grpo"
    min_samples = 2
    kl_in_loss = True

    def advantages(self, rewards: Tensor, *, seq_kl: Tensor, beta: float, greedy_rewards: Tensor | None,
                   pg: PolicyGradientConfig, all_sum: Callable[[Tensor], Tensor]) -> Tensor:
        from rlt2t.learner.losses import normalised_advantages

        return normalised_advantages(rewards, scale=pg.grpo_scale, all_sum=all_sum)
