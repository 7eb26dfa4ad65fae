"""Tests for rlt2t.common.rerank: the IDF table and the three rerank modes, on hand-computed inputs."""

from __future__ import annotations

import math

import pytest

from rlt2t.common.metrics import CiderD, DocumentFrequency
from rlt2t.common.rerank import (
    IdfTable,
    consensus,
    idf_score,
    idf_weighted_mean,
    mean_logprob,
    mean_logprobs,
    rerank,
)

CORPUS = ["1 2 3", "1 2", "1 4", "5 6 1"]


def test_idf_table_counts_documents_not_occurrences(tmp_path):
    table = IdfTable.from_texts(CORPUS + ["7 7 7"], max_n=2)
    assert table.num_docs == 5
    assert table.df[("1",)] == 4 and table.df[("7",)] == 1 and table.df[("7", "7")] == 1
    assert table.idf(["1", "2"]) == pytest.approx(math.log(5 / 2))
    assert table.idf(["2", "1"]) is None  # never seen
    assert ("1", "2", "3") not in table.df  # beyond max_n
    table.save(tmp_path / "idf.json")
    assert IdfTable.load(tmp_path / "idf.json") == table
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not an IDF table"):
        IdfTable.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="texts is empty"):
        IdfTable.from_texts([])


def test_mean_logprob_is_length_normalised_and_averaged_over_scorers():
    candidates = ["1 2 3", "1"]
    # Scorer 0: sums -3.0 (4 positions) and -2.0 (2 positions): the longer one has the better mean.
    # Scorer 1 agrees less strongly; the average over scorers decides.
    logprobs = [[[-0.5, -0.5, -1.0, -1.0], [-1.0, -1.0]],
                [[-1.0, -1.0, -1.0, -1.0], [-0.5, -0.7]]]
    assert mean_logprobs(logprobs).tolist() == pytest.approx([(-0.75 - 1.0) / 2, (-1.0 - 0.6) / 2])
    assert mean_logprob(candidates, logprobs) == 1
    assert mean_logprob(candidates, logprobs[:1]) == 0
    with pytest.raises(ValueError, match=r"logprobs\[0\] has 1 entries for 2 candidates"):
        mean_logprob(candidates, [[[-1.0]]])


def test_idf_weighted_mean_formula():
    table = IdfTable.from_texts(CORPUS, max_n=2)  # N = 4
    idf = {g: table.idf(g.split()) for g in ("1", "2", "1 2", "3", "2 3")}
    lp = [-1.0, -2.0, -3.0, -0.5]
    w1 = (idf["1"] + idf["1 2"]) / 2
    w2 = (idf["2"] + idf["1 2"] + idf["2 3"]) / 3
    w3 = (idf["3"] + idf["2 3"]) / 2
    w_eos = (w1 + w2 + w3) / 3
    expected = (w1 * -1.0 + w2 * -2.0 + w3 * -3.0 + w_eos * -0.5) / (w1 + w2 + w3 + w_eos)
    assert idf_weighted_mean("1 2 3", lp, table) == pytest.approx(expected)
    # An unknown token ("9") gets the mean weight of the known positions, like the EOS.
    w2b = (idf["2"] + idf["2 3"]) / 2
    w3b = (idf["3"] + idf["2 3"]) / 2
    w_rest = (w2b + w3b) / 2
    expected = (w2b * -1.0 + w3b * -2.0 + w_rest * (-4.0 - 0.5)) / (w2b + w3b + 2 * w_rest)
    assert idf_weighted_mean("2 3 9", [-1.0, -2.0, -4.0, -0.5], table) == pytest.approx(expected)
    assert expected != pytest.approx(-7.5 / 4)  # the weights matter here


def test_idf_falls_back_to_plain_mean_without_division_by_zero():
    table = IdfTable.from_texts(CORPUS, max_n=2)
    assert idf_weighted_mean("8 9", [-1.0, -2.0, -3.0], table) == pytest.approx(-2.0)  # nothing known
    everywhere = IdfTable.from_texts(["1 2", "2 1"], max_n=1)  # idf = 0 for every known token
    assert idf_weighted_mean("1 2", [-1.0, -2.0, -6.0], everywhere) == pytest.approx(-3.0)
    assert idf_weighted_mean("", [-0.25], table) == pytest.approx(-0.25)  # EOS only
    with pytest.raises(ValueError, match="one log-prob per whitespace token plus the EOS"):
        idf_weighted_mean("1 2", [-1.0, -1.0], table)


def test_idf_with_subword_pieces_gives_every_piece_its_words_weight():
    table = IdfTable.from_texts(CORPUS, max_n=2)
    idf = {g: table.idf(g.split()) for g in ("1", "2", "1 2", "3", "2 3")}
    w1 = (idf["1"] + idf["1 2"]) / 2
    w2 = (idf["2"] + idf["1 2"] + idf["2 3"]) / 3
    w3 = (idf["3"] + idf["2 3"]) / 2
    w_special = (w1 + w2 + w3) / 3  # the mean over the known words, whatever the pieces
    # `<s> 1 2a 2b 3 </s>`: a leading BOS, word "2" in two pieces.
    lp = [-0.1, -1.0, -2.0, -0.5, -3.0, -0.5]
    words = [None, 0, 1, 1, 2, None]
    expected = ((w_special * -0.1 + w1 * -1.0 + w2 * (-2.0 - 0.5) + w3 * -3.0 + w_special * -0.5)
                / (2 * w_special + w1 + 2 * w2 + w3))
    assert idf_weighted_mean("1 2 3", lp, table, words) == pytest.approx(expected)
    # One piece per word then the EOS is the default, and gives the word-level score.
    word_level = [-1.0, -2.0, -3.0, -0.5]
    assert (idf_weighted_mean("1 2 3", word_level, table, [0, 1, 2, None])
            == pytest.approx(idf_weighted_mean("1 2 3", word_level, table)))
    # Equal IDF everywhere: the plain mean over the scored tokens, like mean_logprob.
    flat = IdfTable.from_texts(["1 2 3", "4"], max_n=1)
    assert idf_weighted_mean("1 2 3", lp, flat, words) == pytest.approx(sum(lp) / len(lp))
    with pytest.raises(ValueError, match="words has 5 entries for 6 log-probs"):
        idf_weighted_mean("1 2 3", lp, table, words[:-1])
    with pytest.raises(ValueError, match=r"word indices must be in \[0, 3\)"):
        idf_weighted_mean("1 2 3", lp, table, [None, 0, 1, 1, 3, None])
    assert idf_score(["1 2 3", "3 9"], [[lp, [-1.0, -1.0, -1.0]]], table,
                     [[words, [0, 1, None]]]) in (0, 1)


def test_idf_prefers_confidence_on_rare_tokens():
    table = IdfTable.from_texts(CORPUS, max_n=1)  # "1" is in every text (idf 0), "3" in one (idf log 4)
    candidates = ["1 3", "3 1"]
    # Same plain mean; candidate 1 is confident on the rare token, candidate 0 on the common one.
    logprobs = [[[-0.1, -3.0, -1.0], [-0.1, -1.0, -3.0]]]
    assert mean_logprob(candidates, logprobs) == 0  # tie: the earlier one
    assert idf_score(candidates, logprobs, table) == 1


def test_consensus_picks_the_candidate_the_others_agree_with():
    candidates = ["1 2 3 4", "1 2 3 5", "1 2 3 6", "7 8 9 10"]
    # The outlier has the best likelihood, but shares nothing with the others.
    logprobs = [[[-1.0] * 5, [-1.1] * 5, [-1.2] * 5, [-0.1] * 5]]
    df = DocumentFrequency.from_references([[t] for t in CORPUS + candidates])
    assert mean_logprob(candidates, logprobs) == 3
    chosen = consensus(candidates, logprobs, top=4, cider=CiderD(df=df))
    assert chosen == 0  # the three similar ones tie on agreement; the best log-prob among them wins
    assert consensus(candidates, logprobs, top=1) == 3  # one kept: plain likelihood
    assert consensus(candidates, logprobs, top=2, cider=CiderD(df=df)) == 3  # {3, 0} share nothing: tie
    with pytest.raises(ValueError, match="top must be >= 1"):
        consensus(candidates, logprobs, top=0)


def test_rerank_dispatch_and_errors():
    table = IdfTable.from_texts(CORPUS)
    logprobs = [[[-1.0, -1.0], [-0.5, -0.5]]]
    assert rerank("mean_logprob", ["1", "2"], logprobs) == 1
    assert rerank("idf", ["1", "2"], logprobs, table=table) == 1
    assert rerank("consensus", ["1", "2"], logprobs, top=2) == 1
    with pytest.raises(ValueError, match="needs an IdfTable"):
        rerank("idf", ["1", "2"], logprobs)
    with pytest.raises(ValueError, match="unknown mode 'best'"):
        rerank("best", ["1", "2"], logprobs)
    with pytest.raises(ValueError, match="candidates is empty"):
        mean_logprob([], [[]])
