"""`metric.monitor` through a stage job: what picks the best checkpoint is the measure the user named (a metric of
their own, or their reward), scored on the stage's greedy validation outputs in the stage's process."""

from __future__ import annotations

import json
import textwrap

import pytest

from rlt2t.common.checkpoint import read_checkpoint
from rlt2t.common.config import load_config
from rlt2t.common.data import load_examples
from rlt2t.common.policy import load_policy
from rlt2t.learner.evaluate import generate

MODULES = {
    "monitor_rewards.py": '''
        import json

        def words(sources, candidates, references, log):
            scores = [len(c.split()) + 0.5 * len(r) for c, r in zip(candidates, references)]
            with open(log, "a") as f:
                for row in zip(sources, candidates, scores):
                    f.write(json.dumps(row) + "\\n")
            return scores
        ''',
    "monitor_metrics.py": '''
        import rlt2t

        @rlt2t.register_metric("monitor_test_chars")
        class Chars:
            def per_sample(self, hyps, refs):
                return [float(len(h)) for h in hyps]

            def corpus(self, hyps, refs):
                return sum(self.per_sample(hyps, refs)) / len(hyps)
        ''',
}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A tiny run's data and tokenizer, made once."""
    from rlt2t.jobs import build_tokenizer_job, make_synthetic_data

    root = tmp_path_factory.mktemp("monitor")
    cfg = load_config(overrides=[f"run.dir={root / 'base'}", "model.preset=tiny", "synth.size=200",
                                 "synth.valid_fraction=0.1"])
    make_synthetic_data(cfg)
    build_tokenizer_job(cfg)
    return root


def _sft(prepared, tmp_path, monkeypatch, *overrides):
    from rlt2t.jobs import sft_job

    for name, text in MODULES.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    base = prepared / "base"
    cfg = load_config(overrides=[f"run.dir={tmp_path / 'run'}", "run.progress=false", "model.preset=tiny",
                                 f"data.train={base / 'data' / 'train.jsonl'}",
                                 f"data.valid={base / 'data' / 'valid.jsonl'}",
                                 f"tokenizer.path={base / 'tokenizer'}", "sft.max_steps=20", "sft.epochs=20",
                                 "sft.batch_size=8", "sft.lr=3e-3", "sft.warmup_ratio=0", "sft.monitor=metric",
                                 "metric.monitor_size=6", "eval.max_new_tokens=6", *overrides])
    result = sft_job(cfg)
    valid = load_examples(base / "data" / "valid.jsonl")[:6]
    policy = load_policy(cfg.model, cfg.tokenizer_dir, checkpoint=result.best)
    outputs = generate(policy, [e.source for e in valid], max_new_tokens=6, max_source_len=cfg.data.max_source_len)
    assert any(outputs), "20 steps no longer teach the tiny model to write: the monitor would score empty texts"
    return result, read_checkpoint(result.best).meta, valid, outputs


def test_an_sft_stage_keeps_its_best_by_the_users_reward(prepared, tmp_path, monkeypatch):
    calls = tmp_path / "calls.jsonl"
    result, meta, valid, outputs = _sft(prepared, tmp_path, monkeypatch, "metric.monitor=reward",
                                        f"reward.terms=[{{kind: python, fn: 'monitor_rewards:words', "
                                        f"params: {{log: '{calls}'}}}}]")
    rows = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [r[:2] for r in rows] == [[e.source, o] for e, o in zip(valid, outputs, strict=True)]  # once each
    assert meta["metrics"]["monitor"] == pytest.approx(sum(r[2] for r in rows) / len(rows))
    assert meta["best"]["by"] == "reward" and result.best.name == "epoch-0001"


def test_an_sft_stage_keeps_its_best_by_a_metric_a_plugin_registers(prepared, tmp_path, monkeypatch):
    _, meta, _, outputs = _sft(prepared, tmp_path, monkeypatch, "metric.monitor=monitor_test_chars",
                               "reward.plugins=[monitor_metrics]")
    assert meta["best"]["by"] == "monitor_test_chars"
    assert meta["metrics"]["monitor"] == pytest.approx(sum(len(o) for o in outputs) / len(outputs))


def test_a_stage_monitored_by_its_loss_builds_no_reward_to_log(prepared, tmp_path, monkeypatch):
    """sft.monitor=loss beside metric.monitor=reward (one config for SFT and RL): the reward (here a function that
    does not import, as a reward model SFT has not trained yet would not load) is not built; the greedy outputs'
    default metric is logged as `metric`."""
    from rlt2t.common.metrics import get_metric

    result, meta, valid, outputs = _sft(prepared, tmp_path, monkeypatch, "sft.monitor=loss", "metric.monitor=reward",
                                        "reward.terms=[{kind: python, fn: 'no_such_module:fn'}]")
    assert meta["best"]["by"] == "-valid_loss" and meta["metrics"]["monitor"] == -meta["metrics"]["valid_loss"]
    refs = [list(e.refs) for e in valid]
    assert meta["metrics"]["metric"] == pytest.approx(get_metric("cider_d").corpus(outputs, refs))
