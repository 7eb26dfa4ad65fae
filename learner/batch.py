"""Collating scored pairs into the learner's :class:`RankBatch` (sources, gold labels, a and b labels)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from rlt2t.common.batching import IGNORE_INDEX, collate_seq2seq, encode_texts, pad
from rlt2t.common.types import ScoredPair
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
    gold, n_gold = encode_texts(tokenizer, [p.reference for p in pairs], max_target_len)
    # a and b are tokenised together so that one pad() call gives them a common length.
    both, n_pair = encode_texts(tokenizer, [p.a for p in pairs] + [p.b for p in pairs], max_target_len)
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
