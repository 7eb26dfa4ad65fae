"""Several references per source (``"references"`` in a row, ``Example.refs``): read and written, carried by the
rollouts, scored against by the rewards, the evaluation and the validation monitor, and counted once per
source in CIDEr-D's document frequencies."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rlt2t.actors.rollout import RolloutWorker
from rlt2t.common.algorithms import rollout_spec_for
from rlt2t.common.candidates import candidate_set
from rlt2t.common.config import EvalConfig, MetricConfig, ModelConfig, RolloutConfig
from rlt2t.common.data import (
    DataError,
    Example,
    load_examples,
    reference_sets,
    unique_references,
    write_examples,
)
from rlt2t.common.metrics import DocumentFrequency, get_metric
from rlt2t.common.rewards import MetricReward, score_groups, score_pairs
from rlt2t.common.types import SampledGroup
from rlt2t.learner.evaluate import distinct_outputs, evaluate, generate, metric_table, monitor_score

REFS = ["1 2 3 4", "1 2 5 6", "7 8 9"]


def _rows(path, *rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_row_with_references_loads_them_and_its_target_defaults_to_the_first(tmp_path):
    path = _rows(tmp_path / "d.jsonl",
                 {"id": "a", "source": "s", "references": REFS},
                 {"id": "b", "source": "s", "target": "1 2 5 6", "references": REFS, "lang": "x"},
                 {"id": "c", "source": "t", "target": "4 4"})
    a, b, c = load_examples(path)
    assert (a.target, a.refs) == ("1 2 3 4", tuple(REFS))
    assert (b.target, b.refs, b.extra) == ("1 2 5 6", tuple(REFS), {"lang": "x"})
    assert (c.references, c.refs) == ((), ("4 4",))  # no references: scored against the target alone
    write_examples(tmp_path / "back.jsonl", [a, b, c])
    assert list(load_examples(tmp_path / "back.jsonl")) == [a, b, c]
    assert "references" not in json.loads((tmp_path / "back.jsonl").read_text().splitlines()[2])


def test_a_target_outside_the_rows_references_is_refused_naming_the_line(tmp_path):
    path = _rows(tmp_path / "d.jsonl", {"id": "a", "source": "s", "target": REFS[1], "references": REFS},
                 {"id": "b", "source": "s", "target": "5 5", "references": REFS})
    with pytest.raises(DataError) as err:
        list(load_examples(path))
    assert ":2: field 'target': not one of the row's references" in str(err.value)


def test_the_idf_table_counts_a_sources_references_once_however_many_rows_repeat_them(tmp_path):
    """One row per reference (COCO-style): predict's IDF table holds each reference once, as CIDEr-D's document
    frequencies do, not once per row that repeats it."""
    from rlt2t.common.config import load_config
    from rlt2t.ensemble import build_idf_table

    _rows(tmp_path / "train.jsonl", *({"id": f"s{i}", "source": "s", "target": r, "references": REFS}
                                      for i, r in enumerate(REFS)),
          {"id": "t", "source": "t", "target": "1 9"})
    table = build_idf_table(load_config(overrides=[f"data.train={tmp_path / 'train.jsonl'}"]))
    assert table.num_docs == len(REFS) + 1
    assert table.df[("1",)] == 3 and table.df[("7",)] == 1 and table.df[("1", "2")] == 2


@pytest.mark.parametrize(("value", "field", "reason"), [
    ("1 2", "references", "expected a non-empty list of strings, got str"),
    ([], "references", "expected a non-empty list of strings, got []"),
    (["1 2", ""], "references[1]", "empty"),
    (["1 2", 3], "references[1]", "expected a string, got int"),
])
def test_bad_references_name_the_line_and_the_field(tmp_path, value, field, reason):
    path = _rows(tmp_path / "d.jsonl", {"id": "a", "source": "s", "target": "1"},
                 {"id": "b", "source": "s", "references": value})
    with pytest.raises(DataError) as err:
        load_examples(path)
    assert str(err.value) == f"{path}:2: field '{field}': {reason}"


def test_the_text_check_covers_every_reference(tmp_path):
    path = _rows(tmp_path / "d.jsonl", {"id": "a", "source": "s", "references": ["1 2", "1 999"]})
    with pytest.raises(DataError, match=r":1: field 'references\[1\]': 999 unknown"):
        load_examples(path, check_text=lambda t: "999 unknown" if "999" in t else None)


def test_examples_built_in_code_refuse_empty_references():
    with pytest.raises(ValueError, match="Example.references must be a tuple of non-empty strings"):
        Example(id="a", source="s", target="1", references=("1", " "))


def test_rows_of_one_source_and_its_references_are_one_reference_set():
    rows = [Example(id=str(i), source="s", target=r, references=tuple(REFS)) for i, r in enumerate(REFS)]
    rows += [Example(id="o", source="o", target="7 8"), Example(id="p", source="p", target="7 8")]
    assert reference_sets(rows) == [REFS, ["7 8"], ["7 8"]]  # single targets: one set per row, as before
    assert [refs for _, refs in unique_references(rows)] == [tuple(REFS), (), (), ("7 8",), ("7 8",)]


def _cider_task(refs: list[list[str]]):
    return get_metric("task_score", df=DocumentFrequency.from_references(refs))


def test_groups_and_pairs_are_scored_against_every_reference():
    metric = _cider_task([REFS, ["7 8"]])
    hyps = ("1 2 5 6", "7 8 9", "1 2 3 4")
    group = SampledGroup(example_id="a", source="s", reference=REFS[0], references=tuple(REFS), candidates=hyps,
                         token_ids=((1,),) * 3, sample_logprobs=((0.0,),) * 3, forced_eos=(False,) * 3,
                         policy_version=0)
    [scored] = score_groups(MetricReward(metric), [group])
    expected = metric.per_sample(list(hyps), [REFS] * 3)
    np.testing.assert_allclose(scored.rewards, expected)
    alone = metric.per_sample(list(hyps), [[REFS[0]]] * 3)
    assert scored.rewards[1] > 0 and alone[1] == 0  # "7 8 9" is only in a reference other than the gold
    pairs = candidate_set("a", "s", REFS[0], ["7 8 9"], include_gold=True, seed=0, version=0, references=REFS)
    [pair] = score_pairs(MetricReward(metric), [pairs])
    assert {pair.score_a, pair.score_b} == set(metric.per_sample(["7 8 9", REFS[0]], [REFS] * 2).tolist())
    assert pair.reference == REFS[0]  # rank RL's CE still learns the gold


def test_rollouts_carry_the_examples_references(ids_tokenizer_dir, tiny_policy):
    weights = tiny_policy.model.state_dict()
    worker = RolloutWorker(ModelConfig(preset="tiny", family="bart"), str(ids_tokenizer_dir),
                           RolloutConfig(max_new_tokens=4, num_samples=2), seed=1, max_source_len=16,
                           spec=rollout_spec_for("grpo", kl=False))
    worker.set_weights(0, weights)
    examples = [Example(id="a", source="5 6", target=REFS[0], references=tuple(REFS)),
                Example(id="b", source="7", target="8 9")]
    groups = worker.sample(examples)
    assert [g.refs for g in groups] == [tuple(REFS), ("8 9",)]
    pair_worker = RolloutWorker(ModelConfig(preset="tiny", family="bart"), str(ids_tokenizer_dir),
                                RolloutConfig(max_new_tokens=4, num_samples=2), seed=1, max_source_len=16)
    pair_worker.set_weights(0, weights)
    assert [s.refs for s in pair_worker.sample(examples)] == [tuple(REFS), ("8 9",)]


def test_evaluation_and_the_monitor_score_against_every_reference(tiny_policy):
    with torch.no_grad():  # no EOS: a fresh tiny BART says nothing at all
        tiny_policy.model.final_logits_bias[0, tiny_policy.tokenizer.eos_token_id] = -1e4
    sources = ["5 6", "7 7", "9"]
    said = generate(tiny_policy, sources, max_new_tokens=6, max_source_len=16)
    # The gold is not what the model says; the first source's second reference is (the others' differ, so that
    # CIDEr-D's idf weighs it): only scoring against every reference sees it.
    seconds = [said[0], "3 3 3", "4 4 4"]
    examples = [Example(id=str(i), source=s, target="1 1 1", references=("1 1 1", r))
                for i, (s, r) in enumerate(zip(sources, seconds, strict=True))]
    refs = [list(e.refs) for e in examples]
    metric = MetricConfig()
    result = evaluate(tiny_policy, examples, EvalConfig(max_new_tokens=6), metric, max_source_len=16)
    assert result.predictions == said
    names = [n for n in result.metrics if n != "perplexity"]
    assert {n: result.metrics[n] for n in names} == metric_table(said, refs, metric, names)
    assert result.metrics["bleu4"] > metric_table(said, [["1 1 1"]] * 3, metric, ["bleu4"])["bleu4"]
    monitor = monitor_score(tiny_policy, examples, metric, max_source_len=16, max_new_tokens=6)
    assert monitor["cider_d"] == pytest.approx(get_metric("cider_d").corpus(said, refs))
    assert monitor["cider_d"] > get_metric("cider_d").corpus(said, [["1 1 1"]] * 3)
    assert monitor["distinct_outputs"] == distinct_outputs(sources, said)
