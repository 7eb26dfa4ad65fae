"""Reward worker of RL: scores the drawn pair of each candidate set with the configured reward
(``reward.terms``: the task metric by default, or reward models, classifiers, HTTP rewards and their
weighted sums; ``rlt2t.common.rewards``) and orders it, better first (docs/design.md, "The method",
step 5). A plain class that Ray wraps at launch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from rlt2t.common.config import RewardConfig
from rlt2t.common.metrics import DocumentFrequency
from rlt2t.common.rewards import build_reward, load_document_frequency, needs_document_frequency, score_pairs
from rlt2t.common.types import CandidateSet, ScoredPair


class RewardWorker:
    """Scores pairs with the reward ``reward.terms`` describe (default ``(1 - w) · CIDEr-D + w · BLEU-4``
    against each set's reference); learned terms run in batches on ``reward.device``.

    ``document_frequency`` is the CIDEr-D df table the driver computed ONCE from the training references,
    shipped as a ``DocumentFrequency`` or as the path of its JSON (``DocumentFrequency.save``); see
    ``rlt2t.common.rewards`` for why it is required when a term uses CIDEr-D (None is accepted otherwise).
    """

    def __init__(self, reward: RewardConfig,
                 document_frequency: DocumentFrequency | str | os.PathLike | None) -> None:
        self.reward = reward
        self.document_frequency = (load_document_frequency(document_frequency)
                                   if document_frequency is not None or needs_document_frequency(reward) else None)
        self.scorer = build_reward(reward, document_frequency=self.document_frequency, device=reward.device)

    def score(self, sets: Sequence[CandidateSet]) -> list[ScoredPair]:
        """One scored pair per set, in order."""
        return score_pairs(self.scorer, sets)

    def score_texts(self, sources: Sequence[str], candidates: Sequence[str],
                    references: Sequence[Sequence[str]] | None = None) -> list[float]:
        """The reward of each candidate (one batched call): what policy-gradient rollouts need."""
        return self.scorer.score(sources, candidates, references).tolist()

    def pid(self) -> int:
        """The worker's process id (tests kill it to exercise re-dispatch)."""
        return os.getpid()
