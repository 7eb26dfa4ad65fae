"""Tests for rlt2t.common.mbr: the batched utilities equal their metric pair by pair, and the MBR choice equals the
definitions of docs/design.md, "Minimum-Bayes-risk decoding", computed by brute force one pair at a time: uniform,
leave-one-out over the pool as drawn (duplicates as entries); probability, over the distinct texts, each candidate
included, at its normalised probability."""

from __future__ import annotations

import random

import numpy as np
import pytest

from rlt2t.common.mbr import (
    VECTORISED_METRICS,
    BleuUtility,
    CiderDUtility,
    MetricUtility,
    RewardUtility,
    TaskScoreUtility,
    check_pool_size,
    expected_utility,
    mbr_choice,
    mbr_over_entries,
    metric_utility,
    pair_utility,
    probability_weights,
    reads_references,
)
from rlt2t.common.metrics import Bleu4, CiderD, DocumentFrequency, SacreBleu, TaskScore, get_metric, register_metric
from rlt2t.common.rewards import MetricReward, RewardModelReward

ID_POOL = ["1 2 3 4 5", "1 2 3 4", "1 2 3 4 5", "7 8 9", "1 2 2 2 3 4", "", "5", "1 2 3 4 5 6 7 8", "2 3 4 5 1 2",
           "9 9 9 9 9"]
TEXT_POOL = ["The cat sat on the mat.", "the cat sat on a mat", "A cat sat, on the mat!", "Dogs bark.", "",
             "the the the cat", "The cat sat on the mat."]
TRAIN = [["1 2 3", "4 5"], ["1 2 9"], ["7 8 9 1"], ["5 6 7"], ["2 3 4 5 6"]]


def per_pair(metric, candidates):
    """The reference: one per_sample call per ordered pair."""
    n = len(candidates)
    return np.array([[metric.per_sample([candidates[i]], [[candidates[j]]])[0] for j in range(n)] for i in range(n)])


@pytest.mark.parametrize("metric", [
    Bleu4(),
    Bleu4(smooth_method="exp"),
    Bleu4(smooth_method="floor", smooth_value=0.1),
    Bleu4(smooth_method="add-k", smooth_value=1),
    Bleu4(effective_order=True),
    Bleu4(smooth_method="exp", effective_order=True),
], ids=["none", "exp", "floor", "add-k", "effective-order", "exp-effective-order"])
def test_batched_bleu_equals_sacrebleu_per_pair(metric):
    for pool in (ID_POOL, TEXT_POOL):
        assert BleuUtility.of(metric).matrix(pool) == pytest.approx(per_pair(metric, pool), abs=1e-12)


def test_batched_sacrebleu_equals_per_pair_with_its_tokenizer_and_lowercasing():
    for metric in (SacreBleu(), SacreBleu(lowercase=True)):
        assert BleuUtility.of(metric).matrix(TEXT_POOL) == pytest.approx(per_pair(metric, TEXT_POOL), abs=1e-12)


def test_batched_bleu_gives_partial_credit_where_it_should():
    # A sanity check that the equality above is not between two zero matrices.
    u = BleuUtility.of(Bleu4()).matrix(ID_POOL)
    assert u[0, 0] == pytest.approx(1.0) and 0 < u[1, 0] < 1 and u[3, 0] == 0.0


@pytest.mark.parametrize("sigma", [6.0, 15.0])
def test_batched_cider_equals_the_metric_per_pair_with_training_df(sigma):
    df = DocumentFrequency.from_references(TRAIN)
    metric = CiderD(sigma=sigma, df=df)
    want = per_pair(metric, ID_POOL)
    assert CiderDUtility.of(metric).matrix(ID_POOL) == pytest.approx(want, abs=1e-9)
    assert want.max() > 1.0  # not all zeros


def test_batched_cider_without_df_takes_the_distinct_pool_as_reference_sets():
    pool = ID_POOL[:5]
    df = DocumentFrequency.from_references([[c] for c in dict.fromkeys(pool)])
    assert CiderDUtility(6.0).matrix(pool) == pytest.approx(per_pair(CiderD(df=df), pool), abs=1e-9)


@pytest.mark.parametrize("weight", [0.0, 1 / 3, 1.0])
def test_batched_task_score_equals_the_metric_per_pair(weight):
    metric = TaskScore(bleu_weight=weight, df=DocumentFrequency.from_references(TRAIN))
    utility = pair_utility(metric)
    assert isinstance(utility, TaskScoreUtility)
    assert utility.matrix(ID_POOL) == pytest.approx(per_pair(metric, ID_POOL), abs=1e-9)


def test_other_metrics_and_reference_rewards_score_all_pairs_in_one_call():
    calls = []

    class Counting:
        name = "rouge_l"

        def per_sample(self, hyps, refs):
            calls.append(len(hyps))
            return get_metric("rouge_l").per_sample(hyps, refs)

        def corpus(self, hyps, refs):
            raise AssertionError("not used")

    utility = pair_utility(Counting())
    assert isinstance(utility, MetricUtility)
    assert utility.matrix(ID_POOL) == pytest.approx(per_pair(get_metric("rouge_l"), ID_POOL))
    assert calls == [len(ID_POOL) ** 2]
    reward = pair_utility(MetricReward(get_metric("rouge_l")))
    assert isinstance(reward, RewardUtility)
    assert reward.matrix(ID_POOL, "src") == pytest.approx(per_pair(get_metric("rouge_l"), ID_POOL))


def test_a_reference_free_reward_is_refused_as_utility():
    reward = RewardModelReward.__new__(RewardModelReward)  # needs_references is a class attribute: no model needed
    with pytest.raises(ValueError, match="read no references"):
        RewardUtility(reward)


def brute_force_uniform(metric, entries):
    """The uniform definition over the pool as drawn (duplicates as separate entries), leave-one-out:
    E(e_i) = Σ_{j≠i} u(e_i, e_j) / (N − 1), 0 for one entry; argmax with ties to the lower index."""
    n = len(entries)
    best, best_e = 0, -np.inf
    for i in range(n):
        e = sum(metric.per_sample([entries[i]], [[entries[j]]])[0] for j in range(n) if j != i) / (n - 1) if n > 1 \
            else 0.0
        if e > best_e + 1e-12:  # equal up to rounding (duplicates summed in another order) is a tie
            best, best_e = i, e
    return best, best_e


def brute_force_probability(metric, entries, logp):
    """The model-weighted definition over the distinct texts y, h itself included, no counts:
    E(h) = Σ_y p(y) u(h, y), p(y) = exp(logp[y]) / Σ_y' exp(logp[y']); returns (the chosen entry, E per text)."""
    texts = list(dict.fromkeys(entries))
    z = sum(np.exp(logp[y]) for y in texts)
    e = {h: sum(np.exp(logp[y]) / z * metric.per_sample([h], [[y]])[0] for y in texts) for h in texts}
    best = texts[0]
    for h in texts:
        if e[h] > e[best] + 1e-12:
            best = h
    return entries.index(best), e


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("weighted", [False, True])
def test_mbr_choice_equals_brute_force_on_small_pools_with_duplicates(seed, weighted):
    rng = random.Random(seed)
    vocab = ["1", "2", "3", "4", "5"]
    distinct = list(dict.fromkeys(" ".join(rng.choices(vocab, k=rng.randint(1, 6))) for _ in range(6)))
    entries = [rng.choice(distinct) for _ in range(rng.randint(2, 9))]
    texts = list(dict.fromkeys(entries))  # the deduplicated pool predict keeps, first occurrence first
    metric = TaskScore(df=DocumentFrequency.from_references(TRAIN))
    utility = pair_utility(metric).matrix(texts)
    if weighted:
        logp = {t: rng.uniform(-6.0, -0.5) for t in texts}
        want_entry, want = brute_force_probability(metric, entries, logp)
        got, scores = mbr_choice(utility, probability_weights([logp[t] for t in texts]))
        assert scores == pytest.approx([want[t] for t in texts], abs=1e-9)
    else:
        want_entry, want_e = brute_force_uniform(metric, entries)
        got, scores = mbr_choice(utility, counts=np.array([entries.count(t) for t in texts]))
        assert scores[got] == pytest.approx(want_e, abs=1e-9)
    assert texts[got] == entries[want_entry]
    assert entries.index(texts[got]) == want_entry  # the same entry: its first occurrence


def test_probability_weights_count_the_candidate_itself_and_not_its_copies():
    u = np.array([[1.0, 0.2], [0.2, 1.0]])
    # Two distinct candidates: leave-one-out would give both 0.2 whatever the weights; the model-weighted
    # expectation includes each candidate's own probability.
    assert mbr_choice(u, np.array([0.9, 0.1]))[1] == pytest.approx([0.92, 0.28])
    assert mbr_choice(u, np.array([0.1, 0.9]))[0] == 1
    # Copies are not counted on top of the probability (the uniform mode counts them).
    with pytest.raises(ValueError, match="probability weights take no counts"):
        expected_utility(u, weights=np.array([0.5, 0.5]), counts=np.array([3, 1]))
    assert mbr_choice(u, counts=np.array([1, 3]))[0] == 1


def test_probability_weights_that_underflow_to_zero_are_accepted():
    # 1000 nats apart: exp(-1000) is exactly 0.0 in float64.
    w = probability_weights([-1.0, -1001.0, -2001.0])
    assert w.tolist() == [1.0, 0.0, 0.0]
    u = np.array([[1.0, 0.9, 0.0], [0.3, 1.0, 0.5], [0.2, 0.8, 1.0]])
    best, scores = mbr_choice(u, w)
    assert best == 0 and scores.tolist() == [1.0, 0.3, 0.2]  # U[:, 0]: all the mass on candidate 0
    chosen, per_entry = mbr_over_entries(["1 2 3 4", "5 6 7 8", "1 2 3 4"], BleuUtility.of(Bleu4()),
                                         [-5000.0, -0.5, -5000.0])
    assert chosen == 1 and per_entry == pytest.approx([0.0, 1.0, 0.0])


def test_ties_go_to_the_lower_index_and_a_single_entry_scores_zero():
    assert mbr_choice(np.ones((3, 3)))[0] == 0
    u = np.array([[1.0, 0.2, 0.5], [0.2, 1.0, 0.5], [0.5, 0.5, 1.0]])
    assert mbr_choice(u)[0] == 2  # agrees with both others
    assert mbr_choice(u, counts=np.array([1, 3, 1]))[0] == 1  # three copies of 1: it agrees with itself twice
    assert expected_utility(np.array([[1.0]])).tolist() == [0.0]
    assert expected_utility(np.array([[1.0]]), counts=np.array([2])).tolist() == [1.0]


def test_expected_utility_refuses_malformed_input():
    with pytest.raises(ValueError, match="square"):
        expected_utility(np.ones((2, 3)))
    with pytest.raises(ValueError, match="weights need one entry per candidate"):
        expected_utility(np.ones((2, 2)), weights=np.ones(3))
    with pytest.raises(ValueError, match="counts need one entry per candidate"):
        expected_utility(np.ones((2, 2)), counts=np.ones(3))
    for bad in ([0.0, 0.0], [1.0, -0.5], [1.0, float("nan")], [float("inf"), 1.0]):
        with pytest.raises(ValueError, match="finite and >= 0, at least one > 0"):
            expected_utility(np.ones((2, 2)), weights=np.array(bad))
    with pytest.raises(ValueError, match="counts must be >= 1"):
        expected_utility(np.ones((2, 2)), counts=np.array([1, 0]))
    with pytest.raises(ValueError, match="must be finite"):
        probability_weights([0.0, float("-inf")])


def test_pool_cap_names_the_config_key():
    check_pool_size(64, 64, "predict.max_pool")
    with pytest.raises(ValueError, match=r"MBR pool of 65 candidates for input 'a' is over predict.max_pool=64: "
                                         r".*4225 utilities.* raise predict.max_pool"):
        check_pool_size(65, 64, "predict.max_pool", " for input 'a'")


def test_mbr_over_entries_equals_the_deduplicated_pool_and_the_brute_force():
    metric = TaskScore(df=DocumentFrequency.from_references(TRAIN))
    entries = ["1 2 3", "1 2", "1 2 3", "4 5", "1 2", "1 2 3 4"]
    logps = [-1.0, -2.0, -1.0, -0.5, -2.0, -3.0]
    chosen, per_entry = mbr_over_entries(entries, pair_utility(metric))
    want, want_e = brute_force_uniform(metric, entries)
    assert chosen == want and per_entry[chosen] == pytest.approx(want_e)
    assert per_entry[0] == per_entry[2] and per_entry[1] == per_entry[4]  # an entry scores as its text
    chosen, per_entry = mbr_over_entries(entries, pair_utility(metric), logps)
    want, by_text = brute_force_probability(metric, entries, dict(zip(entries, logps, strict=True)))
    assert chosen == want and per_entry == pytest.approx([by_text[e] for e in entries], abs=1e-9)
    with pytest.raises(ValueError, match="2 log-probs for 6 entries"):
        mbr_over_entries(entries, pair_utility(metric), [0.0, 0.0])


DEGENERATE = " ".join(["7"] * 64)


@pytest.mark.parametrize("metric", [Bleu4(), Bleu4(smooth_method="exp", effective_order=True), SacreBleu(),
                                    CiderD(df=DocumentFrequency.from_references(TRAIN)),
                                    TaskScore(df=DocumentFrequency.from_references(TRAIN))],
                         ids=["bleu4", "bleu4-exp", "sacrebleu", "cider_d", "task_score"])
def test_batched_utilities_equal_the_metric_on_repeated_token_texts(metric):
    # A degenerate sample repeats one token: its unigram count is 64, its n-gram counts 61..64, beside texts
    # with a few repeats and none. Clipped counts are summed over passes t = 1..64 on the n-grams held t times.
    pool = [DEGENERATE, "7 7 7 8", "7 8 9", " ".join(["7"] * 10), "7 7 7 7 7 8 8 8 8", "1 2 3", DEGENERATE + " 8"]
    assert pair_utility(metric).matrix(pool) == pytest.approx(per_pair(metric, pool), abs=1e-9)
    assert pair_utility(metric).matrix(pool)[0, 3] > 0  # partial credit: 10 of 64 clipped sevens


@pytest.mark.parametrize("name", ["mean_length", "max_length", "distinct_1", "distinct_2"])
def test_a_metric_that_reads_no_reference_is_refused_as_utility(name):
    assert not reads_references(get_metric(name))
    with pytest.raises(ValueError, match=rf"predict.mbr_utility='{name}': this metric reads no references"):
        metric_utility(name, "predict.mbr_utility")


def test_a_metric_that_cannot_be_built_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"serve.mbr_utility='classifier_accuracy': the metric cannot be built .*"
                                         r"TypeError.*path"):
        metric_utility("classifier_accuracy", "serve.mbr_utility")
    with pytest.raises(ValueError, match=r"k='meteor': the metric cannot be built .*FileNotFoundError.*WordNet"):
        metric_utility("meteor", "k", wordnet_dir=str(tmp_path / "no-wordnet"))

    class Broken:
        name = "broken"

        def per_sample(self, hyps, refs):
            raise RuntimeError("no model")

        def corpus(self, hyps, refs):
            return 0.0

    register_metric("broken_for_mbr_test", replace=True)(Broken)
    with pytest.raises(ValueError, match=r"k='broken_for_mbr_test': the metric fails on a probe pair "
                                         r"\(RuntimeError: no model\)"):
        metric_utility("broken_for_mbr_test", "k")


@pytest.mark.parametrize("name", ["bleu4", "sacrebleu", "cider_d", "task_score", "rouge_l", "chrf"])
def test_metrics_that_read_references_are_built_as_utilities(name):
    utility = metric_utility(name, "k")
    assert utility.matrix(["1 2 3 4 5", "1 2 3 4 5", "6 7 8"])[0, 1] > utility.matrix(["1 2 3 4 5", "6 7 8"])[0, 1]
    assert (type(utility).__name__ != "MetricUtility") == (name in VECTORISED_METRICS)
