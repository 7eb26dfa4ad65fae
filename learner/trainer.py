"""The training loop shared by denoising pretraining and SFT.

One loop, read top to bottom: resume → for epoch: for batch: step → log → checkpoint. A stage
supplies its dataset (indexable, items are dicts of id lists), a collate function and a *step
function* that runs forward and backward (so R-drop and FGM can do several passes); the loop owns
optimizer, schedule, clipping, progress, logs, evaluation hooks and checkpoints.

Exactness: batch order is a permutation seeded by (seed, epoch); a resumed run skips the batches
already done in its epoch and restores optimizer, scheduler and RNG state, so it continues the same
trajectory.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from rlt2t.common.checkpoint import (
    BestCheckpoint,
    CheckpointInfo,
    best_beside,
    check_schedule_length,
    checkpoint_name,
    load_training_state,
    prune_checkpoints,
    save_checkpoint,
    set_rng_state,
)
from rlt2t.common.config import FSDPConfig, RunConfig, StageConfig
from rlt2t.common.families import check_mixed_precision
from rlt2t.common.tracking import RunLogger, scores_line
from rlt2t.learner.schedule import linear_warmup_decay
from rlt2t.learner.sharding import rank_bytes
from rlt2t.learner.stage_ranks import StageRanks

log = logging.getLogger("rlt2t.trainer")


Item = TypeVar("Item")
Model = TypeVar("Model", bound=torch.nn.Module)
Item_co = TypeVar("Item_co", covariant=True)


class StageDataset(Protocol[Item_co]):
    """What the loop reads of a dataset: its length and items by index (a stage may add ``set_epoch(epoch)``,
    called at the start of every epoch, to re-seed its per-epoch randomness)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Item_co: ...


class StepFn(Protocol):
    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], accelerator: Accelerator
                 ) -> dict[str, float]:
        """Forward and backward for one batch (no optimizer step); returns scalars to log (incl. "loss")."""


class Heartbeat:
    """A stage's progress as a log line at most every ``every_s`` seconds (called at its ``run.log_every`` steps):
    step, epoch, loss, examples/s and the time left at the stage's pace so far."""

    def __init__(self, stage: str, total_steps: int, first_step: int, every_s: float = 30.0) -> None:
        self.stage, self.total, self.first, self.every_s = stage, total_steps, first_step, every_s
        self.t0 = self.last = time.perf_counter()

    def __call__(self, step: int, epoch: int, metrics: dict[str, float]) -> None:
        now = time.perf_counter()
        if now - self.last < self.every_s or step >= self.total:
            return
        self.last = now
        left = (self.total - step) * (now - self.t0) / max(step - self.first, 1)
        log.info("%s step %d/%d (epoch %d): loss %.4f, %.1f examples/s, about %s left", self.stage, step, self.total,
                 epoch + 1, metrics["loss"], metrics["examples_per_s"], _duration(left))


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min" if seconds < 5400 else \
        f"{seconds / 3600:.1f} h"


class _NoLogger:
    """The metrics log of a rank other than 0 (rank 0 writes the stage's logs)."""

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class StageResult:
    checkpoint: Path
    steps: int
    last_metrics: dict[str, float]

    @property
    def best(self) -> Path:
        """The checkpoint the stage's monitor picked as best (what eval, export and ``init`` load when given the
        stage's checkpoint root), else the newest: ``checkpoint`` is the stage's last checkpoint."""
        return best_beside(self.checkpoint)


def make_accelerator(run: RunConfig, *, sharded: bool = False) -> Accelerator:
    """accelerate on ``run.device`` with ``run.mixed_precision`` (CPU: fp32); ``sharded``: it names the device
    alone (FSDP2 shards, places and casts the model itself)."""
    cpu = run.device == "cpu" or (run.device == "auto" and not torch.cuda.is_available())
    if run.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run.device=cuda but no CUDA device is visible")
    if run.threads:
        torch.set_num_threads(run.threads)
    return Accelerator(cpu=cpu, mixed_precision="no" if cpu or sharded else run.mixed_precision)


def model_config(model: torch.nn.Module) -> PretrainedConfig | None:
    """The config the fp16 guard checks: the model's own (a policy, a classifier) or, for a reward model (which
    has no ``config``), its backbone's; None when neither has one."""
    config = getattr(model, "config", None)
    if config is None:
        config = getattr(getattr(model, "backbone", None), "config", None)
    return config


def scaler_state(accelerator: Accelerator) -> dict[str, Any]:
    """The fp16 gradient scaler's state for the training state ({} without a scaler: CPU, bf16, fp32). Its
    loss scale is found over thousands of steps; a resume that restarted it would skip steps to overflow again
    and leave the trajectory of the uninterrupted run."""
    scaler = accelerator.scaler
    return {"scaler": scaler.state_dict()} if scaler is not None else {}


def load_scaler_state(accelerator: Accelerator, state: dict[str, Any]) -> None:
    """Restore :func:`scaler_state` when both the checkpoint and this run have a scaler (a run resumed under
    another ``run.mixed_precision`` starts its own)."""
    if accelerator.scaler is not None and "scaler" in state:
        accelerator.scaler.load_state_dict(state["scaler"])
    elif accelerator.scaler is not None:
        log.warning("resuming under fp16 from a checkpoint without gradient-scaler state: the loss scale restarts")


GROUP_WINDOW = 64
"""Batches per window of a length-grouped epoch order (:func:`epoch_order`)."""


def epoch_order(n: int, seed: int, epoch: int, *, batch_size: int = 1,
                lengths: Sequence[Any] | None = None) -> list[int]:
    """The example order of an epoch: a permutation depending only on (seed, epoch) and ``lengths``.

    With ``lengths`` (one sort key per example, e.g. its source length in tokens) the batches are grouped
    by length: the permutation is cut into windows of :data:`GROUP_WINDOW` batches, each window sorted by key
    (stably, so equal keys keep their random order) and cut into batches of ``batch_size``, and the epoch's full
    batches are shuffled; a last, partial batch stays last (the loop reads batch ``b`` as the order's slice
    ``[b * batch_size, (b + 1) * batch_size)``).
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(n, generator=g).tolist()
    if lengths is None or batch_size < 2:
        return order
    if len(lengths) != n:
        raise ValueError(f"{len(lengths)} length keys for {n} examples")
    window = GROUP_WINDOW * batch_size
    grouped = [i for w in range(0, n, window) for i in sorted(order[w:w + window], key=lengths.__getitem__)]
    full = n // batch_size
    shuffled = torch.randperm(full, generator=g).tolist()
    return [i for b in shuffled for i in grouped[b * batch_size:(b + 1) * batch_size]] + grouped[full * batch_size:]


def train_stage(
    *,
    stage: str,
    cfg: StageConfig,
    run: RunConfig,
    model: Model,
    tokenizer: PreTrainedTokenizerBase,
    dataset: StageDataset[Item],
    collate: Callable[[list[Item]], dict[str, torch.Tensor]],
    step_fn: StepFn,
    out_dir: str | Path,
    resume_from: CheckpointInfo | None = None,
    evaluate: Callable[[Model], dict[str, float]] | None = None,
    monitor: str | None = None,
    monitor_by: str | None = None,
    monitor_ceiling: float | None = None,
    patience: int = 0,
    patience_counts: Callable[[dict[str, float]], bool] | None = None,
    lengths: Sequence[Any] | None = None,
    strategy: str = "local",
    fsdp: FSDPConfig | None = None,
) -> StageResult:
    """Train ``model`` in place on ``dataset``; checkpoints (with ``tokenizer``) go to ``<out_dir>/checkpoints``.

    ``model`` is a policy's model, or a reward model or classifier. ``resume_from`` must be a checkpoint of
    this stage whose weights ``model`` already holds
    (``load_policy(checkpoint=...)``); optimizer, scheduler, RNG and data position come from it.
    ``evaluate`` runs after each epoch; ``monitor`` names its metric to keep the best checkpoint of (``monitor_by``
    what that measures, for logs and checkpoint meta: ``metric.monitor``, ``loss``; default ``monitor``;
    ``monitor_ceiling`` the best it can be, as an accuracy's 1.0: reaching it is not "still improving"); with
    ``patience`` > 0 the stage stops once that many epochs in a row have not beaten the best (early stopping:
    the count is kept in checkpoint meta, so a resumed run stops where the uninterrupted one did).
    ``patience_counts(scores)`` False leaves an epoch out of that count (SFT: while its outputs have collapsed).
    ``lengths`` (a sort key per example): batches grouped by length (:func:`epoch_order`).
    ``strategy`` ddp or fsdp (with ``fsdp``'s options): this process is one rank of the stage's process group,
    and every rank calls this function alike (:mod:`rlt2t.learner.stage_ranks`).
    """
    if len(dataset) == 0:
        raise ValueError(f"{stage}: the training set is empty")
    out_dir = Path(out_dir)
    ckpt_root = out_dir / "checkpoints"
    config = model_config(model)
    if config is not None:
        check_mixed_precision(config, run.mixed_precision)  # T5 in fp16 overflows: refused at start
    ranks = StageRanks.current(strategy, stage)
    fsdp = fsdp or FSDPConfig()
    accelerator = make_accelerator(run, sharded=ranks.sharded)
    # What trains: the model, or under FSDP its shards under a root unit (before the optimizer sees them).
    trained = ranks.shard(model, stage, fsdp, accelerator.device,
                          run.mixed_precision if accelerator.device.type == "cuda" else "no")
    steps_per_epoch = math.ceil(len(dataset) / cfg.batch_size)
    total_steps = cfg.epochs * steps_per_epoch
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    # Only what trains is optimised: every weight in full fine-tuning, the adapters alone under LoRA (the frozen
    # base then carries no optimizer state, and its gradients are never computed).
    params = [p for p in trained.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = linear_warmup_decay(
        optimizer, warmup_steps=round(cfg.warmup_ratio * total_steps), total_steps=total_steps,
        min_lr_ratio=cfg.min_lr_ratio,
    )
    if not ranks.sharded:
        trained, optimizer = accelerator.prepare(trained, optimizer)

    step, start_epoch, skip_batches = 0, 0, 0
    best = BestCheckpoint.from_meta(resume_from.meta if resume_from is not None else None, monitor_by)
    monitor_by = monitor_by or monitor  # in logs
    # Epochs in a row whose monitor did not beat the best (early stopping with `patience`).
    since_best = int(resume_from.meta.get("since_best", 0)) if resume_from is not None else 0
    if resume_from is not None:
        check_schedule_length(stage, resume_from, total_steps, f"{stage}.epochs, {stage}.max_steps, "
                              f"{stage}.batch_size", f"remove {out_dir} or train into another directory")
        ranks.check_layout(stage, resume_from.path, resume_from.meta)
        state = load_training_state(resume_from.path)
        own = ranks.own_state(resume_from.path, state, optimizer)
        scheduler.load_state_dict(state["scheduler"])
        load_scaler_state(accelerator, state)
        set_rng_state(own["rng"])
        step = resume_from.step
        start_epoch, skip_batches = resume_from.meta["epoch"], resume_from.meta["batch_in_epoch"]
        log.info("%s: resuming from %s (step %d: %d epoch%s done%s)", stage, resume_from.path, step, start_epoch,
                 "" if start_epoch == 1 else "s", f", then {skip_batches} batches" if skip_batches else "")
    else:
        # Each rank its own dropout masks (reproducible: every rank's RNG is in the checkpoint).
        torch.manual_seed(run.seed if not ranks.distributed else run.seed * 7919 + ranks.rank)

    if patience and not (evaluate is not None and monitor):
        log.info("%s: %s.patience=%d needs a validation monitor (a validation split, metric.monitor_size > 0): "
                 "every epoch runs", stage, stage, patience)
        patience = 0
    logger = RunLogger(Path(run.dir) / "logs" / stage, stage) if ranks.main else _NoLogger()
    log.info("%s: %d examples, %d steps/epoch, %d steps, batch %d%s, lr %.2g, device %s%s", stage, len(dataset),
             steps_per_epoch, total_steps, cfg.batch_size, " grouped by length" if lengths is not None else "", cfg.lr,
             accelerator.device, f", {ranks.world} {strategy} ranks" if ranks.distributed else "")

    def checkpoint(name: str, epoch: int, batch_in_epoch: int, metrics: dict[str, float]) -> Path:
        meta = {"stage": stage, "epoch": epoch, "batch_in_epoch": batch_in_epoch, "metrics": metrics,
                "total_steps": total_steps, "best": best.meta(), "since_best": since_best, **ranks.layout()}
        saved = ranks.saved_model(trained, model)  # under FSDP a collective: the weights gathered from the shards
        path = ckpt_root / name
        if ranks.main:
            save_checkpoint(ckpt_root, name, model=saved, tokenizer=tokenizer, step=step, meta=meta,
                            training_state=ranks.training_state(optimizer, {"scheduler": scheduler.state_dict(),
                                                                            **scaler_state(accelerator)}),
                            fill=lambda directory: ranks.write_own(optimizer, directory))
            prune_checkpoints(ckpt_root, cfg.keep_last, protect=best.protect() | {path})
        else:
            ranks.write_own(optimizer, None)
        ranks.from_main(None)  # the others wait for it: they may read it next (the stage's result)
        return path

    bar = tqdm(total=total_steps, initial=step, desc=stage,
               disable=True if not (run.progress and ranks.main) else None, dynamic_ncols=True)
    # Without a bar on the screen (output to a file, a Ray job's log, CI) a line now and then says the stage lives.
    heartbeat = Heartbeat(stage, total_steps, step) if ranks.main and run.progress and bar.disable else None
    last: dict[str, float] = {}
    last_path: Path | None = None
    converging = False  # the monitor beat its best at the stage's last epoch: it stopped while still improving
    window_t, window_n = time.perf_counter(), 0
    trained.train()
    try:
        for epoch in range(start_epoch, cfg.epochs):
            if step >= total_steps or (patience and since_best >= patience):
                break
            if hasattr(dataset, "set_epoch"):
                dataset.set_epoch(epoch)
            order = epoch_order(len(dataset), run.seed, epoch, batch_size=cfg.batch_size, lengths=lengths)
            first = skip_batches if epoch == start_epoch else 0
            for b in range(first, steps_per_epoch):
                if step >= total_steps:
                    break
                batch_ids = order[b * cfg.batch_size : (b + 1) * cfg.batch_size]
                items = [dataset[i] for i in ranks.share(batch_ids)]
                batch = {k: v.to(accelerator.device) for k, v in collate(items).items()}
                metrics = ranks.mean(step_fn(trained, batch, accelerator), accelerator.device)
                grad_norm = ranks.clip_grad_norm(params, cfg.grad_clip, accelerator)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                window_n += len(batch_ids)
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.4f}", epoch=epoch + 1)
                if step % run.log_every == 0 or step == total_steps:
                    elapsed = time.perf_counter() - window_t
                    last = {**metrics, "lr": float(scheduler.get_last_lr()[0]), "grad_norm": float(grad_norm),
                            "epoch": epoch, "examples_per_s": window_n / max(elapsed, 1e-9)}
                    if ranks.distributed:  # rank 0's parameters and optimizer state: 1/N of them under FSDP
                        last["rank_state_bytes"] = rank_bytes(trained, optimizer)
                    logger.log(step, last)
                    if heartbeat is not None:
                        heartbeat(step, epoch, last)
                    window_t, window_n = time.perf_counter(), 0
                if not math.isfinite(metrics["loss"]):
                    raise FloatingPointError(f"{stage}: loss is {metrics['loss']} at step {step}; lower {stage}.lr")
                if cfg.save_every_steps and step % cfg.save_every_steps == 0 and b + 1 < steps_per_epoch:
                    last_path = checkpoint(checkpoint_name(step=step), epoch, b + 1, last)
            # End of epoch: evaluate, checkpoint, keep the best.
            scores: dict[str, float] = {}
            if evaluate is not None:
                trained.eval()
                with torch.no_grad(), ranks.whole(trained, fsdp):
                    scores = ranks.from_main(evaluate(model))
                trained.train()
                logger.log(step, {**scores, "epoch": epoch}, kind="valid")
                log.info("%s epoch %d/%d: %s", stage, epoch + 1, cfg.epochs,  # counted as checkpoints are named
                         scores_line(scores, monitor_by))
            name = checkpoint_name(epoch=epoch + 1)
            if monitor and monitor in scores:
                counts = patience_counts is None or patience_counts(scores)  # a collapsed epoch does not count
                since_best = 0 if best.offer(scores[monitor], ckpt_root / name) else since_best + int(counts)
                converging = since_best == 0 and epoch > 0 and epoch + 1 == cfg.epochs
            last_path = checkpoint(name, epoch + 1, 0, {**last, **scores})
            if patience and since_best >= patience and epoch + 1 < cfg.epochs and step < total_steps:
                log.info("%s: early stop after %d of %d epochs: the monitor (%s) has not beaten %.4f (%s) for %d "
                         "epoch%s (%s.patience=%d)", stage, epoch + 1, cfg.epochs, monitor_by, best.score,
                         best.path.name if best.path else "-", since_best, "" if since_best == 1 else "s", stage,
                         patience)
        if last_path is None:  # resumed at the very end: nothing left to do
            last_path = (resume_from.path if resume_from is not None
                         else checkpoint(checkpoint_name(step=step), 0, 0, last))
    finally:
        bar.close()
        logger.close()
    if best.path is not None:
        log.info("%s: best by the monitor (%s): %.4f at %s", stage, monitor_by, best.score, best.path)
    if converging and not (monitor_ceiling is not None and best.score is not None and best.score >= monitor_ceiling):
        log.info("%s: the monitor (%s) still improved at the last of its %d epochs: the stage ended before it "
                 "converged, and what starts from it starts from a model still learning; train it again with a "
                 "larger %s.epochs, in a new run.dir or after removing %s (a stage resumes only on the schedule "
                 "it started)", stage, monitor_by, cfg.epochs, stage, ckpt_root.parent)
    return StageResult(checkpoint=last_path, steps=step, last_metrics=last)
