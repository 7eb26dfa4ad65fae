"""The sampler's between-steps hook: rows it names leave the batch at once; the other rows are unchanged."""

from __future__ import annotations

import pytest
import torch

from rlt2t.common.collate import collate_seq2seq, encode_texts
from rlt2t.common.sampling import sample_candidates


def test_rows_named_between_steps_stop_and_the_rest_sample_as_before(tiny_policy):
    model, tok = tiny_policy.model.eval(), tiny_policy.tokenizer
    with torch.no_grad():  # no EOS: every row would run to the limit
        model.final_logits_bias[0, tok.eos_token_id] = -1e4
    ids, _ = encode_texts(tok, ["1 2 3", "4 5", "6"], 64)
    batch = collate_seq2seq(ids, None, tok.pad_token_id)

    def run(hook=None):
        generators = [torch.Generator().manual_seed(100 + r) for r in range(6)]
        return sample_candidates(model, batch["input_ids"], batch["attention_mask"], 2, 0, 1.0, 20, generators,
                                 between_steps=hook)

    alone = run()
    calls = []

    def hook():  # after the 5th step, source 1 (rows 2 and 3) is gone; later, row 5 too
        calls.append(len(calls))
        return ({2, 3} if len(calls) >= 5 else set()) | ({5} if len(calls) >= 8 else set())

    stopped = run(hook)
    assert [len(r.token_ids) for r in alone] == [20] * 6
    assert [len(r.token_ids) for r in stopped] == [20, 20, 5, 5, 20, 8]
    for before, after in zip(alone, stopped, strict=True):  # stopped rows keep a prefix; the others are equal
        assert after.token_ids == before.token_ids[: len(after.token_ids)]
        assert after.logprobs == pytest.approx(before.logprobs[: len(after.logprobs)], abs=1e-5)
    assert len(calls) == 19  # once between every two of the 20 steps


def test_a_zero_uniform_on_the_only_allowed_token_still_draws_it(tiny_policy, monkeypatch):
    # torch.rand draws from [0, 1): a 0 on the one token top-k=1 leaves made every score -inf, and argmax then
    # returned token 0 at log-prob -inf (about once in 2^24 such steps).
    model, tok = tiny_policy.model.eval(), tiny_policy.tokenizer
    ids, _ = encode_texts(tok, ["1 2 3"], 64)
    batch = collate_seq2seq(ids, None, tok.pad_token_id)
    real_rand = torch.rand

    def greedy_args():
        return model, batch["input_ids"], batch["attention_mask"], 1, 1, 1.0, 4, [torch.Generator().manual_seed(0)]

    expected = sample_candidates(*greedy_args())[0]
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: torch.zeros_like(real_rand(*a, **kw)))
    zeros = sample_candidates(*greedy_args())[0]
    assert zeros.token_ids == expected.token_ids and 0 not in zeros.token_ids[:1]
    assert all(lp > float("-inf") for lp in zeros.logprobs)
