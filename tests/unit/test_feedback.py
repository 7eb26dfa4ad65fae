"""Pieces of the feedback loop: the scripted annotator, the token it prefers, and the KL estimate against a
hand computation."""

from __future__ import annotations

import pytest
import torch

from rlt2t.common.config import ModelConfig
from rlt2t.common.policy import load_policy
from rlt2t.feedback import ScriptedAnnotator, choose_token, preference_stats, sample_and_kl


def test_scripted_annotator_ranks_distinct_scores_best_first():
    a = ScriptedAnnotator("7")
    assert a.rank(["1 2", "7 3", "7 7", "4 7", "9"]) == ["7 7", "7 3", "1 2"]  # one per score, first seen
    assert a.rank(["1 2", "3"]) is None  # nothing to tell apart
    assert preference_stats([["7 7", "1"], ["7 2", "3 4 5"]], a) == {"preference": 0.75, "hit_rate": 0.5,
                                                                     "mean_length": 2.0}


def test_choose_token_takes_the_one_nearest_a_quarter():
    lists = [["1 2 3", "1 2", "1 4"], ["1 5", "6 2", "1"], ["2 9", "1 8", "7"], ["1", "3", "1 2"]]
    # presence over 12 candidates: "1" 8/12, "2" 5/12, "3" 2/12 ... "2" is at 0.417, "3" at 0.167: "3" is nearer 0.25
    assert choose_token(lists) == "3"
    with pytest.raises(ValueError):
        choose_token([[""]])


def test_kl_is_zero_against_itself_and_matches_a_hand_computation(ids_tokenizer_dir):
    new = load_policy(ModelConfig(preset="tiny", dropout=0.0), ids_tokenizer_dir, seed=1)
    ref = load_policy(ModelConfig(preset="tiny", dropout=0.0), ids_tokenizer_dir, seed=2)
    sources = ["1 2 3", "4 5 6 7", "8"]
    texts, same = sample_and_kl(new, new, sources, k=3, max_new_tokens=6, max_source_len=16, seed=0)
    assert same["kl_per_sequence"] == 0.0 and len(texts) == 3 and all(len(t) == 3 for t in texts)
    assert same["tokens_per_sequence"] > 0
    # Two new tokens: the first is drawn, the second (if any) is the forced EOS, which is not counted; so each
    # sequence's KL is exactly KL(new || ref) of the first step's distribution, whatever was sampled.
    _, two = sample_and_kl(new, ref, sources, k=4, max_new_tokens=2, max_source_len=16, seed=0)
    tok = new.tokenizer
    expected = []
    with torch.no_grad():
        for s in sources:
            enc = tok([s], return_tensors="pt")
            start = torch.tensor([[new.model.config.decoder_start_token_id]])
            p = new.model(**enc, decoder_input_ids=start).logits[0, -1].log_softmax(-1)
            q = ref.model(**enc, decoder_input_ids=start).logits[0, -1].log_softmax(-1)
            expected.append(float((p.exp() * (p - q)).sum()))
    assert two["kl_per_sequence"] == pytest.approx(sum(expected) / len(expected), rel=1e-5)
    assert two["kl_per_token"] == pytest.approx(two["kl_per_sequence"], rel=1e-5)  # one counted token each
