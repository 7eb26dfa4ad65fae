"""`rlt2t predict` scores a candidate as training labels hold it (the tokenizer's whole target template: BART's
pretrained tokenizer puts `<s>` first), on both backends, and `--rerank idf` works with a subword scorer (each
piece of a word weighted by the word's IDF) or is refused before any decoding; beam search's repetition controls
work alike on both backends."""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import BartConfig, BartForConditionalGeneration, BartTokenizerFast

import rlt2t.ensemble as predict_mod
from rlt2t.common.collate import collate_seq2seq, encode_texts
from rlt2t.common.config import Config
from rlt2t.common.ct2 import Ct2Policy, export_ct2
from rlt2t.common.families import decoder_input_ids
from rlt2t.common.rerank import IdfTable, idf_weighted_mean, token_words
from rlt2t.common.scoring import token_scores
from rlt2t.common.tokenization import load_tokenizer
from rlt2t.ensemble import TorchRunner, predict

SOURCES = ["a b", "c d a", "ab cd", "d"]
TARGETS = ["a b c", "ab cd a", "", "dd c"]
TRAIN = ["a b c", "a b", "c d", "ab c", "a dd"]


def bart_bpe_tokenizer() -> BartTokenizerFast:
    """A byte-level BPE tokenizer of BART's pretrained kind (`<s> text </s>`) whose words `ab`, `cd`, `dd` are
    two pieces each."""
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "<mask>": 4, "Ġ": 5}
    for w in ["a", "b", "c", "d", "Ġa", "Ġb", "Ġc", "Ġd"]:
        vocab[w] = len(vocab)
    return BartTokenizerFast(vocab=vocab, merges=[("Ġ", c) for c in "abcd"])


@pytest.fixture(scope="module")
def bart_dir(tmp_path_factory) -> Path:
    tok = bart_bpe_tokenizer()
    torch.manual_seed(0)
    cfg = BartConfig(vocab_size=len(tok), d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
                     pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                     forced_eos_token_id=2, dropout=0.0, init_std=0.5)
    out = tmp_path_factory.mktemp("bart-bpe") / "model"
    BartForConditionalGeneration(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def bart_export(bart_dir, tmp_path_factory) -> Path:
    return export_ct2(bart_dir, tmp_path_factory.mktemp("bart-bpe-export") / "f32", "float32")


def training_logprobs(model_dir: Path, sources, targets) -> list[list[float]]:
    """HF log-probs over what a training batch holds: labels = encode_texts(target=True), decoder inputs from the
    model's decoder start (rlt2t.learner.stages.make_collate)."""
    tok = load_tokenizer(model_dir)
    model = BartForConditionalGeneration.from_pretrained(model_dir).eval()
    src, _ = encode_texts(tok, sources, 64)
    tgt, _ = encode_texts(tok, targets, 64, target=True)
    batch = collate_seq2seq(src, tgt, tok.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       decoder_input_ids=decoder_input_ids(batch["labels"], model.config)).logits
    scores = token_scores(logits, batch["labels"], "logprobs")
    return [scores[i, : len(t)].tolist() for i, t in enumerate(tgt)]


def assert_close(got: list[list[float]], want: list[list[float]], tol: float = 1e-3) -> None:
    assert [len(g) for g in got] == [len(w) for w in want]
    assert max(abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)) < tol


def test_the_template_puts_bos_first():
    tok = bart_bpe_tokenizer()
    assert encode_texts(tok, ["a b c"], 64, target=True)[0][0] == [0, 6, 11, 12, 2]


def test_ct2_scores_the_training_labels_bos_included(bart_dir, bart_export):
    ct2 = Ct2Policy(bart_export)
    assert ct2.target_tokens(["a b c"]) == [["<s>", "a", "Ġb", "Ġc"]]  # score_batch appends the EOS
    got = ct2.score(SOURCES, TARGETS)
    assert [len(x) for x in got] == [5, 7, 2, 5]  # <s> ... </s>
    assert_close(got, training_logprobs(bart_dir, SOURCES, TARGETS))


def test_the_policy_servers_ct2_scores_name_the_labels_they_score(bart_dir, bart_export):
    # /v1/score returns (token ids, log-probs) pairs: the CT2 backend's ids were the tokens without <s>, one short
    from rlt2t.services.backends import Ct2Backend

    (scored,) = Ct2Backend(Ct2Policy(bart_export)).score(["a b"], [["a b c", ""]])
    tok = bart_bpe_tokenizer()
    assert [s.token_ids for s in scored] == [tok("a b c")["input_ids"], tok("")["input_ids"]]
    assert all(len(s.token_ids) == len(s.logprobs) for s in scored)


def test_torch_runner_scores_the_training_labels_bos_included(bart_dir, tmp_path):
    cfg = Config.model_validate({"run": {"dir": str(tmp_path / "run")}, "predict": {"backend": "torch"}})
    got = TorchRunner(cfg, bart_dir).score(SOURCES, TARGETS)
    assert_close(got, training_logprobs(bart_dir, SOURCES, TARGETS), tol=1e-5)


def test_token_words_align_the_scored_ids_with_whitespace_words(bart_export):
    ct2 = Ct2Policy(bart_export)
    words = token_words(ct2.tokenizer, TARGETS)
    assert words == [[None, 0, 1, 2, None], [None, 0, 0, 1, 1, 2, None], [None, None], [None, 0, 0, 1, None]]
    assert [len(w) for w in words] == [len(lp) for lp in ct2.score(SOURCES, TARGETS)]


def _write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tmp_path: Path, train: Path) -> Config:
    return Config.model_validate({
        "run": {"dir": str(tmp_path / "run"), "progress": False}, "data": {"train": str(train)},
        "predict": {"beam_size": 4, "num_hypotheses": 4, "max_new_tokens": 6, "batch_size": 3},
    })


def test_idf_rerank_with_a_subword_scorer_weights_each_piece_by_its_word(bart_export, tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl",
                         [{"id": str(i), "source": "a", "target": t} for i, t in enumerate(TRAIN)])
    inputs = _write_jsonl(tmp_path / "in.jsonl", [{"id": str(i), "source": s} for i, s in enumerate(SOURCES)])
    cfg = _cfg(tmp_path, train)
    result = predict(cfg, [bart_export], [bart_export], inputs, tmp_path / "out" / "pred.csv", rerank="idf")
    assert result.csv_path.is_file() and len(result.predictions) == len(SOURCES)
    table = IdfTable.from_texts(TRAIN, cfg.predict.idf_max_n)
    ct2 = Ct2Policy(bart_export)
    rows = [json.loads(line) for line in result.jsonl_path.read_text().splitlines()]
    pieces = 0
    for row in rows:
        texts = [c["text"] for c in row["candidates"]]
        lps = ct2.score([row["source"]] * len(texts), texts)
        words = token_words(ct2.tokenizer, texts)
        pieces += sum(len(w) - 2 - len(t.split()) for w, t in zip(words, texts, strict=True))
        want = [idf_weighted_mean(t, lp, table, w) for t, lp, w in zip(texts, lps, words, strict=True)]
        assert [c["rerank_score"] for c in row["candidates"]] == pytest.approx(want, abs=1e-6)
        assert row["chosen"] == max(range(len(want)), key=lambda k: (want[k], row["candidates"][k]["mean_logprob"]
                                                                     [bart_export.name]))
    assert pieces > 0  # some candidate has a word of several pieces: the case that used to crash


def test_idf_with_a_scorer_whose_tokens_cannot_be_mapped_to_words_is_refused_before_decoding(
        bart_export, tmp_path, monkeypatch):
    class SlowTokenizerPolicy(Ct2Policy):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.tokenizer = types.SimpleNamespace(is_fast=False)  # like Marian's sentencepiece tokenizer

        def generate(self, *args, **kwargs):
            pytest.fail("decoding ran before the refusal")

    monkeypatch.setattr(predict_mod, "Ct2Policy", SlowTokenizerPolicy)
    train = _write_jsonl(tmp_path / "train.jsonl", [{"id": "0", "source": "a", "target": "a b"}])
    inputs = _write_jsonl(tmp_path / "in.jsonl", [{"id": "0", "source": "a b"}])
    out = tmp_path / "pred.csv"
    with pytest.raises(ValueError, match=r"--rerank idf: the scorer .*f32: its tokenizer .* not a fast tokenizer"):
        predict(_cfg(tmp_path, train), [bart_export], [bart_export], inputs, out, rerank="idf")
    assert not out.exists()


def test_reward_rerank_picks_the_candidate_the_python_reward_prefers(bart_export, tmp_path):
    """``--rerank reward``: reward.terms without references (each input's extra fields as row fields), ties to the
    better mean log-prob; a term that needs references is refused before any decoding."""
    from rlt2t.common.config import MetricTerm, PythonTerm

    calls = []

    def prefer_letter(sources, candidates, references, letter):
        calls.append(references)
        return [float(c.count(x)) for c, x in zip(candidates, letter, strict=True)]

    train = _write_jsonl(tmp_path / "train.jsonl", [{"id": "0", "source": "a", "target": "a b"}])
    inputs = _write_jsonl(tmp_path / "in.jsonl", [{"id": str(i), "source": s, "target": "a", "letter": x}
                                                  for i, (s, x) in enumerate(zip(SOURCES, "caab", strict=True))])
    cfg = _cfg(tmp_path, train)
    cfg.reward.terms = [PythonTerm(fn=prefer_letter)]
    result = predict(cfg, [bart_export], [bart_export], inputs, tmp_path / "pred.csv", rerank="reward")
    assert result.rerank == "reward" and len(calls) == 1 and all(r == [] for r in calls[0])  # one call, no refs
    rows = [json.loads(line) for line in result.jsonl_path.read_text().splitlines()]
    for row, letter in zip(rows, "caab", strict=True):
        want = [float(c["text"].count(letter)) for c in row["candidates"]]
        assert [c["rerank_score"] for c in row["candidates"]] == want
        means = [c["mean_logprob"][bart_export.name] for c in row["candidates"]]
        assert row["chosen"] == max(range(len(want)), key=lambda k: (want[k], means[k]))
    assert any(len(set(c["rerank_score"] for c in row["candidates"])) > 1 for row in rows)  # the reward decided

    cfg.reward.terms = [PythonTerm(fn=prefer_letter), MetricTerm(name="bleu4")]
    with pytest.MonkeyPatch.context() as mp:  # refused before any model is resolved (exported) or decoded
        mp.setattr(predict_mod, "resolve_model", lambda *a: pytest.fail("a model was resolved before the refusal"))
        with pytest.raises(ValueError, match=r"--rerank reward: reward.terms term metric:bleu4 needs references"):
            predict(cfg, [bart_export], [bart_export], inputs, tmp_path / "pred2.csv", rerank="reward")
    assert len(calls) == 1 and not (tmp_path / "pred2.csv").exists()


def test_eval_rerank_reward_scores_the_models_pool_without_references(bart_dir, tmp_path):
    """`rlt2t eval --rerank reward`: the model generates and scores its pool on the torch backend, the reward picks
    (ties to the better mean log-prob) from each example's extra fields and no references, and the eval row scores
    those picks; a term that needs references is refused naming it."""
    from rlt2t import api
    from rlt2t.common.config import MetricTerm, PythonTerm
    from rlt2t.common.policy import load_policy
    from rlt2t.ensemble import rerank_with_policy

    calls = []

    def prefer_letter(sources, candidates, references, letter):
        calls.append(references)
        return [float(c.count(x)) for c, x in zip(candidates, letter, strict=True)]

    rows = [{"id": str(i), "source": s, "target": t, "letter": x}
            for i, (s, t, x) in enumerate(zip(SOURCES, TRAIN, "caab", strict=False))]
    valid = _write_jsonl(tmp_path / "valid.jsonl", rows)
    cfg = _cfg(tmp_path, tmp_path / "train.jsonl")
    cfg.data.valid, cfg.predict.backend = str(valid), "torch"
    cfg.reward.terms = [PythonTerm(fn=prefer_letter)]
    from rlt2t.common.data import load_data

    examples = list(load_data(valid, cfg.data))
    policy = load_policy(cfg.model, None, checkpoint=bart_dir)
    got = rerank_with_policy(cfg, policy, bart_dir, examples, "reward")
    assert calls and all(r == [] for refs in calls for r in refs)
    for cands, scores, chosen, lps, letter in zip(got.candidates, got.scores, got.chosen, got.logprobs, "caab",
                                                  strict=True):
        want = [float(c.count(letter)) for c in cands]
        means = [sum(lp) / len(lp) for lp in lps[0]]
        assert scores.tolist() == want and chosen == max(range(len(cands)), key=lambda k: (want[k], means[k]))
    assert any(len(set(s.tolist())) > 1 for s in got.scores)  # the reward decided somewhere

    table = api.evaluate(cfg, {"bart": bart_dir}, split="valid", metrics="bleu4", rerank="reward")
    assert "rerank reward (python:" in table.title and ".prefer_letter)" in table.title  # which reward picked
    assert set(table.rows) == {"bart"}
    saved = [json.loads(line)["prediction"]
             for line in (cfg.run_dir / "eval" / "bart-valid.predictions.jsonl").read_text().splitlines()]
    assert saved == got.predictions  # a beam pool: the same pool, the same picks

    cfg.reward.terms = [PythonTerm(fn=prefer_letter), MetricTerm(name="rouge_l")]
    with pytest.raises(ValueError, match=r"--rerank reward: reward.terms term metric:rouge_l needs references"):
        api.evaluate(cfg, {"bart": bart_dir}, split="valid", metrics="bleu4", rerank="reward")


def test_the_eval_tables_reward_column_is_the_runs_reward_over_each_models_outputs(bart_dir, tmp_path):
    """`rlt2t eval --metrics ...,reward` / `rlt2t.evaluate(cfg, models, reward=fn)`: SFT and RL compared on the
    reward RL trained with: its mean over the saved predictions, each with its row's references and fields."""
    from rlt2t import api
    from rlt2t.common.config import PythonTerm
    from rlt2t.common.python_rewards import RewardError
    from rlt2t.ensemble import table_columns

    def letters(sources, candidates, references, letter):
        return [float(c.count(x)) - 0.5 * len(refs) for c, refs, x in zip(candidates, references, letter, strict=True)]

    rows = [{"id": str(i), "source": s, "target": t, "letter": x}
            for i, (s, t, x) in enumerate(zip(SOURCES, TRAIN, "caab", strict=False))]
    cfg = _cfg(tmp_path, tmp_path / "train.jsonl")
    cfg.data.valid = str(_write_jsonl(tmp_path / "valid.jsonl", rows))
    table = api.evaluate(cfg, {"bart": bart_dir}, split="valid", metrics="bleu4", reward=letters)
    assert table.columns == ["bleu4", "reward"]
    saved = [json.loads(line)["prediction"]
             for line in (cfg.run_dir / "eval" / "bart-valid.predictions.jsonl").read_text().splitlines()]
    want = np.mean([p.count(x) - 0.5 for p, x in zip(saved, "caab", strict=True)])
    assert table.rows["bart"]["reward"] == pytest.approx(want)
    assert any(p.count(x) for p, x in zip(saved, "caab", strict=True))  # the reward is not 0 - 0.5 everywhere
    cfg.reward.terms = [PythonTerm(fn=letters)]  # the run's reward.terms, named as a column (the command line)
    assert api.evaluate(cfg, {"bart": bart_dir}, split="valid", metrics="reward").rows["bart"] == {"reward": want}

    def broken(sources, candidates, references):
        return [1 / 0 for _ in candidates]

    with pytest.raises(RewardError, match=r"^the eval table's reward column: reward term python:.*broken raised "
                                          r"ZeroDivisionError"):
        api.evaluate(cfg, {"bart": bart_dir}, split="valid", metrics="bleu4", reward=broken)
    assert table_columns(cfg, ["bleu4", "reward"]) == ["bleu4"]  # predict's table scores texts alone
    with pytest.raises(ValueError, match=r"unknown metric\(s\) \['rewrd'\]; known: .*perplexity, reward"):
        api.evaluate(cfg, {"bart": bart_dir}, split="valid", metrics="rewrd")


def _mbr_inputs(tmp_path: Path) -> tuple[Path, Path]:
    train = _write_jsonl(tmp_path / "train.jsonl",
                         [{"id": str(i), "source": "a", "target": t} for i, t in enumerate(TRAIN)])
    inputs = _write_jsonl(tmp_path / "in.jsonl", [{"id": str(i), "source": s, "target": t}
                                                  for i, (s, t) in enumerate(zip(SOURCES, TRAIN, strict=False))])
    return train, inputs


@pytest.mark.parametrize("weights", ["uniform", "probability"])
def test_mbr_rerank_picks_the_highest_expected_task_score_over_beams_and_samples(bart_export, tmp_path, weights):
    """``--rerank mbr`` over ``predict.pool=both``: each candidate's rerank score is its expected task score (CIDEr-D's
    df from data.train) as docs/design.md defines it, computed here by brute force per pair: uniform, leave-one-out
    over the pool's entries with their duplicates; probability, over the distinct candidates, itself included, at
    their normalised sequence probabilities. The choice is its argmax."""
    import numpy as np

    from rlt2t.common.metrics import DocumentFrequency, TaskScore

    train, inputs = _mbr_inputs(tmp_path)
    cfg = _cfg(tmp_path, train)
    cfg.predict.pool, cfg.predict.num_hypotheses, cfg.predict.num_samples = "both", 3, 6
    cfg.predict.top_p, cfg.predict.mbr_weights = 1.0, weights
    result = predict(cfg, [bart_export], [bart_export], inputs, tmp_path / "pred.csv", rerank="mbr")
    assert result.rerank == "mbr" and set(result.seconds_per_source) == {"generate", "score", "rerank", "total"}
    metric = TaskScore(bleu_weight=cfg.metric.bleu_weight, df=DocumentFrequency.from_references([[t] for t in TRAIN]))
    u = lambda h, r: float(metric.per_sample([h], [[r]])[0])  # noqa: E731
    rows = [json.loads(line) for line in result.jsonl_path.read_text().splitlines()]
    for row, prediction in zip(rows, result.predictions, strict=True):
        cands = row["candidates"]
        texts = [c["text"] for c in cands]
        assert sum(c["entries"] for c in cands) == 3 + 6 and row["rerank_seconds"] >= 0
        if weights == "uniform":
            entries = [c["text"] for c in cands for _ in range(c["entries"])]
            want = []
            for t in texts:
                i = entries.index(t)
                want.append(sum(u(t, entries[j]) for j in range(len(entries)) if j != i) / (len(entries) - 1))
        else:
            total = [sum(Ct2Policy(bart_export).score([row["source"]], [t])[0]) for t in texts]
            p = np.exp(np.array(total) - max(total))
            p /= p.sum()
            want = [sum(p[k] * u(h, y) for k, y in enumerate(texts)) for h in texts]
        assert [c["rerank_score"] for c in cands] == pytest.approx(want, rel=1e-4, abs=1e-9)
        assert row["chosen"] == int(np.argmax([c["rerank_score"] for c in cands]))
        assert prediction == cands[row["chosen"]]["text"]
    assert any(len(row["candidates"]) > 1 for row in rows)  # the samples added candidates to choose among
    assert "ensemble (mbr)" in result.metrics and "oracle" in result.metrics


def test_mbr_pool_over_the_cap_is_refused_before_decoding(bart_export, tmp_path, monkeypatch):
    train, inputs = _mbr_inputs(tmp_path)
    cfg = _cfg(tmp_path, train)
    cfg.predict.pool, cfg.predict.num_hypotheses, cfg.predict.num_samples, cfg.predict.max_pool = "both", 4, 30, 60
    monkeypatch.setattr(predict_mod, "resolve_model", lambda *a: pytest.fail("a model was resolved before the refusal"))
    with pytest.raises(ValueError, match=r"MBR pool of 68 candidates \(2 generator\(s\) x 34 each: predict.pool=both, "
                                         r"num_hypotheses=4, num_samples=30\) is over predict.max_pool=60"):
        predict(cfg, [bart_export, bart_export], [bart_export], inputs, tmp_path / "pred.csv", rerank="mbr")
    assert not (tmp_path / "pred.csv").exists()


@pytest.mark.parametrize(("name", "msg"), [
    ("bleu5", r"predict.mbr_utility='bleu5': not a registered metric"),
    ("rouge_m", r"predict.mbr_utility='rouge_m': not a registered metric nor 'reward' \(did you mean rouge_l\?\) "
                r"\(metrics: .*; a utility must read references\)"),
    ("mean_length", r"predict.mbr_utility='mean_length': this metric reads no references"),
    ("distinct_2", r"predict.mbr_utility='distinct_2': this metric reads no references"),
    ("classifier_accuracy", r"predict.mbr_utility='classifier_accuracy': the metric cannot be built .*TypeError"),
])
def test_an_unusable_mbr_utility_is_refused_before_any_model_is_resolved(bart_export, tmp_path, monkeypatch, name,
                                                                         msg):
    train, inputs = _mbr_inputs(tmp_path)
    cfg = _cfg(tmp_path, train)
    cfg.predict.mbr_utility = name
    monkeypatch.setattr(predict_mod, "resolve_model", lambda *a: pytest.fail("a model was resolved before the refusal"))
    with pytest.raises(ValueError, match=msg):
        predict(cfg, [bart_export], [bart_export], inputs, tmp_path / "pred.csv", rerank="mbr")
    assert not (tmp_path / "pred.csv").exists()


def test_a_reward_utility_must_read_references(bart_export, tmp_path, monkeypatch):
    from rlt2t.common.config import PythonTerm

    train, inputs = _mbr_inputs(tmp_path)
    cfg = _cfg(tmp_path, train)
    cfg.predict.mbr_utility = "reward"
    cfg.reward.terms = [PythonTerm(fn=lambda sources, candidates, references: [0.0] * len(candidates))]
    monkeypatch.setattr(predict_mod, "resolve_model", lambda *a: pytest.fail("a model was resolved before the refusal"))
    with pytest.raises(ValueError, match=r"predict.mbr_utility=reward: .*read no references"):
        predict(cfg, [bart_export], [bart_export], inputs, tmp_path / "pred.csv", rerank="mbr")


def test_sampled_pools_repeat_with_the_seed_on_both_backends(bart_dir, bart_export, tmp_path):
    train, inputs = _mbr_inputs(tmp_path)
    for backend, model in (("ct2", bart_export), ("torch", bart_dir)):
        cfg = _cfg(tmp_path, train)
        cfg.predict.backend, cfg.predict.pool, cfg.predict.num_samples, cfg.predict.top_k = backend, "sample", 5, 4
        runs = [json.loads(line)["candidates"] for k in range(2)
                for line in predict(cfg, [model], [model], inputs, tmp_path / f"{backend}{k}.csv",
                                    rerank="mbr").jsonl_path.read_text().splitlines()]
        assert runs[: len(SOURCES)] == runs[len(SOURCES) :]
        assert all(sum(c["entries"] for c in cands) == 5 for cands in runs)
        # Samples, not copies of one greedy output: some source's pool holds several distinct texts.
        assert any(len(cands) > 1 for cands in runs), backend


def test_epsilon_sampling_filters_the_torch_pool(bart_dir, tmp_path):
    """predict.epsilon reaches the torch sampler: at 0.999 only each step's most likely token is left, so every
    sample is the greedy output; at 0 the same seed draws several texts."""
    train, inputs = _mbr_inputs(tmp_path)
    greedy = TorchRunner(_cfg(tmp_path, train), bart_dir).generate(SOURCES, beam_size=1, num_hypotheses=1,
                                                                     max_new_tokens=6)
    pools = {}
    for epsilon in (0.0, 0.999):
        cfg = _cfg(tmp_path, train)
        cfg.predict.backend, cfg.predict.pool, cfg.predict.num_samples = "torch", "sample", 5
        cfg.predict.top_p, cfg.predict.epsilon = 1.0, epsilon
        result = predict(cfg, [bart_dir], [bart_dir], inputs, tmp_path / f"eps{epsilon}.csv", rerank="mbr")
        pools[epsilon] = [json.loads(line)["candidates"] for line in result.jsonl_path.read_text().splitlines()]
    assert [[(c["text"], c["entries"]) for c in cands] for cands in pools[0.999]] == [
        [(hyps[0].text, 5)] for hyps in greedy]
    assert any(len(cands) > 1 for cands in pools[0.0])


@pytest.mark.parametrize("backend", ["auto", "ct2"])
def test_epsilon_on_a_ctranslate2_generator_is_refused_before_exporting(bart_dir, bart_export, tmp_path, monkeypatch,
                                                                       backend):
    train, inputs = _mbr_inputs(tmp_path)
    cfg = _cfg(tmp_path, train)
    cfg.predict.backend, cfg.predict.pool, cfg.predict.epsilon = backend, "both", 0.02
    monkeypatch.setattr(predict_mod, "export_ct2", lambda *a, **kw: pytest.fail("exported before the refusal"))
    for model in (bart_dir, bart_export):
        with pytest.raises(ValueError, match=r"predict.epsilon=0.02: --generators .* runs on CTranslate2, which has "
                                             r"no epsilon sampling; set predict.backend=torch"):
            predict(cfg, [model], [bart_export], inputs, tmp_path / "pred.csv", rerank="mbr")
    assert not (tmp_path / "pred.csv").exists()
    cfg.predict.pool = "beam"  # a pool of beams draws nothing: the setting is not read
    assert predict(cfg, [bart_export], [bart_export], inputs, tmp_path / "pred.csv", rerank="mbr").csv_path.is_file()


@pytest.mark.parametrize("pool", ["sample", "both"])
@pytest.mark.parametrize("mode", ["mean_logprob", "consensus"])
def test_other_rerank_modes_pick_from_sampled_pools(bart_export, tmp_path, pool, mode):
    """predict.pool applies to every rerank mode: the samples join the pool, and the mode picks among them."""
    train, inputs = _mbr_inputs(tmp_path)
    cfg = _cfg(tmp_path, train)
    cfg.predict.pool, cfg.predict.num_hypotheses, cfg.predict.num_samples, cfg.predict.top_k = pool, 2, 5, 4
    result = predict(cfg, [bart_export], [bart_export], inputs, tmp_path / "pred.csv", rerank=mode)
    rows = [json.loads(line) for line in result.jsonl_path.read_text().splitlines()]
    size = 5 + (2 if pool == "both" else 0)
    ct2 = Ct2Policy(bart_export)
    for row, prediction in zip(rows, result.predictions, strict=True):
        cands = row["candidates"]
        assert row["rerank"] == mode and sum(c["entries"] for c in cands) == size
        means = [c["mean_logprob"][bart_export.name] for c in cands]
        want = [float(sum(lp) / len(lp)) for lp in ct2.score([row["source"]] * len(cands), [c["text"] for c in cands])]
        assert means == pytest.approx(want, abs=1e-5)
        if mode == "mean_logprob":
            assert [c["rerank_score"] for c in cands] == pytest.approx(means)
            assert row["chosen"] == max(range(len(cands)), key=lambda k: means[k])
        assert prediction == cands[row["chosen"]]["text"]
    assert any(len(row["candidates"]) > 1 for row in rows)
    assert result.metrics is not None and f"ensemble ({mode})" in result.metrics


def test_the_table_has_the_columns_of_eval_metrics_checked_before_decoding(bart_export, tmp_path, monkeypatch):
    """A translation run's metrics in predict's table (each generator, the ensemble, the oracle); a column that
    needs a model is left out; an unknown name fails before anything is decoded."""
    import rlt2t.ensemble as ensemble

    train, inputs = _mbr_inputs(tmp_path)
    cfg = _cfg(tmp_path, train)
    cfg.eval.metrics = ["chrf", "sacrebleu", "perplexity"]
    result = predict(cfg, [bart_export], [bart_export], inputs, tmp_path / "pred.csv", rerank="mean_logprob")
    assert result.metrics is not None and set(result.metrics) == {bart_export.name, "ensemble (mean_logprob)",
                                                                   "oracle"}
    assert all(list(row) == ["chrf", "sacrebleu"] for row in result.metrics.values())
    assert list(predict(cfg, [bart_export], [bart_export], inputs, tmp_path / "demo.csv", rerank="mean_logprob",
                        metrics=["task_score"]).metrics["oracle"]) == ["task_score"]

    cfg.eval.metrics = ["chrf", "blue"]
    monkeypatch.setattr(ensemble, "resolve_model", lambda *a: pytest.fail("decoded before the columns were checked"))
    with pytest.raises(ValueError, match=r"eval\.metrics: unknown metric\(s\) \['blue'\]"):
        predict(cfg, [bart_export], [bart_export], inputs, tmp_path / "pred2.csv", rerank="mean_logprob")


def test_the_rerank_modes_are_one_list():
    """rlt2t.common.rerank.PREDICT_RERANK_MODES is the list: the CLI's choices come from it, and the config fields
    declare the same values."""
    from typing import get_args

    from rlt2t.cmd_export import RERANK_CHOICES
    from rlt2t.common.config import EvalConfig, PredictConfig
    from rlt2t.common.rerank import PREDICT_RERANK_MODES, RERANK_MODES

    assert PREDICT_RERANK_MODES[: len(RERANK_MODES)] == RERANK_MODES and "mbr" in PREDICT_RERANK_MODES
    assert predict_mod.PREDICT_RERANK_MODES is PREDICT_RERANK_MODES and list(PREDICT_RERANK_MODES) == RERANK_CHOICES
    assert get_args(PredictConfig.model_fields["rerank"].annotation) == PREDICT_RERANK_MODES
    assert get_args(EvalConfig.model_fields["rerank"].annotation) == ("none", *PREDICT_RERANK_MODES)
    from rlt2t.cli import build_parser

    parser = build_parser()
    for args, first in ((["predict", "--generators", "g", "--scorers", "s", "--input", "i", "--out", "o"], []),
                        (["eval"], ["none"])):
        for mode in [*first, *PREDICT_RERANK_MODES]:
            assert parser.parse_args([*args, "--rerank", mode]).rerank == mode
        with pytest.raises(SystemExit):
            parser.parse_args([*args, "--rerank", "mbrr"])
    for mode in PREDICT_RERANK_MODES:  # every mode validates, and a typo names the key
        assert PredictConfig(rerank=mode).rerank == mode and EvalConfig(rerank=mode).rerank == mode
    with pytest.raises(ValueError, match="rerank"):
        PredictConfig(rerank="mbrr")


def test_predict_reads_a_csv_with_a_header_as_data_and_one_without_as_the_competition_file(tmp_path):
    from rlt2t.common.config import DataConfig
    from rlt2t.ensemble import read_inputs

    headed = tmp_path / "test.csv"
    headed.write_text("id,source,target\na,city: paris,sunny in paris\nb,city: rome,\n")
    assert [(e.id, e.source, e.target) for e in read_inputs(headed, DataConfig())] == [
        ("a", "city: paris", "sunny in paris"), ("b", "city: rome", None)]
    competition = tmp_path / "comp.csv"
    competition.write_text("7,12 7 5,40 41\n")  # report_id,description,diagnosis: no header
    [row] = read_inputs(competition, DataConfig())
    assert (row.id, row.source, row.target) == ("7", "12 7 5", "40 41")
    misnamed = tmp_path / "misnamed.csv"
    misnamed.write_text("id,src\na,city: paris\n")  # a header, but not data.source_field's column
    with pytest.raises(ValueError, match=r"misnamed.csv:1: field 'description': .* \(read as the competition's "
                                         r"header-less CSV, as its first row names no 'source' column: if that row "
                                         r"is a header, name the source column with data.source_field="):
        read_inputs(misnamed, DataConfig())


def _repeats(ids, n: int) -> int:
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return len(grams) - len(set(grams))


def test_beam_repetition_controls_on_both_backends(bart_dir, bart_export, tmp_path):
    """predict.no_repeat_ngram_size and repetition_penalty on both runners: no repeated n-gram, fewer repeated
    tokens; and, on torch, the decoder start (BART's EOS) is not a generated token: transformers' own processors
    count it, so with n = 1 or a penalty no hypothesis would end before max_new_tokens."""
    train, _ = _mbr_inputs(tmp_path)
    runners = {"ct2": Ct2Policy(bart_export), "torch": TorchRunner(_cfg(tmp_path, train), bart_dir)}
    def beams(runner, **controls):
        hyps = runner.generate(SOURCES, beam_size=4, num_hypotheses=4, max_new_tokens=12, **controls)
        return [h.token_ids for per_source in hyps for h in per_source]

    for name, runner in runners.items():
        free = beams(runner)
        assert any(_repeats(x, 2) for x in free), f"{name}: the model repeats nothing, the test shows nothing"
        assert not any(_repeats(x, 2) for x in beams(runner, no_repeat_ngram_size=2)), name
        once = beams(runner, no_repeat_ngram_size=1)
        assert not any(_repeats(x, 1) for x in once) and any(len(x) < 12 for x in once), (name, once)
        penalised = beams(runner, repetition_penalty=100.0)
        assert sum(map(_repeats, penalised, [1] * len(penalised))) < sum(map(_repeats, free, [1] * len(free))), name
        assert any(len(x) < 12 for x in penalised), (name, penalised)
        with pytest.raises(ValueError, match="no_repeat_ngram_size"):
            runner.generate(SOURCES, beam_size=1, num_hypotheses=2, max_new_tokens=4, sampling_topk=0, seed=0,
                            no_repeat_ngram_size=2)


def test_predict_applies_the_beam_controls_to_the_beams_not_the_samples(bart_export, tmp_path):
    train, inputs = _mbr_inputs(tmp_path)
    pools = {}
    settings = {"off": {}, "norepeat": {"no_repeat_ngram_size": 2},
                "long": {"min_new_tokens": 8, "length_penalty": 2.0}}
    for pool in ("beam", "sample", "both"):
        for name, controls in settings.items():
            if pool == "sample" and controls:
                continue  # refused: test_a_search_control_that_would_do_nothing_is_refused_by_name
            cfg = _cfg(tmp_path, train)
            cfg.predict.pool, cfg.predict.num_samples, cfg.predict.max_new_tokens = pool, 4, 12
            for key, value in controls.items():
                setattr(cfg.predict, key, value)
            result = predict(cfg, [bart_export], [bart_export], inputs, tmp_path / f"{pool}{name}.csv", rerank="mbr")
            pools[pool, name] = [[c["text"] for c in json.loads(line)["candidates"]]
                                 for line in result.jsonl_path.read_text().splitlines()]
    # The reference decodes as predict does (its threads, its batches of predict.batch_size in input order):
    # CTranslate2's beam search with no_repeat_ngram_size depends on the batch it runs in (on an AMD EPYC the
    # hypotheses of "ab cd" differed between batches of 3 and 4 sources, whatever the threads; not without it).
    cfg = _cfg(tmp_path, train)
    policy = Ct2Policy(bart_export, intra_threads=cfg.export.threads, max_source_len=cfg.data.max_source_len)
    size = cfg.predict.batch_size
    for name, controls in settings.items():
        want = [hyps for start in range(0, len(SOURCES), size) for hyps in policy.generate(
            SOURCES[start : start + size], beam_size=4, num_hypotheses=4, max_new_tokens=12, **controls)]
        assert pools["beam", name] == [list(dict.fromkeys(h.text for h in hyps)) for hyps in want], name
        if controls:
            assert pools["beam", name] != pools["beam", "off"], name
        # a mixed pool: the controlled beams, then the samples, drawn from the model's distribution as without them
        assert pools["both", name] == [list(dict.fromkeys(beams + samples)) for beams, samples in zip(
            pools["beam", name], pools["sample", "off"], strict=True)], name


def test_min_new_tokens_must_be_below_max_new_tokens(tmp_path):
    with pytest.raises(ValueError, match=r"predict.min_new_tokens=12 must be below predict.max_new_tokens=12"):
        Config.model_validate({"predict": {"min_new_tokens": 12, "max_new_tokens": 12}})


@pytest.mark.parametrize("section, settings, error", [
    ("predict", {"pool": "sample", "no_repeat_ngram_size": 3},
     r"predict.no_repeat_ngram_size=3 would do nothing: .*predict.pool=sample draws samples only"),
    ("predict", {"pool": "sample", "repetition_penalty": 1.2, "min_new_tokens": 2},
     r"predict.repetition_penalty=1.2 would do nothing: .*leave predict.repetition_penalty and "
     r"predict.min_new_tokens at the default"),
    ("predict", {"pool": "sample", "length_penalty": 2.0}, r"predict.length_penalty=2.0 would do nothing"),
    ("predict", {"beam_size": 1, "num_hypotheses": 1, "length_penalty": 0.6},
     r"predict.length_penalty=0.6 would do nothing: .*predict.beam_size=1 searches with one"),
    ("eval", {"length_penalty": 2.0}, r"eval.length_penalty=2.0 would do nothing: .*set eval.num_beams above 1"),
    # What acts is taken: the repetition and minimum-length controls shape a greedy decode too.
    ("eval", {"no_repeat_ngram_size": 3, "repetition_penalty": 1.2, "min_new_tokens": 2}, None),
    ("eval", {"num_beams": 4, "length_penalty": 2.0}, None),
    ("predict", {"pool": "both", "no_repeat_ngram_size": 3, "length_penalty": 2.0}, None),
    ("predict", {"pool": "sample", "top_p": 0.95}, None),
])
def test_a_search_control_that_would_do_nothing_is_refused_by_name(section, settings, error):
    """A control the configured decode cannot apply is refused, not silently ignored: any with predict's
    sample-only pool (its samples are drawn without them) and length_penalty with a beam of 1."""
    if error is None:
        cfg = Config.model_validate({section: settings})
        assert {key: getattr(getattr(cfg, section), key) for key in settings} == settings
    else:
        with pytest.raises(ValueError, match=error):
            Config.model_validate({section: settings})


def test_the_torch_runner_cuts_sources_at_data_max_source_len_as_the_ct2_runner_does(bart_dir, bart_export, tmp_path):
    """Both runners read a source as training did (data.max_source_len tokens) when generating and when scoring;
    the torch runner once generated from the whole source and scored the cut one."""
    train, _ = _mbr_inputs(tmp_path)
    long = ["a b c d a b c d ab cd", "dd c b a a b c d", "ab ab cd cd a b"]
    cut = _cfg(tmp_path, train)
    cut.data.max_source_len = 4
    whole = TorchRunner(_cfg(tmp_path, train), bart_dir)
    torch_cut = TorchRunner(cut, bart_dir)
    ct2_cut = Ct2Policy(bart_export, max_source_len=4)

    def greedy(runner):  # greedy: the two backends' beam searches may rank ties apart
        return [hyps[0].token_ids for hyps in runner.generate(long, beam_size=1, num_hypotheses=1, max_new_tokens=8)]
    assert greedy(torch_cut) == greedy(ct2_cut)
    assert greedy(torch_cut) != greedy(whole), "the cut changes nothing here: the test shows nothing"
    targets = [h.text for hyps in torch_cut.generate(long, beam_size=4, num_hypotheses=1, max_new_tokens=8)
               for h in hyps]
    for got, want in zip(torch_cut.score(long, targets), ct2_cut.score(long, targets), strict=True):
        assert got == pytest.approx(want, abs=1e-4)


def test_rlt2t_evals_decode_takes_the_search_controls_as_predicts_beams_do(bart_dir, tmp_path):
    """eval.no_repeat_ngram_size, repetition_penalty, length_penalty and min_new_tokens: `rlt2t eval`'s decode
    (greedy and beam) writes what predict's torch beams write with the same controls (one processor,
    rlt2t.common.search), each control changing what the plain decode writes here; and the eval config refuses
    a minimum length at its maximum, naming both keys."""
    from rlt2t.common.config import ModelConfig
    from rlt2t.common.policy import load_policy
    from rlt2t.learner.evaluate import generate

    train, _ = _mbr_inputs(tmp_path)
    runner = TorchRunner(_cfg(tmp_path, train), bart_dir)
    policy = load_policy(ModelConfig(preset=None, path=str(bart_dir), dropout=0.0))
    settings = {"repeats": {"no_repeat_ngram_size": 1}, "penalty": {"repetition_penalty": 50.0},
                "long": {"min_new_tokens": 8}, "power": {"length_penalty": 0.0}}
    for beams in (1, 4):
        plain = generate(policy, SOURCES, num_beams=beams, max_new_tokens=12, batch_size=1)
        for name, controls in settings.items():
            got = generate(policy, SOURCES, num_beams=beams, max_new_tokens=12, batch_size=1, controls=controls)
            want = [runner.generate([source], beam_size=beams, num_hypotheses=1, max_new_tokens=12, **controls)[0][0]
                    for source in SOURCES]
            assert got == [hyp.text for hyp in want], (beams, name)
            if name != "power" or beams > 1:  # greedy decoding has no finished hypotheses to rank
                assert got != plain, f"{name} changed nothing at {beams} beams: the test shows nothing ({plain})"
    with pytest.raises(ValueError, match=r"eval.min_new_tokens=16 must be below eval.max_new_tokens=16"):
        Config.model_validate({"eval": {"min_new_tokens": 16, "max_new_tokens": 16}})


def _length(ids, eos: int) -> int:
    """Tokens before the EOS."""
    return len(ids) - (1 if ids and ids[-1] == eos else 0)


def test_beam_length_controls_on_both_backends(bart_dir, bart_export, tmp_path):
    """predict.min_new_tokens and length_penalty on both runners: no hypothesis ends before min_new_tokens, and the
    best hypothesis grows with the penalty's power (0: the sum of log-probs, which favours short ones)."""
    train, _ = _mbr_inputs(tmp_path)
    runners = {"ct2": Ct2Policy(bart_export), "torch": TorchRunner(_cfg(tmp_path, train), bart_dir)}
    eos = runners["torch"].tokenizer.eos_token_id

    def beams(runner, **controls):
        hyps = runner.generate(SOURCES, beam_size=4, num_hypotheses=4, max_new_tokens=12, **controls)
        return [[_length(h.token_ids, eos) for h in per_source] for per_source in hyps]

    for name, runner in runners.items():
        free = beams(runner)
        shortest = min(min(per_source) for per_source in free)
        assert shortest < 8, f"{name}: every hypothesis is long already, the test shows nothing ({free})"
        held = beams(runner, min_new_tokens=8)
        assert min(min(per_source) for per_source in held) >= 8, (name, held)
        best = {power: [per_source[0] for per_source in beams(runner, length_penalty=power)] for power in (0.0, 2.0)}
        assert all(a <= b for a, b in zip(best[0.0], best[2.0], strict=True)), (name, best)
        assert sum(best[2.0]) > sum(best[0.0]), (name, best)
    with pytest.raises(ValueError, match="min_new_tokens"):
        runners["torch"].generate(SOURCES, beam_size=1, num_hypotheses=2, max_new_tokens=4, sampling_topk=0, seed=0,
                                  min_new_tokens=2)
