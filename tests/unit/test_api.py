"""The public API (rlt2t.api, re-exported lazily by `rlt2t`): what `import rlt2t` costs, every public name and its
docstring, loading configs from files, override strings and dicts, the reward given to `train`, functions that
travel to the workers by value, and the command line as a layer over the same functions."""

from __future__ import annotations

import importlib
import inspect
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import rlt2t
from rlt2t import api
from rlt2t.common.config import ConfigError, MetricTerm, PythonTerm, load_config

REPO = Path(__file__).resolve().parents[2]


def test_import_rlt2t_loads_neither_torch_nor_ray_nor_the_config():
    code = ("import sys, rlt2t; print(sorted(m for m in ('torch', 'ray', 'transformers', 'pydantic', 'numpy', "
            "'rlt2t.api') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_copy_of_the_checkout_imported_from_its_root_runs_its_own_subpackages(tmp_path):
    """What `ray job submit --working-dir .` unpacks on a node, or a second clone as the working directory: the
    copy's `rlt2t/` comes first on sys.path, and its subpackages must come from the copy too, not from the
    editable install's checkout (which the finder would map them to)."""
    folders = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    for name in folders:  # what pyproject maps into the package, as the upload carries it
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    modules = ("rlt2t.cmd_common", "rlt2t.common.synth", "rlt2t.learner", "rlt2t.actors", "rlt2t.services",
               "rlt2t.configs")  # light ones: which copy, not what they do
    code = f"import importlib; print('\\n'.join(importlib.import_module(m).__file__ for m in {modules!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True)
    files = [Path(f).resolve() for f in out.stdout.split()]
    assert len(files) == len(modules) and all(f.is_relative_to(tmp_path.resolve()) for f in files), out.stdout
    # from anywhere else, the installed checkout, whole
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path.parent,
                         check=True)
    assert all(not Path(f).resolve().is_relative_to(tmp_path.resolve()) for f in out.stdout.split()), out.stdout


def test_every_public_name_resolves_and_documents_itself_with_an_example():
    assert sorted(rlt2t.__all__) == sorted(rlt2t._HOMES) and set(api.__all__) <= set(rlt2t.__all__)
    for name in rlt2t.__all__:
        obj = getattr(rlt2t, name)
        doc = inspect.getdoc(obj) or ""
        assert doc, f"rlt2t.{name} has no docstring"
        if name in api.__all__:
            assert f"rlt2t.{name}(" in doc, f"rlt2t.{name}'s docstring has no example calling it"
            assert obj is getattr(api, name)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        rlt2t.nope  # noqa: B018


def test_no_submodule_shadows_a_public_name():
    """Importing ``rlt2t.<x>`` sets the package's attribute ``x`` to the module: a module named like a public
    function (a ``train.py`` beside ``rlt2t.train``) would replace the function once anything imported it."""
    modules = {p.stem for p in Path(rlt2t.__file__).parent.glob("*.py")}
    assert not modules & set(rlt2t.__all__)
    importlib.import_module("rlt2t.driver")  # the RL job's module, imported as the jobs import it
    assert rlt2t.train is api.train
    with pytest.raises(ConfigError, match=r"reward.terms\[0\] \(python:no_module_xyz:f\)"):
        rlt2t.train(load_config(), reward="no_module_xyz:f")


def test_load_config_takes_files_override_strings_and_dicts(tmp_path):
    extra = tmp_path / "extra.yaml"
    extra.write_text("sft:\n  lr: 0.5\n")
    expected = load_config(["tiny", extra], ["run.dir=runs/x", "rl.algorithm=grpo", "rl.learner_resources.g=1",
                                             "reward.named={}", "data.on_error=skip"])
    by_strings = api.load_config("tiny", extra, overrides=["run.dir=runs/x", "rl.algorithm=grpo",
                                                           "rl.learner_resources.g=1", "reward.named={}",
                                                           "data.on_error=skip"])
    by_dict = api.load_config("tiny", str(extra), overrides={"run": {"dir": "runs/x"}, "rl.algorithm": "grpo",
                                                             "rl": {"learner_resources": {"g": 1}},
                                                             "reward.named": {}, "data.on_error": "skip"})
    assert by_strings == expected and by_dict == expected and expected.sft.lr == 0.5
    with pytest.raises(ConfigError, match=r"sft.lr: .*greater than 0"):
        api.load_config(overrides={"sft": {"lr": -1}})
    with pytest.raises(ConfigError, match="sft.nope: unknown key"):
        api.load_config(overrides={"sft.nope": 1})
    with pytest.raises(TypeError, match="not one string"):
        api.load_config(overrides="sft.lr=1")  # type: ignore[arg-type]


def test_synth_data_keeps_the_same_task_and_refuses_to_replace_another_unless_forced(tmp_path):
    cfg = api.load_config("tiny", overrides={"run.dir": str(tmp_path), "synth.size": 60})
    files = api.synth_data(cfg)
    before = files["train"].read_bytes()
    mtime = files["train"].stat().st_mtime_ns
    assert api.synth_data(cfg) == files and files["train"].stat().st_mtime_ns == mtime  # the same task: kept
    again = api.load_config("tiny", overrides={"run.dir": str(tmp_path), "synth.size": 40})
    with pytest.raises(FileExistsError, match=r"train.jsonl.*force=True in Python, to replace them"):
        api.synth_data(again)  # as `rlt2t data synth` refuses without --force: a trained run's data stays
    assert files["train"].read_bytes() == before
    assert api.synth_data(again, force=True)["train"].read_bytes() != before


def test_import_data_splits_a_file_where_the_stages_read_it_with_the_same_settings(tmp_path):
    from rlt2t.jobs import load_split

    csv = tmp_path / "pairs.csv"
    csv.write_text("question,answer\n" + "".join(f"{i} {i + 1},{i + 2}\n" for i in range(40)))
    cfg = api.load_config("tiny", overrides={"run.dir": str(tmp_path / "run"), "data.source_field": "question",
                                             "data.target_field": "answer"})
    files = api.import_data(cfg, csv, valid_fraction=0.1, test_fraction=0.1)
    assert files == {split: tmp_path / "run" / "data" / f"{split}.jsonl" for split in ("train", "valid", "test")}
    rows = {split: load_split(cfg, split) for split in files}
    assert [len(r) for r in rows.values()] == [32, 4, 4]
    assert sorted(e.source for r in rows.values() for e in r) == sorted(f"{i} {i + 1}" for i in range(40))
    with pytest.raises(FileExistsError, match=r"already holds .*test.jsonl \(pass --force, force=True in Python"):
        api.import_data(cfg, csv)
    assert api.import_data(cfg, csv, unlabeled=True, force=True) == {"test": files["test"]}
    assert all(e.target is None for e in load_split(cfg, "test", require_target=False))


def test_train_takes_functions_terms_and_paths_as_the_reward(monkeypatch):
    import rlt2t.jobs

    seen = []
    monkeypatch.setattr(rlt2t.jobs, "rl_job", lambda cfg, resume, init: seen.append((cfg, resume, init)) or "done")

    def mine(sources, candidates, references):
        return [0.0] * len(candidates)

    cfg = load_config()
    assert api.train(cfg, reward=[mine, MetricTerm(name="bleu4", weight=0.5), "math:hypot"], init="x") == "done"
    terms = seen[0][0].reward.terms
    assert [type(t).__name__ for t in terms] == ["PythonTerm", "MetricTerm", "PythonTerm"]
    assert terms[0].fn is mine and terms[1].weight == 0.5 and terms[2].fn == "math:hypot"
    assert seen[0][1:] == (False, "x") and cfg.reward.terms == [MetricTerm()]  # the caller's config is untouched
    api.train(cfg, reward=PythonTerm(fn=mine, per_sample=True))
    assert seen[1][0].reward.terms[0].per_sample
    with pytest.raises(ValueError, match="at least one"):
        api.train(cfg, reward=[])
    with pytest.raises(ValueError, match="reward.source=http .* would ignore this reward"):
        api.train(load_config(overrides=["reward.source=http", "reward.url=http://x"]), reward=mine)
    with pytest.raises(ConfigError, match=r"reward.terms\[1\] \(python:no_module_xyz:f\)"):
        api.train(cfg, reward=[mine, "no_module_xyz:f"])  # preflight: before any checkpoint or Ray
    assert len(seen) == 2


def test_a_script_sees_the_jobs_progress_unless_it_configured_logging(monkeypatch, capsys):
    import logging

    import rlt2t.jobs

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # a plain script: nothing configured (pytest's handlers aside)
    monkeypatch.setattr(root, "level", logging.WARNING)
    monkeypatch.setattr(rlt2t.jobs, "sft_job", lambda cfg, resume, init: logging.getLogger("rlt2t.sft").info(
        "sft epoch 1: valid_loss 0.5"))
    api.sft(load_config())
    assert "INFO rlt2t.sft: sft epoch 1: valid_loss 0.5" in capsys.readouterr().err
    mine = logging.StreamHandler()
    monkeypatch.setattr(root, "handlers", [mine])  # the program's own set-up is left alone
    api.sft(load_config())
    assert root.handlers == [mine]


def test_a_function_of_a_module_the_workers_cannot_import_travels_by_value(tmp_path):
    """A module found on a path of this process only (not installed, not __main__) is pickled by value, so an
    interpreter without that path (a Ray worker elsewhere) can call its functions."""
    (tmp_path / "local_rewards_xyz.py").write_text(textwrap.dedent("""
        SCALE = 3.0

        def scaled(sources, candidates, references):
            return [SCALE * len(c) for c in candidates]
    """))
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, sys.argv[1])
        from ray import cloudpickle
        from local_rewards_xyz import scaled
        from rlt2t.api import _pickle_by_value_unless_installed
        import json
        _pickle_by_value_unless_installed(json.dumps)  # the standard library stays by reference
        _pickle_by_value_unless_installed(scaled)
        sys.stdout.buffer.write(cloudpickle.dumps(scaled))
    """)
    shipped = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, timeout=120)
    assert shipped.returncode == 0, shipped.stderr.decode()[-3000:]
    load = "import pickle, sys; print(pickle.loads(sys.stdin.buffer.read())(['s'], ['abcd'], [[]]))"
    out = subprocess.run([sys.executable, "-c", load], input=shipped.stdout, capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    assert out.stdout.decode().strip() == "[12.0]"


# --- the command line is a layer over the API --------------------------------------------------------------

class _Result:
    steps, items_used, redispatched, checkpoint, seconds, curves_png = 3, 8, 0, Path("ck"), 1.0, None
    ids, mean_candidates, rerank, csv_path, jsonl_path, metrics = ["a"], 2.0, "reward", Path("p.csv"), Path("p"), None
    seconds_per_source = {"generate": 0.25, "score": 0.125, "rerank": 0.0625, "total": 0.4375}


@pytest.mark.parametrize(("argv", "function", "args", "kwargs"), [
    (["pretrain", "--init", "m"], "pretrain", (), {"resume": False, "init": "m"}),
    (["sft", "--resume"], "sft", (), {"resume": True, "init": None}),
    (["train", "--init", "m"], "train", (), {"resume": False, "init": "m"}),
    (["demo", "--no-predict"], "demo", (), {"fresh": False, "predict": False}),
    (["export", "--checkpoint", "c", "--quantization", "float32"], "export", ("c", None),
     {"quantization": "float32", "force": False}),
    (["predict", "--generators", "g1,g2", "--scorers", "s", "--input", "i.jsonl", "--out", "o.csv", "--rerank",
      "reward"], "predict", (["g1", "g2"], ["s"], "i.jsonl", "o.csv"), {"rerank": "reward"}),
    (["predict", "--generators", "g", "--scorers", "s", "--input", "i.jsonl", "--out", "o.csv", "--rerank", "mbr"],
     "predict", (["g"], ["s"], "i.jsonl", "o.csv"), {"rerank": "mbr"}),
    (["eval", "--checkpoint", "sft", "--metrics", "bleu4"], "evaluate", (["sft"],),
     {"split": None, "metrics": "bleu4", "rerank": None}),
    (["eval", "--checkpoint", "sft", "--rerank", "mbr"], "evaluate", (["sft"],),
     {"split": None, "metrics": None, "rerank": "mbr"}),
    (["tokenizer", "build"], "build_tokenizer", (), {"force": False}),
    (["tokenizer", "build", "--force"], "build_tokenizer", (), {"force": True}),
])
def test_each_stage_command_calls_the_api_function_of_its_stage(argv, function, args, kwargs, cli, monkeypatch,
                                                                 tmp_path):
    calls = []

    def fake(cfg, *a, **kw):
        calls.append((cfg, a, kw))
        if function == "evaluate":
            from rlt2t.eval_table import EvalTable

            return EvalTable("t", "test", ["bleu4"], {"sft": {"bleu4": 0.5}})
        return tmp_path / "out" if function in ("export", "build_tokenizer") else _Result()

    monkeypatch.setattr(api, function, fake)
    code, out, err = cli(*argv, f"run.dir={tmp_path / 'run'}", "sft.lr=0.25")
    assert code == 0, err
    assert len(calls) == 1
    cfg, a, kw = calls[0]
    assert (cfg.run.dir, cfg.sft.lr) == (str(tmp_path / "run"), 0.25) and a == args and kw == kwargs
