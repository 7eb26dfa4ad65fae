"""The reward server's named rewards: ``reward.named`` (name → terms) built once through the reward registry,
each reward-model term whose path is a checkpoint root hot-reloaded as the policy server reloads policies.

    named = NamedRewards(cfg, document_frequency=df)
    named.start()                     # one CheckpointWatcher per watched reward model
    named.score("prefs", sources, candidates, references)

A retrained reward model appears as a newer complete checkpoint under the root; the watcher loads it on its
own thread and swaps it in between calls (a call in flight finishes on the model it started with; a
checkpoint that fails to load leaves the old model serving). Names must not shadow a registered metric.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from rlt2t.common.config import Config
from rlt2t.common.metrics import DocumentFrequency, available_metrics
from rlt2t.common.reward_model import RewardModel
from rlt2t.common.rewards import RewardModelReward, WeightedReward, build_reward
from rlt2t.services.reload import CheckpointWatcher

log = logging.getLogger("rlt2t.services.learned_rewards")


class NamedRewards:
    """The rewards of ``cfg.reward.named``, on ``cfg.reward.device``, with their checkpoint watchers."""

    def __init__(self, cfg: Config, *, document_frequency: DocumentFrequency | None = None) -> None:
        clash = sorted(set(cfg.reward.named) & set(available_metrics()))
        if clash:
            raise ValueError(f"reward.named: {', '.join(clash)} would shadow registered metrics; rename them")
        self.rewards: dict[str, WeightedReward] = {
            name: build_reward(cfg.reward, document_frequency=document_frequency, device=cfg.reward.device, terms=terms)
            for name, terms in cfg.reward.named.items()
        }
        self.watchers: list[CheckpointWatcher[RewardModel]] = []
        for name, reward in self.rewards.items():
            for _, term_name, term in reward.terms:
                if isinstance(term, RewardModelReward) and term.root is not None:
                    self.watchers.append(CheckpointWatcher(term.root, loader=term.load, install=term.install,
                                                           interval_s=cfg.serve.reload_interval_s,
                                                           current=term.model.path))
                    log.info("reward %r (%s): serving %s, watching %s", name, term_name, term.model.path, term.root)

    def names(self) -> list[str]:
        return list(self.rewards)

    def needs_references(self, name: str) -> bool:
        return self.rewards[name].needs_references

    def score(self, name: str, sources: Sequence[str], candidates: Sequence[str],
              references: Sequence[Sequence[str]] | None) -> np.ndarray:
        return self.rewards[name].score(sources, candidates, references)

    def start(self) -> None:
        for w in self.watchers:
            w.start()

    def stop(self) -> None:
        for w in self.watchers:
            w.stop()
