"""examples/datasets_columns.py runs as a user runs it: SFT and RL from a datasets directory with columns of its
own, on tiny settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def test_datasets_columns_example_trains_and_evaluates(tmp_path):
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "datasets_columns.py"), str(run)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout.splitlines()
    assert any(line.startswith("| sft |") for line in table) and any(line.startswith("| rl |") for line in table)
    assert any((run / "rl" / "checkpoints").iterdir())
    # The dataset has no id column: its rows are numbered 1, 2, ... in the saved order.
    predictions = [json.loads(line) for line in (run / "eval" / "rl-valid.predictions.jsonl").open()]
    assert [p["id"] for p in predictions] == [str(i) for i in range(1, len(predictions) + 1)]
    assert len(predictions) == 20  # eval.limit of the tiny config
