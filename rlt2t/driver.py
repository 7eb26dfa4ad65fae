"""The RL job (`rlt2t train`): rollout and reward actors feeding a DDP learner group, wired on Ray.

    init → groups → for epoch: sample → score → learn → publish → evaluate → checkpoint → log

One loop for every algorithm (``rl.algorithm``): what the rollouts return, how rewards become advantages
and the loss are the algorithm's units (``rlt2t.common.types.RolloutSpec``, ``rlt2t.learner.objectives``);
the decisions of the loop (dispatch, retries, reorder buffer, staleness, queued learner steps) are
``rlt2t.scheduler``'s, tested without Ray. Rollouts run ahead of the learner (a bounded number of chunks in
flight) while it trains on what is already scored: the pipeline is asynchronous, the result is not
timing-dependent.

The driver holds references, not data. Learner rank 0 stores each published version in the object store
itself (its call's result, owned by the driver: the reference outlives rank 0), one reference shared by every
rollout worker (no shared filesystem assumed). A worker that does not hold the version a chunk needs loads it
from that reference, so a worker restarted by Ray needs nothing special. Rollouts reach the reward workers,
and scored chunks the learner ranks, by reference: the driver fetches only each result's small summary, which
also carries a dead worker's error. Rank 0 writes the checkpoints from its own model (to ``run.dir``, shared
storage on a real cluster), and the run's start weights are loaded by a short task. A dead learner fails the
job; the last checkpoint resumes it, bit for bit on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import shutil
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import ActorUnavailableError, ObjectLostError, RayActorError, RayTaskError
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import PreTrainedTokenizerBase

from rlt2t.actors.reward import RewardWorker
from rlt2t.actors.rollout import RolloutWorker
from rlt2t.by_reference import FetchObject, RewardsByReference, RolloutsByReference, stored_items
from rlt2t.common.algorithms import nan_loss_advice
from rlt2t.common.checkpoint import (
    BestCheckpoint,
    CheckpointInfo,
    best_beside,
    check_schedule_length,
    checkpoint_name,
    load_training_state,
    prune_checkpoints,
)
from rlt2t.common.collate import encode_texts
from rlt2t.common.config import Config
from rlt2t.common.data import Example, reference_sets
from rlt2t.common.metrics import DocumentFrequency
from rlt2t.common.plots import plot_curves
from rlt2t.common.policy import check_preset_holds
from rlt2t.common.python_rewards import RewardError
from rlt2t.common.rewards import UserRegistrations, check_reward
from rlt2t.common.tracking import RunLogger, scores_line
from rlt2t.common.types import RolloutSpec
from rlt2t.common.waiting import NotYet, wait_until
from rlt2t.groups import (
    LearnerGroup,
    WorkerPool,
    check_cluster,
    init_ray,
    load_published_weights,
    load_start_weights,
)
from rlt2t.learner.evaluate import Monitor, collapse_warning, job_monitor, monitor_name
from rlt2t.learner.trainer import epoch_order
from rlt2t.scheduler import Chunk, ChunkFailed, EpochScheduler, mask_version, needed_version
from rlt2t.services.http import load_token
from rlt2t.services.remote_workers import HttpRewardWorker, HttpRolloutWorker

log = logging.getLogger("rlt2t.train")

STAGE = "rl"


@dataclass
class TrainResult:
    checkpoint: Path
    steps: int
    history: list[dict[str, float]] = field(default_factory=list)
    redispatched: int = 0
    items_used: int = 0
    """Sources trained on (rank RL: pairs, one per source; an offline algorithm: preference pairs) by this call
    (a resumed run: since the resume)."""
    out_of_order: int = 0
    """Chunks handed to the learner ahead of an earlier one (only when rl.deterministic is off)."""

    @property
    def best(self) -> Path:
        """The checkpoint the stage's monitor picked as best (what eval, export and ``init`` load when given the
        stage's checkpoint root), else the newest: ``checkpoint`` is the stage's last checkpoint."""
        return best_beside(self.checkpoint)


def train(cfg: Config, train_set: Sequence[Example], valid: Sequence[Example], *, init: Path,
          resume_from: CheckpointInfo | None = None, stop_after_steps: int = 0, start: Path | None = None
          ) -> TrainResult:
    """Run ``rl.algorithm`` from ``start`` (default ``init``) or resume ``resume_from``; returns the last
    checkpoint. ``init`` is the reference policy of the KL (an SFT checkpoint; checkpoint meta ``init``): a
    feedback round starts from the previous round's policy and keeps its KL to the SFT policy."""
    r = cfg.rl
    if r.unit.data == "preferences":  # an offline algorithm: no rollouts, a fixed set of pairs (rlt2t.offline)
        from rlt2t import offline

        return offline.train(cfg, train_set, valid, init=init, resume_from=resume_from,
                             stop_after_steps=stop_after_steps, start=start)
    out_dir = cfg.run_dir / STAGE
    examples = training_subset(cfg, train_set)
    steps_per_epoch = math.ceil(len(examples) / r.batch_size)
    total_steps = r.epochs * steps_per_epoch if not r.max_steps else min(r.max_steps, r.epochs * steps_per_epoch)
    if resume_from is not None:  # before any actor starts: the learners restore the scheduler
        check_schedule_length(STAGE, resume_from, total_steps, "rl.epochs, rl.max_steps, rl.batch_size, "
                              "rl.train_subset", f"remove {out_dir}, or `rlt2t demo --fresh` for the demo's run")
        if resume_from.step >= total_steps:  # a finished run (the demo rerun): no actor to start, nothing to do
            log.info("rl: %s is the run's last step (%d of %d): nothing left to train", resume_from.path,
                     resume_from.step, total_steps)
            return TrainResult(checkpoint=Path(resume_from.path), steps=resume_from.step)
    spec = r.rollout_spec
    if cfg.reward.source != "http":
        check_reward(cfg.reward)  # a term whose function does not import fails here, before any actor starts
    # metric.monitor, before any actor starts (an unknown name fails here); a reward monitor scores on the job's
    # reward workers, as the rollouts are scored
    monitor = job_monitor(cfg, lambda: lambda *batch: job.reward_scores(*batch))
    init_ray(cfg)
    check_cluster(cfg)
    df = document_frequency(examples, out_dir)
    start = Path(resume_from.path) if resume_from else (start or init)
    job = _Job.start(cfg, spec, start=start, init=init, total_steps=total_steps, df=df)
    try:
        with logging_redirect_tqdm():  # on a terminal, progress lines print above the progress bar
            return job.run(examples, valid, resume_from=resume_from, steps_per_epoch=steps_per_epoch,
                           total_steps=total_steps, stop_after_steps=stop_after_steps, monitor=monitor)
    finally:
        job.release()


def training_subset(cfg: Config, train_set: Sequence[Example]) -> list[Example]:
    r = cfg.rl
    if r.train_subset and r.train_subset < len(train_set):
        train_set, total = train_set[: r.train_subset], len(train_set)
        log.warning("rl: rl.train_subset=%d: training on the first %d of %d rows, %d distinct sources (set 0 for "
                    "all)", r.train_subset, r.train_subset, total, len({e.source for e in train_set}))
    if len(train_set) < r.learners:
        raise ValueError(f"rl: {len(train_set)} training examples for {r.learners} learner ranks")
    return list(train_set)


def count_truncated(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], max_source_len: int) -> int:
    """Sources longer than ``max_source_len`` tokens (EOS included): the rollout workers cut them."""
    lengths = [len(x) for x in tokenizer([e.source for e in examples], add_special_tokens=True)["input_ids"]]
    return sum(n > max_source_len for n in lengths)


def truncate_sources(examples: list[Example], tokenizer: PreTrainedTokenizerBase, max_source_len: int) -> list[Example]:
    """Examples whose source is longer than ``max_source_len`` tokens (EOS included) get the decoded
    truncated source (policy servers tokenise on their side); the others are returned as they are."""
    tok = tokenizer
    sources = [e.source for e in examples]
    lengths = [len(x) for x in tok(sources, add_special_tokens=True)["input_ids"]]
    long = [i for i, n in enumerate(lengths) if n > max_source_len]
    if not long:
        return examples
    ids, _ = encode_texts(tok, [sources[i] for i in long], max_source_len)
    out = list(examples)
    for i, x in zip(long, ids, strict=True):
        out[i] = dataclasses.replace(out[i], source=" ".join(tok.decode(x, skip_special_tokens=True).split()))  # type: ignore[union-attr]
    log.warning("rl: truncated %d of %d sources to data.max_source_len=%d tokens for the policy servers",
                len(long), len(examples), max_source_len)
    return out


def document_frequency(examples: Sequence[Example], out_dir: Path) -> DocumentFrequency | None:
    """CIDEr-D's document frequencies, counted once from the training references (shipped to every reward worker)
    and saved in ``out_dir`` for the reward and policy servers that score this task; None when the rows have no
    references (RL on sources alone, whose reward reads none: ``rlt2t.jobs.rl_splits``)."""
    sets = reference_sets(examples)
    if not sets:
        return None
    df = DocumentFrequency.from_references(sets)
    df.save(out_dir / "document_frequency.json")
    return df


def wait_for_servers(cfg: Config, published_dir: Path, token: str | None) -> None:
    """Block until every policy / reward server of an http source answers /readyz (rollout.timeout_s)."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    servers = [(u, "policy", f"rlt2t serve policy --checkpoint-dir {published_dir}") for u in cfg.rollout.urls
               if cfg.rollout.source == "http"]
    if cfg.reward.source == "http":
        servers.append((cfg.reward.url or "", "reward", "rlt2t serve reward --document-frequency "
                        f"{published_dir.parent / 'document_frequency.json'}"))
    for url, kind, how in servers:
        def ready(url: str = url, kind: str = kind) -> None:
            try:
                status = httpx.get(f"{url.rstrip('/')}/readyz", headers=headers, timeout=5).status_code
            except httpx.HTTPError as e:
                raise NotYet(type(e).__name__) from None
            if status in (401, 403):
                raise RuntimeError(f"rl: the {kind} server at {url} refused our bearer token (HTTP {status}); "
                                   f"set serve.token_file or ${cfg.serve.token_env} to the server's token")
            if status != 200:
                raise NotYet(f"HTTP {status}")

        wait_until(ready, timeout_s=cfg.rollout.timeout_s, interval_s=0.5, error=RuntimeError,
                   what=f"rl: the {kind} server at {url} was not ready (rollout.timeout_s; start it with: {how})",
                   on_wait=lambda _, url=url, kind=kind, how=how: log.info(  # type: ignore[misc]
                       "rl: waiting for the %s server at %s (start it with: %s)", kind, url, how))


class _Publisher:
    """Published policy versions: object-store references (and, for policy servers, checkpoint dirs). The
    weights behind them are never in this process: rank 0 stores each version (``LearnerGroup.publish``), the
    run's first from the start checkpoint, and a resumed run's kept versions, come from loading tasks."""

    def __init__(self, learners: LearnerGroup, published_dir: Path | None, start_weights: ray.ObjectRef,
                 start_version: int) -> None:
        self.learners, self.dir = learners, published_dir
        self.refs: dict[int, ray.ObjectRef] = {}
        # The weights the run starts from, loaded from its start checkpoint by a task: the first publish ships
        # these, so the first rollouts need not wait for the learner (busy with its preflight then).
        self._start: ray.ObjectRef | None = start_weights
        self._start_version = start_version
        self._dropped_below = 0

    def publish(self, version: int, weights: ray.ObjectRef | None = None) -> None:
        if version in self.refs:
            return
        if version < self._dropped_below:  # the learner has moved on: these weights are gone, not the current ones
            raise RuntimeError(f"rl: policy version {version} is needed after its weights were dropped")
        if weights is None:
            if version == self._start_version and self._start is not None:
                weights = self._start
            else:
                weights, step = self.learners.publish()
                if step != version:  # the scheduler queues no learner step past a publish: a bug if it did
                    raise RuntimeError(f"rl: publishing version {version}, learner rank 0 is at step {step}")
        self.refs[version] = weights
        if self.dir is not None:
            # Policy servers (rollout.source=http) load the learner's weights from here (hot reload).
            self.learners.write_published(self.dir, version, weights,
                                          meta={"stage": f"{STAGE}-published", "policy_version": version})
            log.info("rl: published version %d to %s", version, self.dir)

    def drop_start_weights(self) -> None:
        self._start = None

    def kept(self, below: int) -> dict[int, ray.ObjectRef]:
        """The versions a resumed run may still need (for its checkpoint, which rank 0 writes)."""
        return {v: ref for v, ref in self.refs.items() if v < below}

    def prune(self, below: int) -> None:
        """Drop the versions below ``below`` (EpochScheduler.oldest_needed_version: no chunk needs them)."""
        self._dropped_below = max(self._dropped_below, below)
        for v in [v for v in self.refs if v < below]:
            del self.refs[v]


@dataclass
class _Job:
    cfg: Config
    spec: RolloutSpec
    learners: LearnerGroup
    rollouts: WorkerPool
    rewards: WorkerPool
    token: str | None
    init: Path
    """The run's start: the reference policy of the KL, kept in every checkpoint's meta for resumes."""
    start_checkpoint: Path
    """The checkpoint the learners start from (``init``, a feedback round's previous policy, or a resumed one)."""
    first_version: tuple[ray.ObjectRef, ray.ObjectRef]
    """(tokenizer, weights) of ``start_checkpoint`` as the learners hold it, loaded by a task: the first published
    version."""
    start_weights: FetchObject | None = None
    """The run's start weights in the object store, for rollout workers that need them (KL, LoRA)."""
    start_weights_loaded: ray.ObjectRef | None = None
    """The small first result of the task that loads ``start_weights``: waited on before the first rollout."""

    @classmethod
    def start(cls, cfg: Config, spec: RolloutSpec, *, start: Path, init: Path, total_steps: int,
              df: DocumentFrequency | None) -> _Job:
        """The learner group, rollout and reward pools, and the driver's checkpoint writer; nothing
        outlives a failed start (a standing cluster must not keep placement groups or actors)."""
        r = cfg.rl
        learned = [t for t in cfg.reward.terms if t.kind in ("reward_model", "classifier")]
        if cfg.reward.source != "http" and learned and cfg.reward.device == "cuda" and not r.reward_gpus:
            raise ValueError("reward.device=cuda: the RL job's reward workers have no GPU; give them one with "
                             "rl.reward_gpus (e.g. 0.25), or set reward.device=auto")
        if cfg.rollout.source != "http":  # the rollout workers build the preset and load these weights into it
            for path, what in {init: "the KL reference", start: "the RL start"}.items():
                check_preset_holds(cfg.model, path, what)
        learners = rollouts = rewards = None
        start_weights: FetchObject | None = None
        start_weights_loaded: ray.ObjectRef | None = None
        try:
            learners = LearnerGroup(cfg, start, total_steps, reference_checkpoint=init)
            token = load_token(cfg.serve) if "http" in (cfg.rollout.source, cfg.reward.source) else None
            if cfg.rollout.source == "http":
                # One light actor per policy server: they wait on HTTP, so they reserve little CPU.
                rollouts = WorkerPool(HttpRolloutWorker, len(cfg.rollout.urls), num_cpus=0.1, num_gpus=0,
                                      max_restarts=r.max_restarts, args=(),
                                      kwargs=dict(rollout=cfg.rollout, seed=cfg.run.seed, token=token, spec=spec),
                                      per_actor_args=[(url,) for url in cfg.rollout.urls], what="HTTP rollout workers",
                                      results=RolloutsByReference)
            else:
                rollouts = WorkerPool(RolloutWorker, r.rollout_workers, num_cpus=r.rollout_cpus,
                                      num_gpus=r.rollout_gpus, max_restarts=r.max_restarts,
                                      resources=r.rollout_resources,
                                      args=(cfg.model, str(cfg.tokenizer_dir), cfg.rollout),
                                      kwargs=dict(seed=cfg.run.seed, max_source_len=cfg.data.max_source_len, spec=spec,
                                                  device="cuda" if r.rollout_gpus else "cpu"),
                                      what=f"the rollout workers (rl.rollout_workers={r.rollout_workers}, "
                                           f"rl.rollout_cpus={r.rollout_cpus:g}, rl.rollout_gpus={r.rollout_gpus:g}, "
                                           f"rl.rollout_resources={dict(r.rollout_resources)})",
                                      results=RolloutsByReference)
            if cfg.reward.source == "http":
                rewards = WorkerPool(HttpRewardWorker, r.reward_workers, num_cpus=0.1, num_gpus=0,
                                     max_restarts=r.max_restarts, args=(cfg.reward.url, cfg.reward),
                                     kwargs=dict(token=token), what="HTTP reward workers", results=RewardsByReference)
            else:
                rewards = WorkerPool(RewardWorker, r.reward_workers, num_cpus=r.reward_cpus, num_gpus=r.reward_gpus,
                                     max_restarts=r.max_restarts, args=(cfg.reward, df),
                                     kwargs=dict(registrations=UserRegistrations.used_by(cfg.reward)),
                                     what=f"the reward workers (rl.reward_workers={r.reward_workers}, "
                                          f"rl.reward_cpus={r.reward_cpus:g}, rl.reward_gpus={r.reward_gpus:g})",
                                     results=RewardsByReference)
            # Loaded by one task while the workers start, never in this process: the weights of the first
            # published version (and the tokenizer the driver counts truncated sources with), and, for Ray rollout
            # workers that need it, the run's start (the reference policy of the KL, the base that published LoRA
            # adapters adapt), shipped once through the object store: each sampling call carries its fetcher, a
            # worker fetches it once (again after a restart).
            needs_reference = cfg.rollout.source != "http" and (spec.reference or cfg.model.lora.enabled)
            tokenizer, weights, reference_loaded, reference = load_start_weights(
                cfg.model, cfg.tokenizer_dir, start, lora_seed=cfg.run.seed,
                reference=init if needs_reference else None)
            first_version = (tokenizer, weights)
            if needs_reference:
                start_weights_loaded, start_weights = reference_loaded, FetchObject(reference)
            rollouts.wait_started(r.schedule_timeout_s)
            rewards.wait_started(r.schedule_timeout_s)
        except BaseException:
            _release(learners, rollouts, rewards)
            raise
        return cls(cfg, spec, learners, rollouts, rewards, token, init, start, first_version, start_weights,
                   start_weights_loaded)

    def release(self) -> None:
        _release(self.learners, self.rollouts, self.rewards)

    def reward_scores(self, sources: Sequence[str], candidates: Sequence[str], references: Sequence[Sequence[str]],
                      fields: Sequence[Mapping[str, Any]]) -> list[float]:
        """The job's reward of ``candidates``, scored by a reward worker as the rollouts are (on its device, with the
        job's registrations), the next worker asked when one is dead: ``metric.monitor=reward``."""
        for i, actor in enumerate(self.rewards.actors):
            try:
                return ray.get(actor.score_texts.remote(list(sources), list(candidates), [list(r) for r in references],
                                                        [dict(f) for f in fields]))
            except RewardError as e:  # the user's function: its own message, not Ray's traceback around it
                raise RewardError(str(e.cause if isinstance(e, RayTaskError) else e)) from None
            except (RayActorError, ActorUnavailableError):
                if i + 1 == len(self.rewards.actors):
                    raise
                log.warning("rl: reward worker %d is unavailable for the validation monitor; asking the next", i)
        raise RuntimeError("rl: the job has no reward workers")  # rl.reward_workers >= 1 (config)

    def run(self, examples: list[Example], valid: Sequence[Example], *, resume_from: CheckpointInfo | None,
            steps_per_epoch: int, total_steps: int, stop_after_steps: int, monitor: Monitor) -> TrainResult:
        cfg, r = self.cfg, self.cfg.rl
        ckpt_root = self.cfg.run_dir / STAGE / "checkpoints"
        http_rollout = cfg.rollout.source == "http"
        published_dir = cfg.run_dir / STAGE / "published"
        tokenizer_ref, first_weights = self.first_version
        tokenizer = ray.get(tokenizer_ref)  # the start checkpoint loaded (or its error, here)
        if self.start_weights_loaded is not None:
            ray.get(self.start_weights_loaded)
        if http_rollout:
            # Versions a crashed or earlier run published are not this run's weights: servers must not see them.
            shutil.rmtree(published_dir, ignore_errors=True)
            # Policy servers tokenise on their side: cut sources to data.max_source_len here, as the Ray
            # rollout workers do, so the servers sample from the context the learner trains on.
            examples = truncate_sources(examples, tokenizer, cfg.data.max_source_len)
        step, epoch0 = 0, 0
        trained: list[str] | None = None  # the ids the resumed epoch trained on (None: its order's prefix)
        publisher = _Publisher(self.learners, published_dir if http_rollout else None, first_weights,
                               resume_from.step if resume_from else 0)
        best = BestCheckpoint.from_meta(resume_from.meta if resume_from else None, monitor_name(cfg.metric))
        if resume_from is not None:
            # Memory-mapped: the learners' states and the kept weights are read where they are needed (each rank
            # reads its own, a task each kept version), not here.
            state = load_training_state(resume_from.path, mmap=True)
            ranks, kept, trained = len(state["learners"]), sorted(state["published"]), state.get("trained_in_epoch")
            del state  # [] at an epoch's end; absent from older versions
            self.learners.load_training_states_from(Path(resume_from.path), ranks)
            for v in kept:
                loaded, weights = load_published_weights(Path(resume_from.path), v)
                ray.get(loaded)
                publisher.publish(int(v), weights)
            step, epoch0 = resume_from.step, resume_from.meta["epoch"]
            log.info("rl: resuming from %s (step %d, %d epoch%s done)", resume_from.path, step, epoch0,
                     "" if epoch0 == 1 else "s")
        learner_ranks = f"{r.learners} learner rank{'s' if r.learners > 1 else ''}"
        if r.strategy == "fsdp":
            learner_ranks += (f" sharded (rl.strategy=fsdp: each holds 1/{r.learners} of the weights, gradients and "
                              "AdamW state)")
        log.info("rl: %s on %d sources, %d steps/epoch, %d steps, batch %d, K %d, %s", r.algorithm, len(examples),
                 steps_per_epoch, total_steps, r.batch_size, cfg.rollout.num_samples, learner_ranks)
        logger = RunLogger(cfg.run_dir / "logs" / STAGE, STAGE)
        bar = tqdm(total=total_steps, initial=step, desc=f"rl:{r.algorithm}", disable=True if not cfg.run.progress
                   else None, dynamic_ncols=True)
        result = TrainResult(checkpoint=self.start_checkpoint, steps=step)

        def checkpoint(epoch: int, batch_in_epoch: int, at: int, metrics: dict[str, float],
                       trained_in_epoch: Sequence[str] = ()) -> Path:
            name = checkpoint_name(epoch=epoch) if batch_in_epoch == 0 else checkpoint_name(step=at)
            if batch_in_epoch == 0 and "monitor" in metrics:
                best.offer(metrics["monitor"], ckpt_root / name)
            # Rank 0 writes it from its own model; the other ranks' states and the kept weights reach it by
            # reference.
            path = self.learners.write_checkpoint(
                ckpt_root, name, step=at,
                meta={"stage": STAGE, "algorithm": r.algorithm, "init": str(self.init), "epoch": epoch,
                      "batch_in_epoch": batch_in_epoch, "policy_version": at, "metrics": metrics,
                      "best": best.meta(), "total_steps": total_steps},
                published=publisher.kept(below=at), trained_in_epoch=trained_in_epoch)
            prune_checkpoints(ckpt_root, r.keep_last, protect=best.protect())
            return path

        try:
            if http_rollout:
                publisher.publish(step)  # the servers need weights to load before they can answer
                wait_for_servers(cfg, published_dir, self.token)
            if r.refresh_interval and step % r.refresh_interval == 0:
                publisher.publish(step)  # the learner holds exactly these weights now (start, or a resumed checkpoint)
            for epoch in range(epoch0, r.epochs):
                if step >= total_steps:
                    break
                epoch_start = epoch * steps_per_epoch
                if trained is None:  # the epoch's order up to the step (deterministic mode, or a checkpoint
                    # written before checkpoints named the ids): as a list, so later checkpoints name them all
                    trained = self._trained_prefix(examples, epoch, step - epoch_start)
                chunks = self._plan(examples, epoch, epoch_start, step, steps_per_epoch, total_steps, trained)
                if r.refresh_interval == 0:
                    publisher.publish(epoch_start)
                for c in chunks:
                    if c.mask_version is not None and c.mask_version <= step:
                        publisher.publish(c.mask_version)
                publisher.drop_start_weights()  # published by now, or never needed (a run resumed mid-epoch)
                truncated = count_truncated(tokenizer, [e for c in chunks for e in c.examples],
                                            cfg.data.max_source_len)
                if truncated:
                    log.info("rl epoch %d/%d: %d sources longer than data.max_source_len=%d tokens are cut to it",
                             epoch + 1, r.epochs, truncated, cfg.data.max_source_len)
                sched = EpochScheduler(chunks, step=step, batch_size=r.batch_size, learners=r.learners,
                                       max_inflight_chunks=r.max_inflight_chunks, ordered=self._ordered(),
                                       rollouts=self.rollouts.state, rewards=self.rewards.state,
                                       max_attempts=r.max_restarts + 1, refresh_every_steps=r.refresh_interval,
                                       save_every_steps=r.save_every_steps, stop_after_steps=stop_after_steps,
                                       epoch_start=epoch_start,
                                       mask_every=r.mask_refresh_steps,
                                       trained_ids=list(trained))
                trained = []  # later epochs start afresh
                publisher.prune(below=sched.oldest_needed_version())  # the previous epoch's are no longer needed
                last = self._run_epoch(sched, publisher, logger, bar, epoch, epoch_start, total_steps, checkpoint,
                                       truncated)
                step = sched.step
                result.redispatched += sched.stats.redispatched
                result.out_of_order += sched.stats.out_of_order
                result.items_used += sched.stats.items_used
                if sched.stopped:
                    result.steps = step
                    return result
                sched.check_complete()
                scores = validate_epoch(self.learners, valid, cfg, logger, epoch, step,
                                        "unless the start checkpoint wrote so few already (warned as the run "
                                        "started: retrain it first), the reward is probably being gamed by one "
                                        "output; raise the KL coefficient (rl.kl.coef) or lower rl.lr, and keep an "
                                        "earlier checkpoint", monitor)
                result.checkpoint = checkpoint(epoch + 1, 0, step, {**last, **scores})
                result.history.append({"epoch": epoch, **scores})
            result.steps = step
        finally:
            close_logs(cfg, bar, logger)
        return result

    def _ordered(self) -> bool:
        d = self.cfg.rl.deterministic
        return d if d is not None else not torch.cuda.is_available()

    def _trained_prefix(self, examples: list[Example], epoch: int, batches: int) -> list[str]:
        """The ids of the epoch's first ``batches`` batches in its order: what a run that consumed chunks in
        dataset order trained on."""
        order = epoch_order(len(examples), self.cfg.run.seed, epoch)[: batches * self.cfg.rl.batch_size]
        return [examples[i].id for i in order]

    def _plan(self, examples: list[Example], epoch: int, epoch_start: int, step: int, steps_per_epoch: int,
              total_steps: int, trained: Collection[str] = ()) -> list[Chunk]:
        """This epoch's chunks from the learner's position on, each with the version that samples it: its
        sources but the ``trained`` ones (those the checkpoint resumed from names; without deterministic mode
        they are not the order's prefix, chunks having reached the learner as they came)."""
        r = self.cfg.rl
        first_batch = step - epoch_start
        last_batch = min(steps_per_epoch, total_steps - epoch_start)
        order = epoch_order(len(examples), self.cfg.run.seed, epoch)[: last_batch * r.batch_size]
        done = set(trained)
        chosen = [examples[i] for i in order if examples[i].id not in done]
        if len(order) - len(chosen) != len(done) or len(done) != first_batch * r.batch_size:
            raise RuntimeError(f"rl: the checkpoint's epoch {epoch} trained on {len(done)} sources, of which "
                               f"{len(order) - len(chosen)} are in this epoch's order at step {step}: it was "
                               "written for other data, rl.batch_size or run.seed")
        chunks = []
        for i, o in enumerate(range(0, len(chosen), r.chunk_size)):
            version = needed_version(step + o // r.batch_size, epoch_start, r.refresh_interval)
            mask = mask_version(version, r.mask_refresh_steps) if r.mask_refresh_steps else None
            chunks.append(Chunk(i, chosen[o : o + r.chunk_size], version, mask))
        return chunks

    def _run_epoch(self, sched: EpochScheduler, publisher: _Publisher, logger: RunLogger, bar: Any, epoch: int,
                   epoch_start: int, total_steps: int,
                   checkpoint: Callable[[int, int, int, dict[str, float], Sequence[str]], Path],
                   truncated: int) -> dict[str, float]:
        """Sample → score → learn over one epoch's chunks, overlapping rollouts with learner steps."""
        cfg, r = self.cfg, self.cfg.rl
        http_rollout = cfg.rollout.source == "http"
        # A task's small summary -> (kind, chunk index, worker, the reference of its result). Only summaries are
        # fetched here: a dead worker's error shows in its summary, and results travel on by reference.
        pending: dict[ray.ObjectRef, tuple[str, int, int, ray.ObjectRef]] = {}
        scored: dict[int, ray.ObjectRef] = {}  # chunk index -> its scored items, until a learner step takes the last
        unused: dict[int, int] = {}  # chunk index -> its scored items not yet in a learner step
        steps: deque[tuple[list[ray.ObjectRef], Any]] = deque()  # queued learner steps, oldest first
        last: dict[str, float] = {}
        window_t, window_items = time.perf_counter(), 0
        busy_since = learner_busy = 0.0
        epoch_t0 = time.perf_counter()
        while not sched.finished:
            for d in sched.rollout_dispatches(publisher.refs):
                c = d.chunk
                # Policy servers load published checkpoints themselves: do not ship them the weights.
                weights = None if http_rollout else publisher.refs[c.version]
                actor = self.rollouts.actors[d.worker]
                mask = {} if c.mask_version is None else dict(  # NLPO: the masking policy's version too
                    mask_version=c.mask_version, mask_weights=publisher.refs[c.mask_version])
                start = {} if self.start_weights is None else dict(start_weights=self.start_weights)
                summary, sampled = actor.sample_version_stored.options(num_returns=2).remote(
                    c.version, weights, c.examples, **mask, **start)
                pending[summary] = ("rollout", c.index, d.worker, sampled)
            while (batch := sched.next_batch()) is not None:
                if not steps:
                    busy_since = time.perf_counter()
                # NLPO: the learner masks each group with the masking policy it was sampled under
                steps.append((self.learners.train_step_async(batch.items, scored, publisher.refs), batch))
                for item in batch.items[: batch.size]:  # the step's task holds its own references from now on
                    unused[item.chunk] -= 1
                    if not unused[item.chunk]:
                        del scored[item.chunk], unused[item.chunk]
            waitable = list(pending) + (steps[0][0] if steps else [])
            if not waitable:
                wait = sched.retry_wait()
                if wait is not None:
                    time.sleep(wait)
                    continue
                version = sched.blocked_version()
                raise RuntimeError(f"rl: the next chunk needs policy version {version} but the learner is at step "
                                   f"{sched.step}; lower rl.refresh_every_steps or rl.max_inflight_chunks")
            done, _ = ray.wait(waitable, num_returns=1, timeout=sched.retry_wait())
            if not done:
                continue  # a re-dispatch is due
            ref = done[0]
            if steps and ref in steps[0][0]:
                learner_refs, batch = steps.popleft()
                metrics = self.learners.result(learner_refs)  # fails at the first rank that fails
                if not steps:
                    learner_busy += time.perf_counter() - busy_since
                at = sched.step_done()
                window_items += batch.size
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.3f}")
                if r.refresh_interval and at % r.refresh_interval == 0:
                    publisher.publish(at)
                if r.mask_refresh_steps and at % r.mask_refresh_steps == 0:
                    publisher.publish(at)  # the masking policy of later chunks
                publisher.prune(below=sched.oldest_needed_version())  # before a checkpoint saves them
                if at % cfg.run.log_every == 0 or sched.finished:
                    now = time.perf_counter()
                    busy = learner_busy + (now - busy_since if steps else 0.0)
                    last = {**metrics, "staleness_mean": batch.staleness_mean, "staleness_max": batch.staleness_max,
                            "sources": batch.size, "epoch": epoch, "truncated_sources": truncated,
                            "sources_per_s": window_items / max(now - window_t, 1e-9),
                            "learner_busy": busy / max(now - epoch_t0, 1e-9),
                            "redispatched": sched.stats.redispatched}
                    logger.log(at, last)
                    log.info(progress_line(at, total_steps, last))
                    window_t, window_items = now, 0
                if not math.isfinite(metrics["loss"]):
                    raise FloatingPointError(f"rl: loss is {metrics['loss']} at step {at}; "
                                             f"{nan_loss_advice(r.algorithm)}")
                if r.save_every_steps and at % r.save_every_steps == 0 and not sched.finished:
                    # Out of order, the epoch's trained sources are not a prefix of its order: the checkpoint
                    # names them, so a resumed run neither skips nor repeats any.
                    checkpoint(epoch, at - epoch_start, at, last, sched.trained_ids)
                continue
            kind, index, worker, result = pending.pop(ref)
            try:
                if kind == "rollout":
                    ray.get(ref)  # the summary: surfaces a dead worker here, before scoring
                    d = sched.rollout_done(index, worker)
                    summary, items = self.rewards.actors[d.worker].score_stored.options(num_returns=2).remote(result)
                    pending[summary] = ("reward", index, d.worker, items)
                else:
                    stored = stored_items(index, ray.get(ref))
                    sched.reward_done(index, worker, stored)
                    scored[index], unused[index] = result, len(stored)
            except RewardError as e:  # the user's reward function: the same candidates fail again, no retry
                _retrieve_error(result)
                raise RewardError(f"rl: {e.cause if isinstance(e, RayTaskError) else e}") from None
            except (RayActorError, RayTaskError, ObjectLostError) as e:
                _retrieve_error(result)
                # ObjectLostError: the rollout a reward task was to score is gone with its worker's node (results
                # stay where they were made): sampled again, as after any failed task.
                try:
                    when = sched.task_failed(kind, index, worker, unavailable=isinstance(e, ActorUnavailableError),  # type: ignore[arg-type]
                                             error=str(e))
                except ChunkFailed as failed:
                    raise RuntimeError(f"rl: {failed}") from e
                log.warning("rl: %s worker %d failed on chunk %d (%s); re-dispatching%s", kind, worker, index,
                            type(e).__name__, f" in {when - time.monotonic():.1f} s" if when > time.monotonic() else "")
        if sched.stats.out_of_order:
            log.info("rl: %d chunks reached the learner out of dataset order (rl.deterministic off)",
                     sched.stats.out_of_order)
        return last


def _retrieve_error(ref: ray.ObjectRef) -> None:
    """The result beside a failed summary holds the same error: retrieved (and dropped) here, or Ray reports it as
    an unhandled error when the reference is released, a second traceback after the job's own message."""
    with contextlib.suppress(Exception):
        ray.get(ref, timeout=0)


def validate_epoch(learners: LearnerGroup, valid: Sequence[Example], cfg: Config, logger: RunLogger, epoch: int,
                   step: int, collapse_advice: str, monitor: Monitor) -> dict[str, float]:
    """The epoch's validation scores (greedy, on the learner ranks) with ``monitor``'s value of the outputs
    (``metric.monitor``: scored here, where the job's plugins and reward are), logged; a warning, with
    ``collapse_advice``, when the outputs have collapsed. Empty without a validation split."""
    scores: dict[str, float] = {}
    if valid:
        table, hyps = learners.evaluate(valid, cfg)
        scores = {**table, "monitor": monitor(valid, hyps)}
        logger.log(step, {**scores, "epoch": epoch}, kind="valid")
        label = f"rl epoch {epoch + 1}/{cfg.rl.epochs}"  # counted as checkpoints are named (the logs' field: from 0)
        log.info("%s: %s", label, scores_line(scores, monitor_name(cfg.metric)))
        if "distinct_outputs" in scores and (collapsed := collapse_warning(
                label, scores["distinct_outputs"], valid, collapse_advice)):
            log.warning(collapsed)
    return scores


def close_logs(cfg: Config, bar: Any, logger: RunLogger) -> None:
    """The run's progress bar and logs closed, its curves drawn (a failure to draw is a warning: it must never
    replace the run's result, or hide the error the run failed with)."""
    bar.close()
    logger.close()
    try:
        plot_curves(logger.dir / "metrics.jsonl", logger.dir / "curves.png",
                    title=f"RL ({cfg.rl.algorithm}): {cfg.run_dir}")
    except Exception as e:
        log.warning("rl: could not draw %s: %s", logger.dir / "curves.png", e)


# What the progress line shows of a learner step's metrics, when the algorithm reports it: (key, label, format).
PROGRESS_FIELDS = (("reward_mean", "reward", ".3f"), ("reward_a", "reward", ".3f"), ("kl_seq", "kl", ".3f"),
                   ("reward_margin", "margin", ".3f"), ("reward_accuracy", "pair accuracy", ".2f"),
                   ("loss", "loss", ".4f"), ("sources_per_s", "sources/s", ".1f"), ("pairs_per_s", "pairs/s", ".1f"))


def progress_line(step: int, total_steps: int, metrics: dict[str, float]) -> str:
    """The console line every ``run.log_every`` learner steps: where the run is and what it is learning
    (mean reward, KL to the reference per sequence, loss, throughput)."""
    shown: dict[str, str] = {}
    for key, label, fmt in PROGRESS_FIELDS:
        value = metrics.get(key)
        if label not in shown and isinstance(value, int | float) and math.isfinite(value):
            shown[label] = f"{label} {value:{fmt}}"
    epoch = f" (epoch {int(metrics['epoch']) + 1})" if "epoch" in metrics else ""  # as checkpoints are named
    return f"rl step {step}/{total_steps}{epoch}: " + ", ".join(shown.values())


def _release(learners: LearnerGroup | None, *pools: WorkerPool | None) -> None:
    if learners is not None:
        learners.shutdown()
    for pool in pools:
        if pool is not None:
            pool.shutdown()
