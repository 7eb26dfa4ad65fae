"""The embedded Ray a job starts when no RAY_ADDRESS is set (`rlt2t.groups.init_ray`), in a process of its own
(the tests' module-wide Ray may be up in this one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, sys, time
import psutil, ray
from rlt2t.common.config import load_config
from rlt2t.groups import WORKER_ENV, init_ray

before = {k: os.environ.get(k) for k in WORKER_ENV}
init_ray(load_config([sys.argv[1]], []))
after = {k: os.environ.get(k) for k in WORKER_ENV}

def idle_workers():
    return {p.pid for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0] == "ray::IDLE"}

deadline = time.time() + 60
while not idle_workers() and time.time() < deadline:  # the workers Ray starts ahead of the job
    time.sleep(0.1)
ready = idle_workers()

@ray.remote
class Probe:
    def look(self, names):
        return os.getpid(), {k: os.environ.get(k) for k in names}

pid, seen = ray.get(Probe.remote().look.remote(sorted(WORKER_ENV)))
print(json.dumps({"same_env": before == after, "before": before, "worker_env": seen == WORKER_ENV, "seen": seen,
                  "prestarted": pid in ready, "ready": len(ready)}))
ray.shutdown()
"""


def test_the_embedded_cluster_gives_its_workers_the_environment_and_its_first_actor_a_waiting_worker(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TOKENIZERS_PARALLELISM")}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(REPO / "configs" / "tiny.yaml")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["worker_env"], got["seen"]  # TOKENIZERS_PARALLELISM=false and the rest reach the actor
    assert got["same_env"] and got["before"]["TOKENIZERS_PARALLELISM"] is None, got  # the driver's is as it was
    # The actor runs in a worker Ray started before it was asked for: one of the job's, not a second process
    # beside workers of another environment that nothing can use.
    assert got["ready"] >= 1 and got["prestarted"], got
