"""LoRA adapters (rlt2t.common.lora): family targets, adapter-only state, merge, reference = adapters disabled."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForSeq2SeqLM,
    BartConfig,
    MarianConfig,
    MBartConfig,
    MT5Config,
    PegasusConfig,
    T5Config,
)

from rlt2t.common.config import LoraConfig, ModelConfig
from rlt2t.common.lora import (
    adapter_state_dict,
    apply_lora,
    load_adapter_state_dict,
    merged_model,
    reference_policy,
    state_dict_bytes,
)
from rlt2t.common.policy import load_policy

SMALL = dict(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
             decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
             pad_token_id=1, eos_token_id=2, decoder_start_token_id=2)
FAMILIES = {
    "bart": (BartConfig(**SMALL), {"q_proj", "v_proj"}),
    "mbart": (MBartConfig(**SMALL), {"q_proj", "v_proj"}),
    "marian": (MarianConfig(**SMALL), {"q_proj", "v_proj"}),
    "pegasus": (PegasusConfig(**SMALL), {"q_proj", "v_proj"}),
    "t5": (T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2), {"q", "v"}),
    "mt5": (MT5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2), {"q", "v"}),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_default_targets_are_each_familys_query_and_value_projections(family):
    config, expected = FAMILIES[family]
    torch.manual_seed(0)
    model = apply_lora(AutoModelForSeq2SeqLM.from_config(config), LoraConfig(r=4))
    assert model.config.model_type == family
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert adapted == expected
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # self-attention of encoder and decoder plus the decoder's cross-attention: 3 attention blocks x 2 targets x (A, B)
    assert len(trainable) == 3 * 2 * 2


def test_bad_targets_name_the_key():
    model = AutoModelForSeq2SeqLM.from_config(FAMILIES["bart"][0])
    with pytest.raises(ValueError, match=r"model.lora.target_modules: \['q'\] match no linear layer"):
        apply_lora(model, LoraConfig(target_modules=["q"]))
    model.config.model_type = "prophetnet"
    with pytest.raises(ValueError, match="no default for model_type 'prophetnet'"):
        apply_lora(model, LoraConfig())


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(10, 60, (3, 7), generator=g),
            "attention_mask": torch.ones(3, 7, dtype=torch.long),
            "labels": torch.randint(10, 60, (3, 5), generator=g)}


def _lora_policy(ids_tokenizer_dir, seed=0, **lora):
    policy = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0)
    return apply_lora(policy.model, LoraConfig(dropout=0.0, **lora), seed=seed)


def _train_a_little(model, batch, steps=5):
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    for _ in range(steps):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()


def test_init_is_seeded_leaves_the_global_rng_and_starts_at_the_base(ids_tokenizer_dir, batch):
    base = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0).model.eval()
    with torch.no_grad():
        base_logits = base(**batch).logits
    model = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0).model
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = apply_lora(model, LoraConfig(dropout=0.0), seed=5).eval()
    assert torch.equal(torch.get_rng_state(), before)
    b = _lora_policy(ids_tokenizer_dir, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(adapter_state_dict(a).values(), adapter_state_dict(b).values(),
                                                 strict=True))
    with torch.no_grad():  # B = 0 at init: the LoRA policy computes exactly the base
        assert torch.equal(a(**batch).logits, base_logits)


def test_wrapping_a_model_in_adapters_warns_nothing(ids_tokenizer_dir, tmp_path):
    """peft asks the model a property that transformers 5 deprecates: a FutureWarning per wrap, in every Ray
    worker of a LoRA run, that the user can do nothing about; applying adapters and loading a checkpoint of them
    warn nothing."""
    import warnings

    model = load_policy(ModelConfig(preset="tiny", family="bart"), ids_tokenizer_dir, seed=0).model
    base = tmp_path / "base"
    model.save_pretrained(base)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adapted = apply_lora(load_policy(ModelConfig(preset=None), ids_tokenizer_dir, checkpoint=base).model,
                             LoraConfig(dropout=0.0))
        adapted.peft_config["default"].base_model_name_or_path = str(base)
        adapted.save_pretrained(tmp_path / "adapters")
        load_policy(ModelConfig(preset=None), ids_tokenizer_dir, checkpoint=tmp_path / "adapters",
                    trainable_adapters=True)
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)], [str(w.message) for w in caught]


def test_training_moves_adapters_only_and_merge_matches(ids_tokenizer_dir, batch):
    model = _lora_policy(ids_tokenizer_dir, r=4, alpha=8.0)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    _train_a_little(model, batch)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert any(v.abs().sum() > 0 for k, v in adapter_state_dict(model).items() if "lora_B" in k)
    model.eval()
    with torch.no_grad():
        unmerged = model(**batch).logits
        with reference_policy(model):
            reference = model(**batch).logits
        after = model(**batch).logits
    merged = merged_model(model)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        merged_logits = merged(**batch).logits
    assert torch.allclose(merged_logits, unmerged, atol=1e-5, rtol=0)
    assert torch.equal(after, unmerged), "the adapters must be back on after the reference block"
    assert (reference - unmerged).abs().max() > 1e-3, "training changed nothing the reference could tell apart"
    # The reference is the base model: the frozen weights as they were, no adapters.
    base = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0).model.eval()
    with torch.no_grad():
        assert torch.equal(reference, base(**batch).logits)
        assert torch.equal(model(**batch).logits, unmerged), "merged_model must not modify the LoRA policy"


def test_adapter_state_round_trip_into_a_fresh_policy(ids_tokenizer_dir, batch):
    trained = _lora_policy(ids_tokenizer_dir, seed=1)
    _train_a_little(trained, batch)
    state = adapter_state_dict(trained)
    assert all(("lora_A" in k or "lora_B" in k) and v.device.type == "cpu" for k, v in state.items())
    full = sum(v.numel() * v.element_size() for v in trained.get_base_model().state_dict().values())
    assert state_dict_bytes(state) == sum(p.numel() * 4 for p in trained.parameters() if p.requires_grad)
    assert state_dict_bytes(state) < full / 5
    worker = _lora_policy(ids_tokenizer_dir, seed=2)  # a rollout worker's copy: other init, same config
    load_adapter_state_dict(worker, state)
    trained.eval(), worker.eval()
    with torch.no_grad():
        assert torch.equal(worker(**batch).logits, trained(**batch).logits)
    with pytest.raises(ValueError, match="does not fit"):
        load_adapter_state_dict(_lora_policy(ids_tokenizer_dir, r=2, target_modules=["q_proj"]), state)
