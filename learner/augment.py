"""Source-side token augmentation for SFT (docs/design.md, "The method", step 4).

Each source token is independently selected with probability `prob` (0.15); a selected token is either
deleted or repeated 1..`max_repeat` extra times. It makes the model robust to the dropped and stuttered
tokens it meets in noisy inputs; the target is never augmented.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence

import numpy as np

RandomSource = np.random.Generator | random.Random


def _uniforms(rng: RandomSource, n: int) -> list[float]:
    if isinstance(rng, np.random.Generator):
        return rng.random(n).tolist()
    if isinstance(rng, random.Random):
        return [rng.random() for _ in range(n)]
    raise TypeError(f"rng must be a numpy.random.Generator or random.Random, got {type(rng).__name__}")


def _randint(rng: RandomSource, low: int, high: int) -> int:
    """Uniform integer in [low, high], both ends included."""
    if isinstance(rng, np.random.Generator):
        return int(rng.integers(low, high + 1))
    return rng.randint(low, high)


def augment_tokens(
    tokens: Sequence[int],
    rng: RandomSource,
    *,
    prob: float = 0.15,
    protected_ids: Collection[int] = frozenset(),
    max_repeat: int = 3,
    delete_prob: float = 0.5,
) -> list[int]:
    """Return a copy of `tokens` where each unprotected token, with probability `prob`, is deleted (with
    probability `delete_prob`) or else followed by 1..`max_repeat` extra copies of itself (uniform count).

    Tokens whose id is in `protected_ids` (BOS/EOS/pad, field separators) are never selected. Deletions and
    repeats are equally likely by default (`delete_prob=0.5`), so the expected length is about unchanged
    (-0.5 + 0.5·2 = +0.5 tokens per selected token with max_repeat=3).

    Never empty for a non-empty input: if every token happens to be deleted, the input is returned
    unchanged (a clean sample beats an empty one). An empty input gives an empty list.
    """
    if not 0.0 <= prob <= 1.0:
        raise ValueError(f"prob must be in [0, 1], got {prob}")
    if not 0.0 <= delete_prob <= 1.0:
        raise ValueError(f"delete_prob must be in [0, 1], got {delete_prob}")
    if max_repeat < 1:
        raise ValueError(f"max_repeat must be >= 1, got {max_repeat}")
    if prob == 0.0 or not tokens:
        return list(tokens)

    out: list[int] = []
    for token, u in zip(tokens, _uniforms(rng, len(tokens)), strict=True):
        if u >= prob or token in protected_ids:
            out.append(token)
        elif _uniforms(rng, 1)[0] < delete_prob:
            continue
        else:
            out.extend([token] * (1 + _randint(rng, 1, max_repeat)))
    return out if out else list(tokens)
