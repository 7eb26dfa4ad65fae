"""The learner's rank-RL objective on any encoder-decoder: CE(gold) + loss_weight * rank_loss.

`shared_encoder_rank_loss` is the one the learner uses: it encodes each source once and runs a single
batched decoder pass over the three label sets (gold, a, b). `naive_rank_loss` is the original rlt2t
formulation (three full forward passes, each re-encoding the source), kept as the reference the shared
version is tested against. The loss arithmetic itself is in `rlt2t.learner.losses` (torch only).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput

from rlt2t.common.collate import IGNORE_INDEX
from rlt2t.common.families import cross_attention_states, cross_attentions, shift_labels, with_cache
from rlt2t.common.policy import PolicyModel
from rlt2t.common.scoring import SCORE_KINDS, ScoreKind, token_scores
from rlt2t.learner.losses import gold_cross_entropy, pairwise_rank_loss


@dataclass(frozen=True, eq=False)
class RankBatch:
    """One learner batch of rank-RL examples (a collated batch of scored pairs).

    Labels use IGNORE_INDEX (-100) for padding and end with EOS like ordinary seq2seq labels; the decoder
    inputs are derived from them by shifting right. The collator pads labels_a and labels_b to one
    common length T; gold_labels may have a different length Tg.
    """

    input_ids: Tensor
    """[B, S] source token ids."""
    attention_mask: Tensor
    """[B, S] 1 for real source tokens, 0 for padding."""
    gold_labels: Tensor
    """[B, Tg] reference target ids (the CE term)."""
    labels_a: Tensor
    """[B, T] the better candidate's ids."""
    labels_b: Tensor
    """[B, T] the worse candidate's ids."""
    use_rank: Tensor
    """[B] bool or 0/1: 0 where a and b are equal strings or their rewards tie."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, Tensor):
                raise TypeError(f"RankBatch.{field.name} must be a torch.Tensor, got {type(value).__name__}")
            wanted_dim = 1 if field.name == "use_rank" else 2
            if value.dim() != wanted_dim:
                raise ValueError(
                    f"RankBatch.{field.name} must have {wanted_dim} dims, got {tuple(value.shape)}"
                )
            if value.shape[0] != self.input_ids.shape[0]:
                raise ValueError(
                    f"RankBatch.{field.name} has batch size {value.shape[0]}, "
                    f"input_ids has {self.input_ids.shape[0]}"
                )
            if field.name != "use_rank" and (value.dtype.is_floating_point or value.dtype == torch.bool):
                raise ValueError(f"RankBatch.{field.name} must be an integer tensor, got dtype {value.dtype}")
        if self.attention_mask.shape != self.input_ids.shape:
            raise ValueError(
                f"RankBatch.attention_mask shape {tuple(self.attention_mask.shape)} must equal "
                f"input_ids shape {tuple(self.input_ids.shape)}"
            )
        if self.labels_a.shape != self.labels_b.shape:
            raise ValueError(
                f"RankBatch.labels_a {tuple(self.labels_a.shape)} and labels_b {tuple(self.labels_b.shape)} "
                "must be padded to the same length"
            )

    def to(self, device: torch.device | str) -> RankBatch:
        """The same batch with every tensor moved to `device`."""
        return RankBatch(**{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})


class RankLossOutput(NamedTuple):
    """Result of one rank-RL step; all 0-dim tensors."""

    loss: Tensor
    """ce + loss_weight * rank: the value to backpropagate."""
    ce: Tensor
    """Mean token cross-entropy of the gold labels."""
    rank: Tensor
    """The pairwise rank loss (see `pairwise_rank_loss`)."""
    accuracy: Tensor
    """Fraction of counted pairs where a outscores b (no gradient)."""


# Decoder inputs from labels ([B, T] -> [B, T], start first, -100 -> pad): the families module's one definition.
shift_right = shift_labels


def pad_labels(labels: Tensor, length: int) -> Tensor:
    """Right-pad [B, T] labels with IGNORE_INDEX to [B, length] (length >= T)."""
    if length < labels.shape[1]:
        raise ValueError(f"length {length} is shorter than the labels ({labels.shape[1]})")
    return F.pad(labels, (0, length - labels.shape[1]), value=IGNORE_INDEX)


def _decoder_special_ids(model: PolicyModel) -> tuple[int, int]:
    config = model.config
    start, pad = config.decoder_start_token_id, config.pad_token_id
    if start is None or pad is None:
        raise ValueError(
            f"model.config needs decoder_start_token_id and pad_token_id, got {start!r} and {pad!r}"
        )
    return start, pad


def _check_options(score_kind: str, alpha: float) -> None:
    # Checked before the forward pass so a config typo does not cost a batch of compute first.
    if score_kind not in SCORE_KINDS:
        raise ValueError(f"score_kind must be one of {SCORE_KINDS}, got {score_kind!r}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")


def shared_cross_attention_cache(model: Any, hidden: Tensor, repeats: int) -> EncoderDecoderCache:
    """Cross-attention keys/values of each source computed once and tiled ``repeats`` times.

    hidden: [B, S, H] encoder states. Returns an encoder-decoder cache whose cross-attention part holds, for
    every decoder layer, keys and values [repeats·B, heads, S, head_dim] (row r·B + i is source i) and whose
    self-attention part is empty, so a decoder pass over repeats·B label rows reads them instead of projecting
    the repeated states again (about a quarter of the decoder's work for three label sets). Works for every
    family (rlt2t.common.families.cross_attentions finds the projections: BART-style ``encoder_attn``, T5's
    ``EncDecAttention``, a BERT decoder's ``crossattention``); the values equal what each layer would compute.
    """
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    states = cross_attention_states(model, hidden)
    size, length = states.shape[:2]
    for attn in cross_attentions(model):
        key = attn.key(states).view(size, length, -1, attn.head_dim).transpose(1, 2)
        value = attn.value(states).view(size, length, -1, attn.head_dim).transpose(1, 2)
        cache.cross_attention_cache.update(key.repeat(repeats, 1, 1, 1), value.repeat(repeats, 1, 1, 1),
                                           attn.layer_idx)
        cache.is_updated[attn.layer_idx] = True
    return cache


def repeated_encoder_states(model: Any, hidden: Tensor, repeats: int, *, share: bool = True) -> dict[str, Any]:
    """The decoder call's encoder inputs for ``repeats``·B label rows over B sources' states ``hidden``.

    ``share``: each layer's cross-attention keys and values projected once per source and tiled
    (:func:`shared_cross_attention_cache`; the decoder then reads only the repeated states' shape). Without it
    the states themselves are repeated and every layer projects them ``repeats`` times in its own forward: the
    sharded learner's way (rl.strategy=fsdp), where a layer's weights exist whole only inside its forward.
    """
    if not share:  # and no cache at all: a layer's forward then depends on its inputs alone (recomputable)
        return {"encoder_outputs": BaseModelOutput(last_hidden_state=hidden.repeat(repeats, 1, 1)), "use_cache": False}
    cache = shared_cross_attention_cache(model, hidden, repeats)
    return {"encoder_outputs": BaseModelOutput(last_hidden_state=hidden.detach().repeat(repeats, 1, 1)),
            **with_cache(cache)}


def shared_encoder_rank_loss(
    model: Any,
    batch: RankBatch,
    *,
    score_kind: ScoreKind = "logprobs",
    loss_weight: float = 0.2,
    alpha: float = 0.95,
    share_cross_attention: bool = True,
) -> RankLossOutput:
    """CE(gold) + loss_weight * rank_loss with one encoder pass and one batched decoder pass.

    `model` is a bare Hugging Face encoder-decoder (e.g. BartForConditionalGeneration), not a DDP wrapper:
    under DDP wrap `SharedEncoderRankLoss(model)` instead, so that DDP sees the whole step as one forward.

    The encoder states [B, S, H] are projected to each decoder layer's cross-attention keys and values once
    and tiled to 3B rows; gold, a and b labels are padded with -100 to one length L = max(Tg, T) and
    decoded together as [3B, L]. The decoder is causal, so the extra padding
    does not change the logits of real positions. In eval mode the result equals `naive_rank_loss`; in
    train mode the three decoder passes share one encoder dropout mask (the naive version draws three).
    """
    _check_options(score_kind, alpha)
    start_id, pad_id = _decoder_special_ids(model)
    size, length = batch.labels_a.shape
    common = max(batch.gold_labels.shape[1], length)

    hidden = model.get_encoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask)[0]
    labels = torch.cat(
        [
            pad_labels(batch.gold_labels, common),
            pad_labels(batch.labels_a, common),
            pad_labels(batch.labels_b, common),
        ]
    )
    outputs = model(
        **repeated_encoder_states(model, hidden, 3, share=share_cross_attention),
        attention_mask=batch.attention_mask.repeat(3, 1),
        decoder_input_ids=shift_right(labels, start_id, pad_id),
    )
    logits_gold, logits_a, logits_b = outputs.logits.split(size)  # each [B, L, V]
    labels_gold = labels[:size]

    # Same quantity as HF's outputs.loss for the gold batch: mean over non-padding gold tokens.
    ce = gold_cross_entropy(logits_gold, labels_gold, IGNORE_INDEX)
    scores_a = token_scores(logits_a[:, :length], batch.labels_a, score_kind, IGNORE_INDEX)
    scores_b = token_scores(logits_b[:, :length], batch.labels_b, score_kind, IGNORE_INDEX)
    rank, accuracy = pairwise_rank_loss(
        scores_a, scores_b, batch.labels_a, batch.labels_b, batch.use_rank, alpha, IGNORE_INDEX
    )
    return RankLossOutput(ce + loss_weight * rank, ce, rank, accuracy)


def naive_rank_loss(
    model: Any,
    batch: RankBatch,
    *,
    score_kind: ScoreKind = "logprobs",
    loss_weight: float = 0.2,
    alpha: float = 0.95,
) -> RankLossOutput:
    """The original formulation: three full forward passes (gold, a, b), each re-encoding the source.

    Same arguments and result as `shared_encoder_rank_loss`; kept as its reference in tests and benchmarks. The
    decoder inputs are the labels shifted right behind the decoder start (rlt2t's one convention for every
    family), and CE is the mean over non-padding gold tokens, as Hugging Face's own loss.
    """
    _check_options(score_kind, alpha)
    start_id, pad_id = _decoder_special_ids(model)
    source = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "use_cache": False}

    def logits(labels: Tensor) -> Tensor:
        return model(**source, decoder_input_ids=shift_right(labels, start_id, pad_id)).logits

    logits_gold = logits(batch.gold_labels)
    ce = gold_cross_entropy(logits_gold, batch.gold_labels, IGNORE_INDEX)
    logits_a = logits(batch.labels_a)
    logits_b = logits(batch.labels_b)
    scores_a = token_scores(logits_a, batch.labels_a, score_kind, IGNORE_INDEX)
    scores_b = token_scores(logits_b, batch.labels_b, score_kind, IGNORE_INDEX)
    rank, accuracy = pairwise_rank_loss(
        scores_a, scores_b, batch.labels_a, batch.labels_b, batch.use_rank, alpha, IGNORE_INDEX
    )
    return RankLossOutput(ce + loss_weight * rank, ce, rank, accuracy)


class SharedEncoderRankLoss(nn.Module):
    """`shared_encoder_rank_loss` as a module, so DistributedDataParallel can wrap the whole step.

    Calling `model.get_encoder()` and `model(...)` separately on a DDP-wrapped model would bypass DDP's
    forward; wrapping this module instead (`DDP(SharedEncoderRankLoss(model, ...))`) keeps one forward per
    step. Save `wrapper.model` in checkpoints, not the wrapper, to keep the policy's own parameter names.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        score_kind: ScoreKind = "logprobs",
        loss_weight: float = 0.2,
        alpha: float = 0.95,
    ) -> None:
        super().__init__()
        _check_options(score_kind, alpha)
        self.model = model
        self.score_kind: ScoreKind = score_kind
        self.loss_weight = loss_weight
        self.alpha = alpha
        self.share_cross_attention = True
        """False under the sharded learner (`repeated_encoder_states`)."""

    def forward(self, batch: RankBatch) -> RankLossOutput:
        """One rank-RL step on `batch`; see `shared_encoder_rank_loss`."""
        return shared_encoder_rank_loss(
            self.model, batch, score_kind=self.score_kind, loss_weight=self.loss_weight, alpha=self.alpha,
            share_cross_attention=self.share_cross_attention,
        )
