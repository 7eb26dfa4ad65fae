"""The policy server's request batcher: concurrent requests share one model call.

Requests are queued as *jobs* (one per request, ``size`` = its sources). One worker thread, the only
thread that touches the model, takes the oldest job, waits up to ``max_wait_ms`` for others to join,
and runs every queued job with the same key (same route, same decoding settings) that fits in
``max_batch_size`` sources as one call. A job is never split across calls of different weights: a
request larger than ``max_batch_size`` runs alone, in consecutive chunks on one backend, so every
response comes from a single policy version.

The queue is bounded in sources (``max_queue``): a job that would overflow it is refused at once with
:class:`Overloaded` (the routes answer 503 + Retry-After) instead of growing memory and latency without
bound. Hot reload hands a new backend to :meth:`Batcher.swap_backend`; the worker installs it between
batches, so the batch in flight finishes on the old weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlt2t.services.backends import PolicyBackend

log = logging.getLogger("rlt2t.services.batching")

# run(backend, key, items) -> one result per item; the same callable for every job of a key.
Runner = Callable[[PolicyBackend, Any, list[Any]], list[Any]]


class Overloaded(Exception):
    """The queue is full (or the batcher is stopping); retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(eq=False)
class _Job:
    key: Hashable
    runner: Runner
    items: list[Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)


def _post(job: _Job, result: Any = None, error: BaseException | None = None) -> None:
    """Hand a result to the job's event loop (from any thread); a closed loop has no one to tell."""
    with contextlib.suppress(RuntimeError):
        job.loop.call_soon_threadsafe(_resolve, job.future, result, error)


def _resolve(future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    if future.done():  # the client went away and the request was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class Batcher:
    """Bounded, batching front of one backend; see the module docstring.

    ``on_batch(num_sources, seconds)`` is called after every model call (metrics).
    """

    def __init__(self, backend: PolicyBackend, *, max_batch_size: int, max_wait_ms: float, max_queue: int,
                 on_batch: Callable[[int, float], None] | None = None) -> None:
        if max_batch_size < 1 or max_queue < 1 or max_wait_ms < 0:
            raise ValueError(f"need max_batch_size >= 1, max_queue >= 1, max_wait_ms >= 0; got {max_batch_size}, "
                             f"{max_queue}, {max_wait_ms}")
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_queue = max_queue
        self._backend = backend
        self._next_backend: PolicyBackend | None = None
        self._on_batch = on_batch
        self._queue: deque[_Job] = deque()
        self._queued_sources = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._batch_seconds = 0.05  # moving average, for Retry-After estimates

    # -- state ---------------------------------------------------------------------------------------

    @property
    def backend(self) -> PolicyBackend:
        """The backend the next batch will run on (the newest installed or pending)."""
        with self._cond:
            return self._next_backend or self._backend

    @property
    def queue_depth(self) -> int:
        """Sources waiting (not counting the batch being run)."""
        return self._queued_sources

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called: new work is refused."""
        return self._stopping

    def swap_backend(self, backend: PolicyBackend) -> None:
        """Serve ``backend`` from the next batch on; the batch in flight finishes on the old one."""
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
        """Finish the batch in flight, refuse what is queued (503), and join the worker."""
        with self._cond:
            self._stopping = True
            refused, self._queue = list(self._queue), deque()
            self._queued_sources = 0
            self._cond.notify_all()
        for job in refused:
            _post(job, None, Overloaded("server is shutting down", 1))
        if self._thread is not None:
            self._thread.join(timeout)

    def close_backends(self) -> bool:
        """After :meth:`stop`: close the installed and any pending backend. False (nothing closed) while
        a batch still runs, since the backend is in use."""
        if not self._stopping or (self._thread is not None and self._thread.is_alive()):
            return False
        with self._cond:
            backends = {id(b): b for b in (self._backend, self._next_backend) if b is not None}
        for b in backends.values():
            b.close()
        return True

    # -- producer side (event loop) ------------------------------------------------------------------

    def retry_after(self) -> int:
        """Seconds until the queue has likely drained (at least 1)."""
        batches = self._queued_sources / self.max_batch_size + 1
        return max(1, math.ceil(batches * self._batch_seconds))

    async def submit(self, key: Hashable, items: Sequence[Any], runner: Runner) -> tuple[list[Any], PolicyBackend]:
        """Queue ``items`` (one per source) and wait for ``runner``'s results and the backend used.

        Raises :class:`Overloaded` when admitting the job would exceed ``max_queue`` sources (a job
        larger than the whole queue is admitted only into an empty queue, so it is not refused forever).
        """
        if not items:
            return [], self.backend
        if self._stopping:  # after shutdown: refuse, never restart the worker
            raise Overloaded("server is shutting down", 1)
        self.start()
        loop = asyncio.get_running_loop()
        job = _Job(key=key, runner=runner, items=list(items), loop=loop, future=loop.create_future())
        with self._cond:
            if self._stopping:
                raise Overloaded("server is shutting down", 1)
            if self._queued_sources and self._queued_sources + len(job.items) > self.max_queue:
                raise Overloaded(f"queue full ({self._queued_sources} of {self.max_queue} sources waiting)",
                                 self.retry_after())
            self._queue.append(job)
            self._queued_sources += len(job.items)
            self._cond.notify_all()
        return await job.future

    # -- worker thread -------------------------------------------------------------------------------

    def _compatible_size(self, key: Hashable) -> int:
        return sum(len(j.items) for j in self._queue if j.key == key)

    def _take_batch(self) -> tuple[list[_Job], PolicyBackend] | None:
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            first = self._queue[0]
            deadline = first.enqueued + self.max_wait_s
            while (not self._stopping and (remaining := deadline - time.monotonic()) > 0
                   and self._compatible_size(first.key) < self.max_batch_size):
                self._cond.wait(remaining)
            if self._stopping:
                return None
            batch, total, keep = [], 0, deque()
            for job in self._queue:
                if job.key == first.key and (not batch or total + len(job.items) <= self.max_batch_size):
                    batch.append(job)
                    total += len(job.items)
                else:
                    keep.append(job)
            self._queue = keep
            self._queued_sources -= total
            if self._next_backend is not None:  # the swap point: between batches, never inside one
                self._backend, self._next_backend = self._next_backend, None
            return batch, self._backend

    def _work(self) -> None:
        while True:
            taken = self._take_batch()
            if taken is None:
                return
            batch, backend = taken
            items = [item for job in batch for item in job.items]
            start = time.perf_counter()
            try:
                results: list[Any] = []
                for first in range(0, len(items), self.max_batch_size):
                    chunk = items[first : first + self.max_batch_size]
                    results += batch[0].runner(backend, batch[0].key, chunk)
                if len(results) != len(items):
                    raise RuntimeError(f"runner returned {len(results)} results for {len(items)} items")
            except BaseException as e:  # a failed call fails its own requests, never the worker
                log.exception("model call failed for a batch of %d sources", len(items))
                for job in batch:
                    _post(job, None, e if isinstance(e, Exception) else RuntimeError(f"model call aborted: {e!r}"))
                if not isinstance(e, Exception):
                    raise
                continue
            seconds = time.perf_counter() - start
            self._batch_seconds = 0.8 * self._batch_seconds + 0.2 * seconds
            if self._on_batch is not None:
                try:
                    self._on_batch(len(items), seconds)
                except Exception:  # metrics must never strand the batch's requests
                    log.exception("batch metrics callback failed")
            offset = 0
            for job in batch:
                own = results[offset : offset + len(job.items)]
                offset += len(job.items)
                _post(job, (own, backend))
