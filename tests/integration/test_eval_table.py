"""`rlt2t eval` over several models: one table, rows = models, saved as CSV / JSON / Markdown / PNG."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
import torch

from rlt2t.common.checkpoint import save_checkpoint
from rlt2t.common.config import LoraConfig, load_config
from rlt2t.common.lora import apply_lora, load_merged_policy
from rlt2t.common.policy import load_policy
from rlt2t.eval_table import EvalTable, eval_table, resolve_metric_names, resolve_models
from rlt2t.jobs import build_tokenizer_job, load_split, make_synthetic_data
from rlt2t.learner.evaluate import evaluate

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run directory with data, a tokenizer, an SFT checkpoint and an RL checkpoint under the old `rank/` name."""
    run = tmp_path_factory.mktemp("evalrun")
    cfg = load_config([TINY], [f"run.dir={run}", "synth.size=120"])
    make_synthetic_data(cfg)
    build_tokenizer_job(cfg)
    for stage, seed in (("sft", 0), ("rank", 1)):
        policy = load_policy(cfg.model, cfg.tokenizer_dir, seed=seed)
        save_checkpoint(run / stage / "checkpoints", "epoch-0001", model=policy.model, tokenizer=policy.tokenizer,
                        step=1, meta={"best": None})
    return run


def _cfg(run: Path, *over: str):
    return load_config([TINY], [f"run.dir={run}", "eval.limit=8", "eval.max_new_tokens=6", *over])


def test_stages_resolve_rl_to_the_new_directory_else_the_old(run, tmp_path):
    cfg = _cfg(run)
    models = resolve_models(cfg, [])
    assert models == {"sft": run / "sft/checkpoints/epoch-0001", "rl": run / "rank/checkpoints/epoch-0001"}
    assert resolve_models(cfg, ["rank"]) == {"rl": run / "rank/checkpoints/epoch-0001"}
    other = resolve_models(cfg, ["mine=" + str(run / "sft/checkpoints")])
    assert other == {"mine": run / "sft/checkpoints/epoch-0001"}
    with pytest.raises(ValueError, match="two models labelled 'sft'"):
        resolve_models(cfg, ["sft", "sft"])
    with pytest.raises(FileNotFoundError, match=r"pretrain/checkpoints holds no complete checkpoint \(`rlt2t "
                                                r"pretrain` writes them\)"):
        resolve_models(cfg, ["pretrain"])
    # A run without RL under either name: the error names the directory RL writes, and the command
    with pytest.raises(FileNotFoundError, match=r"--checkpoint rl: .*/rl/checkpoints holds no complete checkpoint "
                                                r"\(`rlt2t train` writes them\)"):
        resolve_models(_cfg(tmp_path), ["rl"])
    with pytest.raises(FileNotFoundError, match=r"no such directory \(nor a stage name: sft, rl, rank, pretrain"):
        resolve_models(cfg, [str(tmp_path / "missing")])
    with pytest.raises(FileNotFoundError, match=r"--checkpoint rl: run.dir=.*/elsewhere does not exist \(set run.dir"):
        resolve_models(_cfg(tmp_path / "elsewhere"), ["rl"])  # a saved config's relative run.dir, from another cwd
    with pytest.raises(FileNotFoundError, match=r"run.dir=.*/elsewhere does not exist \(set run.dir"):
        resolve_models(_cfg(tmp_path / "elsewhere"), [])
    # Once the RL stage writes under rl/, that directory wins.
    newer = _cfg(tmp_path)
    policy = load_policy(newer.model, cfg.tokenizer_dir, seed=2)
    for stage in ("rank", "rl"):
        save_checkpoint(tmp_path / stage / "checkpoints", "epoch-0002", model=policy.model,
                        tokenizer=policy.tokenizer, step=2, meta={"best": None})
    assert resolve_models(newer, ["rl"]) == {"rl": tmp_path / "rl/checkpoints/epoch-0002"}


def test_metric_names(run):
    cfg = _cfg(run)
    assert resolve_metric_names(cfg, None) == ["cider_d", "bleu4", "task_score", "rouge_l", "mean_length"]
    assert resolve_metric_names(cfg, "rouge1, meteor") == ["rouge1", "meteor"]
    everything = resolve_metric_names(cfg, "all")
    assert "perplexity" in everything and "meteor" in everything and "classifier_accuracy" not in everything
    with pytest.raises(ValueError, match=r"--metrics: unknown metric\(s\) \['rouge3'\]"):
        resolve_metric_names(cfg, "rouge1,rouge3")


@pytest.mark.system_package("wordnet-base")  # the meteor column
def test_table_rows_are_each_models_own_evaluation(run):
    cfg = _cfg(run)
    columns = ["rouge1", "meteor", "sacrebleu", "distinct_2", "perplexity", "task_score"]
    table = eval_table(cfg, resolve_models(cfg, ["sft", "rl"]), metrics=columns)
    assert list(table.rows) == ["sft", "rl"] and table.columns == columns
    examples = load_split(cfg, "valid")
    cfg.eval.metrics = columns
    for label, stage in (("sft", "sft"), ("rl", "rank")):
        policy = load_policy(cfg.model, cfg.tokenizer_dir, checkpoint=run / stage / "checkpoints/epoch-0001")
        direct = evaluate(policy, examples, cfg.eval, cfg.metric, cfg.data.max_source_len)
        assert table.rows[label] == direct.metrics
        saved = json.loads((run / "eval" / f"{label}-valid.json").read_text())
        assert {c: saved[c] for c in columns} == direct.metrics
    assert table.rows["sft"] != table.rows["rl"]


def test_formats():
    table = EvalTable(title="valid split, greedy decoding", split="valid", columns=["rouge1", "perplexity"],
                      rows={"sft": {"rouge1": 0.16412, "perplexity": 40.91},
                            "rl": {"rouge1": 0.182, "perplexity": 44.03}},
                      checkpoints={"sft": "/a", "rl": "/b"})
    assert table.to_markdown().splitlines()[2:] == [
        "| model | rouge1 | perplexity |", "| --- | ---: | ---: |",
        "| sft | 0.1641 | 40.9100 |", "| rl | 0.1820 | 44.0300 |"]
    rows = list(csv.reader(io.StringIO(table.to_csv())))
    assert rows == [["model", "checkpoint", "rouge1", "perplexity"], ["sft", "/a", "0.16412", "40.91"],
                    ["rl", "/b", "0.182", "44.03"]]


def test_cli_prints_one_table_and_saves_it(run, cli):
    code, out, err = cli("eval", "--config", TINY, f"run.dir={run}", "eval.limit=8", "eval.max_new_tokens=6",
                         "--checkpoint", "sft", "--checkpoint", "rl", "--checkpoint",
                         f"again={run / 'sft' / 'checkpoints'}", "--metrics", "rougeL,mean_length,max_length",
                         "--name", "cmp")
    assert code == 0, err
    assert out.count("rougeL") == 1 and "again" in out
    assert "valid split, its first 8 examples (eval.limit), greedy decoding" in " ".join(out.split())  # wrapped
    saved = json.loads((run / "eval" / "cmp.json").read_text())
    assert list(saved["rows"]) == ["sft", "rl", "again"] and saved["columns"] == ["rougeL", "mean_length", "max_length"]
    assert saved["rows"]["again"] == saved["rows"]["sft"]
    assert (run / "eval" / "cmp.md").read_text().count("\n| ") == 5  # header, rule, 3 models
    assert (run / "eval" / "cmp.csv").is_file()
    assert (run / "eval" / "cmp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = cli("eval", "--config", TINY, f"run.dir={run}", "--metrics", "bleu5")
    assert code == 2 and "unknown metric(s) ['bleu5']" in err


def test_an_adapter_checkpoint_is_evaluated_merged(run, tmp_path):
    """A LoRA stage's checkpoint (adapters + the base's path) is evaluated as base + adapters merged."""
    cfg = _cfg(run, "eval.metrics=[rouge1,perplexity]")
    base = run / "sft" / "checkpoints" / "epoch-0001"
    model = apply_lora(load_policy(cfg.model, cfg.tokenizer_dir, checkpoint=base).model, LoraConfig(r=4), seed=0)
    model.peft_config["default"].base_model_name_or_path = str(base)
    torch.manual_seed(0)
    with torch.no_grad():  # a trained-looking adapter: B != 0
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    ckpt = save_checkpoint(tmp_path / "lora" / "checkpoints", "epoch-0001", model=model,
                           tokenizer=load_policy(cfg.model, cfg.tokenizer_dir, checkpoint=base).tokenizer, step=1,
                           meta={"best": None})
    table = eval_table(cfg, {"sft": base, "lora": ckpt})
    direct = evaluate(load_merged_policy(cfg.model, cfg.tokenizer_dir, ckpt), load_split(cfg, "valid"), cfg.eval,
                      cfg.metric, cfg.data.max_source_len)
    assert table.rows["lora"] == direct.metrics
    assert table.rows["lora"]["perplexity"] != table.rows["sft"]["perplexity"]


def test_eval_rerank_mbr_scores_the_mbr_choice_over_the_models_own_pool(run):
    """`rlt2t eval --rerank mbr`: the model generates beams and samples per source, scores them, and the row scores
    the candidate of highest expected task score against the pool (brute force here); the pool cap is checked
    before decoding."""
    import numpy as np

    from rlt2t.common.data import load_data, reference_sets
    from rlt2t.common.metrics import DocumentFrequency, TaskScore
    from rlt2t.ensemble import rerank_with_policy

    over = ["predict.pool=both", "predict.beam_size=2", "predict.num_hypotheses=2", "predict.num_samples=4",
            "predict.max_new_tokens=6", "run.progress=false"]
    cfg = _cfg(run, *over)
    ckpt = run / "sft/checkpoints/epoch-0001"
    table = eval_table(cfg, {"mbr": ckpt}, metrics="task_score,mean_length", rerank="mbr")
    assert "rerank mbr (task_score, uniform)" in table.title
    saved = json.loads((run / "eval" / "mbr-valid.json").read_text())
    examples = load_split(cfg, "valid")[:8]
    assert saved["rerank"] == "mbr" and saved["pool"] == "both" and saved["examples"] == len(examples)
    assert {k: saved[k] for k in ("beam_size", "num_hypotheses", "no_repeat_ngram_size", "repetition_penalty",
                                  "num_samples", "top_k", "top_p", "epsilon", "temperature", "seed", "mbr_utility",
                                  "mbr_weights")} == {
        "beam_size": 2, "num_hypotheses": 2, "no_repeat_ngram_size": 0, "repetition_penalty": 1.0, "num_samples": 4,
        "top_k": 0, "top_p": 0.9, "epsilon": 0.0, "temperature": 1.0, "seed": 0, "mbr_utility": "task_score",
        "mbr_weights": "uniform"}  # enough to draw the same pools again
    assert set(saved["seconds_per_source"]) == {"generate", "score", "rerank", "total"}
    predictions = [json.loads(line)["prediction"]
                   for line in (run / "eval" / "mbr-valid.predictions.jsonl").read_text().splitlines()]

    again = rerank_with_policy(cfg, load_policy(cfg.model, cfg.tokenizer_dir, checkpoint=ckpt), ckpt, examples, "mbr")
    assert again.predictions == predictions  # seeded sampling: the same pools
    metric = TaskScore(bleu_weight=cfg.metric.bleu_weight, sigma=cfg.metric.cider_sigma,
                       df=DocumentFrequency.from_references(reference_sets(load_data(cfg.path(cfg.data.train),
                                                                                     cfg.data))))
    for cands, counts, chosen in zip(again.candidates, again.counts, again.chosen, strict=True):
        entries = [c for c, n in zip(cands, counts, strict=True) for _ in range(n)]
        assert len(entries) == 2 + 4
        expected = []
        for c in cands:
            i = entries.index(c)
            others = [entries[j] for j in range(len(entries)) if j != i]
            expected.append(float(np.mean(metric.per_sample([c] * len(others), [[o] for o in others]))))
        assert chosen == int(np.argmax(expected))

    with pytest.raises(ValueError, match=r"MBR pool of 6 candidates .* is over predict.max_pool=5"):
        eval_table(_cfg(run, *over, "predict.max_pool=5"), {"mbr": ckpt}, metrics="task_score", rerank="mbr")


@pytest.mark.parametrize(("utility", "msg"), [
    ("mean_length", r"predict.mbr_utility='mean_length': this metric reads no references"),
    ("bleu5", r"predict.mbr_utility='bleu5': not a registered metric"),
])
def test_eval_rerank_mbr_refuses_an_unusable_utility_before_loading_a_model(run, monkeypatch, utility, msg):
    import rlt2t.eval_table as eval_table_mod

    monkeypatch.setattr(eval_table_mod, "eval_job", lambda *a, **k: pytest.fail("a model was evaluated first"))
    with pytest.raises(ValueError, match=rf"eval.rerank=mbr: {msg}"):
        eval_table(_cfg(run, f"predict.mbr_utility={utility}"), {"mbr": run / "sft/checkpoints/epoch-0001"},
                   metrics="task_score", rerank="mbr")
