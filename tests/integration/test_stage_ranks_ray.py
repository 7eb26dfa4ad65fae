"""The pretraining and SFT stages on two Ray actor ranks (``strategy`` ddp / fsdp, ``rlt2t.stage_group``): the
job functions the CLI calls start the ranks, rank 0's checkpoints are the stage's, and a run resumed from a
mid-run checkpoint ends on the weights of the uninterrupted one. (FSDP against DDP, step by step:
tests/unit/learner/test_stage_ranks.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rlt2t.common.checkpoint import checkpoint_name, complete_checkpoints, read_checkpoint
from rlt2t.common.config import ModelConfig, load_config
from rlt2t.common.policy import load_policy
from rlt2t.jobs import pretrain_job, sft_job
from rlt2t.stage_group import check_sees_run_dir

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
RANKS = ["rl.learners=2", "rl.learner_cpus=1", "run.log_every=1"]
SFT = ["sft.strategy=fsdp", "sft.epochs=1", "sft.max_steps=4", "sft.save_every_steps=2", "sft.patience=0"]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_policy(ModelConfig(), checkpoint=path).model.state_dict()


def test_sft_on_two_sharded_ranks_checkpoints_and_resumes_to_the_uninterrupted_weights(ray_session, copy_prepared,
                                                                                      tmp_path):
    run = copy_prepared(tmp_path / "run")
    for stage in (run / "sft", run / "logs" / "sft"):
        shutil.rmtree(stage)
    result = sft_job(load_config([TINY], [f"run.dir={run}", *RANKS, *SFT]))
    assert result.steps == 4
    assert read_checkpoint(result.checkpoint) is not None
    rows = [json.loads(x) for x in (run / "logs" / "sft" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind", "train") == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]  # one log, rank 0's, with the ranks' mean loss
    assert all(r["rank_state_bytes"] > 0 for r in train)
    assert [r["kind"] for r in rows].count("valid") == 1  # the validation monitor ran, on the gathered weights
    assert not list(run.glob(".stage-ranks-*"))  # the ranks' proof of seeing run.dir is cleaned up

    # A run stopped after its step-2 checkpoint (its later checkpoints gone), resumed: the same final weights.
    stopped = tmp_path / "stopped"
    shutil.copytree(run, stopped)
    for info in complete_checkpoints(stopped / "sft" / "checkpoints"):
        if info.step > 2:
            shutil.rmtree(info.path)
    # Resumed on another layout: the ranks refuse it, and the driver raises their error as it is.
    with pytest.raises(ValueError, match="written by 2 rank.s. under sft.strategy=fsdp, this run has 2 under "
                                         "sft.strategy=ddp"):
        sft_job(load_config([TINY], [f"run.dir={stopped}", *RANKS, *SFT, "sft.strategy=ddp"]), resume=True)
    resumed = sft_job(load_config([TINY], [f"run.dir={stopped}", *RANKS, *SFT]), resume=True)
    assert resumed.steps == 4
    final, again = _weights(result.checkpoint), _weights(resumed.checkpoint)
    assert all(torch.equal(final[k], again[k]) for k in final)


def test_pretraining_on_two_ddp_ranks_and_a_rank_that_does_not_see_run_dir(ray_session, copy_prepared, tmp_path):
    run = copy_prepared(tmp_path / "run")
    for stage in (run / "pretrain", run / "logs" / "pretrain"):
        shutil.rmtree(stage)
    cfg = load_config([TINY], [f"run.dir={run}", *RANKS, "pretrain.strategy=ddp", "pretrain.max_steps=2"])
    result = pretrain_job(cfg)
    assert result.steps == 2 and result.checkpoint == run / "pretrain" / "checkpoints" / checkpoint_name(epoch=1)
    assert read_checkpoint(result.checkpoint).meta["ranks"] == 2
    # Checkpoints there already and no resume: refused by the driver, before any rank starts, as in one process.
    with pytest.raises(FileExistsError, match="already holds checkpoints; pass --resume"):
        pretrain_job(cfg)
    # A rank on a node without the driver's run.dir says so before joining the others.
    with pytest.raises(FileNotFoundError, match=r"does not see the driver's run.dir .*mount it at that path on every "
                                           r"node, or set sft.strategy=local"):
        check_sees_run_dir("continued_sft", 1, run, ".stage-ranks-missing")
