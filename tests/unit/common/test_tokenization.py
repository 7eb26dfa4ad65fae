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
    special = (tok.bos_token_id, tok.pad_token_id, tok.eos_token_id, tok.unk_token_id, tok.mask_token_id)
    assert special == (0, 1, 2, 3, 4)
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
    # What the vocabulary really holds, not what Python calls a digit (#16): full-width and superscript
    # digits, leading zeros and control characters Python splits on but the tokenizer does not.
    assert "not a non-negative integer" in check("１２ ７")
    assert "not a non-negative integer" in check("²")
    assert "not a non-negative integer" in check("1\x1c2")
    assert "leading zeros" in check("1 07")


@pytest.mark.parametrize("text", ["</s>", "1 <pad> 2", "12</s>7", "<s> 1", "<unk>", "<mask>", "<extra_id_1>"])
def test_special_tokens_other_than_the_separator_are_refused(text):
    """A target "</s>" would become ids [2, 2] and "<pad>" would be scored (#18): refused in every kind."""
    check = text_checker(build_ids_tokenizer(10, 2))
    problem = check(text)
    assert problem is not None and ("special token" in problem or "outside the vocabulary" in problem), problem
    assert check("1 <sep> 2") is None


def test_lone_surrogates_are_not_text():
    check = text_checker(build_ids_tokenizer(10, 2))
    assert check("1 \ud800 2") == "lone surrogate U+D800 at character 2: not Unicode text"


def test_subword_trains_saves_reloads_and_roundtrips(tmp_path):
    texts = ["the patient has a mild fever", "no fever and a dry cough", "the cough is mild"] * 30
    tok = train_subword_tokenizer(texts, vocab_size=400, num_sentinels=5)
    save_tokenizer(tok, tmp_path)
    again = load_tokenizer(tmp_path)
    assert tokenizer_kind(again) == "subword"
    check = text_checker(again)  # any text reads, but control tokens are still refused
    assert check("an unseen wörd ✓") is None and check("a <sep> b") is None
    assert "special token '</s>'" in check("a </s> b")
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


def test_a_tokenizer_file_with_its_own_fixed_padding_reads_texts(tmp_path):
    """all-MiniLM-L6-v2's tokenizer.json pads and truncates every text to 128 tokens: loaded, a text is its own
    tokens (the checker refused every text as "special token ''" for the padding)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "a": 2, "b": 3}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.enable_padding(pad_id=0, pad_token="[PAD]", length=8)
    raw.enable_truncation(max_length=3)
    PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    check = text_checker(tok)
    assert check("a b") is None and check("a b a b a") is None
    assert "special token '[PAD]'" in check("a [PAD] b")
    assert tok.backend_tokenizer.encode("a b a b a").ids == [2, 3, 2, 3, 2]


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(ValueError, match="tokenizer.path"):
        build_tokenizer("pretrained", num_data_tokens=1, num_sentinels=1, vocab_size=1)
    with pytest.raises(ValueError, match=r"vocab_size=100 leaves no room .* \(tokenizer.vocab_size: at least 363\)"):
        train_subword_tokenizer(["a b"], vocab_size=100)
    train_subword_tokenizer(["a b"], vocab_size=363)  # the least it names is enough


def test_the_data_loader_applies_the_same_rule(tmp_path):
    from rlt2t.common.data import DataError, load_examples

    path = tmp_path / "d.jsonl"
    path.write_text('{"id": 1, "source": "1 <sep> 2", "target": "3"}\n{"id": 2, "source": "4", "target": "</s>"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: field 'target': special token '</s>' is not allowed in a "
                                        r"text \(only '<sep>' is\)"):
        load_examples(path, check_text=text_checker(build_ids_tokenizer(10, 2)))
    path.write_text('{"id": 1, "source": "１２ ７", "target": "3"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:1: field 'source': token '１２' is not a non-negative integer"):
        load_examples(path, check_text=text_checker(build_ids_tokenizer(20, 2)))
