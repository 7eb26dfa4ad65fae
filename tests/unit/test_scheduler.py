from __future__ import annotations

import pytest

from rlt2t.scheduler import mask_version, needed_version


def test_epoch_refresh_samples_with_the_epoch_start_weights():
    assert [needed_version(s, 20, 0) for s in (20, 25, 39)] == [20, 20, 20]


@pytest.mark.parametrize("refresh", [1, 2, 5])
def test_step_refresh_bounds_staleness(refresh):
    for step in range(60):
        v = needed_version(step, 0, refresh)
        assert v % refresh == 0 and v <= step
        if step >= 2 * refresh:  # after the first two intervals: between N and 2N-1 steps stale
            assert refresh <= step - v <= 2 * refresh - 1
    # monotone in the step, so chunks dispatched in order never need an older version than earlier ones
    versions = [needed_version(s, 0, refresh) for s in range(60)]
    assert versions == sorted(versions)


# --------------------------------------------------------------------------------------------------
# EpochScheduler with fake rollout, reward and learner results (no Ray)
# --------------------------------------------------------------------------------------------------

from dataclasses import dataclass  # noqa: E402

from rlt2t.common.data import Example  # noqa: E402
from rlt2t.scheduler import Chunk, ChunkFailed, EpochScheduler, PoolState  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class Item:
    """A scored item as the reward workers return it (only what the scheduler reads)."""

    example_id: str
    policy_version: int
    mask_version: int | None = None


def make(n_chunks=4, chunk=2, batch=4, learners=1, inflight=8, ordered=True, rollouts=2, rewards=1, attempts=2,
         versions=None, masks=None, **kw) -> tuple[EpochScheduler, Clock]:
    clock = Clock()
    chunks = [Chunk(i, [Example(id=f"{i}-{j}", source="1", target="2") for j in range(chunk)],
                    (versions or [0] * n_chunks)[i], masks[i] if masks else None) for i in range(n_chunks)]
    sched = EpochScheduler(chunks, step=0, batch_size=batch, learners=learners, max_inflight_chunks=inflight,
                           ordered=ordered, rollouts=PoolState(rollouts, clock), rewards=PoolState(rewards, clock),
                           max_attempts=attempts, clock=clock, **kw)
    return sched, clock


def scored(chunk: Chunk) -> list[Item]:
    return [Item(e.id, chunk.version, chunk.mask_version) for e in chunk.examples]


def finish(sched: EpochScheduler, index: int) -> None:
    """Rollout then reward of chunk ``index`` succeed."""
    d = sched.rollout_done(index, 0)
    sched.reward_done(index, d.worker, scored(sched.chunks[index]))


def test_dispatch_is_bounded_and_spreads_over_the_least_busy_workers():
    sched, _ = make(n_chunks=5, inflight=3)
    sent = sched.rollout_dispatches(published={0})
    assert [d.chunk.index for d in sent] == [0, 1, 2]  # the in-flight bound
    assert [d.worker for d in sent] == [0, 1, 0]
    assert sched.rollouts.busy == [2, 1]
    assert sched.rollout_dispatches(published={0}) == []


def test_a_chunk_waits_for_its_weights_version():
    sched, _ = make(n_chunks=3, versions=[0, 0, 2])
    assert [d.chunk.index for d in sched.rollout_dispatches(published={0})] == [0, 1]
    assert sched.blocked_version() == 2
    assert [d.chunk.index for d in sched.rollout_dispatches(published={0, 2})] == [2]


def test_out_of_order_completions_reach_the_learner_in_dataset_order():
    sched, _ = make(n_chunks=4, chunk=2, batch=4)
    sched.rollout_dispatches(published={0})
    for index in (2, 1, 3):  # chunk 0 is slow
        finish(sched, index)
    assert sched.next_batch() is None  # nothing may overtake chunk 0
    finish(sched, 0)
    first = sched.next_batch()
    assert [i.example_id for i in first.items] == ["0-0", "0-1", "1-0", "1-1"]
    second = sched.next_batch()
    assert [i.example_id for i in second.items] == ["2-0", "2-1", "3-0", "3-1"]
    assert sched.stats.out_of_order == 0


def test_unordered_mode_takes_chunks_as_they_come_and_counts_it():
    sched, _ = make(n_chunks=2, chunk=2, batch=2, ordered=False)
    sched.rollout_dispatches(published={0})
    finish(sched, 1)
    batch = sched.next_batch()
    assert [i.example_id for i in batch.items] == ["1-0", "1-1"]
    assert sched.stats.out_of_order == 1


def make_planned(n_chunks: int, chunk_steps: int, refresh: int, mask_every: int = 0, **kw):
    """An epoch planned as the driver plans it: batches of one source, chunks of ``chunk_steps`` learner steps,
    each chunk's version (and NLPO mask) that of its first step."""
    versions = [needed_version(i * chunk_steps, 0, refresh) for i in range(n_chunks)]
    masks = [mask_version(v, mask_every) for v in versions] if mask_every else None
    return make(n_chunks=n_chunks, chunk=chunk_steps, batch=1, versions=versions, masks=masks,
                refresh_every_steps=refresh, mask_every=mask_every, **kw)


def _train_one_step(sched: EpochScheduler) -> int:
    assert sched.next_batch() is not None
    return sched.step_done()


def test_a_scored_chunk_keeps_its_version_for_a_run_resumed_before_it_trains():
    sched, _ = make_planned(6, 1, refresh=1)  # versions 0, 0, 1, 2, 3, 4
    sched.rollout_dispatches(published={0})
    finish(sched, 0)
    finish(sched, 1)
    assert _train_one_step(sched) == 1
    assert sched.oldest_needed_version() == 0  # chunk 1 trains next: a run resumed here samples it with 0
    sched.rollout_dispatches(published={0, 1})
    finish(sched, 2)  # scored ahead of the learner
    assert _train_one_step(sched) == 2
    # chunk 2 is scored, but a run resumed at step 2 samples it again with version 1
    assert sched.oldest_needed_version() == 1


def test_a_redispatched_chunk_behind_the_learner_keeps_its_version():
    sched, clock = make_planned(4, 1, refresh=1, ordered=False)  # versions 0, 0, 1, 2
    sched.rollout_dispatches(published={0, 1, 2})
    sched.task_failed("rollout", 0, 0, unavailable=False, error="worker died")
    for index in (1, 2, 3):
        finish(sched, index)
    for _ in range(3):
        _train_one_step(sched)  # unordered: chunks 1-3 train first
    assert sched.step == 3 and needed_version(3, 0, 1) == 2
    assert sched.oldest_needed_version() == 0  # chunk 0's re-dispatch samples with version 0
    clock.now += 1
    (retry,) = sched.rollout_dispatches(published={0, 1, 2})
    finish(sched, retry.chunk.index)
    assert sched.oldest_needed_version() == 2  # only what a resumed run needs
    assert sched.stats.out_of_order == 3  # chunks 1-3 overtook chunk 0; chunk 0 itself is not one (it counted 4)


def test_without_deterministic_mode_a_chunk_sampled_again_takes_the_weights_the_learner_needs_now():
    """A chunk whose worker died after the learner moved on is sampled again with the version the learner's
    position needs (one worker dying three times handed the learner samples 7 steps stale at N = 1); the
    stalest items train first. In deterministic mode it keeps its planned version (its seeds depend on it)."""
    for ordered in (False, True):
        sched, clock = make_planned(8, 1, refresh=1, ordered=ordered, attempts=5)  # versions 0, 0, 1, ..., 6
        sched.rollout_dispatches(published={0, 1})
        for index in (1, 2):
            finish(sched, index)
        if not ordered:
            for _ in range(2):
                _train_one_step(sched)  # chunks 1 and 2
        sched.task_failed("rollout", 0, 0, unavailable=False, error="worker died")
        clock.now += 1
        (retry,) = [d for d in sched.rollout_dispatches(published={0, 1}) if d.chunk.index == 0]
        assert retry.chunk.version == (0 if ordered else needed_version(2, 0, 1))  # 0, or 1 at step 2
        if not ordered:
            sched.rollout_dispatches(published={0, 1, 2, 3})
            finish(sched, 3)
            finish(sched, 4)
            assert [i.example_id for i in sched.next_batch().items] == ["3-0"]
            sched.step_done()
            finish(sched, 0)  # version 1, behind chunk 4's 3 in the queue: it trains first
            batch = sched.next_batch()
            assert [i.example_id for i in batch.items] == ["0-0"] and batch.staleness_max == 2


def test_chunks_longer_than_a_refresh_never_drop_a_version_the_learner_has_not_reached():
    # chunks of 4 steps, refresh every step: versions 0, 3, 7; once chunk 0 is scored the chunks alone would
    # allow dropping versions 1 and 2 before the learner publishes them
    sched, _ = make_planned(3, 4, refresh=1)
    sched.rollout_dispatches(published={0})
    finish(sched, 0)
    for step in range(1, 4):
        assert _train_one_step(sched) == step
        assert sched.oldest_needed_version() == needed_version(step, 0, 1) <= step


def test_an_nlpo_masking_version_is_kept_while_a_chunk_or_a_resumed_run_needs_it():
    sched, _ = make_planned(14, 1, refresh=1, mask_every=10)
    published = set(range(14))
    sched.rollout_dispatches(published=published)
    for index in range(14):
        finish(sched, index)
    for step in range(1, 14):
        assert _train_one_step(sched) == step
        # the resumed run's next chunk samples with step - 1 and masks with the last multiple of 10 below it
        assert sched.oldest_needed_version() == (0 if step <= 10 else 10)


def test_a_late_nlpo_chunk_keeps_its_masking_policy_until_a_learner_step_takes_it():
    # Unordered: chunk 3 (masked by version 0) is scored after the learner passed step 10; the step that trains
    # on it is sent version 0's weights, so they must not be dropped while it waits in the reorder buffer.
    sched, _ = make_planned(14, 1, refresh=1, mask_every=10, ordered=False)
    sched.rollout_dispatches(published=set(range(14)))
    for index in range(14):
        if index != 3:
            finish(sched, index)
    for step in range(1, 13):
        assert _train_one_step(sched) == step
    assert [i.example_id for i in sched.next_batch().items] == ["13-0"]  # queued before chunk 3 arrived
    finish(sched, 3)
    assert sched.chunks[3].mask_version == 0 and sched.oldest_needed_version() == 0
    sched.step_done()
    assert sched.oldest_needed_version() == 0  # chunk 3's item waits for the next step
    batch = sched.next_batch()
    assert [i.example_id for i in batch.items] == ["3-0"] and batch.items[0].mask_version == 0
    assert sched.oldest_needed_version() == 10  # in a learner step now: Ray holds the weights it was sent


def test_a_failed_chunk_goes_to_a_healthy_worker_at_once():
    sched, clock = make(n_chunks=1, rollouts=2)
    sched.rollout_dispatches(published={0})
    assert sched.task_failed("rollout", 0, 0, unavailable=False, error="worker died") <= clock.now
    (retry,) = sched.rollout_dispatches(published={0})
    assert retry.worker == 1  # worker 0 cools down


def test_a_failed_chunk_is_redispatched_after_the_cooldown_and_nothing_is_lost_or_reused():
    sched, clock = make(n_chunks=2, chunk=2, batch=2, rollouts=1)
    sched.rollout_dispatches(published={0})
    when = sched.task_failed("rollout", 0, 0, unavailable=False, error="worker died")
    assert when == clock.now + 0.5 and sched.rollouts.cooldown_until[0] == when
    assert sched.retry_wait() == 0.5
    assert sched.rollout_dispatches(published={0}) == []  # not yet due
    clock.now = when
    (retry,) = sched.rollout_dispatches(published={0})
    assert retry.chunk.index == 0 and retry.chunk.attempts == 1
    finish(sched, 0)
    finish(sched, 1)
    ids = [i.example_id for _ in range(2) for i in sched.next_batch().items]
    assert ids == ["0-0", "0-1", "1-0", "1-1"]
    assert sched.stats.redispatched == 1
    with pytest.raises(RuntimeError, match="delivered twice"):
        sched.reward_done(1, 0, [])


def test_exhausted_retries_fail_the_job_naming_the_chunk():
    sched, clock = make(n_chunks=1, attempts=2)
    sched.rollout_dispatches(published={0})
    sched.task_failed("rollout", 0, 0, unavailable=False, error="boom")
    clock.now += 100
    sched.rollout_dispatches(published={0})
    with pytest.raises(ChunkFailed, match="chunk 0 failed 2 times.*boom"):
        sched.task_failed("reward", 0, 0, unavailable=False, error="boom")


def test_refusals_by_a_restarting_worker_are_bounded_apart_from_failures():
    sched, clock = make(n_chunks=1, attempts=1, max_unavailable=3)
    for _ in range(3):
        sched.rollout_dispatches(published={0})
        sched.task_failed("rollout", 0, 0, unavailable=True, error="restarting")
        clock.now += 100
    assert sched.chunks[0].attempts == 0
    sched.rollout_dispatches(published={0})
    with pytest.raises(ChunkFailed, match="refused 4 times"):
        sched.task_failed("rollout", 0, 0, unavailable=True, error="restarting")


def test_cooldown_doubles_per_consecutive_failure_and_resets_on_success():
    clock = Clock()
    pool = PoolState(2, clock)
    for expected in (0.5, 1.0, 2.0):
        pool.started(0)
        pool.finished(0, ok=False)
        assert pool.cooldown_until[0] == clock.now + expected
    assert pool.pick() == 1  # worker 0 is cooling down
    pool.started(0)
    pool.finished(0, ok=True)
    assert pool.failures[0] == 0


def test_the_tail_batch_smaller_than_the_learner_group_gives_every_rank_an_item():
    sched, _ = make(n_chunks=1, chunk=3, batch=4, learners=4)
    sched.rollout_dispatches(published={0})
    finish(sched, 0)
    batch = sched.next_batch()  # the epoch's tail: 3 items for 4 ranks
    assert batch.size == 3 and [i.example_id for i in batch.items] == ["0-0", "0-1", "0-2", "0-0"]
    assert sched.stats.items_used == 3


def test_staleness_is_measured_at_the_step_the_batch_trains_at_and_two_steps_queue_at_most():
    sched, _ = make(n_chunks=6, chunk=2, batch=2, versions=[0] * 6)
    sched.rollout_dispatches(published={0})
    for i in range(6):
        finish(sched, i)
    a, b = sched.next_batch(), sched.next_batch()
    assert (a.step, a.staleness_max, b.step, b.staleness_max) == (0, 0, 1, 1)
    assert sched.next_batch() is None  # two queued: one running, one waiting
    assert sched.step_done() == 1
    c = sched.next_batch()
    assert (c.step, c.staleness_mean) == (2, 2.0)


def test_no_step_is_queued_behind_one_the_driver_acts_after():
    sched, _ = make(n_chunks=4, chunk=2, batch=2, save_every_steps=1)
    sched.rollout_dispatches(published={0})
    for i in range(4):
        finish(sched, i)
    assert sched.next_batch() is not None
    assert sched.next_batch() is None  # step 1 is a checkpoint: the driver acts before step 2 is queued
    sched.step_done()
    assert sched.next_batch() is not None


def test_stop_after_steps_finishes_the_epoch_early():
    sched, _ = make(n_chunks=4, chunk=2, batch=2, stop_after_steps=1)
    sched.rollout_dispatches(published={0})
    for i in range(4):
        finish(sched, i)
    sched.next_batch()
    assert sched.next_batch() is None
    sched.step_done()
    assert sched.stopped and sched.finished
    sched.check_complete()  # a stopped run may leave chunks unused


def test_an_epoch_that_ends_with_chunks_unused_is_an_error():
    sched, _ = make(n_chunks=2, chunk=2, batch=2)
    sched.rollout_dispatches(published={0})
    finish(sched, 0)
    sched.next_batch()
    sched.step_done()
    with pytest.raises(RuntimeError, match="1 of 2 chunks unused"):
        sched.check_complete()


def test_no_step_is_queued_behind_an_nlpo_mask_refresh():
    """The driver publishes the masking policy after every nlpo_mask_refresh_steps-th step: a step queued
    behind it would run first, and the weights shipped as that version would be the next step's."""
    sched, _ = make_planned(6, 1, refresh=4, mask_every=2)
    sched.rollout_dispatches(published={0, 4})
    for index in range(6):
        finish(sched, index)
    assert _train_one_step(sched) == 1
    assert sched.next_batch() is not None  # step 2 queued (the one after step 1 runs)
    assert sched.next_batch() is None  # nothing behind step 2: its weights become mask version 2
    assert sched.step_done() == 2 and sched.next_batch() is not None


def _planned_by_the_driver(ordered: bool, trained=None, step=0):
    from types import SimpleNamespace

    from rlt2t.common.config import load_config
    from rlt2t.driver import _Job

    cfg = load_config(["tiny"], ["rl.batch_size=4", "rl.chunk_size=4", "rl.algorithm=grpo", "rl.refresh_every_steps=1"])
    examples = [Example(id=str(i), source=f"s{i}", target=f"t{i}") for i in range(16)]
    job = SimpleNamespace(cfg=cfg)
    if trained is None:  # as the driver does for a checkpoint without the list: the order's prefix
        trained = _Job._trained_prefix(job, examples, 0, step)
    chunks = _Job._plan(job, examples, 0, 0, step, 4, 8, trained)
    sched = EpochScheduler(chunks, step=step, batch_size=4, learners=1, max_inflight_chunks=8, ordered=ordered,
                           rollouts=PoolState(1), rewards=PoolState(1), max_attempts=3, refresh_every_steps=1,
                           save_every_steps=1, trained_ids=list(trained or ()))
    return chunks, sched


def test_a_run_without_deterministic_mode_resumes_mid_epoch_with_nothing_lost_or_trained_twice():
    """Out of order, a step trains on whichever chunk was scored first: the checkpoint names the ids trained
    (``trained_ids``), and the resumed run plans the epoch's other sources, each once."""
    chunks, sched = _planned_by_the_driver(ordered=False)
    epoch = [e.id for c in chunks for e in c.examples]
    sched.rollout_dispatches({0, 1, 2})
    finish(sched, 2)  # a fast worker: chunk 2 trains at step 0, then chunk 0
    assert _train_one_step(sched) == 1
    finish(sched, 0)
    assert _train_one_step(sched) == 2
    trained = list(sched.trained_ids)
    assert trained == [e.id for e in chunks[2].examples + chunks[0].examples]
    # killed here; the run resumes from the step-2 checkpoint
    resumed, sched2 = _planned_by_the_driver(ordered=False, trained=trained, step=2)
    rest = [e.id for c in resumed for e in c.examples]
    assert sorted(trained + rest, key=int) == sorted(epoch, key=int)  # every source once
    sched2.rollout_dispatches({0, 1, 2})
    for index in range(len(resumed)):
        finish(sched2, index)
    _train_one_step(sched2)
    assert sched2.trained_ids[:8] == trained and len(set(sched2.trained_ids)) == 12
    # a checkpoint's list that does not fit this epoch (other data, batch size or seed) is refused
    with pytest.raises(RuntimeError, match="written for other data"):
        _planned_by_the_driver(ordered=False, trained=["0", "1", "2", "99"], step=1)


def test_in_deterministic_mode_the_resumed_plan_is_the_rest_of_the_epochs_order():
    chunks, _ = _planned_by_the_driver(ordered=True)
    resumed, sched = _planned_by_the_driver(ordered=True, step=2)
    assert [e.id for c in resumed for e in c.examples] == [e.id for c in chunks[2:] for e in c.examples]
    # the next checkpoint names every source of the epoch trained so far, those before the resume included,
    # so a later resume is right in either mode
    sched.rollout_dispatches({0, 1, 2})
    finish(sched, 0)
    _train_one_step(sched)
    assert sched.trained_ids == [e.id for c in chunks[:3] for e in c.examples]
    again, _ = _planned_by_the_driver(ordered=False, trained=sched.trained_ids, step=3)
    assert [e.id for c in again for e in c.examples] == [e.id for c in chunks[3:] for e in c.examples]
