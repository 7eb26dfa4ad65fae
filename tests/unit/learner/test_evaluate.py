from __future__ import annotations

import math

import pytest
import torch

from rlt2t.common.config import EvalConfig, MetricConfig
from rlt2t.common.data import Example
from rlt2t.common.metrics import get_metric
from rlt2t.learner.evaluate import TABLE_METRICS, evaluate, generate, metric_table


def test_generate_keeps_input_order_across_length_sorted_batches(tiny_policy):
    sources = ["1 2 3 4 5 6 7", "8", "9 10 11", "12 13"]
    batched = generate(tiny_policy, sources, batch_size=2, max_new_tokens=6)
    one_by_one = [generate(tiny_policy, [s], max_new_tokens=6)[0] for s in sources]
    assert batched == one_by_one


def test_the_decode_bar_shows_on_a_terminal_only(tiny_policy, capsys, monkeypatch):
    """progress=True draws the bar where someone watches; a log file (stderr not a terminal: CI, a Ray job's log,
    `> run.log`) would get a carriage-return line per update instead."""
    generate(tiny_policy, ["1 2", "3"], batch_size=1, max_new_tokens=2, progress=True)
    assert "decode" not in capsys.readouterr().err
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    generate(tiny_policy, ["1 2", "3"], batch_size=1, max_new_tokens=2, progress=True)
    assert "decode" in capsys.readouterr().err


def test_generate_restores_training_mode(tiny_policy):
    tiny_policy.model.train()
    generate(tiny_policy, ["1 2"], max_new_tokens=2)
    assert tiny_policy.model.training


def test_metric_table_perfect_and_empty():
    refs = [["1 2 3 4 5"], ["6 7 8 9"], ["1 6 2 7"]]
    perfect = metric_table([r[0] for r in refs], refs, MetricConfig())
    assert list(perfect) == list(TABLE_METRICS)
    assert perfect["bleu4"] == pytest.approx(1.0)
    assert perfect["rouge_l"] == pytest.approx(1.0)
    assert perfect["cider_d"] > 1.0
    assert perfect["task_score"] == pytest.approx(2 / 3 * perfect["cider_d"] + 1 / 3)
    assert perfect["mean_length"] == pytest.approx(13 / 3)
    empty = metric_table(["", "", ""], refs, MetricConfig())
    assert empty["cider_d"] == 0.0 and empty["mean_length"] == 0.0


def test_evaluate_scores_the_policy_output(tiny_policy):
    examples = [Example(id=str(i), source=f"{i} {i + 1}", target=f"{i}") for i in range(6)]
    result = evaluate(tiny_policy, examples, EvalConfig(max_new_tokens=4, limit=4), MetricConfig(), 32)
    assert len(result.predictions) == 4
    assert result.metrics == metric_table(result.predictions, [[e.target] for e in examples[:4]], MetricConfig())
    with pytest.raises(ValueError, match="targets"):
        evaluate(tiny_policy, [Example(id="x", source="1", target=None)], EvalConfig(), MetricConfig(), 32)


def test_beam_search_decodes_with_the_beams_asked_for(tiny_policy):
    from rlt2t.common.collate import encode_texts

    # On this source the untrained tiny model's greedy and 3-beam outputs differ: beam search must really run.
    source = "1 2 3"
    model, tok = tiny_policy.model.eval(), tiny_policy.tokenizer
    input_ids = torch.tensor(encode_texts(tok, [source], 128)[0])

    def hf(num_beams: int) -> str:
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 num_beams=num_beams, do_sample=False, max_new_tokens=4)
        return tiny_policy.decode(out)[0]

    beam, greedy = hf(3), hf(1)
    assert beam != greedy, (beam, greedy)
    assert generate(tiny_policy, [source], num_beams=3, max_new_tokens=4) == [beam]
    assert generate(tiny_policy, [source], max_new_tokens=4) == [greedy]
    # evaluate decodes with eval.num_beams
    examples = [Example(id="0", source=source, target="1 2")]
    assert evaluate(tiny_policy, examples, EvalConfig(num_beams=3, max_new_tokens=4), MetricConfig(),
                    128).predictions == [beam]


def test_reference_perplexity_is_exp_of_token_weighted_cross_entropy(tiny_policy):
    from rlt2t.common.collate import collate_seq2seq, encode_texts
    from rlt2t.learner.evaluate import reference_perplexity

    sources, targets = ["1 2 3", "4 5", "6 7 8 9", "10"], ["3 2 1", "5", "9 8 7 6 5", "10 10"]
    tok = tiny_policy.tokenizer
    src, tgt = encode_texts(tok, sources, 32)[0], encode_texts(tok, targets, 32)[0]
    with torch.no_grad():
        out = tiny_policy.model.eval()(**collate_seq2seq(src, tgt, tok.pad_token_id))
    # HF's loss is the mean CE over all label tokens of the batch: one batch gives exp(loss) exactly.
    whole = reference_perplexity(tiny_policy, sources, targets, batch_size=4)
    assert whole == pytest.approx(math.exp(out.loss.item()), rel=1e-5)
    # Batches of 1 still weight by tokens (not a mean of per-sentence perplexities).
    assert reference_perplexity(tiny_policy, sources, targets, batch_size=1) == pytest.approx(whole, rel=1e-5)
    per_sentence = [reference_perplexity(tiny_policy, [s], [t]) for s, t in zip(sources, targets, strict=True)]
    assert whole != pytest.approx(sum(per_sentence) / 4, rel=1e-3)
    with pytest.raises(ValueError, match="as many targets"):
        reference_perplexity(tiny_policy, sources, targets[:2])


def test_monitor_by_loss_is_minus_the_references_cross_entropy(tiny_policy):
    from rlt2t.common.config import MetricConfig
    from rlt2t.common.data import Example
    from rlt2t.learner.evaluate import monitor_score, reference_perplexity

    examples = [Example(id=str(i), source=f"{i} {i + 1} 3", target=f"{i} {i}") for i in range(6)]
    kw = dict(max_source_len=32, max_new_tokens=8)
    by_metric = monitor_score(tiny_policy, examples, MetricConfig(), **kw)
    by_loss = monitor_score(tiny_policy, examples, MetricConfig(), by="loss", max_target_len=16, **kw)
    loss = math.log(reference_perplexity(tiny_policy, [e.source for e in examples], [e.target for e in examples],
                                         max_source_len=32, max_target_len=16))
    assert by_loss["valid_loss"] == pytest.approx(loss, rel=1e-9) and by_loss["monitor"] == -by_loss["valid_loss"]
    # The greedy outputs' figures are still there (the demo's curves and the collapse check read them).
    assert by_loss["metric"] == by_metric["monitor"]
    assert {k: by_loss[k] for k in ("cider_d", "distinct_outputs")} == {
        k: by_metric[k] for k in ("cider_d", "distinct_outputs")}
    assert "valid_loss" not in by_metric
    with pytest.raises(ValueError, match="monitor must be"):
        monitor_score(tiny_policy, examples, MetricConfig(), by="bleu", **kw)
    with pytest.raises(ValueError, match="validation monitor"):
        monitor_score(tiny_policy, [Example(id="x", source="1 2", target=None)], MetricConfig(), by="loss", **kw)


def test_evaluate_columns_follow_eval_metrics(tiny_policy):
    from rlt2t.learner.evaluate import reference_perplexity

    examples = [Example(id=str(i), source=f"{i} {i + 1}", target=f"{i} 3") for i in range(5)]
    cfg = EvalConfig(max_new_tokens=4, metrics=["perplexity", "rouge1", "distinct_1", "cider_d"])
    result = evaluate(tiny_policy, examples, cfg, MetricConfig(cider_sigma=15.0), 32)
    assert list(result.metrics) == ["perplexity", "rouge1", "distinct_1", "cider_d"]
    refs = [[e.target] for e in examples]
    text = metric_table(result.predictions, refs, MetricConfig(cider_sigma=15.0), ["rouge1", "distinct_1", "cider_d"])
    assert {k: result.metrics[k] for k in text} == text
    assert result.metrics["cider_d"] == get_metric("cider_d", sigma=15.0).corpus(result.predictions, refs)
    assert result.metrics["perplexity"] == reference_perplexity(
        tiny_policy, [e.source for e in examples], [e.target for e in examples], max_source_len=32)
    with pytest.raises(ValueError, match=r"eval.metrics: unknown metric\(s\) \['bleu5'\]"):
        evaluate(tiny_policy, examples, EvalConfig(metrics=["bleu5"]), MetricConfig(), 32)
    with pytest.raises(ValueError, match="eval.classifier_path"):
        evaluate(tiny_policy, examples, EvalConfig(metrics=["classifier_accuracy"]), MetricConfig(), 32)


HYPS_REFS = (["a b c d", "a b", "x y z"], [["a b c d e"], ["a b c"], ["x y w", "x y z"]])


def _examples(refs, extra=None):
    return [Example(id=str(i), source=f"s{i}", target=r[0], references=tuple(r), extra=dict(extra or {}))
            for i, r in enumerate(refs)]


def test_the_monitor_is_the_metric_metric_monitor_names_with_its_settings():
    from rlt2t.learner.evaluate import build_monitor, monitor_name

    hyps, refs = HYPS_REFS
    examples = _examples(refs)
    cider, bleu = get_metric("cider_d").corpus(hyps, refs), get_metric("bleu4").corpus(hyps, refs)
    assert build_monitor(MetricConfig())(examples, hyps) == pytest.approx(cider)  # default, w = 0: CIDEr-D alone
    weighted = MetricConfig(monitor_bleu_weight=0.5)
    assert build_monitor(weighted)(examples, hyps) == pytest.approx(0.5 * cider + 0.5 * bleu)
    assert build_monitor(MetricConfig(monitor="rouge_l"))(examples, hyps) == get_metric("rouge_l").corpus(hyps, refs)
    # A named metric takes its configured settings: CIDEr-D's sigma, the task score's weight.
    wide = MetricConfig(monitor="cider_d", cider_sigma=0.5)
    assert build_monitor(wide)(examples, hyps) == get_metric("cider_d", sigma=0.5).corpus(hyps, refs) != cider
    task = MetricConfig(monitor="task_score", bleu_weight=0.25)
    assert build_monitor(task)(examples, hyps) == pytest.approx(0.75 * cider + 0.25 * bleu)
    assert [monitor_name(m) for m in (MetricConfig(), weighted, wide, task, MetricConfig(monitor="rouge_l"))] == [
        "default", "default, monitor_bleu_weight=0.5", "cider_d, cider_sigma=0.5", "task_score, bleu_weight=0.25",
        "rouge_l"]


def test_a_reward_monitor_is_the_mean_reward_with_each_rows_fields():
    from rlt2t.learner.evaluate import build_monitor

    hyps, refs = HYPS_REFS
    calls = []

    def reward(sources, candidates, references, fields):
        calls.append((sources, candidates, references, fields))
        return [len(c.split()) + f["bonus"] for c, f in zip(candidates, fields, strict=True)]

    monitor = build_monitor(MetricConfig(monitor="reward"), lambda: reward)
    assert monitor(_examples(refs, {"bonus": 1}), hyps) == pytest.approx((5 + 3 + 4) / 3)
    assert calls == [(["s0", "s1", "s2"], hyps, [list(r) for r in refs], [{"bonus": 1}] * 3)]
    built = []
    build_monitor(MetricConfig(), lambda: built.append(1))  # the reward is built for a reward monitor only
    assert built == []


def test_a_monitor_that_cannot_be_scored_fails_when_the_job_starts_naming_metric_monitor():
    from rlt2t.common.config import ConfigError
    from rlt2t.learner.evaluate import build_monitor

    with pytest.raises(ConfigError, match=r"metric.monitor: unknown metric 'rouge_m' \(did you mean rouge_l\?\); "
                                          r"known: default, reward, .*register it in a module listed in reward"):
        build_monitor(MetricConfig(monitor="rouge_m"))
    with pytest.raises(ConfigError, match="metric.monitor=classifier_accuracy: the metric cannot be built from the "
                                          "config alone"):
        build_monitor(MetricConfig(monitor="classifier_accuracy"))
    with pytest.raises(ConfigError, match="metric.monitor=reward: this job has no reward"):
        build_monitor(MetricConfig(monitor="reward"))
    with pytest.raises(ConfigError, match="metric.monitor=mean_length: a length, not a score"):
        build_monitor(MetricConfig(monitor="mean_length"))
    with pytest.raises(ConfigError, match=r"reward.plugins\[0\]: cannot import module 'no_such_metrics_module'"):
        build_monitor(MetricConfig(monitor="mine"), plugins=["no_such_metrics_module"])


def test_the_sft_monitor_scores_greedy_outputs_with_the_monitor_it_is_given(tiny_policy):
    from rlt2t.learner.evaluate import monitor_score

    examples = [Example(id=str(i), source=f"{i} {i + 1} 3", target=f"{i} {i}") for i in range(6)]
    seen = []

    def count(examples, hyps):
        seen.append(list(hyps))
        return 7.0

    out = monitor_score(tiny_policy, examples, MetricConfig(), max_source_len=32, max_new_tokens=8, monitor=count)
    assert out["monitor"] == 7.0
    assert seen == [generate(tiny_policy, [e.source for e in examples], max_new_tokens=8, max_source_len=32)]


def test_a_job_refuses_a_reward_monitor_beside_a_reward_server_set_after_the_config_loaded():
    """Assigning a section's field skips the config's cross-section check (the Python API's way to set it)."""
    from rlt2t.common.config import ConfigError, load_config
    from rlt2t.learner.evaluate import job_monitor

    cfg = load_config(overrides=["reward.source=http", "reward.url=http://127.0.0.1:1"])
    cfg.metric.monitor = "reward"
    with pytest.raises(ConfigError, match="with reward.source=http the reward is the server's"):
        job_monitor(cfg, lambda: pytest.fail("no reward is built"))


def test_a_reward_that_fails_on_a_validation_output_names_the_monitor():
    from rlt2t.common.python_rewards import RewardError
    from rlt2t.learner.evaluate import build_monitor

    def failing(*batch):
        raise RewardError("reward term python:m:f raised ZeroDivisionError")

    monitor = build_monitor(MetricConfig(monitor="reward"), lambda: failing)
    with pytest.raises(RewardError, match=r"^the validation monitor \(metric.monitor=reward\): reward term python:m:f"):
        monitor(_examples(HYPS_REFS[1]), HYPS_REFS[0])
