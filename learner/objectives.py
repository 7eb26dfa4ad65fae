"""What a learner rank optimises, one unit per algorithm family, plugged into the one learner
(``rlt2t.learner.learner.Learner``): the module DDP wraps, how a batch is collated, and one learner step.

- :class:`RankObjective`: rank RL, CE(gold) + λ·pairwise rank loss (``rlt2t.learner.rank_step``).
- :class:`PolicyGradientObjective`: SCST, RLOO, GRPO (sequence advantages from each source's K samples)
  and PPO, A2C, NLPO (token-level advantages from a value head and GAE), all with the clipped ratio
  against the batch's starting policy, truncated importance weights against the sampler, and a KL to
  the reference policy (docs/design.md, "Policy-gradient algorithms").

A step is given a :class:`StepRunner`: the learner's forward through the DDP-wrapped module, its
optimizer step, and its cross-rank reductions, so the objectives hold no distributed code of their own.
"""

from __future__ import annotations

import copy
import logging
import math
import sysconfig
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from rlt2t.common.collate import IGNORE_INDEX
from rlt2t.common.config import RLConfig, RolloutConfig
from rlt2t.common.errors import UnitError
from rlt2t.common.families import decoder_hidden_size
from rlt2t.common.lora import is_lora, load_weights, reference_policy
from rlt2t.common.policy import Policy
from rlt2t.common.sampling import warp_logits
from rlt2t.common.scoring import token_scores
from rlt2t.common.types import ScoredGroup, ScoredPair
from rlt2t.learner.algorithms.base import PolicyGradient
from rlt2t.learner.batch import GroupBatch, group_batch, rank_batch
from rlt2t.learner.group_step import GroupOutput, GroupPolicy, ValueHead, group_forward
from rlt2t.learner.losses import (
    AdaptiveKLController,
    clipped_policy_loss,
    clipped_value_loss,
    counted_rank_weights,
    gae,
    gold_cross_entropy,
    kl_estimate,
    mask_leak,
    masked_mean,
)
from rlt2t.learner.rank_step import RankBatch, SharedEncoderRankLoss

log = logging.getLogger("rlt2t.learner")

# How far the learner's and the sampler's log-probs of the same tokens may differ before an on-policy
# batch is called inconsistent (a float32 torch sampler agrees to ~1e-6; a float32 CTranslate2 one to ~1e-4).
ON_POLICY_RATIO_TOLERANCE = 1e-3


class StepRunner(Protocol):
    """What an objective needs from the learner rank that runs it."""

    @property
    def device(self) -> torch.device: ...

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The objective's module through the DDP wrapper (and autocast)."""
        ...

    def optimize(self, loss: Tensor) -> float:
        """Backward, clip, optimizer step, zero the gradients; returns the gradient norm."""
        ...

    def all_sum(self, values: Tensor) -> Tensor:
        """Sum over the learner ranks (a float64 vector; the input on one rank)."""
        ...

    def all_min(self, value: int) -> int:
        """The smallest of the ranks' values (so every rank takes the same number of optimizer steps)."""
        ...

    def autocast(self) -> AbstractContextManager:
        """The mixed precision ``forward`` runs under, for the objective's other passes (reference, mask)."""
        ...


# How the learner reduces a step's scalars over its ranks: the mean, but counts add up and a "largest" stays the
# largest (a mean over 4 ranks would log one rank's 0.5 ratio deviation as 0.125).
SUMMED_METRICS = ("tokens", "excluded_tokens")
MAXED_METRICS = ("ratio_max", "sampler_ratio_max_dev")


def rank_shares(run: StepRunner, *counts: float) -> list[float]:
    """For each of this rank's counts (tokens, weight mass), the factor that turns a mean over them into its part
    of the mean over every rank's: the number of ranks times this rank's share of the count's sum over the ranks
    (exactly 1 with one rank). DDP averages the ranks' gradients; unscaled, a rank with few tokens (short samples)
    would weigh as much as one with many, and the result would depend on rl.learners."""
    *totals, ranks = run.all_sum(torch.tensor([*counts, 1.0], dtype=torch.float64)).tolist()
    return [ranks * local / total if total > 0 else 1.0 for local, total in zip(counts, totals, strict=True)]


def reference_logits(run: StepRunner, module: GroupPolicy, reference: GroupPolicy | None, input_ids: Tensor,
                     attention_mask: Tensor, labels: Tensor, k: int) -> Tensor:
    """Teacher-forced logits [K*B, T, V] of the frozen reference (K label rows per source, rep-major), without
    gradient, under the policy's mixed precision (at the start, policy = reference, their log-ratio is then
    exactly 0). Under LoRA the reference is the policy's base: ``module``, the objective's own
    :class:`GroupPolicy`, with the adapters disabled; otherwise ``reference``, the start's :class:`GroupPolicy`.
    Both are entered through their root's forward, as the sharded learner needs (each is an FSDP root there)."""
    model = module.model
    with torch.no_grad(), run.autocast():
        if is_lora(model):
            with reference_policy(model):
                return module(input_ids, attention_mask, labels, k).logits
        if reference is None:
            raise RuntimeError("the batch carries no reference log-probs and the learner holds no reference "
                               "policy (rollout workers compute them when rl.kl.coef > 0)")
        return reference(input_ids, attention_mask, labels, k).logits


def frozen_reference(reference: nn.Module | None) -> GroupPolicy | None:
    """The frozen reference model as the objective runs it: its own :class:`GroupPolicy` (an FSDP root under the
    sharded learner, which shards it as it shards the policy), in eval mode, without gradients."""
    if reference is None:
        return None
    return GroupPolicy(reference.eval().requires_grad_(False)).eval()


def rank_token_share(run: StepRunner, mask: Tensor) -> float:
    """`rank_shares` of the tokens of ``mask``: for a token mean over the mask."""
    return rank_shares(run, float(mask.sum()))[0]


def pooled_rank_loss(run: StepRunner, ce: Tensor, rank: Tensor, batch: RankBatch, loss_weight: float,
                     alpha: float) -> Tensor:
    """Rank RL's CE + λ·rank loss with the CE's mean over the gold tokens and the rank loss's weighted mean over
    the counted steps each taken over every rank's batch, as one learner would (``ce + loss_weight * rank``
    exactly, with one rank)."""
    gold = float((batch.gold_labels != IGNORE_INDEX).sum())
    mass = float(counted_rank_weights(batch.labels_a, batch.labels_b, batch.use_rank, alpha, IGNORE_INDEX)[0].sum())
    ce_share, rank_share = rank_shares(run, gold, mass)
    return ce * ce_share + loss_weight * (rank * rank_share)


class RankObjective:
    """Rank RL: CE(gold) + λ·rank loss on (better, worse) pairs, one optimizer step per batch."""

    metric_keys = ("loss", "ce", "rank_loss", "pair_accuracy", "reward_a", "reward_b", "use_rank_fraction",
                   "grad_norm")

    def __init__(self, rl: RLConfig, policy: Policy) -> None:
        self.policy = policy
        self.loss_weight, self.alpha = rl.rank.loss_weight, rl.rank.delay_alpha
        self.module: nn.Module = SharedEncoderRankLoss(policy.model, score_kind=rl.rank.score,
                                                       loss_weight=rl.rank.loss_weight, alpha=rl.rank.delay_alpha)
        policy.model.train()  # rank RL trains with dropout, as SFT does

    def collate(self, items: Sequence[ScoredPair], *, max_source_len: int, max_target_len: int) -> RankBatch:
        return rank_batch(self.policy.tokenizer, items, max_source_len=max_source_len, max_target_len=max_target_len)

    def preflight_batch(self, sources: int, source_len: int, target_len: int, generator: torch.Generator
                        ) -> RankBatch:
        vocab = self.policy.model.config.vocab_size

        def ids(length: int) -> Tensor:
            return torch.randint(0, vocab, (sources, length), generator=generator)

        return RankBatch(input_ids=ids(source_len), attention_mask=torch.ones(sources, source_len, dtype=torch.long),
                         gold_labels=ids(target_len), labels_a=ids(target_len), labels_b=ids(target_len),
                         use_rank=torch.ones(sources, dtype=torch.bool))

    def preflight(self, run: StepRunner, batch: RankBatch) -> None:
        run.forward(batch).loss.backward()

    def step(self, run: StepRunner, batch: RankBatch, items: Sequence[ScoredPair], step: int) -> dict[str, float]:
        out = run.forward(batch)
        grad_norm = run.optimize(pooled_rank_loss(run, out.ce, out.rank, batch, self.loss_weight, self.alpha))
        n = len(items)
        return {"loss": out.loss.item(), "ce": out.ce.item(), "rank_loss": out.rank.item(),
                "pair_accuracy": out.accuracy.item(), "reward_a": sum(p.score_a for p in items) / n,
                "reward_b": sum(p.score_b for p in items) / n,
                "use_rank_fraction": sum(p.use_rank for p in items) / n, "grad_norm": grad_norm}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def frozen_modules(self) -> list[nn.Module]:
        return []


def _token_logprobs(logits: Tensor, labels: Tensor, transform: dict[str, Any], action_mask: Tensor | None = None
                    ) -> tuple[Tensor, Tensor]:
    """(log-probs under the sampling transform, raw log-probs) of the label tokens: [N, T] each, 0 at padding.

    The transform is the sampler's (``rlt2t.common.sampling.warp_logits``: temperature, top-k, top-p), after
    NLPO's action mask when given ([N, T, V] bool, True = allowed), so the ratio compares like with like.
    A token the transform excludes gets -inf (its ratio is 0, its gradient 0).
    """
    raw = token_scores(logits, labels, "logprobs", IGNORE_INDEX)
    scores = logits if action_mask is None else logits.masked_fill(~action_mask, float("-inf"))
    warped = warp_logits(scores, **transform).log_softmax(dim=-1)
    valid = labels != IGNORE_INDEX
    picked = warped.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, picked, torch.zeros_like(picked)), raw


def _entropy(logits: Tensor) -> Tensor:
    """[N, T, V] -> [N, T] entropy of the raw softmax, in float32."""
    logp = logits.float().log_softmax(dim=-1)
    return -(logp.exp() * logp).sum(-1)


def top_p_mask(logits: Tensor, top_p: float) -> Tensor:
    """NLPO's action mask: True for the smallest set of most likely tokens whose mass reaches ``top_p``
    (the most likely token always). logits [..., V] -> bool [..., V]."""
    return torch.isfinite(warp_logits(logits, top_p=top_p))


@dataclass(frozen=True, eq=False)
class Experience:
    """What steps 1 and 2 of a policy-gradient step leave for its optimisation (step 3): rows are the batch's
    K*B samples, rep-major; no gradient anywhere."""

    size: int
    """B: the sources on this rank."""
    k: int
    """K: the samples per source."""
    mask: Tensor
    """[K*B, T] the tokens in the loss (sampled, and inside the current policy's transform)."""
    action_mask: Tensor | None
    """NLPO's allowed tokens [K*B, T, V] (None: unmasked)."""
    old_logp: Tensor
    """[K*B, T] the batch's starting policy's log-probs under the sampling transform."""
    is_weights: Tensor
    """[K*B, T] the truncated importance weights against the sampler."""
    advantages: Tensor
    """[K*B, T]"""
    returns: Tensor | None
    """[K*B, T] the value head's targets (actor-critic units; None otherwise)."""
    old_values: Tensor | None
    """[K*B, T] the value head's estimates at the start (actor-critic units; None otherwise)."""
    reference: Tensor | None
    """[K*B, T] the reference policy's log-probs (None without a KL)."""
    beta: float
    """The KL coefficient of this step."""


class PolicyGradientObjective:
    """SCST, RLOO, GRPO, PPO, A2C and NLPO on batches of scored groups (K samples per source).

    One learner step on a batch:

    1. A no-grad pass of the current weights gives, per token, the log-prob under the sampling transform
       (the ratio's denominator), the raw log-prob (for the KL to the reference) and, for PPO, the values.
       Its ratio to the sampler's own log-probs is the truncated importance weight, capped at rl.pg.is_cap:
       1 on-policy with the torch sampler; it corrects an int8 or stale sampler (and is logged).
    2. Advantages. RLOO: sequence rewards minus β·KL (k1, summed over the sequence), then the leave-one-out
       baseline. GRPO: group-normalised rewards; SCST: rewards minus the greedy decode's; both add β·k3 to the
       loss instead (SCST's greedy baseline has no KL to shape it with: shaping only the samples would bias
       every advantage negative as the KL grows). PPO/A2C/NLPO: the reward at the last token, −β·k1 at every
       token, GAE with the value head, whitened.
    3. rl.pg.epochs × rl.pg.minibatches optimizer steps (minibatches split by source so each keeps its
       shared encoder pass) of the clipped policy loss (+ value loss, − entropy bonus), stopping early when
       the approximate KL to the batch's start passes 1.5·rl.pg.target_kl. With rl.pg.sft_coef > 0 each step
       adds that weight times the cross-entropy of the sources' gold targets, decoded as one more row per
       source on the samples' encoder pass.
    4. The adaptive KL controller moves β towards rl.kl.target with the batch's mean sequence KL.

    A unit whose update is not a sequence of optimizer steps (TRPO) subclasses this and overrides step 3,
    :meth:`_optimise`, which steps 1 and 2 hand an :class:`Experience`.

    Dropout is off throughout (the module stays in eval mode): under dropout an on-policy ratio is not 1.
    """

    def __init__(self, rl: RLConfig, rollout: RolloutConfig, policy: Policy, *, seed: int,
                 reference: nn.Module | None = None, unit: PolicyGradient | None = None) -> None:
        self.rl, self.policy, self.seed = rl, policy, seed
        # this objective's own copy of the unit (one instance per process is shared by every config naming it),
        # holding this job's rl section for its advantages to read (self.rl.section())
        self.unit: PolicyGradient = copy.copy(unit if unit is not None else rl.unit)  # type: ignore[assignment]
        self.unit.rl = rl
        self.k = rollout.num_samples
        head = ValueHead(decoder_hidden_size(policy.model.config)) if self.unit.value_head else None
        self.module: GroupPolicy = GroupPolicy(policy.model, head)
        self.module.eval()
        self.transform = {"temperature": rollout.temperature, "top_k": rollout.top_k, "top_p": rollout.top_p}
        self.kl = AdaptiveKLController(rl.kl.coef, rl.kl.target, rl.kl.horizon)
        self.clip_eps = rl.pg.clip_eps if self.unit.clipped else math.inf
        # Where the KL to the reference goes: a loss term (β·token mean of k3) for GRPO and SCST, a reward for
        # RLOO (sequence) and PPO / A2C / NLPO (per token).
        self.kl_in_loss = self.unit.kl_in_loss
        self.value_clip = rl.pg.value_clip if self.unit.clipped else math.inf
        # Used only when a batch arrives without reference log-probs (policy servers do not compute them).
        self.reference = frozen_reference(reference)
        # Policy servers send samples without reference log-probs: the learner scores them (a second pass).
        self.scores_reference = rl.uses_kl and rollout.source == "http"
        # NLPO's masking policy: one model whose weights are those of the version each group was sampled under
        # (SampledGroup.mask_version), sent by the driver with the step (receive_masks); the sampler and the
        # learner mask with the same weights by construction, whatever the pipeline's lag.
        self.mask_model: nn.Module | None = None
        self._mask_loaded: int | None = None  # the version in mask_model (None: unknown, e.g. just resumed)
        self._masks: dict[int, dict[str, Tensor]] = {}
        if self.unit.masked:
            self.mask_model = copy.deepcopy(policy.model).eval().requires_grad_(False)
        self._warned: set[str] = set()

    @property
    def metric_keys(self) -> tuple[str, ...]:
        keys = ["loss", "policy_loss", "reward_mean", "reward_std", "kl_k1", "kl_k3", "kl_seq", "kl_coef",
                "clip_fraction", "approx_kl", "entropy", "advantage_mean", "advantage_std", "ratio_mean",
                "ratio_max", "sampler_ratio_mean", "sampler_ratio_max_dev", "sampler_kl", "kl_k1_stderr",
                "is_weight_mean", "grad_norm", "optimizer_steps", "tokens", "excluded_tokens"]
        if self.unit.greedy_baseline:
            keys.append("greedy_reward")
        if self.unit.masked:
            keys.append("mask_leak")
        if self.unit.value_head:
            keys += ["value_loss", "value_clip_fraction", "explained_variance"]
        if self.rl.pg.sft_coef:
            keys.append("sft_loss")
        return tuple(keys)

    # -- batches ---------------------------------------------------------------------------------------------

    def collate(self, items: Sequence[ScoredGroup], *, max_source_len: int, max_target_len: int) -> GroupBatch:
        # Samples are at most rollout.max_new_tokens <= data.max_target_len (config check); the gold targets are
        # truncated to data.max_target_len as in SFT.
        return group_batch(self.policy.tokenizer, items, max_source_len=max_source_len,
                           gold_len=max_target_len if self.rl.pg.sft_coef else None)

    def preflight_batch(self, sources: int, source_len: int, target_len: int, generator: torch.Generator
                        ) -> GroupBatch:
        vocab = self.policy.model.config.vocab_size
        k = self.k
        rows = k * sources
        return GroupBatch(
            input_ids=torch.randint(0, vocab, (sources, source_len), generator=generator),
            attention_mask=torch.ones(sources, source_len, dtype=torch.long),
            labels=torch.randint(0, vocab, (rows, target_len), generator=generator),
            sample_logprobs=torch.zeros(rows, target_len), loss_mask=torch.ones(rows, target_len, dtype=torch.bool),
            rewards=torch.zeros(sources, k),
            reference_logprobs=(torch.zeros(rows, target_len) if self.rl.uses_kl and not self.scores_reference
                                else None),
            greedy_rewards=torch.zeros(sources) if self.unit.greedy_baseline else None,
            gold_labels=(torch.randint(0, vocab, (sources, target_len), generator=generator) if self.rl.pg.sft_coef
                         else None))

    def preflight(self, run: StepRunner, batch: GroupBatch) -> None:
        # What a step holds at its peak (the first minibatch of step() over the whole batch): the no-grad pass's
        # [K*B, T, V] logits, still alive while the gradient pass runs; NLPO's action mask (the masking
        # policy's forward) and its row-indexed copy; the learner's reference pass for policy-server samples;
        # the entropy bonus's softmax.
        action_mask = self._action_mask(run, batch)
        if self.rl.uses_kl:
            self._reference_logprobs(run, batch)
        rows = torch.arange(batch.labels.shape[0], device=batch.labels.device)
        with torch.no_grad():
            held = run.forward(batch.input_ids, batch.attention_mask, batch.labels, batch.k)
        out, gold_logits = self._forward(run, batch)
        allowed = None if action_mask is None else action_mask[rows]
        logp, raw = _token_logprobs(out.logits, batch.labels, self.transform, allowed)
        kept = batch.loss_mask & torch.isfinite(logp)  # random labels the transform or the mask excludes
        loss = -masked_mean(torch.where(kept, logp, 0) + raw, kept)
        if allowed is not None:
            loss = loss + masked_mean(mask_leak(out.logits, allowed), batch.loss_mask)
        if self.rl.pg.entropy_coef:
            loss = loss - self.rl.pg.entropy_coef * masked_mean(_entropy(out.logits), batch.loss_mask)
        if out.values is not None:
            loss = loss + masked_mean(out.values**2, batch.loss_mask)
        if gold_logits is not None and batch.gold_labels is not None:
            loss = loss + gold_cross_entropy(gold_logits, batch.gold_labels, IGNORE_INDEX)
        loss.backward()
        del held

    # -- one learner step ------------------------------------------------------------------------------------

    def _forward(self, run: StepRunner, batch: GroupBatch) -> tuple[GroupOutput, Tensor | None]:
        """The gradient pass over a batch's samples: (their output, the gold rows' logits [B, Tg, V] or None).
        With gold labels (rl.pg.sft_coef) they are decoded as sample K + 1 of each source, on the same encoder
        pass; the decoder is causal, so padding every row to one width changes no real position's logits."""
        k = batch.k
        if batch.gold_labels is None:
            return run.forward(batch.input_ids, batch.attention_mask, batch.labels, k), None
        rows, width = batch.labels.shape
        gold_width = batch.gold_labels.shape[1]
        wide = max(width, gold_width)
        labels = torch.cat([nn.functional.pad(batch.labels, (0, wide - width), value=IGNORE_INDEX),
                            nn.functional.pad(batch.gold_labels, (0, wide - gold_width), value=IGNORE_INDEX)])
        out: GroupOutput = run.forward(batch.input_ids, batch.attention_mask, labels, k + 1)
        values = None if out.values is None else out.values[:rows, :width]
        return GroupOutput(out.logits[:rows, :width], values), out.logits[rows:, :gold_width]

    def receive_masks(self, weights: Mapping[int, dict[str, Tensor]]) -> None:
        """NLPO: the masking-policy weights of the versions the next step's groups were sampled under that this
        learner does not hold (the driver sends each version once)."""
        self._masks = dict(weights)

    def _load_mask(self, version: int | None) -> None:
        if version is None or version == self._mask_loaded:  # None: a group the driver did not version
            return
        if version not in self._masks:
            raise RuntimeError(f"nlpo: a group was sampled under masking-policy version {version}, whose weights "
                               f"the learner was not sent (it holds version {self._mask_loaded})")
        assert self.mask_model is not None
        load_weights(self.mask_model, self._masks.pop(version))
        self._mask_loaded = version

    def _action_mask(self, run: StepRunner, batch: GroupBatch, items: Sequence[ScoredGroup] = ()) -> Tensor | None:
        """NLPO's allowed tokens per row [K*B, T, V], each group's from the masking policy it was sampled under."""
        if self.mask_model is None:
            return None
        size = batch.rewards.shape[0]
        versions = [g.mask_version for g in items] if len(items) == size else [None] * size
        mask: Tensor | None = None
        with torch.no_grad(), run.autocast():  # the policy's precision: its top-p set as the sampler's
            for version in sorted(set(versions), key=lambda v: -1 if v is None else v):  # the driver's order
                self._load_mask(version)
                sources = torch.tensor([i for i, v in enumerate(versions) if v == version],
                                       device=batch.input_ids.device)
                part = batch.select(sources) if len(sources) < size else batch
                logits = group_forward(self.mask_model, part.input_ids, part.attention_mask, part.labels,
                                       batch.k).logits
                allowed = top_p_mask(logits, self.rl.pg.nlpo_top_p)
                if part is batch:
                    return allowed
                if mask is None:
                    mask = torch.zeros(batch.labels.shape[0], *allowed.shape[1:], dtype=torch.bool,
                                       device=allowed.device)
                rows = (torch.arange(batch.k, device=sources.device).unsqueeze(1) * size + sources).reshape(-1)
                mask[rows] = allowed
        return mask

    def _reference_logprobs(self, run: StepRunner, batch: GroupBatch) -> Tensor:
        if batch.reference_logprobs is not None:
            return batch.reference_logprobs
        logits = reference_logits(run, self.module, self.reference, batch.input_ids, batch.attention_mask,
                                  batch.labels, batch.k)
        return token_scores(logits, batch.labels, "logprobs", IGNORE_INDEX)

    def step(self, run: StepRunner, batch: GroupBatch, items: Sequence[ScoredGroup], step: int) -> dict[str, float]:
        rl, pg = self.rl, self.rl.pg
        size, k = batch.rewards.shape
        # The tokens the sampler drew: padding and an EOS it forced at the length limit are no action of the
        # policy (probability 1 under the sampling process): no KL term, no reward position, no value target.
        valid = batch.loss_mask
        # 1. the batch's starting policy, without gradient
        action_mask = self._action_mask(run, batch, items)
        with torch.no_grad():
            out = run.forward(batch.input_ids, batch.attention_mask, batch.labels, k)
            old_logp, old_raw = _token_logprobs(out.logits, batch.labels, self.transform, action_mask)
            # A sampled token that the current policy's transform excludes (outside its top-k / top-p now, with
            # stale samples) has no ratio: it leaves the loss (counted in the logs as excluded_tokens).
            mask = batch.loss_mask & torch.isfinite(old_logp)
            entropy = masked_mean(_entropy(out.logits), mask)
            old_values = out.values
            sampler_log_ratio = torch.where(mask, old_logp - batch.sample_logprobs, torch.zeros_like(old_logp))
            is_weights = torch.clamp(torch.exp(sampler_log_ratio), max=pg.is_cap)
            sampler_ratio = torch.exp(sampler_log_ratio)
            # β: 0 where no KL enters (a unit with uses_reference = False, or rl.kl.coef = 0): what its advantages
            # get and the logs show, not rl.kl.coef's unused value
            beta = self.kl.coef if rl.uses_kl else 0.0
            if rl.uses_kl:
                reference = self._reference_logprobs(run, batch)
                k1 = torch.where(valid, kl_estimate(old_raw, reference, "k1"), torch.zeros_like(old_raw))
                k3 = torch.where(valid, kl_estimate(old_raw, reference, "k3"), torch.zeros_like(old_raw))
            else:
                reference = None
                k1 = k3 = torch.zeros_like(old_raw)
            seq_kl = k1.sum(dim=1)  # [K*B] per sequence
            # KL(sampler || reference) per sampled token, which is >= 0 on average whatever the sampler's staleness
            # or quantisation: k1 plus the sampler's log-ratio to the learner (what _warn checks)
            kl_check = torch.where(mask, old_raw - reference - sampler_log_ratio, 0) if reference is not None else None
            # 2. advantages
            rewards = batch.rewards
            if self.unit.value_head:
                lengths = valid.sum(dim=1)
                token_rewards = torch.where(valid, -beta * k1, torch.zeros_like(k1))
                last = (lengths - 1).clamp(min=0)
                seq_rewards = rewards.t().reshape(-1)  # rep-major, as the rows
                token_rewards[torch.arange(token_rewards.shape[0]), last] += seq_rewards
                assert old_values is not None
                values = torch.where(valid, old_values, torch.zeros_like(old_values))
                advantages, returns = gae(token_rewards, values, valid, pg.gamma, pg.lam)
                if pg.whiten_advantages:
                    advantages = self._whiten(run, advantages, mask)
            else:  # sequence advantages, the unit's own [N, K]
                # an exception raised in a unit's own code here is named by the Learner (unit_fault); one in the
                # collective it calls (a peer rank gone) stays a failed rank
                per_source = self.unit.advantages(rewards, seq_kl=seq_kl.view(k, size).t(), beta=beta,
                                                  greedy_rewards=batch.greedy_rewards, pg=pg, all_sum=run.all_sum)
                _check_advantages(self.unit, per_source, rewards)
                advantages = per_source.t().reshape(-1, 1).expand_as(old_logp).contiguous()
                returns = None
        # 3. the optimisation (the unit's objective may take it over: Experience holds what it needs)
        stats, steps = self._optimise(run, batch, Experience(
            size=size, k=k, mask=mask, action_mask=action_mask, old_logp=old_logp, is_weights=is_weights,
            advantages=advantages, returns=returns, old_values=old_values, reference=reference, beta=beta), step)
        # 4. the KL coefficient (every rank sees the same global mean, so they stay equal)
        totals = run.all_sum(torch.tensor([float(seq_kl.sum()), float(seq_kl.numel())], dtype=torch.float64))
        mean_seq_kl = float(totals[0] / totals[1].clamp(min=1))
        if rl.uses_kl:  # without a KL, an adaptive coefficient would drift towards a target nothing measures
            self.kl.update(mean_seq_kl, int(totals[1]))
        metrics = {
            **{key: sum(v) / len(v) for key, v in stats.items() if v},
            "ratio_max": max(stats["ratio_max"]),
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "kl_k1": float(masked_mean(k1, valid)), "kl_k3": float(masked_mean(k3, valid)), "kl_seq": mean_seq_kl,
            # the token mean's standard error: what tells a negative k1 from noise around zero
            "kl_k1_stderr": _token_stderr(k1, valid),
            "kl_coef": beta, "entropy": float(entropy),
            "advantage_mean": float(masked_mean(advantages, mask)),
            "advantage_std": float(masked_mean((advantages - masked_mean(advantages, mask)) ** 2, mask).sqrt()),
            "sampler_ratio_mean": float(masked_mean(sampler_ratio, mask)),
            "sampler_ratio_max_dev": (float(torch.where(mask, (sampler_ratio - 1).abs(), 0).max())
                                      if mask.any() else 0.0),
            # k1 of KL(sampler || learner) under the transform, per token: how far the samples are from the
            # learner's policy (staleness, a quantised sampler)
            "sampler_kl": float(masked_mean(-sampler_log_ratio, mask)),
            "is_weight_mean": float(masked_mean(is_weights, mask)),
            "optimizer_steps": float(steps), "tokens": float(mask.sum()),
            "excluded_tokens": float((batch.loss_mask & ~mask).sum()),
        }
        if self.unit.greedy_baseline and batch.greedy_rewards is not None:
            metrics["greedy_reward"] = float(batch.greedy_rewards.mean())
        if self.unit.value_head and old_values is not None and returns is not None:
            metrics["explained_variance"] = _explained_variance(old_values, returns, valid)
        self._warn(metrics, items, step, kl_check, mask)
        return metrics

    def _optimise(self, run: StepRunner, batch: GroupBatch, exp: Experience, step: int
                  ) -> tuple[dict[str, list[float]], int]:
        """Step 3, the optimisation: rl.pg.epochs x rl.pg.minibatches optimizer steps of the clipped loss. Returns
        each logged scalar's values over the steps (``ratio_max`` never empty) and the optimizer steps taken."""
        rl, pg = self.rl, self.rl.pg
        size, k, mask, action_mask = exp.size, exp.k, exp.mask, exp.action_mask
        old_logp, is_weights, advantages, returns = exp.old_logp, exp.is_weights, exp.advantages, exp.returns
        old_values, reference, beta = exp.old_values, exp.reference, exp.beta
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        # Every rank must take the same number of optimizer steps (DDP all-reduces each backward).
        minibatches = min(rl.optimisation_minibatches, run.all_min(size))
        stats: dict[str, list[float]] = {"loss": [], "policy_loss": [], "clip_fraction": [], "approx_kl": [],
                                         "ratio_mean": [], "ratio_max": [], "grad_norm": [], "value_loss": [],
                                         "value_clip_fraction": [], "mask_leak": [], "sft_loss": []}
        steps = 0
        stop = False
        for _ in range(rl.optimisation_epochs):
            order = torch.randperm(size, generator=generator) if minibatches > 1 else torch.arange(size)
            for part in order.tensor_split(minibatches):  # exactly that many (chunk may give fewer)
                part = part.to(batch.input_ids.device)
                mb = batch.select(part)
                rows = (torch.arange(k, device=part.device).unsqueeze(1) * size + part.unsqueeze(0)).reshape(-1)
                mb_mask = mask[rows]
                out, gold_logits = self._forward(run, mb)
                logp, raw = _token_logprobs(out.logits, mb.labels, self.transform,
                                            None if action_mask is None else action_mask[rows])
                policy_loss, st = clipped_policy_loss(logp, old_logp[rows], advantages[rows], mb_mask,
                                                      self.clip_eps, weights=is_weights[rows])
                loss = policy_loss
                if self.kl_in_loss and reference is not None:
                    kl_term = masked_mean(kl_estimate(raw, reference[rows], "k3"), mb_mask)
                    loss = loss + beta * kl_term
                if out.values is not None and returns is not None and old_values is not None:
                    value_loss, value_clip = clipped_value_loss(out.values, old_values[rows], returns[rows],
                                                                mb_mask, self.value_clip)
                    loss = loss + pg.vf_coef * value_loss
                    stats["value_loss"].append(value_loss.item())
                    stats["value_clip_fraction"].append(value_clip.item())
                if pg.entropy_coef:
                    loss = loss - pg.entropy_coef * masked_mean(_entropy(out.logits), mb_mask)
                if action_mask is not None:  # NLPO: keep the policy's mass inside its action space
                    with torch.set_grad_enabled(pg.nlpo_leak_coef > 0):  # logged either way
                        leak = masked_mean(mask_leak(out.logits, action_mask[rows]), mb_mask)
                    if pg.nlpo_leak_coef > 0:
                        loss = loss + pg.nlpo_leak_coef * leak
                    stats["mask_leak"].append(leak.item())
                if gold_logits is None:
                    objective = loss * rank_token_share(run, mb_mask)
                else:  # each term a mean over every rank's tokens: the samples', the gold targets'
                    assert mb.gold_labels is not None
                    sft_loss = gold_cross_entropy(gold_logits, mb.gold_labels, IGNORE_INDEX)
                    sample_share, gold_share = rank_shares(run, float(mb_mask.sum()),
                                                           float((mb.gold_labels != IGNORE_INDEX).sum()))
                    objective = loss * sample_share + pg.sft_coef * sft_loss * gold_share
                    loss = loss + pg.sft_coef * sft_loss
                    stats["sft_loss"].append(sft_loss.item())
                stats["grad_norm"].append(run.optimize(objective))
                steps += 1
                for key, value in (("loss", loss), ("policy_loss", policy_loss), *st.items()):
                    stats[key].append(float(value.detach()) if isinstance(value, torch.Tensor) else float(value))
                if pg.target_kl:
                    # One decision on every rank: the approximate KL averaged over the ranks.
                    approx = run.all_sum(torch.tensor([float(st["approx_kl"]), 1.0], dtype=torch.float64))
                    if float(approx[0] / approx[1]) > 1.5 * pg.target_kl:
                        stop = True
                        break
            if stop:
                break
        return stats, steps

    def _whiten(self, run: StepRunner, values: Tensor, mask: Tensor) -> Tensor:
        """Whiten over the valid tokens of the whole batch (all ranks)."""
        picked = torch.where(mask, values, torch.zeros_like(values)).double()
        n = mask.sum().double()
        sums = run.all_sum(torch.stack([picked.sum(), (picked**2).sum(), n]).cpu())
        mean = sums[0] / sums[2].clamp(min=1)
        var = (sums[1] / sums[2].clamp(min=1) - mean**2).clamp(min=0)
        out = (values - mean.to(values)) * torch.rsqrt(var.to(values) + 1e-8)
        return torch.where(mask, out, torch.zeros_like(out))

    def _warn(self, metrics: dict[str, float], items: Sequence[ScoredGroup], step: int, kl_check: Tensor | None,
              mask: Tensor) -> None:
        """The warnings peers' trackers show runs dying without (mismatched generation settings). ``step`` counts
        from 0; the messages count from 1, as the step column of the metrics log does."""
        on_policy = all(g.policy_version == step for g in items)
        if on_policy and metrics["sampler_ratio_max_dev"] > ON_POLICY_RATIO_TOLERANCE and "ratio" not in self._warned:
            self._warned.add("ratio")
            log.warning("step %d: on-policy samples, yet the learner's probabilities differ from the sampler's (max "
                        "|ratio - 1| = %.3g): the generation settings differ between sampler and learner "
                        "(rollout.temperature / top_k / top_p), dropout is on, or the sampler is quantised "
                        "(rollout.ct2_compute_type; truncated importance weights correct for it)", step + 1,
                        metrics["sampler_ratio_max_dev"])
        # Samples y of a sampler q give k1 = E_q[log p(y) - log r(y)] = KL(q || r) - KL(q || p): a stale or
        # quantised sampler pulls k1 below 0 by up to KL(q || p), but k1 + (log q - log p) = log q - log r is
        # never negative on average (kl_check, on the sampled tokens). Below 0 by more than its noise, the
        # samples are not from the policy the KL is taken of. Pipelined runs sample one step stale from their
        # second step on, so this does not wait for on-policy steps.
        if kl_check is None or "kl" in self._warned:
            return
        mean, stderr = float(masked_mean(kl_check, mask)), _token_stderr(kl_check, mask)
        if mean < -(0.01 + 3 * stderr):
            self._warned.add("kl")
            log.warning("step %d: the KL estimate to the reference is negative (k1 token mean %.4f; with the "
                        "sampler's log-ratio to the learner, %.4f ± %.4f, which staleness cannot make negative): "
                        "the samples do not come from the policy the KL is taken of (rollout.temperature / top_k / "
                        "top_p other than 1 / 0 / 1 sample a transformed policy; NLPO samples inside its masking "
                        "policy's top-p set, so probability moving outside that set goes unseen until the mask "
                        "refreshes; or the reference log-probs are misaligned with the samples)",
                        step + 1, metrics["kl_k1"], mean, stderr)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"kl": self.kl.state_dict()}
        head = getattr(self.module, "value_head", None)
        if head is not None:
            state["value_head"] = {k: v.detach().cpu().clone() for k, v in head.state_dict().items()}
        return state  # NLPO's masking policy is not state: each step comes with the weights its groups need

    def load_state_dict(self, state: dict[str, Any]) -> None:
        kl = state["kl"]
        if kl.get("target") != self.rl.kl.target:  # the config decides: the coefficient carries over
            log.warning("rl.kl.target=%s where the checkpoint's controller had %s: resuming with its coefficient "
                        "%.4g, %s", self.rl.kl.target, kl.get("target"), kl["coef"],
                        "now fixed" if self.rl.kl.target is None else "moving towards the new target")
        self.kl.load_state_dict({**kl, "target": self.rl.kl.target})
        head = getattr(self.module, "value_head", None)
        if head is not None:
            head.load_state_dict(state["value_head"])
        self._mask_loaded = None  # (a checkpoint's "mask_model", from before masks came with the steps, is unused)

    def frozen_modules(self) -> list[nn.Module]:
        return [m for m in (self.reference, self.mask_model) if m is not None]


def _token_stderr(values: Tensor, mask: Tensor) -> float:
    """Standard error of the token mean of ``values`` over ``mask`` (tokens taken as independent)."""
    spread = masked_mean((values - masked_mean(values, mask)) ** 2, mask).sqrt()
    return float(spread / mask.sum().clamp(min=1).sqrt())


def _explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the valid tokens (1: perfect critic, <= 0: useless)."""
    var = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    diff = returns - values
    var_diff = masked_mean((diff - masked_mean(diff, mask)) ** 2, mask)
    return float(1 - var_diff / var) if var > 0 else 0.0


def build_objective(rl: RLConfig, rollout: RolloutConfig, policy: Policy, *, seed: int,
                    reference: nn.Module | None = None) -> Any:
    """The objective of ``rl.algorithm`` for ``policy`` (its unit's, rlt2t.common.algorithms)."""
    return rl.unit.objective(rl, rollout, policy, seed=seed, reference=reference)


def _check_advantages(unit: Any, advantages: Any, rewards: Tensor) -> None:
    """A unit's sequence advantages are a finite tensor of its rewards' shape [N, K] (the rewards are finite: the
    reward workers refuse others); a flat [N*K] would pair each sample with another's advantage without an
    error. UnitError naming the unit's method otherwise."""
    where = f"{_unit_name(unit)}: advantages"
    if not isinstance(advantages, torch.Tensor) or advantages.shape != rewards.shape:
        got = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages).__name__
        raise UnitError(f"{where} returned {got}; it must return a tensor of the rewards' shape [N sources, K "
                        f"samples] = {tuple(rewards.shape)}")
    if not bool(torch.isfinite(advantages).all()):
        raise UnitError(f"{where} returned non-finite advantages from finite rewards")


def unit_fault(unit: Any, error: BaseException) -> UnitError | None:
    """``error`` as the user's to fix when a unit of one's own (a module outside rlt2t) raised it in its own code:
    the unit's package (installed or not), or a module of the user's the objective calls (outside rlt2t and the
    installed libraries).
    A UnitError naming the unit and the function and line of the last such frame, which reaches the command line
    as one line (a resume would fail the same way). None (a failed rank, which a resume may recover from) for a
    built-in unit, memory, and an error raised in rlt2t's code or in a collective (torch.distributed) that the
    user's code called."""
    module = type(unit).__module__
    if module.startswith("rlt2t.") or isinstance(error, (torch.OutOfMemoryError, MemoryError, UnitError)):
        return None
    frames = []  # (module, code, line) from the outermost call to where it was raised
    tb = error.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_globals.get("__name__", ""), tb.tb_frame.f_code, tb.tb_lineno))
        tb = tb.tb_next
    libraries = tuple({sysconfig.get_path(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")})

    package = module.split(".")[0]  # the unit's own package is the user's, installed in site-packages or not

    def users(name: str, code: Any) -> bool:
        return (name.split(".")[0] == package
                or not (name.startswith("rlt2t.") or code.co_filename.startswith(libraries)))

    last = max((i for i, (name, code, _) in enumerate(frames) if users(name, code)), default=None)
    if last is None or any(name.startswith(("rlt2t.", "torch.distributed")) for name, _, _ in frames[last + 1:]):
        return None
    _, code, line = frames[last]
    return UnitError(f"{_unit_name(unit)}: {code.co_qualname} raised "
                     f"{type(error).__name__}: {_first_line(error)} ({code.co_filename}, line {line})")


def _first_line(error: BaseException) -> str:
    """An error's message as a one-line UnitError quotes it."""
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def _unit_name(unit: Any) -> str:
    """``rl.algorithm=package.module:Class`` of a unit, as its errors name it."""
    return f"rl.algorithm={type(unit).__module__}:{type(unit).__qualname__}"
