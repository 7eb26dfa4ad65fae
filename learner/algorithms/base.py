"""The two kinds of built-in policy-gradient unit, on which the algorithm modules set their flags: sequence
advantages from each source's K samples (:class:`PolicyGradient`) and token-level actor-critic with a value
head and GAE (:class:`ActorCritic`). Both run ``rlt2t.learner.objectives.PolicyGradientObjective``, which asks
the unit what differs (docs/design.md, "Policy-gradient algorithms"). Nothing here imports torch at import
time: a config names a unit and validates without it.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, ClassVar

from rlt2t.common.algorithms import Algorithm

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor

    from rlt2t.common.config import PolicyGradientConfig, RLConfig, RolloutConfig


class PolicyGradient(Algorithm):
    """A group policy gradient: sequence advantages from each source's K samples, the clipped ratio against the
    batch's starting policy, truncated importance weights against the sampler."""

    value_head: ClassVar[bool] = False
    """A value head on the decoder, token-level rewards and GAE (the actor-critic kind)."""
    clipped: ClassVar[bool] = True
    """The ratio (and the value) clipped at rl.pg.clip_eps (rl.pg.value_clip); False: unclipped."""
    kl_in_loss: ClassVar[bool] = False
    """The KL to the reference is a loss term, β·(token mean of k3); False: it shapes the rewards instead."""

    def advantages(self, rewards: Tensor, *, seq_kl: Tensor, beta: float, greedy_rewards: Tensor | None,
                   pg: PolicyGradientConfig, all_sum: Callable[[Tensor], Tensor]) -> Tensor:
        """Per-sequence advantages [N, K] from the rewards [N, K]; ``seq_kl`` [N, K]: each sample's summed k1
        to the reference (0 without a KL), ``beta`` its current coefficient (0 without a KL),
        ``greedy_rewards`` [N] the greedy decodes' rewards when the rollouts made them, ``all_sum`` a sum over the
        learner ranks."""
        raise NotImplementedError(f"{self.name} defines no sequence advantages")

    def check_unit(self) -> None:
        """A sequence-advantage unit defines ``advantages`` with the signature the objective calls it with."""
        super().check_unit()
        if self.value_head:
            return  # token-level advantages from the value head (GAE): no sequence advantages to define
        if type(self).advantages is PolicyGradient.advantages:
            raise ValueError("defines no `advantages(rewards, *, seq_kl, beta, greedy_rewards, pg, all_sum)`: the "
                             "sequence advantages [N, K] of its rewards [N, K]")
        try:
            inspect.signature(self.advantages).bind(None, seq_kl=None, beta=0.0, greedy_rewards=None, pg=None,
                                                    all_sum=None)
        except TypeError as e:
            raise ValueError(f"has `advantages{inspect.signature(self.advantages)}`, which the objective cannot call "
                             f"as advantages(rewards, *, seq_kl, beta, greedy_rewards, pg, all_sum): {e}") from None

    rl: RLConfig
    """The job's `rl` section, on the objective's own copy of the unit (``PolicyGradientObjective``):
    ``self.rl.section()`` is the unit's settings (``rl.<name>``) for its ``advantages`` to read."""

    def objective(self, rl: RLConfig, rollout: RolloutConfig, policy: Any, *, seed: int,
                  reference: Any = None) -> Any:
        from rlt2t.learner.objectives import PolicyGradientObjective

        return PolicyGradientObjective(rl, rollout, policy, seed=seed, reference=reference, unit=self)


class ActorCritic(PolicyGradient):
    """Token-level actor-critic: the reward at the last token, −β·k1 at every token, GAE with a value head on
    the decoder's states, whitened advantages, several optimizer steps per batch."""

    value_head = True
    default_epochs = 2
    default_minibatches = 2
