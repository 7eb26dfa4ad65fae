"""Reward server: scores equal the metric registry's, multiple references, df file, errors naming the field."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from rlt2t.common.config import RewardConfig
from rlt2t.common.metrics import DocumentFrequency, get_metric
from rlt2t.services.reward_app import create_app

CANDS = ["11 12 13 14", "20 21 22", ""]
REFS = ["11 12 13 15", "20 21 22", "30 31"]


@pytest.fixture
def client(serve_cfg):
    serve_cfg.reward.bleu_weight, serve_cfg.reward.cider_sigma = 0.5, 10.0
    with TestClient(create_app(serve_cfg)) as c:
        yield c


def test_default_is_the_configured_task_score(client):
    r = client.post("/v1/reward", json={"candidates": CANDS, "references": REFS})
    assert r.status_code == 200, r.text
    df = DocumentFrequency.from_references([[x] for x in REFS])
    expected = get_metric("task_score", bleu_weight=0.5, sigma=10.0, df=df).per_sample(CANDS, [[x] for x in REFS])
    assert r.json()["scores"] == {"task_score": pytest.approx(expected.tolist())}
    assert r.json()["scores"]["task_score"][1] > r.json()["scores"]["task_score"][0] > 0


def test_named_metrics_and_multiple_references(client):
    refs = [["11 12 13 15", "11 12 13 14"], "20 21 22", ["30 31"]]
    r = client.post("/v1/reward", json={"candidates": CANDS, "references": refs,
                                        "metrics": ["bleu4", "rouge_l", "cider_d"]})
    assert r.status_code == 200, r.text
    scores = r.json()["scores"]
    nested = [["11 12 13 15", "11 12 13 14"], ["20 21 22"], ["30 31"]]
    assert scores["bleu4"] == pytest.approx(get_metric("bleu4").per_sample(CANDS, nested).tolist())
    assert scores["rouge_l"] == pytest.approx(get_metric("rouge_l").per_sample(CANDS, nested).tolist())
    assert scores["bleu4"][0] == pytest.approx(1.0)  # the second reference matches exactly
    assert set(scores) == {"bleu4", "rouge_l", "cider_d"}


def test_document_frequency_file_is_used(serve_cfg, tmp_path):
    df = DocumentFrequency.from_references([["11 12"], ["13 14"], ["50 51 52"], ["60"]])
    df.save(tmp_path / "df.json")
    with TestClient(create_app(serve_cfg, document_frequency=tmp_path / "df.json")) as c:
        r = c.post("/v1/reward", json={"candidates": CANDS, "references": REFS, "metrics": ["cider_d"]})
    expected = get_metric("cider_d", sigma=serve_cfg.reward.cider_sigma, df=df).per_sample(CANDS, [[x] for x in REFS])
    assert r.json()["scores"]["cider_d"] == pytest.approx(expected.tolist())


@pytest.mark.parametrize(("body", "loc"), [
    ({"candidates": ["1"], "references": ["1"], "metrics": ["task_score", "nope"]}, ["body", "metrics", 1]),
    ({"candidates": ["1", "2"], "references": ["1"]}, ["body", "references"]),
    ({"candidates": [], "references": []}, ["body", "candidates"]),
    ({"candidates": ["1"], "references": [[]]}, ["body", "references", 0]),
    ({"candidates": ["1"], "references": ["1"], "extra": True}, ["body", "extra"]),
    ({"candidates": [" ".join(["7"] * 41)], "references": ["1"]}, ["body", "candidates", 0]),
    ({"candidates": ["1"], "references": [["1", " ".join(["7"] * 41)]]}, ["body", "references", 0, 1]),
    ({"candidates": ["1"], "references": ["1"], "metrics": ["bleu4", "bleu4"]}, ["body", "metrics"]),
])
def test_bad_requests_are_422_naming_the_field(client, body, loc):
    r = client.post("/v1/reward", json=body)
    assert r.status_code == 422, r.text
    assert any(e["loc"][: len(loc)] == loc for e in r.json()["detail"]), r.json()


def test_a_metric_that_needs_constructor_arguments_is_a_422_naming_it(client):
    r = client.post("/v1/reward", json={"candidates": ["1"], "references": ["1"],
                                        "metrics": ["bleu4", "classifier_accuracy"]})
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body", "metrics", 1] and "reward.named" in error["msg"], error
    assert client.post("/v1/reward", json={"candidates": ["1"], "references": ["1"],
                                           "metrics": ["bleu4"]}).status_code == 200


def test_named_cider_rewards_scored_in_parts_count_frequencies_over_the_whole_request(serve_cfg):
    """Without a document-frequency table a request's CIDEr-D counts over all of its references, for a named
    reward too, however many parts (serve.max_reward_call_cost) it is scored in."""
    serve_cfg.reward = RewardConfig(named={"cid": [{"kind": "metric", "name": "cider_d"}],
                                           "task": [{"kind": "metric", "name": "task_score", "weight": 2.0}]})
    cands = ["11 12 13 14", "11 12 7", "20 21", "30 31"]
    refs = ["11 12 13 15", "11 12 9", "20 21 22", "30 31"]
    body = {"candidates": cands, "references": refs, "sources": cands,
            "metrics": ["cider_d", "task_score", "cid", "task"]}
    for call_cost in (10**9, 1):  # one part; one part per candidate
        serve_cfg.serve.max_reward_call_cost = call_cost
        with TestClient(create_app(serve_cfg)) as c:
            r = c.post("/v1/reward", json=body)
        assert r.status_code == 200, r.text
        s = r.json()["scores"]
        nested = [[x] for x in refs]
        expected = get_metric("cider_d", sigma=serve_cfg.reward.cider_sigma,
                              df=DocumentFrequency.from_references(nested)).per_sample(cands, nested)
        assert s["cider_d"] == pytest.approx(expected.tolist()) and min(s["cider_d"]) > 0
        assert s["cid"] == pytest.approx(s["cider_d"]), call_cost
        assert s["task"] == pytest.approx([2 * x for x in s["task_score"]]), call_cost


def test_auth_and_ops_routes(serve_cfg, monkeypatch):
    monkeypatch.setenv("RLT2T_API_TOKEN", "tok")
    with TestClient(create_app(serve_cfg)) as c:
        assert c.get("/healthz").status_code == 200
        assert c.post("/v1/reward", json={"candidates": ["1"], "references": ["1"]}).status_code == 401
        ok = c.post("/v1/reward", json={"candidates": ["1"], "references": ["1"]},
                    headers={"Authorization": "Bearer tok"})
        assert ok.status_code == 200
        text = c.get("/metrics", headers={"Authorization": "Bearer tok"}).text
        assert 'rlt2t_reward_requests_total{route="/v1/reward",status="401"} 1.0' in text
