"""Commands that delete or replace files refuse what is not theirs: `demo --fresh` (clean_run), `average --out`,
`predict --out` and `data import-csv`."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

import rlt2t.jobs as jobs
from rlt2t.common.config import load_config
from rlt2t.common.convert import average_checkpoints
from rlt2t.jobs import clean_run

DEMO_OUTPUTS = ("config", "data", "tokenizer", "pretrain", "sft", "rl", "eval", "logs", "export", "predict")


def _cfg(run_dir: str | Path):
    return load_config(["tiny"], [f"run.dir={run_dir}"])


# --- demo --fresh -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("run_dir", ["..", "../..", "{cwd}", "{cwd}/sub/..", "./sub/.."])
def test_fresh_refuses_the_current_directory_and_its_parents(tmp_path, monkeypatch, run_dir):
    cwd = tmp_path / "work" / "repo"
    cwd.mkdir(parents=True)
    (cwd / "precious.txt").write_text("keep")
    monkeypatch.chdir(cwd)
    with pytest.raises(ValueError, match=r"run\.dir=.*current directory"):
        clean_run(_cfg(run_dir.format(cwd=cwd)))
    assert (cwd / "precious.txt").read_text() == "keep"


def test_fresh_refuses_the_home_directory_and_its_parents(tmp_path, monkeypatch):
    home = tmp_path / "home" / "me"
    home.mkdir(parents=True)
    (home / "notes.txt").write_text("keep")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path.parent)  # not the cwd check that refuses
    for run_dir in (f"{home}/sub/..", home.parent):  # home itself: the config refuses it already
        with pytest.raises(ValueError, match="home directory"):
            clean_run(_cfg(run_dir))
    assert (home / "notes.txt").exists()


def test_fresh_checks_again_where_it_deletes(tmp_path, monkeypatch):
    # The config is checked where it was loaded; a process that has since moved into run.dir is refused too.
    run = tmp_path / "run"
    (run / "sft").mkdir(parents=True)
    cfg = _cfg(run)
    monkeypatch.chdir(run)
    with pytest.raises(ValueError, match=r"the current directory: --fresh deletes"):
        clean_run(cfg)
    assert (run / "sft").is_dir()


def test_fresh_deletes_only_the_demo_outputs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "demo"
    for name in DEMO_OUTPUTS:
        if name != "data":
            (run / name).mkdir(parents=True)
            (run / name / "f").write_text("old")
    shared = tmp_path / "shared-data"
    shared.mkdir()
    (shared / "train.jsonl").write_text("{}")
    (shared / "synth_meta.json").write_text("{}")
    (run / "data").symlink_to(shared)  # a linked data dir of the demo's task: the link goes, never its target
    (run / "annotate").mkdir()
    (run / "annotate" / "annotations.db").write_text("human work")
    (run / "notes.md").write_text("mine")
    (run / ".tmp-tokenizer-123").mkdir()  # a killed atomic write's leftovers
    (run / ".old-export-456").mkdir()
    (run / jobs.DEMO_MARKER).write_text("")  # the demo created this run.dir

    clean_run(_cfg("runs/demo"))
    assert sorted(p.name for p in run.iterdir()) == [jobs.DEMO_MARKER, "annotate", "notes.md"]
    assert (shared / "train.jsonl").exists()
    clean_run(_cfg(tmp_path / "missing"))  # nothing there: nothing to do


def test_fresh_keeps_data_the_demo_did_not_write(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "exp1"
    (run / "data").mkdir(parents=True)
    (run / "data" / "train.jsonl").write_text('{"id": "1", "source": "a", "target": "b"}\n')  # import-csv's
    jobs.mark_demo_run(_cfg("runs/exp1"))  # the demo starting on imported data: its outputs follow
    assert (run / jobs.DEMO_MARKER).is_file()
    (run / "sft").mkdir()
    clean_run(_cfg("runs/exp1"))
    assert (run / "data" / "train.jsonl").exists() and not (run / "sft").exists()
    (run / "data" / "synth_meta.json").write_text("{}")  # the demo's synthetic task: regenerated, so it goes
    clean_run(_cfg("runs/exp1"))
    assert not (run / "data").exists()


def test_fresh_deletes_nothing_in_a_run_dir_the_demo_did_not_create(tmp_path, monkeypatch, cli):
    # Only data/ was checked for the demo's mark: config/, logs/, export/ ... of any run.dir were deleted.
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "p"
    for name in ("config", "logs", "export", "src"):
        (run / name).mkdir(parents=True)
    (run / "config" / "settings.yaml").write_text("keep")
    monkeypatch.setattr(jobs, "prepare_sft", lambda cfg: pytest.fail("a stage ran"))
    code, _, err = cli("demo", "--fresh", "--config", "tiny", "run.dir=p")
    assert code == 2 and err.startswith(f"rlt2t demo: error: --fresh: {run} holds config, export, logs but not the "
                                        f"demo's marker {jobs.DEMO_MARKER}")
    assert "nothing was deleted" in err and "run.dir=runs/demo" in err
    assert (run / "config" / "settings.yaml").read_text() == "keep" and (run / "logs").is_dir()
    # the demo does not claim it either: its stages would start beside files it did not write
    jobs.mark_demo_run(_cfg("p"))
    assert not (run / jobs.DEMO_MARKER).exists()

    # a run.dir without any of the demo's entries has nothing to delete: --fresh goes on
    empty = tmp_path / "q"
    (empty / "src").mkdir(parents=True)
    clean_run(_cfg("q"))
    assert (empty / "src").is_dir()


def test_the_demo_marks_the_run_dir_it_starts_in(tmp_path, monkeypatch):
    # prepare_sft (the demo's first stage) marks a new run.dir before it writes there; --fresh then cleans it.
    monkeypatch.chdir(tmp_path)

    def synth(cfg):
        (cfg.run_dir / "data").mkdir(parents=True)
        (cfg.run_dir / "data" / "synth_meta.json").write_text("{}")

    monkeypatch.setattr(jobs, "make_synthetic_data", synth)
    monkeypatch.setattr(jobs, "build_tokenizer_job", lambda cfg: (cfg.run_dir / "tokenizer").mkdir())
    monkeypatch.setattr(jobs, "pretrain_job", lambda cfg, resume: (cfg.run_dir / "pretrain").mkdir())
    monkeypatch.setattr(jobs, "sft_job", lambda cfg, resume: (cfg.run_dir / "sft").mkdir())
    monkeypatch.setattr(jobs, "best_or_latest", lambda root: root)
    jobs.prepare_sft(_cfg("runs/new"))
    run = tmp_path / "runs" / "new"
    assert (run / jobs.DEMO_MARKER).is_file() and (run / "sft").is_dir()
    (run / "notes.md").write_text("mine")
    clean_run(_cfg("runs/new"))
    assert sorted(p.name for p in run.iterdir()) == [jobs.DEMO_MARKER, "notes.md"]


def test_demo_fresh_with_the_current_directory_exits_2_before_any_stage(tmp_path, monkeypatch, cli):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "precious.txt").write_text("keep")
    monkeypatch.setattr(jobs, "prepare_sft", lambda cfg: pytest.fail("a stage ran"))
    code, _, err = cli("demo", "--fresh", "--config", "tiny", f"run.dir={tmp_path}")
    assert code == 2 and err.startswith("rlt2t demo: error: invalid config")
    assert f"run.dir='{tmp_path}' resolves to" in err and "the current directory" in err
    assert (tmp_path / "precious.txt").exists()


# --- average --out ----------------------------------------------------------------------------------------

@pytest.fixture
def checkpoint_root(tmp_path, tiny_policy) -> Path:
    """A checkpoint root with two model directories (epoch-0001, epoch-0002) of the tiny policy."""
    root = tmp_path / "sft" / "checkpoints"
    for i in (1, 2):
        with torch.no_grad():
            for p in tiny_policy.model.parameters():
                p.fill_(float(i))
        tiny_policy.model.save_pretrained(root / f"epoch-000{i}")
        tiny_policy.tokenizer.save_pretrained(root / f"epoch-000{i}")
    return root


def test_average_refuses_an_out_that_is_contains_or_lies_inside_an_input(checkpoint_root):
    inputs = [checkpoint_root / "epoch-0001", checkpoint_root / "epoch-0002"]
    for out, what in ((inputs[0], "is the input"), (checkpoint_root, "contains the input"),
                      (checkpoint_root.parent, "contains the input"), (inputs[1] / "avg", "is inside the input")):
        with pytest.raises(ValueError, match=f"--out .*{what}"):
            average_checkpoints(inputs, out, force=True)  # --force does not lift it
    assert sorted(p.name for p in checkpoint_root.iterdir()) == ["epoch-0001", "epoch-0002"]
    assert not (inputs[1] / "avg").exists()


def test_average_refuses_an_existing_out_unless_force(checkpoint_root, tmp_path, cli):
    inputs = [str(checkpoint_root / "epoch-0001"), str(checkpoint_root / "epoch-0002")]
    out = tmp_path / "avg"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    code, _, err = cli("average", *inputs, "--out", str(out))
    assert code == 2 and err.startswith("rlt2t average: error: --out") and "--force" in err
    assert (out / "mine.txt").exists()
    code, printed, _ = cli("average", *inputs, "--out", str(out), "--force")
    assert code == 0 and printed.strip() == str(out) and (out / "config.json").is_file()
    assert not (out / "mine.txt").exists()


def test_average_out_inside_the_dir_it_reads_is_refused_even_with_force(checkpoint_root, cli):
    code, _, err = cli("average", "--dir", str(checkpoint_root), "--last", "2",
                        "--out", str(checkpoint_root / "avg"), "--force")
    assert code == 2 and "--out" in err and "is inside" in err
    code, _, err = cli("average", "--dir", str(checkpoint_root), "--out", str(checkpoint_root), "--force")
    assert code == 2 and "--out" in err
    assert sorted(p.name for p in checkpoint_root.iterdir()) == ["epoch-0001", "epoch-0002"]


@pytest.mark.parametrize("last", ["0", "-1"])
def test_average_last_below_one_is_refused(checkpoint_root, tmp_path, cli, monkeypatch, last):
    # --last 0 took every checkpoint (infos[-0:]), a negative count dropped the oldest instead.
    import rlt2t.common.convert as convert

    monkeypatch.setattr(convert, "average_checkpoints", lambda *a, **k: pytest.fail("averaged"))
    code, _, err = cli("average", "--dir", str(checkpoint_root), "--last", last,
                        "--out", str(tmp_path / "avg"))
    assert code == 2 and err.startswith("rlt2t average: error: --last must be >= 1") and f"got {last}" in err
    assert not (tmp_path / "avg").exists()


# --- reward-model score --input ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad, reason", [
    ('{"source": "a b"}', "field 'candidate': missing or not a string"),
    ('["a b", "c"]', "expected a JSON object with `source` and `candidate`, got list"),
    ('"a b"', "expected a JSON object with `source` and `candidate`, got str"),
    ('{"source": "a", ', "not valid JSON"),
])
def test_reward_model_score_names_the_files_own_line(tmp_path, cli, monkeypatch, bad, reason):
    import rlt2t.common.reward_model as reward_model

    model = types.SimpleNamespace(score=lambda sources, candidates, batch_size: [0.5] * len(sources))
    monkeypatch.setattr(reward_model, "load_reward_model", lambda *a, **k: model)
    good = json.dumps({"source": "a b", "candidate": "c"})
    inputs = tmp_path / "in.jsonl"
    inputs.write_text(f"{good}\n\n   \n{good}\n\n{bad}\n{good}\n")  # the bad row is the file's line 6
    code, _, err = cli("reward-model", "score", "--model", str(tmp_path / "rm"), "--input", str(inputs))
    assert code == 2 and f"--input {inputs}:6: {reason}" in err, err
    inputs.write_text(f"{good}\n\n   \n{good}\n")  # blank lines alone are skipped
    code, out, _ = cli("reward-model", "score", "--model", str(tmp_path / "rm"), "--input", str(inputs))
    assert code == 0 and [json.loads(line)["reward"] for line in out.splitlines()] == [0.5, 0.5]


# --- predict --out ----------------------------------------------------------------------------------------

def test_predict_refuses_a_directory_out_before_decoding(tmp_path, cli, monkeypatch):
    import rlt2t.ensemble as predict

    inputs = tmp_path / "in.jsonl"
    inputs.write_text(json.dumps({"id": "1", "source": "1 2 3"}) + "\n")
    monkeypatch.setattr(predict, "resolve_model", lambda *a: pytest.fail("models resolved before --out was checked"))
    code, _, err = cli("predict", "--config", "tiny", "--generators", "g", "--scorers", "s",
                        "--input", str(inputs), "--out", str(tmp_path))
    # (the config's INFO notes may come first on stderr when no earlier test configured logging)
    assert code == 2 and "rlt2t predict: error: --out" in err and "is a directory" in err
    (tmp_path / "file").write_text("")
    code, _, err = cli("predict", "--config", "tiny", "--generators", "g", "--scorers", "s",
                        "--input", str(inputs), "--out", str(tmp_path / "file" / "pred.csv"))
    assert code == 2 and "--out" in err and "is a file" in err


def test_predict_refuses_an_out_or_candidates_file_that_is_the_input_before_decoding(tmp_path, cli, monkeypatch):
    import rlt2t.ensemble as predict

    monkeypatch.setattr(predict, "resolve_model", lambda *a: pytest.fail("models resolved before --out was checked"))
    inputs = tmp_path / "in.jsonl"
    inputs.write_text(json.dumps({"id": "1", "source": "1 2 3"}) + "\n")
    (tmp_path / "link.jsonl").symlink_to(inputs)
    candidates_of_in = tmp_path / "in.candidates.jsonl"
    candidates_of_in.write_text(json.dumps({"id": "1", "source": "1 2 3"}) + "\n")  # --out in.jsonl writes it
    before = {p.name: p.read_bytes() for p in (inputs, candidates_of_in)}
    monkeypatch.chdir(tmp_path)
    for input_, out, what in (
        (inputs, inputs, "is the --input file"),
        (inputs, "./sub/../in.jsonl", "is the --input file"),
        (inputs, tmp_path / "link.jsonl", "is the --input file"),  # a symlink to it
        (candidates_of_in, tmp_path / "in.csv", "the candidates file beside it"),  # in.csv's: in.candidates.jsonl
    ):
        code, _, err = cli("predict", "--config", "tiny", "--generators", "g", "--scorers", "s",
                            "--input", str(input_), "--out", str(out))
        assert code == 2 and "rlt2t predict: error: --out" in err, err
        assert what in err and "--input" in err
    assert {p.name: p.read_bytes() for p in (inputs, candidates_of_in)} == before

    # the check itself: an --out that does not exist yet but resolves to the input; a distinct file passes
    with pytest.raises(ValueError, match="--out .*is the --input file"):
        predict.check_out_path(tmp_path / "new" / ".." / "in.jsonl", inputs)
    predict.check_out_path(tmp_path / "pred.csv", inputs)


# --- data import-csv --------------------------------------------------------------------------------------

def _csv(path: Path, n: int) -> str:
    path.write_text("".join(f"{i},{i} {i + 1} 7,{i + 2},{i % 3}\n" for i in range(n)))
    return str(path)


def test_import_csv_refuses_to_overwrite_and_force_removes_stale_splits(tmp_path, cli):
    out = tmp_path / "data"
    code, _, _ = cli("data", "import-csv", "--input", _csv(tmp_path / "a.csv", 40), "--out", str(out),
                      "--valid-fraction", "0.1", "--test-fraction", "0.1")
    assert code == 0 and {p.name for p in out.glob("*.jsonl")} == {"train.jsonl", "valid.jsonl", "test.jsonl"}
    before = (out / "train.jsonl").read_bytes()

    code, _, err = cli("data", "import-csv", "--input", _csv(tmp_path / "b.csv", 30), "--out", str(out))
    assert code == 2 and err.startswith("rlt2t data: error: --out") and "--force" in err
    assert (out / "train.jsonl").read_bytes() == before

    # --force with no test split: the old test.jsonl (rows now in train) is removed, not left to leak
    code, printed, _ = cli("data", "import-csv", "--input", str(tmp_path / "b.csv"), "--out", str(out),
                            "--valid-fraction", "0.1", "--force")
    assert code == 0 and "test.jsonl removed" in printed
    assert {p.name for p in out.glob("*.jsonl")} == {"train.jsonl", "valid.jsonl"}
    rows = sum(len(p.read_text().splitlines()) for p in out.glob("*.jsonl"))
    assert rows == 30

    # an unlabeled test set beside them owns test.jsonl only
    code, _, _ = cli("data", "import-csv", "--input", _csv(tmp_path / "t.csv", 5), "--out", str(out),
                      "--unlabeled")
    assert code == 0 and {p.name for p in out.glob("*.jsonl")} == {"train.jsonl", "valid.jsonl", "test.jsonl"}


def _unlabeled_csv(path: Path, n: int) -> str:
    path.write_text("".join(f"t{i},{i} {i + 1} 7\n" for i in range(n)))
    return str(path)


def test_a_labeled_reimport_keeps_the_unlabeled_test_set(tmp_path, cli):
    out = tmp_path / "data"
    labeled, unlabeled = _csv(tmp_path / "train.csv", 40), _unlabeled_csv(tmp_path / "test.csv", 5)
    assert cli("data", "import-csv", "--input", labeled, "--out", str(out))[0] == 0
    # an unlabeled file is not split: a fraction with --unlabeled is refused, not ignored
    code, _, err = cli("data", "import-csv", "--input", unlabeled, "--out", str(out), "--unlabeled",
                       "--valid-fraction", "0.1")
    assert code == 2 and "--valid-fraction / --test-fraction: --unlabeled writes its rows to test.jsonl alone" in err
    assert cli("data", "import-csv", "--input", unlabeled, "--out", str(out), "--unlabeled")[0] == 0
    test = (out / "test.jsonl").read_bytes()

    # re-import the labeled file with another --valid-fraction: train/valid replaced, the test set kept
    code, printed, _ = cli("data", "import-csv", "--input", labeled, "--out", str(out),
                            "--valid-fraction", "0.2", "--force")
    assert code == 0 and "removed" not in printed
    assert "test.jsonl kept" in printed and "--unlabeled" in printed
    assert (out / "test.jsonl").read_bytes() == test
    assert len((out / "valid.jsonl").read_text().splitlines()) == 8

    # without --force only train/valid are in the way: the test set is not this import's to replace
    code, _, err = cli("data", "import-csv", "--input", labeled, "--out", str(out))
    assert code == 2 and str(out / "train.jsonl") in err and str(out / "test.jsonl") not in err

    # a labeled import with test rows of its own does replace it (with --force), and says so
    code, printed, _ = cli("data", "import-csv", "--input", labeled, "--out", str(out),
                            "--test-fraction", "0.1", "--force")
    assert code == 0 and "replaced an --unlabeled import's test set" in printed
    assert all("target" in json.loads(line) for line in (out / "test.jsonl").read_text().splitlines())

    # ... and that test.jsonl is then the labeled import's: a later one without test rows removes it
    code, printed, _ = cli("data", "import-csv", "--input", labeled, "--out", str(out), "--force")
    assert code == 0 and "test.jsonl removed" in printed and not (out / "test.jsonl").exists()


def test_a_labeled_import_refuses_a_row_without_a_diagnosis(tmp_path, cli):
    # It became an example without a target, refused much later (by SFT) with a Python argument's name.
    csv = tmp_path / "train.csv"
    csv.write_text("".join(f"{i},{i} {i + 1} 7,{'' if i == 3 else i + 2}\n" for i in range(20)))
    out = tmp_path / "data"
    code, _, err = cli("data", "import-csv", "--input", str(csv), "--out", str(out))
    assert code == 2 and f"{csv}:4: field 'diagnosis': empty" in err and "--unlabeled" in err
    assert not out.exists()
    code, _, _ = cli("data", "import-csv", "--input", str(csv), "--out", str(out), "--valid-fraction", "0",
                      "data.on_error=skip")
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert code == 0 and len(rows) == 19 and "3" not in {r["id"] for r in rows}


def test_an_unlabeled_import_drops_diagnoses_so_a_labeled_reimport_keeps_it(tmp_path, cli):
    # A test CSV imported with --unlabeled that had diagnoses kept them, so it read as labeled: a labeled
    # --force re-import then deleted it as its own stale test split.
    out = tmp_path / "data"
    labeled, test_csv = _csv(tmp_path / "train.csv", 40), _csv(tmp_path / "test.csv", 5)  # test.csv has diagnoses
    assert cli("data", "import-csv", "--input", labeled, "--out", str(out))[0] == 0
    code, printed, _ = cli("data", "import-csv", "--input", test_csv, "--out", str(out), "--unlabeled")
    assert code == 0 and "5 diagnoses left out" in printed
    assert all("target" not in json.loads(line) for line in (out / "test.jsonl").read_text().splitlines())
    test = (out / "test.jsonl").read_bytes()
    code, printed, _ = cli("data", "import-csv", "--input", labeled, "--out", str(out), "--force")
    assert code == 0 and "test.jsonl kept" in printed and (out / "test.jsonl").read_bytes() == test


# --- data synth / wordnet / docstrings --------------------------------------------------------------------

def test_generated_tasks_refuse_to_overwrite_split_files_unless_force(tmp_path, cli, monkeypatch):
    run = tmp_path / "run"
    code, _, _ = cli("data", "synth", f"run.dir={run}", "synth.size=60")
    assert code == 0
    before = (run / "data" / "train.jsonl").read_bytes()
    code, _, err = cli("data", "synth", f"run.dir={run}", "synth.size=80", "synth.seed=5")
    assert code == 2 and f"{run / 'data' / 'train.jsonl'}" in err and "--force" in err
    assert (run / "data" / "train.jsonl").read_bytes() == before
    code, _, _ = cli("data", "synth", f"run.dir={run}", "synth.size=80", "synth.seed=5", "--force")
    assert code == 0 and (run / "data" / "train.jsonl").read_bytes() != before

    # an imported data set is not overwritten by a generated task either (nor made to look like the demo's)
    for name, job in (("wordnet", "make_wordnet_data"), ("docstrings", "make_docstring_data"),
                      ("docstring-names", "make_docstring_names_data")):
        monkeypatch.setattr(jobs, job, lambda *a, **k: pytest.fail("generated over existing files"))
        code, _, err = cli("data", name, f"run.dir={run}")
        assert code == 2 and "already holds" in err and "--force" in err

    # the demo regenerates its own synthetic task without --force (it never comes through the command)
    jobs.make_synthetic_data(_cfg(run))


# --- make clean -------------------------------------------------------------------------------------------

def test_make_clean_keeps_the_users_run_directories():
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("no make")
    repo = Path(__file__).resolve().parents[2]
    recipe = subprocess.run(["make", "-s", "-n", "-C", str(repo), "clean"], capture_output=True, text=True,
                            check=True).stdout.split()
    assert "runs" not in recipe and "runs/" not in recipe and "runs/*" not in recipe, recipe
    assert "runs/demo" in recipe


def test_make_train_submit_after_the_demo_trains_a_new_run_from_the_demos_sft(tmp_path, done_stamp):
    """`make train-submit` (README, Scaling out) right after `make demo`, whose run already has its RL stage: a new
    run (runs/submit) from the demo's best SFT checkpoint on the demo's data; RUN_DIR=… (or a TRAIN_CONFIG of one's
    own) trains as told. The job itself is submitted to a real head in tests/integration/test_job_submit.py."""
    import os
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("no make")
    repo = Path(__file__).resolve().parents[2]
    # nothing from this environment, and a Ray address nothing answers at, should a check fail to stop it
    env = {k: v for k, v in os.environ.items() if k not in ("RUN_DIR", "TRAIN_ARGS", "TRAIN_CONFIG", "SUBMIT_FROM",
                                                             "MAKEFLAGS")} | {"RAY_ADDRESS": "http://127.0.0.1:9"}

    def make(*args: str, dry: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["make", "-s", *(["-n"] if dry else []), "-C", str(repo), "train-submit",
                               done_stamp, *args], capture_output=True, text=True, env=env, timeout=60)

    def job(*args: str) -> list[str]:
        out = make(*args).stdout
        return out[out.index("rlt2t.cli train"):].replace("\\\n", " ").split()

    demo = repo / "runs" / "demo"
    assert job() == ["rlt2t.cli", "train", f"run.dir={repo / 'runs' / 'submit'}", "--init",
                     f"{demo}/sft/checkpoints", f"data.train={demo}/data/train.jsonl",
                     f"data.valid={demo}/data/valid.jsonl", f"data.test={demo}/data/test.jsonl"]
    assert job(f"RUN_DIR={tmp_path}", "TRAIN_ARGS=--resume") == ["rlt2t.cli", "train", f"run.dir={tmp_path}",
                                                                 "--resume"]
    assert job("TRAIN_CONFIG=configs/tiny.yaml")[2:] == ["--config", str(repo / "configs" / "tiny.yaml"),
                                                         f"run.dir={repo / 'runs' / 'submit'}"]  # its own data
    # a start that is not there is named, with what to run, before anything reaches Ray
    missing = make(f"SUBMIT_FROM={tmp_path / 'nodemo'}", dry=False)
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert f"{tmp_path / 'nodemo'}/sft/checkpoints is missing" in missing.stderr
    assert "run `make demo` first" in missing.stderr


def test_annotate_export_says_what_it_left_out_and_merged(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    import rlt2t.services.annotation.export as export
    import rlt2t.services.annotation.store as store
    from rlt2t.cmd_annotate import cmd_export

    counts = export.ExportCounts(rank_lists=3, pairs=5, ratings=4, dropped_candidates=2, dropped_lists=1,
                                 merged_ratings=6, dropped_ratings=1)
    monkeypatch.setattr(store, "open_store", lambda cfg: SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(export, "export_all", lambda *a, **k: counts)
    cmd_export(SimpleNamespace(config=[], overrides=[f"run.dir={tmp_path}"], out=str(tmp_path / "x"),
                               include_flagged=False, annotator=None))
    out = capsys.readouterr().out
    assert "3 rank lists; left out: 2 blank or repeated candidates, 1 rankings left with < 2" in out
    assert "4 ratings (6 more averaged in: one row per source and candidate); left out: 1 of blank texts" in out
