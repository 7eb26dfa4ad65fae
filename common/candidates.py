"""Candidate sets without torch: the per-row seeds every process derives alike (:func:`stable_seed`), the text
form candidates are compared in, and :func:`candidate_set`, which draws the rank pair wherever candidates are
produced (Ray rollout workers, policy servers, the HTTP rollout workers that call them). Nothing here imports
torch or transformers: the light workers (HTTP rollout and reward workers) import it.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from typing import Any

from rlt2t.common.types import CandidateSet


def stable_seed(*parts: int | str) -> int:
    """A 63-bit seed from ints and strings, the same in every process and Python version.

    Python's ``hash()`` of a string is salted per process, so it cannot key randomness that must agree
    across Ray workers; a BLAKE2 digest of the parts' JSON encoding (unambiguous) can.
    """
    for i, part in enumerate(parts):
        if isinstance(part, bool) or not isinstance(part, int | str):
            raise TypeError(f"stable_seed: parts[{i}] must be an int or str, got {type(part).__name__}")
    digest = hashlib.blake2b(json.dumps(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # torch generators take seeds below 2**63 everywhere


def normalize_text(text: str) -> str:
    """Whitespace-normalised text: the form candidates are compared and deduplicated in."""
    return " ".join(text.split())


def candidate_set(example_id: str, source: str, reference: str, samples: Sequence[str], *, include_gold: bool,
                  seed: int, version: int, references: Sequence[str] = (),
                  fields: Mapping[str, Any] | None = None) -> CandidateSet:
    """A source's candidate set from its samples: the gold added (``include_gold``), whitespace-normalised,
    empties dropped, deduplicated keeping the first occurrence, and the rank pair drawn. ``references``: every
    reference of the example when it has several (the pair is scored against them; the gold is ``reference``);
    ``fields``: the example's extra fields (for Python reward terms).

    The pair draw is keyed on (seed, version, example id), so any sampler (Ray actor, policy server) that
    produces the same samples gives the same pair; one candidate pairs with itself (the reward then turns
    ranking off for it).
    """
    pool = list(samples) + ([reference] if include_gold else [])
    # dict keeps first-occurrence order: deduplication that does not depend on set iteration order.
    candidates = tuple(dict.fromkeys(t for t in map(normalize_text, pool) if t))
    if len(candidates) >= 2:
        rng = random.Random(stable_seed(seed, version, example_id, "pair"))
        first, second = rng.sample(candidates, 2)
        pair = (first, second)
    else:
        only = candidates[0] if candidates else ""
        pair = (only, only)
    return CandidateSet(example_id=example_id, source=source, reference=reference, candidates=candidates,
                        pair=pair, policy_version=version, references=tuple(references), fields=dict(fields or {}))
