"""The variety of a model's greedy outputs, and the warning for a decoder that ignores its source.

Seen on the several-reference docstring task (seed 6 at sft.lr=1e-3): an SFT model whose greedy output was
one sentence for every name, validation CIDEr-D 0.09 where the other seeds reached 0.65-0.71, while its training
loss kept falling. Nothing said so until an RL benchmark compared nothing from it.
"""

from __future__ import annotations

import logging

import pytest

from rlt2t.common.checkpoint import save_checkpoint
from rlt2t.common.config import load_config
from rlt2t.common.data import Example
from rlt2t.jobs import warn_if_collapsed
from rlt2t.learner.evaluate import collapse_warning, distinct_outputs


def _examples(n: int, targets=None) -> list[Example]:
    targets = targets or [f"summary number {i}" for i in range(n)]
    return [Example(id=str(i), source=f"name {i}", target=targets[i]) for i in range(n)]


def test_distinct_outputs_counts_texts_per_distinct_source():
    assert distinct_outputs(["a", "b", "c", "d"], ["x", "y", "z", "w"]) == 1.0
    assert distinct_outputs(["a", "b", "c", "d"], ["x", "x", "x", "x"]) == 0.25
    assert distinct_outputs(["a", "b", "c", "d"], ["x", "x", "y", "y"]) == 0.5
    # A repeated source counts once, with its first text (greedy decoding gives it the same one anyway).
    assert distinct_outputs(["a", "a", "b"], ["x", "y", "x"]) == 0.5
    assert distinct_outputs([], []) == 0.0
    with pytest.raises(ValueError):
        distinct_outputs(["a"], ["x", "y"])


def test_collapse_is_measured_against_the_references_variety():
    varied = _examples(40)
    one_text = distinct_outputs([e.source for e in varied], ["the same sentence"] * 40)
    message = collapse_warning("sft: ckpt", one_text, varied, "lower sft.lr")
    assert message is not None
    assert "40 validation sources hold 1 distinct texts" in message and "lower sft.lr" in message
    assert "the references 1.000" in message
    # Healthy variety, or a twentieth of the references' or more: no warning.
    assert collapse_warning("sft", 1.0, varied, "") is None
    assert collapse_warning("sft", 0.05, varied, "") is None
    assert collapse_warning("sft", 0.049, varied, "") is not None
    # The CPU demo's RL at its first epoch: 16 texts for 200 sources, the references 0.815; a dip, not a collapse.
    assert collapse_warning("rl epoch 0", 0.08, _examples(200, [f"t{i % 163}" for i in range(200)]), "") is None
    # A task whose targets are few labels keeps few outputs: not a collapse.
    labels = _examples(40, ["positive" if i % 2 else "negative" for i in range(40)])
    assert collapse_warning("sft", 1 / 40, labels, "") is None
    # Too few sources to tell.
    assert collapse_warning("sft", 1 / 19, _examples(19), "") is None
    # One text for all of the 20 sources a small config monitors: 1/20 is not below a twentieth of the
    # references' 1.0, yet it is the collapse itself (unless the references hold one text too).
    assert "20 validation sources hold 1 distinct texts" in collapse_warning("rl", 1 / 20, _examples(20), "")
    assert collapse_warning("rl", 2 / 20, _examples(20), "") is None
    assert collapse_warning("sft", 1 / 20, _examples(20, ["yes", "no"] * 10), "") is None


def _checkpoint(tmp_path, tiny_policy, metrics, stage="sft"):
    return save_checkpoint(tmp_path / stage / "checkpoints", "epoch-0001", model=tiny_policy.model,
                           tokenizer=tiny_policy.tokenizer, step=1, meta={"stage": stage, "metrics": metrics})


def test_the_sft_checkpoint_rl_starts_from_is_checked(tmp_path, tiny_policy, caplog):
    cfg = load_config(overrides=[f"run.dir={tmp_path}", "sft.lr=1e-3"])
    valid = _examples(30)
    collapsed = _checkpoint(tmp_path, tiny_policy, {"monitor": 0.05, "distinct_outputs": 1 / 30})
    with caplog.at_level(logging.WARNING, logger="rlt2t.jobs"):
        warn_if_collapsed(cfg, collapsed, valid)
    [record] = caplog.records
    assert str(collapsed) in record.message and "sft.lr (now 0.001)" in record.message
    assert "model.preset=tiny" not in record.message  # the default preset is not the test one
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlt2t.jobs"):  # the tests' preset: a larger model may be the fix
        warn_if_collapsed(load_config(overrides=[f"run.dir={tmp_path}", "model.preset=tiny"]), collapsed, valid)
    [record] = caplog.records
    assert "or a larger model: model.preset=tiny is for tests" in record.message
    caplog.clear()
    earlier_rl = _checkpoint(tmp_path / "rl", tiny_policy, {"monitor": 0.05, "distinct_outputs": 1 / 30}, "rl")
    with caplog.at_level(logging.WARNING, logger="rlt2t.jobs"):
        warn_if_collapsed(cfg, earlier_rl, valid)
    [record] = caplog.records
    assert record.message.startswith(f"rl: {earlier_rl}") and "sft.lr" not in record.message
    caplog.clear()
    healthy = _checkpoint(tmp_path / "b", tiny_policy, {"monitor": 0.6, "distinct_outputs": 0.97})
    older = _checkpoint(tmp_path / "c", tiny_policy, {"monitor": 0.6})  # written before the metric existed
    with caplog.at_level(logging.WARNING, logger="rlt2t.jobs"):
        warn_if_collapsed(cfg, healthy, valid)
        warn_if_collapsed(cfg, older, valid)
        warn_if_collapsed(cfg, tmp_path / "not-a-checkpoint", valid)
    assert caplog.records == []


def test_an_sft_run_that_ignores_its_source_is_warned_about(tmp_path, caplog):
    """End to end through `sft_job`: one step from a fresh tiny BART, which says the same (nothing) for every
    source; the kept checkpoint records the variety and the job warns."""
    from rlt2t.common.checkpoint import read_checkpoint
    from rlt2t.jobs import build_tokenizer_job, make_synthetic_data, sft_job

    cfg = load_config(overrides=[f"run.dir={tmp_path}", "run.progress=false", "model.preset=tiny", "synth.size=400",
                                 "synth.valid_fraction=0.1", "sft.max_steps=1", "sft.epochs=1", "sft.lr=1e-5",
                                 "eval.max_new_tokens=4"])
    make_synthetic_data(cfg)
    build_tokenizer_job(cfg)
    with caplog.at_level(logging.WARNING, logger="rlt2t.jobs"):
        result = sft_job(cfg)
    distinct = read_checkpoint(result.checkpoint).meta["metrics"]["distinct_outputs"]
    assert distinct < 0.1
    [record] = [r for r in caplog.records if "distinct texts" in r.message]
    assert str(result.checkpoint) in record.message and "sft.lr (now 1e-05)" in record.message
