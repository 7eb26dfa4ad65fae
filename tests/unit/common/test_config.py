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
        ("rl.kl.target=0", "rl.kl.target"),
        ("rl.chunk_size=24", "rl.chunk_size=24 must divide rl.batch_size=16"),
        ("run.dir=", "run.dir"),  # e.g. an unset $RUN_DIR: `--fresh` would delete the working directory
        ("run.dir=.", "run.dir='.' resolves to"),
        ("run.dir=/", "run.dir='/' resolves to /, the filesystem root: the run needs a directory of its own"),
        ("run.dir=//", "the filesystem root"),
        ("run.dir=..", "the current directory or a parent of it"),
        ("run.dir=runs/..", "the current directory: the run needs a directory of its own"),
        ("rl.kl.coef=0 rl.kl.target=6", "rl.kl.target: the adaptive controller scales β and cannot move it off"),
        ("metric.monitor=reward reward.source=http reward.url=http://127.0.0.1:1",
         "metric.monitor=reward scores reward.terms in the job, and with reward.source=http the reward is the "
         "server's: name a metric instead"),
        ("metric.monitor=", "metric.monitor"),
    ],
)
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=override.split(" "))
    assert needle in str(err.value)


def test_every_problem_is_named_once_with_the_nearest_known_key():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["sft.lr=true", "rl.epoch=2", "data.source_feild=doc", "sfft.lr=1", "rl.algorithm=gpro",
                               "rl.grpo.beta=1", "sft.learning_rate=1", "rank.epochs=2"])
    lines = str(err.value).splitlines()[1:]
    assert {line.strip() for line in lines[:2]} == {"sft.lr: expected a number, got true",
                                                    "rank.epochs: moved to rl.epochs"}
    rest = "\n".join(lines[2:])
    assert "rl.epoch: unknown key (did you mean rl.epochs?)" in rest
    assert "data.source_feild: unknown key (did you mean data.source_field?)" in rest
    assert "sfft: unknown key (did you mean sft?)" in rest
    assert "rl.grpo: unknown key (the grpo algorithm has no rl.grpo section of its own)" in rest
    assert "sft.learning_rate: unknown key\n" in rest + "\n"  # nothing near enough to suggest
    assert "rl.algorithm: 'gpro' is neither" in rest and "rl.algorithm: rl.algorithm" not in rest
    assert "rank: unknown key" not in rest  # named once, by its own message above


def test_a_reward_terms_problem_is_named_by_its_index_as_the_config_writes_it():
    """pydantic's location of a term's field holds its kind (reward.terms.0.python.param): the key is written as
    in the YAML, with the nearest field of that kind of term."""
    with pytest.raises(ConfigError) as err:
        load_config(overrides=['reward.terms=[{kind: metric}, {kind: python, fn: "m:f", param: {x: 1}}]',
                               "reward.named={mine: [{kind: metric, nme: bleu4, weight: x}]}"])
    lines = {line.strip() for line in str(err.value).splitlines()[1:]}
    assert lines == {"reward.terms[1].param: unknown key (did you mean reward.terms[1].params?)",
                     "reward.named.mine[0].nme: unknown key (did you mean reward.named.mine[0].name?)",
                     "reward.named.mine[0].weight: Input should be a valid number, unable to parse string as a "
                     "number (got 'x')"}


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
    twice = tmp_path / "twice.yaml"  # YAML keeps the last block: sft.lr and sft.epochs would vanish silently
    twice.write_text("sft:\n  lr: 3.0e-4\n  epochs: 10\nrl:\n  epochs: 3\nsft:\n  rdrop_alpha: 1.0\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: line 6: key 'sft' given twice in one mapping \(first on line"):
        load_config([twice])
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfesft: {}\n")
    with pytest.raises(ConfigError, match=r"binary.yaml: not UTF-8 text"):
        load_config([binary])


def test_numbers_without_a_dot_are_numbers_in_free_form_params(tmp_path):
    """YAML 1.1 reads `1e-2` as a string; typed keys converted it back, but a metric's params (free-form)
    passed the string on, and BLEU-4 failed mid-training at the first n-gram order without a match."""
    path = tmp_path / "c.yaml"
    path.write_text("reward:\n  terms:\n  - {kind: metric, name: bleu4, params: {smooth_method: floor, "
                    "smooth_value: 1e-2}}\n")
    (term,) = load_config([path]).reward.terms
    assert term.params == {"smooth_method": "floor", "smooth_value": 0.01}
    assert load_config(overrides=["sft.lr=2E+0"]).sft.lr == 2.0


def test_run_paths_expand():
    cfg = load_config(overrides=["run.dir=/r"])
    assert str(cfg.path(cfg.data.train)) == "/r/data/train.jsonl"
    assert str(cfg.tokenizer_dir) == "/r/tokenizer"


def test_explain_documents_every_leaf():
    lines = explain()
    at = lines.index("sft.rdrop_alpha = 0.0")
    assert lines[at + 1].startswith("    R-drop")
    # every key line is followed by its (indented) description
    keys = [i for i, line in enumerate(lines) if not line.startswith(" ")]
    assert all(i + 1 < len(lines) and lines[i + 1].startswith("    ") for i in keys), "every key needs a docstring"


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[3] / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    load_config([path])


def test_explain_gives_every_key_its_real_default_and_whole_description():
    from pydantic import BaseModel

    from rlt2t.common.config import Config, explain

    def keys(model, prefix=""):
        for name, field in model.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                yield from keys(field.annotation, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}", field.description

    lines = explain()
    text = "\n".join(lines)
    assert "PydanticUndefined" not in text
    for key, description in keys(Config):
        assert description, f"{key} has no description"
        # A description is a sentence: it ends with a full stop (or a closing parenthesis after one).
        assert description.rstrip().endswith((".", ")")), f"{key}: {description!r}"
        assert any(line.startswith(f"{key} = ") for line in lines), key
    assert "rl.learner_resources = {}" in lines and "rollout.urls = []" in lines
    # the whole description is printed, wrapped: its last word appears, indented
    tokenizer_kind = lines[lines.index("tokenizer.kind = 'ids'") + 1 :]
    assert any("`path`)." in line for line in tokenizer_kind[:4])


def test_policy_gradient_samples_follow_a_shorter_target_limit_unless_set_explicitly():
    cfg = load_config(overrides=["data.max_target_len=24"])
    assert cfg.rl.algorithm == "grpo" and cfg.rollout.max_new_tokens == 24  # the default 64 follows the limit
    assert load_config(overrides=["data.max_target_len=24", "rl.algorithm=rank"]).rollout.max_new_tokens == 64
    assert load_config(overrides=["data.max_target_len=24", "rollout.max_new_tokens=16"]).rollout.max_new_tokens == 16
    with pytest.raises(ConfigError, match="rollout.max_new_tokens=48 exceeds data.max_target_len=24"):
        load_config(overrides=["data.max_target_len=24", "rollout.max_new_tokens=48"])


def test_a_retired_rank_key_names_its_new_home():
    from rlt2t.common.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(overrides=["rank.epochs=3", "rank.loss_weight=0.5"])
    assert "rank.epochs: moved to rl.epochs" in str(err.value)
    assert "rank.loss_weight: moved to rl.rank.loss_weight" in str(err.value)
    assert load_config(overrides=["rl.epochs=3", "rl.rank.loss_weight=0.5"]).rl.rank.loss_weight == 0.5


@pytest.mark.parametrize(("batch", "chunk"), [(32, 32), (48, 24), (8, 8), (100, 25), (16, 16)])
def test_an_unset_chunk_size_divides_the_batch(batch, chunk):
    """No rollout chunk straddles two learner steps, so a run resumed at any step cuts the same chunks."""
    assert load_config(overrides=[f"rl.batch_size={batch}"]).rl.chunk_size == chunk


def test_the_defaults_need_no_derived_note():
    """A config of defaults alone logs no "not its default" line (the first thing `make demo` printed was one):
    the default batch's chunk is derived without a note, a batch the user sets gets one."""
    cfg = load_config()
    assert cfg.rl.chunk_size == 16 and cfg.rl.batch_size == 16
    assert cfg.derived == []
    assert load_config(["tiny"]).derived == [] and load_config(overrides=["rl.batch_size=16"]).derived == []
    assert load_config(overrides=["rl.batch_size=48"]).derived == [
        "rl.chunk_size: 24, not its default 32 (the largest divisor of rl.batch_size=48 up to it)"]


def test_run_dir_rule_without_a_home_directory(monkeypatch):
    # No HOME and no passwd entry: Path.home() raises RuntimeError; the config must still load (it is built
    # at import time, in every command and Ray actor), and ~nosuchuser is a literal directory name.
    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert load_config(overrides=["run.dir=runs/x"]).run.dir == "runs/x"
    assert load_config(overrides=["run.dir=~nosuchuser_rlt2t/runs"]).run.dir == "~nosuchuser_rlt2t/runs"


@pytest.mark.parametrize("override, key", [("sft.lr=true", "sft.lr"), ("rollout.top_k=false", "rollout.top_k"),
                                           ("rl.kl.target=yes", "rl.kl.target")])
def test_a_boolean_for_a_number_names_the_key(override, key, tmp_path):
    """pydantic reads true as 1 for a number: `sft.lr=true` trained at lr 1.0 without a word."""
    with pytest.raises(ConfigError, match=rf"{key}: expected a number, got (true|false)"):
        load_config(overrides=[override])
    path = tmp_path / "c.yaml"
    section, _, leaf = key.partition(".")
    path.write_text(f"{section}:\n  {leaf.replace('.', ': {')}: true{'}' * leaf.count('.')}\n")
    with pytest.raises(ConfigError, match=rf"{key}: expected a number, got true"):
        load_config([path])
    assert load_config(overrides=["rollout.include_gold=false"]).rollout.include_gold is False  # booleans still are


def test_eval_length_follows_short_targets_unless_set():
    """eval.max_new_tokens (64 by default) refused any data.max_target_len below 16 with a message about a key
    the user never set; left unset it now follows the targets down, and set explicitly the check names both."""
    cfg = load_config(overrides=["data.max_target_len=12"])
    assert cfg.eval.max_new_tokens == 48 and "max_new_tokens" not in cfg.eval.model_fields_set
    assert load_config(overrides=["data.max_target_len=40"]).eval.max_new_tokens == 64
    with pytest.raises(ConfigError, match=r"eval.max_new_tokens=64 is more than 4x data.max_target_len=12"):
        load_config(overrides=["data.max_target_len=12", "eval.max_new_tokens=64"])


def test_a_value_a_cross_section_rule_derives_is_said_in_the_log_the_dump_and_explain(caplog, monkeypatch):
    import logging

    from rlt2t.common import config
    from rlt2t.common.config import DERIVED_VALUES, config_to_yaml, explain_derived

    monkeypatch.setattr(config.loading, "_logged", set())  # logged once per process: this test's loads must log

    with caplog.at_level(logging.INFO, logger="rlt2t.config"):
        cfg = load_config(overrides=["rl.batch_size=48", "data.max_target_len=20", "metric.bleu_weight=0.5"])
    assert cfg.rl.chunk_size == 24 and cfg.rollout.max_new_tokens == 20 and cfg.reward.bleu_weight == 0.5
    assert any(line.startswith("rl.chunk_size: 24, not its default 32") for line in cfg.derived)
    assert any(line.startswith("rollout.max_new_tokens: 20, not its default 64") for line in cfg.derived)
    assert any(line.startswith("reward.bleu_weight: 0.5") for line in cfg.derived)
    logged = [r.getMessage() for r in caplog.records if r.name == "rlt2t.config"]
    assert all(any(line in m for m in logged) for line in cfg.derived), logged
    head = config_to_yaml(cfg).splitlines()[: len(cfg.derived)]
    assert head == [f"# derived: {line}" for line in cfg.derived]
    # a value set explicitly is the user's: no rule, no note
    explicit = load_config(overrides=["rl.batch_size=48", "rl.chunk_size=16", "data.max_target_len=20",
                                      "rollout.max_new_tokens=20"])
    assert not any(line.startswith(("rl.chunk_size", "rollout.max_new_tokens")) for line in explicit.derived)
    text = "\n".join(explain_derived())
    assert all(key in text for key, _ in DERIVED_VALUES)


@pytest.mark.parametrize(("overrides", "runs"), [
    ([], False), (["rl.learner_gpus=1"], True), (["rl.preflight=true"], True),
    (["rl.learner_gpus=1", "rl.preflight=false"], False),
])
def test_the_learner_preflight_runs_for_gpu_ranks_unless_set(overrides, runs):
    assert load_config(overrides=overrides).rl.runs_preflight is runs



def test_a_section_of_another_algorithm_is_reported_as_unused():
    """`rl.dpo.rank_lists` with `rl.algorithm=grpo` trains on the default reward: the RL job warns, naming it."""
    cfg = load_config(overrides=["rl.algorithm=grpo", "rl.dpo.rank_lists=[ranks.tsv]", "rl.pg.clip_eps=0.1"])
    assert cfg.rl.unused_sections == ["dpo"]  # rl.pg is shared by the policy gradients, not one algorithm's
    assert load_config(overrides=["rl.algorithm=dpo", "rl.dpo.rank_lists=[ranks.tsv]"]).rl.unused_sections == []
