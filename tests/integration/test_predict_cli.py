"""`rlt2t export` and `rlt2t predict` end to end on tiny models (the CLI's main(), in process, to stay fast).

Two tiny BARTs with different seeded weights (wide enough that their outputs depend on the source, with an
EOS bias so lengths vary) play the SFT and RL models: each is exported, then both generate and score.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from rlt2t.cli import main
from rlt2t.common.config import ModelConfig
from rlt2t.common.ct2 import read_export_info
from rlt2t.common.data import load_examples
from rlt2t.common.policy import load_policy
from rlt2t.common.rerank import IdfTable
from rlt2t.common.tokenization import save_tokenizer

pytestmark = pytest.mark.integration

OVERRIDES = ["synth.size=300", "model.preset=tiny", "run.progress=false", "predict.beam_size=4",
             "predict.num_hypotheses=3", "predict.max_new_tokens=12", "predict.consensus_top=4"]


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def make_model(run: Path, name: str, seed: int) -> Path:
    policy = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), run / "tokenizer", seed=0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in policy.model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 2.0 / param.shape[-1] ** 0.5)
        policy.model.final_logits_bias[0, policy.tokenizer.eos_token_id] = 4.0
    out = run / "models" / name
    policy.model.save_pretrained(out)
    save_tokenizer(policy.tokenizer, out)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("predict")
    assert main(["data", "synth", f"run.dir={run}", *OVERRIDES]) == 0
    assert main(["tokenizer", "build", f"run.dir={run}", *OVERRIDES]) == 0
    make_model(run, "sft", seed=1)
    make_model(run, "rank", seed=2)
    return run


@pytest.fixture(scope="module")
def exports(run) -> list[Path]:
    a = run / "exp" / "sft"
    assert main(["export", "--checkpoint", str(run / "models" / "sft"), "--out", str(a), f"run.dir={run}",
                 *OVERRIDES]) == 0
    # Default --out: {export.out}/<checkpoint name>; float32 this time.
    assert main(["export", "--checkpoint", str(run / "models" / "rank"), "--quantization", "float32",
                 f"run.dir={run}", *OVERRIDES]) == 0
    return [a, run / "export" / "rank"]


def test_export_writes_ct2_model_tokenizer_and_idf(run, exports):
    sft, rank = exports
    assert read_export_info(sft)["quantization"] == "int8" and read_export_info(rank)["quantization"] == "float32"
    for export in exports:
        assert (export / "model.bin").is_file() and (export / "tokenizer.json").is_file()
    train_targets = [e.target for e in load_examples(run / "data" / "train.jsonl")]
    assert IdfTable.load(sft / "idf.json") == IdfTable.from_texts(train_targets, max_n=2)


def test_predict_three_rerank_modes(run, exports, capsys):
    test = load_examples(run / "data" / "test.jsonl")
    chosen = {}
    for mode in ("mean_logprob", "idf", "consensus"):
        out = run / "pred" / f"{mode}.csv"
        code, stdout, err = run_cli(capsys, "predict", "--generators", ",".join(map(str, exports)), "--scorers",
                                    ",".join(map(str, exports)), "--input", str(run / "data" / "test.jsonl"),
                                    "--out", str(out), "--rerank", mode, f"run.dir={run}", *OVERRIDES)
        assert code == 0, err
        for row_name in ("sft", "rank", f"ensemble ({mode})", "oracle", "task_score", "cider_d"):
            assert row_name in stdout, row_name
        with open(out, newline="") as f:
            rows = list(csv.reader(f))
        assert [r[0] for r in rows] == [e.id for e in test]
        lines = [json.loads(x) for x in out.with_name(f"{mode}.candidates.jsonl").read_text().splitlines()]
        assert [x["id"] for x in lines] == [e.id for e in test]
        for line, row in zip(lines, rows, strict=True):
            texts = [c["text"] for c in line["candidates"]]
            assert len(texts) == len(set(texts)) >= 1  # deduplicated across generators
            assert 3 <= len(texts) <= 6  # 3 hypotheses from each of the 2 generators
            assert row[1] == line["prediction"] == texts[line["chosen"]]
            assert all(set(c["mean_logprob"]) == {"sft", "rank"} for c in line["candidates"])
            best = max(c["rerank_score"] for c in line["candidates"] if c["rerank_score"] is not None)
            assert line["candidates"][line["chosen"]]["rerank_score"] == best
            if mode == "mean_logprob":
                c = line["candidates"][line["chosen"]]
                assert c["rerank_score"] == pytest.approx(sum(c["mean_logprob"].values()) / 2)
        chosen[mode] = [x["prediction"] for x in lines]
    # The modes are different rules: on these inputs at least one choice differs.
    assert chosen["mean_logprob"] != chosen["idf"] or chosen["mean_logprob"] != chosen["consensus"]


def test_predict_competition_csv_and_model_dir_generator(run, exports, capsys):
    test = load_examples(run / "data" / "test.jsonl")
    csv_in = run / "test.csv"
    with open(csv_in, "w", newline="") as f:
        w = csv.writer(f)
        for e in test:  # report_id,description,diagnosis (the source's <sep> is not a data token)
            w.writerow([e.id, " ".join(t for t in e.source.split() if t.isdigit()), e.target])
    out = run / "pred" / "from_csv.csv"
    # A plain model directory as generator: exported on the fly into {export.out}/cache.
    code, stdout, err = run_cli(capsys, "predict", "--generators", str(run / "models" / "sft"), "--scorers",
                                str(exports[1]), "--input", str(csv_in), "--out", str(out), f"run.dir={run}",
                                *OVERRIDES)
    assert code == 0, err
    assert "oracle" in stdout and "ensemble (mean_logprob)" in stdout
    assert len(list((run / "export" / "cache").iterdir())) == 1
    assert len(out.read_text().splitlines()) == len(test)


def test_bad_inputs_exit_2_with_a_message(run, exports, capsys):
    common = [f"run.dir={run}", *OVERRIDES]
    code, _, err = run_cli(capsys, "predict", "--generators", str(exports[0]), "--scorers", str(exports[0]),
                           "--input", str(run / "missing.jsonl"), "--out", str(run / "x.csv"), *common)
    assert code == 2 and "--input" in err and "missing.jsonl" in err
    code, _, err = run_cli(capsys, "predict", "--generators", str(run / "data"), "--scorers", str(exports[0]),
                           "--input", str(run / "data" / "test.jsonl"), "--out", str(run / "x.csv"), *common)
    assert code == 2 and "--generators" in err and "neither a CTranslate2 export" in err
    code, _, err = run_cli(capsys, "export", "--checkpoint", str(run / "data"), "--out", str(run / "e"), *common)
    assert code == 2 and "--checkpoint" in err and "neither a model directory" in err
    code, _, err = run_cli(capsys, "export", "--checkpoint", str(run / "models" / "sft"), "--out", str(exports[0]),
                           *common)
    assert code == 2 and "already exists" in err
    with pytest.raises(SystemExit):
        main(["predict", "--generators", "a", "--scorers", "b", "--input", "c", "--out", "d", "--rerank", "best"])
    assert not (run / "x.csv").exists()
