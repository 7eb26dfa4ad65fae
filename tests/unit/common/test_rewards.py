"""The reward registry: each term kind against its own computation, weighted sums, reference-free rewards,
the HTTP term against a mock server, the reward worker built from the registry."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from rlt2t.actors.reward import RewardWorker
from rlt2t.common.checkpoint import save_checkpoint
from rlt2t.common.config import ClassifierTerm, HttpTerm, ModelConfig, RewardConfig, load_config
from rlt2t.common.metrics import DocumentFrequency, get_metric
from rlt2t.common.policy import load_policy
from rlt2t.common.reward_model import init_reward_model
from rlt2t.common.rewards import HttpReward, build_reward, score_pairs
from rlt2t.common.tokenization import load_tokenizer, save_tokenizer
from rlt2t.common.types import CandidateSet

SOURCES = ["1 2 3", "1 2 3", "4 5"]
CANDS = ["11 12 13 14", "11 12 7", "20 21"]
REFS = [["11 12 13 15"], ["11 12 13 15"], ["20 21 22"]]


@pytest.fixture(scope="module")
def reward_model_root(tmp_path_factory, ids_tokenizer_dir):
    """A checkpoint root holding a (randomly initialised) seq2seq reward model on the tiny policy."""
    tmp = tmp_path_factory.mktemp("rm")
    policy = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0)
    policy.model.save_pretrained(tmp / "policy")
    save_tokenizer(policy.tokenizer, tmp / "policy")
    model = init_reward_model(tmp / "policy", max_source_len=16, max_candidate_len=16, seed=0)
    torch.nn.init.normal_(model.head.weight)  # make the scores spread
    save_checkpoint(tmp / "checkpoints", "epoch-0001", model=model, tokenizer=model.tokenizer, step=7)
    return tmp / "checkpoints", model.eval()


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory, ids_tokenizer_dir):
    out = tmp_path_factory.mktemp("clf")
    tok = load_tokenizer(ids_tokenizer_dir)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64, pad_token_id=tok.pad_token_id, num_labels=3,
                        id2label={0: "neg", 1: "neu", 2: "pos"}, label2id={"neg": 0, "neu": 1, "pos": 2})
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(out)
    save_tokenizer(tok, out)
    return out, model, tok


def test_default_reward_is_the_task_score_with_the_shipped_df():
    df = DocumentFrequency.from_references([["11 12 13 15"], ["20 21 22"], ["30 31"]])
    cfg = RewardConfig(bleu_weight=0.25, cider_sigma=9.0)
    reward = build_reward(cfg, document_frequency=df)
    expected = get_metric("task_score", bleu_weight=0.25, sigma=9.0, df=df).per_sample(CANDS, REFS)
    assert reward.score(SOURCES, CANDS, REFS).tolist() == expected.tolist()
    assert reward.needs_references
    with pytest.raises(ValueError, match="'task_score' is a reference metric: it needs references"):
        reward.score(SOURCES, CANDS, None)


def test_weighted_sum_of_reward_model_and_cider(reward_model_root):
    root, model = reward_model_root
    df = DocumentFrequency.from_references(REFS)
    cfg = load_config([], [f"reward.terms=[{{kind: reward_model, path: '{root}'}}, {{kind: metric, name: cider_d, "
                           "weight: 0.5}]", "reward.cider_sigma=4"]).reward
    reward = build_reward(cfg, document_frequency=df)
    rm = model.score(SOURCES, CANDS)
    cider = get_metric("cider_d", sigma=4.0, df=df).per_sample(CANDS, REFS)
    assert reward.score(SOURCES, CANDS, REFS) == pytest.approx(rm + 0.5 * cider, abs=1e-6)
    parts = reward.score_terms(SOURCES, CANDS, REFS)
    assert list(parts) == ["reward_model", "metric:cider_d"]
    assert parts["metric:cider_d"] == pytest.approx(0.5 * cider)


def test_reward_model_alone_is_reference_free_and_batched(reward_model_root):
    root, model = reward_model_root
    cfg = RewardConfig(terms=[{"kind": "reward_model", "path": str(root), "batch_size": 2}])
    reward = build_reward(cfg)
    assert not reward.needs_references
    scores = reward.score(SOURCES, CANDS, None)
    assert scores.dtype == np.float64 and scores.shape == (3,)
    assert scores == pytest.approx([model.score([s], [c])[0] for s, c in zip(SOURCES, CANDS, strict=True)], abs=1e-5)
    (_, _, term), = reward.terms
    assert term.root == root and term.version == 7  # the checkpoint root is what the reward server watches
    # its directory is not a policy (eval, export, serve, --init): it loads as one but was trained to score
    with pytest.raises(ValueError, match=r"epoch-0001 is a reward model \(`rlt2t reward-model train`\), not a "):
        load_policy(ModelConfig(preset=None), checkpoint=root / "epoch-0001")


@pytest.mark.parametrize(("label", "output", "text"), [("pos", "probability", "candidate"), ("0", "logit", "pair"),
                                                       ("neu", "log_probability", "candidate")])
def test_classifier_term_is_the_labels_probability_or_logit(classifier_dir, label, output, text):
    path, model, tok = classifier_dir
    reward = build_reward(RewardConfig(terms=[ClassifierTerm(path=str(path), label=label, output=output, text=text,
                                                             weight=2.0)]))
    enc = tok(SOURCES, CANDS, padding=True, return_tensors="pt") if text == "pair" else tok(CANDS, padding=True,
                                                                                              return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits.double()
    index = {"pos": 2, "0": 0, "neu": 1}[label]
    expected = {"logit": logits[:, index], "probability": logits.softmax(-1)[:, index],
                "log_probability": logits.log_softmax(-1)[:, index]}[output]
    assert reward.score(SOURCES, CANDS) == pytest.approx((2.0 * expected).tolist(), abs=1e-5)


def test_classifier_pair_over_the_limit_is_cut_not_refused(classifier_dir):
    """A candidate longer than the pair's limit is cut with the source (the fast tokenizer refused to cut the
    source alone below zero and the reward worker died); a pair within the limit is scored as it is."""
    path, model, tok = classifier_dir
    reward = build_reward(RewardConfig(terms=[ClassifierTerm(path=str(path), label="pos", output="logit",
                                                             text="pair", max_length=16)]))
    long_cand = " ".join(["5"] * 20)
    enc = tok(["1 2 3"], [long_cand], truncation="longest_first", max_length=16, return_tensors="pt")
    assert enc["input_ids"].shape[1] == 16
    with torch.no_grad():
        expected = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits[0, 2].item()
    assert reward.score(["1 2 3"], [long_cand]) == pytest.approx([expected], abs=1e-5)


def test_rewards_follow_the_metric_settings_unless_set():
    """The rewards optimise the metric the run is judged on: metric.cider_sigma / bleu_weight reach the reward
    terms unless reward.* says otherwise."""
    cfg = load_config([], ["metric.cider_sigma=15", "metric.bleu_weight=0.5"])
    assert (cfg.reward.cider_sigma, cfg.reward.bleu_weight) == (15.0, 0.5)
    refs = [["11 12 13 15 16 17 18 19 20 21 22"]]
    expected = get_metric("task_score", bleu_weight=0.5, sigma=15.0).per_sample(["11 12 13"], refs)
    assert build_reward(cfg.reward).score(["1"], ["11 12 13"], refs).tolist() == expected.tolist()
    own = load_config([], ["metric.cider_sigma=15", "reward.cider_sigma=4"])
    assert (own.reward.cider_sigma, own.metric.cider_sigma) == (4.0, 15.0)


def test_unknown_names_fail_with_the_term_named(classifier_dir):
    path, _, _ = classifier_dir
    with pytest.raises(ValueError, match=r"label='happy' is not a label of .*\(labels: neg, neu, pos\)"):
        build_reward(RewardConfig(terms=[ClassifierTerm(path=str(path), label="happy")]))
    with pytest.raises(ValueError, match=r"reward.terms\[1\]: unknown metric 'nope'"):
        build_reward(RewardConfig(terms=[{"kind": "metric"}, {"kind": "metric", "name": "nope"}]))


def test_learned_terms_are_checked_before_a_job_starts(classifier_dir, reward_model_root, tmp_path):
    """check_reward (what train, eval and predict call before Ray or a model loads) reads a learned term's files:
    a wrong path, a classifier where a reward model is expected (or the reverse) and an unknown label each fail
    naming the term; a classifier's checkpoint root is a path, as for the reward itself."""
    from rlt2t.common.config import ConfigError
    from rlt2t.common.rewards import check_reward

    clf, _, tok = classifier_dir
    root, _ = reward_model_root

    def check(*terms: dict) -> None:
        check_reward(RewardConfig(terms=[{"kind": "metric"}, *terms]))

    check({"kind": "classifier", "path": str(clf), "label": "pos"}, {"kind": "reward_model", "path": str(root)})
    with pytest.raises(ConfigError, match=r"reward.terms\[1\].path: .*nope: neither a model directory nor"):
        check({"kind": "classifier", "path": str(tmp_path / "nope"), "label": "pos"})
    with pytest.raises(ConfigError, match=r"reward.terms\[1\].label='happy' is not a label of .*\(labels: neg, neu"):
        check({"kind": "classifier", "path": str(clf), "label": "happy"})
    with pytest.raises(ConfigError, match=r"reward.terms\[1\].path: .* is not a reward model \(no rlt2t_reward_model"):
        check({"kind": "reward_model", "path": str(clf)})
    # a classifier's checkpoint root: its checkpoint, for the reward and for the eval column alike
    save_checkpoint(tmp_path / "clf" / "checkpoints", "epoch-0001",
                    model=BertForSequenceClassification.from_pretrained(clf), tokenizer=tok, step=1)
    check({"kind": "classifier", "path": str(tmp_path / "clf" / "checkpoints"), "label": "neu"})
    assert get_metric("classifier_accuracy", path=tmp_path / "clf" / "checkpoints").per_sample(
        ["11 12"], [["11 12"]]).tolist() == [1.0]


def test_http_term_posts_sources_and_retries_503():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        calls.append(body)
        if len(calls) == 1:
            return httpx.Response(503, headers={"Retry-After": "0"}, json={"detail": "busy"})
        return httpx.Response(200, json={"scores": {"prefs": [float(len(c)) for c in body["candidates"]]}})

    reward = HttpReward(HttpTerm(url="http://reward", name="prefs", batch_size=2),
                        transport=httpx.MockTransport(handler))
    assert not reward.needs_references  # not a registered metric: the server's named reward
    assert reward.score(SOURCES, CANDS, None).tolist() == [float(len(c)) for c in CANDS]
    assert calls[1] == {"candidates": CANDS[:2], "sources": SOURCES[:2], "metrics": ["prefs"]}
    assert len(calls) == 3  # one 503 retried, then two batches of at most 2

    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(422, json={"detail": [{"loc": ["body", "metrics", 0], "msg": "unknown"}]})

    with pytest.raises(RuntimeError, match="HTTP 422.*metrics"):
        HttpReward(HttpTerm(url="http://reward"), transport=httpx.MockTransport(refuse)).score(SOURCES, CANDS, REFS)


def test_http_term_retries_a_refused_connection_and_names_the_server_when_it_gives_up(monkeypatch):
    waits: list[float] = []
    monkeypatch.setattr("rlt2t.common.rewards.time.sleep", waits.append)
    calls = []

    def refused_once(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content))
        if len(calls) == 1:
            raise httpx.ConnectError("connection refused")
        return httpx.Response(200, json={"scores": {"bleu4": [0.5] * len(calls[-1]["candidates"])}})

    reward = HttpReward(HttpTerm(url="http://reward", name="bleu4"), transport=httpx.MockTransport(refused_once))
    assert reward.needs_references
    assert reward.score(SOURCES, CANDS, REFS).tolist() == [0.5] * 3
    assert len(calls) == 2 and len(waits) == 1 and calls[1]["references"] == REFS

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    with pytest.raises(RuntimeError, match="reward server http://reward: .*connection refused"):
        HttpReward(HttpTerm(url="http://reward"), transport=httpx.MockTransport(refused)).score(SOURCES, CANDS, REFS)
    assert len(waits) == 1 + 3  # three retries, then it gives up


def test_score_pairs_and_the_worker_score_through_a_reward_model(reward_model_root):
    root, model = reward_model_root
    cfg = RewardConfig(terms=[{"kind": "reward_model", "path": str(root)}], device="cpu")
    worker = RewardWorker(cfg, None)  # no CIDEr-D term: no document frequencies needed
    sets = [CandidateSet("e1", "1 2 3", "9 9", ("11 12 13 14", "11 12 7"), ("11 12 13 14", "11 12 7"), 2)]
    (pair,) = worker.score(sets)
    (pair2,) = score_pairs(build_reward(cfg), sets)
    assert pair == pair2
    expected = model.score(["1 2 3"] * 2, ["11 12 13 14", "11 12 7"])
    assert (pair.score_a, pair.score_b) == pytest.approx(sorted(expected.tolist(), reverse=True), abs=1e-5)
    assert pair.use_rank and pair.score_a > pair.score_b
    assert worker.score_texts(SOURCES, CANDS) == pytest.approx(model.score(SOURCES, CANDS).tolist(), abs=1e-5)
