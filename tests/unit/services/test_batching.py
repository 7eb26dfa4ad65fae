"""The request batcher with a fake backend: merging, keys, bounded queue (503 + Retry-After), swaps between
batches, failures confined to their batch."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import pytest
from fastapi.testclient import TestClient

from rlt2t.services.backends import Generation, PolicyBackend, Sampling
from rlt2t.services.batching import Batcher, Overloaded
from rlt2t.services.policy_app import create_app


@dataclass
class FakeBackend:
    """Echoes each source; records the sources of every call; optionally blocks until ``gate`` is set."""

    version: int = 1
    name: str = "fake"
    checkpoint: str = "fake"
    checksum: str = "0" * 64
    loaded_at: float = 0.0
    max_positions: int = 64
    calls: list[list[str]] = field(default_factory=list)
    gate: threading.Event | None = None
    started: threading.Event = field(default_factory=threading.Event)
    closed: int = 0

    def close(self):
        self.closed += 1

    def count_tokens(self, texts):
        return [len(t.split()) for t in texts]

    def candidates(self, sources, sampling: Sampling, row_seeds):
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        self.calls.append(list(sources))
        if "boom" in sources:
            raise RuntimeError("model exploded")
        return [[Generation(f"{s}@v{self.version}", [1], [-0.5])] * sampling.num_candidates for s in sources]

    def score(self, sources, targets):
        raise NotImplementedError


def echo(backend: PolicyBackend, key, items):
    return backend.candidates(items, Sampling(), [0] * len(items))


def test_fake_backend_satisfies_the_protocol():
    assert isinstance(FakeBackend(), PolicyBackend)


def test_backends_are_closed_only_once_the_batch_in_flight_is_done():
    running, pending = FakeBackend(gate=threading.Event()), FakeBackend(version=2)
    b = Batcher(running, max_batch_size=4, max_wait_ms=0, max_queue=8)
    b.start()
    assert not b.close_backends()  # not stopped
    worker = threading.Thread(target=lambda: asyncio.run(b.submit("k", ["a"], echo)))
    worker.start()
    assert running.started.wait(10)
    b.swap_backend(pending)
    b.stop(timeout=0.1)  # the gated batch is still running
    assert not b.close_backends() and running.closed == pending.closed == 0
    running.gate.set()
    worker.join(10)
    b.stop()
    assert b.close_backends()
    assert running.closed == pending.closed == 1


def test_concurrent_requests_share_one_model_call():
    backend = FakeBackend()
    batcher = Batcher(backend, max_batch_size=16, max_wait_ms=300, max_queue=64)

    async def run():
        jobs = [batcher.submit("k", [f"s{i}a", f"s{i}b"], echo) for i in range(5)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    batcher.stop()
    assert len(backend.calls) == 1 and len(backend.calls[0]) == 10  # 5 requests, one call
    for i, (res, used) in enumerate(results):  # every request gets its own results back, in order
        assert [g[0].text for g in res] == [f"s{i}a@v1", f"s{i}b@v1"] and used is backend


def test_batches_respect_keys_and_max_batch_size():
    backend = FakeBackend()
    batcher = Batcher(backend, max_batch_size=4, max_wait_ms=200, max_queue=64)

    async def run():
        jobs = [batcher.submit("a", ["a1", "a2", "a3"], echo), batcher.submit("b", ["b1"], echo),
                batcher.submit("a", ["a4", "a5"], echo), batcher.submit("a", ["a6"], echo),
                batcher.submit("a", [f"x{i}" for i in range(9)], echo)]  # larger than a batch: runs alone
        return await asyncio.gather(*jobs)

    asyncio.run(run())
    batcher.stop()
    assert backend.calls[0] == ["a1", "a2", "a3", "a6"]  # a4/a5 would overflow 4; a6 fits; b never mixes in
    assert ["b1"] in backend.calls and ["a4", "a5"] in backend.calls
    big = [c for c in backend.calls if c[0].startswith("x")]
    assert [len(c) for c in big] == [4, 4, 1]  # chunked into batch-size calls, one after the other


def test_full_queue_refuses_with_retry_after_and_recovers():
    gate = threading.Event()
    backend = FakeBackend(gate=gate)
    batcher = Batcher(backend, max_batch_size=2, max_wait_ms=0, max_queue=3)

    async def run():
        running = asyncio.ensure_future(batcher.submit("k", ["r1", "r2"], echo))
        await asyncio.to_thread(backend.started.wait, 5)  # the worker holds r1/r2 in the model
        queued = asyncio.ensure_future(batcher.submit("k", ["q1", "q2", "q3"], echo))
        await asyncio.sleep(0.05)
        assert batcher.queue_depth == 3
        with pytest.raises(Overloaded) as refused:
            await batcher.submit("k", ["x"], echo)
        assert refused.value.retry_after >= 1
        gate.set()
        await asyncio.gather(running, queued)
        assert batcher.queue_depth == 0
        return await batcher.submit("k", ["after"], echo)

    (res, _) = asyncio.run(run())
    batcher.stop()
    assert res[0][0].text == "after@v1"


def test_swap_happens_between_batches():
    gate = threading.Event()
    old, new = FakeBackend(version=1, gate=gate), FakeBackend(version=2)
    batcher = Batcher(old, max_batch_size=8, max_wait_ms=0, max_queue=64)

    async def run():
        inflight = asyncio.ensure_future(batcher.submit("k", ["first"], echo))
        await asyncio.to_thread(old.started.wait, 5)
        batcher.swap_backend(new)  # arrives while "first" is inside the old model
        assert batcher.backend is new
        gate.set()
        return await inflight, await batcher.submit("k", ["second"], echo)

    (first, used1), (second, used2) = asyncio.run(run())
    batcher.stop()
    assert (first[0][0].text, used1.version) == ("first@v1", 1)
    assert (second[0][0].text, used2.version) == ("second@v2", 2)


def test_a_failed_call_fails_only_its_batch():
    backend = FakeBackend()
    batcher = Batcher(backend, max_batch_size=8, max_wait_ms=0, max_queue=64)

    async def run():
        with pytest.raises(RuntimeError, match="exploded"):
            await batcher.submit("k", ["boom"], echo)
        return await batcher.submit("k", ["fine"], echo)

    (res, _) = asyncio.run(run())
    batcher.stop()
    assert res[0][0].text == "fine@v1"


def test_route_answers_503_with_retry_after_over_capacity(serve_cfg):
    gate = threading.Event()
    backend = FakeBackend(gate=gate)
    serve_cfg.serve.max_batch_size, serve_cfg.serve.max_queue = 1, 1
    app = create_app(serve_cfg, backend=backend)
    with TestClient(app) as c:
        results = {}

        def post(name):
            results[name] = c.post("/v1/candidates", json={"sources": [name], "max_new_tokens": 2})

        t1 = threading.Thread(target=post, args=("one",))
        t1.start()
        assert backend.started.wait(5)  # "one" is in the model
        t2 = threading.Thread(target=post, args=("two",))
        t2.start()
        for _ in range(200):  # wait until "two" waits in the queue
            if app.state.batcher.queue_depth == 1:
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
