"""Unlabelled text (data.unlabeled): the subword tokenizer and denoising pretraining read it besides the splits;
a tokenizer has something to learn from or says so."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import rlt2t.jobs as jobs
from rlt2t.common.config import load_config
from rlt2t.common.tokenization import load_tokenizer

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "the", "dog", "ran", "to", "the", "park"]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(tmp_path: Path, *over: str):
    train = _write(tmp_path / "train.jsonl", [{"source": " ".join(WORDS[i:i + 4]), "target": WORDS[i]}
                                              for i in range(len(WORDS) - 4)])
    unlabeled = _write(tmp_path / "more.jsonl", [{"source": "zebrafish swim near zebrafish"}] * 40)
    return load_config([], [f"run.dir={tmp_path / 'run'}", f"data.train={train}", "tokenizer.kind=subword",
                            "tokenizer.vocab_size=500", "tokenizer.num_sentinels=4",
                            f"data.unlabeled=[{unlabeled}]", *over])


def test_the_subword_tokenizer_learns_from_the_unlabelled_text_too(tmp_path, caplog):
    cfg = _config(tmp_path)
    with caplog.at_level(logging.INFO, logger="rlt2t"):
        out = jobs.build_tokenizer_job(cfg)
    tok = load_tokenizer(out)
    assert tok.tokenize("zebrafish") == ["Ġzebrafish"]  # a word of the unlabelled file only, one token
    assert f"of tokenizer.vocab_size=500 tokens: {len(WORDS) - 4 + len(WORDS) - 4 + 40} texts held no more merges" \
        in caplog.text
    without = load_config([], [f"run.dir={tmp_path / 'plain'}", f"data.train={tmp_path / 'train.jsonl'}",
                               "tokenizer.kind=subword", "tokenizer.vocab_size=500", "tokenizer.num_sentinels=4"])
    assert len(load_tokenizer(jobs.build_tokenizer_job(without)).tokenize("zebrafish")) > 1


def test_a_tokenizer_with_no_text_to_learn_from_says_so(tmp_path):
    empty = _write(tmp_path / "empty.jsonl", [])
    cfg = load_config([], [f"run.dir={tmp_path / 'run'}", f"data.train={empty}", "tokenizer.kind=subword"])
    with pytest.raises(ValueError, match=r"tokenizer.kind=subword: no text to learn a vocabulary from in data.train "
                                         r"\(.*empty.jsonl\)$"):
        jobs.build_tokenizer_job(cfg)
    missing = _config(tmp_path, f"data.unlabeled=[{tmp_path / 'nope.jsonl'}]")
    with pytest.raises(FileNotFoundError, match=r"data.unlabeled\[0\]: .*nope.jsonl does not exist"):
        jobs.build_tokenizer_job(missing)
    nothing = load_config([], [f"run.dir={tmp_path / 'fresh'}", "tokenizer.kind=subword"])  # no data yet
    with pytest.raises(FileNotFoundError, match=r"data.train: .*fresh/data/train.jsonl does not exist \(point "
                                                 r"data.train / data.valid / data.test at your files, `rlt2t data "
                                                 r"import` one, or `rlt2t data synth` the demo's\)"):
        jobs.build_tokenizer_job(nothing)


def test_pretraining_reads_the_unlabelled_text_checked_as_a_split(tmp_path, monkeypatch, caplog):
    cfg = _config(tmp_path, "pretrain.epochs=1", "model.preset=tiny", "data.valid=none.jsonl",
                  "data.test=none.jsonl")
    jobs.build_tokenizer_job(cfg)
    seen = {}

    def pretrain(policy, ids, *args, **kwargs):
        seen["texts"] = [policy.tokenizer.decode(x).strip() for x in ids]

    monkeypatch.setattr("rlt2t.learner.stages.run_pretrain", pretrain)
    with caplog.at_level(logging.INFO, logger="rlt2t"):
        jobs.pretrain_job(cfg)
    assert seen["texts"].count("zebrafish swim near zebrafish") == 40
    assert f"pretrain: 40 texts of data.unlabeled besides the splits' {2 * (len(WORDS) - 4)}" in caplog.text
    _write(tmp_path / "more.jsonl", [{"source": "fine"}, {"source": "a </s> b"}])
    with pytest.raises(ValueError, match=r"more.jsonl:2: field 'source': special token '</s>' is not allowed"):
        jobs.pretrain_job(cfg, resume=False)
