"""What flows between the rank-RL workers: candidate sets (rollout → reward) and scored pairs
(reward → learner collator). Plain frozen dataclasses of strings and numbers, so Ray ships them cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CandidateSet:
    """One source's sampled candidates and the pair drawn from them."""

    example_id: str
    """Id of the training example (the sampling randomness is keyed on it)."""
    source: str
    """Source text, as in the example."""
    reference: str
    """Gold target text, as in the example; the pair is scored against it."""
    candidates: tuple[str, ...]
    """The K samples then the gold target (when included), whitespace-normalised, empty strings dropped,
    duplicates removed keeping the first occurrence. Empty only when every sample was empty and the gold
    was not included."""
    pair: tuple[str, str]
    """The two candidates drawn for ranking, distinct whenever there are two distinct candidates; one
    candidate paired with itself when only one exists (``("", "")`` when there is none)."""
    policy_version: int
    """Version of the weights that sampled the candidates."""

    def __post_init__(self) -> None:
        if not isinstance(self.candidates, tuple):
            raise TypeError(f"CandidateSet.candidates must be a tuple, got {type(self.candidates).__name__}")
        if not (isinstance(self.pair, tuple) and len(self.pair) == 2):
            raise ValueError(f"CandidateSet.pair must be a tuple of two strings, got {self.pair!r}")


@dataclass(frozen=True)
class ScoredPair:
    """A drawn pair ordered by reward: ``a`` is the better (or equal) candidate, ``b`` the other."""

    example_id: str
    """Id of the training example."""
    source: str
    """Source text."""
    reference: str
    """Gold target text (the learner's CE term and the reward's reference)."""
    a: str
    """The candidate with the higher task score (the first drawn one on a tie)."""
    b: str
    """The other candidate."""
    score_a: float
    """Task score of ``a`` against the reference."""
    score_b: float
    """Task score of ``b``; ``score_a >= score_b``."""
    use_rank: bool
    """False when a and b are the same string or their scores tie exactly: such a pair teaches nothing."""
    policy_version: int
    """Version of the weights that sampled the pair (lets the learner measure staleness)."""
