"""The servers' request batcher: concurrent requests share model calls, long ones are split, gone ones dropped,
and work that cannot be answered in time is refused before it starts.

A request is queued as a *job*: its items (one per source, or per scored candidate), each item's *cost*, the
work it asks for (the policy server counts token positions: rows × (source + new tokens)), and each item's
:class:`~rlt2t.services.admission.Work`, the features of the service-time model. One worker thread, the only
thread that touches the model, builds *calls*. The oldest job's key (route and decoding settings) gathers the
queued jobs with that key, up to ``max_batch_size`` items and ``max_call_cost`` work, and runs them as one
call. A job too large for one call runs as several: after each of its calls it goes to the back of the
queue, so other requests' calls run in between. All the calls of a job run on the backend of its first call,
so a response comes from one policy version even when a hot reload lands between them.

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
  long one down but cannot stall it, and more when its requests need more to meet their deadlines (their
  predicted time left over the time to the deadline): the long request gets what it needs, spread over its
  calls, and the small ones the rest. A nested call runs only when every request of the running call is
  predicted to finish in time after it (its *slack*).

Admission (once the service-time model is calibrated, :class:`~rlt2t.services.admission.ServiceTime`): a
request is predicted, when it arrives, to take its own model time divided by the share of the worker it can
expect (what the small requests that would run inside its calls took lately, at most ``NESTED_TIME_SHARE /
(1 + NESTED_TIME_SHARE)`` of it), after the work already queued or running. One whose own time exceeds the time
left before its deadline is refused at once with :class:`TooSlow` (the routes answer 429, naming the prediction
and the limit): no retry would help at this speed. One that would fit alone but not behind the queued work
is refused with :class:`Overloaded` (503 + Retry-After). A job whose slack runs short goes first, ahead of the
queue's order: what was admitted is answered within its deadline as long as the model's predictions hold.

The queue is also bounded in work, not requests: a job that would take the queued work past
``max_queue_cost`` is refused at once with :class:`Overloaded`; a job larger than the whole bound is admitted
into an empty queue only. Hot reload hands a new backend to :meth:`Batcher.swap_backend`; it is installed
between calls. After heavy work (``release_after_cost`` of it since the last time) the worker calls
``release``: the policy server returns the freed heap to the system there (``rlt2t.services.memory``).
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

from rlt2t.services.admission import RecentCalls, ServiceTime, Work, total

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
MAX_LOST_SHARE = NESTED_TIME_SHARE / (1 + NESTED_TIME_SHARE)
"""The most of the worker's time a long request can lose to the small ones run inside its calls."""

DEADLINE_PASSED = "not answered within serve.request_timeout_s; dropped"
"""The 503's message for a request whose deadline passed, queued or running."""

# run(backend, key, items, control) -> one result per item; the same callable for every job of a key.
Runner = Callable[[Any, Any, list[Any], "CallControl"], list[Any]]
# measure(items, results) -> the work one call actually did for these items of a job (rows that stopped early
# did less than predicted); what the service-time model learns from.
Measure = Callable[[list[Any], list[Any]], Work]
# calibration(backend) -> (work, seconds) of calls of chosen shapes, run on the worker before any request.
Calibration = Callable[[Any], Sequence[tuple[Work, float]]]


def nested_time_ratio(need: float) -> float:
    """How much time calls run inside a running call may take per second of its own, when its requests need
    ``need`` of the worker to meet their deadlines: NESTED_TIME_SHARE while they need at most what that leaves
    them, then what is left over, none once they need it all."""
    if need <= 1 - MAX_LOST_SHARE:
        return float(NESTED_TIME_SHARE)
    return max(0.0, (1 - need) / need)


class Overloaded(Exception):
    """The queue is full, the queued work leaves no time for the request, its deadline passed, or the server is
    stopping; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int, predicted_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.predicted_s = predicted_s


class TooSlow(Exception):
    """The request alone is predicted to take ``predicted_s`` seconds, more than the ``limit_s`` left before its
    deadline: refused before any work (429; the message says what to reduce)."""

    def __init__(self, message: str, predicted_s: float, limit_s: float) -> None:
        super().__init__(message)
        self.predicted_s = predicted_s
        self.limit_s = limit_s


class ClientGone(Exception):
    """The client disconnected before its answer was ready; nobody is left to answer."""


@dataclass(eq=False)
class _Job:
    key: Hashable
    runner: Runner
    items: list[Any]
    costs: list[int]
    work: list[Work]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    deadline: float
    measure: Measure | None = None
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
    cost: int = field(init=False, default=0)
    """All its items' cost."""

    def __post_init__(self) -> None:
        self.results = [None] * len(self.items)
        self.cost = sum(self.costs)

    def left_cost(self) -> int:
        return sum(self.costs[self.next :])

    def left_work(self) -> Work:
        return total(self.work[self.next :])

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
    predicted_s: float = 0.0
    """The model's seconds for the call when it was built (0 before the model is ready)."""
    started: float = 0.0
    nested_s: float = 0.0
    """Seconds spent on the calls run inside this one (not its own time)."""
    steps: int = 0
    """Decoding steps to run at most (the most of its items')."""
    steps_done: int = 0
    """Decoding steps run so far (counted where the sampler asks the control between steps)."""

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
    """Bounded, batching, splitting, admitting front of one backend; see the module docstring.

    ``on_batch(num_items, seconds)`` is called after every call (metrics). ``calibration(backend)`` runs once on
    the worker, on the first backend, before any call: its ``(work, seconds)`` fit ``timing``. ``release()`` is
    called on the worker after every ``release_after_cost`` of work (default ``max_call_cost``).
    ``request_timeout_s`` names the deadline in refusals. ``timing_key(key)``: calls whose job keys map to
    different values get service-time models of their own (forked from ``timing`` after the calibration).
    """

    def __init__(self, backend: B | None, *, max_batch_size: int, max_wait_ms: float, max_queue_cost: int,
                 max_call_cost: int, on_batch: Callable[[int, float], None] | None = None,
                 timing: ServiceTime | None = None, calibration: Calibration | None = None,
                 release: Callable[[], object] | None = None, release_after_cost: int | None = None,
                 request_timeout_s: float | None = None, timing_key: Callable[[Any], Hashable] | None = None
                 ) -> None:
        if max_batch_size < 1 or max_queue_cost < 1 or max_call_cost < 1 or max_wait_ms < 0:
            raise ValueError(f"need max_batch_size, max_queue_cost, max_call_cost >= 1 and max_wait_ms >= 0; got "
                             f"{max_batch_size}, {max_queue_cost}, {max_call_cost}, {max_wait_ms}")
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_queue_cost = max_queue_cost
        self.max_call_cost = max_call_cost
        self.timing = timing if timing is not None else ServiceTime()
        self._timing_key = timing_key
        self._timings: dict[Hashable, ServiceTime] = {}
        self.recent = RecentCalls()
        self.request_timeout_s = request_timeout_s
        self._backend = backend
        self._next_backend: B | None = None
        self._on_batch = on_batch
        self._calibration = calibration
        self._calibrated = threading.Event()
        if calibration is None:
            self._calibrated.set()
        self._release = release
        self._release_after_cost = release_after_cost if release_after_cost is not None else max_call_cost
        self._since_release = 0
        self._queue: deque[_Job] = deque()
        self._queued_cost = 0
        self._running: _Call | None = None  # the top-level call on the worker
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

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
    def running_cost(self) -> int:
        """Work of the call on the worker now (0 when idle)."""
        call = self._running
        return call.cost if call is not None else 0

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called: new work is refused."""
        return self._stopping

    def swap_backend(self, backend: B) -> None:
        """Serve ``backend`` from the next call on; calls of jobs already started finish on the old one."""
        with self._cond:
            self._next_backend = backend
            self._cond.notify_all()

    def wait_calibrated(self, timeout: float | None = None) -> bool:
        """Block until the start-up calibration has run (or failed, or there is none); False on timeout."""
        return self._calibrated.wait(timeout)

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

    # -- predictions ---------------------------------------------------------------------------------

    def _timing(self, key: Any) -> ServiceTime:
        """The service-time model for calls of ``key``: ``timing``, or with ``timing_key`` one per kind of call,
        forked from ``timing`` once the start-up calibration has run (a reward model's calls, a hundred times
        slower per unit of work than the task score's, must not make the task score's predictions slow)."""
        if self._timing_key is None or not self._calibrated.is_set():
            return self.timing
        kind = self._timing_key(key)
        timing = self._timings.get(kind)
        if timing is None:
            timing = self._timings.setdefault(kind, self.timing.fork())
        return timing

    def _job_seconds(self, job: _Job) -> float:
        """Model seconds of the job's work not yet handed to a call, run alone."""
        left_items, left_cost = len(job.items) - job.next, job.left_cost()
        if left_items <= 0:
            return 0.0
        calls = max(1, math.ceil(left_cost / self.max_call_cost), math.ceil(left_items / self.max_batch_size))
        return self._timing(job.key).seconds(job.left_work(), calls)

    def _running_left(self, now: float) -> float:
        """Seconds the running call still needs: from its pace once it has run a few steps (the model's
        prediction may be off, the pace is what it is), else the prediction less its own time so far."""
        call = self._running
        if call is None:
            return 0.0
        own = max(0.0, now - call.started - call.nested_s)
        if call.steps_done >= 2:
            return own / call.steps_done * max(0, call.steps - call.steps_done)
        return max(0.0, call.predicted_s - own)

    def _backlog_seconds_locked(self, now: float) -> float:
        """Model seconds of everything queued or running: what a new job may have to wait for."""
        return self._running_left(now) + sum(self._job_seconds(j) for j in self._queue)

    def _slack(self, job: _Job, now: float) -> float:
        """Seconds the job can give to other work and still finish by its deadline (as predicted)."""
        if math.isinf(job.deadline):
            return math.inf
        running = self._running
        left = self._job_seconds(job) + (self._running_left(now) if running is not None and job in running.jobs
                                         else 0.0)
        return job.deadline - now - left

    def _needed_share(self, call: _Call, now: float) -> float:
        """The largest share of the worker one of the call's requests needs from now on to finish in time (its
        predicted time left over its time to the deadline; 1 or more: all of it)."""
        need = 0.0
        for job in call.jobs:
            if job.gone(now) or math.isinf(job.deadline):
                continue
            left = job.deadline - now
            if left <= 0:
                return 1.0
            need = max(need, (self._job_seconds(job) + self._running_left(now)) / left)
        return need

    def retry_after(self) -> int:
        """Seconds until the queued work has likely drained (at least 1)."""
        with self._cond:
            return max(1, math.ceil(self._backlog_seconds_locked(time.monotonic())))

    def _admit_locked(self, job: _Job, now: float, describe: str, reduce: str) -> None:
        """Raise :class:`TooSlow` or :class:`Overloaded` when the job is predicted to miss its deadline."""
        if not self._timing(job.key).ready or math.isinf(job.deadline):
            return
        left = job.deadline - now
        lost = min(self.recent.share_below(job.cost // NESTED_SHARE, now), MAX_LOST_SHARE)
        own = self._job_seconds(job) / (1.0 - lost)
        limit = (f"serve.request_timeout_s = {self.request_timeout_s:g} s" if self.request_timeout_s is not None
                 else "its deadline")
        shared = (f", sharing the worker with the small requests that took {lost:.0%} of it lately" if lost >= 0.05
                  else "")
        if own > left:
            raise TooSlow(f"predicted {own:.3g} s for this request{f' ({describe})' if describe else ''} at this "
                          f"server's measured speed{shared}: more than the {left:.3g} s left of {limit}; refused "
                          f"before any work{f'. Ask for less: {reduce}' if reduce else ''}", own, left)
        backlog = self._backlog_seconds_locked(now)
        if backlog + own > left:
            raise Overloaded(f"predicted {backlog + own:.3g} s for this request behind the {backlog:.3g} s of work "
                             f"queued or running: more than the {left:.3g} s left of {limit}",
                             max(1, math.ceil(backlog + own - left)), predicted_s=backlog + own)

    # -- producer side (event loop) ------------------------------------------------------------------

    async def submit(self, key: Hashable, items: Sequence[Any], runner: Runner, *, costs: Sequence[int] | None = None,
                     work: Sequence[Work] | None = None, measure: Measure | None = None,
                     deadline: float | None = None, gone: Callable[[], Awaitable[Any]] | None = None,
                     describe: str = "", reduce: str = "") -> tuple[list[Any], B | None]:
        """Queue ``items`` (cost ``costs[i]`` each, default 1; model features ``work[i]``, default
        ``Work(rows=cost)``) and wait for ``runner``'s results and the backend used (for no items: the current
        one, None before any is installed). ``measure`` gives the work a call actually did for some of the
        items (default: as predicted).

        ``deadline`` (``time.monotonic()``) and ``gone`` (an awaitable that completes when the client has
        disconnected) end the wait early: the job leaves the queue and its running call, and
        :class:`Overloaded` (deadline) or :class:`ClientGone` is raised. Raises at once :class:`TooSlow` when
        the job alone is predicted to miss ``deadline`` (``describe``: the request's work in words, ``reduce``:
        what to ask for less of; both for the message), :class:`Overloaded` when it would miss it behind the
        queued work or would take the queued work past ``max_queue_cost``.
        """
        if not items:
            return [], self.backend
        costs = [int(c) for c in costs] if costs is not None else [1] * len(items)
        if len(costs) != len(items):
            raise ValueError(f"costs: need one per item ({len(items)}), got {len(costs)}")
        works = list(work) if work is not None else [Work(steps=1, rows=float(c)) for c in costs]
        if len(works) != len(items):
            raise ValueError(f"work: need one per item ({len(items)}), got {len(works)}")
        if self._stopping:  # after shutdown: refuse, never restart the worker
            raise Overloaded("server is shutting down", 1)
        self.start()
        loop = asyncio.get_running_loop()
        job = _Job(key=key, runner=runner, items=list(items), costs=costs, work=works, loop=loop,
                   future=loop.create_future(), deadline=deadline if deadline is not None else math.inf,
                   measure=measure)
        with self._cond:
            if self._stopping:
                raise Overloaded("server is shutting down", 1)
            now = time.monotonic()
            self._admit_locked(job, now, describe, reduce)
            if self._queued_cost and self._queued_cost + job.cost > self.max_queue_cost:
                raise Overloaded(f"queue full ({self._queued_cost} + {job.cost} work > {self.max_queue_cost} queued "
                                 "at most)", self.retry_after())
            self._queue.append(job)
            self._queued_cost += job.cost
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

    # -- worker thread: choosing calls ---------------------------------------------------------------

    def _expire_locked(self, now: float) -> None:
        """Answer and drop queued jobs whose deadline passed (the route normally gets there first)."""
        for job in [j for j in self._queue if j.gone(now)]:
            self._dequeue_locked(job)
            if not job.cancelled:
                _post(job, None, Overloaded(DEADLINE_PASSED, 1))

    def _next_call(self, *, wait: bool, exclude: Collection[_Job] = (), max_job_cost: int | None = None,
                   max_cost: int | None = None, max_seconds: float = math.inf) -> _Call | None:
        """The next call to run. ``wait``: block for work, and let a fresh first job wait ``max_wait_ms``
        for company; a job whose slack is shorter than that call goes first. Otherwise (inside a running call)
        only jobs that have already waited that long, none of ``exclude`` (the running call's jobs), none
        costing more than ``max_job_cost``, at most ``max_cost`` in all, in a call predicted to take at most
        ``max_seconds``."""
        with self._cond:
            while True:
                if self._stopping:
                    return None
                now = time.monotonic()
                self._expire_locked(now)
                waiting = [j for j in self._queue if j not in exclude
                           and (max_job_cost is None or j.cost <= max_job_cost)]
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
                    parts = self._select_locked(first, {j for j in self._queue if j not in chosen}, max_cost)
                    seconds = self._parts_seconds(parts)
                    if seconds > max_seconds:
                        return None  # the running call's requests have no time for it
                    return self._commit_locked(parts, seconds)
                remaining = first.enqueued + self.max_wait_s - now
                if first.next == 0 and remaining > 0 and self._compatible_items(first) < self.max_batch_size:
                    self._cond.wait(remaining)
                    continue
                return self._commit_locked(*self._most_urgent_locked(first, now))

    def _compatible_items(self, first: _Job) -> int:
        return sum(len(j.items) - j.next for j in self._queue if j.key == first.key)

    def _most_urgent_locked(self, first: _Job, now: float) -> tuple[list[tuple[_Job, int, int]], float]:
        """The parts of the call ``first`` would start and its predicted seconds, unless a job outside it has less
        slack than that call's time: then those of the job with the least slack (earliest-deadline-first where
        the queue's order would make one late)."""
        parts = self._select_locked(first, ())
        call_s = self._parts_seconds(parts)
        if not self._timing(first.key).ready:
            return parts, call_s
        in_call = {job for job, _, _ in parts}
        slack = {job: self._slack(job, now) for job in self._queue if job not in in_call}
        urgent = [job for job, s in slack.items() if s < call_s]
        if not urgent:
            return parts, call_s
        parts = self._select_locked(min(urgent, key=slack.__getitem__), ())
        return parts, self._parts_seconds(parts)

    def _call_backend_locked(self, first: _Job) -> Any:
        return first.backend if first.backend is not None else (self._next_backend or self._backend)

    def _select_locked(self, first: _Job, exclude: Collection[_Job],
                       max_cost: int | None = None) -> list[tuple[_Job, int, int]]:
        """The (job, first item, end) parts of the call ``first`` would start (changes nothing): ``first``'s
        key, ``first`` and then the queue in order, up to ``max_batch_size`` items and the call's work bound; a
        job that fits whole waits for a call it fits in rather than being split."""
        call_cost = self.max_call_cost if max_cost is None else min(max_cost, self.max_call_cost)
        backend = self._call_backend_locked(first)
        parts: list[tuple[_Job, int, int]] = []
        count = cost = 0
        for job in [first, *(j for j in self._queue if j is not first)]:
            if count >= self.max_batch_size or cost >= call_cost:
                break
            if job in exclude or job.key != first.key or (job.backend is not None and job.backend is not backend):
                continue
            left_items, left_cost = len(job.items) - job.next, job.left_cost()
            oversized = left_items > self.max_batch_size or left_cost > call_cost
            fits = count + left_items <= self.max_batch_size and cost + left_cost <= call_cost
            if not fits and not oversized:
                continue  # it waits for a call it fits in whole, rather than being split
            start = end = job.next
            while (end < len(job.items) and count < self.max_batch_size
                   and (count == 0 or cost + job.costs[end] <= call_cost)):
                cost += job.costs[end]
                count += 1
                end += 1
            if end > start:
                parts.append((job, start, end))
        return parts

    def _parts_seconds(self, parts: list[tuple[_Job, int, int]]) -> float:
        if not parts:
            return 0.0
        return self._timing(parts[0][0].key).seconds(total(w for job, first, end in parts for w in job.work[first:end]))

    def _commit_locked(self, parts: list[tuple[_Job, int, int]], seconds: float) -> _Call:
        """Hand the parts to a call: pin their backend (installing a pending one between calls, never inside
        one), take them out of the queue, and send the rest of a split job to the back; ``seconds``: the call's
        predicted time."""
        first = parts[0][0]
        if first.backend is None and self._next_backend is not None:  # the swap point
            self._backend, self._next_backend = self._next_backend, None
        backend = first.backend if first.backend is not None else self._backend
        now = time.monotonic()
        taken: set[_Job] = set()
        again: list[_Job] = []
        cost = 0
        for job, start, end in parts:
            job.backend, job.next = backend, end
            part_cost = sum(job.costs[start:end])
            cost += part_cost
            self._queued_cost -= part_cost
            taken.add(job)
            if end < len(job.items):
                job.ready_since = now
                again.append(job)  # the rest of a long job waits behind the others: they run in between
        self._queue = deque(j for j in self._queue if j not in taken) + deque(again)
        return _Call(key=first.key, runner=first.runner, backend=backend, parts=parts, cost=cost,
                     predicted_s=seconds, started=now,
                     steps=max(w.steps for job, start, end in parts for w in job.work[start:end]))

    # -- worker thread: running calls ----------------------------------------------------------------

    def _calibrate(self, backend: Any) -> None:
        """Run the start-up calibration once, on the first backend there is."""
        if self._calibrated.is_set() or backend is None or self._calibration is None:
            return
        try:
            started = time.monotonic()
            samples = self._calibration(backend)
            self.timing.calibrate(samples)
            log.info("calibrated in %.1f s on %d calls: %.3g s per step, %.3g per row-step, %.3g per attended "
                     "position, %.3g per source position", time.monotonic() - started, len(samples),
                     *self.timing.coefficients)
        except Exception:  # the server still serves; the model learns from served calls instead
            log.exception("start-up calibration failed; predicting from served calls only")
        finally:
            self._calibrated.set()

    def _work(self) -> None:
        self._calibrate(self.backend)
        while True:
            call = self._next_call(wait=True)
            if call is None:
                return
            self._calibrate(call.backend)  # no backend at start: before the first call instead
            self._running = call
            try:
                self._run(call, nested=False)
            finally:
                self._running = None
            self._release_if_due()

    def _release_if_due(self) -> None:
        if self._release is None or self._since_release < self._release_after_cost:
            return
        self._since_release = 0
        try:
            self._release()
        except Exception:  # freeing memory is a courtesy: never let it fail the worker
            log.exception("memory release failed")

    def _run(self, call: _Call, *, nested: bool) -> None:
        def between() -> None:
            call.steps_done += 1
            now = time.monotonic()
            own = now - call.started - call.nested_s
            with self._cond:
                need = self._needed_share(call, now)
                slack = min((self._slack(job, now) for job in call.jobs if not job.gone(now)), default=math.inf)
            if call.nested_s > nested_time_ratio(need) * own or slack <= 0:
                return  # the running call's turn
            largest = max(job.cost for job in call.jobs)
            inner = self._next_call(wait=False, exclude=call.jobs, max_job_cost=largest // NESTED_SHARE,
                                    max_cost=max(1, call.cost // NESTED_SHARE), max_seconds=slack)
            if inner is not None:
                t0 = time.monotonic()
                self._run(inner, nested=True)
                call.nested_s += time.monotonic() - t0

        control = CallControl(call.parts, None if nested else between)
        items = call.items
        call.started = time.monotonic()
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
        seconds = max(time.monotonic() - call.started - call.nested_s, 1e-6)
        self._learn(call, results, seconds)
        self._since_release += call.cost
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

    def _learn(self, call: _Call, results: list[Any], seconds: float) -> None:
        """What the call did and how long it took, into the service-time model and the recent calls."""
        done: list[Work] = []
        offset = 0
        for job, first, end in call.parts:
            own = results[offset : offset + end - first]
            offset += end - first
            predicted = total(job.work[first:end])
            if job.measure is None:
                done.append(predicted)
                continue
            try:
                done.append(job.measure(job.items[first:end], own))
            except Exception:  # a measure that fails leaves the prediction standing
                log.exception("measuring a call's work failed")
                done.append(predicted)
        self._timing(call.key).observe(total(done), seconds)
        self.recent.record(seconds, max(job.cost for job in call.jobs))
