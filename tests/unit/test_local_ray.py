"""`make ray-down` (rlt2t.local_ray) stops the processes of one cluster, found by its temp dir, and nothing else."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from rlt2t.local_ray import cluster_processes, main, stop_cluster

SLEEPER = "import signal, sys, time\nif sys.argv[1] == 'stubborn': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" \
          "time.sleep(120)"


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SLEEPER, *args])


def test_stops_its_cluster_children_and_stubborn_ones_and_leaves_the_rest(tmp_path):
    mine = str(tmp_path / "ray")
    polite, stubborn = _spawn("polite", f"--temp-dir={mine}"), _spawn("stubborn", f"--session-dir={mine}/session_1")
    other = _spawn("polite", f"--temp-dir={tmp_path / 'other-ray'}")
    time.sleep(0.5)  # the interpreters are up (the stubborn one ignores SIGTERM)
    try:
        assert {p.pid for p in cluster_processes(mine)} == {polite.pid, stubborn.pid}
        assert stop_cluster(mine, grace_s=2) == 2
        assert polite.wait(timeout=10) is not None and stubborn.wait(timeout=10) is not None
        assert other.poll() is None  # another cluster's process: untouched
        assert cluster_processes(mine) == []
    finally:
        for p in (polite, stubborn, other):
            p.kill()
            p.wait()


def test_the_command_and_its_parents_are_not_part_of_the_cluster(tmp_path):
    """`make ray-down RAY_TMP=DIR` runs a shell and Python whose command lines name DIR: they must survive."""
    target = tmp_path / "ray"
    out = subprocess.run(["sh", "-c", f"{sys.executable} -m rlt2t.local_ray stop {target}; echo after {target}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"no Ray cluster running in {target}", f"after {target}"]


def test_refuses_a_dir_that_would_match_every_cluster():
    with pytest.raises(SystemExit):
        main(["stop", "/tmp"])
