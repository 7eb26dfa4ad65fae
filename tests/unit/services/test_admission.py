"""Admission by predicted time, fair sharing and memory release (#42.1-3): the service-time model, refusals that
name the prediction and the limit (429 alone, 503 behind the queue), small requests run inside a long call
unless its deadline has no room for them, the deadline stopping a running call, and the release after heavy
work. Orderings come from event logs and gates, never from wall-clock thresholds."""

from __future__ import annotations

import asyncio
import platform
import threading
import time
from dataclasses import dataclass, field

import pytest
from fastapi.testclient import TestClient

from rlt2t.services import memory, policy_app, reward_app
from rlt2t.services.admission import SAFETY, RecentCalls, ServiceTime, Work, sampled_work
from rlt2t.services.backends import Generation, Sampling
from rlt2t.services.batching import DEADLINE_PASSED, Batcher, Overloaded, TooSlow, nested_time_ratio


def linear_machine(per_step: float, per_row: float, per_context: float, per_prefill: float):
    """(work, seconds) of calls of varied shapes on a machine exactly linear in the features."""
    shapes = [sampled_work(r, s, n) for r, s, n in ((1, 8, 16), (16, 8, 16), (16, 128, 16), (64, 128, 16),
                                                     (16, 128, 32), (4, 8, 32))]
    return [(w, per_step * w.steps + per_row * w.rows + per_context * w.context + per_prefill * w.prefill)
            for w in shapes]


def slow_timing(per_row: float) -> ServiceTime:
    timing = ServiceTime()
    timing.calibrate(linear_machine(0.0, per_row, 0.0, 0.0))
    return timing


@dataclass
class LoggedBackend:
    """Echoes each source; logs ("start" | "step" | "end", sources of the call[, step]). A call takes
    ``steps`` decoding steps (sources starting with "L": ``long_steps``), asking its control between them (not
    after the last, as the sampler); with ``hold`` given, the first call blocks before its first step until it
    is set (``started`` is set then)."""

    version: int = 1
    name: str = "logged"
    checkpoint: str = "logged"
    checksum: str = "0" * 64
    loaded_at: float = 0.0
    max_positions: int = 64
    steps: int = 1
    long_steps: int = 1
    hold: threading.Event | None = None
    started: threading.Event = field(default_factory=threading.Event)
    log: list[tuple] = field(default_factory=list)
    stopped_at: dict[str, int] = field(default_factory=dict)

    def close(self):
        pass

    def candidates(self, sources, sampling: Sampling, row_seeds, control=None):
        call = tuple(sources)
        self.log.append(("start", call))
        if self.hold is not None and not self.started.is_set():
            self.started.set()
            assert self.hold.wait(10)
        self.started.set()
        active = set(range(len(sources)))
        steps = max(self.long_steps if s.startswith("L") else self.steps for s in sources)
        for step in range(steps):
            self.log.append(("step", call, step))
            if control is not None and step < steps - 1:
                for i in set(control.between_steps()) & active:
                    self.stopped_at[sources[i]] = step
                    active.discard(i)
            if not active:
                break
        self.log.append(("end", call))
        return [[Generation(f"{s}@v{self.version}", [1], [-0.5], [-0.5])] for s in sources]


def echo(backend, key, items, control):
    return backend.candidates(items, Sampling(), [0] * len(items), control)


def batcher_of(backend, *, timing: ServiceTime | None = None, **kw) -> Batcher:
    settings = {"max_batch_size": 8, "max_wait_ms": 0.0, "max_queue_cost": 10_000, "max_call_cost": 1000, **kw}
    return Batcher(backend, timing=timing, request_timeout_s=120.0, **settings)


async def queued(batcher: Batcher, items: int) -> None:
    """Until ``items`` items wait in the queue (a state, not a time)."""
    while batcher.queue_depth < items:
        await asyncio.sleep(0.005)


# -- the service-time model ------------------------------------------------------------------------------

def test_calibration_recovers_the_coefficients_of_a_linear_machine():
    timing = ServiceTime()
    assert not timing.ready and timing.seconds(Work(rows=100.0)) == 0.0  # no prediction before any measure
    timing.calibrate(linear_machine(2e-3, 1e-4, 2e-6, 5e-5))
    assert timing.calibrated and timing.ready
    assert timing.coefficients == pytest.approx((2e-3, 1e-4, 2e-6, 5e-5), rel=1e-6)
    big = sampled_work(256, 255, 255)  # far outside the calibration shapes: the fit extrapolates linearly
    exact = 2e-3 * 255 * 4 + 1e-4 * big.rows + 2e-6 * big.context + 5e-5 * big.prefill
    assert timing.seconds(big, calls=4) == pytest.approx(SAFETY * exact)


def test_the_scale_follows_the_served_calls():
    timing = slow_timing(1e-3)
    work = Work(rows=1000.0)
    assert timing.seconds(work) == pytest.approx(SAFETY * 1.0)
    for _ in range(50):  # the machine got twice as slow (another job on its cores)
        timing.observe(work, 2.0)
    assert timing.scale == pytest.approx(2.0, rel=0.05)
    assert timing.seconds(work) == pytest.approx(SAFETY * 2.0, rel=0.05)


def test_recent_calls_measure_the_share_of_small_requests():
    recent = RecentCalls(window_s=10.0)
    now = time.monotonic()
    recent.record(3.0, largest_cost=10, ended=now)  # small requests' calls
    recent.record(1.0, largest_cost=10, ended=now)
    recent.record(5.0, largest_cost=1000, ended=now)  # a long request's own time
    recent.record(4.0, largest_cost=10, ended=now - 20)  # too old to count
    assert recent.share_below(250, now) == pytest.approx(0.4)
    assert recent.share_below(1000, now) == pytest.approx(0.9)


def test_work_of_a_call_is_measured_from_the_rows_it_decoded():
    gens = [Generation("a", [4, 5, 6], [0.0] * 3, [0.0] * 3), Generation("b", [1], [0.0], [0.0])]
    done = policy_app._sampled_work_done([("src", [0, 1], 5)], [gens])
    assert done == Work(steps=3, rows=4.0, context=3 * (5 + 1.5) + 1 * (5 + 0.5), prefill=10.0)
    assert sampled_work(2, 5, 3) == Work(steps=3, rows=6.0, context=6 * (5 + 1.5), prefill=10.0)


class WordsOnly:
    """A tokenizer's view for calibration: digits are not in its vocabulary, and every word is two tokens."""

    def check_text(self, text):
        return "digits are not in this vocabulary" if any(c.isdigit() for c in text) else None

    def count_tokens(self, texts):
        return [2 * len(t.split()) for t in texts]


def test_the_calibration_source_passes_the_token_rule_within_the_length():
    text, n = policy_app.calibration_source(WordsOnly(), 40)
    assert WordsOnly().check_text(text) is None and n == WordsOnly().count_tokens([text])[0] and 0 < n <= 40


# -- admission -------------------------------------------------------------------------------------------

def test_a_request_predicted_too_slow_is_refused_at_once_naming_the_limit():
    backend = LoggedBackend()
    batcher = batcher_of(backend, timing=slow_timing(0.01))  # 0.01 s per row-step: 1000 of them, 12 s

    async def run():
        with pytest.raises(TooSlow) as refused:
            await batcher.submit("k", ["x"], echo, work=[Work(steps=10, rows=1000.0)],
                                 deadline=time.monotonic() + 10.0, describe="1 source x 100 rows",
                                 reduce="fewer rows")
        return refused.value

    refused = asyncio.run(run())
    batcher.stop()
    assert refused.predicted_s == pytest.approx(SAFETY * 10.0) and 9.0 < refused.limit_s <= 10.0
    message = str(refused)
    assert "predicted 12 s for this request (1 source x 100 rows)" in message
    assert "serve.request_timeout_s = 120 s" in message and "Ask for less: fewer rows" in message
    assert backend.log == []  # refused before any work


def test_a_request_that_fits_alone_but_not_behind_the_queued_work_gets_a_503():
    hold = threading.Event()
    backend = LoggedBackend(hold=hold)
    batcher = batcher_of(backend, timing=slow_timing(0.01))

    async def run():
        first = asyncio.ensure_future(batcher.submit("k", ["first"], echo, work=[Work(rows=500.0)],
                                                     deadline=time.monotonic() + 100.0))  # 6 s predicted
        await asyncio.to_thread(backend.started.wait, 5)
        queued_job = asyncio.ensure_future(batcher.submit("k", ["second"], echo, work=[Work(rows=500.0)],
                                                          deadline=time.monotonic() + 100.0))
        await queued(batcher, 1)
        with pytest.raises(Overloaded, match=r"behind the .* s of work queued or running") as behind:
            await batcher.submit("k", ["third"], echo, work=[Work(rows=500.0)], deadline=time.monotonic() + 10.0)
        hold.set()
        await asyncio.gather(first, queued_job)
        return behind.value

    behind = asyncio.run(run())
    batcher.stop()
    assert behind.retry_after >= 1 and behind.predicted_s is not None and behind.predicted_s > 10.0
    assert ("start", ("third",)) not in backend.log


def test_a_long_request_expects_to_lose_the_share_the_small_ones_took_lately():
    """Alone it would take 6 s of its 10; next to small requests that kept the worker busy, it can count on a
    quarter of it: 24 s, refused, and the message says why."""
    timing = slow_timing(0.01)
    batcher = batcher_of(LoggedBackend(), timing=timing)
    long = {"costs": [1000], "work": [Work(rows=500.0)]}

    async def run():
        alone = await batcher.submit("k", ["L"], echo, deadline=time.monotonic() + 10.0, **long)
        for _ in range(10):
            batcher.recent.record(1.0, largest_cost=10)  # the last 10 s: small requests all the time
        with pytest.raises(TooSlow, match="sharing the worker with the small requests") as refused:
            await batcher.submit("k", ["L"], echo, deadline=time.monotonic() + 10.0, **long)
        return alone, refused.value

    (alone, _), refused = asyncio.run(run())
    batcher.stop()
    assert alone[0][0].text == "L@v1"
    # the model's time (its scale updated by the served call) over the quarter left to the long request
    assert refused.predicted_s == pytest.approx(4 * timing.seconds(Work(rows=500.0)))


def test_the_policy_route_answers_429_with_the_prediction_and_the_limit(serve_cfg, checkpoint_root, monkeypatch):
    with TestClient(policy_app.create_app(serve_cfg, checkpoint_dir=checkpoint_root)) as c:
        batcher = c.app.state.batcher
        assert batcher.wait_calibrated(0) and batcher.timing.calibrated  # calibrated at start-up, on the model
        assert all(coef >= 0 for coef in batcher.timing.coefficients)
        body = {"sources": ["1 2 3"], "num_candidates": 2, "max_new_tokens": 8}
        assert c.post("/v1/candidates", json=body).status_code == 200  # a small request fits

        batcher.timing = slow_timing(10.0)  # a machine where the request's 16 row-steps take 160 s
        monkeypatch.setattr(policy_app, "_run_candidates", lambda *a: pytest.fail("decoded a refused request"))
        r = c.post("/v1/candidates", json=body)
        assert r.status_code == 429, r.text
        refusal = r.json()
        assert refusal["predicted_s"] == pytest.approx(SAFETY * 160.0, rel=0.01) and 0 < refusal["limit_s"] <= 120
        assert "1 sources x 2 candidates x (3 source tokens on average + 8 new tokens)" in refusal["detail"]
        assert "serve.request_timeout_s = 120 s" in refusal["detail"]
        assert "fewer sources, num_candidates or max_new_tokens" in refusal["detail"]
        metrics = c.get("/metrics").text
        assert "rlt2t_policy_rejected_total 1.0" in metrics
        assert 'rlt2t_policy_service_time_seconds_per{feature="row_step"} 10.0' in metrics
        assert "rlt2t_policy_running_cost 0.0" in metrics  # nothing on the worker between requests


def test_the_reward_route_answers_429_for_work_predicted_too_slow(serve_cfg):
    body = {"candidates": ["1 2 3"] * 4, "references": ["1 2 4"] * 4, "metrics": ["task_score"]}
    with TestClient(reward_app.create_app(serve_cfg)) as c:
        assert c.app.state.batcher.timing.calibrated
        assert c.post("/v1/reward", json=body).status_code == 200
    with TestClient(reward_app.create_app(serve_cfg)) as c:
        # 10 s per unit of reward work, before any request: every metric's model is forked from this one
        c.app.state.batcher.timing = slow_timing(10.0)
        r = c.post("/v1/reward", json=body)
        assert r.status_code == 429, r.text
        assert "4 candidates, 1 metrics" in r.json()["detail"] and r.json()["predicted_s"] > 120


def test_each_kind_of_call_learns_its_own_speed():
    """With timing_key, a kind of call far slower than calibrated (a reward model beside the task score) rescales
    its own model: its requests are refused, while the same work of another kind is still admitted."""

    def runner(delay_s: float):
        def run(backend, key, items, control):
            time.sleep(delay_s)
            return list(items)

        return run

    batcher = batcher_of(None, timing=slow_timing(1e-3), timing_key=lambda key: key)  # 10 rows: 0.012 s

    async def run():
        for _ in range(3):  # each call 0.3 s where 0.01 s was modelled: thirty times slower
            await batcher.submit("reward_model", ["x"], runner(0.3), work=[Work(rows=10.0)])
        with pytest.raises(TooSlow):  # predicted about 0.36 s
            await batcher.submit("reward_model", ["x"], runner(0.0), work=[Work(rows=10.0)],
                                 deadline=time.monotonic() + 0.2)
        return await batcher.submit("task_score", ["y"], runner(0.0), work=[Work(rows=10.0)],
                                    deadline=time.monotonic() + 0.2)

    results, _ = asyncio.run(run())
    batcher.stop()
    assert results == ["y"]
    assert batcher.timing.scale == pytest.approx(1.0)  # the calibrated model itself is left as it was


# -- fair sharing ----------------------------------------------------------------------------------------

def sharing_run(long_deadline_s: float | None) -> list[tuple]:
    """A long request (cost 100, 2 steps, 1000 row-steps: 12 s predicted) held in its call until a small one
    (cost 10, 50 row-steps: 0.6 s) waits; then both run to the end. Returns the backend's log."""
    hold = threading.Event()
    backend = LoggedBackend(hold=hold, steps=2, long_steps=2)
    batcher = batcher_of(backend, timing=slow_timing(0.01))

    async def run():
        deadline = time.monotonic() + long_deadline_s if long_deadline_s is not None else None
        long = asyncio.ensure_future(batcher.submit("long", ["L"], echo, costs=[100],
                                                    work=[Work(steps=2, rows=1000.0)], deadline=deadline))
        await asyncio.to_thread(backend.started.wait, 5)
        small = asyncio.ensure_future(batcher.submit("small", ["s"], echo, costs=[10], work=[Work(rows=50.0)]))
        await queued(batcher, 1)
        hold.set()
        await asyncio.gather(long, small)

    asyncio.run(run())
    batcher.stop()
    return backend.log


def test_a_long_call_keeps_the_share_its_deadline_needs():
    # nested seconds per own second: a quarter of the worker is kept in any case, more when the deadline needs it
    assert [nested_time_ratio(need) for need in (0.0, 0.1, 0.25, 0.5, 0.8, 1.0, 3.0)] == \
        pytest.approx([3.0, 3.0, 3.0, 1.0, 0.25, 0.0, 0.0])


def test_a_small_request_completes_inside_a_long_call():
    log = sharing_run(long_deadline_s=None)
    small_end, long_end = log.index(("end", ("s",))), log.index(("end", ("L",)))
    assert log.index(("start", ("s",))) > log.index(("step", ("L",), 0))  # after the long call's first step
    assert small_end < long_end
    assert any(entry[:2] == ("step", ("L",)) for entry in log[small_end:long_end])  # the long call went on


def test_a_long_request_whose_deadline_has_no_room_lets_no_small_request_in():
    """12 s predicted, 12.5 s to its deadline: the small request's 0.6 s would not fit in its slack, so the small
    one waits for the long call to end (and then runs)."""
    log = sharing_run(long_deadline_s=12.5)
    assert log.index(("end", ("L",))) < log.index(("start", ("s",)))
    assert log[-1] == ("end", ("s",))


def test_the_most_urgent_job_goes_first_when_the_queue_order_would_make_it_late():
    """A split request with little slack (2 calls of 1.2 s, admitted with 0.1 s to spare behind a running 1.2 s
    call) takes its second turn before a longer request queued meanwhile (3.6 s), which would make it late."""
    hold = threading.Event()
    backend = LoggedBackend(hold=hold)
    batcher = batcher_of(backend, timing=slow_timing(0.01), max_call_cost=10, max_batch_size=1)

    async def run():
        running = asyncio.ensure_future(batcher.submit("k", ["x"], echo, costs=[10], work=[Work(rows=100.0)]))
        await asyncio.to_thread(backend.started.wait, 5)
        tight = asyncio.ensure_future(batcher.submit("k", ["h1", "h2"], echo, costs=[10, 10],
                                                     work=[Work(rows=100.0)] * 2, deadline=time.monotonic() + 3.7))
        await queued(batcher, 2)
        roomy = asyncio.ensure_future(batcher.submit("k", ["b1"], echo, costs=[10], work=[Work(rows=300.0)]))
        await queued(batcher, 3)
        hold.set()
        await asyncio.gather(running, tight, roomy)

    asyncio.run(run())
    batcher.stop()
    starts = [entry[1][0] for entry in backend.log if entry[0] == "start"]
    assert starts == ["x", "h1", "h2", "b1"]  # taking turns would have run x, h1, b1, h2


# -- deadlines -------------------------------------------------------------------------------------------

def test_the_deadline_stops_a_running_call_at_its_next_step():
    hold = threading.Event()
    backend = LoggedBackend(hold=hold, steps=50)
    batcher = batcher_of(backend)  # no model yet: nothing refused, the deadline is what stops it

    async def run():
        deadline = time.monotonic() + 0.05
        task = asyncio.ensure_future(batcher.submit("k", ["late", "late-too"], echo, deadline=deadline))
        await asyncio.to_thread(backend.started.wait, 5)
        while time.monotonic() <= deadline:  # the deadline passes while the call is held before its first step
            await asyncio.sleep(0.01)
        hold.set()
        with pytest.raises(Overloaded, match=DEADLINE_PASSED):
            await task

    asyncio.run(run())
    batcher.stop()
    assert backend.stopped_at == {"late": 0, "late-too": 0}  # their rows left at the first step
    assert [e for e in backend.log if e[0] == "step"] == [("step", ("late", "late-too"), 0)]


# -- memory ----------------------------------------------------------------------------------------------

def test_memory_is_released_after_heavy_work_only():
    released = []
    batcher = Batcher(LoggedBackend(), max_batch_size=1, max_wait_ms=0, max_queue_cost=10_000, max_call_cost=1000,
                      release=lambda: released.append(True), release_after_cost=100)

    async def run():
        await batcher.submit("k", ["a"], echo, costs=[60])
        await batcher.submit("k", ["b"], echo, costs=[30])
        await batcher.submit("k", ["c"], echo, costs=[30])  # 120 since the start: one release
        await batcher.submit("k", ["d"], echo, costs=[60])

    asyncio.run(run())
    batcher.stop()  # joins the worker: the release after the last call has happened, if due
    assert released == [True]


def test_the_policy_server_releases_memory_after_heavy_requests(serve_cfg, checkpoint_root, monkeypatch):
    released = []
    monkeypatch.setattr(policy_app, "release_memory", lambda: released.append(True))
    cfg = serve_cfg.model_copy(update={"serve": serve_cfg.serve.model_copy(update={"max_call_cost": 50})})
    with TestClient(policy_app.create_app(cfg, checkpoint_dir=checkpoint_root)) as c:
        # 6 candidates x (3 source tokens + 8 new) = 66 >= half serve.max_call_cost: heavy
        r = c.post("/v1/candidates", json={"sources": ["1 2 3"], "num_candidates": 6, "max_new_tokens": 8})
        assert r.status_code == 200
    assert released == [True]


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_release_memory_trims_the_c_heap_on_glibc():
    assert memory.release_memory() is True
