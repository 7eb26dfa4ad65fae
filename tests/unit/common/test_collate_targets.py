"""Targets are encoded with the target template: mBART's labels end with the target language, which the
decoder starts from; every other tokenizer encodes both sides alike."""

from __future__ import annotations

from rlt2t.common.collate import encode_examples, encode_texts
from rlt2t.common.config import ModelConfig
from rlt2t.common.policy import load_policy
from rlt2t.learner.stages import make_collate


def test_mbart_targets_use_the_target_language_template(family_dirs):
    policy = load_policy(ModelConfig(preset=None, path=str(family_dirs["mbart"]), dropout=0.0, src_lang="en_XX",
                                     tgt_lang="ro_RO"))
    tok = policy.tokenizer
    ro, en = tok.convert_tokens_to_ids("ro_RO"), tok.convert_tokens_to_ids("en_XX")
    enc = encode_examples(tok, ["alpha beta"], ["gamma delta"], 32, 32)
    assert enc.sources[0][-2:] == [tok.eos_token_id, en]
    assert enc.targets[0][-2:] == [tok.eos_token_id, ro]
    batch = make_collate(tok.pad_token_id, policy.model.config)([{"input_ids": enc.sources[0],
                                                                   "labels": enc.targets[0]}])
    assert batch["decoder_input_ids"][0].tolist() == [ro, *enc.targets[0][:-1]]
    cut, n = encode_texts(tok, ["gamma delta eta theta iota"], 4, target=True)
    assert n == 1 and len(cut[0]) == 4 and cut[0][-2:] == [tok.eos_token_id, ro]


def test_tokenizers_without_a_target_language_encode_targets_as_sources(tiny_policy):
    tok = tiny_policy.tokenizer
    texts = ["1 2 3", "4 5 6 7 8 9"]
    assert encode_texts(tok, texts, 4, target=True) == encode_texts(tok, texts, 4)
    enc = encode_examples(tok, texts, texts, 4, 4)
    assert enc.sources == enc.targets
