"""Reward-model training: the pairwise loss over preference groups, handed to the shared stage loop.

For a group (a rank list, a pair, a source's ratings) with rewards r and ordered pairs (i better than j):

    loss_group = mean over its pairs of  -log σ(r_i - r_j - margin)
    loss       = mean over the batch's groups of loss_group

so a rank list of K candidates contributes its K·(K-1)/2 pairs, weighted to count once like any other
group (docs/design.md, "Learned rewards"). Held-out pair accuracy (each held-out pair once: the better
candidate must score strictly higher) is evaluated after every epoch and picks the best checkpoint;
optimizer, schedule, clipping, logs, checkpoints and resume are ``rlt2t.learner.trainer.train_stage``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import Tensor

from rlt2t.common.checkpoint import CheckpointInfo
from rlt2t.common.config import RewardModelConfig, RunConfig
from rlt2t.common.plots import plot_curves
from rlt2t.common.preferences import PreferenceGroup
from rlt2t.common.reward_model import RewardModel
from rlt2t.learner.trainer import StageResult, train_stage

STAGE = "reward_model"
PANELS = (
    ("loss", ("loss", "valid_loss"), None),
    ("pair accuracy", ("pair_accuracy",), None),
    ("reward gap (better - worse)", ("reward_gap",), None),
)


def preference_loss(rewards: Tensor, better: Tensor, worse: Tensor, weight: Tensor, margin: float = 0.0) -> Tensor:
    """Σ_p weight_p · -log σ(r[better_p] - r[worse_p] - margin).

    Args:
        rewards: [N] rewards of every candidate in the batch.
        better, worse: [P] indices into ``rewards`` of each pair's better and worse candidate.
        weight: [P] pair weights; :func:`pair_tensors` gives each group's pairs 1 / (its pairs · groups), so
            the result is the mean over groups of each group's mean pair loss.
        margin: m >= 0; the loss keeps pushing until the better leads by more than m.

    Returns:
        A scalar tensor (logsigmoid: stable for large differences of either sign).
    """
    if not (better.shape == worse.shape == weight.shape) or better.dim() != 1:
        raise ValueError(f"better, worse and weight must be [P] alike, got {tuple(better.shape)}, "
                         f"{tuple(worse.shape)}, {tuple(weight.shape)}")
    diff = rewards[better] - rewards[worse] - margin
    return -(weight * F.logsigmoid(diff)).sum()


def pair_tensors(groups: Sequence[PreferenceGroup]) -> tuple[Tensor, Tensor, Tensor]:
    """(better [P], worse [P], weight [P]) over the groups' candidates laid end to end, in group order."""
    better, worse, weight, offset = [], [], [], 0
    for g in groups:
        w = 1.0 / (len(g.pairs) * len(groups))
        for i, j in g.pairs:
            better.append(offset + i)
            worse.append(offset + j)
            weight.append(w)
        offset += len(g.candidates)
    return (torch.tensor(better, dtype=torch.long), torch.tensor(worse, dtype=torch.long),
            torch.tensor(weight, dtype=torch.float32))


def make_collate(model: RewardModel):
    """Groups → the model's batch of every candidate (sources repeated) plus the pair tensors."""

    def collate(groups: list[PreferenceGroup]) -> dict[str, Tensor]:
        sources = [g.source for g in groups for _ in g.candidates]
        candidates = [c for g in groups for c in g.candidates]
        batch = model.encode(sources, candidates)
        batch["pair_better"], batch["pair_worse"], batch["pair_weight"] = pair_tensors(groups)
        return batch

    return collate


def make_step(margin: float):
    def step(model: torch.nn.Module, batch: dict[str, Tensor], accelerator: Accelerator) -> dict[str, float]:
        better, worse, weight = batch.pop("pair_better"), batch.pop("pair_worse"), batch.pop("pair_weight")
        rewards = model(**batch)
        loss = preference_loss(rewards, better, worse, weight, margin)
        accelerator.backward(loss)
        with torch.no_grad():
            gap = rewards[better] - rewards[worse]
        return {"loss": loss.item(), "pair_accuracy": (gap > 0).float().mean().item(), "reward_gap": gap.mean().item()}

    return step


def evaluate_groups(model: RewardModel, groups: Sequence[PreferenceGroup], *, margin: float = 0.0,
                    batch_size: int = 64) -> dict[str, float]:
    """Held-out ``pair_accuracy`` (each pair once; a tie counts as wrong), ``valid_loss`` (as in training:
    each group once) and the mean ``reward_gap`` of the held-out pairs."""
    sources = [g.source for g in groups for _ in g.candidates]
    candidates = [c for g in groups for c in g.candidates]
    rewards = torch.from_numpy(model.score(sources, candidates, batch_size=batch_size))
    better, worse, weight = pair_tensors(groups)
    gap = (rewards[better] - rewards[worse]).numpy()
    loss = preference_loss(rewards, better, worse, weight.double(), margin).item()
    return {"pair_accuracy": float(np.mean(gap > 0)), "valid_loss": loss, "reward_gap": float(np.mean(gap)),
            "valid_pairs": float(len(gap))}


def train_reward_model(model: RewardModel, train: Sequence[PreferenceGroup], valid: Sequence[PreferenceGroup],
                       cfg: RewardModelConfig, run: RunConfig, out_dir: str | Path,
                       resume_from: CheckpointInfo | None = None) -> StageResult:
    """Train ``model`` in place; checkpoints under ``<out_dir>/checkpoints`` (the best by held-out pair accuracy
    is kept), logs under ``<run.dir>/logs/reward_model`` with ``curves.png``."""
    if not train:
        raise ValueError("reward_model: no training preferences (give rank lists, pairs or ratings)")

    def evaluate(m: RewardModel) -> dict[str, float]:
        return evaluate_groups(m, valid, margin=cfg.margin)

    result = train_stage(stage=STAGE, cfg=cfg, run=run, model=model, tokenizer=model.tokenizer, dataset=list(train),
                         collate=make_collate(model), step_fn=make_step(cfg.margin), out_dir=out_dir,
                         resume_from=resume_from, evaluate=evaluate if valid else None,
                         monitor="pair_accuracy" if valid else None, monitor_ceiling=1.0)
    log_dir = Path(run.dir) / "logs" / STAGE
    plot_curves(log_dir / "metrics.jsonl", log_dir / "curves.png", title=f"reward model: {out_dir}", panels=PANELS)
    return result
