"""Evaluation across families: reference perplexity feeds the decoder as training does, with any family's
position limit; decoding ignores the decoding settings a checkpoint's generation config ships."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from rlt2t.common.collate import encode_examples
from rlt2t.common.config import EvalConfig, MetricConfig, ModelConfig
from rlt2t.common.data import Example
from rlt2t.common.policy import load_policy
from rlt2t.learner.evaluate import evaluate, generate, reference_perplexity
from rlt2t.learner.stages import make_collate

SOURCES = ["alpha beta gamma", "red green", "quick slow river stone"]
TARGETS = ["delta eta", "blue small large", "theta"]


def _training_ce(policy, sources, targets, max_target_len=32):
    """exp of the mean CE of one batch fed exactly as SFT feeds it (encode_examples + make_collate)."""
    enc = encode_examples(policy.tokenizer, sources, targets, 32, max_target_len)
    collate = make_collate(policy.tokenizer.pad_token_id, policy.model.config)
    batch = collate([{"input_ids": s, "labels": t} for s, t in zip(enc.sources, enc.targets, strict=True)])
    with torch.no_grad():
        return math.exp(policy.model.eval()(**batch).loss.item())


@pytest.mark.parametrize("family", ["t5", "encoder-decoder", "mbart", "bart"])
def test_reference_perplexity_is_the_training_cross_entropy(family_dirs, family):
    """T5 and warm starts have no max_position_embeddings (it raised AttributeError); mBART's own label shift
    starts from the language code, not the decoder start training uses."""
    langs = {"src_lang": "en_XX", "tgt_lang": "ro_RO"} if family == "mbart" else {}
    policy = load_policy(ModelConfig(preset=None, path=str(family_dirs[family]), dropout=0.0, **langs))
    ppl = reference_perplexity(policy, SOURCES, TARGETS, batch_size=8)
    assert ppl == pytest.approx(_training_ce(policy, SOURCES, TARGETS), rel=1e-5)


def test_perplexity_cuts_references_at_max_target_len(tiny_policy):
    sources, targets = ["1 2 3", "4 5"], ["3 2 1 9 8 7 6 5", "5 6"]
    cut = reference_perplexity(tiny_policy, sources, targets, max_target_len=4)
    assert cut == pytest.approx(_training_ce(tiny_policy, sources, targets, max_target_len=4), rel=1e-5)
    assert cut != pytest.approx(reference_perplexity(tiny_policy, sources, targets), rel=1e-4)
    examples = [Example(id=str(i), source=s, target=t) for i, (s, t) in enumerate(zip(sources, targets, strict=True))]
    cfg = EvalConfig(max_new_tokens=4, metrics=["perplexity"])
    result = evaluate(tiny_policy, examples, cfg, MetricConfig(), 32, max_target_len=4)
    assert result.metrics["perplexity"] == pytest.approx(cut, rel=1e-9)


def test_a_checkpoints_decoding_settings_do_not_reach_evaluation(family_dirs, tmp_path):
    """bart-base ships no_repeat_ngram_size=3 and min_length; the RL sampler ignores them, so must generate."""
    plain = family_dirs["bart"]
    shipped = tmp_path / "bart-settings"
    shutil.copytree(plain, shipped)
    gen_file = shipped / "generation_config.json"
    gen = json.loads(gen_file.read_text())
    gen.update(no_repeat_ngram_size=3, min_length=20, length_penalty=2.0, repetition_penalty=1.5)
    gen_file.write_text(json.dumps(gen))
    a = load_policy(ModelConfig(preset=None, path=str(plain), dropout=0.0))
    b = load_policy(ModelConfig(preset=None, path=str(shipped), dropout=0.0))
    assert b.model.generation_config.no_repeat_ngram_size in (None, 0)
    assert b.model.generation_config.min_length in (None, 0)
    ids = ("decoder_start_token_id", "eos_token_id", "pad_token_id", "bos_token_id", "forced_eos_token_id")
    assert {k: getattr(b.model.generation_config, k) for k in ids} == {k: getattr(a.model.config, k) for k in ids}
    sources = ["alpha beta gamma delta", "red green blue"]
    decoded = {beams: generate(b, sources, num_beams=beams, max_new_tokens=30) for beams in (1, 2)}
    for beams, texts in decoded.items():
        assert texts == generate(a, sources, num_beams=beams, max_new_tokens=30)
    assert decoded[1] != decoded[2], "these sources do not tell beam search from greedy decoding"
    # and the shipped settings would have changed the output had they reached generate
    hf = b.model.generate(**b.tokenizer(sources, return_tensors="pt", padding=True), num_beams=2, max_new_tokens=30,
                          no_repeat_ngram_size=3, min_length=20, length_penalty=2.0, repetition_penalty=1.5)
    assert b.tokenizer.batch_decode(hf, skip_special_tokens=True) != decoded[2]


def test_a_models_ban_on_rows_it_must_never_emit_is_kept(family_dirs, tmp_path):
    """opus-mt checkpoints ban <pad> (the row their decoder starts from) with bad_words_ids: that is part of the
    model, not a decoding preference, and survives while the checkpoint's other settings are dropped."""
    shipped = tmp_path / "marian-ban"
    shutil.copytree(family_dirs["marian"], shipped)
    gen_file = shipped / "generation_config.json"
    gen = json.loads(gen_file.read_text())
    gen.update(bad_words_ids=[[gen["pad_token_id"]]], num_beams=4)
    gen_file.write_text(json.dumps(gen))
    policy = load_policy(ModelConfig(preset=None, path=str(shipped), dropout=0.0))
    assert policy.model.generation_config.bad_words_ids == [[gen["pad_token_id"]]]
    assert policy.model.generation_config.num_beams in (None, 1)
