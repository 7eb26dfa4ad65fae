"""Reward worker of rank RL: scores the drawn pair of each candidate set with the task metric and orders
it, better first (docs/design.md, "The method", step 5). A plain class that Ray wraps at launch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from rlt2t.common.config import RewardConfig
from rlt2t.common.metrics import DocumentFrequency
from rlt2t.common.rewards import load_document_frequency, score_pairs, task_reward
from rlt2t.common.types import CandidateSet, ScoredPair


class RewardWorker:
    """Scores pairs with ``(1 - w) · CIDEr-D + w · BLEU-4`` against each set's reference.

    ``document_frequency`` is the CIDEr-D df table the driver computed ONCE from the training references,
    shipped as a ``DocumentFrequency`` or as the path of its JSON (``DocumentFrequency.save``); see
    ``rlt2t.common.rewards`` for why it is required.
    """

    def __init__(self, reward: RewardConfig, document_frequency: DocumentFrequency | str | os.PathLike) -> None:
        self.reward = reward
        self.document_frequency = load_document_frequency(document_frequency)
        self.metric = task_reward(reward, self.document_frequency)

    def score(self, sets: Sequence[CandidateSet]) -> list[ScoredPair]:
        """One scored pair per set, in order."""
        return score_pairs(self.metric, sets)

    def pid(self) -> int:
        """The worker's process id (tests kill it to exercise re-dispatch)."""
        return os.getpid()
