"""Tests for rlt2t.learner.fgm on a tiny BART: the perturbation is real, exact, and undone bitwise."""

from __future__ import annotations

import pytest
import torch
import transformers

from rlt2t.learner.fgm import FGM, input_embedding_parameter

EPSILON = 0.5


@pytest.fixture
def model() -> transformers.BartForConditionalGeneration:
    torch.manual_seed(0)
    cfg = transformers.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
        normalize_before=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
        forced_bos_token_id=None,
    )  # fmt: skip
    # eval(): no dropout, so every difference below comes from the perturbation alone
    return transformers.BartForConditionalGeneration(cfg).eval()


@pytest.fixture
def batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        "input_ids": torch.randint(3, 64, (2, 7), generator=gen),
        "labels": torch.randint(3, 64, (2, 5), generator=gen),
    }


def test_targets_the_shared_embedding_by_identity(model) -> None:
    fgm = FGM(model, epsilon=EPSILON)
    assert fgm.param is model.model.shared.weight
    assert fgm.param is model.model.encoder.embed_tokens.weight
    assert fgm.param is model.model.decoder.embed_tokens.weight
    # DDP-style wrappers expose the model as `.module`
    wrapper = torch.nn.Module()
    wrapper.module = model
    assert input_embedding_parameter(wrapper) is fgm.param


def test_attack_adds_exactly_epsilon_along_the_gradient_and_restore_is_bitwise(model, batch) -> None:
    fgm = FGM(model, epsilon=EPSILON)
    clean_loss = model(**batch).loss
    clean_loss.backward()
    original = fgm.param.detach().clone()
    grad = fgm.param.grad.detach().clone()

    assert fgm.attack() is True
    delta = fgm.param.detach() - original
    assert torch.linalg.vector_norm(delta).item() == pytest.approx(EPSILON, abs=1e-5)
    torch.testing.assert_close(delta, EPSILON * grad / torch.linalg.vector_norm(grad), atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        adv_loss = model(**batch).loss
    # moving along the gradient raises the loss (first order: by about epsilon·‖g‖)
    assert adv_loss.item() > clean_loss.item() + 1e-4

    fgm.restore()
    assert torch.equal(fgm.param.detach(), original)
    with torch.no_grad():
        assert torch.equal(model(**batch).loss, clean_loss.detach())


def test_perturbation_reaches_encoder_and_decoder(model, batch) -> None:
    fgm = FGM(model, epsilon=EPSILON)
    model(**batch).loss.backward()
    input_ids = batch["input_ids"]
    decoder_ids = batch["labels"]

    def encoder_out() -> torch.Tensor:
        return model.model.encoder(input_ids=input_ids).last_hidden_state

    def decoder_out(encoder_hidden: torch.Tensor) -> torch.Tensor:
        return model.model.decoder(
            input_ids=decoder_ids, encoder_hidden_states=encoder_hidden
        ).last_hidden_state

    with torch.no_grad():
        clean_enc = encoder_out()
        clean_dec = decoder_out(clean_enc)
        with fgm.perturbed() as perturbed:
            assert perturbed
            adv_enc = encoder_out()
            adv_dec_same_memory = decoder_out(clean_enc)  # only the decoder's embed_tokens can differ
        restored_enc = encoder_out()
    assert not torch.allclose(adv_enc, clean_enc, atol=1e-4)
    assert not torch.allclose(adv_dec_same_memory, clean_dec, atol=1e-4)
    assert torch.equal(restored_enc, clean_enc)


def test_adversarial_gradient_is_accumulated(model, batch) -> None:
    fgm = FGM(model, epsilon=EPSILON)
    model(**batch).loss.backward()
    grad_clean = fgm.param.grad.detach().clone()
    other = model.model.encoder.layers[0].fc1.weight
    other_clean = other.grad.detach().clone()
    with fgm.perturbed():
        model(**batch).loss.backward()
    assert not torch.allclose(fgm.param.grad, grad_clean)
    assert not torch.allclose(other.grad, other_clean)
    # the adversarial pass added its own gradient: the sum is not just twice the clean one
    assert not torch.allclose(fgm.param.grad, 2 * grad_clean)


def test_errors_and_no_op_cases(model, batch) -> None:
    fgm = FGM(model, epsilon=EPSILON)
    with pytest.raises(RuntimeError, match="no gradient"):
        fgm.attack()
    with pytest.raises(RuntimeError, match="without a preceding attack"):
        fgm.restore()

    model(**batch).loss.backward()
    fgm.attack()
    with pytest.raises(RuntimeError, match="twice"):
        fgm.attack()
    fgm.restore()

    original = fgm.param.detach().clone()
    for bad in (0.0, float("nan")):
        fgm.param.grad.fill_(bad)
        with fgm.perturbed() as perturbed:
            assert perturbed is False
            assert torch.equal(fgm.param.detach(), original)
        assert torch.equal(fgm.param.detach(), original)

    with pytest.raises(ValueError, match="epsilon"):
        FGM(model, epsilon=0.0)
    with pytest.raises(TypeError, match="get_input_embeddings"):
        FGM(torch.nn.Linear(2, 2))


def test_restore_happens_even_if_the_adversarial_pass_fails(model, batch) -> None:
    fgm = FGM(model, epsilon=EPSILON)
    model(**batch).loss.backward()
    original = fgm.param.detach().clone()
    with pytest.raises(KeyError), fgm.perturbed():
        raise KeyError("boom")
    assert torch.equal(fgm.param.detach(), original)
