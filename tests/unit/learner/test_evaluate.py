from __future__ import annotations

import pytest
import torch

from rlt2t.common.config import EvalConfig, MetricConfig
from rlt2t.common.data import Example
from rlt2t.learner.evaluate import TABLE_METRICS, evaluate, generate, metric_table


def test_generate_keeps_input_order_across_length_sorted_batches(tiny_policy):
    sources = ["1 2 3 4 5 6 7", "8", "9 10 11", "12 13"]
    batched = generate(tiny_policy, sources, batch_size=2, max_new_tokens=6)
    one_by_one = [generate(tiny_policy, [s], max_new_tokens=6)[0] for s in sources]
    assert batched == one_by_one


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


def test_beam_search_runs(tiny_policy):
    torch.manual_seed(0)
    out = generate(tiny_policy, ["1 2 3"], num_beams=3, max_new_tokens=4)
    assert isinstance(out[0], str)
