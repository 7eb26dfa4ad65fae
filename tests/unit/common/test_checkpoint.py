from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from rlt2t.common.checkpoint import (
    MARKER,
    checkpoint_name,
    complete_checkpoints,
    latest_complete_checkpoint,
    load_training_state,
    prune_checkpoints,
    read_checkpoint,
    resolve_model_dir,
    resume_point,
    rng_state,
    save_checkpoint,
    set_rng_state,
)


def test_names_are_consistent():
    assert checkpoint_name(epoch=3) == "epoch-0003"
    assert checkpoint_name(step=120) == "step-000120"
    with pytest.raises(ValueError):
        checkpoint_name(epoch=1, step=2)


def _save(root, tiny_policy, name, step, **kw):
    return save_checkpoint(root, name, model=tiny_policy.model, tokenizer=tiny_policy.tokenizer, step=step, **kw)


def test_save_is_a_loadable_model_dir_with_state(tiny_policy, tmp_path):
    opt = torch.optim.AdamW(tiny_policy.model.parameters())
    path = _save(tmp_path, tiny_policy, "epoch-0001", 10, meta={"epoch": 1},
                 training_state={"optimizer": opt.state_dict(), "rng": rng_state()})
    info = read_checkpoint(path)
    assert info.step == 10 and info.meta["epoch"] == 1
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    assert "optimizer" in load_training_state(path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directory left behind"


def test_latest_never_returns_a_partial_checkpoint(tiny_policy, tmp_path):
    _save(tmp_path, tiny_policy, "epoch-0001", 10)
    good = _save(tmp_path, tiny_policy, "epoch-0002", 20)
    # A crash mid-write leaves a .tmp-* directory; a non-atomic copy leaves a named dir without marker;
    # a truncated file leaves a marker whose sizes do not match.
    (tmp_path / ".tmp-epoch-0003-abc").mkdir()
    (tmp_path / ".tmp-epoch-0003-abc" / "config.json").write_text("{}")
    partial = tmp_path / "epoch-0004"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    truncated = tmp_path / "epoch-0005"
    shutil.copytree(good, truncated)
    meta = json.loads((truncated / MARKER).read_text())
    meta["step"] = 50
    (truncated / MARKER).write_text(json.dumps(meta))
    with open(truncated / "model.safetensors", "r+b") as f:
        f.truncate(100)
    assert latest_complete_checkpoint(tmp_path) == good
    assert [i.path.name for i in complete_checkpoints(tmp_path)] == ["epoch-0001", "epoch-0002"]
    assert resolve_model_dir(tmp_path) == good


def test_empty_or_missing_root(tmp_path):
    assert latest_complete_checkpoint(tmp_path / "none") is None
    with pytest.raises(FileNotFoundError):
        resolve_model_dir(tmp_path)


def test_resume_point_continues_with_resume_and_refuses_to_start_over_checkpoints(tiny_policy, tmp_path):
    # The one guard of every stage (pretrain, sft, rl, reward models, classifiers).
    root = tmp_path / "sft" / "checkpoints"
    assert resume_point(root, resume=False) is None and resume_point(root, resume=True) is None
    root.mkdir(parents=True)
    assert resume_point(root, resume=False) is None  # empty: a new run may start here
    saved = _save(root, tiny_policy, checkpoint_name(epoch=1), 1)
    assert resume_point(root, resume=True) == saved
    with pytest.raises(FileExistsError, match=r"already holds checkpoints; pass --resume \(resume=True in "
                                              r"Python\) to continue \(with the settings it was written with\), "
                                              r"use another run\.dir, or remove .* to start it over"):
        resume_point(root, resume=False)
    with pytest.raises(FileExistsError, match="use another output directory, or remove"):
        resume_point(root, resume=False, elsewhere="use another output directory")


def test_overwrite_and_prune_keep_protected(tiny_policy, tmp_path):
    paths = [_save(tmp_path, tiny_policy, checkpoint_name(step=s), s) for s in (1, 2, 3, 4)]
    _save(tmp_path, tiny_policy, checkpoint_name(step=4), 4, meta={"again": True})  # atomic replace
    assert read_checkpoint(paths[3]).meta["again"] is True
    removed = prune_checkpoints(tmp_path, keep_last=2, protect={paths[0]})
    assert removed == [paths[1]]
    assert [i.step for i in complete_checkpoints(tmp_path)] == [1, 3, 4]


def test_bad_name_rejected(tiny_policy, tmp_path):
    with pytest.raises(ValueError, match="does not match"):
        _save(tmp_path, tiny_policy, "latest", 1)


def test_rng_state_roundtrip():
    state = rng_state()
    a = torch.rand(3)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), a)


def test_best_checkpoint_keeps_the_highest_score_across_a_resume(tmp_path):
    from rlt2t.common.checkpoint import BestCheckpoint

    best = BestCheckpoint()
    assert best.meta() is None and best.protect() == set()
    assert best.offer(0.5, tmp_path / "epoch-0001")
    assert not best.offer(0.4, tmp_path / "epoch-0002")
    assert best.offer(0.6, tmp_path / "epoch-0003")
    resumed = BestCheckpoint.from_meta({"best": best.meta()})
    assert (resumed.score, resumed.path) == (0.6, tmp_path / "epoch-0003")
    assert resumed.protect() == {tmp_path / "epoch-0003"}
    assert not resumed.offer(0.6, tmp_path / "epoch-0004")  # a tie keeps the earlier one


def test_a_run_resumed_with_another_monitor_starts_its_best_afresh(tmp_path, caplog):
    """Scores by different measures do not compare: a CIDEr-D best (scale 0-10) would outrank every ROUGE-L
    score after the resume and stay the run's "best" for good."""
    from rlt2t.common.checkpoint import BestCheckpoint

    best = BestCheckpoint(by="default")
    best.offer(2.5, tmp_path / "epoch-0001")
    meta = {"best": best.meta()}
    assert meta["best"]["by"] == "default"
    same = BestCheckpoint.from_meta(meta, "default")
    assert (same.score, same.by) == (2.5, "default") and caplog.records == []
    with caplog.at_level(logging.WARNING, logger="rlt2t.checkpoint"):
        other = BestCheckpoint.from_meta(meta, "rouge_l")
    assert (other.score, other.path, other.by) == (None, None, "rouge_l")
    [warning] = [r.getMessage() for r in caplog.records]
    assert "epoch-0001" in warning and "chosen by monitor default" in warning and "is rouge_l" in warning
    assert other.offer(0.4, tmp_path / "epoch-0002") and other.meta()["by"] == "rouge_l"
    older = BestCheckpoint.from_meta({"best": {"score": 2.5, "path": str(tmp_path / "epoch-0001")}}, "rouge_l")
    assert older.score == 2.5  # written before checkpoints named their monitor: kept, as before


def test_the_best_checkpoint_survives_a_resume_that_spells_the_run_directory_otherwise(tiny_policy, tmp_path,
                                                                                      monkeypatch):
    """Best recorded under a relative run.dir, the run resumed with an absolute one (or moved): the best
    checkpoint is still protected from pruning."""
    root = tmp_path / "runs" / "demo" / "sft" / "checkpoints"
    for i in (1, 2, 3):
        _save(root, tiny_policy, f"epoch-{i:04d}", i)
    monkeypatch.chdir(tmp_path)
    best_as_recorded = Path("runs/demo/sft/checkpoints/epoch-0001")
    removed = prune_checkpoints(root, keep_last=1, protect={best_as_recorded})
    assert [p.name for p in removed] == ["epoch-0002"]
    assert (root / "epoch-0001").is_dir() and (root / "epoch-0003").is_dir()


def test_a_checkpoint_root_resolves_to_the_monitor_s_best_and_results_name_both(tiny_policy, tmp_path):
    """eval, export, predict and --init given a stage's checkpoint root load the checkpoint its monitor picked,
    not a newer one that scored worse; a stage's result names its last checkpoint and that best one."""
    from rlt2t.learner.trainer import StageResult

    root = tmp_path / "sft" / "checkpoints"
    _save(root, tiny_policy, "epoch-0001", 1)
    _save(root, tiny_policy, "epoch-0002", 2, meta={"best": {"score": 0.9, "path": str(root / "epoch-0001")}})
    assert resolve_model_dir(root) == root / "epoch-0001"
    assert resolve_model_dir(root / "epoch-0002") == root / "epoch-0002"  # a checkpoint is itself
    result = StageResult(checkpoint=root / "epoch-0002", steps=2, last_metrics={})
    assert (result.checkpoint, result.best) == (root / "epoch-0002", root / "epoch-0001")
    _save(root, tiny_policy, "epoch-0003", 3)  # no best recorded: the newest
    assert resolve_model_dir(root) == root / "epoch-0003"


def test_the_best_checkpoint_is_found_after_the_run_directory_moved(tiny_policy, tmp_path):
    from rlt2t.common.checkpoint import best_or_latest

    old_root = tmp_path / "old" / "sft" / "checkpoints"
    _save(old_root, tiny_policy, "epoch-0001", 1)
    _save(old_root, tiny_policy, "epoch-0002", 2, meta={"best": {"score": 0.9, "path": str(old_root / "epoch-0001")}})
    shutil.move(str(tmp_path / "old"), str(tmp_path / "new"))
    assert best_or_latest(tmp_path / "new" / "sft" / "checkpoints") == tmp_path / "new" / "sft" / "checkpoints" / \
        "epoch-0001"


def test_a_resumed_rl_run_finds_its_start_after_the_run_directory_moved(tiny_policy, tmp_path):
    # The RL checkpoint records the SFT checkpoint it started from (the KL's reference) as spelled then.
    from rlt2t.common.config import load_config
    from rlt2t.jobs import _recorded_start

    old_root = tmp_path / "old" / "sft" / "checkpoints"
    _save(old_root, tiny_policy, "epoch-0002", 2)
    recorded = str(old_root / "epoch-0002")
    shutil.move(str(tmp_path / "old"), str(tmp_path / "new"))
    cfg = load_config(["tiny"], [f"run.dir={tmp_path / 'new'}"])
    assert _recorded_start(cfg, recorded) == tmp_path / "new" / "sft" / "checkpoints" / "epoch-0002"
    with pytest.raises(FileNotFoundError, match="pass --init"):
        _recorded_start(cfg, str(tmp_path / "elsewhere" / "epoch-0009"))
