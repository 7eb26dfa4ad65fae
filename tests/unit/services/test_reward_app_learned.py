"""Reward server, learned rewards: a named reward equals the in-process one, a retrained reward model is
hot-reloaded, requests missing what a reward needs are 422s naming the field."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from rlt2t.common.checkpoint import save_checkpoint
from rlt2t.common.config import RewardConfig, load_config
from rlt2t.common.reward_model import init_reward_model
from rlt2t.common.rewards import RewardModelReward, build_reward
from rlt2t.common.tokenization import save_tokenizer
from rlt2t.services.reward_app import create_app

SOURCES = ["1 2 3", "1 2 3", "4 5"]
CANDS = ["11 12 13 14", "11 12 7", "20 21"]


def save_reward_model(root, name: str, init, step: int, seed: int, best: str | None = None):
    model = init_reward_model(init, max_source_len=16, max_candidate_len=16, seed=seed)
    torch.nn.init.normal_(model.head.weight)
    meta = {"best": {"path": str(root / best), "score": 0.8}} if best else None
    save_checkpoint(root, name, model=model, tokenizer=model.tokenizer, step=step, meta=meta)
    return model.eval()


@pytest.fixture
def served(tmp_path, tiny_policy, serve_cfg):
    tiny_policy.model.save_pretrained(tmp_path / "policy")
    save_tokenizer(tiny_policy.tokenizer, tmp_path / "policy")
    root = tmp_path / "rm" / "checkpoints"
    first = save_reward_model(root, "epoch-0001", tmp_path / "policy", step=10, seed=0)
    cfg = load_config([], [f"run.dir={tmp_path}", "model.preset=tiny", "serve.max_wait_ms=0", "reward.device=cpu",
                           f"reward.named={{prefs: [{{kind: reward_model, path: '{root}'}}], "
                           f"mixed: [{{kind: reward_model, path: '{root}'}}, "
                           "{kind: metric, name: bleu4, weight: 2}]}"])
    return cfg, root, first, tmp_path / "policy"


def test_named_reward_equals_the_in_process_reward(served):
    cfg, root, model, _ = served
    with TestClient(create_app(cfg)) as client:
        r = client.post("/v1/reward", json={"candidates": CANDS, "sources": SOURCES, "metrics": ["prefs"]})
        assert r.status_code == 200, r.text
        local = build_reward(cfg.reward, terms=cfg.reward.named["prefs"]).score(SOURCES, CANDS)
        assert r.json()["scores"]["prefs"] == pytest.approx(local.tolist(), abs=1e-6)
        assert r.json()["scores"]["prefs"] == pytest.approx(model.score(SOURCES, CANDS).tolist(), abs=1e-5)
        # A weighted sum with a metric, next to a plain metric, in one request.
        refs = ["11 12 13 14", "11 12 13 14", "20 21"]
        r = client.post("/v1/reward", json={"candidates": CANDS, "sources": SOURCES, "references": refs,
                                            "metrics": ["mixed", "bleu4"]})
        assert r.status_code == 200, r.text
        scores = r.json()["scores"]
        expected = model.score(SOURCES, CANDS) + 2 * torch.tensor(scores["bleu4"]).numpy()
        assert scores["mixed"] == pytest.approx(expected.tolist(), abs=1e-5)


def test_a_retrained_reward_model_is_hot_reloaded(served):
    cfg, root, first, init = served
    app = create_app(cfg)
    with TestClient(app) as client:
        def prefs() -> list[float]:
            r = client.post("/v1/reward", json={"candidates": CANDS, "sources": SOURCES, "metrics": ["prefs"]})
            assert r.status_code == 200, r.text
            return r.json()["scores"]["prefs"]

        before = prefs()
        second = save_reward_model(root, "epoch-0002", init, step=20, seed=1)
        watcher = app.state.named_rewards.watchers[0]  # polled every serve.reload_interval_s; tick it now
        assert watcher.check_once()
        assert prefs() == pytest.approx(second.score(SOURCES, CANDS).tolist(), abs=1e-5)
        assert prefs() != pytest.approx(before, abs=1e-3)
        (_, _, term), = app.state.named_rewards.rewards["prefs"].terms
        assert term.version == 20

        # As the RL job loads it: the checkpoint of best held-out accuracy, which the newest one records; a
        # newer but worse epoch is not served, and the best may be an older one.
        save_reward_model(root, "epoch-0003", init, step=30, seed=2, best="epoch-0002")
        assert not watcher.check_once()
        save_reward_model(root, "epoch-0004", init, step=40, seed=3, best="epoch-0001")
        assert watcher.check_once()
        assert prefs() == pytest.approx(first.score(SOURCES, CANDS).tolist(), abs=1e-5)
        (_, _, term), = app.state.named_rewards.rewards["prefs"].terms
        assert term.version == 10
        # a best that is no longer there (pruned): the newest, as best_or_latest picks it
        save_reward_model(root, "epoch-0005", init, step=50, seed=4, best="epoch-0009")
        assert watcher.check_once()
        (_, _, term), = app.state.named_rewards.rewards["prefs"].terms
        assert term.version == 50


def test_a_reload_between_the_parts_of_a_request_leaves_it_on_one_model(served, monkeypatch):
    """A request over serve.max_reward_call_cost is scored in parts; a retrained model landing between two of
    them serves the next request, never the rest of this one."""
    cfg, root, first, init = served
    cfg.serve.max_reward_call_cost = 1  # one part per candidate
    app = create_app(cfg)
    watcher = app.state.named_rewards.watchers[0]
    second = save_reward_model(root, "epoch-0002", init, step=20, seed=1)
    parts: list[int] = []
    score = RewardModelReward.score

    def score_then_reload(self, *args, **kwargs):
        out = score(self, *args, **kwargs)
        parts.append(self.version)
        if len(parts) == 2:
            assert watcher.check_once()  # the poll thread lands between two parts of one request
        return out

    monkeypatch.setattr(RewardModelReward, "score", score_then_reload)
    with TestClient(app) as client:
        r = client.post("/v1/reward", json={"candidates": CANDS, "sources": SOURCES, "metrics": ["prefs"]})
        assert r.status_code == 200, r.text
        assert parts == [10] * len(CANDS)
        assert r.json()["scores"]["prefs"] == pytest.approx(first.score(SOURCES, CANDS).tolist(), abs=1e-5)
        assert r.json()["reward_model_versions"] == {"prefs": {"reward_model": 10}}
        r = client.post("/v1/reward", json={"candidates": CANDS, "sources": SOURCES, "metrics": ["prefs"]})
        assert r.json()["scores"]["prefs"] == pytest.approx(second.score(SOURCES, CANDS).tolist(), abs=1e-5)
        assert r.json()["reward_model_versions"] == {"prefs": {"reward_model": 20}}


@pytest.mark.parametrize(("body", "loc"), [
    ({"candidates": CANDS, "metrics": ["prefs"]}, ["body", "sources"]),
    ({"candidates": CANDS, "sources": SOURCES, "metrics": ["mixed"]}, ["body", "references"]),
    ({"candidates": CANDS, "sources": SOURCES}, ["body", "references"]),  # task_score by default
    ({"candidates": CANDS, "sources": SOURCES[:2], "metrics": ["prefs"]}, ["body", "sources"]),
    ({"candidates": CANDS, "sources": SOURCES, "metrics": ["prefz"]}, ["body", "metrics", 0]),
])
def test_missing_inputs_are_422s_naming_the_field(served, body, loc):
    cfg, *_ = served
    with TestClient(create_app(cfg)) as client:
        r = client.post("/v1/reward", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == loc


def test_named_rewards_may_not_shadow_metrics(serve_cfg):
    serve_cfg.reward = RewardConfig(named={"bleu4": [{"kind": "metric", "name": "chrf"}]})
    with pytest.raises(ValueError, match="bleu4 would shadow registered metrics"):
        create_app(serve_cfg)
