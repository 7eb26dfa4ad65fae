"""Rank RL on a real (embedded) Ray: DDP learner ranks, determinism, worker faults, resume after a kill."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import ray
import torch

from rlt2t.common.checkpoint import latest_complete_checkpoint
from rlt2t.common.config import ModelConfig, RLConfig, load_config
from rlt2t.common.policy import load_policy
from rlt2t.common.types import ScoredPair
from rlt2t.learner.learner import Learner

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"


def _weights(path: Path) -> dict[str, torch.Tensor]:
    model = load_policy(ModelConfig(), checkpoint=path).model
    return {k: v.clone() for k, v in model.state_dict().items()}


def _pairs(n: int, seed: int = 0) -> list[ScoredPair]:
    g = torch.Generator().manual_seed(seed)

    def text(k: int) -> str:
        return " ".join(str(int(x)) for x in torch.randint(0, 60, (k,), generator=g))

    out = []
    for i in range(n):
        gold, b = text(4), text(5)
        out.append(ScoredPair(example_id=str(i), source=text(8), reference=gold, a=gold, b=b, score_a=1.0,
                              score_b=0.0, use_rank=bool(i % 4), policy_version=0))
    return out


def test_two_ddp_ranks_stay_identical_and_match_one_rank(ray_session, ids_tokenizer_dir, tmp_path):
    policy = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0)
    policy.model.save_pretrained(tmp_path / "init")
    policy.tokenizer.save_pretrained(tmp_path / "init")
    cfg = RLConfig(algorithm="rank", lr=1e-3, warmup_ratio=0.0, batch_size=16, learners=2)
    kwargs = dict(init_checkpoint=str(tmp_path / "init"), total_steps=10, seed=0, max_source_len=32, max_target_len=16)
    actor = ray.remote(Learner).options(num_cpus=1)
    ranks = [actor.remote(ModelConfig(dropout=0.0), None, cfg, rank=i, world_size=2, **kwargs) for i in range(2)]
    rendezvous = ranks[0].rendezvous_address.remote()
    ray.get([r.join.remote(rendezvous) for r in ranks])
    single = Learner(ModelConfig(dropout=0.0), None, cfg.model_copy(update={"learners": 1}), rank=0, world_size=1,
                         **kwargs)
    # Equal token counts per shard make the DDP gradient average equal the single-rank batch gradient.
    batches = [_pairs(16, seed=s) for s in range(4)]
    for pairs in batches:
        ddp = ray.get([r.train_step.remote(pairs[i::2]) for i, r in enumerate(ranks)])
        one = single.train_step(pairs[0::2] + pairs[1::2])
        assert ddp[0] == ddp[1], "logged scalars must be reduced across ranks"
        assert abs(ddp[0]["ce"] - one["ce"]) < 0.05 * one["ce"]
    w0, w1 = ray.get([r.weights.remote() for r in ranks])
    assert all(torch.equal(w0[k], w1[k]) for k in w0), "DDP ranks diverged"
    ws = single.weights()
    assert max((w0[k] - ws[k]).abs().max().item() for k in w0) < 5e-3
    moved = max((w0[k] - policy.model.state_dict()[k]).abs().max().item() for k in w0)
    assert moved > 1e-3, "the learner did not train"
    for r in ranks:
        ray.kill(r)


def _config(run: Path, *extra: str):
    return load_config([TINY], [f"run.dir={run}", "rl.epochs=2", "rl.train_subset=96", "rl.batch_size=16",
                                "rl.chunk_size=8", "run.log_every=1", *extra])


def _run_rank(cfg, **kw):
    from rlt2t.jobs import rl_job

    return rl_job(cfg, **kw)


def _start_in_thread(cfg) -> tuple[threading.Thread, dict]:
    """Run the rank job in a thread; its result or exception lands in the returned dict."""
    box: dict = {}

    def target():
        try:
            box["result"] = _run_rank(cfg)
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            box["error"] = e

    job = threading.Thread(target=target)
    job.start()
    return job, box


def _kill_child(title_prefix: str) -> int | None:
    """SIGKILL a process of this session's Ray whose title (Ray: "ray::Class.method") starts so."""
    for proc in psutil.Process().children(recursive=True):
        try:
            if any(part.startswith(title_prefix) for part in proc.cmdline()):
                os.kill(proc.pid, signal.SIGKILL)
                return proc.pid
        except psutil.Error:
            continue
    return None



@pytest.fixture(scope="module")
def reference_run(ray_session, copy_prepared, tmp_path_factory):
    """An uninterrupted run: the weights every other run of the same config must reproduce exactly."""
    run = copy_prepared(tmp_path_factory.mktemp("ref") / "run")
    result = _run_rank(_config(run, "rl.save_every_steps=2"))
    assert result.steps == 12 and result.items_used == 2 * 96 and result.redispatched == 0
    return _weights(result.checkpoint)


def test_step_refresh_publishes_weights_and_bounds_staleness(ray_session, copy_prepared, tmp_path, caplog):
    import json

    run = copy_prepared(tmp_path / "refresh")
    cfg = _config(run, "rl.refresh_every_steps=2", "rl.epochs=1", "rl.preflight=true")  # off by default on CPU
    with caplog.at_level("INFO", logger="rlt2t.train"):
        result = _run_rank(cfg)
    # The learner's preflight ran on the largest batch (16 pairs, tiny.yaml's max lengths) before step 1.
    preflight = [r.getMessage() for r in caplog.records if "learner preflight" in r.getMessage()]
    assert len(preflight) == 1 and "16 sources per rank" in preflight[0], preflight
    assert result.steps == 6
    rows = [json.loads(x) for x in (run / "logs" / "rl" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 6
    assert max(r["staleness_max"] for r in train) <= 3  # 2N - 1 with N = 2
    assert any(r["staleness_max"] >= 2 for r in train)
    assert (run / "logs" / "rl" / "curves.png").is_file()
    # Validation records the variety of the greedy outputs and warns exactly when they have collapsed.
    from rlt2t.jobs import load_split
    from rlt2t.learner.evaluate import collapse_warning

    valid = load_split(cfg, "valid")[: cfg.metric.monitor_size]
    [epoch] = result.history
    assert 0 < epoch["distinct_outputs"] <= 1
    collapsed = collapse_warning("rl epoch 1/1", epoch["distinct_outputs"], valid, "")
    warned = [r for r in caplog.records if r.getMessage().startswith("rl epoch 1/1: the greedy outputs")]
    assert len(warned) == (collapsed is not None)


def test_learner_death_fails_clearly_and_resumes_bitwise(ray_session, copy_prepared, reference_run, tmp_path):
    """Rank RL's resume is exact: killed mid-run, the job resumed from its newest complete checkpoint ends with
    the uninterrupted run's weights. (A rollout worker killed mid-task: test_pg_ray.py in deterministic mode,
    and the unordered test below for rank RL; the driver and its Ray SIGKILLed mid-run: test_pg_ray.py.)"""
    from rlt2t.groups import LearnerDied

    run = copy_prepared(tmp_path / "learner")
    cfg = _config(run, "rl.save_every_steps=2")
    job, box = _start_in_thread(cfg)
    root = run / "rl" / "checkpoints"
    deadline = time.time() + 600
    killed = None
    while killed is None and time.time() < deadline and job.is_alive():
        if latest_complete_checkpoint(root) is not None:
            killed = _kill_child("ray::Learner")
        time.sleep(0.05)
    job.join(timeout=600)
    assert killed, "the job finished before the learner could be killed"
    assert isinstance(box.get("error"), LearnerDied), box
    assert "learner rank failed" in str(box["error"])
    resumed = _run_rank(cfg, resume=True)
    assert resumed.steps == 12 and resumed.items_used < 2 * 96  # it went on from a checkpoint
    weights = _weights(resumed.checkpoint)
    assert all(torch.equal(reference_run[k], weights[k]) for k in reference_run), "resumed run differs"


def test_unordered_mode_with_a_dead_worker_uses_every_pair_once(ray_session, copy_prepared, tmp_path):
    """rl.deterministic=false: chunks go to the learner as they complete, yet none is lost or reused.

    Killing a rollout worker mid-task delays that chunk's re-dispatch while the other worker's chunks
    complete, so the learner receives them out of dataset order.
    """
    run = copy_prepared(tmp_path / "unordered")
    cfg = _config(run, "rl.deterministic=false", "rl.rollout_workers=2", "rl.epochs=1", "rl.chunk_size=4",
                  "rl.save_every_steps=2", "rl.keep_last=5")
    job, box = _start_in_thread(cfg)
    killed = None
    deadline = time.time() + 600
    while killed is None and time.time() < deadline and job.is_alive():
        killed = _kill_child("ray::RolloutWorker.sample_version")
        time.sleep(0.05)
    job.join(timeout=600)
    assert "error" not in box, box.get("error")  # the driver raises if a chunk is delivered twice or never
    assert killed is not None, "never found a rollout worker to kill"
    result = box["result"]
    assert result.redispatched >= 1
    assert result.items_used == 96 and result.steps == 6
    assert result.out_of_order >= 1, "the re-dispatched chunk should have arrived after later ones"

    # Killed after step 2 (its checkpoint the newest): the checkpoint names the sources steps 1-2 trained on,
    # which out of order are not the epoch's first 32, and the resumed run trains on the other 64, each once.
    import shutil

    from rlt2t.common.checkpoint import load_training_state

    ckpts = run / "rl" / "checkpoints"
    trained = load_training_state(ckpts / "step-000002")["trained_in_epoch"]
    assert len(trained) == len(set(trained)) == 32
    assert load_training_state(ckpts / "step-000004")["trained_in_epoch"][:32] == trained
    resumed_run = tmp_path / "unordered-resumed"
    shutil.copytree(run, resumed_run)
    for name in ("epoch-0001", "step-000004"):
        shutil.rmtree(resumed_run / "rl" / "checkpoints" / name)
    again = _run_rank(_config(resumed_run, "rl.deterministic=false", "rl.rollout_workers=2", "rl.epochs=1",
                              "rl.chunk_size=4", "rl.save_every_steps=1", "rl.keep_last=5"), resume=True)
    assert again.items_used == 64 and again.steps == 6
    through_step_5 = load_training_state(resumed_run / "rl" / "checkpoints" / "step-000005")["trained_in_epoch"]
    assert through_step_5[:32] == trained and len(set(through_step_5)) == 80  # none trained twice


def test_http_rollout_and_reward_sources_train_through_live_servers(ray_session, copy_prepared, tmp_path,
                                                                     live_server):
    """rollout.source=http + reward.source=http: the job samples on a policy server that hot-reloads the
    versions it publishes and scores on a reward server; every pair is used once."""
    import json

    from rlt2t.services import policy_app, reward_app

    run = copy_prepared(tmp_path / "http")
    # The policy server needs the first published version: start the job, wait for its first published
    # checkpoint, then start the servers it waits for.
    socks = [live_server.reserve(), live_server.reserve()]  # held until the servers serve on them
    policy_url, reward_url = (live_server.url_of(s) for s in socks)
    cfg = _config(run, "rl.epochs=2", "rl.train_subset=32", "rollout.source=http",
                  f"rollout.urls=[\"{policy_url}\"]", "reward.source=http", f"reward.url={reward_url}",
                  "serve.reload_interval_s=0.2", "rollout.timeout_s=120")
    job, box = _start_in_thread(cfg)
    published = run / "rl" / "published"
    deadline = time.time() + 300
    while latest_complete_checkpoint(published) is None and job.is_alive() and time.time() < deadline:
        time.sleep(0.1)
    assert latest_complete_checkpoint(published) is not None, box
    df = run / "rl" / "document_frequency.json"
    servers = [live_server(policy_app.create_app(cfg, checkpoint_dir=published), socks[0]),
               live_server(reward_app.create_app(cfg, document_frequency=df), socks[1])]
    with servers[0], servers[1]:
        job.join(timeout=600)
    assert "error" not in box, box.get("error")
    result = box["result"]
    assert result.items_used == 2 * 32 and result.steps == 4
    rows = [json.loads(x) for x in (run / "logs" / "rl" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    # Epoch 2's pairs come from the version published after epoch 1 (the server reloaded it).
    assert [p.name for p in sorted(published.iterdir()) if not p.name.startswith(".")] == ["step-000000", "step-000002"]
    # Epoch 2 asks for version 2: had the server not reloaded it, staleness would be 2 and 3.
    assert [r["staleness_max"] for r in train if r["epoch"] == 1] == [0, 1]


def test_a_tail_batch_smaller_than_the_learner_group_still_steps_every_rank(ray_session, copy_prepared, tmp_path):
    """33 sources, batch 16, 2 ranks: the last batch holds 1 pair; it is repeated so both ranks step."""
    run = copy_prepared(tmp_path / "tail")
    result = _run_rank(_config(run, "rl.learners=2", "rl.train_subset=33", "rl.epochs=1",
                               "rl.rollout_workers=1", "rl.learner_cpus=1"))
    assert result.steps == 3 and result.items_used == 33


def test_learner_group_fails_on_the_first_failed_rank_without_waiting_for_the_others(ray_session):
    """Under DDP a rank that raised leaves the others blocked in a collective: the group must not wait
    for them (here: one call fails at once, the other would take 10 minutes)."""
    from rlt2t.groups import LearnerDied, LearnerGroup

    @ray.remote(num_cpus=0)
    def stuck():
        time.sleep(600)

    @ray.remote(num_cpus=0)
    def out_of_memory():
        raise RuntimeError("learner rank 1: the largest batch it can receive does not fit in memory")

    slow = stuck.remote()
    t0 = time.monotonic()
    with pytest.raises(LearnerDied, match="does not fit in memory"):
        LearnerGroup._get(None, [slow, out_of_memory.remote()])
    assert time.monotonic() - t0 < 60
    ray.cancel(slow, force=True)


def test_a_rank_that_cannot_start_fails_the_groups_first_use_and_leaves_nothing(ray_session, tmp_path, caplog):
    """The group does not wait for its ranks to start (they start beside the rollout and reward workers): a rank
    whose constructor fails is reported, with its cause, when the learners are first used, or logged when the job
    stops on another error first; shutdown removes the group's placement group."""
    from ray.util import placement_group_table

    from rlt2t.groups import LearnerDied, LearnerGroup

    cfg = load_config([TINY], [f"run.dir={tmp_path}"])
    group = LearnerGroup(cfg, tmp_path / "no-such-checkpoint", 4, reference_checkpoint=tmp_path / "no-such-checkpoint")
    try:
        ray.wait(group._joining, num_returns=len(group._joining), timeout=300)  # the rank has failed by now
    finally:
        with caplog.at_level("WARNING", logger="rlt2t.train"):
            group.shutdown()  # as when the job stops on another error before using the learners
    assert any("failed before the job stopped" in r.getMessage() and "no-such-checkpoint" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert placement_group_table(group.pg)["state"] == "REMOVED"
    with pytest.raises(LearnerDied, match="no-such-checkpoint"):
        group.weights()


def test_a_preflight_out_of_memory_is_reported_as_a_setting_to_change(ray_session):
    """BatchTooLarge from a rank's preflight becomes a ValueError naming the settings (the CLI's clear
    error, exit 2), not a learner crash that suggests --resume."""
    from rlt2t.groups import LearnerGroup
    from rlt2t.learner.learner import BatchTooLarge

    @ray.remote(num_cpus=0)
    def preflight():
        raise BatchTooLarge("learner rank 0: the largest batch it can receive does not fit in memory on cuda:0: "
                            "32 sources (rl.batch_size=32 over rl.learners=1)")

    group = LearnerGroup.__new__(LearnerGroup)  # the group's bookkeeping only: no actors are needed
    group._joining, group._preflight = [], [preflight.remote()]
    with pytest.raises(ValueError, match=r"does not fit in memory.*rl\.batch_size=32") as err:
        group.check_preflight()
    assert "Traceback" not in str(err.value)
    group.check_preflight()  # checked once: nothing is left to wait for


def test_a_resumed_state_that_fails_to_load_stops_the_job_before_the_state_is_used(ray_session):
    """load_training_states does not wait (the load queues behind the preflight), so every later use of
    the learners' state (a step, weights, a checkpoint's training states, evaluation) confirms it first."""
    from rlt2t.groups import LearnerDied, LearnerGroup

    @ray.remote(num_cpus=0)
    def load_training_state():
        raise RuntimeError("loaded state_dict: size mismatch for exp_avg")

    group = LearnerGroup.__new__(LearnerGroup)  # bookkeeping only: with no ranks, nothing else is called
    group.ranks, group._joining, group._preflight = [], [], []
    group._loading = [load_training_state.remote()]
    with pytest.raises(LearnerDied, match="size mismatch for exp_avg"):
        group.training_states()
    assert group.training_states() == []  # confirmed once; the job has stopped by then anyway
