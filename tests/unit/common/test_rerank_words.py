"""Word-level IDF for subword scorers (rlt2t.common.rerank): a fast tokenizer's offsets map each scored token to its
whitespace word, every piece of a word gets the word's weight, and a slow tokenizer is refused naming itself."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import BertTokenizerLegacy, T5TokenizerFast

from rlt2t.common.rerank import (
    IdfTable,
    check_word_alignment,
    idf_token_weights,
    idf_weighted_mean,
    token_words,
)
from rlt2t.common.tokenization import build_ids_tokenizer

TRAIN = ["the cat sat", "the cat", "a mat", "the mat sat on a cat"]


def t5_unigram_tokenizer() -> T5TokenizerFast:
    """A sentencepiece-style unigram tokenizer of T5's kind (``▁`` marks a word start, template ``text </s>``), built
    in memory: ``the``, ``cat``, ``on``, ``mat`` are one piece each, ``sat`` is ``▁s at``, ``cats`` is ``▁cat s``, an
    unknown letter is ``▁ <unk>``."""
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    for i, piece in enumerate(["▁the", "▁cat", "▁s", "at", "▁on", "▁mat", "▁a", "s", "▁", "m", "a", "t", "c", "h",
                               "e", "o", "n"]):
        vocab.append((piece, -1.0 - 0.01 * i))
    tok = Tokenizer(models.Unigram(vocab, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>", extra_ids=0)


def test_every_piece_of_a_word_maps_to_that_word():
    tok = t5_unigram_tokenizer()
    texts = ["the cat sat", "cats  sat on", "x the", "mat", ""]
    pieces = [tok.convert_ids_to_tokens(ids) for ids in tok(texts)["input_ids"]]
    assert pieces[:2] == [["▁the", "▁cat", "▁s", "at", "</s>"], ["▁cat", "s", "▁", "▁s", "at", "▁on", "</s>"]]
    # A space piece belongs to the word after it; the EOS to no word.
    assert token_words(tok, texts) == [[0, 1, 2, 2, None], [0, 0, 1, 1, 1, 2, None], [0, 0, 1, None], [0, None],
                                       [None]]


def test_each_subword_token_gets_its_words_weight():
    tok = t5_unigram_tokenizer()
    table = IdfTable.from_texts(TRAIN, max_n=2)
    text = "the cats sat"  # ▁the | ▁cat s | ▁s at | </s>
    (words,) = token_words(tok, [text])
    assert words == [0, 1, 1, 2, 2, None]
    weights = idf_token_weights(text, table, words)
    per_word = idf_token_weights(text, table, [0, 1, 2, None])  # one token per word: the word's own weight
    assert weights is not None and per_word is not None
    assert weights.tolist() == pytest.approx([per_word[0], per_word[1], per_word[1], per_word[2], per_word[2],
                                              per_word[3]])
    # The words' weights differ (so the test tells pieces apart): "the" is in 3 of 4 texts, "sat" in 2.
    assert len({round(float(w), 9) for w in per_word[:3]}) == 3
    lp = [-0.2, -1.0, -3.0, -0.5, -0.7, -0.1]
    want = float(np.dot(weights, lp) / weights.sum())
    assert idf_weighted_mean(text, lp, table, words) == pytest.approx(want)
    assert want != pytest.approx(float(np.mean(lp)))  # the weights matter here


@pytest.mark.parametrize("which", ["ids", "unigram"])
def test_on_single_token_words_the_word_idf_equals_the_whitespace_tokenizers(which):
    """Where every word is one token and the template is ``text </s>``, the offsets give ``[0, ..., W - 1, None]``,
    the whitespace default, and the score is the whitespace tokenizer's."""
    if which == "ids":
        tok, texts, train = build_ids_tokenizer(20, num_sentinels=2), ["3 1 4", "1 5 9 2", "6"], \
            ["3 1", "1 5 9", "2 6 5", "3 5"]
    else:
        tok, texts, train = t5_unigram_tokenizer(), ["the cat on a mat", "a cat", "mat"], TRAIN
    table = IdfTable.from_texts(train, max_n=2)
    words = token_words(tok, texts)
    assert words == [[*range(len(t.split())), None] for t in texts]
    rng = np.random.default_rng(0)
    for text, w in zip(texts, words, strict=True):
        lp = (-rng.random(len(w)) * 3).tolist()
        assert idf_weighted_mean(text, lp, table, w) == pytest.approx(idf_weighted_mean(text, lp, table), abs=1e-12)


def test_a_slow_tokenizer_is_refused_naming_it_and_what_to_do(tmp_path):
    """A slow (Python) tokenizer silently ignores return_offsets_mapping: without the check, no word could be told."""
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "cat", "##s"]) + "\n")
    BertTokenizerLegacy(str(tmp_path / "vocab.txt")).save_pretrained(tmp_path / "scorer")
    slow = BertTokenizerLegacy.from_pretrained(str(tmp_path / "scorer"))
    assert not slow.is_fast and "offset_mapping" not in slow(["the cats"], return_offsets_mapping=True)
    for check in (lambda: check_word_alignment(slow), lambda: token_words(slow, ["the cats"])):
        with pytest.raises(ValueError, match=r"its tokenizer \(BertTokenizerLegacy from .*scorer\) is not a fast "
                                             r"tokenizer: it has no offset mapping.*tokenizer\.json.*or rerank "
                                             r"without it \(mean_logprob, consensus, mbr, reward\)"):
            check()
    check_word_alignment(t5_unigram_tokenizer())  # a fast one passes
