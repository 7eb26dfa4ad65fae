"""RL on sources alone: which training and validation rows may lack a target (nothing of the run reads it), and
what the error says where something does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlt2t.common.config import (
    ClassifierTerm,
    HttpTerm,
    MetricTerm,
    PythonTerm,
    RewardConfig,
    RewardModelTerm,
    load_config,
)
from rlt2t.common.data import DataError
from rlt2t.common.rewards import reference_readers
from rlt2t.driver import document_frequency
from rlt2t.jobs import rl_splits, rl_target_use


def brevity(sources, candidates, references):
    return [-float(len(c.split())) for c in candidates]


def _write(path: Path, labelled: bool, n: int = 6) -> None:
    path.write_text("".join(json.dumps({"id": str(i), "source": f"{i} 5", **({"target": f"{i}"} if labelled else {})})
                            + "\n" for i in range(n)))


def _cfg(tmp_path: Path, *overrides: str, train: bool = False, valid: bool | None = True, fn=brevity):
    data = tmp_path / "data"
    data.mkdir(parents=True, exist_ok=True)
    _write(data / "train.jsonl", train)
    if valid is not None:
        _write(data / "valid.jsonl", valid)
    cfg = load_config([], [f"run.dir={tmp_path / 'run'}", f"data.train={data / 'train.jsonl'}",
                           f"data.valid={data / 'valid.jsonl'}", "rl.algorithm=grpo", "metric.monitor_size=4",
                           *overrides])
    if fn is not None:
        cfg.reward.terms = [PythonTerm(fn=fn)]
    return cfg


def test_reference_readers_name_the_weighted_terms_that_read_references():
    terms = [MetricTerm(name="task_score"), PythonTerm(fn=brevity), RewardModelTerm(path="rm"),
             ClassifierTerm(path="clf", label="ok"), MetricTerm(name="bleu4", weight=0.0),
             HttpTerm(url="http://127.0.0.1:1", name="rouge_l"), HttpTerm(url="http://127.0.0.1:1", name="tone")]
    assert reference_readers(RewardConfig(terms=terms)) == ["reward.terms[0] (metric:task_score)",
                                                            "reward.terms[5] (http:rouge_l)"]
    assert reference_readers(RewardConfig(terms=terms[1:4] + terms[6:])) == []
    assert reference_readers(RewardConfig(terms=terms[1:2], source="http", url="http://127.0.0.1:1")) == [
        "reward.source=http (the reward server's task_score)"]


def test_rl_trains_on_unlabeled_rows_when_nothing_reads_their_targets(tmp_path):
    train, valid = rl_splits(_cfg(tmp_path))
    assert len(train) == 6 and all(e.target is None and e.refs == () for e in train)
    assert [e.target for e in valid] == ["0", "1", "2", "3"]  # metric.monitor_size
    assert document_frequency(train, tmp_path) is None and not (tmp_path / "document_frequency.json").exists()
    assert document_frequency(valid, tmp_path) is not None and (tmp_path / "document_frequency.json").is_file()

    # metric.monitor=reward with a reward that reads no references: the validation rows may be unlabeled too
    train, valid = rl_splits(_cfg(tmp_path / "r", "metric.monitor=reward", valid=False))
    assert [e.target for e in valid] == [None] * 4
    assert rl_splits(_cfg(tmp_path / "none", valid=None))[1] == []  # no validation file
    # DPO from preference files: the reward scores no training row, whatever it reads
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"source": "1 5", "chosen": "1", "rejected": "2"}) + "\n")
    dpo = _cfg(tmp_path / "dpo", "rl.algorithm=dpo", f"rl.dpo.pairs=[{pairs}]", fn=None)
    assert rl_target_use(dpo) == [] and len(rl_splits(dpo)[0]) == 6
    assert rl_target_use(_cfg(tmp_path / "dpo2", "rl.algorithm=dpo", fn=None))  # pairs sampled, ordered by it


@pytest.mark.parametrize(("overrides", "fn", "reader"), [
    ((), None, r"reward.terms\[0\] \(metric:task_score\), the default reward: set reward.terms, or give rlt2t.train "
               r"a reward; RL trains on rows without targets when nothing reads them \(docs/guides/rewards.md"),
    (("rl.pg.sft_coef=0.5",), brevity, r"rl.pg.sft_coef=0.5 \(CE on each row's target\)"),
    (("rl.algorithm=rank",), brevity, r"rl.algorithm=rank \(CE on each row's target, which also joins"),
])
def test_a_row_without_a_target_fails_naming_what_reads_it(tmp_path, overrides, fn, reader):
    cfg = _cfg(tmp_path, *overrides, fn=fn)
    assert rl_target_use(cfg)
    with pytest.raises(DataError, match=r"train\.jsonl:1: field 'target': missing \(.*data\.train needs targets in "
                                        rf"this run for {reader}"):
        rl_splits(cfg)
    with pytest.raises(DataError) as refused:
        rl_splits(cfg)
    assert "--unlabeled" not in str(refused.value)  # the import flag's hint is for data files, not for RL


def test_an_unlabeled_validation_split_fails_naming_the_monitor_that_reads_it(tmp_path):
    with pytest.raises(DataError, match=r"valid\.jsonl:1: field 'target': missing \(.*data\.valid needs targets in "
                                        r"this run for metric\.monitor=default \(the validation outputs scored "
                                        r"against the references; metric\.monitor=reward scores them by the reward"):
        rl_splits(_cfg(tmp_path, valid=False))
    cfg = _cfg(tmp_path / "r", "metric.monitor=reward", valid=False, fn=None)  # a reward monitor of task_score
    with pytest.raises(DataError, match=r"data\.train needs targets in this run for reward\.terms\[0\]"):
        rl_splits(cfg)
    (tmp_path / "r" / "data" / "train.jsonl").unlink()
    _write(tmp_path / "r" / "data" / "train.jsonl", True)
    with pytest.raises(DataError, match=r"data\.valid needs targets in this run for reward\.terms\[0\] "
                                        r"\(metric:task_score\)"):
        rl_splits(cfg)


def test_a_file_without_a_target_column_fails_naming_what_reads_it(tmp_path):
    cfg = _cfg(tmp_path, fn=None, valid=None)
    csv = tmp_path / "data" / "train.csv"
    csv.write_text("id,source\n1,5 6\n")
    cfg.data.train, cfg.data.format = str(csv), "csv"
    with pytest.raises(ValueError, match=r"no column 'target' .*\(data\.train needs targets in this run for "
                                         r"reward\.terms\[0\] \(metric:task_score\)"):
        rl_splits(cfg)
    cfg.reward.terms = [PythonTerm(fn=brevity)]
    assert [e.source for e in rl_splits(cfg)[0]] == ["5 6"] and rl_splits(cfg)[1] == []
