"""Tests for rlt2t.learner.rank_step on a tiny randomly initialised BART (no hub access needed).

The reference is `naive_rank_loss`, the original three-full-forward formulation whose CE is Hugging Face's
own `outputs.loss`; the shared-encoder version must agree with it in value and in gradients.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import BartConfig, BartForConditionalGeneration

from rlt2t.common.scoring import token_scores
from rlt2t.learner.rank_step import (
    RankBatch,
    SharedEncoderRankLoss,
    naive_rank_loss,
    pad_labels,
    shared_encoder_rank_loss,
    shift_right,
)

PAD, BOS, EOS = 0, 1, 2
X = -100  # label padding


@pytest.fixture(scope="module")
def model() -> Iterator[BartForConditionalGeneration]:
    # Intra-op threads only add contention for matrices this small (1 s per test on a busy 2-core box).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
        normalize_before=False, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
        decoder_start_token_id=EOS, forced_bos_token_id=None,
    )
    yield BartForConditionalGeneration(config).eval()
    torch.set_num_threads(threads)


def make_batch(long_gold: bool) -> RankBatch:
    """B=4 pairs: differ at t=2; a ends where b goes on (padding vs token); identical (use_rank 0);
    differ at t=0.

    Gold is longer (Tg=9) or shorter (Tg=5) than the pair length T=7, so both padding directions are used.
    """
    input_ids = torch.tensor(
        [
            [BOS, 10, 11, 12, 13, 14, EOS],
            [BOS, 20, 21, EOS, PAD, PAD, PAD],
            [BOS, 30, 31, 32, 33, EOS, PAD],
            [BOS, 40, EOS, PAD, PAD, PAD, PAD],
        ]
    )
    if long_gold:
        gold = torch.tensor(
            [
                [5, 6, 7, 8, 9, 10, 11, 12, EOS],
                [5, 6, EOS, X, X, X, X, X, X],
                [15, 16, 17, 18, EOS, X, X, X, X],
                [25, EOS, X, X, X, X, X, X, X],
            ]
        )
    else:
        gold = torch.tensor(
            [[5, 6, 7, 8, EOS], [5, 6, EOS, X, X], [15, 16, 17, 18, EOS], [25, EOS, X, X, X]]
        )
    labels_a = torch.tensor(
        [
            [5, 6, 7, 8, EOS, X, X],
            [5, 6, EOS, X, X, X, X],
            [15, 16, 17, EOS, X, X, X],
            [25, 26, 27, 28, 29, 30, EOS],
        ]
    )
    labels_b = torch.tensor(
        [
            [5, 6, 9, 8, 7, EOS, X],
            [5, 6, 3, 4, EOS, X, X],
            [15, 16, 17, EOS, X, X, X],
            [33, 26, EOS, X, X, X, X],
        ]
    )
    use_rank = torch.tensor([True, True, False, True])
    return RankBatch(input_ids, (input_ids != PAD).long(), gold, labels_a, labels_b, use_rank)


def assert_outputs_close(actual, expected, tol: float = 1e-5) -> None:
    for name in ("loss", "ce", "rank", "accuracy"):
        torch.testing.assert_close(
            getattr(actual, name), getattr(expected, name), atol=tol, rtol=tol, msg=name
        )


@pytest.mark.parametrize("long_gold", [True, False])
@pytest.mark.parametrize("score_kind", ["logprobs", "logits"])
def test_shared_encoder_matches_three_full_passes(model, score_kind: str, long_gold: bool) -> None:
    batch = make_batch(long_gold)
    with torch.no_grad():
        shared = shared_encoder_rank_loss(model, batch, score_kind=score_kind)
        naive = naive_rank_loss(model, batch, score_kind=score_kind)
        source = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        hf_ce = model(**source, labels=batch.gold_labels).loss
    assert_outputs_close(shared, naive)
    torch.testing.assert_close(shared.ce, hf_ce, atol=1e-5, rtol=1e-5)
    assert shared.rank.item() > 0.0  # three pairs count, so the comparison is not 0 == 0


@pytest.mark.parametrize("score_kind", ["logprobs", "logits"])
def test_shared_encoder_gradients_match_three_full_passes(model, score_kind: str) -> None:
    batch = make_batch(long_gold=True)

    def gradients(loss_fn) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        # loss_weight 1 so the rank term's gradient is as visible as the CE term's.
        loss_fn(model, batch, score_kind=score_kind, loss_weight=1.0).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    shared, naive = gradients(shared_encoder_rank_loss), gradients(naive_rank_loss)
    model.zero_grad(set_to_none=True)
    assert shared.keys() == naive.keys() and len(shared) > 0
    assert any(name.startswith("model.encoder.") and g.abs().sum() > 0 for name, g in shared.items())
    for name in shared:
        torch.testing.assert_close(shared[name], naive[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("score_kind", ["logprobs", "logits"])
def test_longer_decoder_padding_leaves_real_scores_unchanged(model, score_kind: str) -> None:
    batch = make_batch(long_gold=False)
    labels = batch.labels_a
    longer = pad_labels(labels, labels.shape[1] + 6)
    source = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    with torch.no_grad():
        short_scores = token_scores(model(**source, labels=labels).logits, labels, score_kind)
        long_scores = token_scores(model(**source, labels=longer).logits, longer, score_kind)
    torch.testing.assert_close(long_scores[:, : labels.shape[1]], short_scores, atol=1e-5, rtol=1e-5)
    assert torch.all(long_scores[:, labels.shape[1] :] == 0)


def test_one_encoder_pass_and_one_batched_decoder_pass(model) -> None:
    batch = make_batch(long_gold=True)
    calls: dict[str, list[int]] = {"encoder": [], "decoder": []}

    def record(part: str):
        # Record the batch size of each call: the shared version must decode gold, a and b as one 3B batch.
        return lambda module, args, out: calls[part].append(out[0].shape[0])

    handles = [model.model.encoder.register_forward_hook(record("encoder"))]
    handles.append(model.model.decoder.register_forward_hook(record("decoder")))
    try:
        with torch.no_grad():
            shared_encoder_rank_loss(model, batch)
        assert calls == {"encoder": [4], "decoder": [3 * 4]}
        calls["encoder"].clear()
        calls["decoder"].clear()
        with torch.no_grad():
            naive_rank_loss(model, batch)
        assert calls == {"encoder": [4, 4, 4], "decoder": [4, 4, 4]}
    finally:
        for handle in handles:
            handle.remove()


def test_loss_is_ce_plus_weighted_rank(model) -> None:
    batch = make_batch(long_gold=False)
    with torch.no_grad():
        default = shared_encoder_rank_loss(model, batch)
        heavier = shared_encoder_rank_loss(model, batch, loss_weight=0.7)
    torch.testing.assert_close(default.loss, default.ce + 0.2 * default.rank)
    torch.testing.assert_close(heavier.loss, heavier.ce + 0.7 * heavier.rank)
    torch.testing.assert_close(heavier.ce, default.ce)


def test_module_wrapper_matches_function(model) -> None:
    batch = make_batch(long_gold=True)
    wrapper = SharedEncoderRankLoss(model, score_kind="logits", loss_weight=0.3, alpha=0.9)
    with torch.no_grad():
        expected = shared_encoder_rank_loss(model, batch, score_kind="logits", loss_weight=0.3, alpha=0.9)
        assert_outputs_close(wrapper(batch), expected)


def test_shift_right_starts_with_decoder_start_and_replaces_ignore_index() -> None:
    labels = torch.tensor([[5, 6, EOS, X], [7, EOS, X, X]])
    expected = torch.tensor([[EOS, 5, 6, EOS], [EOS, 7, EOS, PAD]])
    assert torch.equal(shift_right(labels, decoder_start_token_id=EOS, pad_token_id=PAD), expected)


def test_bad_batch_and_options_raise_clear_errors(model) -> None:
    good = make_batch(long_gold=False)
    fields = {name: getattr(good, name) for name in good.__dataclass_fields__}
    with pytest.raises(ValueError, match="labels_b"):
        RankBatch(**{**fields, "labels_b": fields["labels_b"][:3]})
    with pytest.raises(ValueError, match="labels_a.*labels_b"):
        RankBatch(**{**fields, "labels_b": fields["labels_b"][:, :5]})
    with pytest.raises(ValueError, match="gold_labels"):
        RankBatch(**{**fields, "gold_labels": fields["gold_labels"].float()})
    with pytest.raises(ValueError, match="attention_mask"):
        RankBatch(**{**fields, "attention_mask": fields["attention_mask"][:, :4]})
    with pytest.raises(ValueError, match="score_kind.*'probs'"):
        shared_encoder_rank_loss(model, good, score_kind="probs")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="alpha"):
        SharedEncoderRankLoss(model, alpha=-0.1)
    assert torch.equal(good.to("cpu").labels_a, good.labels_a)
