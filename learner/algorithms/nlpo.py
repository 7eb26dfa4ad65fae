"""NLPO: natural language policy optimisation (Ramamurthy et al. 2023), PPO inside a masking policy's top-p set."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlt2t.common.types import RolloutSpec
from rlt2t.learner.algorithms.base import ActorCritic

if TYPE_CHECKING:
    from rlt2t.common.config import Config, RLConfig


class NLPO(ActorCritic):
    """PPO whose action space is the top-p tokens (rl.pg.nlpo_top_p) of a masking policy: a copy of the policy
    refreshed every rl.pg.nlpo_mask_refresh_steps learner steps. The rollouts sample inside the mask and the
    learner masks each group with the weights it was sampled under; a leak term (rl.pg.nlpo_leak_coef) keeps
    the policy's mass inside the mask. Needs the torch rollout backend on Ray workers."""

    name = "nlpo"
    masked = True
    shardable = False  # the masking policy loads each group's weights on the rank that holds the group

    def mask_refresh_steps(self, rl: RLConfig) -> int:
        return rl.pg.nlpo_mask_refresh_steps

    def rollout_spec(self, rl: RLConfig) -> RolloutSpec:
        return RolloutSpec("group", greedy_baseline=self.greedy_baseline, reference=rl.uses_kl,
                           mask_top_p=rl.pg.nlpo_top_p)

    def check(self, cfg: Config) -> None:
        super().check(cfg)
        if cfg.rollout.backend == "ct2" or cfg.rollout.source == "http":
            raise ValueError("rl.algorithm=nlpo samples with a masking policy: use rollout.backend=torch and "
                             "rollout.source=ray")
