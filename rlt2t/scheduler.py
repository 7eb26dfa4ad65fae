"""The RL job's scheduling decisions, with no Ray in them: which chunk goes to which worker, when a failed
chunk is retried, in which order scored chunks reach the learner, when a learner step may be queued, and
each batch's staleness. ``rlt2t.driver`` runs the loop around it (Ray calls in, results back); the unit tests
drive it with fake results (tests/unit/test_scheduler.py).

* Every chunk of sources has a fixed *policy version* (the learner step whose weights sample it):
  :func:`needed_version`. Sampling seeds derive from (seed, version, example id) and, in deterministic
  mode, chunks are consumed in dataset order through a reorder buffer, so which worker did what, and how
  fast, never changes the result.
* A chunk whose task failed (its worker died, or the task raised) is re-dispatched after its worker's
  cooldown; a restarting worker's refusals do not count against ``rl.max_restarts``, up to a bound. Results
  are keyed by chunk index: none is lost, none is used twice (checked).
* At most two learner steps are queued (one running, one waiting), never past a step after which the
  driver must act on the learner (publish weights, checkpoint, stop).
* Published weights are kept only from the oldest version a chunk, or a run resumed from the current step,
  may still need (:meth:`EpochScheduler.oldest_needed_version`): the object store and each checkpoint hold a
  few versions, not one per learner step of the epoch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rlt2t.common.data import Example

TaskKind = Literal["rollout", "reward"]


def needed_version(global_step: int, epoch_start: int, refresh: int) -> int:
    """The learner step whose weights sample the items consumed at ``global_step``.

    ``refresh == 0``: the epoch's first step (the previous epoch's model). Otherwise the refresh point one
    interval behind: staleness is between ``refresh`` and ``2·refresh - 1`` steps, so rollouts can run a
    whole interval ahead of the learner.
    """
    if refresh == 0:
        return epoch_start
    return max(0, (global_step // refresh - 1) * refresh)


def mask_version(version: int, every: int) -> int:
    """NLPO: the masking policy's version for a chunk sampled by ``version`` (the mask refreshes every ``every``
    learner steps)."""
    return (version // every) * every


class ChunkFailed(RuntimeError):
    """A chunk failed more often than the job allows."""


@dataclass
class Chunk:
    index: int
    examples: list[Example]
    version: int
    """Policy version that samples it."""
    mask_version: int | None = None
    """NLPO: version of the masking policy it samples with."""
    attempts: int = 0
    """Failures of a task on it (worker death, an error in the task)."""
    unavailable: int = 0
    """Times it was refused because its worker was restarting (retried after the worker's cooldown)."""

    def versions(self) -> tuple[int, ...]:
        return (self.version,) if self.mask_version is None else (self.version, self.mask_version)


class PoolState:
    """Counters of one pool of workers: tasks in flight, and a cooldown after failures.

    A worker whose task failed cools down (0.5 s, doubling per consecutive failure, at most 10 s): Ray is
    restarting it, and a task sent meanwhile would fail at once (``ActorUnavailableError``).
    """

    MAX_COOLDOWN_S = 10.0

    def __init__(self, size: int, clock: Callable[[], float] = time.monotonic) -> None:
        if size < 1:
            raise ValueError(f"a pool needs at least one worker, got {size}")
        self.clock = clock
        self.busy = [0] * size
        self.cooldown_until = [0.0] * size
        self.failures = [0] * size  # consecutive

    def pick(self) -> int:
        """The least busy worker not cooling down (the one back soonest when all are)."""
        now = self.clock()
        healthy = [i for i in range(len(self.busy)) if self.cooldown_until[i] <= now]
        if not healthy:
            return min(range(len(self.busy)), key=lambda i: self.cooldown_until[i])
        return min(healthy, key=lambda i: self.busy[i])

    def next_available(self) -> float:
        """Clock time at which some worker is out of cooldown (<= now when one already is)."""
        return min(self.cooldown_until)

    def started(self, i: int) -> None:
        self.busy[i] += 1

    def finished(self, i: int, ok: bool) -> None:
        self.busy[i] -= 1
        if ok:
            self.failures[i] = 0
        else:
            self.failures[i] += 1
            delay = min(0.5 * 2 ** (self.failures[i] - 1), self.MAX_COOLDOWN_S)
            self.cooldown_until[i] = max(self.cooldown_until[i], self.clock() + delay)


@dataclass(frozen=True)
class StoredItem:
    """One scored item left in the object store, as the scheduler sees it: what it reads of the item (its example,
    the policy versions that sampled it) and where a learner rank finds it (item ``index`` of the scored result of
    chunk ``chunk``). The driver builds these from the reward workers' small summaries and never fetches the
    items themselves."""

    chunk: int
    index: int
    example_id: str
    policy_version: int
    mask_version: int | None = None


@dataclass(frozen=True)
class Dispatch:
    """Send ``chunk`` to worker ``worker`` of the rollout (or reward) pool."""

    chunk: Chunk
    worker: int


@dataclass(frozen=True)
class LearnerBatch:
    """One learner step's items, in order, and the step (policy version) it will train at."""

    items: list[Any]
    step: int
    size: int
    """Distinct items (sources) in it; ``items`` may repeat some so every learner rank gets one."""
    staleness_mean: float
    staleness_max: int


@dataclass
class EpochStats:
    redispatched: int = 0
    out_of_order: int = 0
    """Chunks handed to the learner ahead of an earlier one (only when deterministic mode is off)."""
    items_used: int = 0


@dataclass
class EpochScheduler:
    """Decisions for one epoch's chunks; see the module doc. ``step`` is the learner step the epoch starts
    at and advances with :meth:`step_done`."""

    chunks: Sequence[Chunk]
    step: int
    batch_size: int
    learners: int
    max_inflight_chunks: int
    ordered: bool
    rollouts: PoolState
    rewards: PoolState
    max_attempts: int
    """Failures of a task on one chunk before the job fails (rl.max_restarts + 1)."""
    refresh_every_steps: int = 0
    save_every_steps: int = 0
    stop_after_steps: int = 0
    epoch_start: int = 0
    mask_every: int = 0
    """NLPO's mask refresh period (0: no masking policy)."""
    max_unavailable: int = 30
    clock: Callable[[], float] = time.monotonic
    stats: EpochStats = field(default_factory=EpochStats)
    trained_ids: list[str] = field(default_factory=list)
    """Example ids of this epoch that finished learner steps trained on (those of a resumed run's checkpoint
    first), in step order: what a run resumed mid-epoch must not train on again. Without deterministic mode
    they are not a prefix of the epoch's order (chunks reach the learner as they come)."""

    def __post_init__(self) -> None:
        self.next_submit = 0
        self.next_consume = 0  # chunks consumed (a count: out of order, not the next index)
        self._first_unconsumed = 0  # the lowest chunk index not consumed yet
        self.ready: dict[int, list[Any]] = {}  # reorder buffer: chunk index -> scored items
        self.consumed: set[int] = set()
        self.retries: list[tuple[float, int]] = []  # (clock time, chunk index)
        self.queue: list[Any] = []  # scored items in consumption order, not yet in a learner batch
        self.steps_queued = 0  # learner steps handed out and not yet done
        self._queued_ids: deque[list[str]] = deque()  # the example ids of each queued step, oldest first

    # -- rollouts and rewards ----------------------------------------------------------------------------------

    def rollout_dispatches(self, published: Container[int]) -> list[Dispatch]:
        """Retries whose wait is over (first: the learner needs them first), then new chunks within the
        in-flight bound whose weights are published. Each is counted as started on its worker."""
        out = []
        now = self.clock()
        for due in sorted(x for x in self.retries if x[0] <= now):
            self.retries.remove(due)
            out.append(self._start(self.rollouts, self.chunks[due[1]]))
        while (self.next_submit < len(self.chunks) and self.next_submit - self.next_consume < self.max_inflight_chunks
               and all(v in published for v in self.chunks[self.next_submit].versions())):
            out.append(self._start(self.rollouts, self.chunks[self.next_submit]))
            self.next_submit += 1
        return out

    def _start(self, pool: PoolState, chunk: Chunk) -> Dispatch:
        worker = pool.pick()
        pool.started(worker)
        return Dispatch(chunk, worker)

    def rollout_done(self, chunk_index: int, worker: int) -> Dispatch:
        """A rollout finished: its candidates go to the least busy reward worker."""
        self.rollouts.finished(worker, ok=True)
        return self._start(self.rewards, self.chunks[chunk_index])

    def reward_done(self, chunk_index: int, worker: int, items: list[Any]) -> None:
        """A chunk is scored: into the reorder buffer."""
        self.rewards.finished(worker, ok=True)
        if chunk_index in self.consumed or chunk_index in self.ready:
            # An invariant, checked because a re-dispatch bug would silently reuse items.
            raise RuntimeError(f"chunk {chunk_index} delivered twice")
        self.ready[chunk_index] = items

    def task_failed(self, kind: TaskKind, chunk_index: int, worker: int, *, unavailable: bool, error: str) -> float:
        """A task failed; the chunk is re-dispatched (from its rollout) once a worker is out of cooldown.
        Returns the clock time of the retry. ``unavailable``: the worker was restarting and refused the task
        (not the chunk's fault, counted apart). Raises :class:`ChunkFailed` past the bounds."""
        pool = self.rollouts if kind == "rollout" else self.rewards
        pool.finished(worker, ok=False)
        chunk = self.chunks[chunk_index]
        self.stats.redispatched += 1
        if unavailable:
            chunk.unavailable += 1
            exhausted = chunk.unavailable > self.max_unavailable
        else:
            chunk.attempts += 1
            exhausted = chunk.attempts >= self.max_attempts
        if exhausted:
            raise ChunkFailed(f"chunk {chunk_index} failed {chunk.attempts} times and was refused {chunk.unavailable} "
                              f"times by restarting workers; last error: {error}")
        if not self.ordered:
            # Unordered, the learner trains on other chunks meanwhile: the chunk is sampled again anyway, so with
            # the weights the learner's position needs now, not the version planned for it (a worker that died
            # three times would otherwise hand the learner samples many steps stale). Ordered mode keeps the
            # planned version: its seeds, hence the run's result, depend on it.
            chunk.version = max(chunk.version, needed_version(self.step, self.epoch_start, self.refresh_every_steps))
            if chunk.mask_version is not None:
                chunk.mask_version = mask_version(chunk.version, self.mask_every)
        when = max(self.rollouts.next_available(), self.rewards.next_available())
        self.retries.append((when, chunk_index))
        return when

    # -- the learner --------------------------------------------------------------------------------------------

    def needs_driver_after(self, n: int) -> bool:
        """Whether the driver acts on the learner right after its n-th step (publish weights or NLPO's masking
        policy, checkpoint, stop): no later step may be queued behind that one, or it would run first."""
        return bool((self.refresh_every_steps and n % self.refresh_every_steps == 0)
                    or (self.mask_every and n % self.mask_every == 0)  # NLPO publishes its masking policy
                    or (self.save_every_steps and n % self.save_every_steps == 0)
                    or (self.stop_after_steps and n >= self.stop_after_steps))

    def _move_ready(self) -> None:
        # In dataset order (deterministic), or as they come (faster when workers are uneven; the result
        # then depends on timing).
        while self._first_unconsumed in self.ready or (not self.ordered and self.ready):
            index = self._first_unconsumed if self._first_unconsumed in self.ready else min(self.ready)
            self.consumed.add(index)
            self.stats.out_of_order += index != self._first_unconsumed
            self.queue.extend(self.ready.pop(index))
            self.next_consume += 1
            while self._first_unconsumed in self.consumed:
                self._first_unconsumed += 1
        if not self.ordered:  # the stalest first: a late chunk's items must not wait behind fresher ones
            self.queue.sort(key=lambda item: item.policy_version)

    @property
    def all_consumed(self) -> bool:
        return self.next_consume == len(self.chunks)

    def next_batch(self) -> LearnerBatch | None:
        """The next learner step's batch, when a full batch (or the epoch's tail) is ready and a step may be
        queued (at most two in flight, none past a step the driver must act after)."""
        self._move_ready()
        if not self.queue or self.steps_queued >= 2:
            return None
        if len(self.queue) < self.batch_size and not self.all_consumed:
            return None
        at = self.step + self.steps_queued
        if self.steps_queued and self.needs_driver_after(at):
            return None
        items, self.queue = self.queue[: self.batch_size], self.queue[self.batch_size:]
        staleness = [at - item.policy_version for item in items]
        size = len(items)
        if size < self.learners:
            # An epoch tail smaller than the group: every rank must step (DDP all-reduces), so the tail's items
            # are repeated to give each rank one.
            items = [items[i % size] for i in range(self.learners)]
        self.steps_queued += 1
        self._queued_ids.append([item.example_id for item in items[:size]])
        self.stats.items_used += size
        return LearnerBatch(items, at, size, sum(staleness) / size, max(staleness))

    def step_done(self) -> int:
        """The oldest queued learner step returned; returns the learner's new step count."""
        if self.steps_queued < 1:
            raise RuntimeError("step_done without a queued learner step")
        self.steps_queued -= 1
        self.trained_ids += self._queued_ids.popleft()
        self.step += 1
        return self.step

    # -- progress -----------------------------------------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        return bool(self.stop_after_steps and self.step >= self.stop_after_steps)

    @property
    def finished(self) -> bool:
        """Every chunk trained on (or the stop step reached) and no learner step outstanding."""
        if self.stopped and not self.steps_queued:
            return True
        return self.all_consumed and not self.queue and not self.steps_queued

    def retry_wait(self) -> float | None:
        """Seconds until the next retry is due (None without retries)."""
        if not self.retries:
            return None
        return max(0.0, min(t for t, _ in self.retries) - self.clock())

    def oldest_needed_version(self) -> int:
        """The oldest policy version still needed: by a chunk not yet scored (its rollout, or a re-dispatch of
        it, which in unordered mode can lag the learner) or by a run resumed from the current step, which plans
        and samples again from there (:func:`needed_version`, and its NLPO mask), or, NLPO, by the masking policy
        of scored groups that no learner step has taken yet. The driver drops the
        published weights of older versions and leaves them out of checkpoints; later chunks, this epoch's or
        the next's, need the same versions or later ones."""
        resumed = needed_version(self.step, self.epoch_start, self.refresh_every_steps)
        needed = [resumed, mask_version(resumed, self.mask_every)] if self.mask_every else [resumed]
        needed += [v for c in self.chunks if c.index not in self.consumed and c.index not in self.ready
                   for v in c.versions()]
        if self.mask_every:  # scored groups not yet in a learner step: the step is sent their masking policies
            needed += [c.mask_version for c in self.chunks if c.index in self.ready and c.mask_version is not None]
            needed += [item.mask_version for item in self.queue if item.mask_version is not None]
        return min(needed)

    def blocked_version(self) -> int | None:
        """The version the next chunk waits for, when nothing else can make progress."""
        if self.next_submit < len(self.chunks) and not self.retries:
            return self.chunks[self.next_submit].version
        return None

    def check_complete(self) -> None:
        """At the epoch's end: every chunk was used once (unless the run stopped early)."""
        if not self.stopped and len(self.consumed) != len(self.chunks):
            raise RuntimeError(f"the epoch ended with {len(self.chunks) - len(self.consumed)} of {len(self.chunks)} "
                               "chunks unused")
