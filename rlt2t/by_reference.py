"""What the RL job's worker actors are launched with, in a module that imports neither torch nor transformers:
Ray imports it in every rollout and reward worker (the mixins are the launched classes' bases, and
:class:`FetchObject` travels in their calls), and a reward worker of reference metrics or an HTTP worker
otherwise needs neither (several seconds of imports, and hundreds of MB, per worker).

A result that stays in the object store comes with a small summary, as the first of two results (the call is
made with num_returns=2): the driver waits on the summaries alone (a dead worker's or a failed task's error shows
there too) and passes the results on by reference, to the reward workers and the learner ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

from rlt2t.common.types import CandidateSet, SampledGroup, ScoredGroup, ScoredPair
from rlt2t.scheduler import StoredItem


class RolloutsByReference:
    """Mixed into a rollout worker class (``sample_version``) at launch."""

    def sample_version_stored(self, *args: Any, **kwargs: Any) -> tuple[int, list[CandidateSet] | list[SampledGroup]]:
        """``sample_version``'s result, after its length."""
        items = self.sample_version(*args, **kwargs)  # type: ignore[attr-defined]
        return len(items), items


ItemSummary = tuple[str, int, int | None]
"""What the scheduler reads of a scored item: (example id, policy version, masking-policy version)."""


class RewardsByReference:
    """Mixed into a reward worker class (``score``) at launch."""

    def score_stored(self, items: Sequence[CandidateSet] | Sequence[SampledGroup]
                     ) -> tuple[list[ItemSummary], list[ScoredPair] | list[ScoredGroup]]:
        """``score``'s result, after its summary (one entry per item, in order)."""
        scored = self.score(items)  # type: ignore[attr-defined]
        return [(x.example_id, x.policy_version, x.mask_version if isinstance(x, ScoredGroup) else None)
                for x in scored], scored


def with_results(cls: type, results: type | None) -> type:
    """``cls`` as it is launched: with the mixin ``results`` (None: as it is), under its own name (the actors'
    process titles are "ray::<Class>.<method>")."""
    return type(cls.__name__, (results, cls), {}) if results is not None else cls


def stored_items(chunk: int, summary: Sequence[ItemSummary]) -> list[StoredItem]:
    """The scheduler's view of chunk ``chunk``'s scored items, from its reward worker's summary."""
    return [StoredItem(chunk, i, *entry) for i, entry in enumerate(summary)]


@dataclass(frozen=True)
class FetchObject:
    """Fetches an object-store value where it is called. Passed inside an argument, its reference is neither
    resolved by Ray for every call nor kept among an actor's constructor arguments (which Ray re-uses on restart
    and warns about): the callee fetches the value once, when it needs it."""

    ref: ray.ObjectRef

    def __call__(self) -> Any:
        return ray.get(self.ref)
