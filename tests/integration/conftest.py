"""Fixtures of the Ray integration tests: an embedded Ray per module, and one prepared run (data, tokenizer
and an SFT checkpoint made by the CLI on the tiny config) shared by the whole session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False,
             runtime_env={"env_vars": {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                                       "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def prepared_run(tmp_path_factory) -> Path:
    """Data, tokenizer and an SFT checkpoint made by the CLI on the tiny config (shared by the tests)."""
    run = tmp_path_factory.mktemp("prepared")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "rlt2t.cli", "demo", "--config", str(TINY), f"run.dir={run}",
                    "rl.enabled=false"], check=True, capture_output=True, env=env, cwd=REPO, timeout=600)
    return run
