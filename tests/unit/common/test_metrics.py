"""Tests for rlt2t.common.metrics.

Pinned numbers come from independent implementations run once in a scratch virtualenv (not a project
or test dependency): ``python -m venv /tmp/v && /tmp/v/bin/pip install pycocoevalcap==1.2 nltk==3.10.4``,
then on HYPS/REFS below:

- CIDEr-D: ``pycocoevalcap.cider.cider.Cider(sigma=s).compute_score(gts, res)`` with
  ``gts = {i: REFS[i]}``, ``res = {i: [HYPS[i]]}`` (its scorer splits on whitespace; the PTB tokenizer,
  which needs Java, was not used).
- ROUGE-L: ``pycocoevalcap.rouge.rouge.Rouge().compute_score(gts, res)``.
- BLEU-4: ``nltk.translate.bleu_score.sentence_bleu`` without smoothing (nltk returns ~1e-78 instead
  of 0 when an n-gram order has no match; both are 0 at the tolerance used).
"""

from __future__ import annotations

import math
import pickle
import warnings

import numpy as np
import pytest
import sacrebleu

from rlt2t.common import metrics
from rlt2t.common.metrics import (
    Bleu4,
    CiderD,
    DocumentFrequency,
    MeanLength,
    Metric,
    RougeL,
    TaskScore,
    available_metrics,
    compute_metrics,
    get_metric,
    register_metric,
)

TOL = 1e-6

# Integer-token texts like the competition's: an exact match (0), two-reference items (1, 3, 5), an empty
# hypothesis (2), a repeated token that clipping must not reward (3), a too-long hypothesis (4), one
# shorter than 4 tokens (5).
HYPS = [
    "12 7 401 9 33 5",
    "12 7 88 9 33",
    "",
    "4 19 250 3 3 3 61",
    "5 6 7 8 9 10 11 12 13 14",
    "301 302",
    "77 12 7 401 5 5 90 91 92",
]
REFS = [
    ["12 7 401 9 33 5"],
    ["12 7 401 9 33 5", "12 88 9 33 6 7"],
    ["4 4 19 250 3"],
    ["4 4 19 250 3", "19 250 3 61"],
    ["5 6 7 8 9 10 11 12"],
    ["301 302 303", "300 301 302 303 304"],
    ["77 12 7 401 5 90 91 92 93 94 95 96"],
]

# pycocoevalcap 1.2 Cider (see module docstring).
CIDER_SIGMA6 = [10.0, 3.0786374225756576, 0.0, 3.255665753023501, 8.030273500601698, 3.1274712226832047,
                5.217631782277663]  # fmt: skip
CIDER_SIGMA6_CORPUS = 4.672811383023103
CIDER_SIGMA15 = [10.0, 3.1147651947282586, 0.0, 3.503686948928171, 8.413901293654318, 3.2878159326774234,
                 5.795278981504949]  # fmt: skip
CIDER_SIGMA15_CORPUS = 4.873635478784732
# pycocoevalcap 1.2 Rouge.
ROUGE_L = [1.0, 0.7155425219941348, 0.0, 0.7648902821316614, 0.9070631970260222, 0.7721518987341772,
           0.7427701674277016]  # fmt: skip
ROUGE_L_CORPUS = 0.7003454381876709
# nltk 3.10.4 sentence_bleu, default weights (0.25,)*4, no smoothing.
BLEU4_SENTENCE = [1.0, 0.0, 0.0, 0.4671379777282001, 0.7598356856515925, 0.0, 0.5201870634468553]
# Corpus BLEU-4 by hand. Clipped matches per item (nltk's modified_precision numerators) and hypothesis
# n-gram totals max(0, len - n + 1):
#   n=1: matches 6+5+0+5+8+2+8 = 34 of 6+5+0+7+10+2+9 = 39
#   n=2: matches 5+3+0+4+7+1+7 = 27 of 33;  n=3: 4+1+0+2+6+0+5 = 18 of 27;  n=4: 3+0+0+1+5+0+3 = 12 of 22
# closest reference lengths 6+6+5+5+8+3+12 = 45 > 39 hypothesis tokens -> BP = exp(1 - 45/39).
# (nltk's corpus_bleu differs here because it counts a denominator of 1 for orders a short hypothesis
# lacks; on the items whose hypotheses all have >= 4 tokens it agrees, see BLEU4_CORPUS_LONG.)
BLEU4_CORPUS = math.exp(1 - 45 / 39) * (34 / 39 * 27 / 33 * 18 / 27 * 12 / 22) ** 0.25
LONG = [0, 1, 3, 4, 6]
BLEU4_CORPUS_LONG = 0.7109838445596988  # nltk 3.10.4 corpus_bleu on items LONG


def test_cider_d_matches_pycocoevalcap_sigma6():
    scorer = CiderD()  # default sigma = 6
    np.testing.assert_allclose(scorer.per_sample(HYPS, REFS), CIDER_SIGMA6, rtol=0, atol=TOL)
    assert scorer.corpus(HYPS, REFS) == pytest.approx(CIDER_SIGMA6_CORPUS, abs=TOL)


def test_cider_d_matches_pycocoevalcap_sigma15():
    scorer = CiderD(sigma=15.0)
    np.testing.assert_allclose(scorer.per_sample(HYPS, REFS), CIDER_SIGMA15, rtol=0, atol=TOL)
    assert scorer.corpus(HYPS, REFS) == pytest.approx(CIDER_SIGMA15_CORPUS, abs=TOL)


def test_cider_d_precomputed_df_equals_on_the_fly_df():
    df = DocumentFrequency.from_references(REFS)
    assert df.num_ref_sets == len(REFS)
    np.testing.assert_array_equal(CiderD(df=df).per_sample(HYPS, REFS), CiderD().per_sample(HYPS, REFS))


def test_cider_d_precomputed_df_makes_a_sample_independent_of_its_batch():
    # A sample's score depends only on its hypothesis, its references, N and df, so scoring a few
    # items against the df of the whole set must reproduce pycocoevalcap's whole-set scores.
    df = DocumentFrequency.from_references(REFS)
    scorer = CiderD(df=df)
    for idx in ([1], [3, 6], [0, 2, 4, 5]):
        got = scorer.per_sample([HYPS[i] for i in idx], [REFS[i] for i in idx])
        np.testing.assert_allclose(got, [CIDER_SIGMA6[i] for i in idx], rtol=0, atol=TOL)
    # Without a precomputed df the batch is the corpus: one item means log N = 0 and every weight 0.
    assert CiderD().per_sample(HYPS[:1], REFS[:1]).tolist() == [0.0]


def test_cider_d_accepts_a_saved_df_path(tmp_path):
    path = tmp_path / "df.json"
    DocumentFrequency.from_references(REFS).save(path)
    np.testing.assert_allclose(CiderD(df=str(path)).per_sample(HYPS, REFS), CIDER_SIGMA6, rtol=0, atol=TOL)


def test_document_frequency_counts_each_item_once():
    df = DocumentFrequency.from_references([["1 2 1", "1 3"], ["2 1"]])
    assert df.num_ref_sets == 2
    assert df.counts[("1",)] == 2  # in both items, three times in the first: counted once per item
    assert df.counts[("3",)] == 1
    assert df.counts[("1", "2")] == 1 and df.counts[("2", "1")] == 2
    assert df.counts[("1", "2", "1")] == 1
    assert ("4",) not in df.counts


def test_document_frequency_round_trips(tmp_path):
    df = DocumentFrequency.from_references(REFS)
    assert DocumentFrequency.from_json(df.to_json()) == df
    path = tmp_path / "sub" / "df.json"
    df.save(path)
    assert DocumentFrequency.load(path) == df
    clone = pickle.loads(pickle.dumps(df))
    assert clone == df and clone.idf == df.idf
    assert df != DocumentFrequency.from_references(REFS[:-1])


def test_document_frequency_rejects_bad_input():
    with pytest.raises(ValueError, match="format"):
        DocumentFrequency.from_json('{"num_ref_sets": 1, "df": {}}')
    with pytest.raises(ValueError, match="num_ref_sets"):
        DocumentFrequency(2, {("1",): 3})  # df larger than the number of reference sets
    with pytest.raises(ValueError, match="num_ref_sets"):
        DocumentFrequency(0, {})
    with pytest.raises(ValueError, match=r"refs\[1\]"):
        DocumentFrequency.from_references([["1"], []])
    with pytest.raises(TypeError, match="CiderD|df"):
        CiderD(df={"1": 1})


def test_bleu4_sentence_matches_nltk():
    per_sample = Bleu4().per_sample(HYPS, REFS)
    np.testing.assert_allclose(per_sample, BLEU4_SENTENCE, rtol=0, atol=TOL)
    # Scale is [0, 1]: sacrebleu's 0-100 value divided by 100.
    raw = sacrebleu.sentence_bleu(HYPS[3], REFS[3], smooth_method="none", use_effective_order=False).score
    assert per_sample[3] == pytest.approx(raw / 100.0, abs=1e-12)


def test_bleu4_corpus_matches_hand_computation_and_nltk():
    assert Bleu4().corpus(HYPS, REFS) == pytest.approx(BLEU4_CORPUS, abs=TOL)
    long_hyps, long_refs = [HYPS[i] for i in LONG], [REFS[i] for i in LONG]
    assert Bleu4().corpus(long_hyps, long_refs) == pytest.approx(BLEU4_CORPUS_LONG, abs=TOL)


def test_bleu4_smoothing_is_configurable():
    # Item 1 has no matching 4-gram: 0 without smoothing, positive with sacrebleu's "exp" smoothing.
    assert Bleu4().per_sample(HYPS[1:2], REFS[1:2])[0] == 0.0
    assert 0.0 < Bleu4(smooth_method="exp").per_sample(HYPS[1:2], REFS[1:2])[0] < 1.0
    with pytest.raises(ValueError, match="smooth_method"):
        Bleu4(smooth_method="laplace")
    with pytest.raises(ValueError, match="tokenize"):
        Bleu4(tokenize="no-such-tokenizer")
    with pytest.raises(ValueError, match="smooth_value must be a number or null, got '1e-2'"):
        Bleu4(smooth_method="floor", smooth_value="1e-2")  # type: ignore[arg-type]


def test_rouge_l_matches_pycocoevalcap():
    scorer = RougeL()
    np.testing.assert_allclose(scorer.per_sample(HYPS, REFS), ROUGE_L, rtol=0, atol=TOL)
    assert scorer.corpus(HYPS, REFS) == pytest.approx(ROUGE_L_CORPUS, abs=TOL)


def test_rouge_l_beta_by_hand():
    # hyp "1 2 3 4", ref "1 3 4 5 6": LCS "1 3 4" = 3, P = 3/4, R = 3/5.
    p, r, beta = 0.75, 0.6, 2.0
    expected = (1 + beta**2) * p * r / (r + beta**2 * p)
    assert RougeL(beta=beta).per_sample(["1 2 3 4"], [["1 3 4 5 6"]])[0] == pytest.approx(expected, abs=1e-12)


def test_rouge_l_takes_precision_and_recall_maxima_over_references_separately():
    # hyp "1 2 3 4"; ref A "1 2 9": LCS 2, P = 2/4, R = 2/3; ref B "1 2 3 7 8 9 10 11": LCS 3, P = 3/4,
    # R = 3/8. coco-caption combines max P = 3/4 (from B) with max R = 2/3 (from A).
    p, r, beta = 0.75, 2 / 3, 1.2
    expected = (1 + beta**2) * p * r / (r + beta**2 * p)
    got = RougeL().per_sample(["1 2 3 4"], [["1 2 9", "1 2 3 7 8 9 10 11"]])[0]
    assert got == pytest.approx(expected, abs=1e-12)


def test_chrf_scale_and_bounds():
    scorer = get_metric("chrf")
    per_sample = scorer.per_sample(HYPS, REFS)
    assert per_sample[0] == pytest.approx(1.0) and per_sample[2] == 0.0
    assert np.all((per_sample >= 0.0) & (per_sample <= 1.0))
    assert per_sample[3] == pytest.approx(sacrebleu.sentence_chrf(HYPS[3], REFS[3]).score / 100.0, abs=1e-12)
    assert 0.0 < scorer.corpus(HYPS, REFS) < 1.0


def test_task_score_is_the_weighted_combination():
    w = 1.0 / 3.0
    scorer = TaskScore()  # default bleu_weight = 1/3
    expected = (1 - w) * np.array(CIDER_SIGMA6) + w * np.array(BLEU4_SENTENCE)
    np.testing.assert_allclose(scorer.per_sample(HYPS, REFS), expected, rtol=0, atol=TOL)
    # Corpus: corpus CIDEr-D (mean over samples) mixed with corpus BLEU-4, not the mean of per_sample.
    assert scorer.corpus(HYPS, REFS) == pytest.approx(
        (1 - w) * CIDER_SIGMA6_CORPUS + w * BLEU4_CORPUS, abs=TOL
    )

    monitor = TaskScore(bleu_weight=0.0, sigma=15.0)
    np.testing.assert_allclose(monitor.per_sample(HYPS, REFS), CIDER_SIGMA15, rtol=0, atol=TOL)
    df = DocumentFrequency.from_references(REFS)
    only_bleu = TaskScore(bleu_weight=1.0, df=df)
    np.testing.assert_allclose(only_bleu.per_sample(HYPS, REFS), BLEU4_SENTENCE, rtol=0, atol=TOL)
    with pytest.raises(ValueError, match="bleu_weight"):
        TaskScore(bleu_weight=1.5)


def test_mean_length_counts_whitespace_tokens():
    scorer = MeanLength()
    assert scorer.per_sample(HYPS, REFS).tolist() == [6, 5, 0, 7, 10, 2, 9]
    assert scorer.corpus(HYPS, REFS) == pytest.approx(39 / 7)


@pytest.mark.parametrize("name", ["cider_d", "bleu4", "rouge_l", "chrf", "task_score", "mean_length"])
def test_every_builtin_metric_gives_one_float64_per_sample(name):
    metric = get_metric(name)
    assert isinstance(metric, Metric) and metric.name == name
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an empty hypothesis must not divide by zero anywhere
        per_sample = metric.per_sample(HYPS, REFS)
        assert per_sample.dtype == np.float64 and per_sample.shape == (len(HYPS),)
        assert per_sample[2] == 0.0  # the empty hypothesis
        assert np.isfinite(metric.corpus(HYPS, REFS))
        only_empty = metric.per_sample(["", ""], [["1 2 3"], [""]])
    assert only_empty.tolist() == [0.0, 0.0]
    assert metric.per_sample([], []).shape == (0,)
    with pytest.raises(ValueError, match="at least one sample"):
        metric.corpus([], [])


def test_registry_lookup_and_unknown_name():
    assert {"cider_d", "bleu4", "rouge_l", "chrf", "task_score", "mean_length"} <= set(available_metrics())
    assert get_metric("cider_d", sigma=15.0).corpus(HYPS, REFS) == pytest.approx(
        CIDER_SIGMA15_CORPUS, abs=TOL
    )
    with pytest.raises(ValueError, match="unknown metric 'cidr'.*bleu4.*cider_d"):
        get_metric("cidr")
    with pytest.raises(TypeError, match="cider_d"):
        get_metric("cider_d", sigmaa=15.0)


def test_custom_metric_registration(monkeypatch):
    monkeypatch.setattr(metrics, "_REGISTRY", dict(metrics._REGISTRY))  # keep the global registry clean

    @register_metric("exact_match")
    class ExactMatch:
        name = "exact_match"

        def __init__(self, strip: bool = True):
            self.strip = strip

        def per_sample(self, hyps, refs):
            return np.array([float(h in r) for h, r in zip(hyps, refs, strict=True)])

        def corpus(self, hyps, refs):
            return float(self.per_sample(hyps, refs).mean())

    assert "exact_match" in available_metrics()
    assert isinstance(get_metric("exact_match", strip=False), ExactMatch)
    table = compute_metrics(["exact_match", "cider_d"], HYPS, REFS, cider_d={"sigma": 15.0})
    assert table == pytest.approx({"exact_match": 1 / 7, "cider_d": CIDER_SIGMA15_CORPUS}, abs=TOL)
    with pytest.raises(ValueError, match="already registered"):
        register_metric("exact_match")(ExactMatch)
    register_metric("exact_match", replace=True)(MeanLength)
    assert isinstance(get_metric("exact_match"), MeanLength)


def test_compute_metrics_gives_corpus_values():
    table = compute_metrics(["cider_d", "bleu4", "rouge_l", "mean_length"], HYPS, REFS)
    assert table == pytest.approx(
        {
            "cider_d": CIDER_SIGMA6_CORPUS,
            "bleu4": BLEU4_CORPUS,
            "rouge_l": ROUGE_L_CORPUS,
            "mean_length": 39 / 7,
        },
        abs=TOL,
    )
    with pytest.raises(ValueError, match="not in names"):
        compute_metrics(["bleu4"], HYPS, REFS, cider_d={"sigma": 15.0})


@pytest.mark.parametrize("name", ["cider_d", "bleu4", "rouge_l", "chrf", "task_score", "mean_length"])
def test_input_validation(name):
    metric = get_metric(name)
    with pytest.raises(ValueError, match=r"len\(hyps\)=2, len\(refs\)=1"):
        metric.per_sample(["1", "2"], [["1"]])
    with pytest.raises(ValueError, match=r"refs\[1\] has no references"):
        metric.per_sample(["1", "2"], [["1"], []])
    with pytest.raises(TypeError, match=r"refs\[0\]"):
        metric.corpus(["1"], ["1"])  # a bare string where a list of references belongs
    with pytest.raises(TypeError, match=r"hyps\[0\]"):
        metric.per_sample([None], [["1"]])


def test_parameter_validation():
    with pytest.raises(ValueError, match="sigma"):
        CiderD(sigma=0.0)
    with pytest.raises(ValueError, match="beta"):
        RougeL(beta=-1.0)
