"""The RL job of an offline preference algorithm (a unit whose data is `preferences`, e.g. ``rl.algorithm=dpo``):
the same learner group, checkpoints, validation and resume as the online job (``rlt2t.driver``), fed from a fixed
set of preference pairs instead of rollouts.

    pairs (files, or samples of the start ordered by the reward) → for epoch: learn → evaluate → checkpoint

The pairs are fixed before the first step and written to ``{run}/rl/preference_pairs.jsonl``: a resumed run
reads them back, so it trains on exactly the same pairs in the same order (bitwise on CPU, as the online job).
Sampled pairs come from Ray tasks (``rl.rollout_workers`` of them, each loading the start once, sampling and
scoring its share); only their texts reach this process. Each step's pairs go to the learner ranks as text,
rank i taking pairs i, i + N, ...
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

import ray
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from rlt2t.common.algorithms import nan_loss_advice
from rlt2t.common.checkpoint import (
    BestCheckpoint,
    CheckpointInfo,
    check_schedule_length,
    checkpoint_name,
    prune_checkpoints,
)
from rlt2t.common.config import Config
from rlt2t.common.data import Example, reference_sets
from rlt2t.common.metrics import DocumentFrequency
from rlt2t.common.rewards import UserRegistrations, check_reward, local_reward
from rlt2t.common.tracking import RunLogger
from rlt2t.common.types import PreferencePair, ScoredGroup
from rlt2t.driver import (
    STAGE,
    TrainResult,
    close_logs,
    document_frequency,
    progress_line,
    training_subset,
    validate_epoch,
)
from rlt2t.groups import LearnerGroup, check_cluster, init_ray
from rlt2t.learner.evaluate import Monitor, job_monitor, monitor_name
from rlt2t.learner.trainer import epoch_order
from rlt2t.preference_data import best_worst_pairs, file_pairs, pairs_file, read_pairs_file, write_pairs_file

log = logging.getLogger("rlt2t.train")


def train(cfg: Config, train_set: Sequence[Example], valid: Sequence[Example], *, init: Path,
          resume_from: CheckpointInfo | None = None, stop_after_steps: int = 0, start: Path | None = None
          ) -> TrainResult:
    """Train ``rl.algorithm`` (an offline preference unit) from ``start`` (default ``init``, also the frozen
    reference) or resume ``resume_from``; returns the last checkpoint."""
    r = cfg.rl
    start = Path(resume_from.path) if resume_from else (start or init)
    monitor = job_monitor(cfg, lambda: local_reward(cfg.reward, reference_sets(training_subset(cfg, train_set))))
    pairs = _pairs(cfg, train_set, init, resumed=resume_from is not None)
    if len(pairs) < r.learners:
        raise ValueError(f"rl: {len(pairs)} preference pairs for {r.learners} learner ranks")
    steps_per_epoch = math.ceil(len(pairs) / r.batch_size)
    total_steps = r.epochs * steps_per_epoch if not r.max_steps else min(r.max_steps, r.epochs * steps_per_epoch)
    if resume_from is not None:
        check_schedule_length(STAGE, resume_from, total_steps, "rl.epochs, rl.max_steps, rl.batch_size, the pairs",
                              f"remove {cfg.run_dir / STAGE}")
        if resume_from.step >= total_steps:
            log.info("rl: %s is the run's last step (%d of %d): nothing left to train", resume_from.path,
                     resume_from.step, total_steps)
            return TrainResult(checkpoint=Path(resume_from.path), steps=resume_from.step)
    init_ray(cfg)
    learners = LearnerGroup(cfg, start, total_steps, reference_checkpoint=init)
    try:
        with logging_redirect_tqdm():
            return _run(cfg, learners, pairs, valid, monitor, init=init, start=start, resume_from=resume_from,
                        steps_per_epoch=steps_per_epoch, total_steps=total_steps, stop_after_steps=stop_after_steps)
    finally:
        learners.shutdown()


def _pairs(cfg: Config, train_set: Sequence[Example], init: Path, *, resumed: bool) -> list[PreferencePair]:
    """The run's pairs: read back when the run already fixed them, else from the settings' files or sampled."""
    path = pairs_file(cfg.run_dir)
    if resumed and path.exists():
        pairs = read_pairs_file(path)
        log.info("rl: %d preference pairs from %s (the run's own)", len(pairs), path)
        return pairs
    settings = cfg.rl.section()
    pairs = file_pairs(settings, f"rl.{cfg.rl.unit.name}")
    if pairs:
        log.info("rl: %d preference pairs from %d files", len(pairs),
                 len(settings.rank_lists) + len(settings.pairs) + len(settings.ratings))
    else:
        pairs = sample_pairs(cfg, training_subset(cfg, train_set), init, settings.sampled_candidates)
    write_pairs_file(path, pairs)
    return pairs


def sample_pairs(cfg: Config, examples: Sequence[Example], start: Path, k: int) -> list[PreferencePair]:
    """One pair per source of ``examples``: the best over the worst of ``k`` samples of ``start`` by the reward
    (sources whose samples tie are left out). Sampled and scored by ``rl.rollout_workers`` Ray tasks."""
    if cfg.reward.source == "http":
        raise ValueError("rl: sampled preference pairs are scored by the reward in-job; set reward.source=ray, or "
                         "give preference files (rl.<algorithm>.rank_lists / pairs / ratings)")
    check_reward(cfg.reward)
    init_ray(cfg)
    check_cluster(cfg)
    df = document_frequency(examples, cfg.run_dir / STAGE)
    r = cfg.rl
    n = max(1, min(r.rollout_workers, len(examples)))
    task = ray.remote(_sample_and_score).options(num_cpus=r.rollout_cpus, num_gpus=r.rollout_gpus)
    t0 = time.perf_counter()
    shares = [list(examples[i::n]) for i in range(n)]
    refs = [task.remote(cfg, str(start), share, k, df, UserRegistrations.used_by(cfg.reward)) for share in shares]
    log.info("rl: sampling %d candidates for each of %d sources from %s to order by the reward (%d Ray task%s)",
             k, len(examples), start, n, "" if n == 1 else "s")
    results = ray.get(refs)
    pairs = [p for share_pairs, _ in results for p in share_pairs]
    ties = sum(t for _, t in results)
    order = {e.id: i for i, e in enumerate(examples)}
    pairs.sort(key=lambda p: order[p.example_id])  # the sources' order, whatever the tasks' split
    log.info("rl: %d preference pairs from %d sources in %.1f s (%d sources left out: their samples tie)",
             len(pairs), len(examples), time.perf_counter() - t0, ties)
    return pairs


def _sample_and_score(cfg: Config, start: str, examples: list[Example], k: int, df: DocumentFrequency | None,
                      registrations: UserRegistrations) -> tuple[list[PreferencePair], int]:
    from rlt2t.actors.reward import RewardWorker
    from rlt2t.actors.rollout import RolloutWorker
    from rlt2t.common.policy import load_policy

    rollout = cfg.rollout.model_copy(update={"num_samples": k,
                                             "max_new_tokens": min(cfg.rollout.max_new_tokens,
                                                                   cfg.data.max_target_len)})
    worker = RolloutWorker(cfg.model, str(cfg.tokenizer_dir), rollout, seed=cfg.run.seed,
                           max_source_len=cfg.data.max_source_len, spec=cfg.rl.rollout_spec,
                           device="cuda" if cfg.rl.rollout_gpus else "cpu")
    worker.set_weights(0, load_policy(cfg.model, cfg.tokenizer_dir, checkpoint=start).model.state_dict())
    reward = RewardWorker(cfg.reward, df, registrations=registrations)
    groups: list[ScoredGroup] = []
    for i in range(0, len(examples), cfg.rl.chunk_size):
        groups += [g for g in reward.score(worker.sample(examples[i : i + cfg.rl.chunk_size]))
                   if isinstance(g, ScoredGroup)]
    return best_worst_pairs(groups)


def _run(cfg: Config, learners: LearnerGroup, pairs: list[PreferencePair], valid: Sequence[Example],
         monitor: Monitor, *,
         init: Path, start: Path, resume_from: CheckpointInfo | None, steps_per_epoch: int, total_steps: int,
         stop_after_steps: int) -> TrainResult:
    r = cfg.rl
    ckpt_root = cfg.run_dir / STAGE / "checkpoints"
    step, epoch0 = 0, 0
    best = BestCheckpoint.from_meta(resume_from.meta if resume_from else None, monitor_name(cfg.metric))
    if resume_from is not None:
        learners.load_training_states_from(Path(resume_from.path), r.learners)
        step, epoch0 = resume_from.step, resume_from.meta["epoch"]
        log.info("rl: resuming from %s (step %d, %d epoch%s done)", resume_from.path, step, epoch0,
                 "" if epoch0 == 1 else "s")
    log.info("rl: %s on %d preference pairs, %d steps/epoch, %d steps, batch %d", r.algorithm, len(pairs),
             steps_per_epoch, total_steps, r.batch_size)
    logger = RunLogger(cfg.run_dir / "logs" / STAGE, STAGE)
    bar = tqdm(total=total_steps, initial=step, desc=f"rl:{r.algorithm}", disable=True if not cfg.run.progress
               else None, dynamic_ncols=True)
    result = TrainResult(checkpoint=start, steps=step)

    def checkpoint(epoch: int, batch_in_epoch: int, at: int, metrics: dict[str, float]) -> Path:
        name = checkpoint_name(epoch=epoch) if batch_in_epoch == 0 else checkpoint_name(step=at)
        if batch_in_epoch == 0 and "monitor" in metrics:
            best.offer(metrics["monitor"], ckpt_root / name)
        path = learners.write_checkpoint(
            ckpt_root, name, step=at,
            meta={"stage": STAGE, "algorithm": r.algorithm, "init": str(init), "epoch": epoch,
                  "batch_in_epoch": batch_in_epoch, "policy_version": at, "metrics": metrics, "best": best.meta(),
                  "total_steps": total_steps},
            published={}, trained_in_epoch=[])
        prune_checkpoints(ckpt_root, r.keep_last, protect=best.protect())
        return path

    try:
        learners.check_preflight()
        for epoch in range(epoch0, r.epochs):
            if step >= total_steps:
                break
            epoch_start = epoch * steps_per_epoch
            order = epoch_order(len(pairs), cfg.run.seed, epoch)
            last: dict[str, float] = {}
            window_t, window_items = time.perf_counter(), 0
            while step < min(total_steps, epoch_start + steps_per_epoch):
                at_batch = step - epoch_start
                batch = [pairs[i] for i in order[at_batch * r.batch_size : (at_batch + 1) * r.batch_size]]
                n = len(learners.ranks)
                metrics = learners.result([rank.train_step.remote(batch[i::n])
                                           for i, rank in enumerate(learners.ranks)])
                step += 1
                window_items += len(batch)
                result.items_used += len(batch)
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.3f}")
                finished = step == total_steps or step == epoch_start + steps_per_epoch
                if step % cfg.run.log_every == 0 or finished:
                    now = time.perf_counter()
                    last = {**metrics, "pairs": len(batch), "epoch": epoch,
                            "pairs_per_s": window_items / max(now - window_t, 1e-9)}
                    logger.log(step, last)
                    log.info(progress_line(step, total_steps, last))
                    window_t, window_items = now, 0
                if not math.isfinite(metrics["loss"]):
                    raise FloatingPointError(f"rl: loss is {metrics['loss']} at step {step}; "
                                             f"{nan_loss_advice(r.algorithm)}")
                if stop_after_steps and step >= stop_after_steps:  # (tests: a run cut short, as by a kill)
                    result.steps = step
                    return result
                if r.save_every_steps and step % r.save_every_steps == 0 and not finished:
                    checkpoint(epoch, step - epoch_start, step, last or metrics)
            scores = validate_epoch(learners, valid, cfg, logger, epoch, step,
                                    "lower rl.lr or raise the preference loss's beta, and keep an earlier checkpoint",
                                    monitor)
            result.checkpoint = checkpoint(epoch + 1, 0, step, {**last, **scores})
            result.history.append({"epoch": epoch, **scores})
        result.steps = step
    finally:
        close_logs(cfg, bar, logger)
    return result
