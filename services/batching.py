"""The servers' request batcher: concurrent requests share model calls, long ones are split, gone ones dropped.

A request is queued as a *job*: its items (one per source, or per scored candidate) and each item's
*cost*, the work it asks for (the policy server counts token positions: rows × (source + new tokens)).
One worker thread, the only thread that touches the model, builds *calls*. The oldest job's key (route
and decoding settings) gathers the queued jobs with that key, up to ``max_batch_size`` items and
``max_call_cost`` work, and runs them as one call. A job too large for one call runs as several: after
each of its calls it goes to the back of the queue, so other requests' calls run in between. All the
calls of a job run on the backend of its first call, so a response comes from one policy version even
when a hot reload lands between them.

Between two decoding steps of a call (the sampler's ``between_steps`` hook, :class:`CallControl`) the
worker

- drops the rows of jobs that are gone: the client disconnected (the route cancels the job) or the
  request's deadline passed. Their rows leave the decoder batch and its cache at once;
- runs one waiting call *inside* the running one when requests outside it have waited ``max_wait_ms``
  and are small next to the largest request in it (at most ``1 / NESTED_SHARE`` of its work; the nested
  call is at most that share of the running call's work, and makes no room itself). A long request then
  delays a small one by about one decoding step and the small one's own call, not by its whole length;
  requests of similar size are batched and take turns call by call as usual. The running call keeps
  at least ``1 / (1 + NESTED_TIME_SHARE)`` of the worker's time, so a stream of small requests slows a
  long one down but cannot stall it.

The queue is bounded in work, not requests: a job that would take the queued work past ``max_queue_cost``
is refused at once with :class:`Overloaded` (the routes answer 503 + Retry-After, estimated from the
measured work rate); a job larger than the whole bound is admitted into an empty queue only. Hot reload
hands a new backend to :meth:`Batcher.swap_backend`; it is installed between calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

log = logging.getLogger("rlt2t.services.batching")


class Backend(Protocol):
    """What the batcher calls of a backend itself (the runners call the rest)."""

    def close(self) -> None: ...


B = TypeVar("B", bound=Backend)

NESTED_SHARE = 4
"""Requests run inside a running call are at most 1/NESTED_SHARE of the largest request in it (and the
nested call at most that share of the running call's work)."""
NESTED_TIME_SHARE = 3
"""While a call runs, the calls run inside it take at most this many times its own time."""

DEADLINE_PASSED = "not answered within serve.request_timeout_s; dropped"
"""The 503's message for a request whose deadline passed, queued or running."""

# run(backend, key, items, control) -> one result per item; the same callable for every job of a key.
Runner = Callable[[Any, Any, list[Any], "CallControl"], list[Any]]


class Overloaded(Exception):
    """The queue is full, the request's deadline passed, or the server is stopping; retry after
    ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ClientGone(Exception):
    """The client disconnected before its answer was ready; nobody is left to answer."""


@dataclass(eq=False)
class _Job:
    key: Hashable
    runner: Runner
    items: list[Any]
    costs: list[int]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    deadline: float
    enqueued: float = field(default_factory=time.monotonic)
    ready_since: float = field(default_factory=time.monotonic)
    """When the job last (re-)entered the queue (what a running call's courtesy waits on)."""
    backend: Any = None
    """Pinned at the job's first call: every call of the job runs on it."""
    next: int = 0
    """First item not yet handed to a call."""
    results: list[Any] = field(default_factory=list)
    done: int = 0
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.results = [None] * len(self.items)

    def left_cost(self) -> int:
        return sum(self.costs[self.next :])

    def gone(self, now: float) -> bool:
        return self.cancelled or now > self.deadline


class CallControl:
    """What a runner hands to the backend for one call (``backends.StepControl``): which of the call's
    items are gone, and the hook the sampler calls between decoding steps."""

    def __init__(self, parts: list[tuple[_Job, int, int]], between: Callable[[], None] | None = None) -> None:
        self._parts = parts
        self._between = between
        self.dropped: set[_Job] = set()
        """Jobs reported stopped to the backend: their results of this call are cut short, never delivered."""

    def stopped(self) -> list[int]:
        """Positions (in the call's item list) of the items whose request is gone."""
        now, pos = time.monotonic(), 0
        out: list[int] = []
        for job, first, end in self._parts:
            if job.gone(now):
                out.extend(range(pos, pos + end - first))
                self.dropped.add(job)
            pos += end - first
        return out

    def between_steps(self) -> list[int]:
        """Let waiting work run (top-level calls only), then :meth:`stopped`."""
        if self._between is not None:
            self._between()
        return self.stopped()


@dataclass(eq=False)
class _Call:
    key: Hashable
    runner: Runner
    backend: Any
    parts: list[tuple[_Job, int, int]]
    cost: int

    @property
    def items(self) -> list[Any]:
        return [item for job, first, end in self.parts for item in job.items[first:end]]

    @property
    def jobs(self) -> set[_Job]:
        return {job for job, _, _ in self.parts}


def _post(job: _Job, result: Any = None, error: BaseException | None = None) -> None:
    """Hand a result to the job's event loop (from any thread); a closed loop has no one to tell."""
    with contextlib.suppress(RuntimeError):
        job.loop.call_soon_threadsafe(_resolve, job.future, result, error)


def _resolve(future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    if future.done():  # the request already gave up (deadline, client gone)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class Batcher(Generic[B]):
    """Bounded, batching, splitting front of one backend; see the module docstring.

    ``on_batch(num_items, seconds)`` is called after every call (metrics).
    """

    def __init__(self, backend: B | None, *, max_batch_size: int, max_wait_ms: float, max_queue_cost: int,
                 max_call_cost: int, on_batch: Callable[[int, float], None] | None = None) -> None:
        if max_batch_size < 1 or max_queue_cost < 1 or max_call_cost < 1 or max_wait_ms < 0:
            raise ValueError(f"need max_batch_size, max_queue_cost, max_call_cost >= 1 and max_wait_ms >= 0; got "
                             f"{max_batch_size}, {max_queue_cost}, {max_call_cost}, {max_wait_ms}")
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_queue_cost = max_queue_cost
        self.max_call_cost = max_call_cost
        self._backend = backend
        self._next_backend: B | None = None
        self._on_batch = on_batch
        self._queue: deque[_Job] = deque()
        self._queued_cost = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._rate: float | None = None  # work per second of model time (moving average)

    # -- state ---------------------------------------------------------------------------------------

    @property
    def backend(self) -> B | None:
        """The backend the next call will run on (the newest installed or pending)."""
        with self._cond:
            return self._next_backend or self._backend

    @property
    def queue_depth(self) -> int:
        """Items waiting for a call."""
        with self._cond:
            return sum(len(j.items) - j.next for j in self._queue)

    @property
    def queued_cost(self) -> int:
        """Work waiting for a call (not counting the call being run)."""
        return self._queued_cost

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called: new work is refused."""
        return self._stopping

    def swap_backend(self, backend: B) -> None:
        """Serve ``backend`` from the next call on; calls of jobs already started finish on the old one."""
        with self._cond:
            self._next_backend = backend
            self._cond.notify_all()

    # -- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        with self._cond:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._work, name="rlt2t-batcher", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the call in flight, refuse what is queued (503), and join the worker."""
        with self._cond:
            self._stopping = True
            refused, self._queue = list(self._queue), deque()
            self._queued_cost = 0
            self._cond.notify_all()
        for job in refused:
            _post(job, None, Overloaded("server is shutting down", 1))
        if self._thread is not None:
            self._thread.join(timeout)

    def close_backends(self) -> bool:
        """After :meth:`stop`: close the installed and any pending backend. False (nothing closed) while
        a call still runs, since the backend is in use."""
        if not self._stopping or (self._thread is not None and self._thread.is_alive()):
            return False
        with self._cond:
            backends = {id(b): b for b in (self._backend, self._next_backend) if b is not None}
        for b in backends.values():
            b.close()
        return True

    # -- producer side (event loop) ------------------------------------------------------------------

    def retry_after(self) -> int:
        """Seconds until the queued work has likely drained (at least 1)."""
        if not self._rate:
            return 1
        return max(1, math.ceil(self._queued_cost / self._rate))

    async def submit(self, key: Hashable, items: Sequence[Any], runner: Runner, *, costs: Sequence[int] | None = None,
                     deadline: float | None = None, gone: Callable[[], Awaitable[Any]] | None = None
                     ) -> tuple[list[Any], B | None]:
        """Queue ``items`` (cost ``costs[i]`` each, default 1) and wait for ``runner``'s results and the
        backend used (for no items: the current one, None before any is installed).

        ``deadline`` (``time.monotonic()``) and ``gone`` (an awaitable that completes when the client has
        disconnected) end the wait early: the job leaves the queue and its running call, and
        :class:`Overloaded` (deadline) or :class:`ClientGone` is raised. Raises :class:`Overloaded` at
        once when admitting the job would take the queued work past ``max_queue_cost``.
        """
        if not items:
            return [], self.backend
        costs = [int(c) for c in costs] if costs is not None else [1] * len(items)
        if len(costs) != len(items):
            raise ValueError(f"costs: need one per item ({len(items)}), got {len(costs)}")
        if self._stopping:  # after shutdown: refuse, never restart the worker
            raise Overloaded("server is shutting down", 1)
        self.start()
        loop = asyncio.get_running_loop()
        job = _Job(key=key, runner=runner, items=list(items), costs=costs, loop=loop, future=loop.create_future(),
                   deadline=deadline if deadline is not None else math.inf)
        total = sum(costs)
        with self._cond:
            if self._stopping:
                raise Overloaded("server is shutting down", 1)
            if self._queued_cost and self._queued_cost + total > self.max_queue_cost:
                raise Overloaded(f"queue full ({self._queued_cost} + {total} work > {self.max_queue_cost} queued "
                                 "at most)", self.retry_after())
            self._queue.append(job)
            self._queued_cost += total
            self._cond.notify_all()
        try:
            return await self._wait(job, gone)
        finally:
            if not job.future.done():
                job.future.cancel()  # a result posted later finds nobody waiting (and warns nobody)
            if job.future.cancelled() or job.future.exception() is not None:
                self._cancel(job)

    async def _wait(self, job: _Job, gone: Callable[[], Awaitable[Any]] | None) -> tuple[list[Any], B]:
        watcher = asyncio.ensure_future(gone()) if gone is not None else None
        waiting = {job.future} | ({watcher} if watcher is not None else set())
        timeout = None if math.isinf(job.deadline) else max(0.0, job.deadline - time.monotonic())
        try:
            done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if watcher is not None:
                watcher.cancel()
        if job.future in done:
            return job.future.result()
        if watcher is not None and watcher in done:
            raise ClientGone("the client disconnected")
        raise Overloaded(DEADLINE_PASSED, self.retry_after())

    def _cancel(self, job: _Job) -> None:
        """The request gave up: out of the queue now, out of its running call at the next decoding step."""
        with self._cond:
            job.cancelled = True
            self._dequeue_locked(job)
            job.results = []  # what its finished calls produced is nobody's any more

    def _dequeue_locked(self, job: _Job) -> None:
        """``job`` out of the queue, its work no longer queued, none of its items left for a call."""
        if job in self._queue:
            self._queue.remove(job)
            self._queued_cost -= job.left_cost()
            job.next = len(job.items)

    # -- worker thread -------------------------------------------------------------------------------

    def _expire_locked(self, now: float) -> None:
        """Answer and drop queued jobs whose deadline passed (the route normally gets there first)."""
        for job in [j for j in self._queue if j.gone(now)]:
            self._dequeue_locked(job)
            if not job.cancelled:
                _post(job, None, Overloaded(DEADLINE_PASSED, 1))

    def _next_call(self, *, wait: bool, exclude: Collection[_Job] = (), max_job_cost: int | None = None,
                   max_cost: int | None = None) -> _Call | None:
        """The next call to run. ``wait``: block for work, and let a fresh first job wait ``max_wait_ms``
        for company. Otherwise (inside a running call) only jobs that have already waited that long, none of
        ``exclude`` (the running call's jobs), none costing more than ``max_job_cost``, at most
        ``max_cost`` in all."""
        with self._cond:
            while True:
                if self._stopping:
                    return None
                now = time.monotonic()
                self._expire_locked(now)
                waiting = [j for j in self._queue if j not in exclude
                           and (max_job_cost is None or sum(j.costs) <= max_job_cost)]
                if not waiting:
                    if not wait:
                        return None
                    self._cond.wait()
                    continue
                first = waiting[0]
                if not wait:
                    if now - first.ready_since < self.max_wait_s:
                        return None
                    chosen = set(waiting)  # too large to run inside the running call: left out of this one too
                    return self._build_call_locked(first, {j for j in self._queue if j not in chosen}, max_cost)
                remaining = first.enqueued + self.max_wait_s - now
                if first.next == 0 and remaining > 0 and self._compatible_items(first) < self.max_batch_size:
                    self._cond.wait(remaining)
                    continue
                return self._build_call_locked(first, exclude)

    def _compatible_items(self, first: _Job) -> int:
        return sum(len(j.items) - j.next for j in self._queue if j.key == first.key)

    def _build_call_locked(self, first: _Job, exclude: Collection[_Job], max_cost: int | None = None) -> _Call:
        call_cost = self.max_call_cost if max_cost is None else min(max_cost, self.max_call_cost)
        if first.backend is not None:
            backend = first.backend
        else:
            if self._next_backend is not None:  # the swap point: between calls, never inside one
                self._backend, self._next_backend = self._next_backend, None
            backend = self._backend
        parts: list[tuple[_Job, int, int]] = []
        count = cost = 0
        keep: deque[_Job] = deque()
        again: list[_Job] = []
        for job in self._queue:
            full = count >= self.max_batch_size or cost >= call_cost
            if (full or job in exclude or job.key != first.key
                    or (job.backend is not None and job.backend is not backend)):
                keep.append(job)
                continue
            left_items, left_cost = len(job.items) - job.next, job.left_cost()
            oversized = left_items > self.max_batch_size or left_cost > call_cost
            fits = count + left_items <= self.max_batch_size and cost + left_cost <= call_cost
            if not fits and not oversized:
                keep.append(job)  # it waits for a call it fits in whole, rather than being split
                continue
            start = end = job.next
            while (end < len(job.items) and count < self.max_batch_size
                   and (count == 0 or cost + job.costs[end] <= call_cost)):
                cost += job.costs[end]
                count += 1
                end += 1
            if end == start:
                keep.append(job)
                continue
            job.backend, job.next = backend, end
            self._queued_cost -= sum(job.costs[start:end])
            parts.append((job, start, end))
            if end < len(job.items):
                again.append(job)  # the rest of a long job waits behind the others: they run in between
        now = time.monotonic()
        for job in again:
            job.ready_since = now
        self._queue = keep + deque(again)
        return _Call(key=first.key, runner=first.runner, backend=backend, parts=parts, cost=cost)

    def _work(self) -> None:
        while True:
            call = self._next_call(wait=True)
            if call is None:
                return
            self._run(call, nested=False)

    def _run(self, call: _Call, *, nested: bool) -> None:
        nested_seconds = 0.0

        def between() -> None:
            nonlocal nested_seconds
            if nested_seconds > NESTED_TIME_SHARE * (time.perf_counter() - start - nested_seconds):
                return  # the running call's turn
            largest = max(sum(job.costs) for job in call.jobs)
            inner = self._next_call(wait=False, exclude=call.jobs, max_job_cost=largest // NESTED_SHARE,
                                    max_cost=max(1, call.cost // NESTED_SHARE))
            if inner is not None:
                t0 = time.perf_counter()
                self._run(inner, nested=True)
                nested_seconds += time.perf_counter() - t0

        control = CallControl(call.parts, None if nested else between)
        items = call.items
        start = time.perf_counter()
        try:
            results = call.runner(call.backend, call.key, items, control)
            if len(results) != len(items):
                raise RuntimeError(f"runner returned {len(results)} results for {len(items)} items")
        except BaseException as e:  # a failed call fails its own requests, never the worker
            log.exception("model call failed for %d items", len(items))
            error = e if isinstance(e, Exception) else RuntimeError(f"model call aborted: {e!r}")
            for job in call.jobs:
                self._cancel(job)
                _post(job, None, error)
            if not isinstance(e, Exception):
                raise
            return
        seconds = max(time.perf_counter() - start - nested_seconds, 1e-6)
        rate = call.cost / seconds
        self._rate = rate if self._rate is None else 0.8 * self._rate + 0.2 * rate
        if self._on_batch is not None:
            try:
                self._on_batch(len(items), seconds)
            except Exception:  # metrics must never strand the call's requests
                log.exception("batch metrics callback failed")
        offset = 0
        for job, first, end in call.parts:
            own = results[offset : offset + end - first]
            offset += end - first
            if job in control.dropped and not job.cancelled:  # its deadline passed in the call: cut short
                self._cancel(job)
                _post(job, None, Overloaded(DEADLINE_PASSED, 1))
            with self._cond:
                if job.cancelled:
                    continue
                job.results[first:end] = own
                job.done += end - first
                complete = job.done == len(job.items)
            if complete:
                _post(job, (job.results, call.backend))
