"""`make ray-up` → `make train-submit` → `make ray-down` against a real local Ray head on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from rlt2t.common.checkpoint import latest_complete_checkpoint, read_checkpoint
from rlt2t.local_ray import cluster_processes

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def make(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`make ARGS` in its own process group: on a timeout the whole group (`ray job submit` included, which
    would hold the output pipes open) is killed and the test fails with what it printed."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(["make", "--no-print-directory", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"make {' '.join(args)}: no end in {timeout} s\n{out[-3000:]}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_submit_tiny_training_job_to_local_head(copy_prepared, tmp_path):
    run = copy_prepared(tmp_path / "run")
    ray_tmp = f"/tmp/rlt2t-test-{os.getpid()}"
    agent = f"RAY_AGENT_PORT={free_port()}"  # not Ray's default: another Ray on this machine may hold it
    # `make ray-up` as a user runs it on this machine: a head the default job fits on.
    up = make("ray-up", f"RAY_TMP={ray_tmp}", agent)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        # A job the head cannot hold fails at once, naming the settings and the cluster's totals, instead of
        # waiting forever for a worker that never starts.
        job = make("train-submit", "TRAIN_CONFIG=configs/tiny.yaml", f"RUN_DIR={run}",
                   "TRAIN_ARGS=rl.epochs=1 rl.train_subset=32 run.progress=false rl.learner_cpus=512", timeout=300)
        out = job.stdout + job.stderr
        assert job.returncode != 0 and "cannot hold this job" in out, out[-3000:]
        assert "rl.learner_cpus=512" in out and "in all" in out and "more than any node offers" in out, out[-3000:]
        assert latest_complete_checkpoint(run / "rl" / "checkpoints") is None
        # As after `make demo`: a new run that starts from another run's SFT checkpoint and reads its data
        # (SUBMIT_FROM; without RUN_DIR that is runs/demo into runs/submit), leaving that run's own stages alone.
        new = tmp_path / "submitted"
        job = make("train-submit", "TRAIN_CONFIG=configs/tiny.yaml", f"RUN_DIR={new}", f"SUBMIT_FROM={run}",
                   "TRAIN_ARGS=rl.epochs=1 rl.train_subset=32 run.progress=false")
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        assert "succeeded" in (job.stdout + job.stderr).lower()
        ckpt = latest_complete_checkpoint(new / "rl" / "checkpoints")
        assert ckpt is not None and ckpt.name == "epoch-0001"
        assert read_checkpoint(ckpt).meta["init"].startswith(str(run / "sft" / "checkpoints"))
        assert not (run / "rl").exists() and not (new / "data").exists()
    finally:
        down = make("ray-down", f"RAY_TMP={ray_tmp}")
        left = cluster_processes(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert down.returncode == 0 and "stopped" in down.stdout, down.stdout + down.stderr
    assert not left, f"`make ray-down` left processes of its cluster: {[p.pid for p in left]}"
