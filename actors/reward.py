"""Reward worker: scores what the rollout workers sampled with the configured reward (``reward.terms``: the
task metric by default, or reward models, classifiers, HTTP rewards and their weighted sums;
``rlt2t.common.rewards``). Rank RL: the drawn pair of each candidate set, ordered better first
(docs/design.md, "The method", step 5); policy gradients: every sample of each group (and SCST's greedy
decode). A plain class that Ray wraps at launch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from rlt2t.common.config import RewardConfig
from rlt2t.common.metrics import DocumentFrequency
from rlt2t.common.rewards import (
    UserRegistrations,
    build_reward,
    load_document_frequency,
    needs_document_frequency,
    score_groups,
    score_pairs,
)
from rlt2t.common.types import CandidateSet, SampledGroup, ScoredGroup, ScoredPair


class RewardWorker:
    """Scores pairs with the reward ``reward.terms`` describe (default ``(1 - w) · CIDEr-D + w · BLEU-4``
    against each set's reference); learned terms run in batches on ``reward.device``.

    ``document_frequency`` is the CIDEr-D df table the driver computed ONCE from the training references,
    shipped as a ``DocumentFrequency`` or as the path of its JSON (``DocumentFrequency.save``); see
    ``rlt2t.common.rewards`` for why it is required when a term uses CIDEr-D (None is accepted otherwise).
    ``registrations`` are the metrics and rewards the job's own process registered (a script's
    ``@register_metric``): registered here too, before the reward is built.
    """

    def __init__(self, reward: RewardConfig,
                 document_frequency: DocumentFrequency | str | os.PathLike | None,
                 registrations: UserRegistrations | None = None) -> None:
        if registrations is not None:
            registrations.install()
        self.reward = reward
        if document_frequency is None and needs_document_frequency(reward):
            raise TypeError("document_frequency must be a DocumentFrequency or the path of one saved with "
                            "DocumentFrequency.save, got None: a CIDEr-D term (task_score, cider_d without a df "
                            "param) scores against the training references' document frequencies")
        self.document_frequency = (load_document_frequency(document_frequency)
                                   if document_frequency is not None else None)
        self.scorer = build_reward(reward, document_frequency=self.document_frequency, device=reward.device)

    def score(self, items: Sequence[CandidateSet] | Sequence[SampledGroup]) -> list[ScoredPair] | list[ScoredGroup]:
        """One scored pair per candidate set, or one scored group per sampled group, in order."""
        if items and isinstance(items[0], SampledGroup):
            return score_groups(self.scorer, items)  # type: ignore[arg-type]
        return score_pairs(self.scorer, items)  # type: ignore[arg-type]

    def score_texts(self, sources: Sequence[str], candidates: Sequence[str],
                    references: Sequence[Sequence[str]] | None = None,
                    fields: Sequence[Mapping[str, Any]] | None = None) -> list[float]:
        """The reward of each candidate (one batched call; ``fields``: each one's row fields, for Python terms):
        what the job's ``metric.monitor=reward`` scores validation outputs with."""
        return self.scorer.score(sources, candidates, references, fields).tolist()

    def pid(self) -> int:
        """The worker's process id (tests kill it to exercise re-dispatch)."""
        return os.getpid()
