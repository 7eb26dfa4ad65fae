"""The cluster-capacity check of the RL job (rlt2t.groups), on made-up cluster resources: no Ray."""

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
