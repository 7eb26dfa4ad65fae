"""Tests for rlt2t.learner.batch.rank_batch: shapes, padding, truncation, and that the learner's loss runs."""

from __future__ import annotations

import pytest
import torch

from rlt2t.common.types import ScoredPair
from rlt2t.learner.batch import rank_batch
from rlt2t.learner.rank_step import shared_encoder_rank_loss


def pair(source: str, reference: str, a: str, b: str, use_rank: bool = True) -> ScoredPair:
    return ScoredPair(example_id="x", source=source, reference=reference, a=a, b=b, score_a=1.0, score_b=0.5,
                      use_rank=use_rank, policy_version=0)


PAIRS = [
    pair("1 2 3 4", "20 21 22 23 24 25", "20 21", "30 31 32 33"),
    pair("5 6", "26", "26 27 28 29 30 31 32", "40", use_rank=False),
    pair("7 8 9", "33 34", "", "33 34"),  # an empty candidate is just EOS
]


def test_shapes_padding_and_eos(tiny_policy):
    tok = tiny_policy.tokenizer
    eos, pad_id = tok.eos_token_id, tok.pad_token_id
    batch = rank_batch(tok, PAIRS, max_source_len=16, max_target_len=16)
    # Lengths are the texts' token counts plus EOS.
    assert batch.input_ids.shape == (3, 5) and batch.attention_mask.shape == (3, 5)
    assert batch.gold_labels.shape == (3, 7)
    assert batch.labels_a.shape == batch.labels_b.shape == (3, 8)
    assert batch.use_rank.dtype == torch.bool and batch.use_rank.tolist() == [True, False, True]

    assert batch.input_ids[1].tolist() == tok("5 6")["input_ids"] + [pad_id] * 2
    assert batch.attention_mask[1].tolist() == [1, 1, 1, 0, 0]
    assert batch.gold_labels[1].tolist() == tok("26")["input_ids"] + [-100] * 5
    assert batch.labels_a[1].tolist() == tok("26 27 28 29 30 31 32")["input_ids"]
    assert batch.labels_b[1].tolist() == [tok.convert_tokens_to_ids("40"), eos] + [-100] * 6
    assert batch.labels_a[2].tolist() == [eos] + [-100] * 7
    for labels in (batch.gold_labels, batch.labels_a, batch.labels_b):
        for row in labels.tolist():
            real = [t for t in row if t != -100]
            assert real[-1] == eos and row[: len(real)] == real  # EOS last, padding only at the end


def test_truncation_keeps_eos(tiny_policy):
    tok = tiny_policy.tokenizer
    batch = rank_batch(tok, PAIRS, max_source_len=3, max_target_len=4)
    assert batch.input_ids.shape[1] == 3 and batch.labels_a.shape[1] == 4 and batch.gold_labels.shape[1] == 4
    assert batch.input_ids[0].tolist() == tok("1 2")["input_ids"]
    assert batch.labels_a[1].tolist() == tok("26 27 28")["input_ids"]


def test_rank_loss_runs_on_the_batch(tiny_policy):
    batch = rank_batch(tiny_policy.tokenizer, PAIRS, max_source_len=16, max_target_len=16)
    model = tiny_policy.model.train()
    out = shared_encoder_rank_loss(model, batch)
    assert torch.isfinite(out.loss) and torch.isfinite(out.rank) and out.ce > 0
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_rejects_empty_and_bad_lengths(tiny_policy):
    with pytest.raises(ValueError, match="pairs"):
        rank_batch(tiny_policy.tokenizer, [], max_source_len=8, max_target_len=8)
    with pytest.raises(ValueError, match="max_target_len"):
        rank_batch(tiny_policy.tokenizer, PAIRS, max_source_len=8, max_target_len=1)
