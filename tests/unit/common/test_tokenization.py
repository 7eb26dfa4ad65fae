from __future__ import annotations

import pytest

from rlt2t.common.tokenization import (
    build_ids_tokenizer,
    build_tokenizer,
    load_tokenizer,
    save_tokenizer,
    sentinel_ids,
    text_checker,
    tokenizer_kind,
    train_subword_tokenizer,
)


def test_ids_vocabulary_layout_matches_bart_specials_and_offset():
    tok = build_ids_tokenizer(num_data_tokens=1894, num_sentinels=100)
    assert len(tok) == 2000
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_id, tok.unk_token_id, tok.mask_token_id) == (0, 1, 2, 3, 4)
    assert tok.convert_tokens_to_ids("<sep>") == 5
    assert sentinel_ids(tok) == list(range(6, 106))
    # data token k <-> model id k + 106, EOS appended
    assert tok("0 7 1893")["input_ids"] == [106, 113, 1999, 2]
    assert tok("3 <sep> 4")["input_ids"] == [109, 5, 110, 2]


def test_ids_roundtrip_save_and_decode(tmp_path):
    tok = build_ids_tokenizer(50, 3)
    save_tokenizer(tok, tmp_path)
    again = load_tokenizer(tmp_path)
    assert tokenizer_kind(again) == "ids"
    ids = again("12 0 49")["input_ids"]
    assert ids == tok("12 0 49")["input_ids"]
    assert again.decode(ids, skip_special_tokens=True) == "12 0 49"
    assert sentinel_ids(again) == [6, 7, 8]


def test_text_checker_names_the_bad_token():
    check = text_checker(build_ids_tokenizer(10, 2))
    assert check("1 2 <sep> 9") is None
    assert "outside the vocabulary (0..9)" in check("1 10")
    assert "not a non-negative integer" in check("1 x")
    assert "not a non-negative integer" in check("-3")


def test_subword_trains_saves_reloads_and_roundtrips(tmp_path):
    texts = ["the patient has a mild fever", "no fever and a dry cough", "the cough is mild"] * 30
    tok = train_subword_tokenizer(texts, vocab_size=400, num_sentinels=5)
    save_tokenizer(tok, tmp_path)
    again = load_tokenizer(tmp_path)
    assert tokenizer_kind(again) == "subword"
    assert text_checker(again) is None
    ids = again("a dry fever")["input_ids"]
    assert ids[-1] == again.eos_token_id
    assert again.decode(ids, skip_special_tokens=True).strip() == "a dry fever"
    assert len(sentinel_ids(again)) == 5


def test_pretrained_directory_loads_through_build(tmp_path):
    save_tokenizer(build_ids_tokenizer(20, 2), tmp_path)
    tok = build_tokenizer("pretrained", num_data_tokens=0, num_sentinels=0, vocab_size=0, path=tmp_path)
    assert tok("3")["input_ids"] == [8 + 3, 2]


def test_tokenizer_without_sentinels_falls_back_to_mask(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1, "<mask>": 2, "a": 3}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", unk_token="<unk>", mask_token="<mask>")
    assert sentinel_ids(tok) == [2]


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(ValueError, match="tokenizer.path"):
        build_tokenizer("pretrained", num_data_tokens=1, num_sentinels=1, vocab_size=1)
    with pytest.raises(ValueError, match="vocab_size"):
        train_subword_tokenizer(["a b"], vocab_size=100)
