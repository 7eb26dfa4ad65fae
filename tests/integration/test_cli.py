"""The `rlt2t` command line on the tiny config: the pipeline as a user runs it (subprocesses), and the quick
commands and their errors through the same ``main`` in this process (each subprocess would spend seconds
importing torch)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlt2t.common.checkpoint import read_checkpoint
from rlt2t.common.plots import read_rows

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")


def test_demo_pipeline_end_to_end(demo_run):
    run, proc = demo_run
    assert "cider_d" in proc.stdout and "task_score" in proc.stdout and "demo finished" in proc.stdout
    for part in ("data/train.jsonl", "tokenizer/tokenizer.json", "pretrain/checkpoints/epoch-0001",
                 "sft/checkpoints", "logs/sft/metrics.jsonl", "config/sft.yaml"):
        assert (run / part).exists(), part
    table = json.loads(next((run / "eval").glob("sft-valid.json")).read_text())
    assert {"cider_d", "bleu4", "task_score", "rouge_l", "mean_length"} <= set(table)
    valid_rows = len((run / "data" / "valid.jsonl").read_text().splitlines())
    assert table["examples"] == min(20, valid_rows)  # eval.limit=20 in tiny.yaml
    assert list((run / "logs" / "pretrain" / "tb").iterdir())
    # SFT, continued SFT and RL on validation and test: the demo's tables, printed and saved as `rlt2t eval` does
    for split in ("valid", "test"):
        saved = json.loads((run / "eval" / f"demo-{split}.json").read_text())
        labels = list(saved["rows"])
        assert labels[:2] == ["sft", "continued sft"] and labels[2].startswith("rl (")
        assert f"{split} split" in proc.stdout
        evaluated = json.loads((run / "eval" / f"rl-{labels[2][4:-1]}-{split}.json").read_text())
        assert evaluated["stage"] == "rl" and evaluated["algorithm"] == labels[2][4:-1]  # "rl (grpo)"
    # continued SFT spends RL's optimizer steps on the gold targets: the same number of steps
    steps = {stage: read_checkpoint(run / stage / "checkpoints" / "epoch-0002").step
             for stage in ("continued_sft", "rl")}
    assert steps["continued_sft"] == steps["rl"] > 0, steps
    # SFT keeps the checkpoint of the lowest validation loss (sft.monitor=loss); continued SFT, RL's baseline,
    # selects by the greedy metric as RL does
    sft_valid = [r for r in read_rows(run / "logs" / "sft" / "metrics.jsonl") if r.get("kind") == "valid"]
    assert sft_valid and all(r["monitor"] == -r["valid_loss"] for r in sft_valid)
    best = read_checkpoint(run / "sft" / "checkpoints" / "epoch-0002").meta["best"]
    assert best["score"] == -min(r["valid_loss"] for r in sft_valid)
    continued_valid = [r for r in read_rows(run / "logs" / "continued_sft" / "metrics.jsonl")
                       if r.get("kind") == "valid"]
    assert continued_valid and not any("valid_loss" in r for r in continued_valid)
    summary = json.loads((run / "eval" / "demo-summary.json").read_text())
    assert set(summary["scores"]) == {"valid", "test_greedy", "test_ct2_beam"}
    assert all(set(s) == {"sft", "continued_sft", "rl"} for s in summary["scores"].values())
    assert "against sft and continued sft (task_score)" in proc.stdout
    assert (run / "eval" / "demo-validation.png").stat().st_size > 1000 and "validation curves:" in proc.stdout
    # progress while RL trains, and no error-looking line from Ray a user cannot act on
    assert "rl step 5/" in proc.stderr and "reward" in proc.stderr.split("rl step 5/")[1].splitlines()[0]
    assert "constructor arguments in the object store" not in proc.stderr
    assert "RAY_AUTH_MODE" not in proc.stderr  # Ray's notice about an unset auth mode: set explicitly, token
    assert not [line for line in proc.stderr.splitlines() if " E " in line[:40] and "core_worker" in line]


@pytest.fixture(scope="module")
def own_run(demo_run, tmp_path_factory) -> Path:
    """A whole copy of the demo's run, for the commands these tests run in it (other tests read the demo's own)."""
    run = tmp_path_factory.mktemp("demo-copy") / "run"
    shutil.copytree(demo_run[0], run)
    return run


def test_demo_rerun_resumes_instead_of_retraining(own_run, rlt2t):
    run = own_run
    before = {stage: sorted(p.name for p in (run / stage / "checkpoints").iterdir())
              for stage in ("sft", "continued_sft", "rl")}
    shutil.rmtree(run / "eval")  # the rerun writes its tables again
    proc = rlt2t("demo", "--config", TINY, f"run.dir={run}", "--no-predict")
    assert "resuming" in proc.stderr
    assert "nothing left to train" in proc.stderr and "rl: rank on" not in proc.stderr  # no Ray job for a done RL
    assert {stage: sorted(p.name for p in (run / stage / "checkpoints").iterdir()) for stage in before} == before
    saved = json.loads((run / "eval" / "demo-test.json").read_text())
    labels = list(saved["rows"])  # the tables still compare SFT and continued SFT with the finished RL
    assert labels[:2] == ["sft", "continued sft"] and labels[2].startswith("rl (")


def test_stage_refuses_to_overwrite_without_resume(own_run, cli):
    run = own_run
    code, _, err = cli("sft", "--config", TINY, f"run.dir={run}")
    assert code == 2 and "--resume" in err


def test_eval_command_and_average(own_run, tmp_path, cli):
    run = own_run
    code, out, err = cli("eval", "--config", TINY, f"run.dir={run}", "eval.num_beams=2")
    assert code == 0, err
    assert "beam 2" in out and "cider_d" in out
    saved = json.loads((run / "eval" / "sft-valid.json").read_text())  # what was decoded, not the title
    assert saved["num_beams"] == 2 and "/sft/checkpoints/" in saved["checkpoint"]
    avg = tmp_path / "avg"
    code, _, err = cli("average", "--dir", str(run / "sft" / "checkpoints"), "--last", "2", "--out", str(avg))
    assert code == 0, err
    assert (avg / "config.json").is_file() and (avg / "tokenizer.json").is_file()
    code, out, err = cli("eval", "--config", TINY, f"run.dir={run}", "--checkpoint", str(avg))
    assert code == 0 and "cider_d" in out, err
    evaluated = [json.loads(p.read_text()) for p in (run / "eval").glob("*-valid.json")]
    assert [t["num_beams"] for t in evaluated if Path(t.get("checkpoint", "")).resolve() == avg.resolve()] == [1]


def test_synth_is_byte_identical_for_a_seed(tmp_path, cli):
    for name in ("a", "b"):
        assert cli("data", "synth", f"run.dir={tmp_path / name}", "synth.size=1000", "synth.seed=3")[0] == 0
    for split in ("train", "valid", "test"):
        a = (tmp_path / "a" / "data" / f"{split}.jsonl").read_bytes()
        assert a == (tmp_path / "b" / "data" / f"{split}.jsonl").read_bytes()


def test_import_competition_csv(tmp_path, cli):
    csv = tmp_path / "train.csv"
    csv.write_text("".join(f"{i},{i} {i + 1} 7,{i + 2},{i % 3}\n" for i in range(40)))
    code, out, _ = cli("data", "import-csv", "--input", str(csv), "--out", str(tmp_path / "d"),
                       "--valid-fraction", "0.1")
    assert code == 0 and "train:" in out and "valid:" in out
    row = json.loads((tmp_path / "d" / "train.jsonl").read_text().splitlines()[0])
    assert row["source"].count("<sep>") == 1
    bad = tmp_path / "bad.csv"
    bad.write_text("1,2 3,4\n2,x y,5\n")
    code, _, err = cli("data", "import-csv", "--input", str(bad), "--out", str(tmp_path / "e"))
    assert code == 2 and "bad.csv:2" in err


def test_validate_names_file_and_line(tmp_path, cli):
    run = tmp_path / "r"
    assert cli("tokenizer", "build", f"run.dir={run}", "tokenizer.num_data_tokens=100")[0] == 0
    data = tmp_path / "x.jsonl"
    data.write_text('{"id": 1, "source": "1 2", "target": "3"}\n{"id": 2, "source": "1 200", "target": "3"}\n')
    code, _, err = cli("data", "validate", f"run.dir={run}", "--files", str(data))
    assert code == 2 and "x.jsonl:2" in err and "outside the vocabulary" in err
    code, out, _ = cli("data", "validate", f"run.dir={run}", "data.on_error=skip", "--files", str(data))
    assert code == 0 and "1 examples, 1 bad line(s) skipped" in out, out


def test_validate_reports_lengths_against_the_limits(tmp_path, cli):
    run = tmp_path / "r"
    assert cli("tokenizer", "build", f"run.dir={run}", "tokenizer.num_data_tokens=100")[0] == 0
    data = tmp_path / "x.jsonl"
    # sources of 1..10 tokens (+ EOS: 2..11), targets of 1 and 5 tokens (+ EOS: 2 and 6)
    data.write_text("".join(json.dumps({"id": i, "source": " ".join(["7"] * i),
                                        "target": "3" if i % 2 else "3 4 5 6 7"}) + "\n" for i in range(1, 11)))
    code, out, _ = cli("data", "validate", f"run.dir={run}", "data.max_source_len=8", "data.max_target_len=4",
                       "eval.max_new_tokens=8", "--files", str(data))
    assert code == 0
    assert "sources: 3 of 10 over data.max_source_len=8 tokens; length p50 6, p90 10, p99 11, max 11" in out
    assert "targets: 5 of 10 over data.max_target_len=4 tokens; length p50 2, p90 6, p99 6, max 6" in out


def test_bad_config_exits_2_naming_the_key(rlt2t):
    # as a subprocess: what a user sees includes no traceback
    proc = rlt2t("sft", "sft.lr=-0.1", check=False)
    assert proc.returncode == 2 and "sft.lr" in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_config_key_exits_2_naming_it(cli):
    code, _, err = cli("config", "sft.lrr=1")
    assert code == 2 and "sft.lrr: unknown key" in err


def test_help_as_a_user_runs_it(rlt2t):
    assert "usage: rlt2t" in rlt2t("--help").stdout


@pytest.mark.parametrize("cmd", [["data", "synth", "--help"], ["data", "import-csv", "--help"],
                                 ["tokenizer", "build", "--help"], ["pretrain", "--help"], ["sft", "--help"],
                                 ["eval", "--help"], ["convert-model", "--help"], ["average", "--help"],
                                 ["demo", "--help"]])
def test_help(cmd, cli):
    code, out, _ = cli(*cmd)
    assert code == 0 and f"usage: rlt2t {' '.join(cmd[:-1])}" in out


def test_convert_model_cli(tmp_path, cli):
    import torch
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    BartForConditionalGeneration(BartConfig(
        vocab_size=500, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
    )).save_pretrained(tmp_path / "pre")
    assert cli("tokenizer", "build", f"run.dir={tmp_path / 'r'}", "tokenizer.num_data_tokens=100")[0] == 0
    assert cli("convert-model", "--input", str(tmp_path / "pre"), "--vocab-size", "206", "--out",
               str(tmp_path / "out"), "--tokenizer", str(tmp_path / "r" / "tokenizer"))[0] == 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["vocab_size"] == 206 and cfg["pad_token_id"] == 1


def _natural_language_data(folder: Path) -> None:
    """A small real-language task (no integer ids): the subword tokenizer path end to end."""
    import random

    rng = random.Random(0)
    animals = ["cat", "dog", "horse", "bird", "fish", "goat"]
    places = ["garden", "kitchen", "river", "field", "barn"]
    folder.mkdir(parents=True)
    for split, n in (("train", 120), ("valid", 12)):
        rows = []
        for i in range(n):
            a, p = rng.choice(animals), rng.choice(places)
            rows.append({"id": f"{split}-{i}", "source": f"Yesterday the {a} was seen near the {p}.",
                         "target": f"{a} in {p}"})
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_subword_natural_language_end_to_end(tmp_path, cli):
    run = tmp_path / "nl"
    _natural_language_data(run / "data")
    common = ["--config", TINY, f"run.dir={run}", "tokenizer.kind=subword", "tokenizer.vocab_size=400",
              "data.test=/nonexistent.jsonl"]
    assert cli("tokenizer", "build", *common)[0] == 0
    assert json.loads((run / "tokenizer" / "rlt2t_tokenizer.json").read_text())["kind"] == "subword"
    code, out, err = cli("sft", *common, "sft.epochs=1", "sft.batch_size=8")
    assert code == 0 and "sft: 15 steps" in out, err
    best = read_checkpoint(run / "sft" / "checkpoints" / "epoch-0001").meta["best"]  # the command names its best
    assert f"; best by the monitor (-valid_loss): epoch-0001 ({best['score']:.4f})" in out, out
    code, out, err = cli("eval", *common)
    assert code == 0 and "cider_d" in out, err
    preds = (run / "eval").glob("*.predictions.jsonl")
    rows = [json.loads(x) for x in next(preds).read_text().splitlines()]
    assert len(rows) == 12 and all(not any(ch.isdigit() for ch in r["prediction"]) for r in rows)
