"""A2C: advantage actor-critic (Mnih et al. 2016), PPO's loss without clipping and with one update per batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlt2t.learner.algorithms.base import ActorCritic

if TYPE_CHECKING:
    from rlt2t.common.config import RLConfig


class A2C(ActorCritic):
    """Advantage actor-critic: PPO's token-level advantages and value head, one unclipped optimizer step per
    batch (rl.pg.epochs and rl.pg.minibatches do not apply)."""

    name = "a2c"
    clipped = False

    def optimisation_epochs(self, rl: RLConfig) -> int:
        return 1

    def optimisation_minibatches(self, rl: RLConfig) -> int:
        return 1
