"""Typed client against stub transports: parsing, retries only on transient failures, Retry-After, errors."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from rlt2t.services import client as client_mod
from rlt2t.services.client import (
    AsyncPolicyClient,
    AsyncRewardClient,
    AuthError,
    PolicyClient,
    RequestError,
    RewardClient,
    ServerError,
    ServiceTimeout,
    Unavailable,
)

OK = {"candidates": [[{"text": "1 2", "token_ids": [7, 8, 2], "logprobs": [-1.0, -2.0, -0.5],
                       "total_logprob": -3.5, "sample_logprobs": [-1.0, -2.0, -0.5]}]], "policy_version": 4}


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    """Record the client's waits instead of sleeping."""
    seen: list[float] = []

    async def fake_async_sleep(s):
        seen.append(s)

    monkeypatch.setattr(client_mod, "_sleep", seen.append)
    monkeypatch.setattr(client_mod, "_async_sleep", fake_async_sleep)
    return seen


def scripted(*steps):
    """A transport answering with ``steps`` in order (an exception is raised, a tuple is (status, body, headers))."""
    calls: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        step = steps[min(len(calls), len(steps)) - 1]
        if isinstance(step, Exception):
            raise step
        status, body, headers = step
        return httpx.Response(status, json=body, headers=headers)

    return handler, calls


def test_parses_response_and_sends_token_and_body(waits):
    handler, calls = scripted((200, OK, {}))
    with PolicyClient("http://svc/", token="t0k", transport=httpx.MockTransport(handler)) as c:
        out = c.candidates(["5 6"], num_candidates=1, top_k=3)
    assert out.policy_version == 4 and out.candidates[0][0].token_ids == [7, 8, 2]
    (req,) = calls
    assert req.url == "http://svc/v1/candidates" and req.headers["Authorization"] == "Bearer t0k"
    sent = json.loads(req.content)
    assert sent["sources"] == ["5 6"] and sent["top_k"] == 3 and "seed" not in sent
    assert waits == []


def test_retries_connection_errors_with_growing_jittered_backoff(waits):
    handler, calls = scripted(httpx.ConnectError("refused"), httpx.ConnectError("refused"), (200, OK, {}))
    c = PolicyClient("http://svc", retries=3, backoff_s=0.1, max_backoff_s=10, transport=httpx.MockTransport(handler))
    assert c.candidates(["1"]).policy_version == 4
    c.close()
    assert len(calls) == 3 and len(waits) == 2
    assert 0 <= waits[0] <= 0.1 and 0 <= waits[1] <= 0.2


def test_503_honours_retry_after_up_to_the_cap(waits):
    busy = (503, {"detail": "queue full"}, {"Retry-After": "2"})
    very_busy = (503, {"detail": "queue full"}, {"Retry-After": "600"})
    handler, calls = scripted(busy, very_busy, (200, OK, {}))
    c = PolicyClient("http://svc", retries=3, backoff_s=0.01, max_retry_after_s=5,
                     transport=httpx.MockTransport(handler))
    c.candidates(["1"])
    assert len(calls) == 3
    assert 2 <= waits[0] <= 2.01 and 5 <= waits[1] <= 5.01


def test_exhausted_retries_raise_unavailable(waits):
    handler, calls = scripted((503, {"detail": "queue full"}, {"Retry-After": "1"}))
    c = PolicyClient("http://svc", retries=2, transport=httpx.MockTransport(handler))
    with pytest.raises(Unavailable) as e:
        c.candidates(["1"])
    assert e.value.status == 503 and e.value.detail == "queue full" and len(calls) == 3
    handler, calls = scripted(httpx.ConnectError("refused"))
    c = PolicyClient("http://svc", retries=1, transport=httpx.MockTransport(handler))
    with pytest.raises(Unavailable, match="ConnectError"):
        c.model()
    assert len(calls) == 2


@pytest.mark.parametrize(("status", "body", "error"), [
    (422, {"detail": [{"loc": ["body", "sources", 0], "msg": "bad", "type": "value_error"}]}, RequestError),
    (401, {"detail": "missing or invalid bearer token"}, AuthError),
    (500, {"detail": "internal error: KeyError"}, ServerError),
    (502, {"detail": "bad gateway"}, ServerError),
])
def test_other_errors_raise_at_once_with_the_server_detail(waits, status, body, error):
    handler, calls = scripted((status, body, {}))
    c = PolicyClient("http://svc", retries=3, transport=httpx.MockTransport(handler))
    with pytest.raises(error) as e:
        c.score("1", ["2"])
    assert len(calls) == 1 and waits == []
    assert e.value.status == status and e.value.detail == body["detail"]


def test_read_timeout_is_not_retried(waits):
    handler, calls = scripted(httpx.ReadTimeout("slow"))
    c = PolicyClient("http://svc", retries=3, transport=httpx.MockTransport(handler))
    with pytest.raises(ServiceTimeout):
        c.candidates(["1"])
    assert len(calls) == 1


def test_bad_arguments_fail_before_sending(waits):
    handler, calls = scripted((200, OK, {}))
    c = PolicyClient("http://svc", transport=httpx.MockTransport(handler))
    with pytest.raises(ValueError, match="temperature"):
        c.candidates(["1"], temperature=0)
    with pytest.raises(ValueError, match="colour"):
        c.candidates(["1"], colour="red")
    assert calls == []


def test_async_clients_retry_and_parse(waits):
    handler, calls = scripted(httpx.ConnectError("refused"), (503, {"detail": "busy"}, {"Retry-After": "1"}),
                              (200, {"scores": {"task_score": [0.5, 1.0]}}, {}))

    async def run():
        async with AsyncRewardClient("http://svc", transport=httpx.MockTransport(handler)) as c:
            return await c.reward(["a", "b"], ["a", ["b", "c"]], metrics=["task_score"])

    out = asyncio.run(run())
    assert out.scores == {"task_score": [0.5, 1.0]} and len(calls) == 3 and len(waits) == 2
    assert json.loads(calls[-1].content)["references"] == ["a", ["b", "c"]]

    handler, calls = scripted((422, {"detail": [{"loc": ["body", "x"], "msg": "m", "type": "t"}]}, {}))

    async def bad():
        async with AsyncPolicyClient("http://svc", transport=httpx.MockTransport(handler)) as c:
            await c.pairs(["1"], ["2"])

    with pytest.raises(RequestError):
        asyncio.run(bad())


def test_reward_client_round_trip(waits):
    handler, calls = scripted((200, {"scores": {"bleu4": [0.25]}}, {}))
    with RewardClient("http://svc", transport=httpx.MockTransport(handler)) as c:
        assert c.reward(["x"], ["y"], metrics=["bleu4"]).scores["bleu4"] == [0.25]


def test_reward_clients_send_sources_and_need_no_references(waits):
    """The server's named (learned) rewards score (source, candidate) pairs: no references."""
    answer = {"scores": {"prefs": [0.5]}, "reward_model_versions": {"prefs": {"reward_model": 20}}}
    sent = {"candidates": ["11 12"], "sources": ["1 2"], "metrics": ["prefs"]}
    handler, calls = scripted((200, answer, {}))
    with RewardClient("http://svc", transport=httpx.MockTransport(handler)) as c:
        out = c.reward(["11 12"], sources=["1 2"], metrics=["prefs"])
    assert out.scores == {"prefs": [0.5]} and out.reward_model_versions == {"prefs": {"reward_model": 20}}

    async def run():
        async with AsyncRewardClient("http://svc", transport=httpx.MockTransport(handler)) as c:
            return await c.reward(["11 12"], sources=["1 2"], metrics=["prefs"])

    assert asyncio.run(run()).scores == {"prefs": [0.5]}
    assert [json.loads(call.content) for call in calls] == [sent, sent]


def test_reload_posts_without_a_body_and_parses_the_model_info(waits):
    info = {"version": 3, "checkpoint": "/r/epoch-0001", "checksum": "0" * 64, "loaded_at": 1.0, "backend": "torch",
            "max_source_tokens": 40, "on_disk": True, "note": None}
    handler, calls = scripted((200, info, {}))
    with PolicyClient("http://svc", transport=httpx.MockTransport(handler)) as c:
        out = c.reload()
    assert (calls[0].method, calls[0].url.path, calls[0].content) == ("POST", "/v1/reload", b"")
    assert out.version == 3 and out.on_disk and out.note is None


def test_reward_clients_read_what_the_server_offers(waits):
    answer = {"metrics": ["bleu4", "task_score"], "named": ["prefs"],
              "unavailable": {"meteor": "WordNet data not found; install Debian's wordnet-base"}}
    handler, calls = scripted((200, answer, {}))
    with RewardClient("http://svc", transport=httpx.MockTransport(handler)) as c:
        out = c.metrics()
    assert out.metrics == ["bleu4", "task_score"] and out.named == ["prefs"]
    assert "wordnet-base" in out.unavailable["meteor"]
    assert calls[-1].method == "GET" and calls[-1].url.path == "/v1/metrics"

    async def run():
        async with AsyncRewardClient("http://svc", transport=httpx.MockTransport(handler)) as c:
            return await c.metrics()

    assert asyncio.run(run()).unavailable == answer["unavailable"]
