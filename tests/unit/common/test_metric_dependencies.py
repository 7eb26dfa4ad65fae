"""Metrics that need data or a package beyond the Python environment (METEOR: WordNet) say what is missing and the
command that installs it before anything is built; the RL job's reward check refuses such a term, naming it."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

from rlt2t.common.config import ConfigError, MetricTerm, RewardConfig
from rlt2t.common.metrics import (
    _REGISTRY,
    Meteor,
    available_metrics,
    check_dependencies,
    missing_dependency,
    register_metric,
)
from rlt2t.common.rewards import check_reward, missing_dependencies

INSTALL = ("wordnet-base", "`make system-deps`", "`apt-get install wordnet-base`")


@pytest.fixture
def wordnet_dir(tmp_path):
    """A directory find_wordnet accepts (it looks for data.noun)."""
    path = tmp_path / "wn"
    path.mkdir()
    (path / "data.noun").write_text("")
    return path


def test_meteor_without_wordnet_names_the_package_and_the_commands(no_wordnet):
    reason = missing_dependency("meteor")
    assert reason is not None and all(words in reason for words in INSTALL), reason
    assert str(no_wordnet) in reason and "$WNSEARCHDIR" in reason  # where it looked, and the other way out
    # The same words as the error building it gives: one check, one message.
    given = missing_dependency("meteor", wordnet_dir=no_wordnet)
    with pytest.raises(FileNotFoundError, match=re.escape(given)):
        Meteor(wordnet_dir=no_wordnet)


def test_meteor_with_wordnet_data_needs_nothing(no_wordnet, wordnet_dir, monkeypatch):
    assert missing_dependency("meteor", wordnet_dir=wordnet_dir) is None
    monkeypatch.setenv("WNSEARCHDIR", str(wordnet_dir))
    assert missing_dependency("meteor") is None


def test_only_meteor_needs_data_among_the_builtin_metrics(no_wordnet):
    assert [name for name in available_metrics() if missing_dependency(name) is not None] == ["meteor"]
    assert missing_dependency("no_such_metric_xyz") is None  # an unknown name is get_metric's error, not this one


class _NeedsTool:
    """A metric of one's own that needs a program: it declares the check beside the metric."""

    name = "needs_tool_xyz"

    def __init__(self, tool: str = "xyz-tool") -> None:
        self.tool = tool

    @staticmethod
    def missing_dependency(tool: str = "xyz-tool", **_params) -> str | None:
        return f"{tool} is not installed; install it with `apt-get install {tool}`"

    def per_sample(self, hyps, refs) -> np.ndarray:
        return np.zeros(len(hyps))

    def corpus(self, hyps, refs) -> float:
        return 0.0


def test_a_metric_of_ones_own_declares_its_dependency_and_a_partial_keeps_it():
    register_metric("needs_tool_xyz")(_NeedsTool)
    register_metric("needs_tool_abc")(functools.partial(_NeedsTool, tool="abc-tool"))
    try:
        assert missing_dependency("needs_tool_xyz") == "xyz-tool is not installed; install it with " \
                                                       "`apt-get install xyz-tool`"
        assert missing_dependency("needs_tool_xyz", tool="other", sigma=9.0).startswith("other is not installed")
        assert missing_dependency("needs_tool_abc").startswith("abc-tool is not installed")  # the partial's keyword
        with pytest.raises(ValueError, match=r"^--metrics: needs_tool_abc cannot run here: abc-tool is not installed"):
            check_dependencies(["bleu4", "needs_tool_abc"], "--metrics")
    finally:
        del _REGISTRY["needs_tool_xyz"], _REGISTRY["needs_tool_abc"]


def test_check_dependencies_names_the_setting_each_metric_and_the_fix(no_wordnet, wordnet_dir):
    check_dependencies(["bleu4", "rouge_l", "perplexity"], "--metrics")  # nothing missing (perplexity: the model's)
    with pytest.raises(ValueError, match=r"^eval.metrics: meteor cannot run here: WordNet data not found .*"
                                         r"`apt-get install wordnet-base`"):
        check_dependencies(["bleu4", "meteor"], "eval.metrics")
    check_dependencies(["meteor"], "--metrics", {"meteor": {"wordnet_dir": str(wordnet_dir)}})


def test_the_rl_reward_check_refuses_a_metric_term_whose_data_is_missing(no_wordnet, wordnet_dir):
    cfg = RewardConfig(terms=[MetricTerm(name="task_score"), MetricTerm(name="meteor", weight=0.5)])
    with pytest.raises(ConfigError, match=r"^reward.terms\[1\] \(metric:meteor\): WordNet data not found .*"
                                          r"`make system-deps`"):
        check_reward(cfg)
    # The term's own WordNet directory (its params) is what is checked.
    check_reward(RewardConfig(terms=[MetricTerm(name="meteor", params={"wordnet_dir": str(wordnet_dir)})]))
    # A named reward is the reward server's, which leaves it out: the job, which does not score with it, starts.
    named = RewardConfig(named={"fluency": [MetricTerm(name="bleu4"), MetricTerm(name="meteor")]})
    check_reward(named)
    (line,) = missing_dependencies(named.named["fluency"], "reward.named.fluency")
    assert line.startswith("reward.named.fluency[1] (metric:meteor): WordNet data not found") and "wordnet-base" in line
