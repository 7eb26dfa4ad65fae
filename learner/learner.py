"""One rank of the RL learner group: the policy under DDP (or sharded, rl.strategy=fsdp:
``rlt2t.learner.sharding``), stepping on its shard of each batch with the algorithm's objective
(``rlt2t.learner.objectives``: rank RL or a policy gradient).

A plain class: the job wraps it with ``ray.remote`` and places N of them through a placement group;
``world_size = 1`` runs the same code without a process group. The ranks rendezvous over TCP on an
address rank 0 picks (no launcher, no shared filesystem), then accelerate takes over device placement,
DDP wrapping (gloo on CPU, nccl on GPU) and mixed precision (bf16/fp16 autocast and loss scaling, on
CUDA only: CPU runs stay float32 and bitwise reproducible). Logged scalars and the validation metric
are reduced across ranks here.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import logging
import math
import os
import resource
import socket
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType

from rlt2t.common.checkpoint import (
    checkpoint_name,
    load_training_state,
    prune_checkpoints,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from rlt2t.common.config import MetricConfig, ModelConfig, RLConfig, RolloutConfig
from rlt2t.common.data import Example
from rlt2t.common.errors import UnitError
from rlt2t.common.families import check_mixed_precision
from rlt2t.common.lora import (
    adapter_state_dict,
    apply_lora,
    is_lora,
    load_weights,
    policy_weights,
)
from rlt2t.common.policy import Policy, load_policy
from rlt2t.common.types import ScoredGroup, ScoredPair
from rlt2t.learner import sharding
from rlt2t.learner.evaluate import TABLE_METRICS, distinct_outputs, generate, metric_table
from rlt2t.learner.objectives import (
    MAXED_METRICS,
    SUMMED_METRICS,
    PolicyGradientObjective,
    StepRunner,
    build_objective,
    unit_fault,
)
from rlt2t.learner.schedule import linear_warmup_decay
from rlt2t.learner.trainer import load_scaler_state, scaler_state

log = logging.getLogger("rlt2t.learner")


def free_address() -> tuple[str, int]:
    """This node's address and a free TCP port for the process-group rendezvous."""
    try:
        import ray

        host = ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (unit tests): loopback
        host = "127.0.0.1"
    with socket.socket() as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


class Objective(Protocol):
    """What a learner rank calls of its algorithm's objective (rlt2t.learner.objectives). Items and batches are
    the objective's own kinds (rank RL: ScoredPair, RankBatch; policy gradients: ScoredGroup, GroupBatch): the
    driver hands each learner what the rollouts of the same algorithm produced."""

    module: torch.nn.Module

    @property
    def metric_keys(self) -> tuple[str, ...]: ...

    def collate(self, items: Any, *, max_source_len: int, max_target_len: int) -> Any: ...

    def preflight_batch(self, sources: int, source_len: int, target_len: int, generator: torch.Generator) -> Any: ...

    def preflight(self, run: StepRunner, batch: Any) -> None: ...

    def step(self, run: StepRunner, batch: Any, items: Any, step: int) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def frozen_modules(self) -> list[torch.nn.Module]:
        """Models the objective runs besides ``module`` (the reference, NLPO's masking policy), never trained,
        each entered through its own forward: the learner moves them to its device with ``module``, or shards
        them as it shards ``module`` (rl.strategy=fsdp)."""
        ...


def published_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """:func:`rlt2t.common.lora.policy_weights` without its copy on CPU: views of the live parameters, for a
    value that is serialised before the parameters change again (an actor method's return value: Ray copies it
    into the object store as the call returns, before the actor runs its next call). On CUDA a CPU copy."""
    if is_lora(model):
        return policy_weights(model)  # the adapters alone: small
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


class BatchTooLarge(RuntimeError):
    """The largest batch a learner rank can receive does not fit in its memory (found by the preflight)."""


def _runs_unit_code(method: Callable[..., Any]) -> Callable[..., Any]:
    """A Learner call that runs the algorithm unit's objective: an error raised in a unit's own code becomes the
    UnitError that names it (:func:`~rlt2t.learner.objectives.unit_fault`), and a unit's error while the rank
    was built is raised by each such call (Ray hands the driver no exception of an actor's constructor, only
    that it died: a failed rank to resume)."""

    @functools.wraps(method)
    def call(self: Learner, *args: Any, **kwargs: Any) -> Any:
        if self.unit_error is not None:
            raise self.unit_error
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            fault = unit_fault(self.cfg.unit, e)
            if fault is None:
                raise
            raise fault from e

    return call


class Learner:
    """One learner rank. ``steps`` counts learner steps (batches), the policy version its weights are."""

    def __init__(self, model_cfg: ModelConfig, tokenizer_dir: str | None, rl_cfg: RLConfig,
                 rollout_cfg: RolloutConfig | None = None, *, init_checkpoint: str, rank: int, world_size: int,
                 total_steps: int, seed: int, max_source_len: int, max_target_len: int, threads: int = 0,
                 mixed_precision: str = "no", reference_checkpoint: str | None = None):
        self.cfg, self.rank, self.world_size = rl_cfg, rank, world_size
        self.sharded = rl_cfg.strategy == "fsdp"
        self.total_steps = total_steps
        rollout_cfg = rollout_cfg or RolloutConfig()
        self.max_source_len, self.max_target_len = max_source_len, max_target_len
        if threads:
            torch.set_num_threads(threads)
            # accelerate resets the thread count on multi-CPU runs unless OMP_NUM_THREADS says otherwise.
            os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        self.use_cuda = bool(rl_cfg.learner_gpus) and torch.cuda.is_available()
        if rl_cfg.learner_gpus and not self.use_cuda:
            log.warning("rl.learner_gpus=%s but CUDA is not available here: learner rank %d runs on CPU",
                        rl_cfg.learner_gpus, rank)
        # Mixed precision applies on CUDA only (CPU runs stay float32 and deterministic).
        self.mixed_precision = mixed_precision if self.use_cuda else "no"
        self.policy: Policy = load_policy(model_cfg, tokenizer_dir, checkpoint=init_checkpoint, trainable_adapters=True)
        if model_cfg.lora.enabled and not is_lora(self.policy.model):
            # The same seed on every rank and in the driver: the same initial adapters everywhere.
            self.policy.model = apply_lora(self.policy.model, model_cfg.lora, seed=seed)
        # The reference for the KL is scored by the rollout workers; the learner holds a copy only when its
        # samples come from policy servers, which do not score it (docs/design.md, "Reference policy").
        reference = None
        # So does an algorithm whose unit scores the reference in the learner (offline preferences: no rollouts).
        learner_scores = (rl_cfg.uses_kl and rollout_cfg.source == "http") or rl_cfg.unit.learner_reference
        if learner_scores and not is_lora(self.policy.model):
            reference = load_policy(model_cfg, tokenizer_dir, checkpoint=reference_checkpoint or init_checkpoint)
            reference.model.eval().requires_grad_(False)
        check_mixed_precision(self.policy.model.config, mixed_precision)  # T5 in fp16 overflows: refused at start
        self.unit_error: UnitError | None = None  # raised by each call that runs the unit (_runs_unit_code)
        try:
            self.objective: Objective = build_objective(rl_cfg, rollout_cfg, self.policy, seed=seed,
                                                        reference=reference.model if reference else None)
        except Exception as e:
            self.unit_error = unit_fault(rl_cfg.unit, e)
            if self.unit_error is None:
                raise
            self.unit_error.__cause__ = e
            return
        self.module: torch.nn.Module = self.objective.module
        # Parameters outside the policy (PPO's value head): whole on every rank when the policy is sharded.
        self._replicated: list[torch.nn.Parameter] = []
        if self.sharded:
            for module in (self.module, *self.objective.frozen_modules()):
                if hasattr(module, "share_cross_attention"):  # a layer's weights are whole only in its forward
                    module.share_cross_attention = False
            inside = set(map(id, self.policy.model.parameters()))
            self._replicated = [p for p in self.module.parameters() if id(p) not in inside]
        self._build_optimizer()
        self.accelerator: Accelerator | None = None
        # Dropout (rank RL) differs per rank but is reproducible: the RNG is part of every checkpoint.
        torch.manual_seed(seed * 7919 + rank)
        self.steps = 0

    def _build_optimizer(self) -> None:
        """AdamW on what trains (with LoRA the adapters: the frozen base has no gradient and no optimizer state)
        and the schedule; built again once the parameters are sharded (they are new tensors then)."""
        self.optimizer = torch.optim.AdamW([p for p in self.module.parameters() if p.requires_grad], lr=self.cfg.lr,
                                           weight_decay=self.cfg.weight_decay)
        # Not handed to accelerate: its wrapper steps a scheduler once per process, ours counts learner steps.
        self.scheduler = linear_warmup_decay(
            self.optimizer, warmup_steps=round(self.cfg.warmup_ratio * self.total_steps),
            total_steps=max(1, self.total_steps), min_lr_ratio=self.cfg.min_lr_ratio)

    @property
    def device(self) -> torch.device:
        return self._prepare().device

    def _prepare(self) -> Accelerator:
        """Hand the model and optimizer to accelerate (after the process group exists, when there is one)."""
        if self.accelerator is None:
            if self.world_size > 1:
                # Each Ray actor sees only its own GPU (CUDA_VISIBLE_DEVICES), so its local rank is 0.
                os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
                                  LOCAL_WORLD_SIZE="1")
            if self.sharded:
                return self._prepare_sharded()
            acc = Accelerator(cpu=not self.use_cuda, mixed_precision=self.mixed_precision)
            if self.world_size > 1 and acc.num_processes != self.world_size:
                raise RuntimeError(f"accelerate sees {acc.num_processes} processes, the learner group has "
                                   f"{self.world_size} ({acc.distributed_type})")
            self.module, self.optimizer = acc.prepare(self.module, self.optimizer)
            for frozen in self.objective.frozen_modules():
                frozen.to(acc.device)
            self.accelerator = acc
        return self.accelerator

    def _prepare_sharded(self) -> Accelerator:
        """rl.strategy=fsdp: accelerate places nothing (FSDP2 shards, moves and casts); it only names the device."""
        if not dist.is_initialized():
            raise RuntimeError("rl.strategy=fsdp: the learner ranks shard over a process group; join() first")
        acc = Accelerator(cpu=not self.use_cuda, mixed_precision="no")
        sharding.shard(self.module, self.policy.model, self.cfg.fsdp, device=acc.device,
                       mixed_precision=self.mixed_precision, replicated=self._replicated)
        for frozen in self.objective.frozen_modules():  # the reference: sharded alike, never trained
            sharding.shard(frozen, frozen, self.cfg.fsdp.model_copy(update={"activation_checkpointing": False}),
                           device=acc.device, mixed_precision=self.mixed_precision)
        for param in self._replicated:
            param.data = param.data.to(acc.device)
        self._build_optimizer()  # over the shards (the steps taken so far: none, _prepare runs before any)
        self.accelerator = acc
        return acc

    # --- process group ----------------------------------------------------------------------------------
    def rendezvous_address(self) -> tuple[str, int]:
        return free_address()

    @_runs_unit_code
    def join(self, rendezvous: tuple[str, int]) -> None:
        """Form the DDP world at rank 0's ``rendezvous_address()`` (call on every rank concurrently)."""
        address, port = rendezvous
        if self.world_size > 1 or self.sharded:  # FSDP shards over a process group, also of one rank
            # Our own rendezvous (rank 0's node, a free port): accelerate then finds the group initialised.
            backend = "nccl" if self.use_cuda else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=self.rank,
                                    world_size=self.world_size, timeout=datetime.timedelta(minutes=10))
            os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port))  # what accelerate expects to find
        acc = self._prepare()
        kind = ("FSDP" if self.sharded else acc.distributed_type.value if acc.distributed_type != DistributedType.NO
                else "single process")
        log.info("learner rank %d/%d ready: %s on %s, mixed precision %s", self.rank, self.world_size, kind,
                 acc.device, self.mixed_precision)

    # --- preflight ---------------------------------------------------------------------------------------------
    def largest_batch_shape(self) -> tuple[int, int, int]:
        """(sources, source tokens, target tokens) of the largest shard this rank can be handed."""
        return math.ceil(self.cfg.batch_size / self.world_size), self.max_source_len, self.max_target_len

    @_runs_unit_code
    def preflight(self) -> dict[str, float]:
        """One forward and backward pass on the largest batch this rank can receive, before any training.

        The learner's memory need is known before the first rollout: ceil(rl.batch_size / rl.learners)
        sources (rank RL: gold, a and b; policy gradients: K samples each), sources of data.max_source_len
        tokens, labels of data.max_target_len. Running that batch first makes an out-of-memory error fail the
        job at setup, with a message naming those settings, instead of after the first rollouts; it also warms
        what a fresh process pays for on its first step (the allocator's memory, the kernels, the DDP buckets
        and all-reduce) while the rollout workers start. Training is unchanged: no optimizer step, the
        gradients are dropped and every RNG is restored.
        """
        t0 = time.perf_counter()
        acc = self._prepare()
        sources, src_len, tgt_len = self.largest_batch_shape()
        gen = torch.Generator().manual_seed(0)  # the batch's content is irrelevant; the global RNGs stay untouched
        batch = self.objective.preflight_batch(sources, src_len, tgt_len, gen).to(acc.device)
        rng = rng_state()
        if self.use_cuda:
            torch.cuda.reset_peak_memory_stats(acc.device)
        try:
            self.objective.preflight(self, batch)  # unscaled under fp16: these gradients are dropped
        except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
            if not (isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(e)):
                raise
            raise BatchTooLarge(
                f"learner rank {self.rank}: the largest batch it can receive does not fit in memory on {acc.device}: "
                f"{sources} sources (rl.batch_size={self.cfg.batch_size} over rl.learners={self.world_size}), "
                f"sources of data.max_source_len={src_len} tokens, targets of data.max_target_len={tgt_len}"
                + (", rollout.num_samples samples per source" if self.cfg.samples_groups else "")
                + ". Lower one of them, or add learner ranks. "
                f"({type(e).__name__}: {e})") from e
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            set_rng_state(rng)
        if self.use_cuda:
            peak_gib = torch.cuda.max_memory_allocated(acc.device) / 2**30
        else:  # the process's peak resident set (Linux reports KiB)
            peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        return {"seconds": time.perf_counter() - t0, "sources": sources, "source_tokens": src_len,
                "target_tokens": tgt_len, "peak_memory_gib": peak_gib}

    # --- training ------------------------------------------------------------------------------------------
    @_runs_unit_code
    def train_step(self, items: Sequence[ScoredPair] | Sequence[ScoredGroup], mask_versions: Sequence[int] = (),
                   *mask_weights: dict[str, torch.Tensor]) -> dict[str, float]:
        """One learner step on this rank's shard (the objective may take several optimizer steps); returns
        scalars averaged over ranks (``step_s``: the seconds this step computed, excluding the metrics
        all-reduce and the wait for the call). NLPO: ``mask_versions`` and ``mask_weights`` (one per version,
        top-level arguments so that Ray resolves them) are the masking policies of the shard's groups that this
        rank does not hold (``rlt2t.groups.LearnerGroup`` keeps track)."""
        t0 = time.perf_counter()
        acc = self._prepare()
        if mask_versions:
            if not isinstance(self.objective, PolicyGradientObjective) or len(mask_weights) != len(mask_versions):
                raise ValueError(f"masking-policy versions {list(mask_versions)} with {len(mask_weights)} weights "
                                 f"for a {type(self.objective).__name__}")
            self.objective.receive_masks(dict(zip(mask_versions, mask_weights, strict=True)))
        batch = self.objective.collate(items, max_source_len=self.max_source_len,
                                       max_target_len=self.max_target_len).to(acc.device)
        metrics = self.objective.step(self, batch, items, self.steps)
        with warnings.catch_warnings():  # an objective that moves the weights itself (TRPO) never steps the optimizer
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step()
        self.steps += 1
        keys = (*self.objective.metric_keys, "step_s")
        local = torch.tensor([metrics.get(k, 0.0) for k in keys[:-1]] + [time.perf_counter() - t0],
                             dtype=torch.float64)
        total = self.all_sum(local)
        out = {k: float(v) for k, v in zip(keys, (total / self.world_size).tolist(), strict=True)}
        out |= {k: float(total[keys.index(k)]) for k in SUMMED_METRICS if k in keys}  # counts: over all ranks
        maxed = [k for k in MAXED_METRICS if k in keys]  # the largest deviation of any rank, not their mean
        if maxed:
            out |= dict(zip(maxed, self.all_max(local[[keys.index(k) for k in maxed]]).tolist(), strict=True))
        return out | {"lr": float(self.scheduler.get_last_lr()[0])}

    def train_step_stored(self, picks: Sequence[tuple[int, int]], mask_versions: Sequence[int],
                          *parts: Any) -> dict[str, float]:
        """:meth:`train_step` on items picked out of whole scored chunks, which reach this rank from the object
        store, not through the driver. ``parts``: the scored chunks (lists of items; top-level arguments, so
        that Ray resolves their references here), then one weights dict per entry of ``mask_versions`` (NLPO);
        ``picks``: the shard's items in order, as (position of its chunk in ``parts``, index in the chunk)."""
        chunks = parts[: len(parts) - len(mask_versions)]
        items = [chunks[c][i] for c, i in picks]
        return self.train_step(items, mask_versions, *parts[len(chunks):])

    # --- what an objective's step calls (StepRunner) ------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)  # prepare() wrapped it in DDP and autocast (or sharded it)

    def optimize(self, loss: torch.Tensor) -> float:
        acc = self._prepare()
        if self.sharded:
            loss.backward()  # FSDP reduce-scatters the shards' gradients (averaged over the ranks, as DDP)
            if self.world_size > 1:
                sharding.average_replicated_grads(self._replicated)
            grad_norm = sharding.clip_grad_norm(self.module.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return grad_norm
        acc.backward(loss)  # scales the loss for fp16
        grad_norm = acc.clip_grad_norm_(self.module.parameters(), self.cfg.grad_clip)  # unscales first
        self.optimizer.step()  # skipped by accelerate's wrapper on an fp16 overflow
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def autocast(self) -> AbstractContextManager:
        """The mixed precision (if any) that ``forward`` runs under, for passes outside the prepared module."""
        if self.sharded:  # FSDP casts the parameters itself; no pass runs outside the sharded module
            return contextlib.nullcontext()
        return self._prepare().autocast()

    def all_min(self, value: int) -> int:
        """The smallest of each rank's ``value`` (itself with one rank)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self._prepare().device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks of a small float64 vector (itself with one rank)."""
        if self.world_size > 1:
            values = values.to(self._prepare().device)
            dist.all_reduce(values)
            values = values.cpu()
        return values

    def all_max(self, values: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum over the ranks of a small float64 vector (itself with one rank)."""
        if self.world_size > 1:
            values = values.to(self._prepare().device)
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
            values = values.cpu()
        return values

    # --- state --------------------------------------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        """What gets published and checkpointed: the policy's CPU state dict (with LoRA: the adapters alone).
        Sharded: gathered from every rank (a collective all ranks call; rank 0 gets them, the others {})."""
        if self.sharded:
            gathered = self._gathered()
            return adapter_state_dict(self.policy.model, gathered) if is_lora(self.policy.model) and gathered \
                else gathered
        return policy_weights(self.policy.model)

    def _gathered(self) -> dict[str, torch.Tensor]:
        """Sharded: the whole policy (LoRA: its adapters, under peft's parameter names) gathered on rank 0, a
        collective; what a checkpoint's ``save_pretrained`` takes."""
        self._prepare()
        if is_lora(self.policy.model):
            return sharding.full_trainable_state(self.policy.model)
        return sharding.full_state(self.module, self.policy.model)

    def publish_weights(self) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
        """What the job publishes, as two results (the job calls it with ``num_returns=2``): a small summary
        (``step``: the learner step, hence the policy version, these weights are; ``bytes``) and the weights.
        Ray stores the weights in this node's object store, owned by the caller: the driver waits on the
        summary alone (a failed rank shows there) and hands the weights' reference on without fetching them;
        the object outlives this process, should it die. Sharded: every rank calls it (the gather is a
        collective); the others return no weights."""
        weights = self.weights() if self.sharded else published_weights(self.policy.model)
        if self.sharded and self.mixed_precision == "bf16":  # what the sharded learner computes with: half the bytes
            weights = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()}
        return {"step": self.steps, "bytes": sum(t.numel() * t.element_size() for t in weights.values())}, weights

    @_runs_unit_code
    def training_state(self) -> dict[str, Any]:
        """A snapshot (deep copy: optimizer.state_dict() aliases the live moment tensors)."""
        return copy.deepcopy(self._training_state())

    def _training_state(self) -> dict[str, Any]:
        """The state itself, aliasing live tensors: to serialise at once. Sharded: this rank's optimizer shards
        as plain tensors."""
        acc = self._prepare()
        optimizer = self.optimizer.state_dict()
        if self.sharded:
            optimizer = sharding.local_optimizer_state(optimizer)
        return {"optimizer": optimizer, "scheduler": self.scheduler.state_dict(),
                "rng": rng_state(), "steps": self.steps, "objective": self.objective.state_dict(),
                **scaler_state(acc)}

    @_runs_unit_code
    def write_checkpoint(self, root: str, name: str, step: int, meta: dict[str, Any], trained_in_epoch: list[str],
                         published_versions: Sequence[int], *states_and_weights: Any) -> str:
        """Rank 0: the job's checkpoint ``root/name``, written here from this rank's own model (no copy of it
        anywhere else); returns its path. ``states_and_weights`` are the training states of ranks 1..N-1, then
        the weights of each of ``published_versions`` (top-level arguments: Ray resolves their references here,
        from the object store). The training state is the one a resumed job reads (``load_training_state_from``
        and the driver): every rank's state, the published weights, the epoch's trained ids. Sharded: the
        weights are gathered here, a collective the other ranks join by calling :meth:`weights` after handing
        over their states (``LearnerGroup.write_checkpoint``)."""
        peers = self.world_size - 1
        if len(states_and_weights) != peers + len(published_versions):
            raise ValueError(f"rank 0 of {self.world_size} got {len(states_and_weights)} states and weights for "
                             f"{len(published_versions)} published versions")
        states = [self._training_state(), *states_and_weights[:peers]]
        published = dict(zip(published_versions, states_and_weights[peers:], strict=True))
        model = sharding.Consolidated(self.policy.model, self._gathered()) if self.sharded else self.policy.model
        path = save_checkpoint(root, name, model=model, tokenizer=self.policy.tokenizer, step=step,
                               meta=meta, training_state={"learners": states, "published": published,
                                                          "trained_in_epoch": list(trained_in_epoch)})
        return str(path)

    def write_published(self, root: str, version: int, meta: Mapping[str, Any],
                        weights: Callable[[], dict[str, torch.Tensor]]) -> None:
        """Rank 0, for policy servers (rollout.source=http): ``version``'s weights as a checkpoint under
        ``root`` (the newest two kept). This rank's own model when it is at that version; otherwise (a version a
        resumed job restored) a copy of it loaded with ``weights()``, which fetches them only then."""
        model: Any = self.policy.model
        if self.sharded:  # the peers join the gather (LearnerGroup.write_published), whichever version this is
            gathered = self._gathered()
            if version != self.steps:
                gathered = weights()  # LoRA: peft's saved adapter names, which its save_pretrained also takes
            model = sharding.Consolidated(self.policy.model, gathered)
        elif version != self.steps:
            model = copy.deepcopy(model)
            load_weights(model, weights())
        save_checkpoint(root, checkpoint_name(step=version), model=model, tokenizer=self.policy.tokenizer,
                        step=version, meta=dict(meta))
        prune_checkpoints(root, keep_last=2)

    @_runs_unit_code
    def load_training_state_from(self, checkpoint: str) -> None:
        """This rank's state out of a checkpoint's training state, read here (memory-mapped: the other ranks'
        states and the published weights in the same file are not read), not shipped through the driver."""
        states = load_training_state(Path(checkpoint), mmap=True)["learners"]
        if len(states) != self.world_size:
            raise ValueError(f"{checkpoint} has {len(states)} learner states, the job has {self.world_size} ranks "
                             "(rl.learners must match to resume exactly)")
        self.load_training_state(copy.deepcopy(states[self.rank]))  # a copy in memory, not pages of the file

    @_runs_unit_code
    def load_training_state(self, state: dict[str, Any]) -> None:
        acc = self._prepare()
        self.optimizer.load_state_dict(state["optimizer"])
        if self.sharded:
            sharding.reshard_optimizer_state(self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        load_scaler_state(acc, state)
        set_rng_state(state["rng"])
        self.steps = state["steps"]
        self.objective.load_state_dict(state.get("objective", {}))

    # --- evaluation -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, examples: Sequence[Example], metric: MetricConfig, max_new_tokens: int,
                 names: Sequence[str] = TABLE_METRICS) -> tuple[dict[str, float], list[str]]:
        """Greedy-decode this rank's shard of ``examples``; the metric table of all ranks' outputs, and the outputs
        in the order of ``examples`` (the job scores its monitor on them: a reward or a metric of the user's is
        known in the job's process)."""
        shard = list(range(self.rank, len(examples), self.world_size))
        whole = (sharding.gathered(self.module, self.cfg.fsdp.reshard_after_forward) if self.sharded
                 else contextlib.nullcontext())  # generate's passes differ between ranks: no collective inside
        if self.sharded:
            self._prepare()
        with whole:
            hyps = generate(self.policy, [examples[i].source for i in shard], max_new_tokens=max_new_tokens,
                            max_source_len=self.max_source_len)
        pieces: list[Any] = [list(zip(shard, hyps, strict=True))]
        if self.world_size > 1:
            pieces = [None] * self.world_size
            dist.all_gather_object(pieces, list(zip(shard, hyps, strict=True)))
        ordered = sorted((i, h) for piece in pieces for i, h in piece)
        all_hyps = [h for _, h in ordered]
        refs = [list(examples[i].refs) for i, _ in ordered]
        # Unlabeled rows (RL on sources alone, monitored by a reward that reads no references): no metric table.
        table = metric_table(all_hyps, refs, metric, names) if all(refs) else {}
        table["distinct_outputs"] = distinct_outputs([examples[i].source for i, _ in ordered], all_hyps)
        return table, all_hyps

    def shutdown(self) -> None:
        if (self.world_size > 1 or self.sharded) and dist.is_initialized():  # joined one (join)
            dist.destroy_process_group()
