"""Tests for rlt2t.common.synth: determinism, layout, splits, and the MLE-vs-metric property."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter

import pytest

from rlt2t.common.data import import_competition_csv, load_examples
from rlt2t.common.synth import (
    GENERATOR_VERSION,
    IN_ORDER_PROB,
    NUM_OPENERS,
    PHRASING_PROBS,
    PREFIX_PROB,
    SEPARATOR_TOKEN,
    build_spec,
    generate_synthetic,
    oracle_diagnosis,
    phrasing_usage,
    write_synthetic,
)


def _ids(text: str) -> list[int]:
    return [int(t) for t in text.split() if t != SEPARATOR_TOKEN]


def _parse_target(spec, target: str) -> list[tuple[int, int]]:
    """(concept, phrasing index) per concept in a diagnosis; fails on anything unexpected."""
    by_phrase = {p: (c, k) for c, phrasings in enumerate(spec.phrasings) for k, p in enumerate(phrasings)}
    tokens = _ids(target)
    if tokens and tokens[0] == spec.prefix:
        tokens = tokens[1:]
    chunks, current = [], []
    for t in tokens + [spec.connector]:
        if t == spec.connector:
            chunks.append(tuple(current))
            current = []
        else:
            current.append(t)
    return [by_phrase[chunk] for chunk in chunks]


@pytest.fixture(scope="module")
def spec():
    return build_spec()


@pytest.fixture(scope="module")
def sample():
    return generate_synthetic(4000, seed=11)


def test_write_is_byte_identical_for_same_arguments(tmp_path):
    for fmt in ("jsonl", "csv"):
        a = write_synthetic(tmp_path / f"a-{fmt}", 300, seed=5, fmt=fmt)
        b = write_synthetic(tmp_path / f"b-{fmt}", 300, seed=5, fmt=fmt)
        c = write_synthetic(tmp_path / f"c-{fmt}", 300, seed=6, fmt=fmt)
        for name in ("train", "valid", "test", "meta"):
            assert a[name].read_bytes() == b[name].read_bytes(), (fmt, name)
        assert a["train"].read_bytes() != c["train"].read_bytes()
        assert sorted(p.name for p in a["train"].parent.iterdir()) == sorted(
            [f"train.{fmt}", f"valid.{fmt}", f"test.{fmt}", "synth_meta.json"]
        )


def test_generate_is_deterministic(sample):
    assert generate_synthetic(4000, seed=11) == sample
    assert generate_synthetic(50, seed=12) != sample[:50]


def test_jsonl_and_csv_files_hold_the_generated_examples(tmp_path):
    examples = {e.id: e for e in generate_synthetic(200, seed=2)}
    seen: list[str] = []
    for fmt in ("jsonl", "csv"):
        paths = write_synthetic(tmp_path / fmt, 200, seed=2, valid_fraction=0.1, test_fraction=0.05, fmt=fmt)
        meta = json.loads(paths["meta"].read_text())
        assert meta["counts"] == {"train": 170, "valid": 20, "test": 10}
        assert (meta["size"], meta["seed"], meta["version"], meta["fmt"]) == (200, 2, GENERATOR_VERSION, fmt)
        ids_by_split = {}
        for name in ("train", "valid", "test"):
            loaded = load_examples(paths[name]) if fmt == "jsonl" else import_competition_csv(paths[name])
            assert loaded.report.skipped == 0
            assert len(loaded) == meta["counts"][name]
            assert all(examples[e.id] == e for e in loaded)
            ids_by_split[name] = [e.id for e in loaded]
        all_ids = sum(ids_by_split.values(), [])
        assert sorted(all_ids, key=int) == [str(i) for i in range(200)]  # disjoint and complete
        seen.append(json.dumps(ids_by_split))
    assert seen[0] == seen[1]  # same split whatever the format


def test_tiny_sizes_still_get_valid_and_test_rows(tmp_path):
    meta = json.loads(write_synthetic(tmp_path, 3, seed=0)["meta"].read_text())
    assert meta["counts"] == {"train": 1, "valid": 1, "test": 1}
    meta = json.loads(
        write_synthetic(tmp_path, 1, seed=0, valid_fraction=0, test_fraction=0)["meta"].read_text()
    )
    assert meta["counts"] == {"train": 1, "valid": 0, "test": 0}


def test_token_ids_stay_below_num_data_tokens(tmp_path):
    paths = write_synthetic(tmp_path, 500, seed=4, num_data_tokens=400, num_findings=20, num_concepts=10)
    meta = json.loads(paths["meta"].read_text())
    examples = [e for name in ("train", "valid", "test") for e in load_examples(paths[name])]
    used = [t for e in examples for t in _ids(e.source) + _ids(e.target)]
    assert max(used) == meta["max_token_id"] < 400 and min(used) >= 0
    assert all(e.target.strip() for e in examples)
    assert all(SEPARATOR_TOKEN in e.source for e in examples)


def test_spec_layout(spec):
    assert spec.num_findings == 48 and spec.num_concepts == 32
    assert len(set(spec.findings)) == 48 and all(2 <= len(p) <= 4 for p in spec.findings)
    for i, p in enumerate(spec.findings):
        for j, q in enumerate(spec.findings):
            if i != j:  # no phrase inside another, so a finding is recognised unambiguously
                assert not any(q[k : k + len(p)] == p for k in range(len(q) - len(p) + 1))
    assert sorted(set(spec.finding_concept)) == list(range(32))  # every concept reachable
    for a, *bs in spec.phrasings:  # A: one token of its own; B_1..B_5: 3 tokens sharing a 2-token suffix
        assert len(a) == 1 and len(bs) == NUM_OPENERS and all(len(b) == 3 for b in bs)
        assert len({b[1:] for b in bs}) == 1 and len({b[0] for b in bs}) == NUM_OPENERS
        assert a[0] not in {t for b in bs for t in b}
    assert len({p[0] for p in spec.phrasings}) == 32 and len({p[1][1:] for p in spec.phrasings}) == 32
    description_side = set(spec.filler) | set(spec.clinical) | {t for p in spec.findings for t in p}
    diagnosis_side = {spec.prefix, spec.connector} | {t for ps in spec.phrasings for p in ps for t in p}
    heads = {p[1][1] for p in spec.phrasings}
    assert description_side & diagnosis_side == heads  # findings mention their concept's head token y_c
    for phrase, concept in zip(spec.findings, spec.finding_concept, strict=True):
        assert spec.phrasings[concept][1][1] in phrase
    assert description_side | diagnosis_side <= set(range(1894))
    assert build_spec() == spec  # the layout does not depend on any data seed


def test_target_concepts_are_determined_by_description_findings(spec, sample):
    single = multi = in_order = 0
    for e in sample:
        expected = spec.concepts_of(spec.find_findings(_ids(e.source.split(SEPARATOR_TOKEN)[1])))
        got = [c for c, _ in _parse_target(spec, e.target)]
        assert sorted(got) == sorted(expected), e
        if len(expected) > 1:
            multi += 1
            in_order += got == expected
        else:
            single += 1
    assert single > 1000 and multi > 1000
    assert abs(in_order / multi - IN_ORDER_PROB) < 0.05


def test_most_frequent_phrasing_is_short_but_suffix_sharing_ones_win_together(spec, sample):
    counts = Counter(k for e in sample for _, k in _parse_target(spec, e.target))
    total = sum(counts.values())
    freq = [counts[k] / total for k in range(1 + NUM_OPENERS)]
    assert freq == pytest.approx(PHRASING_PROBS, abs=0.02)
    assert freq[0] > 2 * max(freq[1:])  # the single most likely phrasing is the short one, by far...
    assert sum(freq[1:]) > freq[0]  # ...but those that share a suffix are more likely together


def _length_normalised_mode(spec, concepts: list[int]) -> tuple[int, ...]:
    """The phrasings of the diagnosis a length-normalised beam search returns on a perfect model of the task: the
    argmax over every prefix choice, concept order and phrasing of log p / (tokens + EOS), as CTranslate2's
    ``length_penalty=1`` scores a finished hypothesis."""
    n = len(concepts)
    orders = list(itertools.permutations(range(n)))
    best = (-math.inf, ())
    for prefix in (False, True):
        for k, order in enumerate(orders):
            p_order = 1.0 if n == 1 else IN_ORDER_PROB if k == 0 else (1 - IN_ORDER_PROB) / (len(orders) - 1)
            for phrasings in itertools.product(range(1 + NUM_OPENERS), repeat=n):
                logp = math.log(PREFIX_PROB if prefix else 1 - PREFIX_PROB) + math.log(p_order)
                logp += sum(math.log(PHRASING_PROBS[j]) for j in phrasings)
                length = prefix + (n - 1) + sum(len(spec.phrasings[concepts[i]][j]) for i, j in zip(order, phrasings,
                                                                                                    strict=True)) + 1
                best = max(best, (logp / length, phrasings))
    return best[1]


def test_no_likelihood_decoding_prefers_the_metric_phrasings(spec, sample):
    # Greedy on a perfect model, first step: A's token against the prefix and each opener (no prefix: 1 - 0.2).
    p_a, *p_b = PHRASING_PROBS
    assert (1 - PREFIX_PROB) * p_a > 1.5 * max(PREFIX_PROB, (1 - PREFIX_PROB) * max(p_b))
    # A length-normalised beam on a perfect model says A for every concept, on rows of one, two and three
    # concepts (with five B phrasings at 0.12 it said B for about a third of them).
    seen = Counter()
    for e in sample[:120]:
        concepts = spec.concepts_of(spec.find_findings(_ids(e.source.split(SEPARATOR_TOKEN)[1])))
        seen[len(concepts)] += 1
        assert _length_normalised_mode(spec, concepts) == (0,) * len(concepts), e
    assert set(seen) == {1, 2, 3}


def _ngram_f1(candidate: list[str], reference: list[str], n: int) -> float:
    grams = lambda toks: Counter(tuple(toks[i : i + n]) for i in range(len(toks) - n + 1))  # noqa: E731
    c, r = grams(candidate), grams(reference)
    overlap = sum((c & r).values())
    if not overlap:
        return 0.0
    precision, recall = overlap / sum(c.values()), overlap / sum(r.values())
    return 2 * precision * recall / (precision + recall)


def test_metric_prefers_suffix_sharing_output_over_the_mode(spec, sample):
    # Stand-in for the task metric (not the metric itself): mean unigram/bigram F1 against the one
    # sampled reference. The sequence-level mode (phrasing A) must lose to phrasing B in expectation.
    mode_score = shared_score = 0.0
    for e in sample:
        ref = e.target.split()
        for phrasing in (0, 1):
            cand = oracle_diagnosis(spec, e.source, phrasing).split()
            score = (_ngram_f1(cand, ref, 1) + _ngram_f1(cand, ref, 2)) / 2
            if phrasing == 0:
                mode_score += score
            else:
                shared_score += score
    assert shared_score / len(sample) > mode_score / len(sample) + 0.03


def test_oracle_mode_is_the_most_frequent_whole_target(spec, sample):
    # Sequence level, pooled over concepts: a single-concept diagnosis equals oracle phrasing A (no
    # prefix) with probability 0.8 * 0.4 = 0.32, each B_j with 0.8 * 0.12 = 0.096.
    hits = Counter()
    single = 0
    for e in sample:
        if len(_parse_target(spec, e.target)) == 1:
            single += 1
            hits.update(k for k in range(1 + NUM_OPENERS) if e.target == oracle_diagnosis(spec, e.source, k))
    freq = [hits[k] / single for k in range(1 + NUM_OPENERS)]
    assert single > 1500
    assert freq == pytest.approx([(1 - PREFIX_PROB) * p for p in PHRASING_PROBS], abs=0.03)
    assert freq[0] > 2 * max(freq[1:])


def test_phrasing_usage_counts_what_the_targets_and_the_oracles_say(spec, sample):
    expected = Counter("A" if k == 0 else "B" for e in sample for _, k in _parse_target(spec, e.target))
    got = phrasing_usage(spec, [e.target for e in sample])
    assert {k: got[k] for k in "AB"} == {k: expected[k] for k in "AB"}
    assert got["other"] == 0 and got["outputs"] == len(sample)
    assert got["prefix"] == sum(_ids(e.target)[:1] == [spec.prefix] for e in sample)
    for phrasing in range(1 + NUM_OPENERS):
        name = "A" if phrasing == 0 else "B"
        oracle = phrasing_usage(spec, [oracle_diagnosis(spec, e.source, phrasing) for e in sample[:50]])
        assert oracle[name] > 0 and oracle["A"] + oracle["B"] == oracle[name] and oracle["prefix"] == 0
    # a head after a token that is not one of its concept's openers is not B
    b = spec.phrasings[0][1]
    other_opener = next(p[1][0] for p in spec.phrasings if p[1][0] not in {x[0] for x in spec.phrasings[0][1:]})
    assert phrasing_usage(spec, [f"{spec.connector} {b[1]} {b[2]}", f"{b[0]} {b[1]} {b[2]}",
                                 f"{other_opener} {b[1]} {b[2]}"]) == {
        "A": 0, "B": 1, "other": 2, "prefix": 0, "outputs": 3}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"size": 0}, "size"),
        ({"size": True}, "size"),
        ({"size": 2}, "size must be >= 3"),
        ({"seed": "1"}, "seed"),
        ({"valid_fraction": 1.0}, "valid_fraction"),
        ({"test_fraction": -0.1}, "test_fraction"),
        ({"fmt": "parquet"}, "fmt"),
        ({"num_data_tokens": 100}, "num_data_tokens"),
        ({"num_findings": 2}, "num_findings"),
        ({"num_concepts": 60}, "num_concepts"),
    ],
)
def test_write_validates_arguments(tmp_path, kwargs, match):
    args = {"size": 10, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        write_synthetic(tmp_path / "out", **args)
    assert not (tmp_path / "out" / "synth_meta.json").exists()


def test_generate_and_oracle_validate_arguments(spec):
    with pytest.raises(ValueError, match="size"):
        generate_synthetic(-1, seed=0)
    with pytest.raises(ValueError, match="phrasing"):
        oracle_diagnosis(spec, "<sep> 1 2", phrasing=1 + NUM_OPENERS)
