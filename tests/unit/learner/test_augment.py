"""Tests for rlt2t.learner.augment: token deletion/repetition for SFT sources."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from rlt2t.learner.augment import augment_tokens


@pytest.mark.parametrize("rng", [np.random.default_rng(0), random.Random(0)])
def test_selection_rates(rng) -> None:
    n = 40_000
    tokens = list(range(n))  # distinct ids, so every token's fate can be read off the output
    out = augment_tokens(tokens, rng, prob=0.15)
    counts = Counter(out)  # per input id: 0 deleted, 1 untouched, 2..4 repeated
    # order is preserved: the output, with repeats collapsed, is the input minus deletions
    assert list(dict.fromkeys(out)) == [t for t in tokens if counts[t] > 0]
    deleted = sum(1 for t in tokens if counts[t] == 0) / n
    repeated = [counts[t] - 1 for t in tokens if counts[t] > 1]
    # expected: 0.15 * 0.5 each; binomial sd is about 0.0013, tolerances are > 4 sd
    assert deleted == pytest.approx(0.075, abs=0.006)
    assert len(repeated) / n == pytest.approx(0.075, abs=0.006)
    extra = Counter(repeated)
    assert set(extra) == {1, 2, 3}
    for k in (1, 2, 3):
        assert extra[k] / len(repeated) == pytest.approx(1 / 3, abs=0.04)


def test_delete_prob_and_max_repeat_parameters() -> None:
    tokens = list(range(5000))
    only_repeat = augment_tokens(tokens, random.Random(1), prob=0.5, delete_prob=0.0, max_repeat=1)
    counts = Counter(only_repeat)
    assert set(counts.values()) == {1, 2}  # nothing deleted, at most one extra copy
    assert counts.total() - len(tokens) == pytest.approx(2500, abs=200)

    only_delete = augment_tokens(tokens, random.Random(1), prob=0.5, delete_prob=1.0)
    assert len(only_delete) == pytest.approx(2500, abs=200)
    assert set(Counter(only_delete).values()) == {1}


def test_protected_ids_are_preserved_in_place() -> None:
    protected = {0, 1, 2}
    rng = np.random.default_rng(3)
    for _ in range(200):
        tokens = [0, *rng.integers(10, 50, size=20).tolist(), 2, 1, 2]
        out = augment_tokens(tokens, rng, prob=0.9, protected_ids=protected)
        assert [t for t in out if t in protected] == [t for t in tokens if t in protected]
        assert out[0] == 0 and out[-3:] == [2, 1, 2]


def test_never_empty() -> None:
    for seed in range(50):
        rng = random.Random(seed)
        assert augment_tokens([7], rng, prob=1.0, delete_prob=1.0) == [7]
        assert augment_tokens([7, 8, 9], rng, prob=1.0, delete_prob=1.0) == [7, 8, 9]
        assert augment_tokens([7, 8, 1], rng, prob=1.0, delete_prob=1.0, protected_ids={1}) == [1]
    assert augment_tokens([], random.Random(0)) == []


def test_prob_zero_is_identity_and_returns_a_copy() -> None:
    tokens = [5, 6, 7, 8]
    out = augment_tokens(tokens, random.Random(0), prob=0.0)
    assert out == tokens and out is not tokens


@pytest.mark.parametrize("make_rng", [np.random.default_rng, random.Random])
def test_deterministic_with_seeded_rng(make_rng) -> None:
    tokens = list(range(10, 200))
    a = augment_tokens(tokens, make_rng(42), prob=0.3)
    b = augment_tokens(tokens, make_rng(42), prob=0.3)
    c = augment_tokens(tokens, make_rng(43), prob=0.3)
    assert a == b != tokens
    assert a != c


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"prob": -0.1}, "prob"),
        ({"prob": 1.5}, "prob"),
        ({"max_repeat": 0}, "max_repeat"),
        ({"delete_prob": 2.0}, "delete_prob"),
    ],
)
def test_bad_arguments_are_named(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        augment_tokens([1, 2, 3], random.Random(0), **kwargs)


def test_bad_rng_type() -> None:
    with pytest.raises(TypeError, match="rng"):
        augment_tokens([1, 2, 3], 0)  # type: ignore[arg-type]
