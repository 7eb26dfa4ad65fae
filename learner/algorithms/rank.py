"""Rank RL: rlt2t's original objective, CE on the gold target plus a pairwise rank loss on scored pairs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlt2t.common.algorithms import Algorithm

if TYPE_CHECKING:
    from rlt2t.common.config import RLConfig, RolloutConfig


class Rank(Algorithm):
    """CE(gold) + λ·pairwise rank loss (rl.rank.*): the rollouts sample K candidates per source, add the gold
    target, and draw a pair; the reward orders it. One optimizer step per batch, with dropout, no KL to a
    reference; the rollouts' weights are refreshed once per epoch by default. The cheapest step."""

    name = "rank"
    data = "pairs"
    uses_reference = False
    default_refresh_steps = 0

    def check_rl(self, rl: RLConfig) -> None:
        if rl.pg.sft_coef:
            raise ValueError("rl.pg.sft_coef: rank RL already trains on the gold targets (its CE term, with "
                             "rl.rank.loss_weight weighing the rank loss against it); the likelihood term is for the "
                             "policy-gradient algorithms")

    def target_use(self, rl: RLConfig) -> str | None:
        return "rl.algorithm=rank (CE on each row's target, which also joins its candidate set)"

    def objective(self, rl: RLConfig, rollout: RolloutConfig, policy: Any, *, seed: int,
                  reference: Any = None) -> Any:
        from rlt2t.learner.objectives import RankObjective

        return RankObjective(rl, policy)
