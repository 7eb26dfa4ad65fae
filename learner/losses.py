"""The pairwise rank loss of rlt2t's rank-RL stage (DESIGN.md, "Rank loss").

Pure tensor functions, torch only, so they can be tested against hand-computed values.
`pairwise_rank_loss` compares the token scores (``rlt2t.common.scoring.token_scores``) of a better
sequence `a` and a worse sequence `b` for the same source, weighting the steps from their first
divergence with a decaying factor.

Running the model to get the logits lives in `rlt2t.learner.rank_step`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Weights at or below this are treated as zero (DESIGN.md); it also keeps far-away steps of long
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
    weights = rank_weights(labels_a, labels_b, alpha, dtype=dtype)
    counted = (
        (labels_a != ignore_index)
        & (labels_b != ignore_index)
        & (weights > MIN_WEIGHT)
        & use_rank.bool().unsqueeze(1)
    )
    weights = torch.where(counted, weights, torch.zeros_like(weights))

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
