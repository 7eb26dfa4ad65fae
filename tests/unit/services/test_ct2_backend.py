"""The policy server on the CTranslate2 backend (serve.backend=ct2): same routes and contracts as torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from rlt2t.common.checkpoint import save_checkpoint
from rlt2t.services.policy_app import create_app


@pytest.fixture
def perturbed_root(tmp_path, tiny_policy):
    """A checkpoint of the tiny policy with noised weights, so greedy outputs are not all the same."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in tiny_policy.model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    root = tmp_path / "ct2-checkpoints"
    save_checkpoint(root, "epoch-0002", model=tiny_policy.model, tokenizer=tiny_policy.tokenizer, step=4,
                    meta={"policy_version": 4})
    return root


def _teacher_forced(policy, source: str, ids: list[int]) -> list[float]:
    enc = policy.tokenizer([source], return_tensors="pt")
    labels = torch.tensor([ids])
    with torch.no_grad():
        logits = policy.model.eval()(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                     labels=labels).logits
    return logits.log_softmax(-1)[0].gather(-1, labels[0][:, None])[:, 0].tolist()


@pytest.fixture
def ct2_client(serve_cfg, perturbed_root):
    cfg = serve_cfg.model_copy(update={"serve": serve_cfg.serve.model_copy(update={"backend": "ct2"}),
                                       "export": serve_cfg.export.model_copy(update={"quantization": "float32"})})
    with TestClient(create_app(cfg, checkpoint_dir=perturbed_root)) as c:
        yield c


def test_ct2_backend_serves_candidates_with_raw_logprobs(ct2_client, tiny_policy):
    info = ct2_client.get("/v1/model").json()
    assert info["version"] == 4 and info["backend"] == "ct2"
    body = {"sources": ["11 12 13", "20 21"], "num_candidates": 3, "top_k": 3, "temperature": 0.8,
            "max_new_tokens": 8, "seed": 7}
    first = ct2_client.post("/v1/candidates", json=body)
    assert first.status_code == 200, first.text
    out = first.json()
    assert out["policy_version"] == 4 and [len(c) for c in out["candidates"]] == [3, 3]
    again = ct2_client.post("/v1/candidates", json=body).json()
    assert [[c["text"] for c in s] for s in again["candidates"]] == [[c["text"] for c in s] for s in out["candidates"]]
    for source, cands in zip(body["sources"], out["candidates"], strict=True):
        for c in cands:
            assert len(c["logprobs"]) == len(c["token_ids"]) >= 1
            # float32 export: the log-probs are the torch model's (tiny_policy holds the served weights).
            assert c["logprobs"] == pytest.approx(_teacher_forced(tiny_policy, source, c["token_ids"]), abs=1e-3)


def test_ct2_backend_beam_and_score_match_torch(ct2_client, tiny_policy):
    beam = ct2_client.post("/v1/candidates", json={"sources": ["11 12 13"], "mode": "beam", "beam_size": 4,
                                                   "num_candidates": 2, "max_new_tokens": 8})
    assert beam.status_code == 200, beam.text
    assert len(beam.json()["candidates"][0]) == 2
    scored = ct2_client.post("/v1/score", json={"source": "11 12 13", "targets": ["14 15", "16"]})
    assert scored.status_code == 200, scored.text
    for s in scored.json()["scores"]:
        assert s["logprobs"] == pytest.approx(_teacher_forced(tiny_policy, "11 12 13", s["token_ids"]), abs=1e-3)


def test_ct2_backend_samples_a_nucleus_and_its_sample_logprobs_are_the_filtered_distributions(ct2_client,
                                                                                             tiny_policy):
    """top_p on the ct2 backend: every drawn token inside transformers' nucleus (after the temperature and top-k),
    and the sample log-probs under that filtered distribution, as the learner's ratio reads them."""
    from rlt2t.common.sampling import warp_logits

    body = {"sources": ["11 12 13", "20 21"], "num_candidates": 4, "top_k": 0, "top_p": 0.6, "temperature": 1.5,
            "max_new_tokens": 8, "seed": 3}
    r = ct2_client.post("/v1/candidates", json=body)
    assert r.status_code == 200, r.text
    filtered = 0
    for source, cands in zip(body["sources"], r.json()["candidates"], strict=True):
        enc = tiny_policy.tokenizer([source], return_tensors="pt")
        for c in cands:
            labels = torch.tensor([c["token_ids"]])
            with torch.no_grad():
                logits = tiny_policy.model.eval()(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                                  labels=labels).logits[0]
            warped = warp_logits(logits, body["temperature"], 0, body["top_p"]).log_softmax(-1)
            n = len(c["token_ids"]) - c["forced_eos"]  # a forced EOS was not drawn (sample log-prob 0)
            drawn = warped.gather(-1, labels[0][:, None])[:n, 0]
            assert torch.isfinite(drawn).all(), c  # nothing outside the nucleus
            assert c["sample_logprobs"][:n] == pytest.approx(drawn.tolist(), abs=1e-3)
            filtered += int((~torch.isfinite(warped)).any(dim=-1).sum())
    assert filtered, "the nucleus kept every token at every step: the test shows nothing"
    pairs = ct2_client.post("/v1/pairs", json={"sources": ["11 12"], "references": ["13"], "top_p": 0.6})
    assert pairs.status_code == 200, pairs.text


def test_ct2_backend_refuses_epsilon_with_a_field_error(ct2_client):
    r = ct2_client.post("/v1/candidates", json={"sources": ["11 12"], "epsilon": 0.02})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "epsilon"], r.text
    assert "the ct2 backend has no epsilon sampling" in r.json()["detail"][0]["msg"], r.text
    # beam search draws nothing: the filter is not read there
    beam = ct2_client.post("/v1/candidates", json={"sources": ["11 12"], "mode": "beam", "epsilon": 0.02,
                                                   "max_new_tokens": 4})
    assert beam.status_code == 200, beam.text


def test_ct2_backend_top_k_beyond_the_vocabulary_means_no_filter(ct2_client):
    body = {"sources": ["11 12", "20 21 22"], "num_candidates": 4, "max_new_tokens": 8, "temperature": 1.5,
            "seed": 1}
    beyond = ct2_client.post("/v1/candidates", json={**body, "top_k": 1_000_000})
    assert beyond.status_code == 200, beyond.text
    assert [len(c) for c in beyond.json()["candidates"]] == [4, 4]
    # the same draws as top_k=0 (the whole vocabulary), log-probs and sampler log-probs included
    whole = ct2_client.post("/v1/candidates", json={**body, "top_k": 0})
    assert whole.status_code == 200, whole.text
    assert beyond.json()["candidates"] == whole.json()["candidates"]
    # and not those of a real filter: the comparison above can tell them apart
    filtered = ct2_client.post("/v1/candidates", json={**body, "top_k": 2})
    assert filtered.status_code == 200, filtered.text
    assert filtered.json()["candidates"] != whole.json()["candidates"]


def test_ct2_backend_removes_its_export_when_the_server_stops(serve_cfg, perturbed_root):
    cfg = serve_cfg.model_copy(update={"serve": serve_cfg.serve.model_copy(update={"backend": "ct2"}),
                                       "export": serve_cfg.export.model_copy(update={"quantization": "float32"})})
    with TestClient(create_app(cfg, checkpoint_dir=perturbed_root)) as c:
        export = Path(c.app.state.batcher.backend.ct2.export_dir)
        assert export.is_dir()
        r = c.post("/v1/candidates", json={"sources": ["11 12 13"], "max_new_tokens": 4, "seed": 1})
        assert r.status_code == 200, r.text
    assert not export.exists()  # removed at shutdown, not left for the garbage collector
