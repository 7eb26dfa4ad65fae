"""Model surgery on pretrained BART directories: vocabulary shrinking and checkpoint averaging."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import BartForConditionalGeneration

from rlt2t.common.io import atomic_directory
from rlt2t.common.tokenization import load_tokenizer, save_tokenizer

log = logging.getLogger("rlt2t.convert")


def shrink_vocabulary(input_dir: str | Path, vocab_size: int, out_dir: str | Path,
                      tokenizer_dir: str | Path | None = None) -> Path:
    """Keep the first ``vocab_size`` embedding rows of a pretrained BART and write it to ``out_dir``.

    The shared embedding, the tied lm_head and ``final_logits_bias`` are cut to ``vocab_size``; the
    config's vocab size and special ids follow the tokenizer when one is given (which is then saved
    beside the model), else the original special ids must fit in the new vocabulary.
    """
    model = BartForConditionalGeneration.from_pretrained(str(input_dir))
    old = model.config.vocab_size
    if not 8 <= vocab_size <= old:
        raise ValueError(f"--vocab-size must be in [8, {old}] (the model has {old} rows), got {vocab_size}")
    tok = load_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
    if tok is not None and len(tok) > vocab_size:
        raise ValueError(f"tokenizer {tokenizer_dir} has {len(tok)} tokens, more than --vocab-size {vocab_size}")
    model.resize_token_embeddings(vocab_size)  # BART also cuts final_logits_bias; lm_head stays tied
    cfg = model.config
    if tok is not None:
        cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id = tok.pad_token_id, tok.bos_token_id, tok.eos_token_id
        cfg.decoder_start_token_id = cfg.forced_eos_token_id = tok.eos_token_id
    cfg.forced_bos_token_id = None
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        value = getattr(cfg, key)
        if value is not None and value >= vocab_size:
            raise ValueError(f"config.{key}={value} does not fit in {vocab_size} rows; pass --tokenizer")
    gen = model.generation_config
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "forced_eos_token_id"):
        setattr(gen, key, getattr(cfg, key))
    gen.forced_bos_token_id = None
    with atomic_directory(out_dir) as tmp:
        model.save_pretrained(tmp)
        if tok is not None:
            save_tokenizer(tok, tmp)
    log.info("shrunk %s from %d to %d rows → %s", input_dir, old, vocab_size, out_dir)
    return Path(out_dir)


def average_checkpoints(paths: Sequence[str | Path], out_dir: str | Path) -> Path:
    """Uniform average of the weights of several checkpoints of one model (floating tensors only)."""
    if len(paths) < 2:
        raise ValueError(f"averaging needs at least 2 checkpoints, got {len(paths)}")
    base = BartForConditionalGeneration.from_pretrained(str(paths[0]))
    total = {k: v.detach().clone().double() for k, v in base.state_dict().items() if v.is_floating_point()}
    for p in paths[1:]:
        sd = BartForConditionalGeneration.from_pretrained(str(p)).state_dict()
        if set(sd) != set(base.state_dict()):
            raise ValueError(f"{p} does not have the same parameters as {paths[0]}")
        for k in total:
            if sd[k].shape != total[k].shape:
                raise ValueError(f"{p}: {k} has shape {tuple(sd[k].shape)}, expected {tuple(total[k].shape)}")
            total[k] += sd[k].double()
    with torch.no_grad():
        state = base.state_dict()
        for k, v in total.items():
            state[k].copy_((v / len(paths)).to(state[k].dtype))
    tok_dir = Path(paths[0])
    with atomic_directory(out_dir) as tmp:
        base.save_pretrained(tmp)
        if (tok_dir / "tokenizer_config.json").is_file() or (tok_dir / "tokenizer.json").is_file():
            save_tokenizer(load_tokenizer(tok_dir), tmp)
    log.info("averaged %d checkpoints → %s", len(paths), out_dir)
    return Path(out_dir)
