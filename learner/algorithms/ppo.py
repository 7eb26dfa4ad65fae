"""PPO: proximal policy optimisation (Schulman et al. 2017) with a value head, token by token."""

from __future__ import annotations

from rlt2t.learner.algorithms.base import ActorCritic


class PPO(ActorCritic):
    """Proximal policy optimisation, token-level: the reward at the last token and −β·k1 at every token, GAE
    (rl.pg.gamma, rl.pg.lam) with a value head on the decoder, the clipped ratio and value losses, 2 epochs × 2
    minibatches per batch by default, stopping early past 1.5·rl.pg.target_kl."""

    name = "ppo"
