"""HTTP rollout/reward sources against stub servers (httpx.MockTransport): same contracts as the actors."""

from __future__ import annotations

import json

import httpx
import pytest

from rlt2t.common.candidates import candidate_set
from rlt2t.common.config import RewardConfig, RolloutConfig
from rlt2t.common.data import Example
from rlt2t.common.types import RolloutSpec
from rlt2t.services.remote_workers import HttpRewardWorker, HttpRolloutWorker

EXAMPLES = [Example(id="a", source="1 2 3", target="7 8"), Example(id="b", source="4 5", target="9")]


def _candidates_response(sources: list[str], k: int, version: int) -> dict:
    cands = [[{"text": f"{i} {j % 2}", "token_ids": [1], "logprobs": [-0.5], "total_logprob": -0.5,
               "sample_logprobs": [-0.5]} for j in range(k)] for i in range(len(sources))]
    return {"candidates": cands, "policy_version": version}


def _model_info(version: int) -> dict:
    return {"version": version, "checkpoint": "/c", "checksum": "x", "loaded_at": 0.0, "backend": "torch",
            "max_source_tokens": 255}


def test_rollout_waits_for_the_published_version_and_builds_candidate_sets():
    versions = iter([0, 0, 3])  # /v1/model: the server reloads version 3 on the third poll
    requests, polls = [], []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/model":
            polls.append(request.headers.get("authorization"))
            return httpx.Response(200, json=_model_info(next(versions)))
        body = json.loads(request.content)
        requests.append(body)
        return httpx.Response(200, json=_candidates_response(body["sources"], body["num_candidates"], 3))

    cfg = RolloutConfig(num_samples=3, top_k=3, top_p=0.9, temperature=0.8, max_new_tokens=8, timeout_s=30)
    worker = HttpRolloutWorker("http://policy", cfg, seed=5, poll_s=0.0, token="s3cret",
                               transport=httpx.MockTransport(handler))
    sets = worker.sample_version(2, None, EXAMPLES)
    assert len(polls) == 3 and len(requests) == 1  # polled the cheap route, sampled once
    assert polls[0] == "Bearer s3cret"
    assert requests[0]["mode"] == "sample" and requests[0]["top_k"] == 3 and requests[0]["num_candidates"] == 3
    assert requests[0]["top_p"] == 0.9 and requests[0]["temperature"] == 0.8  # the rollout's sampling, all of it
    assert [s.policy_version for s in sets] == [3, 3]
    expected = candidate_set(EXAMPLES[0].id, EXAMPLES[0].source, EXAMPLES[0].target, ["0 0", "0 1", "0 0"],
                             include_gold=True, seed=5, version=3)
    assert sets[0] == expected
    assert sets[0].candidates == ("0 0", "0 1", "7 8")  # samples deduplicated, gold added


def test_rollout_gives_up_waiting_after_the_timeout_and_uses_what_it_got():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/model":
            return httpx.Response(200, json=_model_info(1))
        body = json.loads(request.content)
        return httpx.Response(200, json=_candidates_response(body["sources"], body["num_candidates"], 1))

    cfg = RolloutConfig(num_samples=2, timeout_s=0.05)
    worker = HttpRolloutWorker("http://policy", cfg, seed=0, poll_s=0.01, transport=httpx.MockTransport(handler))
    sets = worker.sample_version(4, None, EXAMPLES)
    assert [s.policy_version for s in sets] == [1, 1]  # staleness is measured from this


def test_group_rollout_samples_each_chunk_and_its_greedy_baseline():
    requests = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/model":
            return httpx.Response(200, json=_model_info(2))
        body = json.loads(request.content)
        requests.append(body)
        return httpx.Response(200, json=_candidates_response(body["sources"], body["num_candidates"], 2))

    cfg = RolloutConfig(num_samples=2, batch_size=1, max_new_tokens=8)
    worker = HttpRolloutWorker("http://policy", cfg, seed=5, poll_s=0.0, transport=httpx.MockTransport(handler),
                               spec=RolloutSpec("group", greedy_baseline=True))
    groups = worker.sample_version(2, None, EXAMPLES)
    assert [r["sources"] for r in requests] == [["1 2 3"], ["1 2 3"], ["4 5"], ["4 5"]]  # per chunk: samples, greedy
    assert [(r["num_candidates"], r.get("top_k")) for r in requests] == [(2, 0), (1, 1)] * 2
    assert requests[0]["seed"] == requests[1]["seed"] != requests[2]["seed"]
    assert [g.example_id for g in groups] == ["a", "b"] and groups[1].reference == "9"
    assert groups[0].candidates == ("0 0", "0 1") and groups[0].greedy == "0 0" and groups[0].policy_version == 2
    assert groups[0].sample_logprobs == ((-0.5,), (-0.5,)) and groups[0].forced_eos == (False, False)


def test_rank_rollout_needs_a_target_for_every_example():
    worker = HttpRolloutWorker("http://policy", RolloutConfig(), seed=0,
                               transport=httpx.MockTransport(lambda request: httpx.Response(500)))
    with pytest.raises(ValueError, match=r"examples\[1\] \(id 'b'\) has no target"):
        worker.sample_version(0, None, [EXAMPLES[0], Example(id="b", source="4 5", target=None)])


def test_reward_orders_each_pair_by_the_servers_scores():
    from rlt2t.common.types import CandidateSet

    sets = [CandidateSet(example_id="a", source="s", reference="r", candidates=("x", "y"), pair=("x", "y"),
                         policy_version=2),
            CandidateSet(example_id="b", source="s", reference="r", candidates=("z",), pair=("z", "z"),
                         policy_version=2)]
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        return httpx.Response(200, json={"scores": {"task_score": [0.1, 0.9, 0.5, 0.5]}})

    worker = HttpRewardWorker("http://reward", RewardConfig(), transport=httpx.MockTransport(handler))
    pairs = worker.score(sets)
    assert seen["candidates"] == ["x", "y", "z", "z"] and seen["metrics"] == ["task_score"]
    assert (pairs[0].a, pairs[0].b, pairs[0].score_a, pairs[0].use_rank) == ("y", "x", 0.9, True)
    assert pairs[1].use_rank is False and pairs[1].policy_version == 2
