"""The one function that builds or loads a policy (an encoder–decoder model + its tokenizer).

The learner, rollout workers, servers and export all call :func:`load_policy`; nothing else constructs a
model. A user with a downloaded ``facebook/bart-base``, ``google/flan-t5-small``, ``Helsinki-NLP/opus-mt-*``,
mBART or Pegasus directory goes through the same ``from_pretrained`` path as a checkpoint written by rlt2t.
Family quirks (decoder start, language codes, position limits, ...) live in :mod:`rlt2t.common.families`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

import torch
from peft import PeftModel
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from rlt2t.common.config import DataConfig, ModelConfig
from rlt2t.common.families import (
    FAMILIES,
    build_model,
    family_of,
    family_of_dir,
    load_model,
    max_positions,
    prepare_model,
    prepare_tokenizer,
    preset_config,
    vocab_size,
)
from rlt2t.common.family_table import PRESETS, has_tokenizer
from rlt2t.common.tokenization import load_tokenizer

log = logging.getLogger("rlt2t.policy")


PolicyModel: TypeAlias = PreTrainedModel | PeftModel
"""A transformers encoder-decoder, or a LoRA ``PeftModel`` around one (rlt2t.common.lora; it forwards the
model's calls)."""


@dataclass
class Policy:
    model: PolicyModel
    tokenizer: PreTrainedTokenizerBase
    origin: str
    """Where it came from: ``preset:small`` (``preset:t5/small`` for other families) or a directory."""

    @property
    def family(self) -> str:
        """The model's family (``bart``, ``t5``, ...; see rlt2t.common.families)."""
        return family_of(self.model.config).name

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def decode(self, ids: torch.Tensor | list[list[int]]) -> list[str]:
        """Token ids [B, T] → texts, special tokens dropped, whitespace normalised."""
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return [" ".join(t.split()) for t in texts]


def bart_config(preset: str, tokenizer: PreTrainedTokenizerBase, dropout: float = 0.1) -> PretrainedConfig:
    """A from-scratch BartConfig of a preset shape whose vocabulary and special ids match ``tokenizer``."""
    return preset_config("bart", preset, tokenizer, dropout)


REWARD_MODEL_SPEC = "rlt2t_reward_model.json"
"""The file that makes a directory a reward model (:mod:`rlt2t.common.reward_model`)."""


def load_policy(
    model_cfg: ModelConfig,
    tokenizer_dir: str | Path | None = None,
    *,
    checkpoint: str | Path | None = None,
    seed: int | None = None,
    trainable_adapters: bool = False,
    reward_model_backbone: bool = False,
) -> Policy:
    """Build or load the policy.

    Precedence: ``checkpoint`` (an rlt2t checkpoint or any HF encoder–decoder directory) > ``model_cfg.path``
    > ``model_cfg.preset`` of ``model_cfg.family`` (from scratch, vocabulary taken from the tokenizer). The
    tokenizer comes from the model directory when it holds one, else from ``tokenizer_dir``. A directory of an
    architecture rlt2t does not know, or whose weights do not all load, raises UnsupportedModelError.

    A LoRA checkpoint (peft's adapter directory, naming its base) loads as base + adapters: merged into one
    plain model (to evaluate, serve, export or sample), or, with ``trainable_adapters``, as the peft model
    whose adapters train (a LoRA stage resuming).

    A reward model's directory (`rlt2t reward-model train`) is refused, unless ``reward_model_backbone`` (the
    reward model loading its own seq2seq backbone): its weights load as a policy but were trained to score.
    """
    path = checkpoint if checkpoint is not None else model_cfg.path
    if path is not None and not reward_model_backbone and (Path(path) / REWARD_MODEL_SPEC).is_file():
        raise ValueError(f"{path} is a reward model (`rlt2t reward-model train`), not a policy: use it as a reward "
                         "term (reward.terms=[{kind: reward_model, path: ...}]) or with `rlt2t reward-model score`")
    if path is not None and is_adapter_checkpoint(path):
        return _load_adapters(model_cfg, tokenizer_dir, Path(path), trainable=trainable_adapters)
    if path is not None:
        path = Path(path)
        family = family_of_dir(path)  # FileNotFoundError without config.json, UnsupportedModelError if unknown
        tok_src = tokenizer_source(path, tokenizer_dir)
        if tok_src is None:
            raise ValueError(f"{path} holds no tokenizer; set tokenizer.path to a tokenizer directory")
        tokenizer = prepare_tokenizer(load_tokenizer(tok_src), family, src_lang=model_cfg.src_lang)
        model = load_model(path, dropout=model_cfg.dropout)
        origin = str(path)
    else:
        if model_cfg.preset is None:
            raise ValueError("model: set either model.path (a pretrained directory) or model.preset")
        if tokenizer_dir is None:
            raise ValueError("a from-scratch model needs a tokenizer directory (run `rlt2t tokenizer build`)")
        family = FAMILIES[model_cfg.family]
        tokenizer = prepare_tokenizer(load_tokenizer(tokenizer_dir), family, src_lang=model_cfg.src_lang)
        if seed is not None:
            torch.manual_seed(seed)  # initial weights are part of the run's reproducibility
        model = build_model(preset_config(model_cfg.family, model_cfg.preset, tokenizer, model_cfg.dropout))
        origin = f"preset:{model_cfg.preset}" if family.name == "bart" else f"preset:{family.name}/{model_cfg.preset}"
    prepare_model(model, tokenizer, tgt_lang=model_cfg.tgt_lang)
    _check_vocabulary(model, tokenizer, origin)
    log.info("policy from %s (%s): %.2fM parameters, vocab %d", origin, family.name,
             sum(p.numel() for p in model.parameters()) / 1e6, vocab_size(model.config))
    return Policy(model=model, tokenizer=tokenizer, origin=origin)


def check_preset_holds(model_cfg: ModelConfig, checkpoint: str | Path, what: str) -> None:
    """Workers that build ``model_cfg``'s preset and load another process's weights into it (the RL job's rollout
    workers take the learner's) need the preset to be the architecture of ``checkpoint``, the weights' start: a
    checkpoint of another family or shape is refused here, naming the key, instead of failing every worker's
    strict load. Nothing to check with ``model.path`` (the workers load that directory) or for an adapter
    checkpoint (its base's config)."""
    config_file = Path(checkpoint) / "config.json"
    if model_cfg.path is not None or model_cfg.preset is None or not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    family = family_of(config, where=str(checkpoint))
    if family.name != model_cfg.family:
        raise ValueError(f"model.family={model_cfg.family}: {what} {checkpoint} is a {family.name} model, and the "
                         f"workers build model.preset={model_cfg.preset} of model.family to load its weights into; "
                         f"set model.family={family.name}")
    shape = PRESETS[model_cfg.preset]
    width = config.get("d_model")
    layers = config.get("encoder_layers", config.get("num_layers"))
    if (width, layers) != (shape["d_model"], shape["layers"]):
        raise ValueError(f"model.preset={model_cfg.preset} ({shape['d_model']} wide, {shape['layers']} layers): "
                         f"{what} {checkpoint} is {width} wide with {layers} layers; set model.preset to the "
                         f"one it was built from (known: {', '.join(PRESETS)})")


ADAPTER_CONFIG = "adapter_config.json"


def is_adapter_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` holds peft adapters (a LoRA stage's checkpoint) rather than a full model."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(path: str | Path) -> Path:
    """The base model directory an adapter checkpoint was trained on (recorded by peft when it was saved)."""
    config = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
    base = config.get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise FileNotFoundError(f"{path}: its base model {base!r} is not a model directory any more; adapters need "
                                f"the base they were trained on")
    return Path(base)


@contextlib.contextmanager
def peft_wrapping() -> Iterator[None]:
    """Around a peft wrapping of a model: peft asks it ``is_gradient_checkpointing``, which transformers 5
    deprecates with a FutureWarning on every wrap (once per Ray worker of a LoRA run), nothing a user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def _load_adapters(model_cfg: ModelConfig, tokenizer_dir: str | Path | None, path: Path, *, trainable: bool) -> Policy:
    base = load_policy(model_cfg, tokenizer_dir, checkpoint=adapter_base(path))
    with peft_wrapping():
        model = PeftModel.from_pretrained(base.model, str(path), is_trainable=trainable)
    if not trainable:
        model = model.merge_and_unload()
    return Policy(model=model, tokenizer=base.tokenizer, origin=str(path))


def lora_base(checkpoint: str | Path) -> Path:
    """The base that LoRA adapters trained from ``checkpoint`` adapt: the base an adapter checkpoint names (its
    adapters train on), or the plain model itself (fresh adapters are added to it)."""
    return adapter_base(checkpoint) if is_adapter_checkpoint(checkpoint) else Path(checkpoint)


def check_lengths(policy: Policy, data_cfg: DataConfig, new_tokens: Mapping[str, int] | None = None) -> None:
    """Reject source/target lengths the model has no positions for, naming the key and the most it may be; T5
    has no limit. ``new_tokens``: decoding lengths by key (``{"rollout.max_new_tokens": 64}``), which may use
    every position (the decoder start token takes the first, the last token decoded is never fed back)."""
    positions = max_positions(policy.model.config)
    if positions is None:
        return
    lengths = {f"data.{key}": getattr(data_cfg, key) for key in ("max_source_len", "max_target_len")}
    for key, value in {**lengths, **(new_tokens or {})}.items():
        if value > positions:
            raise ValueError(f"{key}={value} exceeds the model's {positions} positions ({policy.origin}): set "
                             f"{key}={positions} or lower")


def tokenizer_source(path: str | Path | None, tokenizer_dir: str | Path | None) -> Path | None:
    """The tokenizer :func:`load_policy` gives the model at ``path``: the directory's own (a LoRA adapter's
    base's, on which it loads), else ``tokenizer_dir``; None when there is neither."""
    if path is not None:
        path = adapter_base(path) if is_adapter_checkpoint(path) else Path(path)
        if has_tokenizer(path):
            return path
    return Path(tokenizer_dir) if tokenizer_dir is not None else None


def _check_vocabulary(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, origin: str) -> None:
    rows = vocab_size(model.config)
    if len(tokenizer) > rows:
        raise ValueError(
            f"{origin}: tokenizer has {len(tokenizer)} tokens but the model only {rows} "
            "embedding rows (shrink or grow the model with `rlt2t convert-model --vocab-size`)"
        )
