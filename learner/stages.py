"""Denoising pretraining and SFT: datasets, collate and step functions handed to `train_stage`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from transformers import PretrainedConfig

from rlt2t.common.checkpoint import CheckpointInfo
from rlt2t.common.collate import collate_seq2seq, cut_ids
from rlt2t.common.config import FSDPConfig, LoraConfig, PretrainConfig, RunConfig, SFTConfig
from rlt2t.common.families import decoder_input_ids, max_positions
from rlt2t.common.lora import apply_lora, is_lora
from rlt2t.common.policy import Policy
from rlt2t.common.tokenization import sentinel_ids, template_affixes
from rlt2t.learner.augment import augment_tokens
from rlt2t.learner.fgm import FGM
from rlt2t.learner.noising import DenoisingDataset
from rlt2t.learner.rdrop import rdrop_forward
from rlt2t.learner.trainer import StageResult, train_stage


class SFTDataset:
    """Encoded (source, target) pairs; sources optionally augmented (delete / repeat), seeded per (epoch, index).

    Repeats lengthen a source, and sources come cut to the limit already: an augmented one is cut again to
    ``max_source_len`` (None: no limit), keeping the template's special tokens (``affixes``, as
    ``encode_texts`` does), or it would run past the model's position table.
    """

    def __init__(self, sources: Sequence[list[int]], targets: Sequence[list[int]], *, augment_prob: float,
                 protected_ids: set[int], seed: int, max_source_len: int | None = None,
                 affixes: tuple[int, int] = (0, 1)):
        if len(sources) != len(targets):
            raise ValueError(f"{len(sources)} sources but {len(targets)} targets")
        self.sources, self.targets = sources, targets
        self.augment_prob, self.protected_ids, self.seed = augment_prob, frozenset(protected_ids), seed
        self.max_source_len, self.affixes = max_source_len, affixes
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.sources)

    def lengths(self) -> list[int]:
        """Source token counts (before augmentation): the sort keys of batches grouped by length."""
        return [len(s) for s in self.sources]

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        src = self.sources[i]
        if self.augment_prob > 0:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, self.epoch, i]))
            src = augment_tokens(src, rng, prob=self.augment_prob, protected_ids=self.protected_ids)
            if self.max_source_len is not None:
                src = cut_ids(src, self.max_source_len, self.affixes)
        return {"input_ids": src, "labels": self.targets[i]}


def make_collate(pad_id: int, model_config: PretrainedConfig):
    """Padded batches with explicit decoder inputs ([decoder start] + labels[:-1]): one convention for every
    family, whatever shifting a Hugging Face model would do with labels alone (mBART's differs)."""

    def collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = collate_seq2seq([it["input_ids"] for it in items], [it["labels"] for it in items], pad_id)
        batch["decoder_input_ids"] = decoder_input_ids(batch["labels"], model_config)
        return batch

    return collate


def ce_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], accelerator: Accelerator) -> dict[str, float]:
    """Plain cross-entropy forward + backward."""
    loss = model(**batch).loss
    accelerator.backward(loss)
    return {"loss": loss.item()}


def make_sft_step(cfg: SFTConfig, model: torch.nn.Module):
    """CE, with R-drop when ``rdrop_alpha`` > 0 and an FGM adversarial pass when ``fgm_epsilon`` > 0."""
    fgm = FGM(model, cfg.fgm_epsilon) if cfg.fgm_epsilon > 0 else None

    def step(model: torch.nn.Module, batch: dict[str, torch.Tensor], accelerator: Accelerator) -> dict[str, float]:
        if cfg.rdrop_alpha > 0:
            out = rdrop_forward(model, batch, cfg.rdrop_alpha)
            loss, metrics = out.loss, {"ce": out.ce.item(), "kl": out.kl.item()}
        else:
            loss = model(**batch).loss
            metrics = {}
        accelerator.backward(loss)
        if fgm is not None:
            with fgm.perturbed() as perturbed:
                if perturbed:
                    adv = model(**batch).loss
                    accelerator.backward(adv)
                    metrics["adv_loss"] = adv.item()
        return {"loss": loss.item(), **metrics}

    return step


def run_pretrain(policy: Policy, texts: Sequence[list[int]], cfg: PretrainConfig, run: RunConfig, out_dir: Path,
                 resume_from: CheckpointInfo | None = None, fsdp: FSDPConfig | None = None) -> StageResult:
    """Denoising on token-id texts (no EOS): span corruption, noise re-sampled per access; the decoder writes the
    whole text or only the masked spans (``cfg.objective``). ``fsdp``: the options of ``cfg.strategy=fsdp``."""
    tok = policy.tokenizer
    dataset = DenoisingDataset(texts, sentinel_ids=sentinel_ids(tok), eos_id=tok.eos_token_id, seed=run.seed,
                               noise_density=cfg.noise_density, mean_span_length=cfg.mean_span_length,
                               reconstruct=cfg.objective == "reconstruct")
    return train_stage(stage="pretrain", cfg=cfg, run=run, model=policy.model, tokenizer=tok, dataset=dataset,
                       collate=make_collate(tok.pad_token_id, policy.model.config), step_fn=ce_step, out_dir=out_dir,
                       resume_from=resume_from, lengths=dataset.lengths() if cfg.group_by_length else None,
                       strategy=cfg.strategy, fsdp=fsdp)


def with_lora(policy: Policy, lora: LoraConfig, seed: int) -> Policy:
    """The policy with LoRA adapters on its frozen base (unchanged if it carries them already, as when resumed
    from an adapter checkpoint). The base must be a model directory: an adapter checkpoint names it."""
    if is_lora(policy.model):
        return policy
    if policy.origin.startswith("preset:"):
        raise ValueError("model.lora: LoRA adapts a pretrained base, but this model is built from scratch "
                         f"({policy.origin}); give model.path, --init, or pretrain first")
    model = apply_lora(policy.model, lora, seed=seed)
    # peft records the base as it was loaded; an absolute path keeps the checkpoint usable from any directory.
    model.peft_config["default"].base_model_name_or_path = str(Path(policy.origin).resolve())
    return Policy(model=model, tokenizer=policy.tokenizer, origin=policy.origin)


def run_sft(policy: Policy, sources: Sequence[list[int]], targets: Sequence[list[int]], cfg: SFTConfig,
            run: RunConfig, out_dir: Path, resume_from: CheckpointInfo | None = None, evaluate=None,
            lora: LoraConfig | None = None, max_source_len: int | None = None, stage: str = "sft",
            patience_counts=None, fsdp: FSDPConfig | None = None, monitor_by: str | None = None) -> StageResult:
    """Supervised fine-tuning: CE (+ R-drop, augmentation, FGM as configured), best checkpoint by the monitor
    (the ``monitor`` score of ``evaluate``; ``monitor_by`` names what it measures).

    With ``lora.enabled`` only LoRA adapters train (``rlt2t.common.lora``) and checkpoints hold the adapters
    plus the training state; resume from one with ``load_lora_policy``. ``max_source_len``
    (``data.max_source_len``) bounds augmented sources; None: the model's position limit. ``stage`` names
    the logs (``<run>/logs/<stage>``) and checkpoint meta. ``fsdp``: the options of ``cfg.strategy=fsdp``.
    """
    if lora is not None and lora.enabled:
        if cfg.fgm_epsilon > 0:
            raise ValueError("sft.fgm_epsilon: FGM perturbs the input embedding along its gradient, which LoRA "
                             "freezes (model.lora.enabled); set sft.fgm_epsilon=0")
        policy = with_lora(policy, lora, seed=run.seed)
    tok = policy.tokenizer
    dataset = SFTDataset(sources, targets, augment_prob=cfg.augment_prob, protected_ids=set(tok.all_special_ids),
                         seed=run.seed, max_source_len=max_source_len or max_positions(policy.model.config),
                         affixes=template_affixes(tok))
    return train_stage(stage=stage, cfg=cfg, run=run, model=policy.model, tokenizer=tok, dataset=dataset,
                       collate=make_collate(tok.pad_token_id, policy.model.config),
                       step_fn=make_sft_step(cfg, policy.model), out_dir=out_dir, resume_from=resume_from,
                       evaluate=evaluate, monitor="monitor" if evaluate is not None else None, monitor_by=monitor_by,
                       patience=cfg.patience, patience_counts=patience_counts,
                       lengths=dataset.lengths() if cfg.group_by_length else None, strategy=cfg.strategy, fsdp=fsdp)
