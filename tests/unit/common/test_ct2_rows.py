"""Tests for rlt2t.common.ct2 on a model with more output rows than its tokenizer has tokens (T5 pads its
vocabulary to a multiple of 128; `convert-model --vocab-size` grows a model): ids of the unnamed rows going
back into CTranslate2 (scoring), the top-k clamp against the model's rows, and the one decode path that
``Ct2Policy.generate`` and ``sample_ct2_logprobs`` share."""

from __future__ import annotations

import pytest
import torch

from rlt2t.common.collate import collate_seq2seq, encode_texts
from rlt2t.common.config import ModelConfig
from rlt2t.common.ct2 import UNUSED_ROW, Ct2Policy, ct2_sampler_from_state_dict, sample_ct2_logprobs
from rlt2t.common.policy import Policy, load_policy
from rlt2t.common.sampling import warp_logits

EXTRA_ROWS = 8
SOURCES = ["12 7 33", "5 6 40 41"]
K = 4


@pytest.fixture(scope="module")
def grown(ids_tokenizer_dir) -> Policy:
    """The tiny BART grown by EXTRA_ROWS output rows the tokenizer has no name for, made likely."""
    pol = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0)
    named = len(pol.tokenizer)
    pol.model.resize_token_embeddings(named + EXTRA_ROWS, mean_resizing=False)
    pol.model.eval()
    with torch.no_grad():
        pol.model.final_logits_bias[0, named:] = 4.0
    return pol


@pytest.fixture(scope="module")
def ct2(grown, tmp_path_factory) -> Ct2Policy:
    return ct2_sampler_from_state_dict(grown, None, tmp_path_factory.mktemp("ct2"), "float32", max_source_len=16)


def teacher_forced_logits(pol: Policy, sources: list[str], rows: list[list[int]], k: int) -> torch.Tensor:
    """HF logits [rows, T, V] of each row given its source (row i * k + j: source i)."""
    enc, _ = encode_texts(pol.tokenizer, sources, 16)
    batch = collate_seq2seq([x for x in enc for _ in range(k)], rows, pol.tokenizer.pad_token_id)
    with torch.no_grad():
        return pol.model(**batch).logits


def test_unnamed_rows_round_trip_and_score(ct2, grown):
    """score_ids takes sampled rows holding ids the tokenizer has no token for (it crashed: the tokenizer
    names them None) and scores them as the sampler saw them."""
    named = len(grown.tokenizer)
    assert ct2.vocab_rows == named + EXTRA_ROWS
    ids = [3, named, 12, named + EXTRA_ROWS - 1, 2]
    tokens = ct2.row_tokens(ids)
    assert tokens[1] == f"{UNUSED_ROW}0>" and tokens[3] == f"{UNUSED_ROW}{EXTRA_ROWS - 1}>"
    assert ct2.token_ids(tokens) == ids
    rows = sample_ct2_logprobs(ct2, SOURCES, K, 0, 1.0, 6, seed=1)
    assert any(i >= named for r in rows for i in r.token_ids)
    sources = [s for s in SOURCES for _ in range(K)]
    scores = ct2.score_ids(sources, [r.token_ids for r in rows])
    for row, score in zip(rows, scores, strict=True):
        n = len(row.token_ids) - row.forced  # the forced EOS was not drawn (raw log-prob 0)
        assert len(score) == len(row.token_ids)
        assert max(abs(a - b) for a, b in zip(score[:n], row.logprobs[:n], strict=True)) < 1e-4


def test_top_k_is_clamped_against_the_model_rows_not_the_tokenizer(ct2, grown):
    """top_k between the tokenizer's size and the model's rows is a real filter, for CT2 as for the learner:
    the behaviour log-probs are under the learner's transform (CT2 sampled unfiltered: -inf vs finite)."""
    top_k = len(grown.tokenizer)
    rows = sample_ct2_logprobs(ct2, SOURCES, K, top_k, 1.0, 6, seed=1)
    ids = [r.token_ids for r in rows]
    logprobs = warp_logits(teacher_forced_logits(grown, SOURCES, ids, K), 1.0, top_k).log_softmax(-1)
    for r, row in enumerate(rows):
        for t in range(len(row.token_ids) - row.forced):
            assert abs(logprobs[r, t, row.token_ids[t]].item() - row.sample_logprobs[t]) < 1e-4
    # top_k at the model's rows is no filter (CT2 rejects k > vocabulary): same samples as top_k=0
    whole = ct2.generate(SOURCES, num_hypotheses=K, max_new_tokens=6, sampling_topk=0, seed=3)
    at_rows = ct2.generate(SOURCES, num_hypotheses=K, max_new_tokens=6, sampling_topk=ct2.vocab_rows, seed=3)
    assert at_rows == whole


def test_sample_logprobs_under_a_nucleus_are_the_learners_transform(ct2, grown):
    """top_p (rollout.top_p with the ct2 rollout backend): every drawn token is inside transformers' nucleus after
    the temperature and top-k, and its behaviour log-prob is the learner's transform's; the rows are reproducible
    and differ from unfiltered ones."""
    for temperature, top_k, top_p in ((1.5, 0, 0.6), (1.0, 5, 0.8)):
        rows = sample_ct2_logprobs(ct2, SOURCES, K, top_k, temperature, 6, seed=1, top_p=top_p)
        ids = [r.token_ids for r in rows]
        logprobs = warp_logits(teacher_forced_logits(grown, SOURCES, ids, K), temperature, top_k, top_p).log_softmax(-1)
        for r, row in enumerate(rows):
            for t in range(len(row.token_ids) - row.forced):
                assert abs(logprobs[r, t, row.token_ids[t]].item() - row.sample_logprobs[t]) < 1e-4
        assert bool((~torch.isfinite(logprobs)).any()), "the nucleus kept every token: the test shows nothing"
        again = sample_ct2_logprobs(ct2, SOURCES, K, top_k, temperature, 6, seed=1, top_p=top_p)
        assert [r.token_ids for r in again] == ids
    whole = sample_ct2_logprobs(ct2, SOURCES, K, 0, 1.5, 6, seed=1)
    assert [r.token_ids for r in whole] != [r.token_ids for r in sample_ct2_logprobs(ct2, SOURCES, K, 0, 1.5, 6,
                                                                                     seed=1, top_p=0.6)]


def test_generate_and_sample_ct2_logprobs_share_one_decode_path(ct2, monkeypatch):
    """Top-k clamp, reseed, forced-EOS handling and the hypothesis count live in one place."""
    calls = []
    decode = Ct2Policy._decode

    def spy(self, *args, **kwargs):
        calls.append(kwargs["sampling_topk"])
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(Ct2Policy, "_decode", spy)
    generated = ct2.generate(SOURCES, num_hypotheses=K, max_new_tokens=6, sampling_topk=5, seed=2)
    sampled = sample_ct2_logprobs(ct2, SOURCES, K, 5, 1.0, 6, seed=2)
    assert calls == [5, 5]
    assert [list(h.token_ids) for hyps in generated for h in hyps] == [r.token_ids for r in sampled]

    class Short:  # CT2 answering with fewer hypotheses than asked must not shift the row layout
        def __init__(self, translator):
            self.translator = translator

        def translate_batch(self, *args, **kwargs):
            return self.translator.translate_batch(*args, **{**kwargs, "num_hypotheses": 1})

    monkeypatch.setattr(ct2, "translator", Short(ct2.translator))
    for run in (lambda: ct2.generate(SOURCES, num_hypotheses=K, max_new_tokens=6, sampling_topk=5),
                lambda: sample_ct2_logprobs(ct2, SOURCES, K, 5, 1.0, 6, seed=None)):
        with pytest.raises(RuntimeError, match="returned 1 samples for source 0, expected 4"):
            run()
