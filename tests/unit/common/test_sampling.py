"""The sampler: its between-steps hook (rows it names leave the batch at once; the other rows are unchanged), and
its filters."""

from __future__ import annotations

import pytest
import torch

from rlt2t.common.collate import collate_seq2seq, encode_texts
from rlt2t.common.sampling import check_sampling, sample_candidates, warp_logits


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


def test_epsilon_removes_tokens_under_it_after_top_p_and_keeps_the_most_likely():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = lambda scores: torch.isfinite(scores)[0].tolist()  # noqa: E731
    assert kept(warp_logits(logits, epsilon=0.1)) == [True, True, True, False]
    assert kept(warp_logits(logits, epsilon=0.6)) == [True, False, False, False]  # none reach it: the best stays
    assert torch.equal(warp_logits(logits, epsilon=0.1)[0, :3], logits[0, :3])  # the rest untouched
    # After top-p 0.8 the two left have 0.625 and 0.375 of the mass: epsilon reads that, not the raw 0.3.
    assert kept(warp_logits(logits, top_p=0.8)) == [True, True, False, False]
    assert kept(warp_logits(logits, top_p=0.8, epsilon=0.35)) == [True, True, False, False]
    assert kept(warp_logits(logits, top_p=0.8, epsilon=0.4)) == [True, False, False, False]
    # Leading dims are kept, each row filtered on its own.
    both = warp_logits(torch.stack([logits, logits.flip(-1)]), epsilon=0.1)
    assert both.shape == (2, 1, 4) and torch.isfinite(both).sum() == 6


@pytest.mark.parametrize("epsilon", [-0.1, 1.0])
def test_epsilon_outside_0_1_is_refused(epsilon):
    with pytest.raises(ValueError, match=r"epsilon must be in \[0, 1\)"):
        check_sampling(1, 0, 1.0, 1.0, epsilon)


def test_epsilon_sampling_draws_no_token_under_epsilon(tiny_policy):
    model, tok = tiny_policy.model.eval(), tiny_policy.tokenizer
    ids, _ = encode_texts(tok, ["1 2 3", "4 5"], 64)
    batch = collate_seq2seq(ids, None, tok.pad_token_id)
    with torch.no_grad():  # epsilon at the median of the first step's probabilities: about half the tokens go
        enc = model.get_encoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        start = torch.full((2, 1), model.config.decoder_start_token_id)
        first = model(encoder_outputs=enc, attention_mask=batch["attention_mask"], decoder_input_ids=start)
    epsilon = float(first.logits[0, -1].softmax(-1).median())

    def run(eps):
        generators = [torch.Generator().manual_seed(7 + r) for r in range(2 * 32)]
        return sample_candidates(model, batch["input_ids"], batch["attention_mask"], 32, 0, 1.0, 6, generators,
                                 epsilon=eps)

    def drawn_probs(rows):
        return [p for r in rows for p, _ in zip(torch.tensor(r.logprobs).exp().tolist(),
                                                 r.token_ids[: len(r.token_ids) - r.forced], strict=False)]

    plain, filtered = run(0.0), run(epsilon)
    assert min(drawn_probs(plain)) < epsilon  # without the filter such tokens are drawn: the check below can fail
    assert min(drawn_probs(filtered)) >= epsilon * (1 - 1e-5)
    for row in filtered:  # the sample log-prob is under the renormalised kept mass: above the raw one
        assert all(s >= r - 1e-6 for s, r in zip(row.sample_logprobs, row.logprobs, strict=True))
    assert any(s > r + 1e-3 for row in filtered for s, r in zip(row.sample_logprobs, row.logprobs, strict=True))
