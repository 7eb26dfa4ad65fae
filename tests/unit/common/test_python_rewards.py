"""Python reward terms (``kind: python``): the call contract (batched and per sample, row fields, params), the
checks on what comes back, errors that name the term and the source, the preflight, the registry, plugins and
entry points, and the registrations a job ships to its reward workers."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from rlt2t.actors.reward import RewardWorker
from rlt2t.common import metrics as metrics_module
from rlt2t.common import python_rewards
from rlt2t.common.candidates import candidate_set
from rlt2t.common.config import ConfigError, MetricTerm, PythonTerm, RewardConfig, config_to_yaml, load_config
from rlt2t.common.python_rewards import RewardError, register_reward
from rlt2t.common.rewards import UserRegistrations, build_reward, check_reward, score_groups, score_pairs
from rlt2t.common.types import SampledGroup

SOURCES = ["1 2 3", "4 5", "6"]
CANDS = ["11 12", "13", "14 15 16"]
REFS = [["11 12 13"], ["13"], ["14", "16"]]


def reward_of(*terms: PythonTerm):
    return build_reward(RewardConfig(terms=list(terms)))


def test_a_batched_function_gets_every_candidate_its_references_row_fields_and_params():
    calls = []

    def fn(sources, candidates, references, difficulty, scale):
        calls.append((sources, candidates, references, difficulty, scale))
        return [scale * len(c.split()) + (d or 0) for c, d in zip(candidates, difficulty, strict=True)]

    fields = [{"difficulty": 1, "topic": "a"}, {"topic": "b"}, {"difficulty": 3}]
    scores = reward_of(PythonTerm(fn=fn, params={"scale": 2.0})).score(SOURCES, CANDS, REFS, fields)
    np.testing.assert_array_equal(scores, [2 * 2 + 1, 2 * 1 + 0, 2 * 3 + 3])
    # one call for the batch; `topic` is not a parameter of fn, so it is not passed; a row without a field gets None
    assert calls == [(SOURCES, CANDS, REFS, [1, None, 3], 2.0)]


def test_a_function_with_kwargs_gets_every_row_field_and_empty_references_without_them():
    seen = {}

    def fn(sources, candidates, references, **row_fields):
        seen.update(references=references, **row_fields)
        return np.arange(len(candidates), dtype=np.float32)  # any sequence of numbers: numpy, lists, tensors

    scores = reward_of(PythonTerm(fn=fn)).score(SOURCES, CANDS, None, [{"a": 1}, {"b": 2}, {}])
    assert scores.dtype == np.float64 and scores.tolist() == [0.0, 1.0, 2.0]
    assert seen == {"references": [[], [], []], "a": [1, None, None], "b": [None, 2, None]}


def test_a_per_sample_function_is_called_once_per_candidate_with_its_own_row():
    def fn(source, candidate, references, weight=1.0):
        return weight * (candidate in references)

    term = PythonTerm(fn=fn, per_sample=True)
    scores = reward_of(term).score(SOURCES, CANDS, REFS, [{"weight": 0.5}, {}, {"weight": 4}])
    assert scores.tolist() == [0.0, 1.0, 0.0]
    assert reward_of(term).score(["s"], ["14"], [["14"]], [{"weight": 4}]).tolist() == [4.0]


def test_a_weighted_python_term_adds_to_a_metric_term():
    metric = build_reward(RewardConfig(terms=[MetricTerm(name="bleu4")])).score(SOURCES, CANDS, REFS)
    both = build_reward(RewardConfig(terms=[MetricTerm(name="bleu4"),
                                            PythonTerm(fn=lambda s, c, r: [1.0] * len(c), weight=0.25)]))
    np.testing.assert_allclose(both.score(SOURCES, CANDS, REFS), metric + 0.25)
    assert [name for _, name, _ in both.terms] == [
        "metric:bleu4", f"python:{__name__}:test_a_weighted_python_term_adds_to_a_metric_term.<locals>.<lambda>"]


@pytest.mark.parametrize(("result", "message"), [
    ([1.0, float("nan"), 0.0], r"returned nan \(candidate 1: '13', source '4 5'\): rewards must be finite"),
    ([1.0, 0.0, math.inf], r"returned inf \(candidate 2: '14 15 16', source '6'\)"),
    ([1.0, 2.0], r"returned 2 scores for 3 candidates"),
    ([1.0, None, 0.0], r"returned None \(NoneType\), not a number \(candidate 1"),
    (["1", 2.0, 3.0], r"returned '1' \(str\), not a number \(candidate 0"),
    (0.5, r"returned float, not one float per candidate \(3\) \(a function of one candidate needs per_sample"),
    (None, r"returned NoneType, not one float per candidate"),
])
def test_what_is_not_one_finite_number_per_candidate_is_refused_naming_the_term(result, message):
    def fn(sources, candidates, references):
        return result

    with pytest.raises(RewardError, match=rf"reward term python:{__name__}:.*fn {message}"):
        reward_of(PythonTerm(fn=fn)).score(SOURCES, CANDS, REFS)


def test_an_exception_names_the_term_and_the_first_source_that_fails_alone():
    def fn(sources, candidates, references):
        return [1.0 / (len(c) - 2) for c in candidates]  # "13" divides by zero

    with pytest.raises(RewardError, match=r"python:.*fn raised ZeroDivisionError: float division by zero at .* "
                                          r"\(first failing source: '4 5', candidate 1: '13'\)") as err:
        reward_of(PythonTerm(fn=fn)).score(SOURCES, CANDS, REFS)
    assert isinstance(err.value.__cause__, ZeroDivisionError)
    assert f"at {Path(__file__).name}:" in str(err.value)
    assert "`return [1.0 / (len(c) - 2) for c in candidates]" in str(err.value)

    def per(source, candidate, references):
        raise KeyError(candidate)

    with pytest.raises(RewardError, match=r"raised KeyError: '11 12' at .* in per `raise KeyError\(candidate\)` "
                                          r"\(candidate 0: '11 12', source '1 2 3'\)"):
        reward_of(PythonTerm(fn=per, per_sample=True)).score(SOURCES, CANDS, REFS)


def test_a_function_that_cannot_take_the_three_arguments_is_refused_before_any_call():
    def one(candidates):
        return [0.0] * len(candidates)

    calls = []

    def late(sources, candidates, references, lang):  # a row field: given when the call comes
        calls.append(lang)
        return [0.0] * len(candidates)

    with pytest.raises(ConfigError, match=r"reward.terms\[0\] \(python:.*one\): .*one\(candidates\) cannot take the "
                                          r"three arguments a reward is called with: \(sources, candidates, "
                                          r"references, \*\*row_fields\) -> one float per candidate"):
        check_reward(RewardConfig(terms=[PythonTerm(fn=one)]))
    with pytest.raises(ConfigError, match=r"\(source, candidate, references, \*\*row_fields\) -> float "
                                          r"\(per_sample: true\)"):
        check_reward(RewardConfig(terms=[PythonTerm(fn=one, per_sample=True)]))
    check_reward(RewardConfig(terms=[PythonTerm(fn=late)]))
    assert reward_of(PythonTerm(fn=late)).score(["s"], ["c"], None, [{"lang": "en"}]).tolist() == [0.0]
    assert calls == [["en"]]


def test_a_function_of_one_candidate_given_as_batched_fails_saying_per_sample():
    def full_stop(source, candidate, references):
        return 0.0 if candidate.rstrip().endswith(".") else -1.0

    with pytest.raises(RewardError, match=r"raised AttributeError: .*rstrip.*; called with one candidate it returns "
                                          r"a number: a function of one candidate needs per_sample: true$"):
        reward_of(PythonTerm(fn=full_stop)).score(SOURCES, CANDS, REFS)
    with pytest.raises(RewardError) as err:  # a batched function's own failure gets no such hint
        reward_of(PythonTerm(fn=lambda sources, candidates, references: [1 / 0])).score(SOURCES, CANDS, REFS)
    assert "needs per_sample" not in str(err.value)


def test_a_failure_on_a_row_without_references_says_so():
    """RL on sources alone gives a function empty reference lists: one that reads refs[0] fails saying why."""
    def fn(sources, candidates, references):
        return [float(len(c.split()) - len(refs[0].split())) for c, refs in zip(candidates, references, strict=True)]

    unlabeled = [[] for _ in CANDS]
    with pytest.raises(RewardError, match=r"raised IndexError: list index out of range .*\(first failing source: "
                                          r"'1 2 3', candidate 0: '11 12'; its row has no references, an empty list\)"):
        reward_of(PythonTerm(fn=fn)).score(SOURCES, CANDS, unlabeled)

    def per(source, candidate, references):
        return float(len(references[0]))

    with pytest.raises(RewardError, match=r"\(candidate 0: '11 12', source '1 2 3'; its row has no references"):
        reward_of(PythonTerm(fn=per, per_sample=True)).score(SOURCES, CANDS, unlabeled)
    # (a labelled row's failure says nothing of references: the test above ends at the candidate)


def test_a_param_that_shadows_a_row_field_is_refused():
    def fn(sources, candidates, references, **row_fields):
        return [0.0] * len(candidates)

    with pytest.raises(RewardError, match="difficulty is both a row field of the data and a param of the term"):
        reward_of(PythonTerm(fn=fn, params={"difficulty": 1})).score(["s"], ["c"], None, [{"difficulty": 2}])


def test_the_preflight_names_the_term_and_the_path_that_does_not_import():
    cfg = load_config(overrides=['reward.terms=[{kind: metric}, {kind: python, fn: "no_such_module_xyz:f"}]'])
    with pytest.raises(ConfigError, match=r"reward.terms\[1\] \(python:no_such_module_xyz:f\) 'no_such_module_xyz:f': "
                                          r"cannot import module 'no_such_module_xyz'"):
        check_reward(cfg.reward)
    with pytest.raises(ConfigError, match=r"reward.named.mine\[0\] .*'json:no_such_name': module 'json' has no "
                                          r"attribute 'no_such_name'"):
        check_reward(RewardConfig(named={"mine": [PythonTerm(fn="json:no_such_name")]}))
    with pytest.raises(ConfigError, match=r"reward.terms\[0\] .*'json:decoder' is a module, not a function"):
        check_reward(RewardConfig(terms=[PythonTerm(fn="json:decoder")]))
    with pytest.raises(ConfigError, match=r"no reward registered as 'unregistered_xyz'.*package.module:function"):
        check_reward(RewardConfig(terms=[PythonTerm(fn="unregistered_xyz")]))
    with pytest.raises(ConfigError, match=r"reward.terms\[0\]: unknown metric 'no_metric_xyz'.*reward.plugins"):
        check_reward(RewardConfig(terms=[MetricTerm(name="no_metric_xyz")]))
    with pytest.raises(ConfigError, match=r"reward.plugins\[0\]: cannot import module 'no_plugin_xyz'"):
        check_reward(RewardConfig(plugins=["no_plugin_xyz"]))
    check_reward(RewardConfig(terms=[PythonTerm(fn="math:hypot")]))  # resolves: no error


def test_a_registered_reward_is_found_by_name(monkeypatch):
    monkeypatch.setattr(python_rewards, "_REWARDS", {})

    @register_reward("shortness")
    def shortness(sources, candidates, references):
        return [-len(c) for c in candidates]

    assert reward_of(PythonTerm(fn="shortness")).score(SOURCES, CANDS, REFS).tolist() == [-5.0, -2.0, -8.0]
    with pytest.raises(ValueError, match="already registered"):
        register_reward("shortness")(lambda s, c, r: c)
    register_reward("shortness")(shortness)  # the same function again (a module imported twice): no error


def test_a_function_given_in_code_is_written_out_as_its_path():
    term = PythonTerm(fn=test_a_function_given_in_code_is_written_out_as_its_path)
    cfg = load_config()
    cfg.reward.terms = [term]
    assert f"fn: {__name__}:test_a_function_given_in_code_is_written_out_as_its_path" in config_to_yaml(cfg)
    assert cfg.reward.terms[0].fn is test_a_function_given_in_code_is_written_out_as_its_path


def test_pairs_and_groups_pass_each_examples_row_fields_to_every_candidate_of_it():
    def fn(sources, candidates, references, bonus):
        return [float(b) for b in bonus]

    reward = reward_of(PythonTerm(fn=fn))
    sets = [candidate_set("a", "1", "2", ["3"], include_gold=True, seed=0, version=0, fields={"bonus": 5}),
            candidate_set("b", "1", "2", ["3"], include_gold=True, seed=0, version=0, fields={"bonus": 7})]
    assert [(p.score_a, p.score_b) for p in score_pairs(reward, sets)] == [(5.0, 5.0), (7.0, 7.0)]
    group = SampledGroup("g", "1", "2", ("3", "4"), ((5,), (6,)), ((-1.0,), (-1.0,)), (False, False), 0,
                         greedy="5", fields={"bonus": 2})
    scored = score_groups(reward, [group])[0]
    assert scored.rewards == (2.0, 2.0) and scored.greedy_reward == 2.0


def test_user_registrations_hold_what_the_reward_names_beyond_the_built_ins(monkeypatch):
    monkeypatch.setattr(python_rewards, "_REWARDS", {})
    monkeypatch.setattr(metrics_module, "_REGISTRY", dict(metrics_module._REGISTRY))
    cfg = RewardConfig(terms=[MetricTerm(name="bleu4"), MetricTerm(name="task_score"), PythonTerm(fn="zero")],
                       named={"other": [PythonTerm(fn="one")]})
    assert UserRegistrations.used_by(cfg) == UserRegistrations()

    def fn(sources, candidates, references):
        return [0.0] * len(candidates)

    register_reward("zero")(fn)
    register_reward("one")(fn)
    register_reward("unused")(fn)  # registered, but no term names it: not shipped (nor imported on a worker)
    metrics_module.register_metric("unused_metric")(metrics_module.MeanLength)
    factory = metrics_module._REGISTRY["bleu4"]
    metrics_module.register_metric("bleu4", replace=True)(lambda: factory())  # a replaced built-in is shipped too
    found = UserRegistrations.used_by(cfg)
    assert found.rewards == {"zero": fn, "one": fn} and list(found.metrics) == ["bleu4"]


def test_a_reward_worker_scores_a_python_term_over_a_plugin_module(tmp_path, monkeypatch):
    (tmp_path / "my_plugin_rewards.py").write_text(textwrap.dedent("""
        from rlt2t.common.python_rewards import register_reward

        @register_reward("plugin_length", replace=True)
        def plugin_length(sources, candidates, references, **row_fields):
            return [float(len(c.split())) for c in candidates]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(python_rewards, "_REWARDS", {})
    cfg = RewardConfig(terms=[PythonTerm(fn="plugin_length")], plugins=["my_plugin_rewards"])
    check_reward(cfg)
    worker = RewardWorker(cfg, None)
    assert worker.score_texts(SOURCES, CANDS, REFS) == [2.0, 1.0, 3.0]


def test_an_installed_entry_point_is_loaded_before_rewards_are_built(tmp_path):
    """A package's `rlt2t.plugins` entry point (a dist-info on the path, as pip installs one) registers its reward
    in every process that builds one, with no reward.plugins entry."""
    (tmp_path / "ep_rewards.py").write_text(textwrap.dedent("""
        from rlt2t.common.python_rewards import register_reward

        def setup():
            register_reward("from_entry_point")(lambda sources, candidates, references: [7.0] * len(candidates))
    """))
    info = tmp_path / "ep_rewards-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-rewards\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[rlt2t.plugins]\nmine = ep_rewards:setup\n")
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, sys.argv[1])
        from rlt2t.common.config import PythonTerm, RewardConfig
        from rlt2t.common.rewards import build_reward
        print(build_reward(RewardConfig(terms=[PythonTerm(fn="from_entry_point")])).score(["s"], ["c"]).tolist())
    """)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[7.0]"
