"""The built-in RL algorithms, one module each (``rlt2t.common.algorithms`` lists them and finds them by name).

Group policy gradients (K samples per source, sequence advantages): :mod:`.scst`, :mod:`.rloo`, :mod:`.grpo`.
Token-level actor-critic (a value head, GAE): :mod:`.ppo`, :mod:`.a2c`, :mod:`.nlpo`. Rank RL on scored pairs:
:mod:`.rank`. Shared machinery: :mod:`.base` (the kinds) and ``rlt2t.learner.objectives`` (the objectives).
"""
