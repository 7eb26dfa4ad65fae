"""Collating what the reward workers return into learner batches: scored pairs into a :class:`RankBatch`
(rank RL), scored groups into a :class:`GroupBatch` (policy-gradient algorithms)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlt2t.common.collate import IGNORE_INDEX, collate_seq2seq, encode_texts, pad
from rlt2t.common.types import ScoredGroup, ScoredPair
from rlt2t.learner.rank_step import RankBatch

log = logging.getLogger("rlt2t.rank_batch")


def rank_batch(
    tokenizer: PreTrainedTokenizerBase,
    pairs: Sequence[ScoredPair],
    *,
    max_source_len: int,
    max_target_len: int,
) -> RankBatch:
    """Tokenise B scored pairs into a RankBatch.

    input_ids / attention_mask [B, S]: the sources, padded with the tokenizer's pad id. gold_labels
    [B, Tg]: the references; labels_a / labels_b [B, T]: the pair, both padded with -100 to one common T
    (the rank loss compares them position by position). Every label sequence ends with EOS; a longer
    text is truncated keeping its EOS, as everywhere else (``encode_texts``). use_rank [B] bool.
    """
    if len(pairs) == 0:
        raise ValueError("pairs is empty; a RankBatch needs at least one scored pair")
    for name, value in (("max_source_len", max_source_len), ("max_target_len", max_target_len)):
        if value < 2:
            raise ValueError(f"{name} must be >= 2 (one token and EOS), got {value}")
    sources, n_src = encode_texts(tokenizer, [p.source for p in pairs], max_source_len)
    gold, n_gold = encode_texts(tokenizer, [p.reference for p in pairs], max_target_len, target=True)
    # a and b are tokenised together so that one pad() call gives them a common length.
    both, n_pair = encode_texts(tokenizer, [p.a for p in pairs] + [p.b for p in pairs], max_target_len, target=True)
    if n_src or n_gold or n_pair:
        log.debug("rank batch: truncated %d sources, %d references, %d candidates", n_src, n_gold, n_pair)
    seq2seq = collate_seq2seq(sources, gold, tokenizer.pad_token_id)
    labels_a, labels_b = pad(both, IGNORE_INDEX).split(len(pairs))
    return RankBatch(
        input_ids=seq2seq["input_ids"],
        attention_mask=seq2seq["attention_mask"],
        gold_labels=seq2seq["labels"],
        labels_a=labels_a,
        labels_b=labels_b,
        use_rank=torch.tensor([p.use_rank for p in pairs], dtype=torch.bool),
    )


@dataclass(frozen=True, eq=False)
class GroupBatch:
    """A collated batch of scored groups: B sources with K samples each (policy-gradient algorithms).

    Sample rows are rep-major (row ``j * B + i`` = sample j of source i), the layout of
    ``rlt2t.learner.group_step``. Per-token tensors are [K*B, T], padded with 0 (labels with -100).
    """

    input_ids: Tensor
    """[B, S] source ids."""
    attention_mask: Tensor
    """[B, S]."""
    labels: Tensor
    """[K*B, T] the sampled token ids (EOS last when produced), -100 padding."""
    sample_logprobs: Tensor
    """[K*B, T] the sampler's log-probs of those tokens under the distribution it sampled from."""
    loss_mask: Tensor
    """[K*B, T] bool: tokens that enter the loss (real tokens, not a forced EOS)."""
    rewards: Tensor
    """[B, K] float: each sample's reward."""
    reference_logprobs: Tensor | None = None
    """[K*B, T] raw log-probs under the reference policy (None: the learner computes them)."""
    greedy_rewards: Tensor | None = None
    """[B] the greedy decode's reward (SCST)."""
    gold_labels: Tensor | None = None
    """[B, Tg] each source's gold target ids (EOS last), -100 padding: the likelihood term (rl.pg.sft_coef)."""

    @property
    def k(self) -> int:
        return self.rewards.shape[1]

    def to(self, device: torch.device | str) -> GroupBatch:
        moved: dict[str, Any] = {f.name: (None if getattr(self, f.name) is None else getattr(self, f.name).to(device))
                                 for f in dataclasses.fields(self)}
        return GroupBatch(**moved)

    def select(self, sources: Tensor) -> GroupBatch:
        """The sub-batch of the given source indices [b] with all their K samples (a minibatch)."""
        size, k = self.rewards.shape
        rows = (torch.arange(k, device=sources.device).unsqueeze(1) * size + sources.unsqueeze(0)).reshape(-1)

        def pick(t: Tensor, index: Tensor) -> Tensor:
            return t[index.to(t.device)]

        def pick_optional(t: Tensor | None, index: Tensor) -> Tensor | None:
            return None if t is None else pick(t, index)

        return GroupBatch(input_ids=pick(self.input_ids, sources), attention_mask=pick(self.attention_mask, sources),
                          labels=pick(self.labels, rows), sample_logprobs=pick(self.sample_logprobs, rows),
                          loss_mask=pick(self.loss_mask, rows), rewards=pick(self.rewards, sources),
                          reference_logprobs=pick_optional(self.reference_logprobs, rows),
                          greedy_rewards=pick_optional(self.greedy_rewards, sources),
                          gold_labels=pick_optional(self.gold_labels, sources))


def group_batch(
    tokenizer: PreTrainedTokenizerBase,
    groups: Sequence[ScoredGroup],
    *,
    max_source_len: int,
    gold_len: int | None = None,
) -> GroupBatch:
    """Collate B scored groups of equal K into a :class:`GroupBatch` (sources tokenised and truncated as
    the rollout workers did; labels are the sampled ids themselves). ``gold_len``: also tokenise each group's
    gold target, truncated to that many tokens keeping its EOS, as gold_labels (None: no gold labels)."""
    if not groups:
        raise ValueError("groups is empty; a GroupBatch needs at least one scored group")
    k = len(groups[0].rewards)
    for g in groups:
        if len(g.rewards) != k or len(g.group.token_ids) != k:
            raise ValueError(f"group {g.example_id!r} has {len(g.group.token_ids)} samples and {len(g.rewards)} "
                             f"rewards; the batch has K = {k}")
    sources, _ = encode_texts(tokenizer, [g.group.source for g in groups], max_source_len)
    seq2seq = collate_seq2seq(sources, None, tokenizer.pad_token_id)
    index = [(g.group, j) for j in range(k) for g in groups]  # rep-major: row j * B + i
    labels = pad([list(g.token_ids[j]) for g, j in index], IGNORE_INDEX)
    width = labels.shape[1]

    def floats(values: Sequence[Sequence[float]]) -> Tensor:
        out = torch.zeros(len(values), width, dtype=torch.float32)
        for r, v in enumerate(values):
            out[r, : len(v)] = torch.tensor(v, dtype=torch.float32)
        return out

    sample = floats([g.sample_logprobs[j] for g, j in index])
    mask = labels != IGNORE_INDEX
    for r, (sampled, j) in enumerate(index):
        if sampled.forced_eos[j] and sampled.token_ids[j]:
            mask[r, len(sampled.token_ids[j]) - 1] = False
    have_reference = all(g.reference_logprobs is not None for g, _ in index)
    reference = floats([g.reference_logprobs[j] for g, j in index]) if have_reference else None  # type: ignore[index]
    greedy = None
    if all(g.greedy_reward is not None for g in groups):
        greedy = torch.tensor([g.greedy_reward for g in groups], dtype=torch.float32)
    gold = None
    if gold_len is not None:
        gold = pad(encode_texts(tokenizer, [g.group.reference for g in groups], gold_len, target=True)[0],
                   IGNORE_INDEX)
    return GroupBatch(
        input_ids=seq2seq["input_ids"], attention_mask=seq2seq["attention_mask"], labels=labels,
        sample_logprobs=sample, loss_mask=mask,
        rewards=torch.tensor([list(g.rewards) for g in groups], dtype=torch.float32),
        reference_logprobs=reference, greedy_rewards=greedy, gold_labels=gold)
