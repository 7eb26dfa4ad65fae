"""Reward worker: scores what the rollout workers sampled against each source's reference. Rank RL: the
drawn pair of each candidate set, ordered better first (docs/design.md, "The method", step 5); policy
gradients: every sample of each group (and SCST's greedy decode). A plain class that Ray wraps at launch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from rlt2t.common.config import RewardConfig
from rlt2t.common.metrics import DocumentFrequency
from rlt2t.common.rewards import load_document_frequency, score_groups, score_pairs, task_reward
from rlt2t.common.types import CandidateSet, SampledGroup, ScoredGroup, ScoredPair


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

    def score(self, items: Sequence[CandidateSet] | Sequence[SampledGroup]) -> list[ScoredPair] | list[ScoredGroup]:
        """One scored pair per candidate set, or one scored group per sampled group, in order."""
        if items and isinstance(items[0], SampledGroup):
            return score_groups(self.metric, items)  # type: ignore[arg-type]
        return score_pairs(self.metric, items)  # type: ignore[arg-type]

    def pid(self) -> int:
        """The worker's process id (tests kill it to exercise re-dispatch)."""
        return os.getpid()
