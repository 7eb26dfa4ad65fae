"""Policy server routes on a tiny checkpoint (TestClient): shapes, log-prob correctness, pairs as training
makes them, validation errors naming the field, auth, metrics, the CLI's error path."""

from __future__ import annotations

import time

import pytest
import torch
from fastapi.testclient import TestClient

from rlt2t.actors.reward import RewardWorker
from rlt2t.actors.rollout import RolloutWorker
from rlt2t.cli import main as cli_main
from rlt2t.common.config import ModelConfig, RolloutConfig
from rlt2t.common.data import Example
from rlt2t.common.metrics import DocumentFrequency
from rlt2t.learner.evaluate import generate
from rlt2t.services.policy_app import create_app
from rlt2t.services.schemas import MIN_TEMPERATURE

SOURCES = ["11 12 13 14", "20 21", "30 31 32 33 34 35 36"]


@pytest.fixture
def client(serve_cfg, checkpoint_root):
    with TestClient(create_app(serve_cfg, checkpoint_dir=checkpoint_root)) as c:
        yield c


def teacher_forced(policy, source: str, ids: list[int]) -> list[float]:
    """Independent reference: log p(ids[t] | source, ids[:t]) with one plain forward pass."""
    model = policy.model.eval()
    enc = policy.tokenizer([source], return_tensors="pt")
    dec = torch.tensor([[model.config.decoder_start_token_id] + ids[:-1]])
    with torch.no_grad():
        logits = model(input_ids=enc.input_ids, attention_mask=enc.attention_mask, decoder_input_ids=dec).logits
    return logits.log_softmax(-1)[0, torch.arange(len(ids)), torch.tensor(ids)].tolist()


def test_candidates_shapes_and_raw_logprobs(client, tiny_policy):
    r = client.post("/v1/candidates", json={"sources": SOURCES, "num_candidates": 3, "top_k": 5,
                                            "temperature": 0.7, "max_new_tokens": 10, "seed": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["policy_version"] == 0
    assert [len(c) for c in body["candidates"]] == [3, 3, 3]
    for source, cands in zip(SOURCES, body["candidates"], strict=True):
        for cand in cands:
            ids = cand["token_ids"]
            assert 1 <= len(ids) <= 10 and len(cand["logprobs"]) == len(ids)
            assert cand["text"] == tiny_policy.decode([ids])[0]
            # Raw model log-probs (not temperature/top-k adjusted) of exactly the returned tokens.
            assert cand["logprobs"] == pytest.approx(teacher_forced(tiny_policy, source, ids), abs=1e-4)
            assert cand["total_logprob"] == pytest.approx(sum(cand["logprobs"]), abs=1e-6)


def test_seeded_sampling_is_reproducible_and_independent_of_batch_mates(client):
    params = {"num_candidates": 2, "top_k": 0, "max_new_tokens": 8, "seed": 9}
    together = client.post("/v1/candidates", json={"sources": SOURCES, **params}).json()["candidates"]
    again = client.post("/v1/candidates", json={"sources": SOURCES, **params}).json()["candidates"]
    assert together == again
    other_seed = client.post("/v1/candidates", json={"sources": SOURCES, **params, "seed": 10}).json()
    assert other_seed["candidates"] != together


def test_seeded_candidates_do_not_depend_on_concurrent_batch_mates(serve_cfg, checkpoint_root):
    """Requests sent together are merged into one model call; a seeded one answers as it does alone."""
    from concurrent.futures import ThreadPoolExecutor

    cfg = serve_cfg.model_copy(update={"serve": serve_cfg.serve.model_copy(update={"max_wait_ms": 300})})
    params = {"num_candidates": 2, "top_k": 0, "max_new_tokens": 8}
    with TestClient(create_app(cfg, checkpoint_dir=checkpoint_root)) as c:
        alone = c.post("/v1/candidates", json={"sources": SOURCES[:1], **params, "seed": 9}).json()["candidates"]
        bodies = [{"sources": SOURCES[:1], **params, "seed": 9}] + [
            {"sources": [s], **params, "seed": 100 + i} for i, s in enumerate(SOURCES[1:])]
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: c.post("/v1/candidates", json=b), bodies))
        sizes = [line for line in c.get("/metrics").text.splitlines()
                 if line.startswith("rlt2t_policy_batch_sources_count")]
    assert all(a.status_code == 200 for a in answers)
    together = answers[0].json()["candidates"]
    assert [[c["token_ids"] for c in x] for x in together] == [[c["token_ids"] for c in x] for x in alone]
    # Padding to batch mates' lengths moves log-probs only by float rounding.
    for got, want in zip(together[0], alone[0], strict=True):
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)
    # Fewer model calls than requests: the concurrent ones really shared a batch.
    assert float(sizes[0].split()[-1]) < 1 + len(bodies), sizes


def test_top_k_1_tiny_top_p_and_large_epsilon_are_greedy(client, tiny_policy):
    greedy = generate(tiny_policy, SOURCES, max_new_tokens=8)
    # epsilon 0.999: no token of the untrained model is that likely, so only the most likely one is left
    for extra in ({"top_k": 1}, {"top_p": 1e-6}, {"epsilon": 0.999}):
        r = client.post("/v1/candidates", json={"sources": SOURCES, "max_new_tokens": 8, **extra})
        assert [c[0]["text"] for c in r.json()["candidates"]] == greedy, extra


def test_beam_returns_hypotheses_with_teacher_forced_logprobs(client, tiny_policy):
    # 3 beams, 4 tokens: where the untrained tiny model's beam and greedy outputs differ (a server that
    # decoded greedily would fail below)
    sources = SOURCES[:2]
    r = client.post("/v1/candidates", json={"sources": sources, "mode": "beam", "beam_size": 3,
                                            "num_candidates": 3, "max_new_tokens": 4})
    assert r.status_code == 200, r.text
    differs = []
    for source, cands in zip(sources, r.json()["candidates"], strict=True):
        assert len(cands) == 3
        best = generate(tiny_policy, [source], num_beams=3, max_new_tokens=4)[0]
        assert cands[0]["text"] == best
        differs.append(best != generate(tiny_policy, [source], max_new_tokens=4)[0])
        for cand in cands:
            assert cand["logprobs"] == pytest.approx(teacher_forced(tiny_policy, source, cand["token_ids"]), abs=1e-4)
    assert any(differs), "no source here tells beam search from greedy decoding"
    bad = client.post("/v1/candidates", json={"sources": ["1"], "mode": "beam", "beam_size": 2, "num_candidates": 3})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "num_candidates"]


def _repeats(ids, n: int) -> int:
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return len(grams) - len(set(grams))


def test_beam_repetition_controls_reach_the_beams_and_are_a_422_with_sampling(client):
    body = {"sources": SOURCES, "mode": "beam", "beam_size": 3, "num_candidates": 3, "max_new_tokens": 12}
    ids = {}
    for n in (0, 2):
        r = client.post("/v1/candidates", json={**body, "no_repeat_ngram_size": n})
        assert r.status_code == 200, r.text
        ids[n] = [c["token_ids"] for cands in r.json()["candidates"] for c in cands]
    assert any(_repeats(x, 2) for x in ids[0]), "the tiny model repeats nothing here: the test shows nothing"
    assert not any(_repeats(x, 2) for x in ids[2])
    for field, value in (("no_repeat_ngram_size", 2), ("repetition_penalty", 1.5), ("length_penalty", 2.0),
                         ("min_new_tokens", 3)):
        r = client.post("/v1/candidates", json={"sources": SOURCES[:1], "num_candidates": 2, field: value})
        assert r.status_code == 422 and [e["loc"] for e in r.json()["detail"]] == [["body", field]], r.text
        assert "mode: beam" in r.json()["detail"][0]["msg"]


def test_beam_length_controls_reach_the_backend_and_min_new_tokens_stays_below_the_limit(client, monkeypatch):
    """(What they do to the beams, on both backends: tests/unit/test_predict_targets.py.)"""
    from rlt2t.services.backends import TorchBackend

    seen = []
    real = TorchBackend.candidates

    def spy(self, sources, sampling, *args, **kwargs):
        seen.append(sampling)
        return real(self, sources, sampling, *args, **kwargs)

    monkeypatch.setattr(TorchBackend, "candidates", spy)
    body = {"sources": SOURCES, "mode": "beam", "beam_size": 3, "num_candidates": 3, "max_new_tokens": 12}
    r = client.post("/v1/candidates", json={**body, "min_new_tokens": 4, "length_penalty": 2.0})
    assert r.status_code == 200, r.text
    assert [(s.mode, s.min_new_tokens, s.length_penalty) for s in seen] == [("beam", 4, 2.0)]
    r = client.post("/v1/candidates", json={**body, "min_new_tokens": 12})
    assert r.status_code == 422 and [e["loc"] for e in r.json()["detail"]] == [["body", "min_new_tokens"]], r.text
    assert "below max_new_tokens (12)" in r.json()["detail"][0]["msg"]
    one_beam = {**body, "beam_size": 1, "num_candidates": 1}
    r = client.post("/v1/candidates", json={**one_beam, "length_penalty": 2.0})
    assert r.status_code == 422 and [e["loc"] for e in r.json()["detail"]] == [["body", "length_penalty"]], r.text
    assert "beam_size above 1" in r.json()["detail"][0]["msg"]
    r = client.post("/v1/candidates", json={**one_beam, "min_new_tokens": 4})  # acts on a beam of one
    assert r.status_code == 200 and [s.min_new_tokens for s in seen[1:]] == [4], r.text


def test_score_matches_teacher_forcing(client, tiny_policy):
    targets = ["40 41 42", "", "7 <sep> 8"]
    r = client.post("/v1/score", json={"source": SOURCES[0], "targets": targets})
    assert r.status_code == 200, r.text
    scores = r.json()["scores"]
    eos = tiny_policy.tokenizer.eos_token_id
    assert scores[1]["token_ids"] == [eos]
    sep = tiny_policy.tokenizer.sep_token_id
    assert scores[2]["token_ids"] == tiny_policy.tokenizer(["7 <sep> 8"])["input_ids"][0]
    assert sep in scores[2]["token_ids"]
    for s in scores:
        assert s["logprobs"] == pytest.approx(teacher_forced(tiny_policy, SOURCES[0], s["token_ids"]), abs=1e-4)
        assert s["mean_logprob"] == pytest.approx(s["total_logprob"] / len(s["token_ids"]))


def test_pairs_equal_the_ray_rollout_and_reward_workers(serve_cfg, checkpoint_root, tmp_path, ids_tokenizer_dir):
    refs = ["11 12 13", "20 22", "30 31 32"]
    df = DocumentFrequency.from_references([[r] for r in refs + ["11 40", "50 51"]])
    df.save(tmp_path / "df.json")
    rollout = RolloutConfig(num_samples=4, top_k=3, temperature=0.8, max_new_tokens=8)
    serve_cfg.rollout = rollout
    app = create_app(serve_cfg, checkpoint_dir=checkpoint_root, document_frequency=tmp_path / "df.json")
    with TestClient(app) as c:
        r = c.post("/v1/pairs", json={"sources": SOURCES, "references": refs, "example_ids": ["a", "b", "c"],
                                      "seed": 77})
    assert r.status_code == 200, r.text
    worker = RolloutWorker(ModelConfig(path=str(checkpoint_root / "epoch-0001"), dropout=0.0),
                           str(ids_tokenizer_dir), rollout, seed=77, max_source_len=128)
    examples = [Example(id=i, source=s, target=t) for i, s, t in zip("abc", SOURCES, refs, strict=True)]
    expected = RewardWorker(serve_cfg.reward, df).score(worker.sample(examples))
    assert r.json()["pairs"] == [vars(p) for p in expected]
    assert r.json()["policy_version"] == 0


def test_pairs_score_every_reference_of_a_source_as_rank_training_does(serve_cfg, checkpoint_root, ids_tokenizer_dir):
    """A source given a list of references: its pair is scored against all of them, the first is the gold, and
    the request's document frequencies count one set per source: equal to the Ray rollout and reward workers
    on examples that carry those references (a row's "references")."""
    refs = [["11 12 13", "11 12 40", "41 12 13 14"], "20 22", ["30 31 32", "33 34 35 36"]]
    rollout = RolloutConfig(num_samples=4, top_k=3, temperature=0.8, max_new_tokens=8)
    serve_cfg.rollout = rollout
    body = {"sources": SOURCES, "example_ids": ["a", "b", "c"], "seed": 77}
    with TestClient(create_app(serve_cfg, checkpoint_dir=checkpoint_root)) as c:
        r = c.post("/v1/pairs", json={**body, "references": refs})
        gold_only = c.post("/v1/pairs", json={**body, "references": [g if isinstance(g, str) else g[0] for g in refs]})
    assert r.status_code == 200 and gold_only.status_code == 200, (r.text, gold_only.text)
    worker = RolloutWorker(ModelConfig(path=str(checkpoint_root / "epoch-0001"), dropout=0.0),
                           str(ids_tokenizer_dir), rollout, seed=77, max_source_len=128)
    examples = [Example(id=i, source=s, target=g if isinstance(g, str) else g[0],
                        references=() if isinstance(g, str) else tuple(g))
                for i, s, g in zip("abc", SOURCES, refs, strict=True)]
    df = DocumentFrequency.from_references([list(e.refs) for e in examples])
    expected = RewardWorker(serve_cfg.reward, df).score(worker.sample(examples))
    pairs = r.json()["pairs"]
    assert pairs == [vars(p) for p in expected]
    assert [p["reference"] for p in pairs] == ["11 12 13", "20 22", "30 31 32"]
    # the same samples, scored against more references: the scores move
    assert [(p["score_a"], p["score_b"]) for p in pairs] != [(p["score_a"], p["score_b"])
                                                             for p in gold_only.json()["pairs"]]


@pytest.mark.parametrize(("route", "body", "loc", "token"), [
    # The #16 reproducers on every route that takes texts (the tiny vocabulary has data tokens 0..59).
    ("/v1/candidates", {"sources": ["7", "999999 7"]}, ["body", "sources", 1], "'999999' is outside the vocabulary"),
    ("/v1/candidates", {"sources": ["hello world"]}, ["body", "sources", 0], "'hello' is not a non-negative integer"),
    ("/v1/candidates", {"sources": ["１２ ７"]}, ["body", "sources", 0], "'１２' is not a non-negative integer"),
    ("/v1/pairs", {"sources": ["1", "2 x"], "references": ["3", "4"]}, ["body", "sources", 1], "'x'"),
    ("/v1/pairs", {"sources": ["1"], "references": ["3 60"]}, ["body", "references", 0], "'60' is outside"),
    ("/v1/pairs", {"sources": ["1", "2"], "references": ["3", ["4", "5 60"]]}, ["body", "references", 1, 1],
     "'60' is outside"),
    ("/v1/score", {"source": "1 ü", "targets": ["2"]}, ["body", "source"], "'ü'"),
    ("/v1/score", {"source": "1", "targets": ["2", "3 007"]}, ["body", "targets", 1], "'007'"),
    # The special-token rule (#18): refused, naming the token; only <sep> may appear in a text.
    ("/v1/score", {"source": "1", "targets": ["</s>"]}, ["body", "targets", 0], "special token '</s>'"),
    ("/v1/score", {"source": "1", "targets": ["2 <pad>"]}, ["body", "targets", 0], "special token '<pad>'"),
    ("/v1/candidates", {"sources": ["<s> 1"]}, ["body", "sources", 0], "special token '<s>'"),
])
def test_texts_obey_the_data_loaders_token_rule(client, route, body, loc, token):
    r = client.post(route, json=body)
    assert r.status_code == 422, r.text
    [error] = r.json()["detail"]
    assert error["loc"] == loc and token in error["msg"], error


@pytest.mark.parametrize(("body", "loc"), [
    ({"sources": []}, ["body", "sources"]),
    ({"sources": [""]}, ["body", "sources", 0]),
    ({"sources": ["1", "  \n"]}, ["body", "sources", 1]),
    ({"sources": ["1"], "colour": "red"}, ["body", "colour"]),
    ({"sources": ["1"], "temperature": -1}, ["body", "temperature"]),
    ({"sources": ["1"], "top_p": 1.5}, ["body", "top_p"]),
    ({"sources": ["1"], "seed": 2**70}, ["body", "seed"]),
    ({"sources": ["1"], "num_candidates": 7}, ["body", "num_candidates"]),  # serve.max_candidates_per_source=6
    ({"sources": ["1"] * 9}, ["body", "sources"]),  # serve.max_sources_per_call=8
    ({"sources": ["1", " ".join(["5"] * 41)]}, ["body", "sources", 1]),  # serve.max_tokens_per_source=40
    ({"sources": ["1"], "max_new_tokens": 257}, ["body", "max_new_tokens"]),  # tiny model: 256 positions
    ({"sources": ["1"], "mode": "greedy"}, ["body", "mode"]),
    ({"sources": "1"}, ["body", "sources"]),
])
def test_bad_candidate_requests_are_422_naming_the_field(client, body, loc):
    r = client.post("/v1/candidates", json=body)
    assert r.status_code == 422, r.text
    assert loc in [e["loc"] for e in r.json()["detail"]]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/candidates", {"sources": ["11 12"], "temperature": 1e-300}),
    ("/v1/candidates", {"sources": ["11 12"], "temperature": 1e-30, "top_k": 3}),
    ("/v1/pairs", {"sources": ["11 12"], "references": ["11"], "temperature": 1e-300}),
])
def test_a_temperature_too_small_to_divide_by_is_a_422(client, path, body):
    """Logits divided by under about 1e-38 overflow: pad tokens and null log-probs, answered with a 200."""
    r = client.post(path, json={**body, "max_new_tokens": 3, "seed": 1})
    assert r.status_code == 422, r.text[:300]
    assert [e["loc"] for e in r.json()["detail"]] == [["body", "temperature"]]
    smallest = client.post("/v1/candidates", json={"sources": ["11 12"], "temperature": MIN_TEMPERATURE,
                                                   "max_new_tokens": 3, "seed": 1})
    assert smallest.status_code == 200 and "null" not in smallest.text


def test_bad_pairs_and_score_requests_name_the_field(client):
    r = client.post("/v1/pairs", json={"sources": ["1", "2"], "references": ["3"]})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "references"]
    r = client.post("/v1/pairs", json={"sources": ["1"], "references": ["3"], "example_ids": ["a", "b"]})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "example_ids"]
    r = client.post("/v1/score", json={"source": "1", "targets": ["2"] * 7})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "targets"]
    r = client.post("/v1/score", json={"source": "1", "targets": ["2", " ".join(["3"] * 41)]})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "targets", 1]
    r = client.post("/v1/score", content=b'{"source": "1", "targets": [NaN]}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 422
    r = client.post("/v1/candidates", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422


def test_a_request_is_refused_at_its_first_long_text_without_tokenizing_the_rest(client, monkeypatch):
    backend = client.app.state.batcher.backend
    seen: list[str] = []
    real = backend.check_text
    monkeypatch.setattr(backend, "check_text", lambda text: seen.append(text) or real(text))
    long = " ".join(["3"] * 41)  # the tiny config's limit is 40 tokens
    r = client.post("/v1/candidates", json={"sources": ["11 12", long, "13", "14"]})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "sources", 1]
    assert seen == ["11 12", long]


def test_text_checks_run_off_the_event_loop(client, monkeypatch):
    """A request whose texts take long to check (a large body: tokenizing 4 MiB takes seconds) leaves the
    server answering others, /healthz included, while it is checked."""
    import threading

    backend = client.app.state.batcher.backend
    real, entered, answered = backend.check_text, threading.Event(), threading.Event()
    released: list[bool] = []

    def slow_check(text: str):
        entered.set()
        # released once /healthz has answered; on the event loop, this wait would hold /healthz until it ran out
        released.append(answered.wait(20))
        return real(text)

    monkeypatch.setattr(backend, "check_text", slow_check)
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=client.post("/v1/candidates", json={"sources": ["11 12"],
                                                                                          "max_new_tokens": 2})))
    t.start()
    try:
        assert entered.wait(30)
        assert client.get("/healthz").status_code == 200
        assert "r" not in result  # the checked request is still waiting for its check
    finally:
        answered.set()
        t.join(60)
    assert result["r"].status_code == 200 and released == [True]


def test_model_info_health_and_metrics(client, checkpoint_root):
    info = client.get("/v1/model").json()
    assert info["version"] == 0 and info["checkpoint"] == str(checkpoint_root / "epoch-0001")
    assert len(info["checksum"]) == 64 and info["backend"] == "torch" and info["max_source_tokens"] == 40
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ready"}
    client.post("/v1/candidates", json={"sources": ["1", "2"], "max_new_tokens": 3})
    client.post("/v1/candidates", json={"sources": []})
    text = client.get("/metrics").text
    assert 'rlt2t_policy_requests_total{route="/v1/candidates",status="200"} 1.0' in text
    assert 'rlt2t_policy_requests_total{route="/v1/candidates",status="422"} 1.0' in text
    assert "rlt2t_policy_request_seconds_bucket" in text
    assert "rlt2t_policy_batch_sources_sum 2.0" in text
    assert "rlt2t_policy_queue_sources 0.0" in text and "rlt2t_policy_model_version 0.0" in text


def test_bearer_token_from_env_guards_every_route_but_healthz(serve_cfg, checkpoint_root, monkeypatch):
    monkeypatch.setenv("RLT2T_API_TOKEN", "s3cret")
    with TestClient(create_app(serve_cfg, checkpoint_dir=checkpoint_root)) as c:
        assert c.get("/healthz").status_code == 200
        for method, path in (("get", "/v1/model"), ("get", "/readyz"), ("get", "/metrics"),
                             ("post", "/v1/candidates")):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
                r = getattr(c, method)(path, headers=headers)
                assert r.status_code == 401, (path, headers)
                assert r.json() == {"detail": "missing or invalid bearer token"}
        ok = c.post("/v1/candidates", json={"sources": ["1"], "max_new_tokens": 2},
                    headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


@pytest.mark.parametrize("token", ["s3crét", "two words", "tab\there"])
def test_a_token_no_client_can_send_is_refused_at_start(serve_cfg, checkpoint_root, tmp_path, monkeypatch, token):
    monkeypatch.setenv("RLT2T_API_TOKEN", token)
    with pytest.raises(ValueError, match=r"\$RLT2T_API_TOKEN: the bearer token holds"):
        create_app(serve_cfg, checkpoint_dir=checkpoint_root)
    (tmp_path / "token").write_text(token + "\n", encoding="utf-8")
    serve_cfg.serve.token_file = str(tmp_path / "token")
    with pytest.raises(ValueError, match="serve.token_file .*: the bearer token holds"):
        create_app(serve_cfg, checkpoint_dir=checkpoint_root)


def test_token_file_takes_precedence(serve_cfg, checkpoint_root, tmp_path, monkeypatch):
    monkeypatch.setenv("RLT2T_API_TOKEN", "from-env")
    (tmp_path / "token").write_text("from-file\n")
    serve_cfg.serve.token_file = str(tmp_path / "token")
    with TestClient(create_app(serve_cfg, checkpoint_dir=checkpoint_root)) as c:
        assert c.get("/v1/model", headers={"Authorization": "Bearer from-env"}).status_code == 401
        assert c.get("/v1/model", headers={"Authorization": "Bearer from-file"}).status_code == 200


def test_nothing_to_serve_is_a_clear_error(serve_cfg, tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="serve.checkpoint_dir"):
        create_app(serve_cfg, checkpoint_dir=tmp_path / "missing" / "checkpoints")
    assert cli_main(["serve", "policy", "--checkpoint-dir", str(tmp_path / "missing" / "checkpoints"),
                     f"run.dir={tmp_path}"]) == 2
    assert "rlt2t serve: error:" in capsys.readouterr().err


def test_waits_for_the_first_checkpoint_with_503s(serve_cfg, tmp_path, tiny_policy):
    """A root a training run has not written yet: 503 + Retry-After (never 500), then it serves."""
    from rlt2t.common.checkpoint import save_checkpoint

    root = tmp_path / "rank" / "checkpoints"  # does not exist yet; its parent is created below
    root.parent.mkdir()
    cfg = serve_cfg.model_copy(update={"serve": serve_cfg.serve.model_copy(update={"reload_interval_s": 0.05})})
    with TestClient(create_app(cfg, checkpoint_dir=root)) as c:
        assert c.get("/healthz").status_code == 200
        r = c.get("/readyz")
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"  # ceil(reload_interval_s), at least 1
        assert r.json()["detail"] == f"no complete checkpoint under {root} yet"  # why, as the model routes say
        for r in (c.get("/v1/model"), c.post("/v1/candidates", json={"sources": ["11 12"]}),
                  c.post("/v1/score", json={"source": "11", "targets": ["12"]})):
            assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1, r.text
        save_checkpoint(root, "epoch-0001", model=tiny_policy.model, tokenizer=tiny_policy.tokenizer, step=3,
                        meta={"policy_version": 3})
        deadline = time.monotonic() + 20
        while c.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the first checkpoint was never loaded"
            time.sleep(0.05)
        assert c.get("/v1/model").json()["version"] == 3
        assert c.post("/v1/candidates", json={"sources": ["11 12"], "max_new_tokens": 4}).status_code == 200

def test_oversized_bodies_are_refused_before_parsing_or_auth(serve_cfg, checkpoint_root, monkeypatch):
    monkeypatch.setenv("RLT2T_API_TOKEN", "t0ken")
    cfg = serve_cfg.model_copy(update={"serve": serve_cfg.serve.model_copy(update={"max_body_bytes": 2048})})
    with TestClient(create_app(cfg, checkpoint_dir=checkpoint_root)) as c:
        big = {"sources": ["1 " * 1500]}
        r = c.post("/v1/candidates", json=big)  # no token: 401 before any of the body is read
        assert r.status_code == 401
        r = c.post("/v1/candidates", json=big, headers={"Authorization": "Bearer t0ken"})
        assert r.status_code == 413 and "serve.max_body_bytes" in r.json()["detail"]

        def chunks():  # no Content-Length: counted as it streams
            for _ in range(10):
                yield b"x" * 512

        r = c.post("/v1/candidates", content=chunks(), headers={"Authorization": "Bearer t0ken",
                                                                "content-type": "application/json"})
        assert r.status_code == 413
        ok = c.post("/v1/candidates", json={"sources": ["11 12"], "max_new_tokens": 3},
                    headers={"Authorization": "Bearer t0ken"})
        assert ok.status_code == 200


def mbr_reference(metric, texts, total_logprobs, weights):
    """The definitions of docs/design.md, "Minimum-Bayes-risk decoding", by brute force, per entry: uniform,
    leave-one-out over the entries (duplicates as separate entries); probability, over the distinct texts y,
    itself included, at p(y) ∝ exp(total_logprob of y's first entry)."""
    import math

    u = lambda h, r: float(metric.per_sample([h], [[r]])[0])  # noqa: E731
    if weights == "uniform":
        n = len(texts)
        return [sum(u(t, texts[j]) for j in range(n) if j != i) / (n - 1) for i, t in enumerate(texts)]
    distinct = list(dict.fromkeys(texts))
    top = max(total_logprobs)
    p = {y: math.exp(total_logprobs[texts.index(y)] - top) for y in distinct}
    z = sum(p.values())
    return [sum(p[y] / z * u(t, y) for y in distinct) for t in texts]


@pytest.mark.parametrize(("utility", "weights"), [("bleu4", "uniform"), ("sacrebleu", "probability"),
                                                  (None, "uniform"), (None, "probability")])
def test_candidates_rerank_mbr_picks_the_highest_expected_utility(client, utility, weights):
    """``rerank: mbr`` on /v1/candidates: per source, each candidate's expected utility (brute force here) and the
    argmax (ties: the lower index)."""
    from rlt2t.common.metrics import DocumentFrequency, TaskScore, get_metric

    r = client.post("/v1/candidates", json={"sources": SOURCES, "num_candidates": 6, "top_k": 0, "seed": 3,
                                            "max_new_tokens": 8, "rerank": "mbr", "mbr_weights": weights,
                                            **({"utility": utility} if utility else {})})
    assert r.status_code == 200, r.text
    body = r.json()
    for cands, chosen, expected in zip(body["candidates"], body["chosen"], body["expected_utility"], strict=True):
        texts = [c["text"] for c in cands]
        # Without the server's document frequencies, CIDEr-D's come from the pool's distinct texts.
        metric = get_metric(utility) if utility else \
            TaskScore(df=DocumentFrequency.from_references([[t] for t in dict.fromkeys(texts)]))
        want = mbr_reference(metric, texts, [c["total_logprob"] for c in cands], weights)
        assert expected == pytest.approx(want, rel=1e-6, abs=1e-9)
        assert chosen == next(i for i, w in enumerate(want) if w >= max(want) - 1e-9)
    assert body["rerank_seconds"] >= 0
    assert any(len(set(c["text"] for c in cands)) > 1 for cands in body["candidates"])  # a choice was made


def test_candidates_without_rerank_leave_the_mbr_fields_out_and_nothing_else():
    from rlt2t.services.schemas import Candidate, CandidatesResponse

    plain = CandidatesResponse(candidates=[[Candidate(text="a", token_ids=[1], logprobs=[-0.5], total_logprob=-0.5,
                                                      sample_logprobs=[-0.5])]], policy_version=3)
    assert set(plain.model_dump()) == {"candidates", "policy_version"}
    assert set(plain.model_dump()["candidates"][0][0]) == {"text", "token_ids", "logprobs", "total_logprob",
                                                           "sample_logprobs", "forced_eos"}
    plain.chosen, plain.rerank_seconds = [0], 0.0
    assert plain.model_dump()["chosen"] == [0] and plain.model_dump()["rerank_seconds"] == 0.0
    assert "expected_utility" not in plain.model_dump()


def test_candidates_without_rerank_answer_no_mbr_fields(client):
    plain = client.post("/v1/candidates", json={"sources": SOURCES[:1], "num_candidates": 2}).json()
    assert set(plain) == {"candidates", "policy_version"}  # only when asked for


@pytest.mark.parametrize(("utility", "msg"), [
    ("bleu5", "only the vectorised MBR utilities"),
    ("rouge_l", "only the vectorised MBR utilities"),  # registered, but scored one pair per call: unbounded work
    ("mean_length", "only the vectorised MBR utilities"),
    ("classifier_accuracy", "only the vectorised MBR utilities"),
])
def test_an_unusable_mbr_utility_is_a_422_on_utility(client, utility, msg):
    r = client.post("/v1/candidates", json={"sources": SOURCES[:1], "num_candidates": 2, "rerank": "mbr",
                                            "utility": utility})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"][0]
    assert detail["loc"] == ["body", "utility"] and msg in detail["msg"] and f"utility={utility!r}" in detail["msg"]


def test_a_utility_that_cannot_be_built_is_a_422_not_a_500(client):
    """A vectorised name registered anew by a plugin over the built-in metric, failing to build."""
    from rlt2t.common.metrics import _REGISTRY, register_metric

    saved = _REGISTRY["cider_d"]

    def broken(**params):
        raise FileNotFoundError("no data files")

    register_metric("cider_d", replace=True)(broken)
    try:
        r = client.post("/v1/candidates", json={"sources": SOURCES[:1], "num_candidates": 2, "rerank": "mbr",
                                                "utility": "cider_d"})
    finally:
        register_metric("cider_d", replace=True)(saved)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"][0]
    assert detail["loc"] == ["body", "utility"] and "cannot be built" in detail["msg"]
    assert "FileNotFoundError: no data files" in detail["msg"]


@pytest.mark.parametrize("name", ["rouge_l", "mean_length", "bleu5"])
def test_serve_mbr_utility_is_checked_when_the_app_is_created(serve_cfg, checkpoint_root, name):
    cfg = serve_cfg.model_copy(update={"serve": serve_cfg.serve.model_copy(update={"mbr_utility": name})})
    with pytest.raises(ValueError, match=rf"serve.mbr_utility='{name}': the policy server computes only the "
                                         r"vectorised MBR utilities \(bleu4, cider_d, sacrebleu, task_score\)"):
        create_app(cfg, checkpoint_dir=checkpoint_root)


def test_serving_a_run_before_its_rl_points_at_its_sft_checkpoints(serve_cfg, tmp_path):
    run = tmp_path / "fresh"
    (run / "sft" / "checkpoints").mkdir(parents=True)
    cfg = serve_cfg.model_copy(update={"run": serve_cfg.run.model_copy(update={"dir": str(run)}),
                                       "serve": serve_cfg.serve.model_copy(update={"checkpoint_dir":
                                                                                   "{run}/rl/checkpoints"})})
    with pytest.raises(FileNotFoundError, match=r"serve.checkpoint_dir: neither .*/rl/checkpoints nor its parent "
                                                r"exists \(no RL run there yet: to serve the SFT model, "
                                                r"--checkpoint-dir .*/fresh/sft/checkpoints\)"):
        create_app(cfg)
