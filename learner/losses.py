"""The RL losses as pure tensor functions, torch only, each tested against a hand computation or a
Python-loop reference (docs/design.md, "Rank loss" and "Policy-gradient algorithms").

Rank RL: `pairwise_rank_loss` compares the token scores (``rlt2t.common.scoring.token_scores``) of a
better sequence `a` and a worse sequence `b` for the same source, weighting the steps from their first
divergence with a decaying factor.

Policy gradient: `kl_estimate` (k1, k2, k3); the sequence advantages `baseline_advantages` (SCST's),
`leave_one_out_advantages` (RLOO's), `normalised_advantages` (GRPO's); `gae`, `clipped_policy_loss`,
`clipped_value_loss`, `masked_mean` / `masked_whiten`, `mask_leak` (NLPO), and the `AdaptiveKLController`.
Both: `gold_cross_entropy`, the CE on the gold targets (rank RL's CE term, the policy gradients' likelihood
term). "Token mean" everywhere is the sum over valid (mask = 1) tokens divided by their count, over the
whole batch.

Running the model to get the logits lives in `rlt2t.learner.rank_step` and `rlt2t.learner.group_step`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

# Weights at or below this are treated as zero (docs/design.md, "Rank loss"); it also keeps far-away steps of long
# sequences from contributing denormal noise when alpha < 1.
MIN_WEIGHT = 1e-8
# Added to the weight sum so that a batch where nothing counts gives 0 / eps = 0, not 0 / 0.
WEIGHT_SUM_EPS = 1e-8


def rank_weights(
    labels_a: Tensor, labels_b: Tensor, alpha: float, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Delay weights w_t = alpha^(t - s) for t >= s, 0 before s, where s is the first step at which
    labels_a and labels_b differ (T when they never do, so identical pairs get all-zero weights).

    Padding against a real token counts as a difference. Shapes: labels [B, T] -> weights [B, T] of dtype.
    Exclusion of padded steps and of use_rank = 0 pairs is done by `pairwise_rank_loss`, not here.
    """
    batch, length = labels_a.shape
    if length == 0:  # argmax cannot reduce an empty dimension
        return torch.zeros((batch, 0), dtype=dtype, device=labels_a.device)
    diff = labels_a != labels_b
    # argmax returns the first maximal index, i.e. the first True; rows without a difference get T.
    no_diff = torch.full((batch,), length, dtype=torch.long, device=labels_a.device)
    first = torch.where(diff.any(dim=1), diff.int().argmax(dim=1), no_diff)
    steps = torch.arange(length, device=labels_a.device).expand(batch, length)
    exponent = steps - first.unsqueeze(1)
    base = torch.full((), alpha, dtype=dtype, device=labels_a.device)
    # clamp keeps alpha ** negative out of the computation (it would overflow for small alpha).
    weights = base.pow(exponent.clamp(min=0).to(dtype))
    return torch.where(exponent >= 0, weights, torch.zeros_like(weights))


def counted_rank_weights(labels_a: Tensor, labels_b: Tensor, use_rank: Tensor, alpha: float,
                         ignore_index: int = -100, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """The delay weights of the steps `pairwise_rank_loss` counts (0 elsewhere) and the [B, T] mask of those
    steps; the weights' sum is the loss's denominator."""
    weights = rank_weights(labels_a, labels_b, alpha, dtype=dtype)
    counted = (
        (labels_a != ignore_index)
        & (labels_b != ignore_index)
        & (weights > MIN_WEIGHT)
        & use_rank.bool().unsqueeze(1)
    )
    return torch.where(counted, weights, torch.zeros_like(weights)), counted


def pairwise_rank_loss(
    scores_a: Tensor,
    scores_b: Tensor,
    labels_a: Tensor,
    labels_b: Tensor,
    use_rank: Tensor,
    alpha: float = 0.95,
    ignore_index: int = -100,
) -> tuple[Tensor, Tensor]:
    """Delay-weighted pairwise rank loss of a better sequence `a` over a worse sequence `b`.

    With d_t = z_a[t] - z_b[t], l_t = -log sigmoid(d_t), s the first step where the labels differ and
    w_t = alpha^(t - s) for t >= s (0 before), the loss is sum(w_t * l_t) / (sum(w_t) + 1e-8) pooled over
    the whole batch, counting only steps where neither label is `ignore_index`, w_t > 1e-8 and the pair
    has use_rank = 1.

    Args:
        scores_a, scores_b: [B, T] token scores of a and b (see `token_scores`).
        labels_a, labels_b: [B, T] integer labels. The caller pads both to one common T with
            `ignore_index` (padding against a real token then counts as a difference, which is right:
            the sequences differ in length there).
        use_rank: [B] bool or 0/1; pairs with 0 (equal strings or tied rewards) are ignored.
        alpha: delay factor in [0, 1].
        ignore_index: label value marking padding.

    Returns:
        (loss, accuracy), both 0-dim. loss carries the gradient; it is exactly 0 (with a defined zero
        gradient) when no step counts. accuracy (no gradient) is the fraction of counted pairs (use_rank = 1
        and at least one counted step) whose weighted score sum(w_t * z_a[t]) exceeds sum(w_t * z_b[t]);
        0 when no pair counts.
    """
    if scores_a.dim() != 2:
        raise ValueError(f"scores_a must be [B, T], got shape {tuple(scores_a.shape)}")
    for name, tensor in (("scores_b", scores_b), ("labels_a", labels_a), ("labels_b", labels_b)):
        if tensor.shape != scores_a.shape:
            raise ValueError(
                f"{name} must have the shape of scores_a {tuple(scores_a.shape)}, got {tuple(tensor.shape)}"
            )
    for name, tensor in (("labels_a", labels_a), ("labels_b", labels_b)):
        if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got dtype {tensor.dtype}")
    if use_rank.shape != scores_a.shape[:1]:
        raise ValueError(f"use_rank must be [B] = [{scores_a.shape[0]}], got shape {tuple(use_rank.shape)}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")

    dtype = torch.promote_types(scores_a.dtype, torch.float32)
    z_a, z_b = scores_a.to(dtype), scores_b.to(dtype)
    weights, counted = counted_rank_weights(labels_a, labels_b, use_rank, alpha, ignore_index, dtype)

    # where (not multiply) drops excluded steps, so an infinite score there cannot turn into 0 * inf = NaN.
    step_loss = -F.logsigmoid(z_a - z_b)
    weighted = torch.where(counted, weights * step_loss, torch.zeros_like(step_loss))
    loss = weighted.sum() / (weights.sum() + WEIGHT_SUM_EPS)

    with torch.no_grad():
        zero = torch.zeros_like(z_a)
        sum_a = torch.where(counted, weights * z_a, zero).sum(dim=1)
        sum_b = torch.where(counted, weights * z_b, zero).sum(dim=1)
        pair_counted = counted.any(dim=1)
        correct = (sum_a > sum_b) & pair_counted
        accuracy = correct.sum().to(dtype) / pair_counted.sum().clamp(min=1).to(dtype)
    return loss, accuracy


# ------------------------------------------------------------------------------------------ policy gradient

KLKind = Literal["k1", "k2", "k3"]
GroupScale = Literal["group", "batch", "none"]
# GRPO's std guard (docs/design.md): a group whose rewards all tie gets advantage 0, not 0 / 0.
GRPO_STD_EPS = 1e-4


def gold_cross_entropy(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Likelihood training's loss: the mean of -log p(label) over the non-padding label tokens, in float32
    (Hugging Face's own loss). logits [B, T, V], labels [B, T]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=ignore_index)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Token mean: sum(values where mask) / count(mask); 0 (with a zero gradient) when nothing is masked in.

    values, mask: the same shape; mask bool or 0/1. ``where`` (not multiply) so that an excluded -inf or NaN
    cannot leak into the sum.
    """
    mask = mask.bool()
    picked = torch.where(mask, values, torch.zeros_like(values))
    return picked.sum() / mask.sum().clamp(min=1).to(values.dtype)


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(values - mean) / sqrt(var + eps) over the masked-in entries (population variance); entries outside
    the mask are returned as 0. ``shift_mean=False`` only rescales."""
    mask = mask.bool()
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    out = (values - mean) * torch.rsqrt(var + eps) if shift_mean else values * torch.rsqrt(var + eps)
    return torch.where(mask, out, torch.zeros_like(out))


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: KLKind = "k3") -> Tensor:
    """Per-token estimate of KL(policy || reference) from the log-probs of sampled tokens.

    With d = logp - ref_logp: k1 = d (unbiased, can be negative per token); k2 = d^2 / 2; k3 = exp(-d) + d - 1
    (unbiased for the KL under the policy's samples, and >= 0 for every token). Shapes: any, equal; returns
    the same shape.
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} must have one shape")
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.expm1(-d) + d  # exp(-d) - 1 + d, accurate for small d
    raise ValueError(f"kind must be 'k1', 'k2' or 'k3', got {kind!r}")


def mask_leak(logits: Tensor, allowed: Tensor) -> Tensor:
    """-log of the probability the softmax of ``logits`` puts on the ``allowed`` tokens, per position.

    This is KL(q || p) for p = softmax(logits) and q = p restricted to the allowed set and renormalised: 0 when
    every bit of mass is allowed, growing as mass moves outside. NLPO's loss on masked log-probs is blind to the
    logits of masked-out tokens; this term is what keeps the policy's mass inside its action space.
    logits [..., V] (any float dtype, computed in float32), allowed [..., V] bool with at least one True per
    position; returns [...].
    """
    if logits.shape != allowed.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and allowed {tuple(allowed.shape)} must have one shape")
    scores = logits.float()
    inside = torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.logsumexp(scores, dim=-1) - inside


def baseline_advantages(rewards: Tensor, baseline: Tensor | None) -> Tensor:
    """Sequence advantages against a per-source baseline: A_k = r_k - baseline. rewards [N, K], baseline [N]
    (e.g. the reward of the source's greedy decode) -> [N, K]."""
    _check_rewards(rewards)
    if baseline is None or baseline.shape != rewards.shape[:1]:
        got = None if baseline is None else tuple(baseline.shape)
        raise ValueError(f"the baseline must have shape [N] = [{rewards.shape[0]}], got {got}")
    return rewards - baseline.unsqueeze(1)


def leave_one_out_advantages(rewards: Tensor) -> Tensor:
    """A_k = r_k - the mean of the source's other K - 1 rewards (K >= 2): [N, K] -> [N, K]."""
    k = _check_rewards(rewards, min_k=2)
    return rewards - (rewards.sum(dim=1, keepdim=True) - rewards) / (k - 1)


def normalised_advantages(rewards: Tensor, *, scale: GroupScale = "group",
                          all_sum: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """A_k = (r_k - mean(r)) / (s + 1e-4) over each source's K >= 2 rewards: [N, K] -> [N, K]. s by ``scale``:
    ``"group"``, the std of the source's K rewards (ddof 1); ``"batch"``, the std (ddof 0) of every r_k - mean(r)
    of the batch, over every learner rank when ``all_sum`` sums a float64 vector over them, so a source's
    advantages grow with how far apart its rewards are (with ``"group"`` K rewards that differ by a hair get
    advantages of +-1 like any others); ``"none"``, s = 1 and no guard (Dr. GRPO)."""
    _check_rewards(rewards, min_k=2)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "group":
        return centred / (rewards.std(dim=1, keepdim=True, unbiased=True) + GRPO_STD_EPS)
    if scale == "batch":
        c = centred.double()
        sums = torch.stack([(c**2).sum(), torch.tensor(float(c.numel()), dtype=torch.float64)]).cpu()
        total = all_sum(sums) if all_sum is not None else sums
        # Each source's deviations sum to 0, so the batch's mean deviation is 0 and the std is the RMS.
        std = (total[0] / total[1].clamp(min=1)).sqrt()
        return centred / (std.to(centred) + GRPO_STD_EPS)
    if scale == "none":
        return centred
    raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")


def _check_rewards(rewards: Tensor, min_k: int = 1) -> int:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [N, K], got shape {tuple(rewards.shape)}")
    k = rewards.shape[1]
    if k < min_k:
        raise ValueError(f"these advantages need K >= {min_k} candidates per source, got {k}")
    return k


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over right-padded token sequences.

    rewards, values, mask: [B, T]; mask marks valid tokens, a prefix of each row. With V_{T+1} = 0 past a
    row's last valid token: delta_t = r_t + gamma * V_{t+1} - V_t, A_t = sum_l (gamma * lam)^l delta_{t+l},
    returns = A + V. Returns (advantages, returns), [B, T], 0 outside the mask; no gradient flows.
    """
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError(f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask "
                         f"{tuple(mask.shape)} must all be [B, T]")
    mask = mask.bool()
    rewards, values = rewards.detach(), values.detach()
    zero = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    running = zero
    next_value = zero
    for t in range(rewards.shape[1] - 1, -1, -1):
        valid = mask[:, t]
        # Past a row's end (or at padding) the next value and the running sum restart from 0.
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(valid, delta + gamma * lam * running, zero)
        next_value = torch.where(valid, values[:, t], zero)
        advantages[:, t] = running
    returns = torch.where(mask, advantages + values, torch.zeros_like(values))
    return advantages, returns


def clipped_policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_eps: float,
                        weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate as a token mean: max(-rho * A, -clip(rho, 1 - eps, 1 + eps) * A),
    rho = exp(logp - old_logp).

    logp: [B, T] log-probs under the current policy (with gradient); old_logp: [B, T] the same tokens
    under the policy the ratio is taken against (no gradient); advantages: [B, T] or [B] (a sequence
    advantage broadcast over its tokens); mask: [B, T]. ``weights`` [B, T] (optional, no gradient)
    multiplies each token's term: truncated importance weights for a sampler that differs from the
    learner. ``clip_eps=inf`` gives the unclipped policy gradient (A2C). Returns (loss, stats) with
    stats ``clip_fraction`` (tokens whose ratio left the clip range), ``approx_kl`` (token mean of
    k3 between old and current, Schulman's estimator) and ``ratio_mean`` / ``ratio_max``; no gradient.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logp)
    if not (logp.shape == old_logp.shape == advantages.shape == mask.shape):
        raise ValueError(f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)}, advantages "
                         f"{tuple(advantages.shape)} and mask {tuple(mask.shape)} must have one shape")
    # A token whose old log-prob is -inf has no ratio: it must not be in the mask (the caller excludes it).
    mask = mask.bool()
    log_ratio = torch.where(mask, logp - torch.where(mask, old_logp.detach(), torch.zeros_like(logp)),
                            torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)
    advantages = advantages.detach()
    unclipped = -ratio * advantages
    clipped = -torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    per_token = torch.maximum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights.detach()
    loss = masked_mean(per_token, mask)
    with torch.no_grad():
        outside = (ratio < 1.0 - clip_eps) | (ratio > 1.0 + clip_eps)
        stats = {"clip_fraction": masked_mean(outside.to(logp.dtype), mask),
                 "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
                 "ratio_mean": masked_mean(ratio, mask),
                 "ratio_max": torch.where(mask, ratio, torch.zeros_like(ratio)).max() if mask.any()
                 else torch.zeros((), dtype=logp.dtype)}
    return loss, stats


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
                       clip_eps: float) -> tuple[Tensor, Tensor]:
    """1/2 token mean of max((V - R)^2, (old_V + clip(V - old_V, -eps, eps) - R)^2); [B, T] each.
    ``clip_eps=inf`` gives the plain squared error. Returns (loss, clip fraction: tokens whose value moved
    more than eps from old_V)."""
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError(f"values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, returns "
                         f"{tuple(returns.shape)} and mask {tuple(mask.shape)} must have one shape")
    old_values, returns = old_values.detach(), returns.detach()
    clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    per_token = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    loss = 0.5 * masked_mean(per_token, mask)
    with torch.no_grad():
        clip_fraction = masked_mean(((values - old_values).abs() > clip_eps).to(values.dtype), mask)
    return loss, clip_fraction


class AdaptiveKLController:
    """The KL coefficient of Ziegler et al. (2019), as RL4LMs and trl use it.

    ``update(kl, n)``: e = clip(kl / target - 1, -0.2, 0.2); coef <- coef * (1 + e * n / horizon), with
    ``kl`` the batch's mean KL per sequence and ``n`` the sequences in the batch. ``target=None`` keeps the
    coefficient fixed. Its state is two floats (``state_dict``), saved with the learner's.
    """

    def __init__(self, init_coef: float, target: float | None, horizon: int) -> None:
        if init_coef < 0:
            raise ValueError(f"init_coef must be >= 0, got {init_coef}")
        if target is not None and not target > 0:
            raise ValueError(f"target must be > 0 (or None for a fixed coefficient), got {target}")
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        self.coef = float(init_coef)
        self.target = target
        self.horizon = horizon

    def update(self, kl: float, n: int) -> float:
        """Move the coefficient towards the target KL; returns the new coefficient."""
        if self.target is not None:
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.coef *= 1.0 + error * n / self.horizon
        return self.coef

    def state_dict(self) -> dict[str, float | None]:
        return {"coef": self.coef, "target": self.target}

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        self.coef = float(state["coef"])  # type: ignore[arg-type]
        self.target = state["target"]
