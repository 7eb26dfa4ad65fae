"""The RL job's Ray side: starting Ray, checking that the cluster can hold the job, and the actor groups
(the learner group in one placement group, the rollout and reward worker pools).

Role classes stay plain Python (``rlt2t.learner.learner.Learner``, ``rlt2t.actors.rollout.RolloutWorker``,
...); ``ray.remote(...).options(...)`` is applied here, where they are launched.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlt2t.by_reference import FetchObject, with_results
from rlt2t.common.checkpoint import load_training_state
from rlt2t.common.config import Config, ModelConfig
from rlt2t.common.data import Example
from rlt2t.common.environ import environment
from rlt2t.common.errors import ResumableFailure, UnitError
from rlt2t.common.lora import apply_lora, is_lora, policy_weights
from rlt2t.common.policy import load_policy, lora_base
from rlt2t.learner.evaluate import validation_columns
from rlt2t.learner.learner import BatchTooLarge, Learner
from rlt2t.scheduler import PoolState, StoredItem

log = logging.getLogger("rlt2t.train")

# Actors log through ours; transformers' progress bars and tokenizers' thread pools only add noise.
# glibc malloc hands large freed blocks back to the OS and faults them in again on the next step. With
# fixed thresholds a worker reuses its activation memory instead (bench/pipeline.py measured the
# difference on a fresh learner actor's first steps). A value set in the driver's environment is passed on
# instead; other allocators ignore these variables.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
WORKER_ENV = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
              "TOKENIZERS_PARALLELISM": "false", **{k: os.environ.get(k, v) for k, v in MALLOC_ENV.items()}}


class LearnerDied(ResumableFailure):
    """A learner rank died; the job stops and the newest checkpoint resumes it."""


class ClusterTooSmall(ValueError):
    """The cluster cannot hold what the job asks for (a setting to change, not a failure to retry)."""


# --- what the job asks of the cluster ---------------------------------------------------------------------

@dataclass(frozen=True)
class Demand:
    """One kind of actor the job starts: how many, and the resources of each."""

    what: str
    """The settings that size it, for messages (e.g. ``rl.rollout_workers=2 x rl.rollout_cpus=1``)."""
    count: int
    resources: dict[str, float]


def job_demands(cfg: Config, *, policy_server: bool = False) -> list[Demand]:
    """Every actor the RL job (and, deployed beside it, the policy server) asks the cluster for."""
    r = cfg.rl

    def bundle(cpus: float, gpus: float, extra: dict[str, float]) -> dict[str, float]:
        return {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **extra}

    http_rollout, http_reward = cfg.rollout.source == "http", cfg.reward.source == "http"
    demands = [
        Demand(f"rl.learners={r.learners} x (rl.learner_cpus={r.learner_cpus:g}, rl.learner_gpus={r.learner_gpus:g}, "
               f"rl.learner_resources={dict(r.learner_resources)})", r.learners,
               bundle(r.learner_cpus, r.learner_gpus, dict(r.learner_resources))),
        Demand(f"{len(cfg.rollout.urls)} HTTP rollout workers x 0.1 CPU" if http_rollout else
               f"rl.rollout_workers={r.rollout_workers} x (rl.rollout_cpus={r.rollout_cpus:g}, "
               f"rl.rollout_gpus={r.rollout_gpus:g}, rl.rollout_resources={dict(r.rollout_resources)})",
               len(cfg.rollout.urls) if http_rollout else r.rollout_workers,
               {"CPU": 0.1} if http_rollout else bundle(r.rollout_cpus, r.rollout_gpus, dict(r.rollout_resources))),
        Demand(f"rl.reward_workers={r.reward_workers} x " + ("0.1 CPU (HTTP)" if http_reward else
               f"(rl.reward_cpus={r.reward_cpus:g}, rl.reward_gpus={r.reward_gpus:g})"), r.reward_workers,
               {"CPU": 0.1} if http_reward else bundle(r.reward_cpus, r.reward_gpus, {})),
    ]
    if policy_server:
        s = cfg.serve
        demands.append(Demand(f"the policy server (serve.num_cpus={s.num_cpus:g}, serve.num_gpus={s.num_gpus:g}, "
                              f"serve.resources={dict(s.resources)})", 1, bundle(s.num_cpus, s.num_gpus,
                                                                                 dict(s.resources))))
    return demands


def check_fits(demands: Sequence[Demand], totals: dict[str, float], largest_node: dict[str, float]) -> None:
    """Fail at once, naming the settings and the cluster's totals, when the cluster can never hold the job:
    the sum of every resource asked for exceeds the cluster's total, or one actor exceeds every node."""
    problems = []
    for name in sorted({k for d in demands for k in d.resources}):
        need = sum(d.count * d.resources.get(name, 0.0) for d in demands)
        have = totals.get(name, 0.0)
        if need > have + 1e-9:
            parts = " + ".join(d.what for d in demands if d.resources.get(name))
            problems.append(f"{name}: the job asks for {need:g} ({parts}) but the cluster has {have:g} in all")
    for d in demands:
        for name, amount in d.resources.items():
            if amount > largest_node.get(name, 0.0) + 1e-9:
                problems.append(f"{name}: one of {d.what} needs {amount:g}, more than any node offers "
                                f"({largest_node.get(name, 0.0):g})")
    if problems:
        raise ClusterTooSmall("the Ray cluster cannot hold this job, it would wait forever:\n  " + "\n  ".join(problems)
                              + "\n  lower those settings, or start the cluster with more resources "
                              "(`make ray-up RAY_CPUS=...`)")


def check_cluster(cfg: Config, *, policy_server: bool = False) -> None:
    """:func:`check_fits` against the connected cluster's alive nodes."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    totals: dict[str, float] = {}
    largest: dict[str, float] = {}
    for res in nodes:
        for k, v in res.items():
            totals[k] = totals.get(k, 0.0) + v
            largest[k] = max(largest.get(k, 0.0), v)
    check_fits(job_demands(cfg, policy_server=policy_server), totals, largest)


def init_ray(cfg: Config) -> None:
    """Join the cluster at RAY_ADDRESS, or start an embedded local one sized for the job."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True, runtime_env={"env_vars": WORKER_ENV})
        return
    need = sum(d.count * d.resources.get("CPU", 0.0) for d in job_demands(cfg))
    # Ray turns token authentication on for a local cluster when RAY_AUTH_MODE is unset, and says so on every run
    # in a line a user of the embedded cluster cannot act on: the protection stays, the notice goes. (The mode
    # itself cannot be set here: Ray reads it when it is imported.)
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    # Logical CPUs: the embedded cluster may oversubscribe a small machine rather than refuse to start. Its
    # processes inherit WORKER_ENV from the environment it starts in, not from a runtime_env: Ray starts a worker
    # per CPU ahead of the job, and only workers of the job's runtime_env can take its actors and tasks (with
    # one, those workers sat idle while each actor waited about a second for a process of its own).
    with environment(WORKER_ENV):
        ray.init(num_cpus=max(math.ceil(need), os.cpu_count() or 1), include_dashboard=False,
                 log_to_driver=True, configure_logging=False)


def unschedulable(what: str, timeout_s: float) -> str:
    return (f"{what} could not be scheduled within rl.schedule_timeout_s={timeout_s:g} s: no node offers its "
            "resources now (cluster totals: " + ", ".join(f"{k} {v:g}" for k, v in sorted(
                ray.cluster_resources().items()) if not k.startswith("node:")) + ")")


# --- the learner group ------------------------------------------------------------------------------------

class LearnerGroup:
    """N Learner actors in one placement group, forming one DDP world (or one FSDP world: rl.strategy=fsdp)."""

    sharded = False
    """rl.strategy=fsdp: gathers of the weights are collectives every rank joins."""

    def __init__(self, cfg: Config, init_checkpoint: Path, total_steps: int, *, reference_checkpoint: Path):
        r = cfg.rl
        self.sharded = r.strategy == "fsdp"
        bundles = [{"CPU": r.learner_cpus, **({"GPU": r.learner_gpus} if r.learner_gpus else {}),
                    **r.learner_resources} for _ in range(r.learners)]
        self.pg = placement_group(bundles, strategy="PACK")
        self.ranks: list[Any] = []
        self._joining: list[ray.ObjectRef] = []  # the DDP rendezvous, sent and not yet confirmed
        self._preflight: list[ray.ObjectRef] = []
        self._loading: list[ray.ObjectRef] = []  # resumed training states, sent and not yet confirmed
        self._masks_held: list[int | None] = [None] * cfg.rl.learners  # NLPO: each rank's masking-policy version
        try:
            self._start(cfg, init_checkpoint, total_steps, reference_checkpoint)
        except BaseException:
            self.shutdown()  # the placement group and any rank started must not outlive a failed start
            raise

    def _start(self, cfg: Config, init_checkpoint: Path, total_steps: int, reference_checkpoint: Path) -> None:
        r = cfg.rl
        try:
            ray.get(self.pg.ready(), timeout=r.schedule_timeout_s)
        except GetTimeoutError:
            raise ClusterTooSmall(unschedulable(f"the learner group ({r.learners} bundles of "
                                                 f"{self.pg.bundle_specs[0]}: rl.learners, rl.learner_cpus / "
                                                 "learner_gpus / learner_resources)", r.schedule_timeout_s)) from None
        actor = ray.remote(Learner)
        self.ranks = [
            actor.options(
                num_cpus=r.learner_cpus, num_gpus=r.learner_gpus, resources=dict(r.learner_resources), max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                                     placement_group_bundle_index=i),
            ).remote(cfg.model, str(cfg.tokenizer_dir), r, cfg.rollout, init_checkpoint=str(init_checkpoint), rank=i,
                     world_size=r.learners, total_steps=total_steps, seed=cfg.run.seed,
                     max_source_len=cfg.data.max_source_len, max_target_len=cfg.data.max_target_len,
                     threads=max(1, int(r.learner_cpus)), mixed_precision=cfg.run.mixed_precision,
                     reference_checkpoint=str(reference_checkpoint))
            for i in range(r.learners)
        ]
        # Neither the DDP rendezvous nor the preflight is waited for here: the ranks start (import torch, load
        # the checkpoints) while the rollout and reward workers start, and _settle confirms both before the
        # learners' first use. Each actor runs its calls in order, so no step overtakes them; rank 0's address
        # reaches the other ranks as an object reference.
        rendezvous = self.ranks[0].rendezvous_address.remote()
        self._joining = [rank.join.remote(rendezvous) for rank in self.ranks]
        self._preflight = [rank.preflight.remote() for rank in self.ranks] if r.runs_preflight else []

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
            cause = getattr(e, "cause", None)  # the rank's own exception, inside Ray's RayTaskError
            if isinstance(cause, UnitError):
                raise UnitError(str(cause)) from None  # the user's unit to fix: resuming would fail the same way
            raise LearnerDied(f"a learner rank failed: {e}") from e

    def check_preflight(self) -> None:
        """Surface the rendezvous's and the preflight's outcome (once): a rank that failed to start, or an
        out-of-memory error in the preflight, fails the job before training."""
        if self._joining:
            refs, self._joining = self._joining, []
            self._get(refs)
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
        log.info("rl: learner preflight on the largest batch (%d sources per rank, %d source / %d target tokens): "
                 "%.1f s, peak memory %.2f GiB (rank 0)", first["sources"], first["source_tokens"],
                 first["target_tokens"], first["seconds"], first["peak_memory_gib"])

    def _settle(self) -> None:
        """Confirm the setup calls not waited for (rendezvous, preflight, resumed states) before anything uses the
        learners' state: a rank that failed to load its state must not train or be checkpointed."""
        self.check_preflight()
        if self._loading:
            refs, self._loading = self._loading, []
            self._get(refs)

    def _log_setup_failures(self) -> None:
        """A setup call (rendezvous, preflight, resumed state) that failed while the job stopped on another error
        first (a worker that could not be placed, a policy server that never answered): logged, not lost."""
        pending = [*self._joining, *self._preflight, *self._loading]
        if not pending:
            return
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except (RayActorError, RayTaskError) as e:
                log.warning("rl: a learner rank had failed before the job stopped: %s", e)

    def train_step_async(self, items: Sequence[StoredItem], scored: Mapping[int, ray.ObjectRef],
                         published: Mapping[int, ray.ObjectRef] | None = None) -> list[ray.ObjectRef]:
        """Shard a global batch over the ranks (rank i takes items i, i+N, ...). The items stay in the object
        store: each rank is sent the references of the scored chunks (``scored``: chunk index -> its reward
        worker's result) its shard picks from, and fetches them itself. NLPO: each rank is also sent the
        ``published`` weights of the masking policies its groups were sampled under, those it does not hold."""
        self._settle()
        n = len(self.ranks)
        refs = []
        for i, rank in enumerate(self.ranks):
            shard = list(items[i::n])
            chunks = list(dict.fromkeys(item.chunk for item in shard))  # in the order the shard first uses them
            position = {c: k for k, c in enumerate(chunks)}
            picks = [(position[item.chunk], item.index) for item in shard]
            versions = self._masks_to_send(i, shard)
            if versions and published is None:
                raise ValueError(f"nlpo: groups sampled under masking-policy versions {versions}: pass the "
                                 "published weights")
            masks = [published[v] for v in versions] if published is not None else []
            refs.append(rank.train_step_stored.remote(picks, versions, *(scored[c] for c in chunks), *masks))
        return refs

    def _masks_to_send(self, rank: int, shard: Sequence[StoredItem]) -> list[int]:
        """The masking-policy versions of ``shard`` that ``rank`` will load and does not hold, in the order it
        loads them (ascending, as PolicyGradientObjective._action_mask does); records the one it ends with."""
        wanted = sorted({g.mask_version for g in shard if g.mask_version is not None})
        send = []
        for v in wanted:
            if v != self._masks_held[rank]:
                send.append(v)
                self._masks_held[rank] = v
        return send

    def result(self, refs: list[ray.ObjectRef]) -> dict[str, float]:
        return self._get(refs)[0]  # scalars are already averaged over ranks

    def _gather_peers(self, method: str = "weights") -> list[ray.ObjectRef]:
        """Sharded learners (rl.strategy=fsdp): the other ranks' part of a gather of the weights that rank 0
        runs in the call submitted beside this one (each rank runs its calls in order)."""
        if not self.sharded:
            return []
        return [getattr(r, method).remote() for r in self.ranks[1:]]

    def _get_joined(self, ref: ray.ObjectRef, joins: list[ray.ObjectRef]) -> Any:
        """``ref``'s result once the other ranks' part of it (``_gather_peers``) is done too."""
        return self._get([ref, *joins])[0] if joins else self._get(ref)

    def weights(self) -> dict[str, torch.Tensor]:
        """Rank 0's weights, fetched here (tests; the job publishes them with :meth:`publish`)."""
        self._settle()
        joins = self._gather_peers()
        return self._get_joined(self.ranks[0].weights.remote(), joins)

    def publish(self) -> tuple[ray.ObjectRef, int]:
        """Rank 0's current weights in the object store, and the learner step they are: rank 0 stores them as
        its call's result, owned by this process (the reference stays valid should rank 0 die), and only the
        call's small summary is fetched here, never the weights."""
        self._settle()
        summary, weights = self.ranks[0].publish_weights.options(num_returns=2).remote()
        joins = [r.publish_weights.options(num_returns=2).remote()[0] for r in self.ranks[1:]] if self.sharded else []
        return weights, self._get_joined(summary, joins)["step"]

    def write_checkpoint(self, root: Path, name: str, *, step: int, meta: dict[str, Any],
                         published: Mapping[int, ray.ObjectRef], trained_in_epoch: Sequence[str]) -> Path:
        """Rank 0 writes the checkpoint ``root/name`` from its own model (``Learner.write_checkpoint``); the other
        ranks' training states and the ``published`` weights reach it by reference, not through this process."""
        self._settle()
        peers = [r.training_state.remote() for r in self.ranks[1:]]
        joins = self._gather_peers()  # after their states, which rank 0's call waits for
        versions = sorted(published)
        path = self.ranks[0].write_checkpoint.remote(
            str(root), name, step, meta, list(trained_in_epoch), versions, *peers, *(published[v] for v in versions))
        return Path(self._get_joined(path, joins))

    def write_published(self, root: Path, version: int, weights: ray.ObjectRef, meta: dict[str, Any]) -> None:
        """Policy servers: rank 0 writes ``version`` under ``root`` (``Learner.write_published``; ``weights`` are
        fetched there only when rank 0 is at another version)."""
        self._settle()
        joins = self._gather_peers()
        self._get_joined(self.ranks[0].write_published.remote(str(root), version, meta, FetchObject(weights)), joins)

    def training_states(self) -> list[dict[str, Any]]:
        self._settle()
        return self._get([r.training_state.remote() for r in self.ranks])

    def load_training_states(self, states: list[dict[str, Any]]) -> None:
        if len(states) != len(self.ranks):
            raise ValueError(f"checkpoint has {len(states)} learner states, the job has {len(self.ranks)} ranks "
                             "(rl.learners must match to resume exactly)")
        self._masks_held = [None] * len(self.ranks)  # the resumed ranks hold none (masks are not learner state)
        # Not waited for: queued behind the preflight, so the first rollouts need not wait for either.
        # Each rank runs its calls in order, and _settle confirms the load before the state is used.
        self._loading = [r.load_training_state.remote(s) for r, s in zip(self.ranks, states, strict=True)]

    def load_training_states_from(self, checkpoint: Path, count: int) -> None:
        """Each rank reads its own state from ``checkpoint`` (which holds ``count``): as
        :meth:`load_training_states`, without the states passing through this process."""
        if count != len(self.ranks):
            raise ValueError(f"checkpoint has {count} learner states, the job has {len(self.ranks)} ranks "
                             "(rl.learners must match to resume exactly)")
        self._masks_held = [None] * len(self.ranks)
        self._loading = [r.load_training_state_from.remote(str(checkpoint)) for r in self.ranks]

    def evaluate(self, examples: Sequence[Example], cfg: Config) -> tuple[dict[str, float], list[str]]:
        """The metric table of the ranks' greedy outputs on ``examples``, and the outputs (in order): the usual
        columns (``TABLE_METRICS``), then the text metrics of ``eval.metrics`` beyond them (chrF, sacreBLEU for a
        translation run)."""
        names = validation_columns(cfg.eval.metrics)
        self._settle()
        return self._get([r.evaluate.remote(list(examples), cfg.metric, cfg.eval.max_new_tokens, names)
                          for r in self.ranks])[0]

    def shutdown(self) -> None:
        self._log_setup_failures()
        with contextlib.suppress(Exception):  # best effort on the way out
            ray.get([r.shutdown.remote() for r in self.ranks], timeout=30)
        for r in self.ranks:
            ray.kill(r)
        remove_placement_group(self.pg)


# --- worker pools -----------------------------------------------------------------------------------------

# The run's start weights are loaded by a short task (no CPU reserved: the job's actors may hold them all), not
# in the driver: it returns a small first result to wait on, then the weights, which stay in the object store.
# The task's process keeps its imports for the job's next loading task (a resume's kept versions, a feedback
# round's next job) instead of paying them again; it holds no weights between tasks and ends with the job.

def _start_weights(model_cfg: ModelConfig, tokenizer_dir: str | Path | None, checkpoint: str, lora_seed: int,
                   reference: str | None) -> tuple[Any, dict[str, torch.Tensor], int | None,
                                                   dict[str, torch.Tensor] | None]:
    """(tokenizer, weights) of ``checkpoint`` as the learner ranks hold it at the start (LoRA applied as they
    apply it): the published weights of the run's first version. Then, when ``reference`` is a checkpoint,
    (parameter count, full state dict) of it: the KL's reference, the base of LoRA adapters (else None, None).
    One process loads both, the same checkpoint once (a fresh run starts from its reference).

    With LoRA, a ``reference`` that is itself an adapter checkpoint (RL from a LoRA SFT checkpoint, whose
    adapters the run trains on) gives its base: what the learners' adapters adapt, and what their KL reference
    is (the adapters disabled). Merged, the rollout workers would apply the adapters twice."""
    policy = load_policy(model_cfg, tokenizer_dir, checkpoint=checkpoint, trainable_adapters=True)
    count, base = None, None
    if reference is not None and model_cfg.lora.enabled:
        reference = str(lora_base(reference))
    if reference is not None:
        same = reference == checkpoint and not is_lora(policy.model)  # before LoRA is applied, the reference
        model = policy.model if same else load_policy(model_cfg, tokenizer_dir, checkpoint=reference).model
        count, base = sum(p.numel() for p in model.parameters()), model.state_dict()
    if model_cfg.lora.enabled and not is_lora(policy.model):
        policy.model = apply_lora(policy.model, model_cfg.lora, seed=lora_seed)
    return policy.tokenizer, policy_weights(policy.model), count, base


def _checkpoint_published(checkpoint: str, version: int) -> tuple[int, dict[str, torch.Tensor]]:
    """(version, weights) of a published version that ``checkpoint``'s training state keeps."""
    return version, load_training_state(checkpoint, mmap=True)["published"][version]


def load_start_weights(model_cfg: ModelConfig, tokenizer_dir: str | Path | None, checkpoint: Path, lora_seed: int,
                       reference: Path | None = None) -> tuple[ray.ObjectRef, ...]:
    """:func:`_start_weights` as a task: (tokenizer, weights, reference summary, reference weights) references."""
    task: Any = ray.remote(num_cpus=0, num_returns=4)(_start_weights)
    return task.remote(model_cfg, tokenizer_dir, str(checkpoint), lora_seed,
                       None if reference is None else str(reference))


def load_published_weights(checkpoint: Path, version: int) -> tuple[ray.ObjectRef, ray.ObjectRef]:
    """:func:`_checkpoint_published` as a task: (summary, weights) references."""
    task: Any = ray.remote(num_cpus=0, num_returns=2)(_checkpoint_published)
    return task.remote(str(checkpoint), version)


class WorkerPool:
    """Rollout or reward actors, restarted by Ray when they die. Which worker gets a task, and the cooldown
    of a failed one, are the scheduler's (``state``, a :class:`rlt2t.scheduler.PoolState`)."""

    def __init__(self, cls: type, n: int, *, num_cpus: float, num_gpus: float, max_restarts: int, args: tuple,
                 kwargs: dict, resources: dict[str, float] | None = None,
                 per_actor_args: Sequence[tuple] | None = None, what: str = "", results: type | None = None):
        # ``results``: a mixin (rlt2t.by_reference: RolloutsByReference, RewardsByReference) whose methods leave
        # the role's results in the object store.
        launched = with_results(cls, results)
        # Actor handles are Any here, as LearnerGroup.ranks: Ray types them as the handle or the class itself.
        remote: Any = ray.remote(launched).options(num_cpus=num_cpus, num_gpus=num_gpus,
                                                   resources=dict(resources or {}), max_restarts=max_restarts,
                                                   max_task_retries=0)
        own = list(per_actor_args) if per_actor_args is not None else [()] * n
        if len(own) != n:
            raise ValueError(f"per_actor_args: {len(own)} entries for {n} workers")
        self.cls = cls
        self.what = what or cls.__name__
        self.actors: list[Any] = [remote.remote(*extra, *args, **kwargs) for extra in own]
        # Ray restarts an actor with its constructor's arguments: an ObjectRef among them (the run's start weights)
        # must stay referenced here, or a restart after the driver dropped it fails with "object already deleted".
        self._constructor_args = (own, args, kwargs)
        self.state = PoolState(n)

    def wait_started(self, timeout_s: float) -> None:
        """Fail the job, naming the settings, when a worker cannot be placed (or fails to start) in time."""
        refs = [a.pid.remote() for a in self.actors]
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            raise ClusterTooSmall(unschedulable(self.what, timeout_s))
        ray.get(done)  # a constructor that raised fails the job here, with its own message

    def shutdown(self) -> None:
        """Let workers release what they hold (``close``, best effort: ``ray.kill`` skips finalizers)."""
        if hasattr(self.cls, "close"):
            with contextlib.suppress(Exception):
                ray.wait([a.close.remote() for a in self.actors], num_returns=len(self.actors), timeout=30)
        for a in self.actors:
            ray.kill(a)
