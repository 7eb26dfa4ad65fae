"""`make ray-down` (rlt2t.local_ray) matches its cluster's temp dir as a path, not a substring, and skips what it
may not inspect or signal (another user's processes) instead of failing on them."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest

import rlt2t.local_ray as local_ray
from rlt2t.local_ray import cluster_processes, stop_cluster

SLEEPER = "import time; time.sleep(120)"


@pytest.mark.parametrize(("arg", "named"), [
    ("/tmp/rlt2t-ray", True),
    ("/tmp/rlt2t-ray/", True),
    ("/tmp/rlt2t-ray/session_1/sockets/raylet", True),
    ("--temp-dir=/tmp/rlt2t-ray", True),
    ("--session-dir=/tmp/rlt2t-ray/session_1", True),
    ("/tmp/rlt2t-ray-alice", False),
    ("/tmp/rlt2t-ray-alice/session_1", False),
    ("--temp-dir=/tmp/rlt2t-ray-alice", False),
    ("/var/tmp/rlt2t-ray", False),
    ("--temp-dir=/var/tmp/rlt2t-ray/x", False),
])
def test_an_argument_names_the_dir_only_as_a_path(monkeypatch, arg, named):
    me = local_ray.os.getuid()  # a process of this user, whoever runs the tests
    proc = SimpleNamespace(pid=10**7, info={"cmdline": ["python", arg]}, children=lambda recursive: [],
                           uids=lambda: SimpleNamespace(real=me, effective=me, saved=me))
    monkeypatch.setattr(local_ray.psutil, "process_iter", lambda attrs: [proc])
    assert bool(cluster_processes("/tmp/rlt2t-ray")) is named


def test_a_cluster_whose_dir_extends_ours_is_left_alone(tmp_path):
    mine = tmp_path / "ray"
    ours = subprocess.Popen([sys.executable, "-c", SLEEPER, f"--temp-dir={mine}"])
    alice = subprocess.Popen([sys.executable, "-c", SLEEPER, f"--temp-dir={tmp_path}/ray-alice",
                              f"{tmp_path}/ray-alice/session_1"])
    time.sleep(0.3)
    try:
        assert {p.pid for p in cluster_processes(str(mine))} == {ours.pid}
    finally:
        for p in (ours, alice):
            p.kill()
            p.wait()


class _Proc:
    """A psutil.Process of some user, naming the marker on its command line."""

    def __init__(self, pid: int, uid: int, marker: str, *, deny_signal: bool = False) -> None:
        self.pid, self.uid, self.deny_signal = pid, uid, deny_signal
        self.info = {"cmdline": ["raylet", f"--temp-dir={marker}"]}
        self.signals: list[int] = []

    def children(self, recursive: bool = False) -> list:
        return []

    def uids(self):
        return SimpleNamespace(real=self.uid, effective=self.uid, saved=self.uid)

    def send_signal(self, sig: int) -> None:
        if self.deny_signal:
            raise psutil.AccessDenied(self.pid)
        self.signals.append(sig)

    def kill(self) -> None:
        self.send_signal(9)


def test_processes_of_another_user_are_skipped_and_a_denied_signal_does_not_fail(monkeypatch):
    marker = "/tmp/rlt2t-ray"
    mine, theirs = _Proc(10**7, 1000, marker), _Proc(10**7 + 1, 1001, marker)
    monkeypatch.setattr(local_ray.os, "getuid", lambda: 1000)
    monkeypatch.setattr(local_ray.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(local_ray.psutil, "process_iter", lambda attrs: [mine, theirs])
    assert cluster_processes(marker) == [mine]

    # One that changed hands (or hardened its permissions) after it was found: SIGTERM is denied, no traceback.
    denied = _Proc(10**7 + 2, 1000, marker, deny_signal=True)
    monkeypatch.setattr(local_ray, "cluster_processes", lambda m: [mine, denied])
    monkeypatch.setattr(local_ray.psutil, "wait_procs", lambda procs, timeout: ([], list(procs)))
    assert stop_cluster(marker, grace_s=0) == 2
    assert mine.signals == [15, 9] and denied.signals == []
