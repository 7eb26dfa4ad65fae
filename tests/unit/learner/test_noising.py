"""Tests for rlt2t.learner.noising: span corruption and the re-noising dataset."""

from __future__ import annotations

import random

import numpy as np
import pytest

from rlt2t.learner.noising import DenoisingDataset, span_corruption

EOS = 2
MASK = 3
SENTINELS = list(range(100, 120))  # data tokens below are drawn from [10, 100), so ids never collide


def reconstruct(input_ids: list[int], labels: list[int], sentinel_ids: list[int], eos_id: int) -> list[int]:
    """Invert span_corruption: put the i-th label span back where the i-th sentinel sits in the input."""
    assert input_ids[-1] == eos_id and labels[-1] == eos_id
    markers = set(sentinel_ids)
    spans: list[list[int]] = []
    for tok in labels[:-1]:
        if tok in markers:
            spans.append([])
        else:
            assert spans, "label must start with a sentinel"
            spans[-1].append(tok)
    out: list[int] = []
    span_iter = iter(spans)
    for tok in input_ids[:-1]:
        out.extend(next(span_iter) if tok in markers else [tok])
    assert next(span_iter, None) is None, "more label spans than sentinels in the input"
    return out


def noise_spans(input_ids: list[int], labels: list[int], sentinel_ids: list[int]) -> list[int]:
    """Lengths of the masked spans, read from the label."""
    lengths: list[int] = []
    for tok in labels[:-1]:
        if tok in sentinel_ids:
            lengths.append(0)
        else:
            lengths[-1] += 1
    return lengths


def random_text(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(10, 100) for _ in range(length)]


@pytest.mark.parametrize("make_rng", [lambda s: np.random.default_rng(s), lambda s: random.Random(s)])
def test_reconstructs_exactly_and_sentinels_in_order(make_rng) -> None:
    data_rng = random.Random(0)
    for seed in range(300):
        tokens = random_text(data_rng, data_rng.randint(2, 80))
        inp, lab = span_corruption(tokens, make_rng(seed), sentinel_ids=SENTINELS, eos_id=EOS)
        assert reconstruct(inp, lab, SENTINELS, EOS) == tokens
        used_in_input = [t for t in inp if t in SENTINELS]
        used_in_label = [t for t in lab if t in SENTINELS]
        assert used_in_input == used_in_label == SENTINELS[: len(used_in_input)]
        assert len(used_in_input) >= 1
        # a span is never adjacent to another (they would be one span), and never empty
        assert all(length >= 1 for length in noise_spans(inp, lab, SENTINELS))
        assert all(not (a in SENTINELS and b in SENTINELS) for a, b in zip(inp, inp[1:], strict=False))


def test_density_and_mean_span_length_statistics() -> None:
    data_rng = random.Random(1)
    rng = np.random.default_rng(1)
    total_tokens = total_noise = total_spans = 0
    span_lengths: list[int] = []
    first_masked = 0
    draws = 2000
    for _ in range(draws):
        tokens = random_text(data_rng, data_rng.randint(20, 200))
        inp, lab = span_corruption(tokens, rng, sentinel_ids=SENTINELS, eos_id=EOS)
        spans = noise_spans(inp, lab, SENTINELS)
        total_tokens += len(tokens)
        total_noise += sum(spans)
        total_spans += len(spans)
        span_lengths.extend(spans)
        first_masked += inp[0] in SENTINELS
    assert total_noise / total_tokens == pytest.approx(0.15, abs=0.005)
    assert total_noise / total_spans == pytest.approx(3.0, abs=0.1)
    # span lengths are random, not all equal to the mean
    assert min(span_lengths) == 1 and max(span_lengths) >= 8
    # the first token can be masked too, but spans are not glued to the start
    assert 0 < first_masked < draws // 2


def test_counts_follow_the_formula() -> None:
    tokens = [10 + i % 90 for i in range(100)]  # 100 tokens -> 15 noise tokens in round(15 / 3) = 5 spans
    for seed in range(20):
        inp, lab = span_corruption(tokens, random.Random(seed), sentinel_ids=SENTINELS, eos_id=EOS)
        spans = noise_spans(inp, lab, SENTINELS)
        assert sum(spans) == 15 and len(spans) == 5
        assert len(inp) == 100 - 15 + 5 + 1
        assert len(lab) == 15 + 5 + 1


def test_single_mask_id_mode() -> None:
    data_rng = random.Random(2)
    for seed in range(100):
        tokens = random_text(data_rng, data_rng.randint(30, 80))
        inp, lab = span_corruption(tokens, np.random.default_rng(seed), sentinel_ids=[MASK], eos_id=EOS)
        assert reconstruct(inp, lab, [MASK], EOS) == tokens
        num_spans = len(noise_spans(inp, lab, [MASK]))
        assert inp.count(MASK) == lab.count(MASK) == num_spans >= 1
        assert not set(inp) & set(SENTINELS)


def test_more_spans_than_sentinels_reuses_the_last() -> None:
    tokens = list(range(10, 90))  # 80 tokens -> 12 noise tokens, 4 spans, only 2 sentinels
    inp, lab = span_corruption(tokens, random.Random(0), sentinel_ids=[100, 101], eos_id=EOS)
    assert [t for t in inp if t >= 100] == [100, 101, 101, 101]
    assert [t for t in lab if t >= 100] == [100, 101, 101, 101]
    assert reconstruct(inp, lab, [100, 101], EOS) == tokens


def test_edge_lengths() -> None:
    rng = random.Random(0)
    assert span_corruption([], rng, sentinel_ids=SENTINELS, eos_id=EOS) == ([EOS], [EOS])
    assert span_corruption([42], rng, sentinel_ids=SENTINELS, eos_id=EOS) == ([42, EOS], [EOS])
    # length 2: exactly one token is masked, as one span
    seen = set()
    for seed in range(50):
        inp, lab = span_corruption([42, 43], random.Random(seed), sentinel_ids=SENTINELS, eos_id=EOS)
        seen.add((tuple(inp), tuple(lab)))
    assert seen == {((100, 43, EOS), (100, 42, EOS)), ((42, 100, EOS), (100, 43, EOS))}
    # length 3 at a high density: two noise tokens, one kept token
    for seed in range(50):
        inp, lab = span_corruption(
            [42, 43, 44], random.Random(seed), noise_density=0.6, sentinel_ids=SENTINELS, eos_id=EOS
        )
        assert reconstruct(inp, lab, SENTINELS, EOS) == [42, 43, 44]
        assert sum(noise_spans(inp, lab, SENTINELS)) == 2


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"noise_density": 0.0}, "noise_density"),
        ({"noise_density": 1.0}, "noise_density"),
        ({"mean_span_length": 0.5}, "mean_span_length"),
        ({"sentinel_ids": []}, "sentinel_ids"),
    ],
)
def test_bad_arguments_are_named(kwargs, name) -> None:
    args = {"sentinel_ids": SENTINELS, "eos_id": EOS, **kwargs}
    with pytest.raises(ValueError, match=name):
        span_corruption([10, 11, 12], random.Random(0), **args)


def test_bad_rng_type() -> None:
    with pytest.raises(TypeError, match="rng"):
        span_corruption([10, 11, 12], 0, sentinel_ids=SENTINELS, eos_id=EOS)  # type: ignore[arg-type]


def make_dataset(seed: int) -> DenoisingDataset:
    data_rng = random.Random(3)
    texts = [random_text(data_rng, 60) for _ in range(5)]
    return DenoisingDataset(texts, sentinel_ids=SENTINELS, eos_id=EOS, seed=seed)


def test_dataset_renoises_every_access_and_round_trips() -> None:
    ds = make_dataset(seed=7)
    assert len(ds) == 5
    draws = [ds[0] for _ in range(10)]
    assert len({tuple(d["input_ids"]) for d in draws}) > 5
    for d in draws:
        assert set(d) == {"input_ids", "labels"}
        assert reconstruct(d["input_ids"], d["labels"], SENTINELS, EOS) == ds.texts[0]
    assert ds[-1] is not None  # negative indices work like a list's
    with pytest.raises(IndexError):
        ds[5]


def test_dataset_reproducible_for_same_seed_and_differs_across_seeds_and_epochs() -> None:
    def run(ds: DenoisingDataset) -> list[list[int]]:
        out = []
        for epoch in range(2):
            ds.set_epoch(epoch)
            out.extend(ds[i]["input_ids"] for i in [3, 1, 3, 0])
        return out

    assert run(make_dataset(seed=7)) == run(make_dataset(seed=7))
    assert run(make_dataset(seed=7)) != run(make_dataset(seed=8))

    # resuming at epoch 1 in a new process draws what the uninterrupted run drew in epoch 1
    uninterrupted, resumed = make_dataset(seed=7), make_dataset(seed=7)
    for _ in range(3):
        uninterrupted[2]
    uninterrupted.set_epoch(1)
    resumed.set_epoch(1)
    assert [uninterrupted[2] for _ in range(3)] == [resumed[2] for _ in range(3)]

    # A fresh copy per epoch (non-persistent DataLoader workers): the epoch alone must change the noise.
    first, second = make_dataset(seed=7), make_dataset(seed=7)
    second.set_epoch(1)
    assert [first[i]["input_ids"] for i in range(5)] != [second[i]["input_ids"] for i in range(5)]


def test_dataset_validates_arguments() -> None:
    with pytest.raises(ValueError, match="sentinel_ids"):
        DenoisingDataset([[10, 11]], sentinel_ids=[], eos_id=EOS)
    with pytest.raises(ValueError, match="seed"):
        DenoisingDataset([[10, 11]], sentinel_ids=SENTINELS, eos_id=EOS, seed=-1)
    with pytest.raises(ValueError, match="epoch"):
        make_dataset(0).set_epoch(-1)


@pytest.mark.parametrize("length", [0, 1, 2, 7, 60])
def test_reconstruct_labels_the_whole_text_from_the_same_corrupted_input(length: int) -> None:
    tokens = random_text(random.Random(length), length)
    for seed in range(20):
        t5_input, t5_labels = span_corruption(tokens, random.Random(seed), sentinel_ids=SENTINELS, eos_id=EOS)
        inp, lab = span_corruption(tokens, random.Random(seed), sentinel_ids=SENTINELS, eos_id=EOS, reconstruct=True)
        assert inp == t5_input  # the same noise: only the label differs
        assert lab == [*tokens, EOS]
        assert reconstruct(inp, t5_labels, SENTINELS, EOS) == tokens
        if length >= 2:
            assert any(t in SENTINELS for t in inp)  # something is hidden, and the label still has all of it


def test_dataset_reconstruct_objective() -> None:
    data_rng = random.Random(3)
    texts = [random_text(data_rng, 60) for _ in range(5)]
    spans = DenoisingDataset(texts, sentinel_ids=SENTINELS, eos_id=EOS, seed=7)
    whole = DenoisingDataset(texts, sentinel_ids=SENTINELS, eos_id=EOS, seed=7, reconstruct=True)
    for i in range(5):
        a, b = spans[i], whole[i]
        assert a["input_ids"] == b["input_ids"]
        assert b["labels"] == [*texts[i], EOS] and a["labels"] != b["labels"]
