"""What a reward model's batch holds: each field (source, candidate) cut to its own limit, special tokens kept,
on both kinds; the candidate on a seq2seq decoder encoded with the target template; pairs within the limits
encoded as the tokenizer encodes them (so a saved model scores them as before)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, BertTokenizer, BertTokenizerLegacy

from rlt2t.common.reward_model import RewardModel, RewardModelSpec, init_reward_model, load_reward_model
from rlt2t.common.tokenization import save_tokenizer

WORDS = [f"w{i}" for i in range(40)]


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert-vocab") / "vocab.txt"
    path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    return path


def encoder_model(tok, max_source_len: int, max_candidate_len: int) -> RewardModel:
    torch.manual_seed(0)
    backbone = BertForSequenceClassification(BertConfig(
        vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=128, num_labels=1, pad_token_id=tok.pad_token_id, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)).eval()
    return RewardModel(backbone, tok, RewardModelSpec("encoder", max_source_len, max_candidate_len))


def text(first: int, n: int) -> str:
    return " ".join(WORDS[(first + i) % len(WORDS)] for i in range(n))


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "python"])
@pytest.mark.parametrize(("src_words", "cand_words"), [(30, 2), (30, 30), (3, 30), (3, 2), (6, 6)])
def test_encoder_pairs_cut_each_field_to_its_own_limit(vocab_file, slow, src_words, cand_words):
    """[CLS] source [SEP] candidate [SEP] with at most limit − 2 (the [CLS] … [SEP] of one text) content tokens of
    each field: a short candidate does not let the source run past its limit, a long source cuts no candidate
    token (one joint budget did both)."""
    tok = (BertTokenizerLegacy if slow else BertTokenizer)(str(vocab_file))
    assert tok.is_fast is not slow
    model = encoder_model(tok, max_source_len=8, max_candidate_len=6)
    src, cand = text(0, src_words), text(20, cand_words)
    batch = model.encode([src], [cand])
    ids = tok.convert_tokens_to_ids
    expected = [tok.cls_token_id, *ids(src.split()[:6]), tok.sep_token_id, *ids(cand.split()[:4]), tok.sep_token_id]
    assert batch["input_ids"][0].tolist() == expected
    assert batch["attention_mask"][0].tolist() == [1] * len(expected)
    if "token_type_ids" in batch:
        seg_a = 2 + min(src_words, 6)
        assert batch["token_type_ids"][0].tolist() == [0] * seg_a + [1] * (len(expected) - seg_a)


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "python"])
def test_encoder_pairs_within_the_limits_are_the_tokenizers_own_encoding(vocab_file, slow):
    """Pairs no longer than their limits are encoded exactly as before (``tok(sources, candidates)``, padded), so
    a saved encoder reward model scores them as it did; only over-long fields are now cut differently."""
    tok = (BertTokenizerLegacy if slow else BertTokenizer)(str(vocab_file))
    model = encoder_model(tok, max_source_len=8, max_candidate_len=8)
    sources, candidates = [text(0, 6), text(3, 1), text(9, 4)], [text(1, 2), text(5, 6), text(7, 1)]
    batch = model.encode(sources, candidates)
    plain = tok(sources, candidates, padding=True, return_tensors="pt")
    assert set(batch) == {k for k in ("input_ids", "attention_mask", "token_type_ids") if k in plain}
    for k, v in batch.items():
        assert torch.equal(v, plain[k]), k


def test_a_saved_encoder_reward_model_loads_and_scores_like_the_one_saved(vocab_file, tmp_path):
    tok = BertTokenizer(str(vocab_file))
    model = encoder_model(tok, max_source_len=8, max_candidate_len=6)
    sources, candidates = [text(0, 30), text(3, 2), text(3, 2)], [text(1, 2), text(5, 30), text(6, 3)]
    scores = model.score(sources, candidates)
    one_at_a_time = np.array([model.score([s], [c])[0] for s, c in zip(sources, candidates, strict=True)])
    np.testing.assert_allclose(scores, one_at_a_time, rtol=1e-5, atol=1e-6)  # padding changes nothing
    model.save_pretrained(tmp_path)
    save_tokenizer(tok, tmp_path)
    loaded = load_reward_model(tmp_path)
    assert loaded.spec == model.spec
    saved, again = model.encode(sources, candidates), loaded.encode(sources, candidates)
    assert saved.keys() == again.keys() and all(torch.equal(saved[k], again[k]) for k in saved)
    np.testing.assert_allclose(loaded.score(sources, candidates), scores, rtol=1e-5, atol=1e-7)


def test_seq2seq_fields_keep_their_own_limits_and_the_candidate_the_target_template(family_dirs):
    """mBART: the source as ``text </s> src_lang`` cut to max_source_len, the candidate as the policy's labels are,
    ``text </s> tgt_lang``, cut to max_candidate_len, after the decoder start."""
    model = init_reward_model(family_dirs["mbart"], max_source_len=6, max_candidate_len=5, dropout=0.0)
    tok = model.tokenizer
    tok.tgt_lang = "ro_RO"  # a target language other than the source's
    long = "alpha beta gamma delta epsilon zeta eta theta iota kappa"
    batch = model.encode([long, "red"], ["red", long])
    src = tok([long, "red"])["input_ids"]
    tgt = tok(text_target=["red", long])["input_ids"]
    assert tgt[0][-1] == tok.convert_tokens_to_ids("ro_RO") and src[0][-1] == tok.convert_tokens_to_ids("en_XX")
    assert len(src[0]) > 6 and len(tgt[1]) > 5
    start = model.backbone.config.decoder_start_token_id
    assert batch["input_ids"][0].tolist() == src[0][:4] + src[0][-2:]  # content cut, </s> en_XX kept
    assert batch["input_ids"][1, : len(src[1])].tolist() == src[1]
    assert batch["decoder_input_ids"][0, : 1 + len(tgt[0])].tolist() == [start, *tgt[0]]
    assert batch["decoder_input_ids"][1].tolist() == [start, *tgt[1][:3], *tgt[1][-2:]]  # </s> ro_RO kept
    assert batch["decoder_attention_mask"].sum(1).tolist() == [1 + len(tgt[0]), 6]
