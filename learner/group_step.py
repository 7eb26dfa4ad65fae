"""The policy-gradient learner's forward pass: K sampled label rows per source, one encoder pass.

Group algorithms (SCST, RLOO, GRPO) and PPO score K samples of every source. Encoding the source once
and decoding its K rows against the same encoder states is the rank step's trick extended to K rows
(``rlt2t.learner.rank_step``): each decoder layer's cross-attention keys and values are projected once per
source and tiled K times. :func:`naive_group_forward` (K full passes, each re-encoding) is the
reference the shared version is tested against.

Row layout (rep-major, as the cross-attention cache tiles): row ``j * B + i`` is sample j of source i.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from rlt2t.common.collate import IGNORE_INDEX
from rlt2t.learner.rank_step import _decoder_special_ids, repeated_encoder_states, shift_right


class GroupOutput(NamedTuple):
    logits: Tensor
    """[K*B, T, V] decoder logits; step t predicts labels[:, t]."""
    values: Tensor | None
    """[K*B, T] value estimates from the value head on the decoder's final hidden state (None without one)."""


class ValueHead(nn.Module):
    """PPO's critic: a linear map of the decoder's final hidden state to a scalar per token.

    Initialised to zero output (weights and bias 0), so the first advantages are the raw returns and the
    head does not perturb a policy that starts from SFT.
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        """[N, T, H] -> [N, T] (float32, also under mixed precision: autocast would run the product in bf16 and
        round the critic's values, hence GAE's advantages and returns)."""
        with torch.autocast(hidden.device.type, enabled=False):
            return self.linear(hidden.float()).squeeze(-1)


def _check(input_ids: Tensor, labels: Tensor, k: int) -> int:
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    size = input_ids.shape[0]
    if labels.dim() != 2 or labels.shape[0] != k * size:
        raise ValueError(f"labels must be [K*B, T] = [{k * size}, T], got {tuple(labels.shape)}")
    return size


def group_forward(model: Any, input_ids: Tensor, attention_mask: Tensor, labels: Tensor, k: int,
                  value_head: ValueHead | None = None, *, share_cross_attention: bool = True) -> GroupOutput:
    """Teacher-forced logits (and values) of K label rows per source with one encoder pass.

    input_ids, attention_mask: [B, S]; labels: [K*B, T] rep-major (row j*B + i = sample j of source i),
    padded with -100. In eval mode the result equals :func:`naive_group_forward` (the decoder is causal,
    so padding does not change the logits of real positions).
    """
    _check(input_ids, labels, k)
    start_id, pad_id = _decoder_special_ids(model)
    hidden = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)[0]
    outputs = model(
        **repeated_encoder_states(model, hidden, k, share=share_cross_attention),
        attention_mask=attention_mask.repeat(k, 1),
        decoder_input_ids=shift_right(labels, start_id, pad_id),
        output_hidden_states=value_head is not None,
    )
    values = value_head(outputs.decoder_hidden_states[-1]) if value_head is not None else None
    return GroupOutput(outputs.logits, values)


def naive_group_forward(model: Any, input_ids: Tensor, attention_mask: Tensor, labels: Tensor, k: int,
                        value_head: ValueHead | None = None) -> GroupOutput:
    """K full forward passes (each re-encoding the sources): the reference of :func:`group_forward`."""
    size = _check(input_ids, labels, k)
    start_id, pad_id = _decoder_special_ids(model)
    logits, values = [], []
    for j in range(k):
        rows = labels[j * size : (j + 1) * size]
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                    decoder_input_ids=shift_right(rows, start_id, pad_id), output_hidden_states=value_head is not None)
        logits.append(out.logits)
        if value_head is not None:
            values.append(value_head(out.decoder_hidden_states[-1]))
    return GroupOutput(torch.cat(logits), torch.cat(values) if value_head is not None else None)


def label_mask(labels: Tensor) -> Tensor:
    """[N, T] bool: real label tokens (not -100 padding)."""
    return labels != IGNORE_INDEX


class GroupPolicy(nn.Module):
    """The policy (and PPO's value head) as one module, so DistributedDataParallel wraps the whole
    forward: ``DDP(GroupPolicy(model, head))``. Checkpoints save ``.model`` (the policy's own parameter
    names) and the head's state separately."""

    def __init__(self, model: nn.Module, value_head: ValueHead | None = None) -> None:
        super().__init__()
        self.model = model
        self.value_head = value_head
        self.share_cross_attention = True
        """False under the sharded learner (``repeated_encoder_states``)."""

    def forward(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor, k: int) -> GroupOutput:
        return group_forward(self.model, input_ids, attention_mask, labels, k, self.value_head,
                             share_cross_attention=self.share_cross_attention)
