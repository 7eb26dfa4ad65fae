"""LoRA adapters through peft: train, checkpoint and publish a few low-rank matrices, not the whole model.

A LoRA policy is the frozen base model with a trainable update (alpha / r)·B·A beside each adapted linear
layer (``model.lora``: r, alpha, dropout, target_modules; the default targets are the attention query and
value projections of the model's family, keyed on ``config.model_type``). It is what lets a user RL-tune
flan-t5-xl or mbart-large on the GPUs they have: optimizer state, checkpoints and weight publishes cover
the adapters only (for the ``base`` preset with r = 8: see ``bench/lora.py`` for the bytes per publish).

The module lives in ``common/`` because every role needs part of it: the learner trains and publishes, the
rollout workers load published adapters, the servers and export need a merged model.

API (``model`` is the ``PeftModel`` that :func:`apply_lora` returns):

- :func:`apply_lora` (model, cfg, seed) -> PeftModel: base frozen, adapters trainable, initialised from
  ``seed`` without touching the global RNG (B = 0, so the policy starts equal to the base).
- :func:`adapter_state_dict` (model) -> {name: CPU tensor}: the adapter weights alone, what a learner
  checkpoints and publishes to rollout workers (names without the adapter name, peft's format).
- :func:`load_adapter_state_dict` (model, state): apply a published state to a LoRA policy of the same config
  (a rollout worker's copy); unknown or missing adapter keys raise.
- :func:`reference_policy` (model): context manager in which ``model`` computes as the base with adapters
  disabled: the reference log-probs for a KL penalty need no second copy of the model.
- :func:`merged_model` (model) -> a plain transformers model with the adapters merged into the base weights
  (a copy; the LoRA policy is left as it was): what CTranslate2 export and the torch server take.
- Checkpoints: ``save_checkpoint(model=peft_model)`` writes peft's adapter directory (adapter_config.json
  naming the base directory, adapter_model.safetensors) instead of full weights;
  :func:`rlt2t.common.policy.is_adapter_checkpoint` recognises one, :func:`load_lora_policy` loads base +
  adapters (trainable, to resume), :func:`load_merged_policy` a merged plain policy (to evaluate or serve) and
  :func:`save_merged_model` writes it as a model directory (to export: CTranslate2's converter reads
  directories).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, TaskType, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import PreTrainedModel
from typing_extensions import TypeIs

from rlt2t.common.config import LoraConfig, ModelConfig
from rlt2t.common.io import atomic_directory
from rlt2t.common.policy import Policy, load_policy, peft_wrapping
from rlt2t.common.tokenization import save_tokenizer

DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    "bart": ("q_proj", "v_proj"),
    "mbart": ("q_proj", "v_proj"),
    "marian": ("q_proj", "v_proj"),
    "pegasus": ("q_proj", "v_proj"),
    "t5": ("q", "v"),
    "mt5": ("q", "v"),
}
"""Attention query and value projections per ``config.model_type`` (the LoRA paper's choice). Each family
names them in every self- and cross-attention layer of both encoder and decoder."""


def lora_targets(model: PreTrainedModel, cfg: LoraConfig) -> list[str]:
    """``cfg.target_modules``, else the family default; an unknown family or a name no module has raises."""
    model_type = getattr(model.config, "model_type", None)
    if cfg.target_modules is not None:
        targets = list(cfg.target_modules)
    elif model_type in DEFAULT_TARGETS:
        targets = list(DEFAULT_TARGETS[model_type])
    else:
        raise ValueError(f"model.lora.target_modules: no default for model_type {model_type!r} (defaults exist for "
                         f"{', '.join(DEFAULT_TARGETS)}); name the linear layers to adapt")
    leaves = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    missing = [t for t in targets if t not in leaves]
    if missing or not targets:
        raise ValueError(f"model.lora.target_modules: {missing or targets} match no linear layer of this "
                         f"{model_type} model (its linear layers: {', '.join(sorted(leaves))})")
    return targets


def apply_lora(model: PreTrainedModel | PeftModel, cfg: LoraConfig, seed: int = 0) -> PeftModel:
    """Wrap ``model`` with LoRA adapters; only adapter weights require grad afterwards.

    The adapters' A matrices are drawn from ``seed`` inside a forked RNG, so the result does not depend on
    (or change) the global torch RNG: a run and its resumed continuation see the same random stream.
    """
    if isinstance(model, PeftModel):
        raise ValueError("the model already carries LoRA adapters")
    # peft annotates lora_alpha as int; it only enters the scale alpha / r, so a fractional alpha works.
    peft_cfg = PeftLoraConfig(task_type=TaskType.SEQ_2_SEQ_LM, r=cfg.r, lora_alpha=cfg.alpha,  # type: ignore[arg-type]
                              lora_dropout=cfg.dropout, target_modules=lora_targets(model, cfg), bias="none")
    with torch.random.fork_rng(devices=[]), peft_wrapping():
        torch.manual_seed(seed)
        return get_peft_model(model, peft_cfg)


def is_lora(model: torch.nn.Module) -> TypeIs[PeftModel]:
    """Whether ``model`` is a LoRA policy (a peft model)."""
    return isinstance(model, PeftModel)


def adapter_state_dict(model: PeftModel, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter weights alone, detached CPU copies (peft's key format); safe to publish while training.
    ``state``: take them from this state dict of ``model`` (its own parameter names) instead of the model."""
    return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(model, state_dict=state).items()}


def load_adapter_state_dict(model: PeftModel, state: dict[str, torch.Tensor]) -> None:
    """Copy published adapter weights into a LoRA policy of the same config; mismatched keys raise."""
    expected = set(get_peft_model_state_dict(model))
    if set(state) != expected:
        extra, missing = sorted(set(state) - expected), sorted(expected - set(state))
        raise ValueError(f"adapter state does not fit this model: unexpected {extra[:3]}, missing {missing[:3]} "
                         f"({len(extra)} and {len(missing)} keys)")
    set_peft_model_state_dict(model, state)


def state_dict_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of the tensors of a state dict (what a weight publish moves)."""
    return sum(t.numel() * t.element_size() for t in state.values())


@contextlib.contextmanager
def reference_policy(model: torch.nn.Module) -> Iterator[PeftModel]:
    """Inside the block ``model`` computes as its base model (adapters disabled); restored afterwards."""
    if not isinstance(model, PeftModel):
        raise TypeError("reference_policy needs a LoRA policy (apply_lora); a full fine-tune keeps a reference copy")
    with model.disable_adapter():
        yield model


def merged_model(model: torch.nn.Module) -> PreTrainedModel:
    """A plain transformers model whose weights are base + (alpha / r)·B·A; ``model`` itself is unchanged."""
    if not isinstance(model, PeftModel):
        raise TypeError("merged_model needs a LoRA policy (apply_lora)")
    merged = copy.deepcopy(model).merge_and_unload()
    merged.train(model.training)
    return merged


def load_lora_policy(model_cfg: ModelConfig, tokenizer_dir: str | Path | None, checkpoint: str | Path) -> Policy:
    """Base + the adapters of ``checkpoint``, trainable: the policy a LoRA stage resumes with."""
    return load_policy(model_cfg, tokenizer_dir, checkpoint=checkpoint, trainable_adapters=True)


def load_merged_policy(model_cfg: ModelConfig, tokenizer_dir: str | Path | None, checkpoint: str | Path) -> Policy:
    """Base + adapters of ``checkpoint`` merged into one plain model: to evaluate, export or serve it (what
    ``load_policy`` gives for an adapter checkpoint)."""
    return load_policy(model_cfg, tokenizer_dir, checkpoint=checkpoint)


def save_merged_model(model_cfg: ModelConfig, tokenizer_dir: str | Path | None, checkpoint: str | Path,
                      out_dir: str | Path) -> Path:
    """Write ``checkpoint``'s base + adapters merged as a plain model directory (weights, config, tokenizer),
    atomically: what a converter that reads directories (CTranslate2 export) takes."""
    policy = load_merged_policy(model_cfg, tokenizer_dir, checkpoint)
    with atomic_directory(out_dir) as tmp:
        policy.model.save_pretrained(str(tmp))
        save_tokenizer(policy.tokenizer, tmp)
    return Path(out_dir)


def policy_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a learner publishes and checkpoints of its policy: the adapters alone for a LoRA policy, every
    parameter otherwise (detached CPU copies)."""
    if is_lora(model):
        return adapter_state_dict(model)
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Install published weights (:func:`policy_weights`) into another copy of the policy: adapters into a LoRA
    policy, every parameter (strictly) otherwise."""
    if is_lora(model):
        load_adapter_state_dict(model, state)
    else:
        model.load_state_dict(state, strict=True)
