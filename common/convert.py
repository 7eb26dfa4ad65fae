"""Model surgery on pretrained directories of any family: vocabulary shrinking and checkpoint averaging."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from rlt2t.common.families import default_special_ids, family_of_dir, load_model
from rlt2t.common.family_table import has_tokenizer
from rlt2t.common.io import atomic_directory
from rlt2t.common.tokenization import load_tokenizer, save_tokenizer

log = logging.getLogger("rlt2t.convert")

# Families whose first rows can be kept: their special tokens sit at the start of the vocabulary. Marian keeps
# <pad> (its decoder start) in the last row, and a warm start's BERT vocabulary is not the model's own to cut.
SHRINKABLE = ("bart", "mbart", "pegasus", "t5")


def shrink_vocabulary(input_dir: str | Path, vocab_size: int, out_dir: str | Path,
                      tokenizer_dir: str | Path | None = None, *, force: bool = False) -> Path:
    """Keep the first ``vocab_size`` embedding rows of a pretrained BART-family (BART, mBART, Pegasus) or T5-family
    (T5, Flan-T5, mT5) model and write it to ``out_dir``.

    The shared embedding and the lm_head (tied or, for T5 v1.1 / Flan-T5, its own) are cut to ``vocab_size``, as is
    BART's ``final_logits_bias``; the config's vocab size and special ids follow the tokenizer when one is given
    (which is then saved beside the model; the decoder start is the family's: EOS for BART and mBART, pad for T5
    and Pegasus), else the original special ids must fit in the new vocabulary (and ``out_dir`` holds no
    tokenizer: the one it is used with is the user's to give). An existing ``out_dir`` is replaced only with
    ``force``.
    """
    check_out_dir(out_dir, [input_dir], force=force)
    family = family_of_dir(input_dir)
    if family.name not in SHRINKABLE:
        raise ValueError(f"{input_dir}: convert-model shrinks {', '.join(SHRINKABLE)} models, not {family.name} "
                         "(Marian keeps its decoder-start <pad> in the last row)")
    model = load_model(input_dir)
    old = model.config.vocab_size
    if not 8 <= vocab_size <= old:
        raise ValueError(f"--vocab-size must be in [8, {old}] (the model has {old} rows), got {vocab_size}")
    tok = load_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
    if tok is not None and len(tok) > vocab_size:
        raise ValueError(f"tokenizer {tokenizer_dir} has {len(tok)} tokens, more than --vocab-size {vocab_size}")
    output = model.get_output_embeddings().weight
    untied = output.data_ptr() != model.get_input_embeddings().get_parameter("weight").data_ptr()
    kept_output = output.detach()[:vocab_size].clone()
    model.resize_token_embeddings(vocab_size)  # cuts the shared embedding (and BART's final_logits_bias)
    if untied:
        # transformers re-ties T5's lm_head when resizing; a T5 v1.1 / Flan-T5 keeps its own, cut the same way.
        model.get_output_embeddings().weight = torch.nn.Parameter(kept_output)
    cfg = model.config
    if tok is not None:
        for key, value in default_special_ids(family.name, tok).items():
            setattr(cfg, key, value)
    cfg.forced_bos_token_id = None
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        value = getattr(cfg, key, None)
        if value is not None and value >= vocab_size:
            raise ValueError(f"config.{key}={value} does not fit in {vocab_size} rows; pass --tokenizer")
    gen = model.generation_config
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "forced_eos_token_id"):
        setattr(gen, key, getattr(cfg, key, None))
    gen.forced_bos_token_id = None
    with atomic_directory(out_dir) as tmp:
        model.save_pretrained(tmp)
        if tok is not None:
            save_tokenizer(tok, tmp)
    log.info("shrunk %s (%s) from %d to %d rows → %s", input_dir, family.name, old, vocab_size, out_dir)
    if tok is None:
        log.warning("%s holds no tokenizer (no --tokenizer given): use it with one of at most %d tokens "
                    "(tokenizer.kind=pretrained tokenizer.path=...)", out_dir, vocab_size)
    return Path(out_dir)


def check_out_dir(out_dir: str | Path, inputs: Sequence[str | Path], *, force: bool = False,
                  flag: str = "--out") -> None:
    """Refuse an output directory that equals, contains or lies inside one of ``inputs`` (it would replace what
    is read, or land among it), and an existing one unless ``force``."""
    out = Path(out_dir).expanduser().resolve()
    for given in inputs:
        src = Path(given).expanduser().resolve()
        if out == src or out in src.parents or src in out.parents:
            where = "is" if out == src else "contains" if out in src.parents else "is inside"
            raise ValueError(f"{flag} {out_dir} {where} the input {given}: give a directory of its own")
    if out.exists() and not force:
        raise FileExistsError(f"{flag} {out_dir} already exists (pass --force to replace it)")


def average_checkpoints(paths: Sequence[str | Path], out_dir: str | Path, *, force: bool = False) -> Path:
    """Uniform average of the weights of several checkpoints of one model, any family (floating tensors only).

    ``out_dir`` must not be, contain or lie inside an input; an existing one is replaced only with ``force``."""
    if len(paths) < 2:
        raise ValueError(f"averaging needs at least 2 checkpoints, got {len(paths)}")
    check_out_dir(out_dir, paths, force=force)
    family = family_of_dir(paths[0])
    base = load_model(paths[0])
    total = {k: v.detach().clone().double() for k, v in base.state_dict().items() if v.is_floating_point()}
    for p in paths[1:]:
        if family_of_dir(p) != family:
            raise ValueError(f"{p} is a model of family {family_of_dir(p).name}, {paths[0]} of family {family.name}")
        sd = load_model(p).state_dict()
        if set(sd) != set(base.state_dict()):
            differ = sorted(set(sd) ^ set(base.state_dict()))
            raise ValueError(f"{p} does not have the same parameters as {paths[0]} ({len(differ)} differ, first "
                             f"{differ[0]}: a model of another shape)")
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
        if has_tokenizer(tok_dir):
            save_tokenizer(load_tokenizer(tok_dir), tmp)
    log.info("averaged %d %s checkpoints → %s", len(paths), family.name, out_dir)
    return Path(out_dir)
