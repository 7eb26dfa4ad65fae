"""The encoder–decoder families as plain facts, with no torch or transformers import: what the config checks
and the command line read (``rlt2t.common.config`` imports this, so ``rlt2t --help`` and a config error do not
load torch). The models, tokenizers and everything that touches weights are :mod:`rlt2t.common.families`, which
re-exports these names; the family table there documents each family's quirks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Presets: (d_model, layers, heads, ffn, max positions). `base` is the BART-base shape.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(d_model=32, layers=1, heads=2, ffn=64, positions=256),
    "small": dict(d_model=256, layers=3, heads=4, ffn=1024, positions=256),
    "base": dict(d_model=768, layers=6, heads=12, ffn=3072, positions=1024),
}


class UnsupportedModelError(ValueError):
    """A model directory or config rlt2t cannot train (unknown architecture, or weights that do not load)."""


@dataclass(frozen=True)
class Family:
    """What rlt2t needs to know about one encoder–decoder family."""

    name: str
    model_types: tuple[str, ...]
    """``config.json`` ``model_type`` values of this family."""
    learned_positions: bool
    """Whether ``max_position_embeddings`` bounds source and target lengths (False: relative positions)."""
    ct2: bool
    """Whether CTranslate2's converter accepts it."""
    fp16_safe: bool
    """False where fp16 activations overflow (T5): fp16 mixed precision is refused."""
    preset: bool
    """Whether a from-scratch preset exists (``model.family``)."""


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("bart", ("bart",), learned_positions=True, ct2=True, fp16_safe=True, preset=True),
        Family("mbart", ("mbart",), learned_positions=True, ct2=True, fp16_safe=True, preset=True),
        Family("marian", ("marian",), learned_positions=True, ct2=True, fp16_safe=True, preset=True),
        Family("pegasus", ("pegasus",), learned_positions=True, ct2=True, fp16_safe=True, preset=True),
        Family("t5", ("t5", "mt5", "umt5"), learned_positions=False, ct2=True, fp16_safe=False, preset=True),
        Family("encoder-decoder", ("encoder-decoder",), learned_positions=True, ct2=False, fp16_safe=True,
               preset=False),
    )
}
EXPORT_INFO = "rlt2t_export.json"
"""What `rlt2t export` writes beside a CTranslate2 model (its source, quantization, checksum): an export's mark."""
PRESET_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.preset)
_BY_MODEL_TYPE = {t: f for f in FAMILIES.values() for t in f.model_types}


def _supported() -> str:
    return ", ".join(f"{f.name} ({'/'.join(f.model_types)})" for f in FAMILIES.values())


def family_of(config: PretrainedConfig | dict[str, Any], where: str = "model") -> Family:
    """The family of a model config (object or ``config.json`` dict); UnsupportedModelError if none."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    family = _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise UnsupportedModelError(
            f"{where}: model_type {model_type!r} is not an encoder-decoder family rlt2t can train "
            f"(supported: {_supported()})"
        )
    return family


def family_of_dir(path: str | Path) -> Family:
    """The family of a model directory, from its ``config.json`` (FileNotFoundError if it has none)."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        hint = "" if path.exists() else (" (a local directory: a hub name such as google/flan-t5-small must be "
                                         "downloaded first, e.g. huggingface-cli download NAME --local-dir DIR)")
        raise FileNotFoundError(f"{path}: not a model directory (no config.json){hint}")
    if (path / EXPORT_INFO).is_file():  # a CTranslate2 export's config.json has no model_type
        raise UnsupportedModelError(
            f"{path}: a CTranslate2 export, which torch cannot load: predict or score with it (rlt2t predict "
            f"--generators {path} --scorers {path} --input FILE --out FILE prints its table when FILE has targets), "
            "or pass the checkpoint it was exported from (`source` in its rlt2t_export.json)")
    return family_of(json.loads(config_path.read_text()), str(path))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
"""Files of which a model directory holds at least one when its tokenizer is saved with it."""


def has_tokenizer(path: str | Path) -> bool:
    """Whether a model directory holds its tokenizer's files."""
    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def check_mixed_precision(config: PretrainedConfig | dict[str, Any] | str, mixed_precision: str) -> None:
    """Refuse fp16 for a family whose activations overflow in it (T5: use bf16). ``config`` may be a family name;
    a model outside the encoder-decoder families (a reward model's or classifier's encoder) is not checked."""
    if mixed_precision != "fp16":
        return
    try:
        family = FAMILIES[config] if isinstance(config, str) else family_of(config)
    except UnsupportedModelError:
        return
    if not family.fp16_safe:
        raise ValueError(
            f"run.mixed_precision=fp16: {family.name}-family models overflow in fp16 (their activations exceed "
            "65504 and become inf/NaN); use run.mixed_precision=bf16 (or no)"
        )
