"""A metric whose data is missing here (METEOR without Debian's wordnet-base) stops `rlt2t eval` and the RL job
before they decode or start Ray, naming the metric and the command that installs what it needs."""

from __future__ import annotations

import pytest

import rlt2t.driver as driver
from rlt2t import api
from rlt2t.cli import main
from rlt2t.common.config import ConfigError, load_config
from rlt2t.common.data import Example

INSTALL = ("wordnet-base", "`make system-deps`", "`apt-get install wordnet-base`")


class _Decoding(Exception):
    """Raised where eval would start decoding."""


@pytest.fixture
def decoding(monkeypatch) -> list:
    """Calls that reached api.evaluate (the decoding), each stopped there with _Decoding."""
    calls: list = []

    def evaluate(cfg, models, **kw):
        calls.append(kw["metrics"])
        raise _Decoding

    monkeypatch.setattr(api, "evaluate", evaluate)
    return calls


@pytest.mark.parametrize(("args", "what"), [
    (["--metrics", "rouge1,meteor"], "--metrics"),
    (["--metrics", "all"], "--metrics"),
    (["eval.metrics=[bleu4, meteor]"], "eval.metrics"),
])
def test_eval_refuses_a_metric_missing_its_data_before_decoding(no_wordnet, decoding, tmp_path, capsys, args, what):
    code = main(["eval", "--config", "tiny", f"run.dir={tmp_path}", *args])
    err = capsys.readouterr().err
    assert code == 2 and decoding == [], err
    (line,) = [x for x in err.splitlines() if x.startswith("rlt2t eval: error: ")]
    assert line.startswith(f"rlt2t eval: error: {what}: meteor cannot run here: WordNet data not found"), err
    assert all(words in line for words in INSTALL), err


def test_eval_without_such_a_metric_goes_on_to_decode(no_wordnet, decoding, tmp_path):
    with pytest.raises(_Decoding):
        main(["eval", "--config", "tiny", f"run.dir={tmp_path}", "--metrics", "rouge1,bleu4"])
    assert decoding == ["rouge1,bleu4"]


def test_the_rl_job_refuses_a_reward_missing_its_data_before_ray_starts(no_wordnet, monkeypatch, tmp_path):
    monkeypatch.setattr(driver, "init_ray", lambda cfg: pytest.fail("Ray started"))
    cfg = load_config(["tiny"], [f"run.dir={tmp_path}",
                                 "reward.terms=[{kind: metric, name: task_score}, {kind: metric, name: meteor}]"])
    examples = [Example(str(i), f"s {i}", f"t {i}") for i in range(8)]
    with pytest.raises(ConfigError, match=r"^reward.terms\[1\] \(metric:meteor\): WordNet data not found") as e:
        driver.train(cfg, examples, [], init=tmp_path / "init")
    assert all(words in str(e.value) for words in INSTALL), e.value


@pytest.mark.parametrize(("metrics", "what"), [(["rouge1", "meteor"], "metrics"), (None, "eval.metrics")])
def test_the_python_api_refuses_a_metric_missing_its_data_before_a_model_loads(no_wordnet, monkeypatch, tmp_path,
                                                                               metrics, what):
    import rlt2t.eval_table as eval_table

    monkeypatch.setattr(eval_table, "eval_job", lambda *a, **kw: pytest.fail("a model was evaluated"))
    cfg = load_config(["tiny"], [f"run.dir={tmp_path}", "eval.metrics=[bleu4, meteor]"])
    with pytest.raises(ValueError, match=rf"^{what}: meteor cannot run here: WordNet data not found") as e:
        api.evaluate(cfg, {"m": tmp_path / "model"}, metrics=metrics)
    assert all(words in str(e.value) for words in INSTALL), e.value
