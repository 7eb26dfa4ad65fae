"""Reward server, dependencies checked at start-up: a metric (or a named reward with a metric term) whose data is
missing here (METEOR without Debian's wordnet-base) is not offered; the start-up log and GET /v1/metrics say so
with the command that installs it, and a request naming it is a 422 saying the same, never a 500."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from rlt2t.common.config import MetricTerm
from rlt2t.common.metrics import _REGISTRY, available_metrics, get_metric, register_metric
from rlt2t.services.reward_app import create_app

CANDS = ["the dog ran home", "a cat sat"]
REFS = ["the hound ran home", "a cat sat down"]
INSTALL = ("wordnet-base", "`make system-deps`", "`apt-get install wordnet-base`")


def _metrics_error(r) -> dict:
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    return error


def test_without_wordnet_meteor_is_not_offered_and_the_server_says_what_to_install(serve_cfg, no_wordnet, caplog):
    with caplog.at_level(logging.WARNING, logger="rlt2t.services.reward"):
        app = create_app(serve_cfg)
    (warning,) = [r.getMessage() for r in caplog.records if "not offered" in r.getMessage()]
    assert warning.startswith("reward server: 'meteor' is not offered: WordNet data not found")
    assert all(words in warning for words in INSTALL), warning
    with TestClient(app) as client:
        info = client.get("/v1/metrics")
        assert info.status_code == 200, info.text
        offered, unavailable = info.json()["metrics"], info.json()["unavailable"]
        assert "meteor" not in offered and {"bleu4", "rouge_l", "task_score"} <= set(offered)
        assert all(words in unavailable["meteor"] for words in INSTALL), unavailable
        assert "reward.named" in unavailable["classifier_accuracy"]  # needs its classifier: not offered either
        assert set(offered) | set(unavailable) == set(available_metrics())
        for _ in range(2):  # every request, not only the first: a 422 naming the field and the fix
            error = _metrics_error(client.post("/v1/reward", json={"candidates": CANDS, "references": REFS,
                                                                   "metrics": ["bleu4", "meteor"]}))
            assert error["loc"] == ["body", "metrics", 1] and error["input"] == "meteor", error
            assert error["msg"].startswith("'meteor' is not offered by this server: WordNet data not found"), error
            assert all(words in error["msg"] for words in INSTALL), error
        ok = client.post("/v1/reward", json={"candidates": CANDS, "references": REFS, "metrics": ["bleu4"]})
        assert ok.status_code == 200, ok.text
        # A misspelt name lists what is offered: meteor is not among it.
        error = _metrics_error(client.post("/v1/reward", json={"candidates": CANDS, "references": REFS,
                                                               "metrics": ["meteorr"]}))
        assert error["msg"].startswith("unknown metric 'meteorr'; known: ") and "meteor," not in error["msg"], error


@pytest.mark.system_package("wordnet-base")
def test_with_wordnet_meteor_is_offered_and_scores(serve_cfg, caplog):
    with caplog.at_level(logging.WARNING, logger="rlt2t.services.reward"):
        app = create_app(serve_cfg)
    assert not [r for r in caplog.records if "not offered" in r.getMessage()]
    with TestClient(app) as client:
        info = client.get("/v1/metrics").json()
        assert "meteor" in info["metrics"] and "meteor" not in info["unavailable"]
        r = client.post("/v1/reward", json={"candidates": CANDS, "references": REFS, "metrics": ["meteor"]})
        assert r.status_code == 200, r.text
        expected = get_metric("meteor").per_sample(CANDS, [[x] for x in REFS])
        assert r.json()["scores"]["meteor"] == pytest.approx(expected.tolist())


def test_a_named_reward_with_a_metric_missing_its_data_is_not_offered(serve_cfg, no_wordnet, caplog):
    serve_cfg.reward.named = {"fluency": [MetricTerm(name="bleu4"), MetricTerm(name="meteor", weight=0.5)],
                              "overlap": [MetricTerm(name="bleu4")]}
    with caplog.at_level(logging.WARNING, logger="rlt2t.services.reward"):
        app = create_app(serve_cfg)  # starts: the named reward is left out, not built
    assert any(r.getMessage().startswith("reward server: 'fluency' is not offered: reward.named.fluency[1] "
                                         "(metric:meteor): WordNet data not found") for r in caplog.records)
    body = {"candidates": CANDS, "references": REFS, "sources": ["1", "2"]}
    with TestClient(app) as client:
        info = client.get("/v1/metrics").json()
        assert info["named"] == ["overlap"] and "wordnet-base" in info["unavailable"]["fluency"], info
        error = _metrics_error(client.post("/v1/reward", json={**body, "metrics": ["overlap", "fluency"]}))
        assert error["loc"] == ["body", "metrics", 1] and "wordnet-base" in error["msg"], error
        assert error["msg"].startswith("'fluency' is not offered by this server: reward.named.fluency[1]"), error
        r = client.post("/v1/reward", json={**body, "metrics": ["overlap"]})
        assert r.status_code == 200, r.text


class _NeedsModule:
    """A metric of one's own that imports a missing package when built, without declaring the dependency."""

    name = "needs_module_xyz"

    def __init__(self) -> None:
        raise ModuleNotFoundError("No module named 'fancy_metric_backend'")


def test_a_metric_failing_to_build_for_a_missing_package_is_a_422_not_a_500(serve_cfg):
    register_metric("needs_module_xyz")(_NeedsModule)
    try:
        with TestClient(create_app(serve_cfg)) as client:
            error = _metrics_error(client.post("/v1/reward", json={"candidates": CANDS, "references": REFS,
                                                                   "metrics": ["needs_module_xyz"]}))
            assert error["loc"] == ["body", "metrics", 0], error
            assert "ModuleNotFoundError: No module named 'fancy_metric_backend'" in error["msg"], error
            assert "fancy_metric_backend" in client.get("/v1/metrics").json()["unavailable"]["needs_module_xyz"]
    finally:
        del _REGISTRY["needs_module_xyz"]
