"""The rank-RL job: rollout and reward actors feeding a DDP learner group, wired on Ray.

    init → groups → for epoch: sample → score → learn → publish → evaluate → checkpoint → log

Rollouts run ahead of the learner (a bounded number of chunks in flight) while it trains on the
pairs already scored: the pipeline is asynchronous, the result is not timing-dependent.

* Every chunk of sources has a fixed *policy version* (the learner step whose weights sample it): the
  epoch's first step (``rank.refresh_every_steps=0``, the original "previous epoch's model"), or the
  refresh point one interval behind the step that will consume it. Sampling seeds derive from
  (seed, version, example id) and pairs are consumed in dataset order, so which worker did what, and
  how fast, never changes the result.
* Weights travel through the object store: one ``ray.put`` per version, one reference shared by every
  rollout worker (no shared filesystem assumed). A worker that does not hold the version a chunk
  needs loads it from that reference, so a worker restarted by Ray needs nothing special.
* A chunk whose worker died is re-dispatched; pairs are keyed by chunk index in a reorder buffer, so
  none is lost and none is used twice. A dead learner fails the job; the last checkpoint resumes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import shutil
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tqdm.auto import tqdm

from rlt2t.actors.reward import RewardWorker
from rlt2t.actors.rollout import RolloutWorker
from rlt2t.common.batching import encode_texts
from rlt2t.common.checkpoint import (
    CheckpointInfo,
    checkpoint_name,
    load_training_state,
    prune_checkpoints,
    save_checkpoint,
)
from rlt2t.common.config import Config
from rlt2t.common.data import Example
from rlt2t.common.metrics import DocumentFrequency
from rlt2t.common.plots import plot_curves
from rlt2t.common.policy import load_policy
from rlt2t.common.tracking import RunLogger
from rlt2t.common.types import ScoredPair
from rlt2t.learner.rank_learner import BatchTooLarge, LearnerRank
from rlt2t.learner.trainer import epoch_order
from rlt2t.services.remote_workers import HttpRewardWorker, HttpRolloutWorker

log = logging.getLogger("rlt2t.driver")


class LearnerDied(RuntimeError):
    """A learner rank died; the job stops and the newest checkpoint resumes it."""


# --- actor groups ----------------------------------------------------------------------------------------

class LearnerGroup:
    """N LearnerRank actors in one placement group, forming one DDP world."""

    def __init__(self, cfg: Config, init_checkpoint: Path, total_steps: int):
        r = cfg.rank
        bundles = [{"CPU": r.learner_cpus, **({"GPU": r.learner_gpus} if r.learner_gpus else {}),
                    **r.learner_resources} for _ in range(r.learners)]
        self.pg = placement_group(bundles, strategy="PACK")
        self.ranks = []
        self._preflight: list[ray.ObjectRef] = []
        self._loading: list[ray.ObjectRef] = []  # resumed training states, sent and not yet confirmed
        try:
            self._start(cfg, init_checkpoint, total_steps)
        except BaseException:
            self.shutdown()  # the placement group and any rank started must not outlive a failed start
            raise

    def _start(self, cfg: Config, init_checkpoint: Path, total_steps: int) -> None:
        r = cfg.rank
        try:
            ray.get(self.pg.ready(), timeout=600)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"rank: no nodes offer {r.learners} learner bundles of {self.pg.bundle_specs[0]} "
                               "within 600 s (rank.learner_cpus / learner_gpus / learner_resources)") from None
        actor = ray.remote(LearnerRank)
        self.ranks = [
            actor.options(
                num_cpus=r.learner_cpus, num_gpus=r.learner_gpus, resources=dict(r.learner_resources), max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                                     placement_group_bundle_index=i),
            ).remote(cfg.model, str(cfg.tokenizer_dir), r, init_checkpoint=str(init_checkpoint), rank=i,
                     world_size=r.learners, total_steps=total_steps, seed=cfg.run.seed,
                     max_source_len=cfg.data.max_source_len, max_target_len=cfg.data.max_target_len,
                     threads=max(1, int(r.learner_cpus)), mixed_precision=cfg.run.mixed_precision)
            for i in range(r.learners)
        ]
        address, port = self._get(self.ranks[0].rendezvous_address.remote())
        self._get([rank.join.remote(address, port) for rank in self.ranks])
        # Not waited for here: it runs while the rollout and reward workers start, and the first
        # train_step_async checks its outcome (each actor runs its calls in order, so no step overtakes it).
        self._preflight = [rank.preflight.remote() for rank in self.ranks] if r.preflight else []

    def _get(self, refs):
        """ray.get, failing on the first rank that fails: under DDP the others may wait on it forever."""
        try:
            if not isinstance(refs, list):
                return ray.get(refs)
            remaining = list(refs)
            while remaining:
                done, remaining = ray.wait(remaining, num_returns=1)
                ray.get(done)  # raises this rank's error now
            return ray.get(refs)
        except (RayActorError, RayTaskError) as e:
            raise LearnerDied(f"a learner rank failed: {e}") from e

    def check_preflight(self) -> None:
        """Surface the preflight's outcome (once): an out-of-memory error there fails the job before training."""
        if not self._preflight:
            return
        refs, self._preflight = self._preflight, []
        try:
            stats = self._get(refs)
        except LearnerDied as e:
            cause = getattr(e.__cause__, "cause", None)  # the rank's own exception, inside Ray's RayTaskError
            if isinstance(cause, BatchTooLarge):
                raise ValueError(str(cause)) from None  # a setting to change: resuming would fail the same way
            raise
        first = stats[0]
        log.info("rank: learner preflight on the largest batch (%d pairs per rank, %d source / %d target tokens): "
                 "%.1f s, peak memory %.2f GiB (rank 0)", first["pairs"], first["source_tokens"],
                 first["target_tokens"], first["seconds"], first["peak_memory_gib"])

    def _settle(self) -> None:
        """Confirm the setup calls not waited for (preflight, resumed states) before anything uses the
        learners' state: a rank that failed to load its state must not train or be checkpointed."""
        self.check_preflight()
        if self._loading:
            refs, self._loading = self._loading, []
            self._get(refs)

    def train_step_async(self, pairs: Sequence[ScoredPair]) -> list[ray.ObjectRef]:
        """Shard a global batch over the ranks (rank i takes pairs i, i+N, ...)."""
        self._settle()
        n = len(self.ranks)
        return [rank.train_step.remote(list(pairs[i::n])) for i, rank in enumerate(self.ranks)]

    def result(self, refs: list[ray.ObjectRef]) -> dict[str, float]:
        return self._get(refs)[0]  # scalars are already averaged over ranks

    def weights(self) -> dict[str, torch.Tensor]:
        self._settle()
        return self._get(self.ranks[0].weights.remote())

    def training_states(self) -> list[dict[str, Any]]:
        self._settle()
        return self._get([r.training_state.remote() for r in self.ranks])

    def load_training_states(self, states: list[dict[str, Any]]) -> None:
        if len(states) != len(self.ranks):
            raise ValueError(f"checkpoint has {len(states)} learner states, the job has {len(self.ranks)} ranks "
                             "(rank.learners must match to resume exactly)")
        # Not waited for: queued behind the preflight, so the first rollouts need not wait for either.
        # Each rank runs its calls in order, and _settle confirms the load before the state is used.
        self._loading = [r.load_training_state.remote(s) for r, s in zip(self.ranks, states, strict=True)]

    def evaluate(self, examples: Sequence[Example], cfg: Config) -> dict[str, float]:
        self._settle()
        return self._get([r.evaluate.remote(list(examples), cfg.metric, cfg.eval.max_new_tokens)
                          for r in self.ranks])[0]

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):  # best effort on the way out
            ray.get([r.shutdown.remote() for r in self.ranks], timeout=30)
        for r in self.ranks:
            ray.kill(r)
        remove_placement_group(self.pg)


class WorkerPool:
    """Rollout or reward actors, restarted by Ray when they die; tasks go to the least busy healthy one.

    A worker whose task failed cools down (0.5 s, doubling per consecutive failure, at most 10 s): Ray
    is restarting it, and a task sent meanwhile would fail at once (``ActorUnavailableError``).
    """

    MAX_COOLDOWN_S = 10.0

    def __init__(self, cls: type, n: int, *, num_cpus: float, num_gpus: float, max_restarts: int, args: tuple,
                 kwargs: dict, resources: dict[str, float] | None = None,
                 per_actor_args: Sequence[tuple] | None = None):
        remote = ray.remote(cls).options(num_cpus=num_cpus, num_gpus=num_gpus, resources=dict(resources or {}),
                                         max_restarts=max_restarts, max_task_retries=0)
        own = list(per_actor_args) if per_actor_args is not None else [()] * n
        if len(own) != n:
            raise ValueError(f"per_actor_args: {len(own)} entries for {n} workers")
        self.cls = cls
        self.actors = [remote.remote(*extra, *args, **kwargs) for extra in own]
        self.busy = [0] * n
        self.cooldown_until = [0.0] * n
        self.failures = [0] * n  # consecutive

    def pick(self) -> int:
        """The least busy worker not cooling down (the one back soonest when all are)."""
        now = time.monotonic()
        healthy = [i for i in range(len(self.actors)) if self.cooldown_until[i] <= now]
        if not healthy:
            return min(range(len(self.actors)), key=lambda i: self.cooldown_until[i])
        return min(healthy, key=lambda i: self.busy[i])

    def next_available(self) -> float:
        """Monotonic time at which some worker is out of cooldown (<= now when one already is)."""
        return min(self.cooldown_until)

    def failed(self, i: int) -> None:
        self.failures[i] += 1
        delay = min(0.5 * 2 ** (self.failures[i] - 1), self.MAX_COOLDOWN_S)
        self.cooldown_until[i] = max(self.cooldown_until[i], time.monotonic() + delay)

    def succeeded(self, i: int) -> None:
        self.failures[i] = 0

    def shutdown(self) -> None:
        """Let workers release what they hold (``close``, best effort: ``ray.kill`` skips finalizers)."""
        if hasattr(self.cls, "close"):
            with contextlib.suppress(Exception):
                ray.wait([a.close.remote() for a in self.actors], num_returns=len(self.actors), timeout=30)
        for a in self.actors:
            ray.kill(a)


# --- the job ---------------------------------------------------------------------------------------------

@dataclass
class Chunk:
    index: int
    examples: list[Example]
    version: int
    attempts: int = 0
    """Failures of a task on it (worker death, an error in the task)."""
    unavailable: int = 0
    """Times it was refused because its worker was restarting (retried after the worker's cooldown)."""


@dataclass
class RankResult:
    checkpoint: Path
    steps: int
    history: list[dict[str, float]] = field(default_factory=list)
    redispatched: int = 0
    pairs_used: int = 0
    out_of_order: int = 0
    """Chunks handed to the learner ahead of an earlier one (only when rank.deterministic is off)."""


def needed_version(global_step: int, epoch_start: int, refresh: int) -> int:
    """The learner step whose weights sample the pairs consumed at ``global_step``.

    ``refresh == 0``: the epoch's first step (the previous epoch's model). Otherwise the refresh point
    one interval behind: staleness is between ``refresh`` and ``2·refresh - 1`` steps, so rollouts can
    run a whole interval ahead of the learner.
    """
    if refresh == 0:
        return epoch_start
    return max(0, (global_step // refresh - 1) * refresh)


# Actors log through ours; transformers' progress bars and tokenizers' thread pools only add noise.
# glibc malloc hands large freed blocks back to the OS and faults them in again on the next step. With
# fixed thresholds a worker reuses its activation memory instead: a fresh learner actor's first steps ran
# up to 1.4x slower without them (small preset, bench/pipeline.py). A value set in the driver's
# environment is passed on instead; other allocators ignore these variables.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
WORKER_ENV = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
              "TOKENIZERS_PARALLELISM": "false", **{k: os.environ.get(k, v) for k, v in MALLOC_ENV.items()}}


def init_ray(cfg: Config) -> None:
    """Join the cluster at RAY_ADDRESS, or start an embedded local one."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True, runtime_env={"env_vars": WORKER_ENV})
        return
    r = cfg.rank
    need = r.learners * r.learner_cpus + r.rollout_workers * r.rollout_cpus + r.reward_workers * r.reward_cpus
    # Logical CPUs: the embedded cluster may oversubscribe a small machine rather than refuse to start.
    ray.init(num_cpus=max(math.ceil(need), os.cpu_count() or 1), include_dashboard=False,
             log_to_driver=True, configure_logging=False, runtime_env={"env_vars": WORKER_ENV})


def truncate_sources(examples: list[Example], tokenizer, max_source_len: int) -> list[Example]:
    """Examples whose source is longer than ``max_source_len`` tokens (EOS included) get the decoded
    truncated source; the others are returned as they are."""
    sources = [e.source for e in examples]
    lengths = [len(x) for x in tokenizer(sources, add_special_tokens=True)["input_ids"]]
    long = [i for i, n in enumerate(lengths) if n > max_source_len]
    if not long:
        return examples
    ids, _ = encode_texts(tokenizer, [sources[i] for i in long], max_source_len)
    out = list(examples)
    for i, x in zip(long, ids, strict=True):
        out[i] = dataclasses.replace(out[i], source=" ".join(tokenizer.decode(x, skip_special_tokens=True).split()))
    log.warning("rank: truncated %d of %d sources to data.max_source_len=%d tokens for the policy servers",
                len(long), len(examples), max_source_len)
    return out


def wait_for_servers(cfg: Config, published_dir: Path, token: str | None) -> None:
    """Block until every policy / reward server of an http source answers /readyz (rollout.timeout_s)."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    servers = [(u, "policy", f"rlt2t serve policy --checkpoint-dir {published_dir}") for u in cfg.rollout.urls
               if cfg.rollout.source == "http"]
    if cfg.reward.source == "http":
        servers.append((cfg.reward.url, "reward", "rlt2t serve reward --document-frequency "
                        f"{published_dir.parent / 'document_frequency.json'}"))
    deadline = time.monotonic() + cfg.rollout.timeout_s
    for url, kind, how in servers:
        announced = False
        while True:
            try:
                status = httpx.get(f"{url.rstrip('/')}/readyz", headers=headers, timeout=5).status_code
            except httpx.HTTPError:
                status = None
            if status == 200:
                break
            if status in (401, 403):
                raise RuntimeError(f"rank: the {kind} server at {url} refused our bearer token (HTTP {status}); "
                                   f"set serve.token_file or ${cfg.serve.token_env} to the server's token")
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank: the {kind} server at {url} was not ready within rollout.timeout_s="
                                   f"{cfg.rollout.timeout_s:g} s (start it with: {how})")
            if not announced:
                log.info("rank: waiting for the %s server at %s (start it with: %s)", kind, url, how)
                announced = True
            time.sleep(0.5)


def _start_groups(cfg: Config, start: Path, total_steps: int, df: DocumentFrequency):
    """The learner group, rollout and reward pools, and the driver's checkpoint writer."""
    r = cfg.rank
    learners = rollouts = rewards = None
    try:
        learners = LearnerGroup(cfg, start, total_steps)
        http_rollout = cfg.rollout.source == "http"
        token = None
        if http_rollout or cfg.reward.source == "http":
            from rlt2t.services.http import load_token

            token = load_token(cfg.serve)  # the servers' bearer token, handed to the workers explicitly
        if http_rollout:
            # One light actor per policy server: they wait on HTTP, so they reserve little CPU.
            rollouts = WorkerPool(HttpRolloutWorker, len(cfg.rollout.urls), num_cpus=0.1, num_gpus=0,
                                  max_restarts=r.max_restarts, args=(),
                                  kwargs=dict(rollout=cfg.rollout, seed=cfg.run.seed, token=token),
                                  per_actor_args=[(url,) for url in cfg.rollout.urls])
        else:
            rollouts = WorkerPool(RolloutWorker, r.rollout_workers, num_cpus=r.rollout_cpus,
                                  num_gpus=r.rollout_gpus, max_restarts=r.max_restarts, resources=r.rollout_resources,
                                  args=(cfg.model, str(cfg.tokenizer_dir), cfg.rollout),
                                  kwargs=dict(seed=cfg.run.seed, max_source_len=cfg.data.max_source_len))
        if cfg.reward.source == "http":
            rewards = WorkerPool(HttpRewardWorker, r.reward_workers, num_cpus=0.1, num_gpus=0, max_restarts=r.max_restarts,
                                 args=(cfg.reward.url, cfg.reward), kwargs=dict(token=token))
        else:
            rewards = WorkerPool(RewardWorker, r.reward_workers, num_cpus=r.reward_cpus, num_gpus=0,
                                 max_restarts=r.max_restarts, args=(cfg.reward, df), kwargs={})
        saver = load_policy(cfg.model, cfg.tokenizer_dir, checkpoint=start)  # writes checkpoints on the driver
    except BaseException:
        _release(learners, rollouts, rewards)
        raise
    return learners, rollouts, rewards, saver, token


def _release(learners: LearnerGroup | None, *pools: WorkerPool | None) -> None:
    if learners is not None:
        learners.shutdown()
    for pool in pools:
        if pool is not None:
            pool.shutdown()


def train_rank(cfg: Config, train: Sequence[Example], valid: Sequence[Example], *, init: Path,
               resume_from: CheckpointInfo | None = None, stop_after_steps: int = 0) -> RankResult:
    """Run rank RL from ``init`` (an SFT checkpoint) or resume ``resume_from``; returns the last checkpoint."""
    r = cfg.rank
    out_dir = cfg.run_dir / "rank"
    ckpt_root = out_dir / "checkpoints"
    if r.train_subset and r.train_subset < len(train):
        log.warning("rank: rank.train_subset=%d: training on %d of %d sources (set 0 for all)", r.train_subset,
                    r.train_subset, len(train))
        train = train[: r.train_subset]
    train = list(train)
    if len(train) < r.learners:
        raise ValueError(f"rank: {len(train)} training examples for {r.learners} learner ranks")
    steps_per_epoch = math.ceil(len(train) / r.batch_size)
    total_steps = r.epochs * steps_per_epoch if not r.max_steps else min(r.max_steps, r.epochs * steps_per_epoch)
    init_ray(cfg)

    # CIDEr-D document frequencies: once, from the training references, shipped to every reward worker.
    df = DocumentFrequency.from_references([[e.target] for e in train])
    df.save(out_dir / "document_frequency.json")  # for reward / policy servers scoring this task
    start = Path(resume_from.path) if resume_from else init
    learners = rollouts = rewards = None
    try:
        learners, rollouts, rewards, saver, token = _start_groups(cfg, start, total_steps, df)
    except BaseException:
        _release(learners, rollouts, rewards)  # nothing may outlive a failed start on a standing cluster
        raise
    http_rollout = cfg.rollout.source == "http"
    published_dir = out_dir / "published"


    def write_published(version: int, weights: dict[str, torch.Tensor]) -> None:
        """Policy servers (rollout.source=http) load the learner's weights from here (hot reload)."""
        name = checkpoint_name(step=version)
        saver.model.load_state_dict(weights)
        save_checkpoint(published_dir, name, model=saver.model, tokenizer=saver.tokenizer, step=version,
                        meta={"stage": "rank-published", "policy_version": version})
        prune_checkpoints(published_dir, keep_last=2)
        log.info("rank: published version %d to %s", version, published_dir)

    if http_rollout:
        # Versions a crashed or earlier run published are not this run's weights: servers must not see them.
        shutil.rmtree(published_dir, ignore_errors=True)
        # Policy servers tokenise on their side: cut sources to data.max_source_len here, as the Ray
        # rollout workers do, so the servers sample from the context the learner trains on.
        train = truncate_sources(train, saver.tokenizer, cfg.data.max_source_len)
    step, epoch0, published = 0, 0, {}
    if resume_from is not None:
        state = load_training_state(resume_from.path)
        learners.load_training_states(state["learners"])
        published = {int(v): ray.put(w) for v, w in state["published"].items()}
        if http_rollout:
            for v, w in sorted(state["published"].items()):
                write_published(int(v), w)
        step, epoch0 = resume_from.step, resume_from.meta["epoch"]
        log.info("rank: resuming from %s (step %d, epoch %d)", resume_from.path, step, epoch0)
    logger = RunLogger(cfg.run_dir / "logs" / "rank", "rank")
    bar = tqdm(total=total_steps, initial=step, desc="rank", disable=True if not cfg.run.progress else None, dynamic_ncols=True)
    result = RankResult(checkpoint=start, steps=step)
    best = (resume_from.meta.get("best") or {}) if resume_from else {}

    # The weights the run starts from are the checkpoint the driver loaded too: the first publish ships
    # these, so the first rollouts need not wait for the learner (busy with its preflight at this point).
    start_weights: dict[str, torch.Tensor] | None = {k: v.detach().clone() for k, v in saver.model.state_dict().items()}
    start_version = step

    def publish(version: int) -> None:
        nonlocal start_weights
        if version not in published:
            if version == start_version and start_weights is not None:
                weights, start_weights = start_weights, None
            else:
                weights = learners.weights()
            published[version] = ray.put(weights)
            if http_rollout:
                write_published(version, weights)

    def checkpoint(epoch: int, batch_in_epoch: int, metrics: dict[str, float]) -> Path:
        nonlocal best
        saver.model.load_state_dict(learners.weights())
        name = checkpoint_name(epoch=epoch) if batch_in_epoch == 0 else checkpoint_name(step=step)
        if batch_in_epoch == 0 and "monitor" in metrics and metrics["monitor"] > best.get("score", -math.inf):
            best = {"score": metrics["monitor"], "path": str(ckpt_root / name)}
        keep = {v: ray.get(ref) for v, ref in published.items() if v < step}
        path = save_checkpoint(ckpt_root, name, model=saver.model, tokenizer=saver.tokenizer, step=step,
                               meta={"stage": "rank", "epoch": epoch, "batch_in_epoch": batch_in_epoch,
                                     "policy_version": step,
                                     "metrics": metrics, "best": best or None, "total_steps": total_steps},
                               training_state={"learners": learners.training_states(), "published": keep})
        prune_checkpoints(ckpt_root, r.keep_last, protect={Path(best["path"])} if best else set())
        return path

    try:
        if http_rollout:
            publish(step)  # the servers need weights to load before they can answer
            wait_for_servers(cfg, published_dir, token)
        if r.refresh_every_steps and step % r.refresh_every_steps == 0:
            publish(step)  # the learner holds exactly these weights now (start, or a resumed checkpoint)
        for epoch in range(epoch0, r.epochs):
            if step >= total_steps:
                break
            epoch_start = epoch * steps_per_epoch
            first_batch = step - epoch_start
            order = epoch_order(len(train), cfg.run.seed, epoch)[first_batch * r.batch_size:]
            examples = [train[i] for i in order]
            last_batch = min(steps_per_epoch, total_steps - epoch_start)
            examples = examples[: (last_batch - first_batch) * r.batch_size]
            chunks = [Chunk(i, examples[o : o + r.chunk_size],
                            needed_version(step + o // r.batch_size, epoch_start, r.refresh_every_steps))
                      for i, o in enumerate(range(0, len(examples), r.chunk_size))]
            if r.refresh_every_steps == 0:
                publish(epoch_start)
            start_weights = None  # published by now, or never needed (a run resumed mid-epoch)
            epoch_stats = run_epoch(cfg, chunks, learners, rollouts, rewards, published, publish, logger, bar,
                                    step, stop_after_steps, result, checkpoint, epoch, epoch_start)
            step = epoch_stats["step"]
            if stop_after_steps and step >= stop_after_steps:
                result.steps = step
                return result
            scores = learners.evaluate(valid, cfg) if valid else {}
            if scores:
                logger.log(step, {**scores, "epoch": epoch}, kind="valid")
                log.info("rank epoch %d: %s", epoch, ", ".join(f"{k}={v:.4f}" for k, v in scores.items()))
            result.checkpoint = checkpoint(epoch + 1, 0, {**epoch_stats["last"], **scores})
            result.history.append({"epoch": epoch, **scores})
            for v in [v for v in published if v < step - r.refresh_every_steps]:
                del published[v]  # no later chunk can need it
        result.steps = step
    finally:
        bar.close()
        logger.close()
        plot_curves(logger.dir / "metrics.jsonl", logger.dir / "curves.png", title=f"rank RL: {cfg.run_dir}")
        _release(learners, rollouts, rewards)
    return result


def run_epoch(cfg: Config, chunks: list[Chunk], learners: LearnerGroup, rollouts: WorkerPool, rewards: WorkerPool,
              published: dict[int, ray.ObjectRef], publish, logger: RunLogger, bar, step: int, stop_after_steps: int,
              result: RankResult, checkpoint, epoch: int, epoch_start: int) -> dict[str, Any]:
    """Sample → score → learn over one epoch's chunks, overlapping rollouts with learner steps."""
    r = cfg.rank
    ordered = r.deterministic if r.deterministic is not None else not torch.cuda.is_available()
    pending: dict[ray.ObjectRef, tuple[str, int, int]] = {}  # ref -> (kind, chunk index, worker)
    ready: dict[int, list[ScoredPair]] = {}  # reorder buffer: chunk index -> scored pairs
    consumed: set[int] = set()  # chunk indices whose pairs reached the learner's queue
    retries: list[tuple[float, int]] = []  # (monotonic time, chunk index): re-dispatches waiting for a worker
    queue: list[ScoredPair] = []  # pairs in dataset order, not yet learned from
    next_submit = next_consume = 0
    # Learner steps submitted and not yet returned, oldest first: (refs, batch info). The next step is
    # queued on the learner while one runs, so it never waits for the driver's round trip between steps.
    steps_inflight: deque[tuple[list[ray.ObjectRef], dict[str, Any]]] = deque()
    last: dict[str, float] = {}
    window_t, window_pairs = time.perf_counter(), 0
    busy_since = 0.0
    learner_busy = 0.0
    epoch_t0 = time.perf_counter()

    def after_step_needs_driver(n: int) -> bool:
        """Whether the driver acts on the learner right after its n-th step (publish, checkpoint, stop):
        no later step may be queued behind that one, or it would run first."""
        return bool((r.refresh_every_steps and n % r.refresh_every_steps == 0)
                    or (r.save_every_steps and n % r.save_every_steps == 0)
                    or (stop_after_steps and n >= stop_after_steps))

    def submit_rollout(c: Chunk) -> None:
        w = rollouts.pick()
        # Policy servers load published checkpoints themselves: do not ship them the weights.
        weights = None if cfg.rollout.source == "http" else published[c.version]
        ref = rollouts.actors[w].sample_version.remote(c.version, weights, c.examples)
        pending[ref] = ("rollout", c.index, w)
        rollouts.busy[w] += 1

    while next_consume < len(chunks) or queue or steps_inflight:
        # Re-dispatch failed chunks whose wait is over (ahead of new work: the learner needs them first).
        now = time.monotonic()
        for due in sorted(x for x in retries if x[0] <= now):
            retries.remove(due)
            submit_rollout(chunks[due[1]])
        # Dispatch rollouts ahead of the learner, bounded, each once its weights version exists.
        while (next_submit < len(chunks) and next_submit - next_consume < r.max_inflight_chunks
               and chunks[next_submit].version in published):
            submit_rollout(chunks[next_submit])
            next_submit += 1
        # Move completed chunks into the learner's queue: in dataset order (deterministic), or as they
        # come (faster when workers are uneven; the result then depends on timing).
        while next_consume in ready or (not ordered and ready):
            index = next_consume if next_consume in ready else min(ready)
            if index in consumed:  # an invariant, checked because a re-dispatch bug would silently reuse pairs
                raise RuntimeError(f"rank: chunk {index} delivered twice")
            consumed.add(index)
            result.out_of_order += index != next_consume
            queue.extend(ready.pop(index))
            next_consume += 1
        # Queue a learner step (at most two: one running, one waiting) when a full batch or the epoch's
        # tail is ready, unless the driver must act after the step already queued.
        while (len(steps_inflight) < 2 and queue and (len(queue) >= r.batch_size or next_consume == len(chunks))
               and not (steps_inflight and after_step_needs_driver(step + len(steps_inflight)))):
            batch, queue = queue[: r.batch_size], queue[r.batch_size:]
            # Staleness against the learner's version when this batch is trained (after the queued steps).
            staleness = [step + len(steps_inflight) - p.policy_version for p in batch]
            shards = batch
            if len(batch) < r.learners:
                # An epoch tail smaller than the group: every rank must step (DDP all-reduces), so the
                # tail's pairs are repeated to give each rank one.
                shards = [batch[i % len(batch)] for i in range(r.learners)]
            if not steps_inflight:
                busy_since = time.perf_counter()
            steps_inflight.append((learners.train_step_async(shards), {
                "staleness_mean": sum(staleness) / len(staleness), "staleness_max": max(staleness),
                "pairs": len(batch)}))
        waitable = list(pending) + (steps_inflight[0][0] if steps_inflight else [])
        if not waitable and retries:
            time.sleep(max(0.0, min(t for t, _ in retries) - time.monotonic()))
            continue
        if not waitable:
            if next_submit < len(chunks):  # the next chunk waits for a version the learner has not reached
                raise RuntimeError(f"rank: chunk {next_submit} needs policy version {chunks[next_submit].version} "
                                   f"but the learner is at step {step}; lower rank.refresh_every_steps "
                                   "or rank.max_inflight_chunks")
            break
        timeout = max(0.0, min(t for t, _ in retries) - time.monotonic()) if retries else None
        done, _ = ray.wait(waitable, num_returns=1, timeout=timeout)
        if not done:
            continue  # a re-dispatch is due
        ref = done[0]
        if steps_inflight and ref in steps_inflight[0][0]:
            learner_refs, batch_info = steps_inflight.popleft()
            ray.wait(learner_refs, num_returns=len(learner_refs))
            metrics = learners.result(learner_refs)
            if not steps_inflight:
                learner_busy += time.perf_counter() - busy_since
            step += 1
            result.pairs_used += batch_info["pairs"]
            window_pairs += batch_info["pairs"]
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['pair_accuracy']:.2f}")
            if r.refresh_every_steps and step % r.refresh_every_steps == 0:
                publish(step)
            if step % cfg.run.log_every == 0 or next_consume == len(chunks) and not queue and not steps_inflight:
                now = time.perf_counter()
                busy = learner_busy + (now - busy_since if steps_inflight else 0.0)
                last = {**metrics, **batch_info, "epoch": epoch, "pairs_per_s": window_pairs / max(now - window_t, 1e-9),
                        "learner_busy": busy / max(now - epoch_t0, 1e-9), "redispatched": result.redispatched}
                logger.log(step, last)
                window_t, window_pairs = now, 0
            if r.save_every_steps and step % r.save_every_steps == 0 and (next_consume < len(chunks) or queue):
                result.checkpoint = checkpoint(epoch, step - epoch_start, last)
            if stop_after_steps and step >= stop_after_steps:
                break
            continue
        kind, index, w = pending.pop(ref)
        pool = rollouts if kind == "rollout" else rewards
        pool.busy[w] -= 1
        try:
            if kind == "rollout":
                ray.get(ref)  # surfaces a dead worker here, before scoring
                pool.succeeded(w)
                rw = rewards.pick()
                score_ref = rewards.actors[rw].score.remote(ref)
                pending[score_ref] = ("reward", index, rw)
                rewards.busy[rw] += 1
            else:
                ready[index] = ray.get(ref)
                pool.succeeded(w)
        except (RayActorError, RayTaskError) as e:
            chunk = chunks[index]
            pool.failed(w)
            result.redispatched += 1
            # A restarting worker refuses tasks at once: that is not the chunk's fault, only a reason to wait
            # (bounded: some minutes of cooldowns). Any other failure counts against rank.max_restarts.
            if isinstance(e, ActorUnavailableError):
                chunk.unavailable += 1
                exhausted = chunk.unavailable > 30
            else:
                chunk.attempts += 1
                exhausted = chunk.attempts > r.max_restarts + 1
            if exhausted:
                raise RuntimeError(f"rank: chunk {index} failed {chunk.attempts} times and was refused "
                                   f"{chunk.unavailable} times by restarting workers; last error: {e}") from e
            when = max(rollouts.next_available(), rewards.next_available())
            log.warning("rank: %s worker %d failed on chunk %d (%s); re-dispatching%s", kind, w, index,
                        type(e).__name__, f" in {when - time.monotonic():.1f} s" if when > time.monotonic() else "")
            retries.append((when, index))
    stopped = stop_after_steps and step >= stop_after_steps
    if not stopped and len(consumed) != len(chunks):
        raise RuntimeError(f"rank: the epoch ended with {len(chunks) - len(consumed)} of {len(chunks)} chunks unused")
    if result.out_of_order:
        log.info("rank: %d chunks reached the learner out of dataset order (rank.deterministic off)",
                 result.out_of_order)
    return {"step": step, "last": last}
