"""Span corruption for denoising pretraining (docs/design.md, "The method", step 3).

A fraction of the tokens (noise density, 0.15) is masked in contiguous spans (mean length 3). Each span
is replaced in the input by one sentinel id. The label is one of two objectives (``pretrain.objective``):

    tokens  = a b c d e f g h
    input   = a <s0> d e <s1> h </s>
    labels  = a b c d e f g h </s>            reconstruct: the whole text (BART's text infilling)
    labels  = <s0> b c <s1> f g </s>          span_corruption: span by span, the sentinel and what it hides (T5's)

Span corruption (the default) has short labels and is what a pretrained T5 was trained with; reconstruction
trains the decoder on every token, copying what the encoder sees, and is what a pretrained BART was trained with.

`DenoisingDataset` wraps pre-tokenized texts and draws fresh noise on every access, reproducibly from a
base seed. The sentinel ids come from `rlt2t.common.tokenization.sentinel_ids`: the tokenizer's own
``<extra_id_N>`` where the family has them (T5's, counting down from the top of its vocabulary), the
project's ``<extra_id_N>`` for its own tokenizers, a single mask token otherwise (BART, mBART, Pegasus).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import torch

RandomSource = np.random.Generator | random.Random


def _sample_distinct(rng: RandomSource, population: int, k: int) -> list[int]:
    """k distinct integers drawn uniformly from range(population), in random order."""
    if isinstance(rng, np.random.Generator):
        return rng.choice(population, size=k, replace=False).tolist()
    if isinstance(rng, random.Random):
        return rng.sample(range(population), k)
    raise TypeError(f"rng must be a numpy.random.Generator or random.Random, got {type(rng).__name__}")


def _random_composition(rng: RandomSource, total: int, parts: int) -> list[int]:
    """Split `total` into `parts` positive integers summing to `total`, uniformly over all such splits.

    Choosing parts - 1 distinct cut points among the total - 1 gaps between unit items gives every
    composition the same probability ("stars and bars").
    """
    cuts = sorted(c + 1 for c in _sample_distinct(rng, total - 1, parts - 1))
    bounds = [0, *cuts, total]
    return [hi - lo for lo, hi in zip(bounds, bounds[1:], strict=False)]


def _check_noise_params(noise_density: float, mean_span_length: float, sentinel_ids: Sequence[int]) -> None:
    if not 0.0 < noise_density < 1.0:
        raise ValueError(f"noise_density must be in (0, 1), got {noise_density}")
    if not mean_span_length >= 1.0:
        raise ValueError(f"mean_span_length must be >= 1, got {mean_span_length}")
    if len(sentinel_ids) == 0:
        raise ValueError(
            "sentinel_ids must hold at least one id (pass [mask_id] for a tokenizer without sentinels)"
        )


def span_corruption(
    tokens: Sequence[int],
    rng: RandomSource,
    *,
    noise_density: float = 0.15,
    mean_span_length: float = 3.0,
    sentinel_ids: Sequence[int],
    eos_id: int,
    reconstruct: bool = False,
) -> tuple[list[int], list[int]]:
    """Mask random spans of `tokens`; return (input_ids, labels), both ending with `eos_id`.

    The labels are the masked spans after their sentinels (T5's objective), or with ``reconstruct`` the whole of
    `tokens` (BART's); the input and the random draws are the same either way.

    Counts, for n = len(tokens) >= 2:
      - noise tokens: round(n * noise_density) clamped to [1, n - 1] (Python's round, half to even, the same
        rounding numpy and T5 use);
      - spans: max(1, round(noise / mean_span_length)), further capped so that every span holds at least
        one token and consecutive spans are separated by at least one kept token (otherwise two spans
        would merge into one).
    The noise count is split into span lengths, and the kept count into the gaps around the spans, by
    uniformly random compositions. The gap before the first span and after the last may be empty, so the
    first and last tokens can be masked too.

    Sentinels are used in order: span i gets sentinel_ids[i]. When there are more spans than sentinels the
    last sentinel is reused for the remaining spans; the label stays decodable because spans appear in
    the same order in input and label. This is also how single-mask mode works: a tokenizer without
    sentinel tokens (pretrained BART) passes `[mask_id]`, and every span is marked with that one id.

    Sequences of length 0 or 1 are returned unmasked (input = tokens + [eos], labels = [eos], or tokens + [eos]
    with ``reconstruct``): masking the only token would leave an input with no information, and "no sentinel in
    the input, so the label is just EOS" is consistent with the format.

    `tokens` must not contain the sentinel ids or `eos_id` (not checked, to keep the per-sample cost low).
    """
    _check_noise_params(noise_density, mean_span_length, sentinel_ids)
    n = len(tokens)
    if n <= 1:
        return [*tokens, eos_id], [*tokens, eos_id] if reconstruct else [eos_id]

    num_noise = min(max(round(n * noise_density), 1), n - 1)
    num_keep = n - num_noise
    num_spans = max(1, round(num_noise / mean_span_length))
    # Each span needs >= 1 noise token, and the num_spans - 1 inner gaps need >= 1 kept token each.
    num_spans = min(num_spans, num_noise, num_keep + 1)

    span_lengths = _random_composition(rng, num_noise, num_spans)
    # num_spans + 1 gaps; the outer two may be empty: draw positive parts of num_keep + 2, then take one off
    # each outer gap.
    gaps = _random_composition(rng, num_keep + 2, num_spans + 1)
    gaps[0] -= 1
    gaps[-1] -= 1

    input_ids: list[int] = []
    labels: list[int] = []
    pos = 0
    last_sentinel = len(sentinel_ids) - 1
    for i, span_length in enumerate(span_lengths):
        input_ids.extend(tokens[pos : pos + gaps[i]])
        pos += gaps[i]
        sentinel = sentinel_ids[min(i, last_sentinel)]
        input_ids.append(sentinel)
        labels.append(sentinel)
        labels.extend(tokens[pos : pos + span_length])
        pos += span_length
    input_ids.extend(tokens[pos:])
    input_ids.append(eos_id)
    if reconstruct:
        return input_ids, [*tokens, eos_id]
    labels.append(eos_id)
    return input_ids, labels


class DenoisingDataset(torch.utils.data.Dataset):
    """Pre-tokenized texts (token-id lists without EOS) served with freshly sampled span corruption
    (``reconstruct``: labels are the whole text, see :func:`span_corruption`).

    Item i is a dict(input_ids=list[int], labels=list[int]) from `span_corruption`. The noise of each access
    comes from an RNG seeded with (seed, epoch, i, k), where k counts the earlier accesses of item i in this
    dataset object since the last `set_epoch`. So:
      - call `set_epoch(epoch)` before each epoch (like DistributedSampler's). The noise of epoch e then
        depends only on (seed, e, i, k): a run resumed at epoch e draws exactly what an uninterrupted run
        draws, and non-persistent DataLoader workers, which get a fresh copy of the dataset every epoch,
        draw new noise each epoch;
      - repeated accesses within an epoch still differ (k grows), also inside a persistent DataLoader
        worker, which `set_epoch` in the main process does not reach (its epoch stays put, its k keeps
        growing: reproducible for a given seed, data order and worker count, but not resume-exact);
      - calling `set_epoch` twice with the same epoch replays that epoch's noise.
    Padding and tensor conversion are left to the collate function.
    """

    def __init__(
        self,
        texts: Sequence[Sequence[int]],
        *,
        sentinel_ids: Sequence[int],
        eos_id: int,
        seed: int = 0,
        noise_density: float = 0.15,
        mean_span_length: float = 3.0,
        reconstruct: bool = False,
    ) -> None:
        _check_noise_params(noise_density, mean_span_length, sentinel_ids)
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.texts = [list(t) for t in texts]
        self.sentinel_ids = list(sentinel_ids)
        self.eos_id = eos_id
        self.seed = seed
        self.noise_density = noise_density
        self.mean_span_length = mean_span_length
        self.reconstruct = reconstruct
        self.epoch = 0
        self._access_counts = [0] * len(self.texts)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch mixed into the noise seed and restart the per-item access counts."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.epoch = epoch
        self._access_counts = [0] * len(self.texts)

    def __len__(self) -> int:
        return len(self.texts)

    def lengths(self) -> list[int]:
        """Text token counts (before corruption): the sort keys of batches grouped by length."""
        return [len(t) for t in self.texts]

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        # range() indexing normalises negative indices and raises IndexError when out of range, like a list
        index = range(len(self.texts))[index]
        count = self._access_counts[index]
        self._access_counts[index] = count + 1
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, self.epoch, index, count]))
        input_ids, labels = span_corruption(
            self.texts[index],
            rng,
            noise_density=self.noise_density,
            mean_span_length=self.mean_span_length,
            sentinel_ids=self.sentinel_ids,
            eos_id=self.eos_id,
            reconstruct=self.reconstruct,
        )
        return {"input_ids": input_ids, "labels": labels}
