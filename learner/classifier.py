"""Sequence-classifier training for classifier rewards (a sentiment or intent model over small label sets).

Input: JSONL with ``text`` and ``label`` per line (bad lines fail with ``file:line: field '...'``). The model
is any local encoder or sequence-classification directory loaded with a fresh head of ``len(labels)``
outputs (``id2label`` saved in its config, so a reward term can name its label); cross-entropy, with the
optimizer, schedule, logs, checkpoints and resume of ``rlt2t.learner.trainer.train_stage`` and held-out
accuracy after every epoch (the best checkpoint is kept).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import Tensor
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerBase

from rlt2t.common.checkpoint import CheckpointInfo
from rlt2t.common.config import ClassifierConfig, RunConfig
from rlt2t.common.data import DataError
from rlt2t.common.plots import plot_curves
from rlt2t.learner.trainer import StageResult, train_stage

STAGE = "classifier"
PANELS = (
    ("loss", ("loss", "valid_loss"), None),
    ("accuracy", ("accuracy",), None),
)


@dataclass(frozen=True)
class LabelledText:
    text: str
    label: str


def read_labelled(path: str | Path) -> list[LabelledText]:
    """Labelled JSONL → texts with string labels (an integer label is read as its decimal string)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"labelled file not found: {path}")
    out = []
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except json.JSONDecodeError as e:
                raise DataError(path, number, None, f"not valid JSON: {e.msg}") from None
            if not isinstance(row, dict):
                raise DataError(path, number, None, f"expected a JSON object, got {type(row).__name__}")
            for key in ("text", "label"):
                if key not in row:
                    raise DataError(path, number, key, "missing")
            text, label = row["text"], row["label"]
            if not isinstance(text, str) or not text.strip():
                raise DataError(path, number, "text", "must be a non-empty string")
            if isinstance(label, bool) or not isinstance(label, str | int) or str(label).strip() == "":
                raise DataError(path, number, "label", f"must be a non-empty string or an integer, got {label!r}")
            out.append(LabelledText(text, str(label)))
    return out


def check_labels(rows: Sequence[LabelledText], labels: Sequence[str], path: str) -> None:
    known = set(labels)
    for i, r in enumerate(rows):
        if r.label not in known:
            raise ValueError(f"{path}: example {i + 1} has label {r.label!r}, not one of classifier.labels "
                             f"{list(labels)}")


def init_classifier(init: str | Path, labels: Sequence[str]) -> torch.nn.Module:
    """A classifier with a fresh head of ``len(labels)`` outputs on the backbone at ``init``."""
    return AutoModelForSequenceClassification.from_pretrained(
        str(init), num_labels=len(labels), id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)}, ignore_mismatched_sizes=True)


def make_collate(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, labels: Sequence[str], max_length: int):
    index = {name: i for i, name in enumerate(labels)}
    accepted = set(inspect.signature(model.forward).parameters)

    def collate(rows: list[LabelledText]) -> dict[str, Tensor]:
        enc = tokenizer([r.text for r in rows], truncation=True, max_length=max_length, padding=True,
                        return_tensors="pt")
        batch = {k: v for k, v in enc.items() if k in accepted}
        batch["labels"] = torch.tensor([index[r.label] for r in rows], dtype=torch.long)
        return batch

    return collate


def ce_step(model: torch.nn.Module, batch: dict[str, Tensor], accelerator: Accelerator) -> dict[str, float]:
    out = model(**batch)
    accelerator.backward(out.loss)
    accuracy = (out.logits.argmax(dim=-1) == batch["labels"]).float().mean().item()
    return {"loss": out.loss.item(), "accuracy": accuracy}


@torch.no_grad()
def evaluate_classifier(model: torch.nn.Module, collate, rows: Sequence[LabelledText], batch_size: int = 64
                        ) -> dict[str, float]:
    """Held-out ``accuracy`` and mean cross-entropy ``valid_loss``."""
    device = next(model.parameters()).device
    correct, loss_sum = 0, 0.0
    for first in range(0, len(rows), batch_size):
        batch = {k: v.to(device) for k, v in collate(list(rows[first : first + batch_size])).items()}
        out = model(**batch)
        correct += int((out.logits.argmax(dim=-1) == batch["labels"]).sum())
        loss_sum += float(out.loss) * len(batch["labels"])
    return {"accuracy": correct / len(rows), "valid_loss": loss_sum / len(rows)}


def train_classifier(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, train: Sequence[LabelledText],
                     valid: Sequence[LabelledText], labels: Sequence[str], cfg: ClassifierConfig, run: RunConfig,
                     out_dir: str | Path, resume_from: CheckpointInfo | None = None) -> StageResult:
    """Train ``model`` in place on ``train``; checkpoints under ``<out_dir>/checkpoints`` (best held-out accuracy
    kept), logs under ``<run.dir>/logs/classifier`` with ``curves.png``."""
    if not train:
        raise ValueError("classifier: no training examples")
    collate = make_collate(model, tokenizer, labels, cfg.max_length)
    result = train_stage(stage=STAGE, cfg=cfg, run=run, model=model, tokenizer=tokenizer, dataset=list(train),
                         collate=collate, step_fn=ce_step, out_dir=out_dir, resume_from=resume_from,
                         evaluate=(lambda m: evaluate_classifier(m, collate, valid)) if valid else None,
                         monitor="accuracy" if valid else None, monitor_ceiling=1.0)
    log_dir = Path(run.dir) / "logs" / STAGE
    plot_curves(log_dir / "metrics.jsonl", log_dir / "curves.png", title=f"classifier: {out_dir}", panels=PANELS)
    return result
