"""Encoder–decoder families: every model-family quirk rlt2t knows about, in one place.

rlt2t trains, serves and exports any encoder–decoder of the families below. Everything else in the
product is written against what every family shares (``get_encoder()``, ``encoder_outputs=``, the
encoder–decoder KV cache, ``config.decoder_start_token_id`` / ``eos_token_id`` / ``pad_token_id``) and asks
this module for the rest. A directory whose ``config.json`` names another architecture is refused with a
clear error (:class:`UnsupportedModelError`), as is a load that leaves weights missing or unused: a model
that would train from random weights is never returned.

=============== ================== ===================================================================
family          ``model_type``     quirks handled here
=============== ================== ===================================================================
bart            bart               decoding starts from ``</s>`` (``decoder_start = eos``); learned
                                   positions (``max_position_embeddings``); post-norm (CTranslate2 reads
                                   ``normalize_before``, which a from-scratch config must set to False)
mbart           mbart              pre-norm; language codes: ``model.src_lang`` sets the tokenizer's
                                   source language (its template adds the code to every text rlt2t
                                   encodes), ``model.tgt_lang`` becomes the decoder start token (mBART-25's
                                   convention) and the target template's code (labels end with it);
                                   without codes (a from-scratch preset) it starts from
                                   ``</s>`` like BART
marian          marian             decoding starts from ``<pad>`` (the last row in opus-mt checkpoints);
                                   static sinusoidal positions (``max_position_embeddings`` is still the
                                   limit; the table is frozen: from_pretrained makes it trainable and
                                   Marian does not save it); the tokenizer is the slow sentencepiece one,
                                   and it has neither sentinels nor a mask token (no span corruption)
pegasus         pegasus            decoding starts from ``<pad>``; static sinusoidal positions (frozen);
                                   no sentinels (span corruption marks every span with ``<mask_2>``)
t5              t5, mt5, umt5      decoding starts from ``<pad>``, no BOS; relative position buckets, so
                                   no position limit (:func:`max_positions` is None); ``<extra_id_N>``
                                   sentinels are the tokenizer's own; v1.0 checkpoints tie ``lm_head`` and
                                   scale the decoder output by d_model^-0.5, v1.1 / Flan-T5 untie it and do
                                   not scale (``config.scale_decoder_outputs``); fp16 overflows, so
                                   ``run.mixed_precision=fp16`` is refused in favour of bf16
encoder-decoder encoder-decoder    ``EncoderDecoderModel`` warm-started from a BERT-style encoder (Rothe
                                   et al. 2020): encoder and decoder from the same checkpoint, fresh
                                   cross-attention; BERT tokenizers have no EOS, so ``[SEP]`` is EOS and
                                   ``[CLS]`` the decoder start; CTranslate2 cannot convert it (the torch
                                   backend serves, samples and predicts)
=============== ================== ===================================================================

Conventions every family shares (docs/design.md): sources and targets are encoded by the same tokenizer
call (``tok(text)``, special tokens included), labels are those ids, and the decoder input is
``[decoder_start] + labels[:-1]`` (:func:`decoder_input_ids`, used by every training step, so no
family-specific shifting inside Hugging Face models matters).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn
from transformers import (
    AutoConfig,
    AutoModelForSeq2SeqLM,
    BartConfig,
    EncoderDecoderModel,
    GenerationConfig,
    MarianConfig,
    MBartConfig,
    PegasusConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    T5Config,
)
from transformers.modeling_outputs import Seq2SeqLMOutput

from rlt2t.common.collate import IGNORE_INDEX
from rlt2t.common.family_table import (  # noqa: F401 - re-exported: the one place callers ask about families
    FAMILIES,
    PRESET_FAMILIES,
    PRESETS,
    Family,
    UnsupportedModelError,
    check_mixed_precision,
    family_of,
    family_of_dir,
)

log = logging.getLogger("rlt2t.families")


# --------------------------------------------------------------------------------------------------
# The decoder's KV cache, under this transformers' name for it
# --------------------------------------------------------------------------------------------------

# transformers 5.24 renamed the seq2seq forward's ``past_key_values`` keyword, and the output field, to
# ``cache`` in every family (the old name warns there and goes in 5.40); 5.0-5.23 know only the old one. Every
# incremental decode and shared-cross-attention pass passes and reads the cache through the two helpers below.
CACHE_KEYWORD = "cache" if "cache" in {f.name for f in fields(Seq2SeqLMOutput)} else "past_key_values"


def with_cache(cache: Any) -> dict[str, Any]:
    """Keyword arguments of a forward that reads and extends ``cache`` (None: start one)."""
    return {CACHE_KEYWORD: cache, "use_cache": True}


def cache_of(output: Any) -> Any:
    """The KV cache a forward given :func:`with_cache` returned."""
    return getattr(output, CACHE_KEYWORD)


# --------------------------------------------------------------------------------------------------
# Facts read off a config
# --------------------------------------------------------------------------------------------------


def max_positions(config: PretrainedConfig) -> int | None:
    """Most source or target positions the model has; None when positions are relative (no limit)."""
    if not family_of(config).learned_positions:
        return None
    if family_of(config).name == "encoder-decoder":
        return min(config.encoder.max_position_embeddings, config.decoder.max_position_embeddings)
    return int(config.max_position_embeddings)


NO_POSITION_LIMIT = 1 << 20
"""What :func:`positions_or` gives for a model without a position limit (T5): no truncation in practice."""


def positions_or(config: PretrainedConfig, default: int = NO_POSITION_LIMIT) -> int:
    """:func:`max_positions`, or ``default`` for a model without a limit (where a number is needed)."""
    limit = max_positions(config)
    return default if limit is None else limit


def vocab_size(config: PretrainedConfig) -> int:
    """Rows of the output embedding (the decoder's vocabulary)."""
    if family_of(config).name == "encoder-decoder":
        return int(config.decoder.vocab_size)
    return int(config.vocab_size)


def decoder_hidden_size(config: PretrainedConfig) -> int:
    """Width of the decoder's final hidden states (what a value or reward head reads): ``d_model``, or the BERT
    decoder's ``hidden_size`` for a warm start (an EncoderDecoderConfig has neither itself)."""
    if family_of(config).name == "encoder-decoder":
        return int(config.decoder.hidden_size)
    return int(config.d_model)


def shift_labels(labels: Tensor, decoder_start_token_id: int, pad_token_id: int) -> Tensor:
    """Teacher-forcing decoder inputs from labels: [B, T] -> [B, T], start token first, -100 -> pad."""
    shifted = torch.empty_like(labels)
    shifted[:, 0] = decoder_start_token_id
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill(shifted == IGNORE_INDEX, pad_token_id)


def decoder_input_ids(labels: Tensor, config: PretrainedConfig) -> Tensor:
    """:func:`shift_labels` with the model's decoder start and pad ids: the decoder inputs of every training step."""
    start, pad = config.decoder_start_token_id, config.pad_token_id
    if start is None or pad is None:
        raise ValueError(f"model.config needs decoder_start_token_id and pad_token_id, got {start!r} and {pad!r}")
    return shift_labels(labels, start, pad)


# --------------------------------------------------------------------------------------------------
# From-scratch presets
# --------------------------------------------------------------------------------------------------


def default_special_ids(family: str, tokenizer: PreTrainedTokenizerBase) -> dict[str, int | None]:
    """The family's special ids for ``tokenizer`` without language codes: pad, BOS, EOS, the decoder start
    (BART and mBART: EOS; T5, Marian and Pegasus: pad) and the forced last token of a row at the length limit
    (EOS, as the pretrained checkpoints' generation configs set; T5's has none)."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    start = eos if family in ("bart", "mbart") else pad
    return {"pad_token_id": pad, "bos_token_id": None if family == "t5" else tokenizer.bos_token_id,
            "eos_token_id": eos, "decoder_start_token_id": start,
            "forced_eos_token_id": None if family == "t5" else eos}


def preset_config(family: str, preset: str, tokenizer: PreTrainedTokenizerBase, dropout: float = 0.1
                  ) -> PretrainedConfig:
    """A from-scratch config of ``family`` with a preset shape whose vocabulary and special ids match ``tokenizer``.

    The vocabulary is ``len(tokenizer)``; pad and EOS are the tokenizer's; the decoder starts where the family
    does (BART and mBART: EOS; T5, Marian and Pegasus: pad). Sentinels are whatever the tokenizer holds.
    """
    if preset not in PRESETS:
        raise ValueError(f"model.preset: unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    if family not in PRESET_FAMILIES:
        raise ValueError(f"model.family: unknown family {family!r} (known: {', '.join(PRESET_FAMILIES)})")
    p = PRESETS[preset]
    ids = default_special_ids(family, tokenizer)
    if ids["pad_token_id"] is None or ids["eos_token_id"] is None:
        raise ValueError(f"a from-scratch {family} needs a tokenizer with pad and EOS tokens")
    vocab = len(tokenizer)
    # The config classes take keys beyond their declared fields (tie_word_embeddings, normalize_before, ...) as
    # attributes: the keyword arguments go in as one dict, checked by the config itself.
    extra: dict[str, Any]
    if family == "t5":
        # Flan-T5's layout (T5 v1.1): gated-GELU feed-forward, untied lm_head, no output scaling.
        extra = {"tie_word_embeddings": False, **{k: v for k, v in ids.items() if k != "forced_eos_token_id"}}
        return T5Config(
            vocab_size=vocab, d_model=p["d_model"], d_kv=p["d_model"] // p["heads"], d_ff=p["ffn"],
            num_layers=p["layers"], num_decoder_layers=p["layers"], num_heads=p["heads"],
            feed_forward_proj="gated-gelu", dropout_rate=dropout, **extra,
        )
    shape: dict[str, Any] = dict(
        vocab_size=vocab, d_model=p["d_model"], encoder_layers=p["layers"], decoder_layers=p["layers"],
        encoder_attention_heads=p["heads"], decoder_attention_heads=p["heads"], encoder_ffn_dim=p["ffn"],
        decoder_ffn_dim=p["ffn"], max_position_embeddings=p["positions"], dropout=dropout,
        attention_dropout=0.0, activation_dropout=0.0, forced_bos_token_id=None, **ids,
    )
    if family == "bart":
        # CTranslate2's BART converter reads normalize_before; HF's BART is post-norm.
        extra = {"normalize_before": False, "tie_word_embeddings": True}
        return BartConfig(**shape, **extra)
    if family == "mbart":
        return MBartConfig(**shape, scale_embedding=True)
    if family == "marian":
        return MarianConfig(**shape, decoder_vocab_size=vocab, scale_embedding=True,
                            share_encoder_decoder_embeddings=True)
    return PegasusConfig(**shape, scale_embedding=True)


def build_model(config: PretrainedConfig) -> PreTrainedModel:
    """A randomly initialised model of a preset config (seed the global RNG first for reproducibility)."""
    model = AutoModelForSeq2SeqLM.from_config(config)
    if family_of(config).name == "t5" and not getattr(config, "scale_decoder_outputs", True):
        # transformers ties T5's lm_head to the shared embedding whatever the config says; a v1.1-style
        # (Flan-T5) model has its own, as the pretrained checkpoints do.
        model.lm_head.weight = nn.Parameter(model.shared.weight.detach().clone())
    return model


# --------------------------------------------------------------------------------------------------
# Loading a directory
# --------------------------------------------------------------------------------------------------


def _set_dropout(config: PretrainedConfig, dropout: float) -> None:
    name = family_of(config).name
    if name == "t5":
        config.dropout_rate = dropout
    elif name == "encoder-decoder":
        for sub in (config.encoder, config.decoder):
            sub.hidden_dropout_prob = dropout
    else:
        config.dropout = dropout


def load_model(path: str | Path, dropout: float | None = None) -> PreTrainedModel:
    """Load a local encoder–decoder directory of any family, refusing anything that would not be the saved model.

    UnsupportedModelError for an unknown ``model_type`` (e.g. a decoder-only model) and for a load that reports
    missing, unexpected or mis-shaped weights (e.g. a config.json of one architecture over the weights of
    another): those weights would be freshly random. ``dropout`` overrides the family's main dropout.
    """
    path = Path(path)
    family = family_of_dir(path)
    config = AutoConfig.from_pretrained(str(path))
    if dropout is not None:
        _set_dropout(config, dropout)
    model_class = EncoderDecoderModel if family.name == "encoder-decoder" else AutoModelForSeq2SeqLM
    try:
        # with output_loading_info, from_pretrained returns (model, loading report); its annotation omits that case
        model, info = cast("tuple[PreTrainedModel, dict[str, Any]]",
                           model_class.from_pretrained(str(path), config=config, output_loading_info=True))
    except RuntimeError as e:  # transformers raises on weights whose shapes do not fit the config
        raise UnsupportedModelError(
            f"{path}: the weights do not match its config.json ({family.name}): {str(e).splitlines()[0]} "
            "Refusing to train a partly random model"
        ) from e
    problems = {k: sorted(info.get(k) or ()) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems = {k: v for k, v in problems.items() if v}
    if problems:
        detail = "; ".join(f"{k.replace('_', ' ')}: {', '.join(map(str, v[:5]))}{' …' if len(v) > 5 else ''}"
                           for k, v in problems.items())
        raise UnsupportedModelError(
            f"{path}: the weights do not match its config.json ({family.name}, {type(model).__name__}): {detail}. "
            "Refusing to train a partly random model"
        )
    return model


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase, family: Family, *, src_lang: str | None = None
                      ) -> PreTrainedTokenizerBase:
    """The family's tokenizer conventions, applied in place: BERT's [SEP]/[CLS] as EOS/BOS, mBART's source language."""
    if tokenizer.eos_token is None and getattr(tokenizer, "sep_token", None) is not None:
        # BERT-style tokenizers (warm starts) end every text with [SEP]: it is the EOS of generated text.
        tokenizer.eos_token = tokenizer.sep_token
        if tokenizer.bos_token is None and getattr(tokenizer, "cls_token", None) is not None:
            tokenizer.bos_token = tokenizer.cls_token
    if src_lang is not None:
        if not hasattr(tokenizer, "src_lang") or _lang_id(tokenizer, src_lang) is None:
            raise ValueError(f"model.src_lang={src_lang!r}: the tokenizer has no such language code")
        tokenizer.src_lang = src_lang  # its template then adds the code to every text it encodes
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError(f"the {family.name} tokenizer needs EOS and pad tokens (got {tokenizer.eos_token!r}, "
                         f"{tokenizer.pad_token!r})")
    return tokenizer


def _lang_id(tokenizer: PreTrainedTokenizerBase, code: str) -> int | None:
    i = tokenizer.convert_tokens_to_ids(code)  # one token: one id (None when the tokenizer has no unk)
    return i if isinstance(i, int) and i != tokenizer.unk_token_id else None


GENERATION_IDS = ("decoder_start_token_id", "bos_token_id", "eos_token_id", "pad_token_id", "forced_bos_token_id",
                  "forced_eos_token_id", "bad_words_ids")
"""The special ids a generation config keeps (:func:`generation_config`); every other setting is ours to pass.
``bad_words_ids`` is a model's ban on rows it must never emit (opus-mt checkpoints ban ``<pad>``, the row their
decoder starts from)."""


def generation_config(ids: Any, **settings: Any) -> GenerationConfig:
    """A fresh GenerationConfig holding only the special ids of ``ids`` (a mapping, or a generation config to
    read them from) and ``settings`` (num_beams, max_new_tokens, ...): nothing a loaded checkpoint's generation
    config sets besides its ids reaches decoding."""
    if not isinstance(ids, dict):
        ids = {key: getattr(ids, key, None) for key in GENERATION_IDS}
    return GenerationConfig(**{key: ids.get(key) for key in GENERATION_IDS}, **settings)


def prepare_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, tgt_lang: str | None = None) -> None:
    """The family's decoding conventions, applied in place to ``model.config`` and its generation config.

    ``tgt_lang`` (mBART) becomes the decoder start token and the tokenizer's target language (so targets end
    with the code the decoder starts from). An encoder–decoder warm start gets its special ids from the
    tokenizer when its config lacks them. The generation config is replaced by one holding only the special
    ids, those of the model config where both have them (the sampler, ``generate`` and the CTranslate2 export
    all read one of the two): decoding settings a checkpoint ships are dropped.
    """
    config = model.config
    family = family_of(config)
    if tgt_lang is not None:
        if family.name != "mbart":
            raise ValueError(f"model.tgt_lang applies to mbart models, not {family.name}")
        start = _lang_id(tokenizer, tgt_lang)
        if start is None:
            raise ValueError(f"model.tgt_lang={tgt_lang!r}: the tokenizer has no such language code")
        config.decoder_start_token_id = start
    if family.name == "encoder-decoder":
        for key, value in (("decoder_start_token_id", tokenizer.bos_token_id), ("eos_token_id", tokenizer.eos_token_id),
                           ("pad_token_id", tokenizer.pad_token_id)):
            if getattr(config, key, None) is None:
                setattr(config, key, value)
        config.vocab_size = config.decoder.vocab_size
    for key in ("decoder_start_token_id", "eos_token_id", "pad_token_id"):
        if getattr(config, key, None) is None:
            raise ValueError(f"{family.name} model: config.{key} is not set")
    if family.name in ("marian", "pegasus"):
        # Sinusoidal position tables are constants, but from_pretrained hands them back trainable; Marian does not
        # even save them (rebuilt at load), so a trained table would silently revert in every checkpoint.
        for stack in (model.get_encoder(), model.get_decoder()):
            stack.embed_positions.weight.requires_grad_(False)
    gen = model.generation_config
    if gen is not None:
        ids = {key: getattr(gen, key, None) for key in GENERATION_IDS}
        ids.update({key: getattr(config, key) for key in ("decoder_start_token_id", "eos_token_id", "pad_token_id")})
        if getattr(config, "forced_bos_token_id", None) is None:
            ids["forced_bos_token_id"] = None
        # A checkpoint's generation_config.json may carry decoding settings (bart-base: no_repeat_ngram_size=3,
        # min_length, length_penalty, ...). The RL sampler ignores them; generate would apply them, so evaluation
        # and the validation monitor would score a different decoder than the one RL trains. Keep the ids only.
        model.generation_config = generation_config(ids)
    if tgt_lang is not None and hasattr(tokenizer, "tgt_lang"):
        tokenizer.tgt_lang = tgt_lang  # targets are then encoded with its template (``encode_texts(target=True)``)


# --------------------------------------------------------------------------------------------------
# Warm start (Rothe et al. 2020)
# --------------------------------------------------------------------------------------------------


def warm_start(encoder_dir: str | Path, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """``EncoderDecoderModel`` with encoder and decoder both initialised from a BERT-style ``encoder_dir``.

    The decoder is the same checkpoint made causal with fresh cross-attention layers (the only new weights).
    Special ids come from ``tokenizer`` (``[CLS]`` starts decoding, ``[SEP]`` ends it, see
    :func:`prepare_tokenizer`).
    """
    model = EncoderDecoderModel.from_encoder_decoder_pretrained(str(encoder_dir), str(encoder_dir))
    prepare_model(model, prepare_tokenizer(tokenizer, FAMILIES["encoder-decoder"]))
    # transformers prints the decoder's load report: the cross-attention layers are new, and so is the LM head's
    # transform when the checkpoint is an encoder without its MLM head (a sentence-embedding model such as MiniLM).
    log.info("warm start from %s: encoder and decoder initialised from it; cross-attention starts random", encoder_dir)
    return model


# --------------------------------------------------------------------------------------------------
# Cross-attention projections (the learner's shared-encoder step)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CrossAttention:
    """One decoder layer's cross-attention key and value projections of the encoder states."""

    layer_idx: int
    key: nn.Module
    value: nn.Module
    head_dim: int


def cross_attentions(model: PreTrainedModel) -> list[CrossAttention]:
    """Every decoder layer's cross-attention projections, in layer order.

    BART, mBART, Marian and Pegasus: ``layers[i].encoder_attn.{k,v}_proj``; T5:
    ``block[i].layer[1].EncDecAttention.{k,v}`` (relative position bias is in self-attention only, so
    cross-attention keys are plain projections); a BERT decoder (warm start):
    ``bert.encoder.layer[i].crossattention.self.{key,value}``.
    """
    name = family_of(model.config).name
    decoder = model.get_decoder()
    if name == "t5":
        attns = [block.layer[1].EncDecAttention for block in decoder.block]
        return [CrossAttention(_idx(a, i), a.k, a.v, a.key_value_proj_dim) for i, a in enumerate(attns)]
    if name == "encoder-decoder":
        layers = _bert_layers(decoder)
        attns = [layer.crossattention.self for layer in layers]
        return [CrossAttention(_idx(a, i), a.key, a.value, a.attention_head_size) for i, a in enumerate(attns)]
    attns = [layer.encoder_attn for layer in decoder.layers]
    return [CrossAttention(_idx(a, i), a.k_proj, a.v_proj, a.head_dim) for i, a in enumerate(attns)]


def _idx(attn: nn.Module, default: int) -> int:
    idx = getattr(attn, "layer_idx", None)
    return default if idx is None else int(idx)


def _bert_layers(decoder: PreTrainedModel) -> Sequence[Any]:
    """The BERT decoder's layers (modules whose parts are reached by attribute name, untyped in transformers)."""
    base: Any = getattr(decoder, decoder.base_model_prefix, decoder)  # named by the model class: untyped
    layers = base.encoder.layer
    if not all(hasattr(layer, "crossattention") for layer in layers):
        raise UnsupportedModelError(f"{type(decoder).__name__}: decoder layers without cross-attention")
    return layers


def decoder_stack(model: PreTrainedModel) -> nn.Module:
    """The decoder without its LM head: called with ``input_ids``, ``attention_mask``, ``encoder_hidden_states``
    (see :func:`cross_attention_states`) and ``encoder_attention_mask``, its ``last_hidden_state`` is the
    decoder's final hidden states. ``get_decoder()`` is that stack in every family but a warm start, where it is
    the BERT decoder with its LM head (its output holds logits only); its base model is the stack."""
    decoder = model.get_decoder()
    if family_of(model.config).name == "encoder-decoder":
        return getattr(decoder, decoder.base_model_prefix, decoder)
    return decoder


def cross_attention_states(model: PreTrainedModel, hidden: Tensor) -> Tensor:
    """The encoder states as the decoder's cross-attention reads them ([B, S, H_enc] -> [B, S, H_dec]): an
    EncoderDecoderModel projects them when the two hidden sizes differ."""
    proj = getattr(model, "enc_to_dec_proj", None)
    return proj(hidden) if proj is not None else hidden
