"""R-drop regularisation for SFT (docs/design.md, "The method", step 4).

The same batch goes through the model twice with dropout active; the two predictive distributions are
pulled together by a symmetric KL term:

    loss = 0.5 · (CE1 + CE2) + alpha · KL_sym

`rdrop_loss` is the pure loss on two sets of logits; `rdrop_forward` runs the two passes on a model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F


class RDropLoss(NamedTuple):
    """Scalars; `loss` carries the gradient, `ce` and `kl` are its parts (also differentiable)."""

    loss: torch.Tensor
    ce: torch.Tensor
    kl: torch.Tensor


def rdrop_loss(
    logits1: torch.Tensor,
    logits2: torch.Tensor,
    labels: torch.Tensor,
    alpha: float,
    ignore_index: int = -100,
) -> RDropLoss:
    """R-drop loss of two forward passes over the same batch.

    Shapes: logits1, logits2 [B, T, V]; labels [B, T] (ignore_index marks padding). Returns scalars.

    Let M be the set of label positions != ignore_index and p1, p2 the softmax distributions of the two
    passes at a position. Conventions:
      - CEk = mean over M of -log pk(label)  (the usual token-mean cross-entropy, as HF computes it);
      - ce = 0.5 · (CE1 + CE2);
      - per position, KL_sym = 0.5 · (KL(p1‖p2) + KL(p2‖p1)), with KL(p‖q) = Σ_v p_v (log p_v − log q_v);
      - kl = mean of KL_sym over M (positions not in M contribute nothing);
      - loss = ce + alpha · kl.
    Gradients flow into both logits (no stop-gradient on either side). Computed in float32 whatever the
    logits' dtype. With no position in M all three are 0 (with a zero gradient) instead of NaN.
    """
    if logits1.shape != logits2.shape:
        raise ValueError(
            f"logits1 {tuple(logits1.shape)} and logits2 {tuple(logits2.shape)} must have the same shape"
        )
    if logits1.dim() != 3 or labels.shape != logits1.shape[:2]:
        raise ValueError(
            f"expected logits [B, T, V] and labels [B, T], "
            f"got logits {tuple(logits1.shape)} and labels {tuple(labels.shape)}"
        )
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")

    mask = labels != ignore_index  # [B, T]
    num_tokens = mask.sum().clamp(min=1)
    logp1 = F.log_softmax(logits1.float(), dim=-1)  # [B, T, V]
    logp2 = F.log_softmax(logits2.float(), dim=-1)

    # Gather at a safe index for the padding positions; they are masked out below.
    safe_labels = labels.masked_fill(~mask, 0).unsqueeze(-1)  # [B, T, 1]
    nll1 = -logp1.gather(-1, safe_labels).squeeze(-1)  # [B, T]
    nll2 = -logp2.gather(-1, safe_labels).squeeze(-1)
    ce1 = (nll1 * mask).sum() / num_tokens
    ce2 = (nll2 * mask).sum() / num_tokens
    ce = 0.5 * (ce1 + ce2)

    # 0.5·(KL(p1‖p2) + KL(p2‖p1)) = 0.5 · Σ_v (p1 − p2)(log p1 − log p2)
    kl_per_token = 0.5 * ((logp1.exp() - logp2.exp()) * (logp1 - logp2)).sum(-1)  # [B, T]
    kl = (kl_per_token * mask).sum() / num_tokens
    return RDropLoss(loss=ce + alpha * kl, ce=ce, kl=kl)


def rdrop_forward(model: torch.nn.Module, batch: Mapping[str, Any], alpha: float) -> RDropLoss:
    """Run `model(**batch)` twice and return `rdrop_loss` of the two logits against `batch["labels"]`.

    The model must be in training mode: otherwise dropout is off, both passes agree and R-drop silently
    reduces to plain CE. `batch` holds the model's inputs and labels [B, T]; the output's `.logits` are
    [B, T, V].
    """
    if not model.training:
        raise RuntimeError(
            "rdrop_forward needs model.train(): in eval mode dropout is off and the KL term is 0"
        )
    if "labels" not in batch:
        raise ValueError("batch must contain 'labels' [B, T]")
    logits1 = model(**batch).logits
    logits2 = model(**batch).logits
    return rdrop_loss(logits1, logits2, batch["labels"], alpha)
