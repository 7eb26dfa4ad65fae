"""Per-token scores of label sequences under a model's logits: the teacher-forcing primitive shared by the
learner (rank loss, policy-gradient log-probs), the policy server (`/v1/score`) and reranking. Torch only.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor
from transformers.modeling_outputs import BaseModelOutput

from rlt2t.common.families import decoder_input_ids

ScoreKind = Literal["logits", "logprobs"]
SCORE_KINDS: tuple[str, ...] = ("logits", "logprobs")


def token_scores(
    logits: Tensor,
    labels: Tensor,
    kind: ScoreKind = "logprobs",
    ignore_index: int = -100,
) -> Tensor:
    """Score of each label token at each decoder step.

    Args:
        logits: [B, T, V] decoder logits; step t predicts labels[:, t].
        labels: [B, T] integer label ids, `ignore_index` at padding.
        kind: "logits" (the raw logit of the label token, what the original rlt2t trained with) or
            "logprobs" (its log-softmax, consistent with how candidates are reranked at inference).
        ignore_index: label value marking padding.

    Returns:
        [B, T] scores in float32 (float64 if the logits are float64); 0 at padded positions.
    """
    if kind not in SCORE_KINDS:
        raise ValueError(f"kind must be one of {SCORE_KINDS}, got {kind!r}")
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if labels.shape != logits.shape[:2]:
        raise ValueError(
            f"labels must be [B, T] = {tuple(logits.shape[:2])} to match logits, got {tuple(labels.shape)}"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got dtype {labels.dtype}")

    # Score in at least float32: bf16 logits lose too much in logsumexp and in small score differences.
    dtype = torch.promote_types(logits.dtype, torch.float32)
    valid = labels != ignore_index
    # gather cannot index with -100: point padding at token 0 and zero its score afterwards.
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels)).long()
    picked = logits.gather(-1, safe_labels.unsqueeze(-1)).squeeze(-1).to(dtype)
    if kind == "logprobs":
        # log_softmax(x)[y] = x[y] - logsumexp(x), without materialising a second [B, T, V] tensor.
        picked = picked - torch.logsumexp(logits.to(dtype), dim=-1)
    return torch.where(valid, picked, torch.zeros_like(picked))


@torch.inference_mode()
def sequence_logprobs(model, input_ids: Tensor, attention_mask: Tensor, rows: list[list[int]],
                      k: int) -> list[list[float]]:
    """Raw teacher-forced log-probs of ``k`` label rows per source, the encoder run once per source.

    input_ids, attention_mask: [B, S]; ``rows``: B·k id lists, row ``i * k + j`` a label sequence of source i
    (the sampler's layout). Returns, per row, the log-softmax of the logits at each of its tokens.
    """
    size = input_ids.shape[0]
    if len(rows) != size * k:
        raise ValueError(f"rows: need {size} x {k} = {size * k} label rows, got {len(rows)}")
    if not rows:
        return []
    config = model.config
    device = next(model.parameters()).device
    width = max(1, max(len(r) for r in rows))
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for r, ids in enumerate(rows):
        labels[r, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
    decoder_input = decoder_input_ids(labels, config)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    hidden = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    logits = model(encoder_outputs=BaseModelOutput(last_hidden_state=hidden.repeat_interleave(k, dim=0)),
                   attention_mask=attention_mask.repeat_interleave(k, dim=0),
                   decoder_input_ids=decoder_input.to(device), use_cache=False).logits
    scores = token_scores(logits, labels.to(device), "logprobs").cpu()
    return [scores[r, : len(ids)].tolist() for r, ids in enumerate(rows)]
