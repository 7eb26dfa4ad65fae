"""DPO as a Ray job (`rlt2t train rl.algorithm=dpo`), offline: pairs sampled from the SFT checkpoint and ordered
by the reward, or read from an annotation export; the pairs fixed in the run dir, a resume of a run cut short
bitwise identical to an uninterrupted run (cut in this process: a real SIGKILL of the driver and its Ray leaves the
same files, test_pg_ray.py), and the Python API's `rlt2t.train` running it too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import rlt2t
from rlt2t.common.checkpoint import latest_complete_checkpoint, read_checkpoint
from rlt2t.common.config import ModelConfig, load_config
from rlt2t.common.policy import load_policy
from rlt2t.jobs import rl_job
from rlt2t.preference_data import pairs_file, read_pairs_file

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
SETTINGS = ["rl.algorithm=dpo", "rl.epochs=2", "rl.train_subset=48", "rl.batch_size=8", "rl.chunk_size=8",
            "rl.lr=1e-3", "rl.dpo.sampled_candidates=4", "rollout.top_k=0", "run.log_every=1",
            "rl.save_every_steps=3"]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in load_policy(ModelConfig(), checkpoint=path).model.state_dict().items()}


@pytest.fixture(scope="module")
def reference(ray_session, copy_prepared, tmp_path_factory):
    run = copy_prepared(tmp_path_factory.mktemp("dpo-ref") / "run")
    cfg = load_config([TINY], [f"run.dir={run}", *SETTINGS])
    result = rl_job(cfg)
    pairs = read_pairs_file(pairs_file(run))
    assert 0 < len(pairs) <= 48 and all(p.chosen != p.rejected for p in pairs)
    steps = 2 * -(-len(pairs) // 8)
    assert result.steps == steps and result.items_used == 2 * len(pairs)  # two passes over the pairs
    rows = [json.loads(x) for x in (run / "logs" / "rl" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind", "train") == "train"]
    assert len(train) == steps and all("reward_margin" in r and "reward_accuracy" in r for r in train)
    assert train[0]["reward_margin"] == 0.0  # the first step's policy is its reference
    last_epoch = train[len(train) // 2:]  # its last step may hold 2 pairs: the epoch's mean says more
    assert sum(r["reward_accuracy"] for r in last_epoch) / len(last_epoch) > 0.5
    assert sum(r["reward_margin"] for r in last_epoch) / len(last_epoch) > 0
    assert any(r.get("kind") == "valid" for r in rows)  # validated after each epoch, as the online job
    return run, pairs, _weights(result.checkpoint), steps


def test_resume_of_a_run_cut_short_is_bitwise_identical(reference, copy_prepared, tmp_path):
    _, pairs, weights, steps = reference
    run = copy_prepared(tmp_path / "cut")
    cut = rl_job(load_config([TINY], [f"run.dir={run}", *SETTINGS]), stop_after_steps=4)
    assert cut.steps == 4 < steps  # its last checkpoint is step 3's: the resumed run trains step 4 again
    assert read_checkpoint(latest_complete_checkpoint(run / "rl" / "checkpoints")).step == 3
    assert read_pairs_file(pairs_file(run)) == pairs  # the same pairs: sampling is seeded by run.seed
    result = rl_job(load_config([TINY], [f"run.dir={run}", *SETTINGS]), resume=True)
    assert result.steps == steps
    resumed = _weights(result.checkpoint)
    assert all(torch.equal(weights[k], resumed[k]) for k in weights), "resumed run differs from uninterrupted"


def test_pairs_from_an_annotation_export_and_the_python_api(ray_session, copy_prepared, tmp_path):
    run = copy_prepared(tmp_path / "export")
    rows = [json.loads(x) for x in (run / "data" / "train.jsonl").read_text().splitlines()][:16]
    ranks = tmp_path / "ranked.tsv"  # the annotation app's rank-list export: source, best, ..., worst
    ranks.write_text("".join(f"{r['source']}\t{r['target']}\t{r['target'].split()[0]}\n" for r in rows
                             if len(r["target"].split()) > 1))
    lists = sum(1 for _ in ranks.read_text().splitlines())
    cfg = rlt2t.load_config(TINY, overrides={"run.dir": str(run), "rl.algorithm": "dpo", "rl.epochs": 1,
                                               "rl.batch_size": 4, "rl.chunk_size": 4,
                                               "rl.dpo": {"rank_lists": [str(ranks)], "loss": "ipo"}})
    result = rlt2t.train(cfg)
    assert len(read_pairs_file(pairs_file(run))) == lists
    assert result.steps == -(-lists // 4) and result.items_used == lists
    other = copy_prepared(tmp_path / "missing")  # a file that is not there: named with its key, before any actor
    missing = rlt2t.load_config(TINY, overrides={"run.dir": str(other), "rl.algorithm": "dpo",
                                                 "rl.dpo": {"rank_lists": [str(tmp_path / "x.tsv")]}})
    with pytest.raises(FileNotFoundError, match=r"^rl.dpo.rank_lists: file not found: .*x.tsv$"):
        rlt2t.train(missing)
