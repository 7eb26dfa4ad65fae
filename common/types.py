"""What flows between the RL workers, as plain frozen dataclasses of strings and numbers (Ray ships them
cheaply):

- rank RL: candidate sets (rollout → reward) and scored pairs (reward → learner);
- policy-gradient algorithms: sampled groups (rollout → reward) and scored groups (reward → learner);
- :class:`RolloutSpec`: what an algorithm asks the rollout workers to return;
- offline preference algorithms: :class:`PreferencePair` (a file or a reward → learner).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


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
    references: tuple[str, ...] = ()
    """Every reference of the example when it has several (``Example.references``); empty: the gold alone."""
    fields: dict[str, Any] = field(default_factory=dict, hash=False)
    """The example's extra fields (``Example.extra``): what Python reward terms get as row fields."""

    @property
    def refs(self) -> tuple[str, ...]:
        """What the pair is scored against."""
        return self.references or (self.reference,)

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


@dataclass(frozen=True)
class RolloutSpec:
    """What the rollout workers return for an algorithm (its unit's ``rollout_spec``, rlt2t.common.algorithms;
    docs/design.md, "Policy-gradient algorithms")."""

    kind: Literal["pair", "group"]
    """`pair`: a :class:`CandidateSet` (rank RL); `group`: a :class:`SampledGroup` of K samples with their
    per-token log-probs."""
    greedy_baseline: bool = False
    """Also decode each source greedily (SCST's baseline)."""
    reference: bool = False
    """Also score every sample under the frozen reference policy (the KL to the start)."""
    mask_top_p: float = 1.0
    """NLPO: sample only among the top-p tokens of the masking policy (1: no mask)."""


@dataclass(frozen=True)
class SampledGroup:
    """K samples of one source with what a policy-gradient learner needs to take their ratio and KL."""

    example_id: str
    source: str
    reference: str
    """Gold target (the reward's reference); "" for an unlabeled example (a reward that reads no references)."""
    candidates: tuple[str, ...]
    """The K decoded samples (special tokens dropped, whitespace normalised), duplicates kept: each is a
    draw of the policy."""
    token_ids: tuple[tuple[int, ...], ...]
    """Per sample, the sampled token ids (no decoder start token; EOS last when produced): the learner's
    labels, so nothing depends on re-tokenising the decoded text."""
    sample_logprobs: tuple[tuple[float, ...], ...]
    """Per sample and token, the log-prob under the distribution actually sampled from (temperature,
    top-k, top-p, NLPO's mask), as the sampler computed it."""
    forced_eos: tuple[bool, ...]
    """Per sample: its last token is the EOS forced at the length limit, not a draw (left out of the loss)."""
    policy_version: int
    reference_logprobs: tuple[tuple[float, ...], ...] | None = None
    """Per sample and token, the raw log-prob under the frozen reference policy (None: not asked for)."""
    greedy: str | None = None
    """The source's greedy decode (SCST's baseline; None unless asked for)."""
    mask_version: int | None = None
    """NLPO: the policy version of the masking policy whose top-p set the samples were drawn in (the learner
    masks with those same weights); None without a mask, or one the driver did not version."""
    references: tuple[str, ...] = ()
    """Every reference of the example when it has several (``Example.references``); empty: the gold alone."""
    fields: dict[str, Any] = field(default_factory=dict, hash=False)
    """The example's extra fields (``Example.extra``): what Python reward terms get as row fields."""

    @property
    def refs(self) -> tuple[str, ...]:
        """What the samples are scored against (empty for an unlabeled example, whose ``reference`` is "")."""
        return self.references or ((self.reference,) if self.reference else ())

    def __post_init__(self) -> None:
        k = len(self.candidates)
        if not (len(self.token_ids) == len(self.sample_logprobs) == len(self.forced_eos) == k):
            raise ValueError(f"SampledGroup {self.example_id!r}: {k} candidates but {len(self.token_ids)} token "
                             f"rows, {len(self.sample_logprobs)} log-prob rows, {len(self.forced_eos)} flags")
        for j, (ids, lps) in enumerate(zip(self.token_ids, self.sample_logprobs, strict=True)):
            if len(ids) != len(lps):
                raise ValueError(f"SampledGroup {self.example_id!r}: sample {j} has {len(ids)} tokens and "
                                 f"{len(lps)} log-probs")
        if self.reference_logprobs is not None and [len(x) for x in self.reference_logprobs] != [
                len(x) for x in self.token_ids]:
            raise ValueError(f"SampledGroup {self.example_id!r}: reference log-probs do not match the tokens")


@dataclass(frozen=True)
class ScoredGroup:
    """A sampled group with the reward of each sample (and of the greedy decode, for SCST)."""

    group: SampledGroup
    rewards: tuple[float, ...]
    """Reward of each of the K samples against the reference."""
    greedy_reward: float | None = None
    extra: dict[str, float] = field(default_factory=dict)
    """Per-group reward details for the logs (e.g. each term of a weighted sum, averaged over K)."""

    @property
    def policy_version(self) -> int:
        return self.group.policy_version

    @property
    def mask_version(self) -> int | None:
        return self.group.mask_version

    @property
    def example_id(self) -> str:
        return self.group.example_id


@dataclass(frozen=True)
class PreferencePair:
    """One preference for the offline preference algorithms (DPO, IPO): for a source, a candidate preferred to
    another, from a file of preferences (rank lists, pairs, ratings) or from samples ordered by a reward."""

    example_id: str
    """Where it came from (``file:line``, or the training example's id for sampled pairs)."""
    source: str
    chosen: str
    """The preferred candidate."""
    rejected: str
    """The other candidate."""
    weight: float = 1.0
    """The pair's weight in the loss (a rank list of K gives K·(K-1)/2 pairs of weight 2/(K·(K-1)) each, so
    that every list weighs as much as one pair; 1 for a lone pair)."""
