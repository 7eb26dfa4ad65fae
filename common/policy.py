"""The one function that builds or loads a policy (BART + tokenizer).

The learner, rollout workers, servers and export all call :func:`load_policy`; nothing else
constructs a model. A user with a downloaded ``facebook/bart-base`` directory goes through the same
``from_pretrained`` path as a checkpoint written by rlt2t.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import BartConfig, BartForConditionalGeneration, PreTrainedTokenizerBase

from rlt2t.common.config import PRESETS, DataConfig, ModelConfig
from rlt2t.common.tokenization import load_tokenizer

log = logging.getLogger("rlt2t.policy")


@dataclass
class Policy:
    model: BartForConditionalGeneration
    tokenizer: PreTrainedTokenizerBase
    origin: str
    """Where it came from: ``preset:small`` or a directory."""

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def decode(self, ids: torch.Tensor | list[list[int]]) -> list[str]:
        """Token ids [B, T] → texts, special tokens dropped, whitespace normalised."""
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return [" ".join(t.split()) for t in texts]


def bart_config(preset: str, tokenizer: PreTrainedTokenizerBase, dropout: float = 0.1) -> BartConfig:
    """A from-scratch BartConfig of a preset shape whose vocabulary and special ids match ``tokenizer``."""
    if preset not in PRESETS:
        raise ValueError(f"model.preset: unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    p = PRESETS[preset]
    return BartConfig(
        vocab_size=len(tokenizer),
        d_model=p["d_model"],
        encoder_layers=p["layers"],
        decoder_layers=p["layers"],
        encoder_attention_heads=p["heads"],
        decoder_attention_heads=p["heads"],
        encoder_ffn_dim=p["ffn"],
        decoder_ffn_dim=p["ffn"],
        max_position_embeddings=p["positions"],
        dropout=dropout,
        attention_dropout=0.0,
        activation_dropout=0.0,
        # CTranslate2's BART converter reads this; from-scratch configs must carry it.
        normalize_before=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.eos_token_id,  # BART starts decoding from </s>
        forced_bos_token_id=None,
        forced_eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )


def load_policy(
    model_cfg: ModelConfig,
    tokenizer_dir: str | Path | None = None,
    *,
    checkpoint: str | Path | None = None,
    seed: int | None = None,
) -> Policy:
    """Build or load the policy.

    Precedence: ``checkpoint`` (an rlt2t checkpoint or any HF model directory) > ``model_cfg.path``
    > ``model_cfg.preset`` (from scratch, vocabulary taken from the tokenizer). The tokenizer comes
    from the model directory when it holds one, else from ``tokenizer_dir``.
    """
    path = checkpoint if checkpoint is not None else model_cfg.path
    if path is not None:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: not a model directory (no config.json)")
        tok_src = path if _has_tokenizer(path) else tokenizer_dir
        if tok_src is None:
            raise ValueError(f"{path} holds no tokenizer; set tokenizer.path to a tokenizer directory")
        tokenizer = load_tokenizer(tok_src)
        model = BartForConditionalGeneration.from_pretrained(str(path), dropout=model_cfg.dropout)
        origin = str(path)
    else:
        if model_cfg.preset is None:
            raise ValueError("model: set either model.path (a pretrained directory) or model.preset")
        if tokenizer_dir is None:
            raise ValueError("a from-scratch model needs a tokenizer directory (run `rlt2t tokenizer build`)")
        tokenizer = load_tokenizer(tokenizer_dir)
        if seed is not None:
            torch.manual_seed(seed)  # initial weights are part of the run's reproducibility
        model = BartForConditionalGeneration(bart_config(model_cfg.preset, tokenizer, model_cfg.dropout))
        origin = f"preset:{model_cfg.preset}"
    _check_vocabulary(model, tokenizer, origin)
    log.info("policy from %s: %.2fM parameters, vocab %d", origin, sum(p.numel() for p in model.parameters()) / 1e6,
             model.config.vocab_size)
    return Policy(model=model, tokenizer=tokenizer, origin=origin)


def check_lengths(policy: Policy, data_cfg: DataConfig) -> None:
    """Reject source/target lengths the model has no positions for (naming the key)."""
    positions = policy.model.config.max_position_embeddings
    for key in ("max_source_len", "max_target_len"):
        value = getattr(data_cfg, key)
        if value > positions:
            raise ValueError(f"data.{key}={value} exceeds the model's {positions} positions ({policy.origin})")


def _has_tokenizer(path: Path) -> bool:
    return any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))


def _check_vocabulary(model: BartForConditionalGeneration, tokenizer: PreTrainedTokenizerBase, origin: str) -> None:
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(
            f"{origin}: tokenizer has {len(tokenizer)} tokens but the model only {model.config.vocab_size} "
            "embedding rows (shrink or grow the model with `rlt2t convert-model --vocab-size`)"
        )
