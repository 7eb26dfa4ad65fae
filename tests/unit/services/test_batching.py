"""The request batcher with a fake backend: merging, keys, work-bounded calls and queue (503 + Retry-After),
long jobs split and interleaved, waiting work run between decoding steps, gone requests dropped from the
queue and from their running call, swaps between calls, failures confined to their call."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from dataclasses import dataclass, field

import pytest
from fastapi.testclient import TestClient

from rlt2t.services.backends import Ct2Backend, Generation, PolicyBackend, Sampling, TorchBackend, load_backend
from rlt2t.services.batching import Batcher, ClientGone, Overloaded
from rlt2t.services.policy_app import create_app


@dataclass
class FakeBackend:
    """Echoes each source; records the sources of every call. A call takes ``steps`` decoding steps of
    ``step_s`` seconds (sources starting with "L": ``long_steps``), asking its control between them (what
    the torch sampler does); it blocks until ``gate`` is set when one is given."""

    version: int = 1
    name: str = "fake"
    checkpoint: str = "fake"
    checksum: str = "0" * 64
    loaded_at: float = 0.0
    max_positions: int = 64
    steps: int = 1
    long_steps: int = 1
    step_s: float = 0.0
    calls: list[list[str]] = field(default_factory=list)
    finished: list[float] = field(default_factory=list)
    stopped_at: dict[str, int] = field(default_factory=dict)
    gate: threading.Event | None = None
    started: threading.Event = field(default_factory=threading.Event)
    closed: int = 0

    def close(self):
        self.closed += 1

    def count_tokens(self, texts):
        return [len(t.split()) for t in texts]

    def check_text(self, text):
        return None

    def candidates(self, sources, sampling: Sampling, row_seeds, control=None):
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        self.calls.append(list(sources))
        if "boom" in sources:
            raise RuntimeError("model exploded")
        active = set(range(len(sources)))
        for step in range(max(self.long_steps if s.startswith("L") else self.steps for s in sources)):
            time.sleep(self.step_s)
            if control is not None:
                for i in set(control.between_steps()) & active:
                    self.stopped_at[sources[i]] = step
                    active.discard(i)
            if not active:
                break
        self.finished.append(time.monotonic())
        return [[Generation(f"{s}@v{self.version}", [1], [-0.5], [-0.5])] * sampling.num_candidates for s in sources]

    def score(self, sources, targets):
        raise NotImplementedError


def echo(backend: PolicyBackend, key, items, control):
    return backend.candidates(items, Sampling(), [0] * len(items), control)


def batcher_of(backend, *, max_batch_size=8, max_wait_ms=0.0, max_queue_cost=1000, max_call_cost=1000):
    return Batcher(backend, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, max_queue_cost=max_queue_cost,
                   max_call_cost=max_call_cost)


def test_real_backends_satisfy_the_protocol(serve_cfg, checkpoint_root):
    """Both servable backends have every member of PolicyBackend (a runtime isinstance checks names only),
    and their methods take the protocol's parameters (what the batcher's runners pass)."""
    ct2_cfg = serve_cfg.model_copy(update={"serve": serve_cfg.serve.model_copy(update={"backend": "ct2"}),
                                           "export": serve_cfg.export.model_copy(update={"quantization": "float32"})})
    backends = [load_backend(serve_cfg, checkpoint_root), load_backend(ct2_cfg, checkpoint_root)]
    try:
        assert [type(b) for b in backends] == [TorchBackend, Ct2Backend]
        for backend in backends:
            assert isinstance(backend, PolicyBackend), type(backend)
            for method in ("count_tokens", "check_text", "candidates", "score", "close"):
                want = list(inspect.signature(getattr(PolicyBackend, method)).parameters)[1:]
                assert list(inspect.signature(getattr(backend, method)).parameters) == want, (type(backend), method)
            assert backend.count_tokens(["11 12 13"]) == [3] and backend.version == 0
    finally:
        for backend in backends:
            backend.close()


def test_backends_are_closed_only_once_the_call_in_flight_is_done():
    running, pending = FakeBackend(gate=threading.Event()), FakeBackend(version=2)
    b = batcher_of(running)
    b.start()
    assert not b.close_backends()  # not stopped
    worker = threading.Thread(target=lambda: asyncio.run(b.submit("k", ["a"], echo)))
    worker.start()
    assert running.started.wait(10)
    b.swap_backend(pending)
    b.stop(timeout=0.1)  # the gated call is still running
    assert not b.close_backends() and running.closed == pending.closed == 0
    running.gate.set()
    worker.join(10)
    b.stop()
    assert b.close_backends()
    assert running.closed == pending.closed == 1


def test_concurrent_requests_share_one_model_call():
    backend = FakeBackend()
    batcher = batcher_of(backend, max_batch_size=16, max_wait_ms=300)

    async def run():
        return await asyncio.gather(*(batcher.submit("k", [f"s{i}a", f"s{i}b"], echo) for i in range(5)))

    results = asyncio.run(run())
    batcher.stop()
    assert len(backend.calls) == 1 and len(backend.calls[0]) == 10  # 5 requests, one call
    for i, (res, used) in enumerate(results):  # every request gets its own results back, in order
        assert [g[0].text for g in res] == [f"s{i}a@v1", f"s{i}b@v1"] and used is backend


def test_calls_respect_keys_batch_size_and_work():
    backend = FakeBackend()
    batcher = batcher_of(backend, max_batch_size=4, max_wait_ms=200, max_call_cost=10)

    async def run():
        jobs = [batcher.submit("a", ["a1", "a2", "a3"], echo), batcher.submit("b", ["b1"], echo),
                batcher.submit("a", ["a4", "a5"], echo), batcher.submit("a", ["a6"], echo),
                batcher.submit("a", [f"x{i}" for i in range(9)], echo),  # more items than a call: split
                batcher.submit("c", ["c1", "c2", "c3"], echo, costs=[6, 6, 6])]  # more work than a call: split
        return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    batcher.stop()
    assert backend.calls == [
        ["a1", "a2", "a3", "a6"],  # a4/a5 would overflow 4 items: they wait whole; a6 fits; b never mixes in
        ["b1"],
        ["a4", "a5", "x0", "x1"],  # a job larger than a call fills the room left
        ["c1"],  # 6 + 6 > 10: one item per call, the two split jobs taking turns
        ["x2", "x3", "x4", "x5"],
        ["c2"],
        ["x6", "x7", "x8"],
        ["c3"],
    ]
    assert [g[0].text for g in results[4][0]] == [f"x{i}@v1" for i in range(9)]  # reassembled in order


def test_the_queue_is_bounded_in_work_not_requests():
    gate = threading.Event()
    backend = FakeBackend(gate=gate)
    batcher = batcher_of(backend, max_batch_size=2, max_queue_cost=100)

    async def run():
        running = asyncio.ensure_future(batcher.submit("k", ["r1"], echo, costs=[100]))
        await asyncio.to_thread(backend.started.wait, 5)  # the worker holds r1 in the model: queue empty
        heavy = asyncio.ensure_future(batcher.submit("k", ["q1"], echo, costs=[90]))
        await asyncio.sleep(0.05)
        assert batcher.queued_cost == 90
        light = asyncio.ensure_future(batcher.submit("k", [f"l{i}" for i in range(10)], echo))  # 10 items, work 10
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded, match="queue full") as refused:
            await batcher.submit("k", ["x"], echo, costs=[1])  # one small request is one too many
        assert refused.value.retry_after >= 1
        gate.set()
        await asyncio.gather(running, heavy, light)
        assert batcher.queued_cost == 0
        alone = await batcher.submit("k", ["huge"], echo, costs=[10_000])  # over the bound: admitted when empty
        return await batcher.submit("k", ["after"], echo), alone

    (res, _), (alone, _) = asyncio.run(run())
    batcher.stop()
    assert res[0][0].text == "after@v1" and alone[0][0].text == "huge@v1"


def test_waiting_work_runs_between_the_steps_of_a_long_call():
    """A small request arriving while a long call decodes is answered long before that call ends."""
    backend = FakeBackend(steps=2, long_steps=40, step_s=0.01)
    batcher = batcher_of(backend, max_call_cost=100)

    async def run():
        long = asyncio.ensure_future(batcher.submit("long", ["L"], echo, costs=[100]))
        await asyncio.to_thread(backend.started.wait, 5)
        t0 = time.monotonic()
        await batcher.submit("small", ["s"], echo, costs=[25])
        small_s = time.monotonic() - t0
        await long
        return small_s

    small_s = asyncio.run(run())
    batcher.stop()
    assert backend.calls == [["L"], ["s"]]
    assert backend.finished[0] < backend.finished[1]  # the small call finished inside the long one
    assert small_s < 0.3  # not the long call's 0.4 s: about one of its steps, then its own two


def test_requests_of_similar_size_take_turns_instead():
    """Only work much smaller than the running call (1/4 of it at most) runs inside it."""
    backend = FakeBackend(steps=2, long_steps=20, step_s=0.005)
    batcher = batcher_of(backend, max_call_cost=100)

    async def run():
        first = asyncio.ensure_future(batcher.submit("a", ["L1"], echo, costs=[100]))
        await asyncio.to_thread(backend.started.wait, 5)
        await asyncio.gather(first, batcher.submit("b", ["L2"], echo, costs=[26]))

    asyncio.run(run())
    batcher.stop()
    assert backend.calls == [["L1"], ["L2"]] and backend.finished[0] < backend.finished[1]  # one after the other


def test_a_split_job_lets_other_requests_in_between_its_calls():
    gate = threading.Event()
    backend = FakeBackend(gate=gate, steps=0, long_steps=0)  # no decoding steps: nothing runs inside a call
    batcher = batcher_of(backend, max_call_cost=2)

    async def run():
        first = asyncio.ensure_future(batcher.submit("a", ["first"], echo))
        await asyncio.to_thread(backend.started.wait, 5)
        long = asyncio.ensure_future(batcher.submit("a", ["L1", "L2", "L3", "L4", "L5", "L6"], echo))
        await asyncio.sleep(0.02)
        short = asyncio.ensure_future(batcher.submit("a", ["s1"], echo))
        await asyncio.sleep(0.02)
        gate.set()
        await asyncio.gather(first, long, short)

    asyncio.run(run())
    batcher.stop()
    # L runs in calls of two; the short request, queued after it, shares L's second call instead of waiting
    # for the whole of L.
    assert backend.calls == [["first"], ["L1", "L2"], ["s1", "L3"], ["L4", "L5"], ["L6"]]


def test_a_disconnected_client_leaves_the_queue_and_its_running_call():
    backend = FakeBackend(steps=200, step_s=0.005, gate=threading.Event())
    batcher = batcher_of(backend, max_wait_ms=50)

    async def run():
        left = asyncio.Event()
        gone = asyncio.ensure_future(batcher.submit("k", ["gone", "gone-too"], echo, gone=left.wait))
        stays = asyncio.ensure_future(batcher.submit("k", ["stays"], echo))
        await asyncio.to_thread(backend.started.wait, 5)  # the call holds all three, held at the gate
        queued = asyncio.ensure_future(batcher.submit("other", ["queued"], echo, gone=left.wait, costs=[7]))
        await asyncio.sleep(0.02)
        assert batcher.queued_cost == 7
        left.set()  # the client of "gone" and "queued" disconnects
        for task in (gone, queued):
            with pytest.raises(ClientGone):
                await task
        assert batcher.queued_cost == 0  # "queued" left the queue at once
        backend.gate.set()
        return await stays

    (res, _) = asyncio.run(run())
    batcher.stop()
    assert res[0][0].text == "stays@v1"
    assert backend.stopped_at == {"gone": 0, "gone-too": 0}  # their rows left at the first step
    assert ["queued"] not in backend.calls  # never ran


def test_a_request_past_its_deadline_is_dropped_with_503():
    backend = FakeBackend(steps=300, step_s=0.005)
    batcher = batcher_of(backend)

    async def run():
        t0 = time.monotonic()
        with pytest.raises(Overloaded, match="request_timeout_s") as late:
            await batcher.submit("k", ["slow"], echo, deadline=time.monotonic() + 0.2)
        return time.monotonic() - t0, late.value.retry_after

    waited, retry_after = asyncio.run(run())
    deadline = time.monotonic() + 5
    while not backend.finished and time.monotonic() < deadline:
        time.sleep(0.01)
    batcher.stop()
    assert 0.15 < waited < 1.0 and retry_after >= 1
    assert backend.stopped_at["slow"] < 100  # the call stopped at the next step, not after its 300


def test_swap_happens_between_calls_and_a_split_job_stays_on_its_backend():
    gate = threading.Event()
    old, new = FakeBackend(version=1, gate=gate), FakeBackend(version=2)
    batcher = batcher_of(old, max_call_cost=1)

    async def run():
        inflight = asyncio.ensure_future(batcher.submit("k", ["first", "second"], echo))  # two calls
        await asyncio.to_thread(old.started.wait, 5)
        batcher.swap_backend(new)  # arrives while "first" is inside the old model
        assert batcher.backend is new
        gate.set()
        return await inflight, await batcher.submit("k", ["third"], echo)

    (split, used1), (third, used2) = asyncio.run(run())
    batcher.stop()
    assert [g[0].text for g in split] == ["first@v1", "second@v1"] and used1.version == 1  # one version
    assert (third[0][0].text, used2.version) == ("third@v2", 2)


def test_a_failed_call_fails_only_its_requests():
    backend = FakeBackend()
    batcher = batcher_of(backend)

    async def run():
        with pytest.raises(RuntimeError, match="exploded"):
            await batcher.submit("k", ["boom"], echo)
        return await batcher.submit("k", ["fine"], echo)

    (res, _) = asyncio.run(run())
    batcher.stop()
    assert res[0][0].text == "fine@v1"


def test_route_answers_503_with_retry_after_over_capacity(serve_cfg):
    gate = threading.Event()
    backend = FakeBackend()
    # Every request below costs 1 source x 1 candidate x (1 token + 2 new) = 3: the queue holds one.
    serve_cfg.serve.max_batch_size, serve_cfg.serve.max_queue_cost = 1, 3
    app = create_app(serve_cfg, backend=backend)
    with TestClient(app) as c:
        # The start-up calibration has run (ungated); from here every model call waits at the gate.
        backend.gate = gate
        backend.started.clear()
        results = {}

        def post(name):
            results[name] = c.post("/v1/candidates", json={"sources": [name], "max_new_tokens": 2})

        t1 = threading.Thread(target=post, args=("one",))
        t1.start()
        assert backend.started.wait(5)  # "one" is in the model
        t2 = threading.Thread(target=post, args=("two",))
        t2.start()
        for _ in range(200):  # wait until "two" waits in the queue
            if app.state.batcher.queued_cost == 3:
                break
            threading.Event().wait(0.01)
        refused = c.post("/v1/candidates", json={"sources": ["three"], "max_new_tokens": 2})
        gate.set()
        t1.join(5)
        t2.join(5)
        assert refused.status_code == 503
        assert int(refused.headers["Retry-After"]) >= 1 and "queue full" in refused.json()["detail"]
        assert results["one"].status_code == results["two"].status_code == 200
        assert results["two"].json()["candidates"][0][0]["text"] == "two@v1"
        assert 'rlt2t_policy_rejected_total 1.0' in c.get("/metrics").text


def test_a_stream_of_small_requests_slows_a_long_call_but_cannot_stall_it():
    """The running call keeps a quarter of the worker's time: next to its 40 steps of 5 ms (0.2 s), small calls of
    50 ms each fit about 0.6 s / 50 ms = 12 times, where 40 would run if every step made room. Counted, not
    timed: on a loaded machine the steps and the small calls both stretch, and the count stays."""
    backend = FakeBackend(steps=10, long_steps=40, step_s=0.005)
    batcher = batcher_of(backend, max_call_cost=100)

    async def run():
        long = asyncio.ensure_future(batcher.submit("long", ["L"], echo, costs=[100]))
        await asyncio.to_thread(backend.started.wait, 5)
        t0 = time.monotonic()

        async def stream(i: int) -> int:
            done = 0
            while not long.done():
                await batcher.submit("small", [f"s{i}"], echo, costs=[1])
                done += 1
            return done

        smalls = await asyncio.gather(long, *(stream(i) for i in range(3)))
        return time.monotonic() - t0, smalls[1:]

    long_s, smalls = asyncio.run(run())
    batcher.stop()
    small_calls = len(backend.calls) - 1  # inside the long call, plus at most one per stream after it ended
    assert all(n >= 1 for n in smalls) and 1 <= small_calls <= 12 * 2 + 3, (small_calls, smalls, long_s)


def test_a_call_cut_short_by_a_deadline_never_answers_with_its_partial_results():
    """The worker stops a request's rows at its deadline; even when the event loop notices the deadline only
    after the worker has finished the call, the request gets the 503, not the cut-short results."""
    backend = FakeBackend(steps=300, step_s=0.001)
    batcher = batcher_of(backend)

    async def run():
        task = asyncio.ensure_future(batcher.submit("k", ["slow"], echo, deadline=time.monotonic() + 0.05))
        await asyncio.sleep(0)
        time.sleep(0.5)  # a busy event loop: the call is stopped and finished before the wait can time out
        with pytest.raises(Overloaded, match="request_timeout_s"):
            await task

    asyncio.run(run())
    batcher.stop()
    assert backend.stopped_at["slow"] < 150 and len(backend.finished) == 1
