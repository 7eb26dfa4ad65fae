"""The scripts of examples/ run as a user runs them (a subprocess, from the repository), on tiny settings given
as overrides; each checks what its example is about."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlt2t.common.checkpoint import latest_complete_checkpoint, read_checkpoint
from rlt2t.common.io import atomic_write_jsonl
from rlt2t.common.policy import is_adapter_checkpoint

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TINY_RL = ["rl.epochs=1", "rl.train_subset=8", "rl.batch_size=8", "rollout.num_samples=2", "metric.monitor_size=4",
           "eval.limit=8", "eval.max_new_tokens=12", "run.progress=false"]


def run_example(name: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_every_example_is_short_and_listed_in_the_readme():
    readme = (EXAMPLES / "README.md").read_text()
    for script in sorted(EXAMPLES.glob("*.py")):
        assert len(script.read_text().splitlines()) <= 40, script.name
        assert f"`{script.name}`" in readme, script.name


def test_custom_reward(tmp_path):
    run = tmp_path / "run"
    out = run_example("custom_reward.py", str(run), "synth.size=160", "model.preset=tiny", "sft.epochs=1", *TINY_RL)
    assert "| sft |" in out.stdout and "| rl |" in out.stdout
    assert latest_complete_checkpoint(run / "rl" / "checkpoints") is not None
    # The run's reward was the script's function (recorded by its path in the run's config), nothing else.
    saved = yaml.safe_load((run / "config" / "rl.yaml").read_text())
    assert saved["reward"]["terms"] == [{"kind": "python", "fn": "__main__:overlap_minus_length", "params": {},
                                         "weight": 1.0, "per_sample": False}]
    assert saved["metric"]["monitor"] == "reward"  # and it picked RL's best checkpoint
    rl = latest_complete_checkpoint(run / "rl" / "checkpoints")
    assert read_checkpoint(rl).meta["best"]["by"] == "reward"


def test_lora_local_model(bart_family_dir, tmp_path):
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "red", "green", "blue", "small", "large"]
    rows = []
    for i in range(40):
        src = [rng.choice(words) for _ in range(rng.randint(3, 7))]
        rows.append({"id": str(i), "source": " ".join(src), "target": " ".join(src[:2])})
    for split, part in (("train", rows[:32]), ("valid", rows[32:])):
        atomic_write_jsonl(tmp_path / f"{split}.jsonl", part)
    run = tmp_path / "run"
    out = run_example("lora_local_model.py", str(bart_family_dir), str(run), f"data.train={tmp_path}/train.jsonl",
                      f"data.valid={tmp_path}/valid.jsonl", f"data.test={tmp_path}/valid.jsonl",
                      "data.max_source_len=32", "data.max_target_len=16", "sft.epochs=1", "sft.max_steps=4",
                      "rollout.max_new_tokens=8", *TINY_RL)
    assert "| base |" in out.stdout and "| sft |" in out.stdout and "| rl |" in out.stdout
    for stage in ("sft", "rl"):  # adapters on the frozen base, not full models
        checkpoint = latest_complete_checkpoint(run / stage / "checkpoints")
        assert checkpoint is not None and is_adapter_checkpoint(checkpoint), stage
