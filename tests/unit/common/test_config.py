from __future__ import annotations

from pathlib import Path

import pytest

from rlt2t.common.config import Config, ConfigError, explain, load_config


def test_defaults_are_the_demo_and_validate():
    cfg = load_config()
    assert cfg.model.preset == "small" and cfg.tokenizer.kind == "ids" and cfg.run.device == "auto"
    assert cfg == Config()


def test_yaml_then_overrides_later_wins(tmp_path):
    a = tmp_path / "a.yaml"
    a.write_text("sft:\n  lr: 0.01\n  epochs: 2\nrun:\n  dir: x\n")
    b = tmp_path / "b.yaml"
    b.write_text("sft:\n  epochs: 5\n")
    cfg = load_config([a, b], ["sft.lr=3e-4", "run.seed=9", "model.path=null", "sft.enabled=false"])
    assert cfg.sft.lr == 3e-4 and cfg.sft.epochs == 5 and cfg.run.dir == "x" and cfg.run.seed == 9
    assert cfg.sft.enabled is False and cfg.model.path is None


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("sft.lr=-1", "sft.lr"),
        ("sft.nope=1", "sft.nope: unknown key"),
        ("nope.x=1", "nope: unknown key"),
        ("sft.epochs=abc", "sft.epochs"),
        ("pretrain.noise_density=1.5", "pretrain.noise_density"),
        ("data.max_target_len=1000", "data.max_target_len=1000 exceeds the 256 positions"),
        ("tokenizer.kind=words", "tokenizer.kind"),
        ("sft", "expected key.path=value"),
        ("sft.lr.x=1", "sft.lr"),
    ],
)
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert needle in str(err.value)


def test_length_check_skipped_for_pretrained_path():
    # A pretrained directory's positions are only known when it is loaded (checked there).
    cfg = load_config(overrides=["model.path=/some/dir", "data.max_source_len=1000"])
    assert cfg.data.max_source_len == 1000


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config([tmp_path / "missing.yaml"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config([bad])


def test_run_paths_expand():
    cfg = load_config(overrides=["run.dir=/r"])
    assert str(cfg.path(cfg.data.train)) == "/r/data/train.jsonl"
    assert str(cfg.tokenizer_dir) == "/r/tokenizer"


def test_explain_documents_every_leaf():
    lines = explain()
    assert any(line.startswith("sft.rdrop_alpha = 0.0  # R-drop") for line in lines)
    assert all("#  " not in line and line.split("# ", 1)[1] for line in lines), "every key needs a docstring"


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[3] / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    load_config([path])
