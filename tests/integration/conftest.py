"""Fixtures of the Ray integration tests: an embedded Ray per module, and one demo run on the tiny config (made
by the CLI as a user runs it; its data, tokenizer and SFT checkpoint are the other tests' start) shared by the
whole session."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray

from rlt2t.common.checkpoint import latest_complete_checkpoint, read_checkpoint
from rlt2t.common.environ import environment
from rlt2t.groups import WORKER_ENV
from rlt2t.local_ray import cluster_processes, stop_cluster

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"


_LAST_RAY_MODULE: list[str] = []  # the last module whose tests use ray_session (pytest_collection_modifyitems)
_LAST_TWO_NODE: list[str] = []  # the last test on the two-node cluster, which stops it
_TWO_NODE: dict[str, tuple[LoopbackCluster, str]] = {}  # the running two-node cluster and its temp dir
_FAILED = pytest.StashKey[bool]()  # set on a test whose call failed (pytest_runtest_makereport)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" and report.failed:
        item.stash[_FAILED] = True
    return report


# `make test` runs these tests on two pytest-xdist workers (`--dist loadfile`): each module's tests on one worker, in
# order (its module fixtures are made once; some tests go on from what an earlier one left); the modules that run jobs
# on the worker's embedded Ray (:func:`ray_session`) all on one worker (spread over both, their tests took 2.3 times as
# long as in one process; kept on one, at most 1.8 times; in two groups, one per worker, the one-session suite below
# took 1296 s instead of 1064 s on 2 cores); the tests on the two-node cluster on one worker (one cluster serves them).
# The scheduler sees only test names, so such a test has TWO_NODE_NAME in its name and such a module is listed in
# RAY_SESSION_MODULES: pytest_collection_modifyitems checks both. (pytest-xdist's own grouping by mark, `--dist
# loadgroup`, does not group under pytest 9.2: pytest-xdist issue 1386.) The unit tests run in a session of their own
# before these. In one session with them (each unit test its own scope, filling the idle worker) the suite took 1064 s
# instead of 1127 s; it was set aside when a unit test failed in it, a failure later traced to that test's data
# following the process's string hashing (fixed), not to the shared session: worth measuring again.
TWO_NODE_NAME = "two_node"
RAY_SESSION_MODULES = ("test_dpo_ray.py", "test_families_e2e.py", "test_feedback_loop.py", "test_pg_ray.py",
                       "test_rl_ray.py", "test_stage_ranks_ray.py", "test_trpo_ray.py")


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadFileScheduling

    class Groups(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module, *_, name = nodeid.split("::")
            if TWO_NODE_NAME in name:
                return "two_node_cluster"
            return "ray_session" if Path(module).name in RAY_SESSION_MODULES else module

    return Groups(config, log) if config.getvalue("dist") == "loadfile" else None


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: the "last" tests below are the last that run
def pytest_collection_modifyitems(session, config, items) -> None:
    # The tests on the two-node loopback cluster run one after another, at the first one's place, so that one
    # cluster serves them all (a start and a stop cost about 15 s).
    two_node = [item for item in items if "two_node_cluster" in getattr(item, "fixturenames", ())]
    unnamed = [item.nodeid for item in two_node if TWO_NODE_NAME not in item.name]
    if unnamed:
        raise pytest.UsageError(f"a test on the two-node cluster must have {TWO_NODE_NAME!r} in its name (the "
                                f"workers' scheduler sees only names): {unnamed}")
    unlisted = sorted({item.path.name for item in items if "ray_session" in getattr(item, "fixturenames", ())}
                      - set(RAY_SESSION_MODULES))
    if unlisted:
        raise pytest.UsageError(f"modules using ray_session must be listed in RAY_SESSION_MODULES of "
                                f"tests/integration/conftest.py (the workers' scheduler sees only names): {unlisted}")
    if two_node:
        at = items.index(two_node[0])
        others = [item for item in items if item not in two_node]
        items[:] = others[:at] + two_node + others[at:]
    _LAST_TWO_NODE[:] = [item.nodeid for item in two_node[-1:]]
    users = [item.module.__name__ for item in items
             if "ray_session" in getattr(item, "fixturenames", ()) and getattr(item, "module", None) is not None]
    _LAST_RAY_MODULE[:] = users[-1:]


@pytest.fixture(scope="module")
def ray_session(request):
    """One embedded Ray for the modules whose tests run jobs in this process, started by the first and stopped
    after the last of the whole run (3.5 s of start and stop saved per module; on a worker that does not run that
    one, at the worker's end: pytest_sessionfinish): each job releases its actors and placement groups, so a
    module finds the cluster as the one before it left it. None stays up while the unit tests run (a session-wide
    one was once suspected of CI's hung gloo test, which turned out to be torch's DDP teardown:
    tests/unit/learner/test_pg_rank_share.py)."""
    if not ray.is_initialized():
        # Its processes inherit the jobs' environment (as rlt2t.groups.init_ray's do), so the workers Ray starts
        # ahead of them take their first actors.
        with environment({**WORKER_ENV, "OMP_NUM_THREADS": "1"}):
            ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    leftover = [pg for pg in ray.util.placement_group_table().values() if pg.get("state") == "CREATED"]
    if not _LAST_RAY_MODULE or _LAST_RAY_MODULE[0] == request.module.__name__ or leftover:
        ray.shutdown()  # the last user, or a module that left reserved resources behind: the next starts afresh


def pytest_sessionfinish(session, exitstatus) -> None:
    if ray.is_initialized():  # kept up by a worker that did not run the last module of ray_session
        ray.shutdown()


def run_rlt2t(*args: str, check: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``rlt2t ARGS`` as a user runs it (a subprocess in the repo, one torch thread), its output captured; a
    non-zero exit fails with what it printed unless ``check=False``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "rlt2t.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd or REPO, timeout=600)
    if check:
        _check_exit(proc)
    return proc


def _check_exit(proc: subprocess.CompletedProcess) -> None:
    """AssertionError with what ``rlt2t ...`` printed when it exited non-zero."""
    if proc.returncode != 0:
        raise AssertionError(f"rlt2t {' '.join(proc.args[3:])} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")


@pytest.fixture(scope="session")
def rlt2t() -> Callable[..., subprocess.CompletedProcess]:
    """:func:`run_rlt2t`: ``rlt2t(*args, check=True, cwd=None)``."""
    return run_rlt2t


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`rlt2t demo` on the tiny config as a user runs it (a subprocess) and what it printed: data, tokenizer,
    pretraining, SFT, continued SFT, RL and the demo's tables. test_cli.py checks the run; the other tests start
    from its data, tokenizer and SFT checkpoint (:func:`prepared_run`). One demo serves the whole run: the first
    pytest-xdist worker that needs it makes it, the others wait for it (a lock beside their temp dirs) and read
    what it printed; a demo that failed fails each of them with its output."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' temp dirs, popen-gwN, are in one directory of this run
    run, printed = root / "demo", root / "demo.json"
    with open(root / "demo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not printed.exists():
            try:
                proc = run_rlt2t("demo", "--config", str(TINY), f"run.dir={run}", check=False)
            except subprocess.TimeoutExpired as e:  # recorded too: the others fail at once instead of trying again
                out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                            for x in (e.stdout, e.stderr))
                proc = subprocess.CompletedProcess(e.cmd, -9, out, f"{err}\ntimed out after {e.timeout:g} s")
            printed.write_text(json.dumps({"args": proc.args, "returncode": proc.returncode, "stdout": proc.stdout,
                                           "stderr": proc.stderr}))
    proc = subprocess.CompletedProcess(**json.loads(printed.read_text()))
    _check_exit(proc)
    return run, proc


# What of the demo's run comes after SFT (a copy leaves it out: the tests' RL jobs start from SFT).
AFTER_SFT = ("rl", "eval", "continued_sft", "rl.yaml", "continued_sft.yaml")


@pytest.fixture(scope="session")
def prepared_run(demo_run) -> Path:
    """The demo's run, for its data, tokenizer and SFT checkpoint: read it, write to a :func:`copy_prepared`
    (test_cli.py runs its commands in a whole copy: other workers read this one meanwhile)."""
    return demo_run[0]


@pytest.fixture(scope="session")
def copy_prepared(prepared_run) -> Callable[[Path], Path]:
    """``copy_prepared(dest)``: a copy of the prepared run at ``dest`` up to its SFT stage (no RL, continued SFT
    or evaluation outputs, their logs or configs)."""

    def copy(dest: Path) -> Path:
        shutil.copytree(prepared_run, dest, ignore=shutil.ignore_patterns(*AFTER_SFT))
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


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class LoopbackCluster:
    """A running two-node Ray cluster on 127.0.0.1 (see :func:`two_node_cluster`)."""

    dashboard: str
    """The dashboard and job API, http://127.0.0.1:PORT."""
    env: dict[str, str]
    """The environment Ray commands against it run with: token authentication on, no RAY_ADDRESS."""

    def run(self, cmd: list[str], timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
        """``cmd`` in the repo with the cluster's environment (plus ``env``), its output captured."""
        return subprocess.run(cmd, cwd=REPO, env={**self.env, **env}, capture_output=True, text=True,
                              timeout=timeout)


@pytest.fixture
def two_node_cluster(request) -> Iterator[LoopbackCluster]:
    """A head offering 2 CPUs and a second node (another `ray start --address`) offering 2 CPUs and `fake_gpu: 2`
    (standing in for GPUs), token authentication on. One cluster serves the tests that use it (run one after
    another: pytest_collection_modifyitems), stopped after the last of them or after one that failed (at the
    session's end at the latest). Only this cluster is stopped, found by its own temp dir, never by name (other
    engineers run Ray on this machine); a process of it left running fails the test that stops it."""
    if "cluster" not in _TWO_NODE:
        _TWO_NODE["cluster"] = _start_two_node()
        request.config.add_cleanup(_stop_at_the_end)  # a run stopped before its last user (-x, Ctrl-C)
    yield _TWO_NODE["cluster"][0]
    # after the last user, or after a failed one (its jobs and actors may hold the cluster: the next starts afresh)
    if request.node.nodeid in _LAST_TWO_NODE or request.node.stash.get(_FAILED, False):
        left = _stop_two_node()
        assert left == [], [p.cmdline() for p in left]


def _start_two_node() -> tuple[LoopbackCluster, str]:
    ray_tmp = f"/tmp/rlt2t-2n-{os.getpid()}"
    gcs, dash, client, agent1, agent2 = free_ports(5)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env["RAY_AUTH_MODE"] = "token"
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # "0" would make the head refuse a second node
    cluster = LoopbackCluster(f"http://127.0.0.1:{dash}", env)
    ray_bin = str(Path(sys.executable).with_name("ray"))
    try:
        token = cluster.run([ray_bin, "get-auth-token", "--generate"])
        assert token.returncode == 0, token.stderr
        head = cluster.run([ray_bin, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=2",
                            "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
                            f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent1}",
                            f"--temp-dir={ray_tmp}", "--disable-usage-stats"])
        assert head.returncode == 0, head.stdout + head.stderr
        node = cluster.run([ray_bin, "start", f"--address=127.0.0.1:{gcs}", "--node-ip-address=127.0.0.1",
                            "--num-cpus=2", '--resources={"fake_gpu": 2}', f"--dashboard-agent-listen-port={agent2}",
                            f"--temp-dir={ray_tmp}", "--disable-usage-stats"])
        assert node.returncode == 0, node.stdout + node.stderr
    except BaseException:
        stop_cluster(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)
        raise
    return cluster, ray_tmp


def _stop_at_the_end() -> None:
    left = _stop_two_node()
    if left:
        warnings.warn(f"two-node cluster processes left running: {[p.cmdline() for p in left]}", stacklevel=1)


def _stop_two_node() -> list:
    """Stop the shared two-node cluster (if running); the processes of it still alive afterwards."""
    if "cluster" not in _TWO_NODE:
        return []
    _, ray_tmp = _TWO_NODE.pop("cluster")
    stop_cluster(ray_tmp)
    left = cluster_processes(ray_tmp)
    shutil.rmtree(ray_tmp, ignore_errors=True)
    return left
