"""Fixtures of the Ray integration tests: an embedded Ray per module, and one prepared run (data, tokenizer and
an SFT checkpoint made by the CLI on the tiny config) shared by the whole session."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import ray

from rlt2t.common.checkpoint import latest_complete_checkpoint, read_checkpoint

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"


@pytest.fixture(scope="module")
def ray_session():
    """One per module (seconds each time): the jobs of the module's tests run on it, each releasing its actors
    and placement groups as a job does; none stays up while other modules run (a session-wide one was suspected
    of CI's hung gloo test, which turned out to be torch's DDP teardown: tests/unit/learner/test_pg_rank_share.py)."""
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False,
             runtime_env={"env_vars": {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                                       "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
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


@pytest.fixture(scope="session")
def copy_prepared(prepared_run) -> Callable[[Path], Path]:
    """``copy_prepared(dest)``: a copy of the prepared run at ``dest`` without its RL and eval outputs."""

    def copy(dest: Path) -> Path:
        shutil.copytree(prepared_run, dest, ignore=shutil.ignore_patterns("rl", "eval"))
        return dest

    return copy


@pytest.fixture(scope="session")
def kill_training() -> Callable[..., int]:
    """``kill_training(run, *overrides, at_step=4)``: start ``rlt2t train`` on the tiny config in its own
    process group, SIGKILL the driver and its embedded Ray once a complete checkpoint of ``at_step`` or later is
    on disk, and return the step of the latest complete checkpoint left behind."""

    def kill(run: Path, *overrides: str, at_step: int = 4) -> int:
        args = [sys.executable, "-m", "rlt2t.cli", "train", "--config", str(TINY), f"run.dir={run}", *overrides]
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        root = run / "rl" / "checkpoints"
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:
            latest = latest_complete_checkpoint(root)
            if latest is not None and read_checkpoint(latest).step >= at_step:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the job finished before it could be killed; make it longer"
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and its embedded Ray, mid-run
        proc.wait()
        latest = latest_complete_checkpoint(root)
        assert latest is not None, "no checkpoint survived the kill"
        return read_checkpoint(latest).step

    return kill
