"""Rollout and reward over HTTP: the policy and reward servers as alternatives to the Ray actors.

With ``rollout.source: http`` the driver runs one light :class:`HttpRolloutWorker` per policy server
URL (Ray actors, so dispatch, re-dispatch and the reorder buffer are the ones the local actors use);
each asks its server for samples and builds the candidate sets locally with the same rules as
``rlt2t.actors.rollout.RolloutWorker`` (``rlt2t.common.candidates.candidate_set``). The servers get
the learner's weights from the checkpoints the driver publishes under ``{run}/rl/published``
(``rlt2t serve policy --checkpoint-dir`` that directory; it hot-reloads the newest). A server that
has not loaded the version a chunk asks for yet is waited for, up to ``rollout.timeout_s``, then its
candidates are used anyway and the staleness logged says by how much they lag.

With ``reward.source: http`` an :class:`HttpRewardWorker` scores each drawn pair on the reward server
(its ``task_score``, configured by the server's own ``reward`` section and document frequencies: start
it with ``--document-frequency {run}/rl/document_frequency.json`` to score as the Ray actors do).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence

from rlt2t.common.candidates import candidate_set, stable_seed
from rlt2t.common.config import RewardConfig, RolloutConfig
from rlt2t.common.data import Example
from rlt2t.common.rewards import order_pair
from rlt2t.common.types import CandidateSet, RolloutSpec, SampledGroup, ScoredGroup, ScoredPair
from rlt2t.services.client import PolicyClient, RewardClient
from rlt2t.services.schemas import CandidatesResponse

log = logging.getLogger("rlt2t.remote_workers")

# The server's seed field is bounded (JSON-safe integers).
_SEED_RANGE = 2**31 - 1


class HttpRolloutWorker:
    """Samples on one policy server; the same contract as ``RolloutWorker``: candidate sets (rank RL) or
    sampled groups (policy gradients: the server's per-token sample log-probs; the reference log-probs are
    left to the learner, ``reference_logprobs=None``)."""

    def __init__(self, url: str, rollout: RolloutConfig, *, seed: int, token: str | None = None,
                 poll_s: float = 0.5, transport=None, spec: RolloutSpec | None = None) -> None:
        self.url = url
        self.rollout = rollout
        self.seed = seed
        self.poll_s = poll_s
        self.spec = spec or RolloutSpec("pair")
        if self.spec.mask_top_p < 1.0:
            raise ValueError("NLPO's masked sampling needs the Ray rollout workers (rollout.source=ray)")
        self.client = PolicyClient(url, token=token, timeout=rollout.timeout_s, transport=transport)

    def sample_version(self, version: int, weights,
                       examples: Sequence[Example]) -> list[CandidateSet] | list[SampledGroup]:
        """Candidate sets or sampled groups for ``examples`` from weights of ``version`` or newer (``weights`` is
        unused: the server loads published checkpoints)."""
        del weights
        if self.spec.kind == "group":
            return self._groups(version, examples)
        for i, ex in enumerate(examples):
            if ex.target is None:
                raise ValueError(f"examples[{i}] (id {ex.id!r}) has no target; rank RL needs a reference")
        cfg = self.rollout
        return [candidate_set(ex.id, ex.source, ex.target or "", [c.text for c in candidates],
                              include_gold=cfg.include_gold, seed=self.seed, version=response.policy_version,
                              references=ex.references, fields=ex.extra)
                for chunk, _, response in self._sampled_chunks(version, examples)
                for ex, candidates in zip(chunk, response.candidates, strict=True)]

    def _groups(self, version: int, examples: Sequence[Example]) -> list[SampledGroup]:
        out: list[SampledGroup] = []
        for chunk, seed, response in self._sampled_chunks(version, examples):
            greedy = None
            if self.spec.greedy_baseline:
                greedy = self.client.candidates([ex.source for ex in chunk], mode="sample", num_candidates=1, top_k=1,
                                                max_new_tokens=self.rollout.max_new_tokens, seed=seed).candidates
            for i, (ex, cands) in enumerate(zip(chunk, response.candidates, strict=True)):
                out.append(SampledGroup(
                    example_id=ex.id, source=ex.source, reference=ex.target or "", references=ex.references,
                    fields=ex.extra, candidates=tuple(c.text for c in cands),
                    token_ids=tuple(tuple(c.token_ids) for c in cands),
                    sample_logprobs=tuple(tuple(c.sample_logprobs) for c in cands),
                    forced_eos=tuple(c.forced_eos for c in cands), policy_version=response.policy_version,
                    greedy=None if greedy is None else greedy[i][0].text))
        return out

    def _sampled_chunks(self, version: int, examples: Sequence[Example]
                        ) -> Iterator[tuple[list[Example], int, CandidatesResponse]]:
        """Each chunk of ``rollout.batch_size`` examples, its seed and the server's samples for it, asked once the
        server serves ``version`` or newer (or ``rollout.timeout_s`` has passed)."""
        cfg = self.rollout
        for first in range(0, len(examples), cfg.batch_size):
            chunk = list(examples[first : first + cfg.batch_size])
            seed = stable_seed(self.seed, version, *(ex.id for ex in chunk)) % _SEED_RANGE
            self._wait_for_version(version)
            response = self.client.candidates(
                [ex.source for ex in chunk], mode="sample", num_candidates=cfg.num_samples, top_k=cfg.top_k,
                top_p=cfg.top_p, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, seed=seed)
            if response.policy_version != version:
                log.warning("policy server %s answered with version %d; chunk wanted %d", self.url,
                            response.policy_version, version)
            yield chunk, seed, response

    def _wait_for_version(self, version: int) -> None:
        """Poll the (cheap) /v1/model until the server serves ``version`` or newer, up to rollout.timeout_s."""
        deadline = time.monotonic() + self.rollout.timeout_s
        while self.client.model().version < version and time.monotonic() < deadline:
            time.sleep(self.poll_s)  # the server has not reloaded the published version yet

    def pid(self) -> int:
        return os.getpid()


class HttpRewardWorker:
    """Scores on a reward server (its ``task_score``); the same contract as ``RewardWorker``: drawn pairs
    ordered better first, or every sample (and greedy decode) of sampled groups."""

    def __init__(self, url: str, reward: RewardConfig, *, token: str | None = None, transport=None) -> None:
        self.url = url
        self.client = RewardClient(url, token=token, timeout=reward.timeout_s, transport=transport)

    def _scores(self, hyps: list[str], refs: list[tuple[str, ...]]) -> list[float]:
        scores = self.client.reward(hyps, refs, metrics=["task_score"]).scores["task_score"]
        if len(scores) != len(hyps):
            raise RuntimeError(f"reward server {self.url} returned {len(scores)} scores for {len(hyps)} candidates")
        return scores

    def score(self, items: Sequence[CandidateSet] | Sequence[SampledGroup]) -> list[ScoredPair] | list[ScoredGroup]:
        if not items:
            return []
        if isinstance(items[0], SampledGroup):
            groups: Sequence[SampledGroup] = items  # type: ignore[assignment]
            texts = [list(g.candidates) + ([g.greedy] if g.greedy is not None else []) for g in groups]
            flat = self._scores([t for ts in texts for t in ts],
                                [g.refs for g, ts in zip(groups, texts, strict=True) for _ in ts])
            out, pos = [], 0
            for g, ts in zip(groups, texts, strict=True):
                k = len(g.candidates)
                out.append(ScoredGroup(group=g, rewards=tuple(flat[pos : pos + k]),
                                       greedy_reward=flat[pos + k] if g.greedy is not None else None))
                pos += len(ts)
            return out
        sets: Sequence[CandidateSet] = items  # type: ignore[assignment]
        scores = self._scores([text for s in sets for text in s.pair], [s.refs for s in sets for _ in range(2)])
        return [order_pair(s, scores[2 * i], scores[2 * i + 1]) for i, s in enumerate(sets)]

    def pid(self) -> int:
        return os.getpid()
