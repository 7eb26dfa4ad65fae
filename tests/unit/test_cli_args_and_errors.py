"""The `rlt2t` command line's arguments and error policy (rlt2t.cli.main): overrides after an option of many
values, one-line errors instead of tracebacks, exit codes; and export's default directory."""

from __future__ import annotations

import io
import json
import sys
import types
from pathlib import Path

import pytest

from rlt2t.cli import main
from rlt2t.common.config import load_config

# --- overrides after an option of many values -------------------------------------------------------------

def test_overrides_after_data_validate_files_are_overrides(tmp_path, capsys, cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "t.jsonl"
    data.write_text(json.dumps({"id": "1", "source": "5 6", "target": "7"}) + "\n")
    code, out, err = cli("data", "validate", "--files", str(data), "run.dir=X", "data.on_error=skip")
    assert code == 0, err
    assert out.splitlines() == ["(no tokenizer at X/tokenizer, and no model.path holding one: token checks and "
                                "lengths skipped; `rlt2t tokenizer build` first, or give model.path)",
                                f"{data}: 1 examples"]
    # a file whose name looks like an override stays a file
    (tmp_path / "a.b=c").write_text(data.read_text())
    code, out, err = cli("data", "validate", "--files", str(data), "a.b=c", "run.dir=X")
    assert code == 0 and "a.b=c: 1 examples" in out and "X/tokenizer" in out, err
    # nothing left for the option itself
    with pytest.raises(SystemExit) as exit_:
        main(["data", "validate", "--files", "run.dir=X"])
    assert exit_.value.code == 2 and "--files: expected at least one value" in capsys.readouterr().err


def test_a_pretrained_directorys_own_tokenizer_checks_the_data_before_sft_as_before_rl(tmp_path, cli, family_dirs):
    """model.path with its own tokenizer and no `rlt2t tokenizer build`: `data validate` and every stage's data
    loading check the texts with that tokenizer (SFT used to skip the checks RL then failed on)."""
    from rlt2t.jobs import load_split

    data = tmp_path / "train.jsonl"
    rows = [{"id": "1", "source": "hello world", "target": "a cat"},
            {"id": "2", "source": "hello there", "target": "a cat </s> sat"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t5 = family_dirs["t5"]  # a sentencepiece tokenizer of its own, as a downloaded Flan-T5's
    over = [f"run.dir={tmp_path / 'run'}", f"model.path={t5}"]
    code, out, err = cli("data", "validate", "--files", str(data), *over)
    assert out.splitlines()[0] == f"(tokens of the tokenizer at {t5})"
    assert code != 0 and f"{data}:2: field 'target': special token '</s>' is not allowed" in err, out + err
    with pytest.raises(ValueError, match=r"train.jsonl:2: field 'target': special token '</s>' is not allowed in "
                                         r"a text$"):  # no `<sep>` to offer: the pretrained vocabulary has none
        load_split(load_config([], [*over, f"data.train={data}"]), "train")  # what `rlt2t sft` loads


def test_reward_model_training_on_files_without_a_preference_names_them(tmp_path, cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.tsv").write_text("")
    (tmp_path / "ties.jsonl").write_text('{"source": "1 2", "candidate": "3", "rating": 2}\n'
                                         '{"source": "1 2", "candidate": "4", "rating": 2}\n')
    code, _, err = cli("reward-model", "train", "--rank-lists", "empty.tsv", "--ratings", "ties.jsonl", "run.dir=X")
    assert code != 0 and "no preference pairs in empty.tsv, ties.jsonl (empty files, or every source's" in err, err
    code, _, err = cli("reward-model", "train", "run.dir=X")
    assert code != 0 and "no preferences; give reward_model.rank_lists" in err


def test_overrides_after_reward_model_rank_lists_are_overrides(tmp_path, cli, monkeypatch):
    import rlt2t.common.checkpoint as checkpoint
    import rlt2t.reward_jobs as reward_jobs

    seen = {}

    def job(cfg, resume):
        seen["cfg"] = cfg
        return types.SimpleNamespace(steps=1, checkpoint=tmp_path)

    monkeypatch.setattr(reward_jobs, "reward_model_job", job)
    monkeypatch.setattr(checkpoint, "complete_checkpoint", lambda path: types.SimpleNamespace(meta={}))
    code, _, err = cli("reward-model", "train", "--rank-lists", "rl.tsv", "run.dir=X",
                        "reward_model.epochs=3")
    assert code == 0, err
    cfg = seen["cfg"]
    assert cfg.run.dir == "X" and cfg.reward_model.epochs == 3 and cfg.reward_model.rank_lists == ["rl.tsv"]


# --- one-line errors --------------------------------------------------------------------------------------

def test_an_os_error_is_one_line_naming_the_file(tmp_path, cli):
    missing = tmp_path / "missing.jsonl"
    code, _, err = cli("data", "validate", "--files", str(missing))
    assert code == 2 and err == f"rlt2t data: error: {missing}: No such file or directory\n"


def test_a_server_that_is_down_is_one_line_not_a_traceback(cli, monkeypatch, tmp_path):
    from rlt2t import api
    from rlt2t.services.client import Unavailable

    def down(cfg, **kwargs):
        raise Unavailable("POST http://127.0.0.1:8999/v1/candidates: Connection refused (after 3 retries)")

    monkeypatch.setattr(api, "sft", down)  # as `annotate load` meets a policy server that is not running
    code, _, err = cli("sft", f"run.dir={tmp_path}")
    assert code == 1 and err == ("rlt2t sft: error: POST http://127.0.0.1:8999/v1/candidates: Connection refused "
                                 "(after 3 retries)\nnothing answers at that address: is the server running (`rlt2t "
                                 "serve policy` / `rlt2t serve reward`), and is the URL right?\nthe newest complete "
                                 "checkpoint is kept: rerun with --resume\n")
    monkeypatch.setattr(api, "sft", lambda cfg, **kw: (_ for _ in ()).throw(Unavailable("busy", status=503)))
    code, _, err = cli("sft", f"run.dir={tmp_path}")  # a server that answers 503 is there: no such hint
    assert code == 1 and "nothing answers" not in err and err.startswith("rlt2t sft: error: busy\n")
    monkeypatch.setattr(api, "sft", lambda cfg, **kw: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # a bug is still a traceback
        cli("sft", f"run.dir={tmp_path}")


def test_a_closed_pipe_ends_quietly(capsys, monkeypatch):
    # `rlt2t config --explain | head -5`
    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    code = main(["config", "--explain"])
    monkeypatch.undo()
    assert code == 141 and capsys.readouterr().err == ""


def test_an_unreachable_annotation_database_is_named_with_its_password_hidden(cli):
    code, _, err = cli("annotate", "agreement", "annotate.database_url=postgresql://u:secret@127.0.0.1:1/db")
    assert code == 2 and err.startswith("rlt2t annotate: error: annotate.database_url: cannot open "
                                        "postgresql+psycopg://u:***@127.0.0.1:1/db: ")
    assert "secret" not in err and len(err.strip().splitlines()) == 1


def test_deploy_config_errors_exit_2_like_every_command(cli):
    code, _, err = cli("deploy", "serve-start", "no_such.key=1")
    assert code == 2 and err.startswith("rlt2t deploy serve-start: error: ")


# --- export's default directory ---------------------------------------------------------------------------

def test_export_defaults_to_a_directory_per_stage_and_checkpoint(tmp_path, monkeypatch):
    # Both stages name their checkpoints epoch-0001: the RL export went over the SFT one.
    import rlt2t.common.ct2 as ct2
    import rlt2t.ensemble as predict
    from rlt2t.jobs import export_job

    written = []
    monkeypatch.setattr(ct2, "export_ct2", lambda model_dir, out, *a, **k: written.append(Path(out)))
    monkeypatch.setattr(predict, "save_idf_beside", lambda cfg, out: None)
    cfg = load_config(["tiny"], [f"run.dir={tmp_path}"])
    for stage in ("sft", "rl"):
        ckpt = tmp_path / stage / "checkpoints" / "epoch-0001"
        ckpt.mkdir(parents=True)
        (ckpt / "config.json").write_text("{}")
        export_job(cfg, ckpt)
    assert written == [tmp_path / "export" / "sft-epoch-0001", tmp_path / "export" / "rl-epoch-0001"]
    model = tmp_path / "models" / "mine"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    export_job(cfg, model)
    assert written[-1] == tmp_path / "export" / "mine"


def test_modules_beside_where_rlt2t_runs_import_as_under_python_m(tmp_path, cli, monkeypatch):
    # The installed console script's path starts at its bin/ directory, not the current one: a reward term's
    # `my_reward_here:fn` or `reward.plugins` beside the user's config must still import (docs/guides/rewards.md).
    import importlib

    (tmp_path / "my_reward_here.py").write_text("def brevity(sources, candidates, references):\n    return [0.0]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("my_reward_here")
    code, _, err = cli("config", "--config", "tiny")
    assert code == 0, err
    assert sys.path[-1] == str(tmp_path)  # appended: an installed package of the same name still comes first
    assert importlib.import_module("my_reward_here").brevity([], [], []) == [0.0]
    sys.modules.pop("my_reward_here")


def test_the_terminal_loop_on_a_run_without_items_says_how_to_load_some(tmp_path, cli):
    from rlt2t.services.annotation.store import Store

    code, out, err = cli("annotate", "terminal", "--annotator", "tom", f"run.dir={tmp_path}")
    assert code == 2 and "no items to rate in this run's annotation database yet: load some with `rlt2t annotate " \
        "load --candidates FILE`" in err, out + err
    store = Store.open(f"sqlite:///{tmp_path}/annotate/annotations.db")
    try:
        assert store.annotator_by_name("tom") is None  # no token handed out for an empty queue
    finally:
        store.close()
