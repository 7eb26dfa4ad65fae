"""The cluster-capacity check of the RL job (rlt2t.groups), on made-up cluster resources, and how a job starts
Ray (`ray.init` replaced): no Ray."""

from __future__ import annotations

import pytest

from rlt2t.common.config import load_config
from rlt2t.groups import ClusterTooSmall, check_fits, job_demands


def test_the_default_job_does_not_fit_a_two_cpu_head_and_the_message_names_the_settings():
    cfg = load_config()
    with pytest.raises(ClusterTooSmall) as err:
        check_fits(job_demands(cfg), {"CPU": 2.0}, {"CPU": 2.0})
    message = str(err.value)
    assert "CPU: the job asks for 2.5" in message and "but the cluster has 2 in all" in message
    for setting in ("rl.learners=1", "rl.learner_cpus=1", "rl.rollout_workers=1", "rl.rollout_cpus=1",
                    "rl.reward_workers=1", "rl.reward_cpus=0.5"):
        assert setting in message
    check_fits(job_demands(cfg), {"CPU": 3.0}, {"CPU": 3.0})  # what `make ray-up` starts on 2 cores


def test_one_actor_larger_than_every_node_and_missing_gpus_are_reported():
    cfg = load_config(overrides=["rl.learner_gpus=1", "rl.learner_cpus=4"])
    with pytest.raises(ClusterTooSmall) as err:
        check_fits(job_demands(cfg), {"CPU": 8.0}, {"CPU": 2.0})
    message = str(err.value)
    assert "GPU: the job asks for 1 (rl.learners=1 x (rl.learner_cpus=4, rl.learner_gpus=1" in message
    assert "CPU: one of rl.learners=1" in message and "more than any node offers (2)" in message


def test_a_deployed_policy_server_counts_too():
    cfg = load_config(overrides=["serve.num_cpus=1"])
    check_fits(job_demands(cfg), {"CPU": 3.0}, {"CPU": 3.0})
    with pytest.raises(ClusterTooSmall, match=r"the policy server \(serve.num_cpus=1"):
        check_fits(job_demands(cfg, policy_server=True), {"CPU": 3.0}, {"CPU": 3.0})


def test_reward_workers_with_a_gpu_count_in_the_jobs_gpus():
    cfg = load_config(overrides=["rl.reward_gpus=0.5", "rl.reward_workers=2"])
    with pytest.raises(ClusterTooSmall, match=r"GPU: the job asks for 1 \(rl.reward_workers=2 x \(rl.reward_cpus=0.5, "
                                              r"rl.reward_gpus=0.5\)\)"):
        check_fits(job_demands(cfg), {"CPU": 8.0}, {"CPU": 8.0})


def test_each_learner_rank_is_sent_a_masking_policy_once_in_the_order_it_loads_them():
    from types import SimpleNamespace

    import rlt2t.groups as groups

    group = object.__new__(groups.LearnerGroup)  # only the bookkeeping: no Ray
    group._masks_held = [None, None]

    def shard(*versions):
        return [SimpleNamespace(mask_version=v) for v in versions]

    assert group._masks_to_send(0, shard(0, 0)) == [0]
    assert group._masks_to_send(0, shard(0)) == []  # held
    assert group._masks_to_send(1, shard(0, 10)) == [0, 10]  # another rank holds its own
    assert group._masks_to_send(1, shard(0, 10)) == [0, 10]  # it ends with 10 loaded: 0 is sent again
    assert group._masks_to_send(0, shard(10, None)) == [10]
    assert group._masks_held == [10, 10]


def test_the_embedded_cluster_starts_in_the_workers_environment_and_a_joined_one_gets_it_as_a_runtime_env(
        monkeypatch):
    """An embedded Ray's processes inherit WORKER_ENV from the environment `ray.init` starts them in (then the
    workers Ray starts ahead of the job are the job's: a runtime_env would leave them idle), the driver's own
    environment as it was after it; a cluster at RAY_ADDRESS, whose processes exist already, gets a runtime_env."""
    import os

    import ray

    import rlt2t.groups as groups

    calls: list[tuple[dict, dict]] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append((kw, {k: os.environ.get(k) for k in groups.WORKER_ENV})))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")  # the user's own value, back after the start
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    groups.init_ray(load_config())
    kwargs, seen = calls.pop()
    assert "runtime_env" not in kwargs and seen == groups.WORKER_ENV
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true" and "TRANSFORMERS_VERBOSITY" not in os.environ

    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    groups.init_ray(load_config())
    kwargs, seen = calls.pop()
    assert kwargs["runtime_env"] == {"env_vars": groups.WORKER_ENV} and seen["TOKENIZERS_PARALLELISM"] == "true"
