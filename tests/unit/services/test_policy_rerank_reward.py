"""``rerank: reward`` on the policy server's /v1/candidates: the pick of a reference-free reward of the config
(reward.named, or reward.terms), built once; refused with a 422 on ``reward`` when it is unknown, cannot be loaded
or reads references."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

import rlt2t.services.policy_app as policy_app
from rlt2t.common.config import MetricTerm, PythonTerm, RewardModelTerm
from rlt2t.services.policy_app import create_app

SOURCES = ["11 12 13 14", "20 21", "30 31 32 33 34 35 36"]
CALLS: list[tuple[list[str], list[str], list[list[str]]]] = []


def digit_sum(sources, candidates, references):
    """A reference-free reward: the sum of the candidate's numbers, mod 13 (so that ties happen and count)."""
    CALLS.append((list(sources), list(candidates), [list(r) for r in references]))
    return [float(sum(int(t) for t in c.split()) % 13) for c in candidates]


def not_finite(sources, candidates, references):
    return [float("nan")] * len(candidates)


def serving(serve_cfg, named):
    return serve_cfg.model_copy(update={"reward": serve_cfg.reward.model_copy(update={"named": named})})


@pytest.fixture
def client(serve_cfg, checkpoint_root, tmp_path):
    cfg = serving(serve_cfg, {
        "digits": [PythonTerm(fn=digit_sum)],
        "with_bleu": [PythonTerm(fn=digit_sum), MetricTerm(name="bleu4", weight=0.5)],
        "missing_fn": [PythonTerm(fn="no_such_module_here:fn")],
        "missing_model": [RewardModelTerm(path=str(tmp_path / "no-reward-model"))],
        "nan": [PythonTerm(fn=not_finite)],
    })
    with TestClient(create_app(cfg, checkpoint_dir=checkpoint_root)) as c:
        yield c


def expected_pick(cands: list[dict]) -> tuple[int, list[float]]:
    """The rule by hand: the highest reward, ties to the higher mean log-prob, then to the earlier text; the first
    entry of the chosen text."""
    scores = [float(sum(int(t) for t in c["text"].split()) % 13) for c in cands]
    best = 0
    for k, c in enumerate(cands):
        mean = c["total_logprob"] / len(c["logprobs"])
        top = cands[best]["total_logprob"] / len(cands[best]["logprobs"])
        if (scores[k], mean) > (scores[best], top):
            best = k
    return next(k for k, c in enumerate(cands) if c["text"] == cands[best]["text"]), scores


def test_rerank_reward_answers_the_rewards_pick(client):
    CALLS.clear()
    body = {"sources": SOURCES, "num_candidates": 6, "top_k": 0, "seed": 5, "max_new_tokens": 8, "rerank": "reward",
            "reward": "digits"}
    r = client.post("/v1/candidates", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"candidates", "policy_version", "chosen", "reward_scores", "rerank_seconds"}
    for cands, chosen, scores in zip(out["candidates"], out["chosen"], out["reward_scores"], strict=True):
        want_chosen, want_scores = expected_pick(cands)
        assert scores == want_scores and chosen == want_chosen
    # One call over each source's distinct texts, each with its own source and no references.
    (sources, texts, refs), = CALLS
    distinct = [list(dict.fromkeys(c["text"] for c in cands)) for cands in out["candidates"]]
    assert texts == [t for ts in distinct for t in ts]
    assert sources == [s for s, ts in zip(SOURCES, distinct, strict=True) for _ in ts]
    assert refs == [[] for _ in texts]
    assert any(len(set(s)) > 1 for s in out["reward_scores"])  # the reward decided somewhere
    assert out["rerank_seconds"] >= 0


def test_a_reward_is_built_once(client, monkeypatch):
    built = []
    real = policy_app.build_reward

    def counting(*args, **kwargs):
        built.append(kwargs.get("where"))
        return real(*args, **kwargs)

    monkeypatch.setattr(policy_app, "build_reward", counting)
    body = {"sources": SOURCES[:1], "num_candidates": 2, "max_new_tokens": 4, "rerank": "reward", "reward": "digits"}
    for _ in range(3):
        assert client.post("/v1/candidates", json=body).status_code == 200
    assert built == ["reward.named.digits"]


@pytest.mark.parametrize(("reward", "msg"), [
    ("prefs", "reward='prefs': not a reward of this server's reward.named (configured: digits, missing_fn, "
              "missing_model, nan, with_bleu)"),
    ("with_bleu", "reward.named.with_bleu term metric:bleu4 needs references, which a reranker does not have"),
    (None, "reward.terms term metric:task_score needs references"),  # the default reward.terms: the task score
    ("missing_fn", "reward.named.missing_fn cannot be loaded on this server (ConfigError: "),
    ("missing_model", "reward.named.missing_model cannot be loaded on this server ("),
    ("nan", "reward.named.nan: reward term python:"),
    ("nan", "not_finite returned nan (candidate 0: "),
])
def test_a_reward_the_server_cannot_rerank_with_is_a_422_on_reward(client, reward, msg):
    body = {"sources": SOURCES[:1], "num_candidates": 2, "max_new_tokens": 4, "rerank": "reward",
            **({"reward": reward} if reward else {})}
    for _ in range(2):  # refused again the same way (a refusal is remembered, a load failure tried again)
        r = client.post("/v1/candidates", json=body)
        assert r.status_code == 422, r.text
        (detail,) = r.json()["detail"]
        assert detail["loc"] == ["body", "reward"] and msg in detail["msg"], detail


@pytest.mark.parametrize(("extra", "field"), [
    ({"rerank": "rewards"}, "rerank"),
    ({"rerank": "reward", "reward": 3}, "reward"),
    ({"rerank": "reward", "reward": ""}, "reward"),
    ({"rerank": "reward", "reward": ["digits"]}, "reward"),
    ({"reward": "digits"}, "reward"),  # read only with rerank: reward
    ({"rerank": "mbr", "reward": "digits"}, "reward"),
    ({"rerank": "reward", "reward": "digits", "utility": "bleu4"}, "utility"),  # read only with rerank: mbr
    ({"mbr_weights": "probability"}, "mbr_weights"),  # read only with rerank: mbr
])
def test_a_bad_rerank_field_is_a_422_naming_it(client, extra, field):
    r = client.post("/v1/candidates", json={"sources": SOURCES[:1], "num_candidates": 2, "max_new_tokens": 4, **extra})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"][:2] == ["body", field]


def test_a_reward_is_checked_before_decoding(client, monkeypatch):
    """A refused reward costs no model call."""
    monkeypatch.setattr(policy_app, "_run_candidates", lambda *a: pytest.fail("decoded before the refusal"))
    r = client.post("/v1/candidates", json={"sources": SOURCES[:1], "rerank": "reward", "reward": "with_bleu"})
    assert r.status_code == 422


def test_the_default_mbr_weights_sent_without_a_rerank_is_accepted(client):
    """The typed client sends every field, `mbr_weights: uniform` included: only another value is refused."""
    r = client.post("/v1/candidates", json={"sources": SOURCES[:1], "num_candidates": 2, "max_new_tokens": 4,
                                            "mbr_weights": "uniform"})
    assert r.status_code == 200, r.text
