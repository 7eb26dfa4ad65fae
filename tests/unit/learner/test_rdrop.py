"""Tests for rlt2t.learner.rdrop: the R-drop loss against a by-hand computation, and the two-pass helper."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from rlt2t.learner.rdrop import rdrop_forward, rdrop_loss


def softmax(row: list[float]) -> list[float]:
    exps = [math.exp(x) for x in row]
    return [e / sum(exps) for e in exps]


def kl(p: list[float], q: list[float]) -> float:
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))


def test_matches_hand_computation() -> None:
    l1 = [[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]]
    l2 = [[0.5, 2.5, 0.0], [1.0, -0.5, 2.0]]
    labels = [1, 2]
    alpha = 0.7

    # by hand, straight from the definitions in the docstring, in plain Python floats
    p1 = [softmax(r) for r in l1]
    p2 = [softmax(r) for r in l2]
    ce1 = sum(-math.log(p1[t][labels[t]]) for t in range(2)) / 2
    ce2 = sum(-math.log(p2[t][labels[t]]) for t in range(2)) / 2
    ce = 0.5 * (ce1 + ce2)
    kl_sym = sum(0.5 * (kl(p1[t], p2[t]) + kl(p2[t], p1[t])) for t in range(2)) / 2
    expected = ce + alpha * kl_sym

    out = rdrop_loss(torch.tensor([l1]), torch.tensor([l2]), torch.tensor([labels]), alpha)
    assert out.ce.item() == pytest.approx(ce, rel=1e-6)
    assert out.kl.item() == pytest.approx(kl_sym, rel=1e-5)
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert kl_sym > 0.01  # the example is not degenerate


def test_identical_logits_give_zero_kl_and_plain_ce() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 11, generator=gen)
    labels = torch.randint(0, 11, (3, 4), generator=gen)
    labels[0, 2:] = -100
    out = rdrop_loss(logits, logits.clone(), labels, alpha=5.0)
    assert out.kl.item() == pytest.approx(0.0, abs=1e-7)
    ce_ref = torch.nn.functional.cross_entropy(logits.view(-1, 11), labels.view(-1), ignore_index=-100)
    torch.testing.assert_close(out.ce, ce_ref)
    torch.testing.assert_close(out.loss, ce_ref)


def test_padding_positions_are_excluded() -> None:
    gen = torch.Generator().manual_seed(1)
    logits1 = torch.randn(2, 5, 7, generator=gen)
    logits2 = torch.randn(2, 5, 7, generator=gen)
    labels = torch.randint(0, 7, (2, 5), generator=gen)
    labels[0, 3:] = -100
    labels[1, 1] = -100
    ref = rdrop_loss(logits1, logits2, labels, alpha=1.0)

    # changing the logits at padded positions changes nothing
    pad = labels == -100
    noisy1, noisy2 = logits1.clone(), logits2.clone()
    noisy1[pad] += 10 * torch.randn(int(pad.sum()), 7, generator=gen)
    noisy2[pad] -= 3.0 * torch.randn(int(pad.sum()), 7, generator=gen)
    out = rdrop_loss(noisy1, noisy2, labels, alpha=1.0)
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a, b)

    # and the mean is over the 6 real tokens: same as computing on just those tokens
    keep = ~pad
    flat = rdrop_loss(logits1[keep][None], logits2[keep][None], labels[keep][None], alpha=1.0)
    for a, b in zip(flat, ref, strict=True):
        torch.testing.assert_close(a, b)


def test_all_padding_gives_zeros_not_nan() -> None:
    logits = torch.randn(1, 3, 4, requires_grad=True)
    out = rdrop_loss(logits, logits + 1.0, torch.full((1, 3), -100), alpha=1.0)
    assert out.loss.item() == 0.0 and out.kl.item() == 0.0
    out.loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_gradient_flows_to_both_logits() -> None:
    gen = torch.Generator().manual_seed(2)
    logits1 = torch.randn(2, 3, 5, generator=gen, requires_grad=True)
    logits2 = torch.randn(2, 3, 5, generator=gen, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3), generator=gen)
    rdrop_loss(logits1, logits2, labels, alpha=1.0).kl.backward()
    assert logits1.grad is not None and logits1.grad.abs().sum() > 0
    assert logits2.grad is not None and logits2.grad.abs().sum() > 0
    # the symmetric KL treats both sides alike: swapping them swaps the gradients
    g1, g2 = logits1.grad.clone(), logits2.grad.clone()
    logits1.grad = logits2.grad = None
    rdrop_loss(logits2, logits1, labels, alpha=1.0).kl.backward()
    torch.testing.assert_close(logits1.grad, g1)
    torch.testing.assert_close(logits2.grad, g2)


def test_low_precision_logits_are_computed_in_float32() -> None:
    gen = torch.Generator().manual_seed(3)
    logits1 = torch.randn(1, 4, 6, generator=gen)
    logits2 = torch.randn(1, 4, 6, generator=gen)
    labels = torch.randint(0, 6, (1, 4), generator=gen)
    out = rdrop_loss(logits1.bfloat16(), logits2.bfloat16(), labels, alpha=1.0)
    ref = rdrop_loss(logits1.bfloat16().float(), logits2.bfloat16().float(), labels, alpha=1.0)
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, ref.loss)


def test_bad_inputs() -> None:
    logits = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="same shape"):
        rdrop_loss(logits, torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long), alpha=1.0)
    with pytest.raises(ValueError, match="labels"):
        rdrop_loss(logits, logits, torch.zeros(1, 3, dtype=torch.long), alpha=1.0)
    with pytest.raises(ValueError, match="alpha"):
        rdrop_loss(logits, logits, torch.zeros(1, 2, dtype=torch.long), alpha=-1.0)


def test_rdrop_forward_on_tiny_bart() -> None:
    torch.manual_seed(0)
    cfg = transformers.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
        normalize_before=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
        forced_bos_token_id=None, dropout=0.3,
    )  # fmt: skip
    model = transformers.BartForConditionalGeneration(cfg)
    labels = torch.randint(3, 64, (2, 5))
    labels[1, 3:] = -100
    batch = {"input_ids": torch.randint(3, 64, (2, 6)), "labels": labels}

    model.train()
    out = rdrop_forward(model, batch, alpha=1.0)
    assert out.kl.item() > 0  # dropout made the two passes differ
    out.loss.backward()
    assert model.model.shared.weight.grad is not None

    model.eval()
    with pytest.raises(RuntimeError, match="train"):
        rdrop_forward(model, batch, alpha=1.0)
    with pytest.raises(ValueError, match="labels"):
        rdrop_forward(model.train(), {"input_ids": batch["input_ids"]}, alpha=1.0)
