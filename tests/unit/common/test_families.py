"""Every encoder-decoder family through load_policy: saved tiny models with their own tokenizer classes load
back exactly, presets match the project's tokenizer, unknown or mismatched directories are refused."""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import fields

import pytest
import torch
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.modeling_outputs import BaseModelOutput

from rlt2t.common.config import ConfigError, DataConfig, ModelConfig, load_config
from rlt2t.common.families import (
    CACHE_KEYWORD,
    FAMILIES,
    PRESET_FAMILIES,
    UnsupportedModelError,
    cache_of,
    check_mixed_precision,
    cross_attentions,
    decoder_input_ids,
    max_positions,
    preset_config,
    with_cache,
)
from rlt2t.common.policy import check_lengths, load_policy
from rlt2t.common.sampling import sample_candidates
from rlt2t.common.tokenization import load_tokenizer

LOADED = ("bart", "t5", "t5-v1.0", "marian", "mbart", "pegasus", "encoder-decoder")
FAMILY_OF = {"t5-v1.0": "t5"}


@pytest.fixture(scope="module")
def policies(family_dirs):
    return {f: load_policy(ModelConfig(preset=None, path=str(family_dirs[f]), dropout=0.0)) for f in LOADED}


@pytest.mark.parametrize("name", LOADED)
def test_saved_directory_loads_back_exactly(name, family_dirs, policies):
    policy = policies[name]
    assert policy.family == FAMILY_OF.get(name, name)
    saved = load_file(family_dirs[name] / "model.safetensors")
    state = policy.model.state_dict()
    for key, value in saved.items():
        assert torch.equal(state[key], value), key
    assert policy.tokenizer.eos_token_id == policy.model.config.eos_token_id


@pytest.mark.parametrize("name", LOADED)
def test_shared_sampler_greedy_equals_generate(name, policies):
    # common/sampling.py (get_encoder, encoder_outputs, the KV cache and batch_select_indices) for every family.
    policy = policies[name]
    model = policy.model.eval()
    batch = policy.tokenizer(["alpha beta gamma delta", "river"], return_tensors="pt", padding=True)
    rows = sample_candidates(model, batch["input_ids"], batch["attention_mask"], 1, 1, 1.0, 6,
                             [torch.Generator().manual_seed(i) for i in range(2)])
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=6, do_sample=False, num_beams=1)
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    for row, ref in zip(rows, out.tolist(), strict=True):
        ref = ref[1:]  # drop the decoder start
        if eos in ref:
            ref = ref[: ref.index(eos) + 1]
        while ref and ref[-1] == pad and pad != eos and len(ref) > len(row.token_ids):
            ref.pop()
        assert row.token_ids == ref


def test_decoder_start_per_family(policies):
    starts = {name: policies[name].model.config.decoder_start_token_id for name in LOADED}
    toks = {name: policies[name].tokenizer for name in LOADED}
    assert starts["bart"] == toks["bart"].eos_token_id
    assert starts["t5"] == starts["pegasus"] == 0 == toks["t5"].pad_token_id
    assert starts["marian"] == toks["marian"].pad_token_id == len(toks["marian"]) - 1
    assert starts["mbart"] == toks["mbart"].convert_tokens_to_ids("en_XX")
    assert starts["encoder-decoder"] == toks["encoder-decoder"].cls_token_id
    # BERT's [SEP] is the warm start's EOS; T5 has no BOS.
    assert toks["encoder-decoder"].eos_token == "[SEP]" and toks["t5"].bos_token is None


@pytest.mark.parametrize("name", LOADED)
def test_incremental_decode_uses_the_installed_cache_keyword(name, policies):
    # transformers 5.24 renamed past_key_values to cache (the old name warns with a FutureWarning and goes in
    # 5.40): a decode through with_cache/cache_of, token by token, must not take the deprecated path, and must
    # give the full forward's logits.
    model = policies[name].model.eval()
    batch = policies[name].tokenizer(["alpha beta gamma", "river delta"], return_tensors="pt", padding=True)
    labels = torch.tensor([[5, 6, 7, 8], [9, 5, 6, 7]])
    decoder_inputs = decoder_input_ids(labels, model.config)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        encoded = BaseModelOutput(last_hidden_state=model.get_encoder()(**batch).last_hidden_state)
        full = model(encoder_outputs=encoded, attention_mask=batch["attention_mask"],
                     decoder_input_ids=decoder_inputs, use_cache=False).logits
        cache, steps = None, []
        for t in range(decoder_inputs.shape[1]):
            out = model(encoder_outputs=encoded, attention_mask=batch["attention_mask"],
                        decoder_input_ids=decoder_inputs[:, t : t + 1], **with_cache(cache))
            cache = cache_of(out)
            assert cache is not None
            steps.append(out.logits)
    assert CACHE_KEYWORD in {f.name for f in fields(type(out))}
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)


def test_cross_attention_found_in_every_family(policies):
    for name in LOADED:
        model = policies[name].model
        attns = cross_attentions(model)
        assert [a.layer_idx for a in attns] == [0, 1], name


def test_positions():
    assert max_positions(preset_config("t5", "tiny", _project_tok())) is None
    assert max_positions(preset_config("marian", "tiny", _project_tok())) == 256


def test_t5_has_no_length_limit(policies):
    check_lengths(policies["t5"], DataConfig(max_source_len=5000, max_target_len=5000))
    with pytest.raises(ValueError, match="exceeds the model's 128 positions"):
        check_lengths(policies["marian"], DataConfig(max_source_len=5000))


_TOK = {}


def _project_tok():
    if "tok" not in _TOK:
        from rlt2t.common.tokenization import build_ids_tokenizer

        _TOK["tok"] = build_ids_tokenizer(num_data_tokens=60, num_sentinels=4)
    return _TOK["tok"]


@pytest.mark.parametrize("family", PRESET_FAMILIES)
def test_presets_match_the_project_tokenizer(family, ids_tokenizer_dir, tmp_path):
    tok = load_tokenizer(ids_tokenizer_dir)
    policy = load_policy(ModelConfig(preset="tiny", family=family, dropout=0.0), ids_tokenizer_dir, seed=0)
    config = policy.model.config
    assert policy.family == family
    assert (config.vocab_size, config.pad_token_id, config.eos_token_id) == (len(tok), tok.pad_token_id,
                                                                              tok.eos_token_id)
    start = tok.eos_token_id if family in ("bart", "mbart") else tok.pad_token_id
    assert config.decoder_start_token_id == start
    # It trains (a loss and a gradient) and saves/loads as itself.
    batch = tok(["3 4 5"], return_tensors="pt")
    labels = tok(["6 7"], return_tensors="pt")["input_ids"]
    loss = policy.model(**batch, decoder_input_ids=decoder_input_ids(labels, config), labels=labels).loss
    loss.backward()
    assert torch.isfinite(loss)
    policy.model.save_pretrained(tmp_path)
    again = load_policy(ModelConfig(preset=None, dropout=0.0), ids_tokenizer_dir, checkpoint=tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(policy.model.state_dict().values(),
                                                  again.model.state_dict().values(), strict=True))


def test_t5_preset_is_flan_style(ids_tokenizer_dir):
    model = load_policy(ModelConfig(preset="tiny", family="t5"), ids_tokenizer_dir, seed=0).model
    assert model.lm_head.weight is not model.shared.weight and not model.config.scale_decoder_outputs


def test_unknown_architecture_is_refused(tmp_path, ids_tokenizer_dir):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=70)).save_pretrained(tmp_path)
    shutil.copytree(ids_tokenizer_dir, tmp_path, dirs_exist_ok=True)
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2' is not an encoder-decoder"):
        load_policy(ModelConfig(), checkpoint=tmp_path)


def test_weights_of_another_architecture_are_refused(family_dirs, tmp_path):
    # The issue's failure: a T5's weights under a BART config.json would load as a random BART.
    shutil.copytree(family_dirs["t5"], tmp_path / "m")
    bart_config = json.loads((family_dirs["bart"] / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(bart_config))
    with pytest.raises(UnsupportedModelError, match="weights do not match"):
        load_policy(ModelConfig(), checkpoint=tmp_path / "m")


def test_fp16_refused_for_t5():
    with pytest.raises(ConfigError, match="use run.mixed_precision=bf16"):
        load_config(overrides=["model.family=t5", "run.mixed_precision=fp16"])
    load_config(overrides=["model.family=t5", "run.mixed_precision=bf16"])
    load_config(overrides=["model.family=bart", "run.mixed_precision=fp16"])
    with pytest.raises(ValueError, match="bf16"):
        check_mixed_precision({"model_type": "mt5"}, "fp16")
    assert not FAMILIES["t5"].fp16_safe


def test_fp16_refused_for_a_t5_directory(family_dirs):
    with pytest.raises(ConfigError, match="t5-family models overflow in fp16"):
        load_config(overrides=[f"model.path={family_dirs['t5']}", "run.mixed_precision=fp16"])


def test_mbart_language_codes(family_dirs):
    policy = load_policy(ModelConfig(preset=None, path=str(family_dirs["mbart"]), src_lang="de_DE",
                                     tgt_lang="fr_XX"))
    tok = policy.tokenizer
    ids = tok("alpha beta")["input_ids"]
    assert ids[-2:] == [tok.eos_token_id, tok.convert_tokens_to_ids("de_DE")]  # mBART-25: text </s> lang
    assert policy.model.config.decoder_start_token_id == tok.convert_tokens_to_ids("fr_XX")
    assert policy.model.generation_config.decoder_start_token_id == tok.convert_tokens_to_ids("fr_XX")
    with pytest.raises(ValueError, match="no such language code"):
        load_policy(ModelConfig(preset=None, path=str(family_dirs["mbart"]), tgt_lang="xx_YY"))


def test_unused_weights_are_refused(family_dirs, tmp_path):
    # Same shapes, another architecture: mBART's weights (pre-norm, extra layer norms) under a BART config.
    shutil.copytree(family_dirs["mbart"], tmp_path / "m")
    config = json.loads((family_dirs["mbart"] / "config.json").read_text())
    config.update(model_type="bart", architectures=["BartForConditionalGeneration"])
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="unexpected keys: .*layer_norm"):
        load_policy(ModelConfig(), checkpoint=tmp_path / "m")


def test_truncation_keeps_each_familys_special_tokens(policies):
    from rlt2t.common.collate import encode_texts
    from rlt2t.common.tokenization import template_affixes

    long = " ".join(["alpha beta gamma"] * 20)
    expected_affixes = {"bart": (0, 1), "t5": (0, 1), "marian": (0, 1), "pegasus": (0, 1), "mbart": (0, 2),
                        "encoder-decoder": (1, 1)}
    for name, (prefix, suffix) in expected_affixes.items():
        tok = policies[name].tokenizer
        assert template_affixes(tok) == (prefix, suffix), name
        full = tok(long)["input_ids"]
        (ids,), truncated = encode_texts(tok, [long], 8)
        assert truncated == 1 and len(ids) == 8
        assert ids == full[: 8 - suffix] + full[len(full) - suffix :], name


def test_sft_batches_carry_the_familys_decoder_inputs(policies):
    from rlt2t.learner.stages import make_collate

    policy = policies["mbart"]  # its decoder starts from the target language code
    tok = policy.tokenizer
    collate = make_collate(tok.pad_token_id, policy.model.config)
    batch = collate([{"input_ids": tok("alpha")["input_ids"], "labels": tok("beta gamma")["input_ids"]}])
    labels = batch["labels"][0].tolist()
    assert batch["decoder_input_ids"][0].tolist() == [tok.convert_tokens_to_ids("en_XX"), *labels[:-1]]


def test_sinusoidal_positions_are_frozen(policies):
    for name in ("marian", "pegasus"):
        model = policies[name].model
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert not any("embed_positions" in n for n in trainable), name


def test_span_corruption_uses_the_familys_sentinels(policies):
    import random

    from rlt2t.common.tokenization import sentinel_ids
    from rlt2t.learner.noising import span_corruption

    tok = policies["t5"].tokenizer
    sentinels = sentinel_ids(tok)
    top = len(tok) - 1
    assert sentinels == list(range(top, top - 8, -1))  # T5's own <extra_id_0..7>, counting down
    assert tok.convert_ids_to_tokens(sentinels[:2]) == ["<extra_id_0>", "<extra_id_1>"]
    tokens = tok("alpha beta gamma delta epsilon zeta eta theta iota kappa", add_special_tokens=False)["input_ids"]
    inputs, labels = span_corruption(tokens, random.Random(0), noise_density=0.3, mean_span_length=2,
                                     sentinel_ids=sentinels, eos_id=tok.eos_token_id)
    assert labels[0] == inputs[inputs.index(sentinels[0])] == top  # <extra_id_0> opens the first span
    assert "<extra_id_0>" in tok.decode(inputs) and labels[-1] == tok.eos_token_id
    assert sentinel_ids(policies["pegasus"].tokenizer) == [policies["pegasus"].tokenizer.mask_token_id]
    assert sentinel_ids(policies["mbart"].tokenizer) == [policies["mbart"].tokenizer.mask_token_id]
    with pytest.raises(ValueError, match="pretrain.enabled=false"):
        sentinel_ids(policies["marian"].tokenizer)
