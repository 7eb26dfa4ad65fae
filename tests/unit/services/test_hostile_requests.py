"""Both apps under hostile and heavy requests (#18), with the issue's reproducers scaled down: no input gives
a 5xx (a property test over every string field of every route, lone surrogates included), work-bounded
admission, deadlines, auth before the body, strict types and content types, HEAD /healthz."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlt2t.common.checkpoint import save_checkpoint
from rlt2t.common.config import Config
from rlt2t.services import policy_app, reward_app
from rlt2t.services.backends import Sampling, TorchBackend
from rlt2t.services.http import RequestGate

JSON = {"content-type": "application/json"}


def post_raw(client: TestClient, path: str, body, headers: dict | None = None):
    """POST a body as JSON text with \\u escapes, the only way a lone surrogate travels in JSON."""
    return client.post(path, content=json.dumps(body).encode(), headers={**JSON, **(headers or {})})


@pytest.fixture
def long_root(tmp_path, tiny_policy):
    """The tiny policy with EOS suppressed: every row decodes to max_new_tokens (a known amount of work)."""
    with torch.no_grad():
        tiny_policy.model.final_logits_bias[0, tiny_policy.tokenizer.eos_token_id] = -1e4
    root = tmp_path / "long"
    save_checkpoint(root, "epoch-0001", model=tiny_policy.model, tokenizer=tiny_policy.tokenizer, step=1)
    return root


def with_serve(cfg: Config, **serve) -> Config:
    return cfg.model_copy(update={"serve": cfg.serve.model_copy(update=serve)})


@pytest.fixture
def policy(serve_cfg, checkpoint_root):
    with TestClient(policy_app.create_app(serve_cfg, checkpoint_dir=checkpoint_root)) as c:
        yield c


@pytest.fixture
def reward(serve_cfg):
    with TestClient(reward_app.create_app(serve_cfg)) as c:
        yield c


# -- 1. no input produces a 5xx -------------------------------------------------------------------------

SURROGATE_BODIES = [
    ("policy", "/v1/candidates", {"sources": ["12 \ud800 7"]}),
    ("policy", "/v1/pairs", {"sources": ["1"], "references": ["2"], "example_ids": ["\udfff"]}),
    ("policy", "/v1/score", {"source": "1", "targets": ["\ud83d"]}),
    ("policy", "/v1/candidates", {"\ud800": 1}),
    ("reward", "/v1/reward", {"candidates": ["\ud800"], "references": ["1"]}),
    ("reward", "/v1/reward", {"candidates": ["1"], "references": ["1"], "metrics": ["\udc80"]}),
    ("reward", "/v1/reward", {"\ud800": 1}),
]


@pytest.mark.parametrize(("app", "path", "body"), SURROGATE_BODIES)
def test_a_lone_surrogate_is_a_422_that_encodes(policy, reward, app, path, body):
    r = post_raw(policy if app == "policy" else reward, path, body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]  # valid UTF-8 JSON; the surrogate echoed as text
    assert "\\ud" in json.dumps(detail, ensure_ascii=False) or "\\ud" in r.text


def test_refusals_say_what_is_wrong_and_which_setting_sets_a_limit(policy, reward, serve_cfg):
    limit = serve_cfg.serve.max_candidates_per_source
    r = policy.post("/v1/candidates", json={"sources": ["1"], "num_candidates": limit + 1})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "num_candidates"]
    assert r.json()["detail"][0]["msg"] == f"{limit + 1} candidates per source; at most {limit} " \
                                          "(serve.max_candidates_per_source)"
    r = policy.post("/v1/candidates", json={"sources": ["1"] * (serve_cfg.serve.max_sources_per_call + 1)})
    assert "(serve.max_sources_per_call)" in r.json()["detail"][0]["msg"]
    r = policy.post("/v1/candidates", json={"sources": ["1"], "mode": "beam", "beam_size": 2, "num_candidates": 4})
    assert r.json()["detail"][0]["msg"] == "4 hypotheses asked of a beam search; at most 2 (a beam search returns " \
                                          "at most beam_size)"
    r = policy.post("/v1/candidates", json={"sources": [" \t "]})  # whitespace alone, said in words
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "sources", 0]
    assert r.json()["detail"][0]["msg"].startswith("holds no text: whitespace alone")
    r = reward.post("/v1/reward", json={"candidates": ["1"], "references": [[]]})  # a union's branches, named
    assert r.status_code == 422
    assert [e["loc"] for e in r.json()["detail"]] == [["body", "references", 0, "text"],
                                                      ["body", "references", 0, "list[text]"]]


# Arbitrary unicode (surrogates, controls, unassigned) mixed with texts close to valid ones, so that the
# model runs on some of them too.
ANY_TEXT = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=12),
    st.lists(st.sampled_from(["1", "7", "59", "60", "007", "<sep>", "</s>", "<pad>", "x", "\ud800"]),
             max_size=5).map(" ".join),
    st.lists(st.sampled_from(["1", "7", "59", "<sep>"]), min_size=1, max_size=4).map(" ".join),  # valid
)
TEXTS = st.lists(ANY_TEXT, min_size=1, max_size=2)


def _bodies(draw_extra):
    extra = st.dictionaries(ANY_TEXT, st.integers(0, 3), max_size=1) if draw_extra else st.just({})
    return {
        "/v1/candidates": st.fixed_dictionaries({"sources": TEXTS, "max_new_tokens": st.just(2),
                                                 "mode": st.one_of(st.just("sample"), ANY_TEXT)}),
        "/v1/pairs": TEXTS.flatmap(lambda s: st.fixed_dictionaries({
            "sources": st.just(s), "references": st.lists(ANY_TEXT, min_size=len(s), max_size=len(s)),
            "example_ids": st.lists(ANY_TEXT, min_size=len(s), max_size=len(s)),
            "num_samples": st.just(2), "max_new_tokens": st.just(2)})),
        "/v1/score": st.fixed_dictionaries({"source": ANY_TEXT, "targets": TEXTS}),
        "/v1/reward": TEXTS.flatmap(lambda c: st.fixed_dictionaries({
            "candidates": st.just(c),
            "references": st.lists(st.one_of(ANY_TEXT, st.lists(ANY_TEXT, min_size=1, max_size=2)),
                                   min_size=len(c), max_size=len(c)),
            "metrics": st.lists(st.one_of(st.sampled_from(["task_score", "bleu4", "rouge_l", "chrf"]), ANY_TEXT),
                                min_size=1, max_size=2)})),
    }, extra


@pytest.fixture
def both_apps(serve_cfg, checkpoint_root, ids_tokenizer_dir):
    serve_cfg.tokenizer.path = str(ids_tokenizer_dir)  # the reward server applies the run's token rule too
    with TestClient(policy_app.create_app(serve_cfg, checkpoint_dir=checkpoint_root)) as p, \
            TestClient(reward_app.create_app(serve_cfg)) as r:
        yield {"/v1/candidates": p, "/v1/pairs": p, "/v1/score": p, "/v1/reward": r}


def test_no_string_in_any_field_of_any_route_gives_a_5xx(both_apps):
    """Property: whatever unicode any string field (or key) holds, the answer is a 2xx or 4xx with a JSON
    body."""
    bodies, extra = _bodies(draw_extra=True)
    routes = st.sampled_from(sorted(bodies))
    statuses: set[tuple[str, int]] = set()

    @settings(max_examples=250, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def check(data) -> None:
        path = data.draw(routes)
        body = {**data.draw(bodies[path]), **data.draw(extra)}
        r = post_raw(both_apps[path], path, body)
        assert r.status_code < 500, (path, body, r.text)
        assert isinstance(r.json(), dict)
        statuses.add((path, r.status_code))

    check()
    assert {(path, 200) for path in bodies} <= statuses  # the models and metrics ran too, not only 422s


# -- 2. cost-bounded admission, deadlines, reward work off the event loop ---------------------------------

def test_a_request_over_the_work_bound_is_a_422_naming_the_product(serve_cfg, checkpoint_root):
    cfg = with_serve(serve_cfg, max_request_cost=5000)
    with TestClient(policy_app.create_app(cfg, checkpoint_dir=checkpoint_root)) as c:
        # The "many sources x many candidates x long outputs", scaled to the test limits.
        r = c.post("/v1/candidates", json={"sources": ["1"] * 8, "num_candidates": 6, "max_new_tokens": 255})
        assert r.status_code == 422
        [error] = r.json()["detail"]
        assert error["loc"] == ["body"] and "serve.max_request_cost" in error["msg"]
        assert "8 sources x 6 candidates x (1 source tokens on average + 255 new tokens) = 12288" in error["msg"]
        beam = c.post("/v1/candidates", json={"sources": ["1 2"] * 8, "mode": "beam", "beam_size": 6,
                                              "num_candidates": 1, "max_new_tokens": 150})
        assert beam.status_code == 422 and "x 6 beams x" in beam.json()["detail"][0]["msg"]
        pairs = c.post("/v1/pairs", json={"sources": ["1"] * 8, "references": ["2"] * 8, "num_samples": 6,
                                          "max_new_tokens": 255})
        assert pairs.status_code == 422 and "x 6 samples x" in pairs.json()["detail"][0]["msg"]
        within = c.post("/v1/candidates", json={"sources": ["1"] * 2, "num_candidates": 6, "max_new_tokens": 200})
        assert within.status_code == 200  # 2 x 6 x 201 = 2412


def test_score_work_is_bounded_too(serve_cfg, checkpoint_root):
    cfg = with_serve(serve_cfg, max_request_cost=100)
    with TestClient(policy_app.create_app(cfg, checkpoint_dir=checkpoint_root)) as c:
        r = c.post("/v1/score", json={"source": " ".join(["1"] * 40), "targets": [" ".join(["2"] * 40)] * 2})
        assert r.status_code == 422 and "2 targets x (40 source tokens + 40 target" in r.json()["detail"][0]["msg"]


def test_a_request_past_its_deadline_is_dropped_from_its_running_call(serve_cfg, long_root, monkeypatch):
    """The issue's reproducer (a long decode whose client stops waiting), scaled down: the answer is a 503 at
    the deadline, and the model call stops at its next decoding step instead of running to the end. Admission
    would refuse this request at once (test_admission.py); here its prediction is wrong (0 s), as when the
    machine slows down after a request was admitted, and the deadline is what stops the work."""
    body = {"sources": ["1 2 3"] * 8, "num_candidates": 6, "max_new_tokens": 255, "temperature": 100.0}
    backend = TorchBackend.from_checkpoint(serve_cfg, long_root)
    sampling = Sampling(num_candidates=6, temperature=100.0, max_new_tokens=255)
    backend.candidates(body["sources"][:1], sampling, list(range(6)))  # warm-up
    t0 = time.perf_counter()
    backend.candidates(body["sources"], sampling, list(range(48)))
    full_s = time.perf_counter() - t0  # the whole decode on this machine, now
    deadline_s = full_s / 4
    cfg = with_serve(serve_cfg, request_timeout_s=deadline_s, max_call_cost=10**6)
    with TestClient(policy_app.create_app(cfg, backend=backend)) as c:
        monkeypatch.setattr(c.app.state.batcher.timing, "seconds", lambda work, calls=1: 0.0)
        t0 = time.perf_counter()
        r = c.post("/v1/candidates", json=body)
        answered_s = time.perf_counter() - t0
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1, r.text[:300]
        assert "serve.request_timeout_s" in r.json()["detail"]
        deadline = time.monotonic() + 10  # wait for the worker to record the stopped call
        while "rlt2t_policy_batch_seconds_count 1.0" not in (text := c.get("/metrics").text):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    call_s = float(next(line.split()[-1] for line in text.splitlines()
                        if line.startswith("rlt2t_policy_batch_seconds_sum")))
    assert answered_s < deadline_s + 0.4 * full_s, (full_s, answered_s)  # at the deadline, not at the end
    assert call_s < 0.6 * full_s, (full_s, call_s)  # the call stopped at a step soon after it


def test_reward_work_is_bounded_split_and_off_the_event_loop(serve_cfg):
    """The issue's ROUGE-L reproducer scaled down: refused over serve.max_reward_cost, and within it scored
    on the worker in parts of at most serve.max_reward_call_cost while the event loop keeps answering."""
    long_text = " ".join(str(i % 50) for i in range(200))
    item = reward_app.reward_cost(long_text, [long_text], 2)  # 201 x 201 token pairs + characters, 2 metrics
    assert item == 2 * (201 * 201 + 2 * len(long_text))
    cfg = with_serve(serve_cfg, max_tokens_per_source=200, max_reward_cost=40 * item, max_reward_call_cost=2 * item)
    app = reward_app.create_app(cfg)
    with TestClient(app) as c:
        too_much = c.post("/v1/reward", json={"candidates": [long_text] * 48, "references": [long_text] * 48,
                                               "metrics": ["rouge_l", "bleu4"]})
        assert too_much.status_code == 422
        assert "48 candidates x 1.0 references on average" in too_much.json()["detail"][0]["msg"]
        assert "serve.max_reward_cost" in too_much.json()["detail"][0]["msg"]

        scorer, parts = app.state.batcher.backend, []
        original = scorer.score

        def recording(key, items):
            parts.append(len(items))
            return original(key, items)

        scorer.score = recording
        ok = c.post("/v1/reward", json={"candidates": [long_text] * 20, "references": [long_text] * 20,
                                        "metrics": ["rouge_l", "bleu4"]})
        assert ok.status_code == 200 and ok.json()["scores"]["rouge_l"] == [pytest.approx(1.0)] * 20
        assert parts == [2] * 10  # two items per part


def test_unknown_tokens_are_refused_by_the_reward_server_of_an_ids_run(serve_cfg, ids_tokenizer_dir):
    serve_cfg.tokenizer.path = str(ids_tokenizer_dir)
    with TestClient(reward_app.create_app(serve_cfg)) as c:
        r = c.post("/v1/reward", json={"candidates": ["1 2", "hello"], "references": ["1", "2"]})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "candidates", 1]
        assert "'hello' is not a non-negative integer" in r.json()["detail"][0]["msg"]
        r = c.post("/v1/reward", json={"candidates": ["1"], "references": [["2", "</s>"]]})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "references", 0, 1]
        assert c.post("/v1/reward", json={"candidates": ["1 <sep> 2"], "references": ["2"]}).status_code == 200


# -- 4. auth before the body, every route but /healthz ----------------------------------------------------

@pytest.mark.parametrize("which", ["policy", "reward"])
def test_with_a_token_everything_but_healthz_needs_it(serve_cfg, checkpoint_root, monkeypatch, which):
    monkeypatch.setenv("RLT2T_API_TOKEN", "s3cret")
    app = (policy_app.create_app(serve_cfg, checkpoint_dir=checkpoint_root) if which == "policy"
           else reward_app.create_app(serve_cfg))
    auth = {"Authorization": "Bearer s3cret"}
    with TestClient(app) as c:
        assert c.get("/healthz").status_code == 200 and c.head("/healthz").status_code == 200
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect", "/metrics", "/readyz", "/nope"):
            r = c.get(path)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer", path
            assert c.get(path, headers=auth).status_code in (200, 404), path
        route = "/v1/candidates" if which == "policy" else "/v1/reward"
        # Not JSON, not even the right content type, no token: 401, the body never read.
        assert c.post(route, content=b"{not json", headers=JSON).status_code == 401
        assert c.post(route, content=b"x", headers={"content-type": "text/plain"}).status_code == 401
        assert c.post(route, content=b"{not json", headers={**JSON, **auth}).status_code == 422
        text = c.get("/metrics", headers=auth).text
    assert f'rlt2t_{which}_requests_total{{route="{route}",status="401"}} 2.0' in text
    assert f'rlt2t_{which}_requests_total{{route="/openapi.json",status="401"}} 1.0' in text


def test_head_healthz_without_a_token(reward):
    r = reward.head("/healthz")
    assert r.status_code == 200 and r.content == b""


# -- 5. strict types, content types ------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/candidates", {"sources": ["1"], "num_candidates": "3"}, "num_candidates"),
    ("/v1/candidates", {"sources": ["1"], "num_candidates": True}, "num_candidates"),
    ("/v1/candidates", {"sources": ["1"], "seed": "12"}, "seed"),
    ("/v1/candidates", {"sources": ["1"], "temperature": "0.5"}, "temperature"),
    ("/v1/candidates", {"sources": [1]}, "sources"),
    ("/v1/pairs", {"sources": ["1"], "references": ["2"], "include_gold": "yes"}, "include_gold"),
    ("/v1/pairs", {"sources": ["1"], "references": ["2"], "include_gold": 1}, "include_gold"),
    ("/v1/score", {"source": 7, "targets": ["2"]}, "source"),
])
def test_wrong_types_are_refused_not_coerced(policy, path, body, field):
    r = policy.post(path, json=body)
    assert r.status_code == 422, r.text
    assert any(field in e["loc"] for e in r.json()["detail"]), r.json()


def test_integers_are_still_numbers(policy):
    r = policy.post("/v1/candidates", json={"sources": ["1"], "temperature": 1, "top_p": 1, "max_new_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("headers", [{"content-type": "text/plain"},
                                     {"content-type": "application/x-www-form-urlencoded"},
                                     {"content-type": "application/json; charset=latin-1"}, {}])
def test_a_body_that_is_not_declared_json_is_a_415(policy, reward, headers):
    body = json.dumps({"sources": ["1"], "max_new_tokens": 2}).encode()
    for client, path in ((policy, "/v1/candidates"), (reward, "/v1/reward")):
        r = client.post(path, content=body, headers=headers)
        assert r.status_code == 415, (path, headers, r.text)
        assert "application/json" in r.json()["detail"]
    r = policy.post("/v1/candidates", content=body, headers={"content-type": "Application/JSON; charset=UTF-8"})
    assert r.status_code == 200


def test_body_limit_alone_takes_any_content_type():
    """The gate with no token and json_only=False: its body handling alone (no auth, no content-type rule)."""
    app = FastAPI()

    @app.post("/form")
    async def form(request: Request) -> dict:
        return {"size": len(await request.body())}

    app.add_middleware(RequestGate, token=None, max_bytes=10, body_timeout_s=30.0, json_only=False,
                       setting="annotate.max_body_bytes")
    with TestClient(app) as c:
        ok = c.post("/form", content=b"a=1&b=2", headers={"content-type": "application/x-www-form-urlencoded"})
        assert ok.status_code == 200 and ok.json() == {"size": 7}
        big = c.post("/form", content=b"a=" + b"x" * 20, headers={"content-type": "application/x-www-form-urlencoded"})
        assert big.status_code == 413 and "annotate.max_body_bytes" in big.json()["detail"]


def test_a_client_gone_in_the_middle_of_its_body_is_counted_499_not_500(serve_cfg):
    """Nobody is left to answer: no response is started, and the request metric says the client closed."""
    app = reward_app.create_app(serve_cfg)
    messages = [{"type": "http.request", "body": b'{"candidates"', "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/reward", "raw_path": b"/v1/reward", "root_path": "", "query_string": b"",
             "headers": [(b"host", b"x"), (b"content-type", b"application/json"), (b"content-length", b"100")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    assert sent == [] and messages == []
    with TestClient(app) as c:
        text = c.get("/metrics").text
    assert 'rlt2t_reward_requests_total{route="/v1/reward",status="499"} 1.0' in text
    assert 'status="500"' not in text


def test_beam_search_lets_waiting_work_run_between_its_steps(serve_cfg, long_root):
    class Counting:
        steps = 0

        def stopped(self):
            return []

        def between_steps(self):
            self.steps += 1
            return []

    backend = TorchBackend.from_checkpoint(serve_cfg, long_root)
    control = Counting()
    beam = Sampling(mode="beam", num_candidates=1, beam_size=2, max_new_tokens=10)
    out = backend.candidates(["1 2", "3"], beam, [], control)
    assert out == backend.candidates(["1 2", "3"], beam, [], None)
    assert control.steps >= 9  # one call after every decoding step


def test_a_small_request_runs_between_the_steps_of_a_long_beam_search(serve_cfg, long_root):
    """The serving guide's promise for beam search too: a small request sent while a long beam search runs is answered
    between two of its decoding steps, with the answer it gets alone."""
    backend = TorchBackend.from_checkpoint(serve_cfg, long_root)
    started = threading.Event()
    candidates = backend.candidates

    def tracked(*args, **kwargs):
        started.set()
        return candidates(*args, **kwargs)

    backend.candidates = tracked  # type: ignore[method-assign]
    long = {"sources": ["1 2 3"] * 8, "mode": "beam", "beam_size": 6, "num_candidates": 1, "max_new_tokens": 255}
    smalls = [{"sources": ["5 6"], "mode": "beam", "beam_size": 2, "max_new_tokens": 4},
              {"sources": ["5 6"], "max_new_tokens": 4, "seed": 1}]
    with TestClient(policy_app.create_app(with_serve(serve_cfg, max_call_cost=10**6), backend=backend)) as c:
        alone = [c.post("/v1/candidates", json=body).json() for body in smalls]
        started.clear()
        result: dict = {}

        def run_long() -> None:
            t0 = time.perf_counter()
            result["status"] = c.post("/v1/candidates", json=long).status_code
            result["seconds"] = time.perf_counter() - t0

        thread = threading.Thread(target=run_long)
        thread.start()
        assert started.wait(30)
        t0 = time.perf_counter()
        answers = [c.post("/v1/candidates", json=body) for body in smalls]
        small_s = time.perf_counter() - t0
        thread.join()
    assert result["status"] == 200 and [r.status_code for r in answers] == [200, 200]
    assert [r.json() for r in answers] == alone
    assert small_s < result["seconds"] / 3, (small_s, result["seconds"])


def test_beam_search_stops_once_every_source_of_its_call_is_gone(serve_cfg, long_root):
    class AllGone:
        def stopped(self):
            return [0, 1]

        between_steps = stopped

    backend = TorchBackend.from_checkpoint(serve_cfg, long_root)
    beam = Sampling(mode="beam", num_candidates=1, beam_size=2, max_new_tokens=50)
    full = backend.candidates(["1 2", "3"], beam, [], None)
    cut = backend.candidates(["1 2", "3"], beam, [], AllGone())
    assert min(len(g[0].token_ids) for g in full) >= 49  # no EOS: beams run to the limit
    assert max(len(g[0].token_ids) for g in cut) <= 2
