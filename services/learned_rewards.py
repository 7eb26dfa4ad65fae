"""The reward server's named rewards: ``reward.named`` (name → terms) built once through the reward registry,
each reward-model term whose path is a checkpoint root hot-reloaded as the policy server reloads policies.

    named = NamedRewards(cfg, document_frequency=df)
    named.on_reload = lambda rewards: ...   # each new snapshot of the rewards (a retrained model installed)
    named.start()                     # one CheckpointWatcher per watched reward model
    named.score("prefs", sources, candidates, references)

A retrained reward model appears as a newer complete checkpoint under the root; the watcher loads it on its
own thread and installs it as a new snapshot of the rewards (:attr:`NamedRewards.rewards` is replaced, never
changed), handed to ``on_reload``: the reward server builds a new scorer on it and swaps that in through its
batcher, so every part of a request is scored by the models it started with. A checkpoint that fails to
load leaves the old model serving. Names must not shadow a registered metric. A named reward with a metric term
whose data or package is missing here (METEOR without WordNet) is not built: :attr:`NamedRewards.unavailable` says
what to install, and the reward server does not offer it.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from rlt2t.common.config import Config, MetricTerm, RewardConfig
from rlt2t.common.metrics import DocumentFrequency, available_metrics
from rlt2t.common.plugins import load_plugins
from rlt2t.common.reward_model import RewardModel
from rlt2t.common.rewards import (
    RewardModelReward,
    WeightedReward,
    build_reward,
    build_term,
    missing_dependencies,
    needs_document_frequency,
)
from rlt2t.services.reload import CheckpointWatcher

log = logging.getLogger("rlt2t.services.learned_rewards")

Snapshot = Mapping[str, WeightedReward]
"""Name → reward, with the reward models of one moment (a scorer's models never change under it)."""


class NamedRewards:
    """The rewards of ``cfg.reward.named``, on ``cfg.reward.device``, with their checkpoint watchers.

    ``on_reload(rewards)``, when set, is called with each new snapshot a watcher installs."""

    def __init__(self, cfg: Config, *, document_frequency: DocumentFrequency | None = None) -> None:
        load_plugins(cfg.reward.plugins)  # metrics of your own: before the names and the dependencies are checked
        clash = sorted(set(cfg.reward.named) & set(available_metrics()))
        if clash:
            raise ValueError(f"reward.named: {', '.join(clash)} would shadow registered metrics; rename them")
        self.cfg = cfg
        self.on_reload: Callable[[Snapshot], None] | None = None
        # Named reward not built -> what its terms lack here and how to install it (the server does not offer it).
        self.unavailable: dict[str, str] = {
            name: "; ".join(missing) for name, terms in cfg.reward.named.items()
            if (missing := missing_dependencies(terms, f"reward.named.{name}"))}
        self.rewards: Snapshot = {
            name: build_reward(cfg.reward, document_frequency=document_frequency, device=cfg.reward.device, terms=terms,
                               where=f"reward.named.{name}")
            for name, terms in cfg.reward.named.items() if name not in self.unavailable
        }
        # Without a table, the task score / CIDEr-D terms count frequencies over each request's references.
        self._own_frequencies: dict[str, list[tuple[int, MetricTerm]]] = {} if document_frequency is not None else {
            name: [(i, t) for i, t in enumerate(terms)
                   if isinstance(t, MetricTerm) and needs_document_frequency(RewardConfig(terms=[t]))]
            for name, terms in cfg.reward.named.items()}
        self._lock = threading.Lock()  # watchers install from their own threads
        self.watchers: list[CheckpointWatcher[RewardModel]] = []
        for name, reward in self.rewards.items():
            for index, (_, term_name, term) in enumerate(reward.terms):
                if isinstance(term, RewardModelReward) and term.root is not None:
                    self.watchers.append(CheckpointWatcher(term.root, loader=term.load,
                                                           install=functools.partial(self._install, name, index),
                                                           interval_s=cfg.serve.reload_interval_s,
                                                           current=term.model.path, follow_best=True))
                    log.info("reward %r (%s): serving %s, watching %s", name, term_name, term.model.path, term.root)

    def names(self) -> list[str]:
        """The named rewards served (those of :attr:`unavailable` left out)."""
        return list(self.rewards)

    def needs_references(self, name: str) -> bool:
        return self.rewards[name].needs_references

    def score(self, name: str, sources: Sequence[str], candidates: Sequence[str],
              references: Sequence[Sequence[str]] | None, *, rewards: Snapshot | None = None,
              document_frequency: DocumentFrequency | None = None) -> np.ndarray:
        """``name``'s scores with the models of ``rewards`` (a snapshot of :attr:`rewards`; default: the current
        one). ``document_frequency``: a request's own CIDEr-D table, for the terms that count frequencies over
        the request's references (no table given), so that a request scored in parts scores as a whole."""
        reward = (self.rewards if rewards is None else rewards)[name]
        own = self._own_frequencies.get(name) if document_frequency is not None else None
        if own:
            terms = list(reward.terms)
            for i, term in own:
                weight, term_name, _ = terms[i]
                terms[i] = (weight, term_name, build_term(term, self.cfg.reward, document_frequency=document_frequency))
            reward = WeightedReward(terms)
        return reward.score(sources, candidates, references)

    @staticmethod
    def model_versions(reward: WeightedReward) -> dict[str, int]:
        """Term name → version of each reward-model term of ``reward``."""
        return {term_name: term.version for _, term_name, term in reward.terms if isinstance(term, RewardModelReward)}

    def _install(self, name: str, index: int, model: RewardModel) -> None:
        """A watcher's newer model for term ``index`` of ``name``: a new snapshot, handed to ``on_reload``."""
        with self._lock:
            terms = list(self.rewards[name].terms)
            weight, term_name, term = terms[index]
            assert isinstance(term, RewardModelReward), "only reward-model terms are watched"
            terms[index] = (weight, term_name, term.with_model(model))
            self.rewards = {**self.rewards, name: WeightedReward(terms)}
            if self.on_reload is not None:
                self.on_reload(self.rewards)

    def start(self) -> None:
        for w in self.watchers:
            w.start()

    def stop(self) -> None:
        for w in self.watchers:
            w.stop()
