"""Sequence rewards: what the reward workers, the policy server's ``/v1/pairs`` and the reward server
compute for a candidate given its source and reference.

Today the reward of rank RL is the task score ``(1 - w) · CIDEr-D + w · BLEU-4`` (docs/design.md, "Task
metric") with CIDEr-D document frequencies counted once from the training references: with frequencies
counted from the batch being scored (the coco default) a candidate's reward would depend on which other
candidates share its batch, and a batch of one would always score 0.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from rlt2t.common.config import RewardConfig
from rlt2t.common.metrics import DocumentFrequency, Metric, get_metric
from rlt2t.common.types import CandidateSet, SampledGroup, ScoredGroup, ScoredPair


def load_document_frequency(document_frequency: DocumentFrequency | str | os.PathLike) -> DocumentFrequency:
    """A ``DocumentFrequency`` as given, or loaded from the JSON ``DocumentFrequency.save`` wrote."""
    if isinstance(document_frequency, str | os.PathLike):
        document_frequency = DocumentFrequency.load(document_frequency)
    if not isinstance(document_frequency, DocumentFrequency):
        raise TypeError(
            "document_frequency must be a DocumentFrequency or the path of one saved with "
            f"DocumentFrequency.save, got {type(document_frequency).__name__}"
        )
    return document_frequency


def task_reward(reward: RewardConfig, document_frequency: DocumentFrequency) -> Metric:
    """The task score metric of ``reward`` with fixed CIDEr-D document frequencies."""
    return get_metric("task_score", bleu_weight=reward.bleu_weight, sigma=reward.cider_sigma, df=document_frequency)


def score_pairs(metric: Metric, sets: Sequence[CandidateSet]) -> list[ScoredPair]:
    """One scored pair per set, in order; all 2·len(sets) strings are scored in one metric call."""
    hyps = [text for s in sets for text in s.pair]
    refs = [[s.reference] for s in sets for _ in range(2)]
    scores = metric.per_sample(hyps, refs).tolist() if hyps else []
    return [order_pair(s, scores[2 * i], scores[2 * i + 1]) for i, s in enumerate(sets)]


def score_groups(metric: Metric, groups: Sequence[SampledGroup]) -> list[ScoredGroup]:
    """The reward of every sample (and greedy decode) of each group, in one metric call."""
    hyps: list[str] = []
    refs: list[list[str]] = []
    for g in groups:
        hyps += list(g.candidates) + ([g.greedy] if g.greedy is not None else [])
        refs += [[g.reference]] * (len(g.candidates) + (g.greedy is not None))
    scores = metric.per_sample(hyps, refs).tolist() if hyps else []
    out, pos = [], 0
    for g in groups:
        k = len(g.candidates)
        greedy = scores[pos + k] if g.greedy is not None else None
        out.append(ScoredGroup(group=g, rewards=tuple(scores[pos : pos + k]), greedy_reward=greedy))
        pos += k + (g.greedy is not None)
    return out


def order_pair(s: CandidateSet, score_first: float, score_second: float) -> ScoredPair:
    """The scored pair of ``s`` given the scores of its two drawn candidates: better first, ties kept in
    draw order, ``use_rank`` off for equal strings or tied scores."""
    first, second = s.pair
    if score_second > score_first:
        first, second, score_first, score_second = second, first, score_second, score_first
    return ScoredPair(
        example_id=s.example_id,
        source=s.source,
        reference=s.reference,
        a=first,
        b=second,
        score_a=score_first,
        score_b=score_second,
        # A tie is exact float equality: the metric is deterministic, so equal texts (or texts the metric
        # cannot tell apart) score bit-identically.
        use_rank=first != second and score_first != score_second,
        policy_version=s.policy_version,
    )
