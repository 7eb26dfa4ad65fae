"""Deploy rank-RL training and the policy server to a Ray cluster (`make deploy` / `make undeploy`).

    python -m rlt2t.deploy up     [--address URL] [--config FILE ...] run.dir=/shared/runs/exp1 [key=value ...]
    python -m rlt2t.deploy status [--wait]
    python -m rlt2t.deploy down

Everything goes through the cluster's job API (the dashboard address, port 8265 by default), so a laptop
needs nothing but that port (``ray dashboard cluster.yaml`` or ``kubectl port-forward`` forward it):

* ``up`` submits ``rlt2t train`` as one job, and a short *launcher* job that creates the policy server:
  a detached named actor (namespace ``rlt2t``) in a detached placement group sized from ``serve.num_cpus``,
  ``serve.num_gpus`` and ``serve.resources``, running uvicorn on ``create_app`` in a thread. The launcher
  waits, inside the cluster, until the server's ``/healthz`` answers, prints its URL and exits; the actor
  outlives it. ``up`` writes what it started to a state file (``.deploy/state.json``).
* ``down`` stops the training job, then a teardown job kills the actor and removes its placement group.
  Running it twice is harmless.

The training job and the server read and write ``run.dir`` on whichever node they land: on a real
cluster it must be shared storage (EFS, NFS, a ReadWriteMany volume) mounted at the same path everywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from rlt2t.common.config import ConfigError, load_config
from rlt2t.common.io import atomic_write_json

NAMESPACE = "rlt2t"
SERVER_NAME = "rlt2t-policy-server"
PLACEMENT_GROUP_NAME = "rlt2t-policy-server-pg"
DEFAULT_DASHBOARD_PORT = 8265
DEFAULT_GCS_PORT = 6379
DEFAULT_STATE = Path(".deploy/state.json")
# Never uploaded with the job: virtualenvs, run outputs and VCS data are large and node-specific.
UPLOAD_EXCLUDES = [".venv", "runs", ".git", ".deploy", "**/__pycache__", ".pytest_cache", ".ruff_cache",
                   "*.egg-info"]
URL_MARKER = "RLT2T_POLICY_URL="
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
REPO_ROOT = Path(__file__).resolve().parents[1]


class DeployError(RuntimeError):
    """Deployment failed; the message says what and where to look."""


# --- addresses -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ClusterAddress:
    """A parsed RAY_ADDRESS: the dashboard (job API), a GCS bootstrap address, or a Ray Client address."""

    kind: Literal["dashboard", "gcs", "client"]
    host: str
    port: int
    scheme: str = "http"

    @property
    def is_loopback(self) -> bool:
        return is_loopback_host(self.host)

    @property
    def dashboard_url(self) -> str | None:
        """The job API URL when it follows from the address alone (None: ask the cluster)."""
        return f"{self.scheme}://{_host_for_url(self.host)}:{self.port}" if self.kind == "dashboard" else None


def is_loopback_host(host: str) -> bool:
    """True for localhost and 127.0.0.0/8 or ::1."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def parse_address(text: str) -> ClusterAddress:
    """Parse RAY_ADDRESS forms.

    ``http(s)://host[:port]`` is the dashboard (port 8265 if omitted); ``ray://host[:port]`` is a Ray Client
    address (its dashboard is looked up by connecting); ``host:port`` is what ``ray job submit --address``
    takes, the dashboard, except port 6379 (the GCS default), which is a bootstrap address.
    """
    text = (text or "").strip()
    if not text or text == "auto":
        raise DeployError("address: give the cluster's dashboard address, e.g. http://127.0.0.1:8265 "
                          "(RAY_ADDRESS or --address; 'auto' is not supported)")
    if "://" in text:
        parts = urlsplit(text)
        if parts.scheme not in ("http", "https", "ray") or not parts.hostname:
            raise DeployError(f"address {text!r}: expected http(s)://host:port, ray://host:port or host:port")
        try:
            port = parts.port
        except ValueError as e:
            raise DeployError(f"address {text!r}: bad port ({e})") from None
        if parts.scheme == "ray":
            return ClusterAddress("client", parts.hostname, port or 10001, "ray")
        return ClusterAddress("dashboard", parts.hostname, port or DEFAULT_DASHBOARD_PORT, parts.scheme)
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise DeployError(f"address {text!r}: expected http(s)://host:port, ray://host:port or host:port")
    host = host.strip("[]")
    port = int(port_text)
    return ClusterAddress("gcs" if port == DEFAULT_GCS_PORT else "dashboard", host, port)


@contextlib.contextmanager
def _api_server_env(url: str | None) -> Iterator[None]:
    """Ray's job and state clients prefer RAY_ADDRESS from the environment over their argument; pin ours."""
    saved = {k: os.environ.get(k) for k in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")}
    os.environ.pop("RAY_ADDRESS", None)
    if url:
        os.environ["RAY_API_SERVER_ADDRESS"] = url
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def resolve_dashboard_url(address: ClusterAddress) -> str:
    """The job API URL of the cluster (GCS and Ray Client addresses are asked for it)."""
    if address.dashboard_url:
        return address.dashboard_url
    from ray.dashboard.utils import ray_address_to_api_server_url, ray_client_address_to_api_server_url

    raw = f"ray://{_host_for_url(address.host)}:{address.port}" if address.kind == "client" \
        else f"{_host_for_url(address.host)}:{address.port}"
    try:
        with _api_server_env(None):
            if address.kind == "client":
                return ray_client_address_to_api_server_url(raw)
            return ray_address_to_api_server_url(raw)
    except Exception as e:  # ray raises ConnectionError, ValueError or its own errors here
        raise DeployError(f"RAY_ADDRESS {raw}: cannot reach the cluster to find its dashboard ({e})") from None


def job_client(dashboard_url: str):
    """A JobSubmissionClient for ``dashboard_url`` (token auth is picked up from RAY_AUTH_MODE/~/.ray)."""
    from ray.job_submission import JobSubmissionClient

    try:
        with _api_server_env(dashboard_url):
            return JobSubmissionClient(dashboard_url)
    except Exception as e:  # ConnectionError, or RuntimeError on an auth or version problem
        raise DeployError(f"RAY_ADDRESS {dashboard_url}: cannot reach the job API ({e}). Is the cluster up and "
                          "its dashboard port forwarded? With token auth set RAY_AUTH_MODE=token.") from None


# --- state file ------------------------------------------------------------------------------------------

@dataclass
class DeployState:
    """What `up` started, for `status` and `down`."""

    dashboard_url: str
    run_dir: str
    train_job_id: str | None = None
    serve_job_id: str | None = None
    server_url: str | None = None
    server_name: str = SERVER_NAME
    namespace: str = NAMESPACE
    python: str = "python"
    started_at: float = field(default_factory=time.time)


def write_state(path: str | Path, state: DeployState) -> None:
    atomic_write_json(path, asdict(state))


def read_state(path: str | Path) -> DeployState | None:
    """The saved state, or None when nothing is deployed from here."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return DeployState(**data)
    except (json.JSONDecodeError, TypeError) as e:
        raise DeployError(f"state file {path}: unreadable ({e}); delete it after checking the cluster "
                          "(`ray job list`, `ray list actors`)") from None


# --- entrypoints -----------------------------------------------------------------------------------------

def _config_args(config_paths: Sequence[str | Path], working_dir: Path) -> list[str]:
    """--config arguments valid inside the uploaded working dir: paths in it become relative."""
    args = []
    for p in config_paths:
        p = Path(p).resolve()
        try:
            args += ["--config", str(p.relative_to(working_dir.resolve()))]
        except ValueError:
            args += ["--config", str(p)]  # outside the upload: must exist at this path on the cluster
    return args


def train_entrypoint(python: str, config_paths: Sequence[str | Path], overrides: Sequence[str],
                     working_dir: Path) -> str:
    """The shell command of the training job."""
    # --resume: a fresh run starts from the SFT checkpoint; a redeploy after a crash continues the newest one.
    return shlex.join([python, "-m", "rlt2t.cli", "train", "--resume", *_config_args(config_paths, working_dir),
                       *overrides])


def serve_entrypoint(python: str, config_paths: Sequence[str | Path], overrides: Sequence[str],
                     working_dir: Path, *, name: str, timeout_s: float) -> str:
    """The shell command of the launcher job that starts the detached policy-server actor."""
    return shlex.join([python, "-m", "rlt2t.deploy", "serve-start", "--name", name, "--timeout", str(timeout_s),
                       *_config_args(config_paths, working_dir), *overrides])


def teardown_entrypoint(python: str, *, name: str) -> str:
    return shlex.join([python, "-m", "rlt2t.deploy", "serve-stop", "--name", name])


def parse_server_url(logs: str) -> str | None:
    """The URL the launcher job printed (its last ``RLT2T_POLICY_URL=`` line)."""
    urls = [line.split(URL_MARKER, 1)[1].strip() for line in logs.splitlines() if URL_MARKER in line]
    return urls[-1] if urls else None


# --- the server actor (runs on the cluster) -------------------------------------------------------------

class PolicyServerActor:
    """uvicorn serving ``create_app(cfg)`` in a background thread of a Ray actor.

    A plain class: ``ray.remote(...).options(...)`` is applied where it is launched.
    """

    def __init__(self, cfg: Any, *, startup_timeout_s: float = 120.0):
        import uvicorn

        from rlt2t.services.http import check_exposure, load_token, uvicorn_config
        from rlt2t.services.policy_app import create_app

        s = cfg.serve
        check_exposure(s, s.host, load_token(s))
        self._checkpoint_dir = str(cfg.path(s.checkpoint_dir))
        app = create_app(cfg, checkpoint_dir=self._checkpoint_dir)
        self._server = uvicorn.Server(uvicorn_config(app, s, host=s.host, port=s.port, log_level="info"))
        self._thread = threading.Thread(target=self._server.run, name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive():  # uvicorn exits its thread when it cannot bind
                raise RuntimeError(f"policy server failed to start on {s.host}:{s.port} (see this actor's log)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"policy server did not start within {startup_timeout_s:.0f}s")
            time.sleep(0.05)
        port = self._server.servers[0].sockets[0].getsockname()[1]  # the real one when serve.port=0
        host = s.host
        if host in ("0.0.0.0", "::", ""):
            import ray

            host = ray.util.get_node_ip_address()
        self._url = f"http://{_host_for_url(host)}:{port}"
        # Health is checked from this process: the launcher job runs on the head, which cannot reach a
        # server bound to its own node's loopback (the default serve.host) on another node.
        local = "127.0.0.1" if s.host in ("0.0.0.0", "::", "", "localhost") or s.host.startswith("127.") else s.host
        self._local_url = f"http://{_host_for_url(local)}:{port}"

    def url(self) -> str:
        return self._url

    def serving(self) -> str:
        """The checkpoint root this server watches (a redeploy must not reuse a server of another run)."""
        return self._checkpoint_dir

    def healthy_url(self, timeout_s: float) -> str:
        """The URL, once /healthz answers from this node (DeployError after ``timeout_s``)."""
        wait_healthy(self._local_url, timeout_s)
        return self._url

    def stop(self) -> None:
        """Let uvicorn finish in-flight requests and close its socket."""
        self._server.should_exit = True
        self._thread.join(timeout=30)


def wait_healthy(url: str, timeout_s: float, *, interval_s: float = 0.5) -> None:
    """Poll ``url``/healthz until it answers 200; DeployError after ``timeout_s``."""
    import httpx

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        try:
            r = httpx.get(f"{url}/healthz", timeout=5.0)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            raise DeployError(f"policy server {url} did not become healthy within {timeout_s:.0f}s ({last})")
        time.sleep(interval_s)


def start_policy_server(cfg: Any, *, name: str = SERVER_NAME, namespace: str = NAMESPACE,
                        timeout_s: float = 300.0) -> str:
    """Create the detached placement group and server actor (inside a job on the cluster); returns its URL.

    An already running server of that name is reused, so `up` can be repeated.
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init(namespace=namespace, log_to_driver=True)
    try:
        actor = ray.get_actor(name, namespace=namespace)
        serving, wanted = ray.get(actor.serving.remote(), timeout=60), str(cfg.path(cfg.serve.checkpoint_dir))
        if serving != wanted:
            raise DeployError(f"policy server {name!r} is already running for {serving}, not {wanted}: "
                              "run `make undeploy` first")
        print(f"policy server {name!r} is already running for {serving}; reusing it")
    except ValueError:
        s = cfg.serve
        bundle = {"CPU": s.num_cpus, **({"GPU": s.num_gpus} if s.num_gpus else {}), **s.resources}
        pg = placement_group([bundle], strategy="STRICT_PACK", name=f"{name}-pg", lifetime="detached")
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise DeployError(f"no node offers the policy server's resources {bundle} within {timeout_s:.0f}s "
                              "(serve.num_cpus / serve.num_gpus / serve.resources)") from None
        actor = ray.remote(PolicyServerActor).options(
            name=name, namespace=namespace, lifetime="detached", max_restarts=3,
            num_cpus=s.num_cpus, num_gpus=s.num_gpus, resources=dict(s.resources),
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                 placement_group_bundle_index=0),
        ).remote(cfg, startup_timeout_s=timeout_s)
    return ray.get(actor.healthy_url.remote(timeout_s), timeout=timeout_s + 30)


def stop_policy_server(name: str = SERVER_NAME, namespace: str = NAMESPACE, timeout_s: float = 60.0) -> bool:
    """Kill the server actor and remove its placement group (inside a job); False if none was running."""
    import ray
    from ray.util.placement_group import get_placement_group, remove_placement_group

    ray.init(namespace=namespace, log_to_driver=True)
    found = False
    try:
        actor = ray.get_actor(name, namespace=namespace)
        found = True
        with contextlib.suppress(Exception):  # a graceful close first; the kill below is what counts
            ray.get(actor.stop.remote(), timeout=30)
        ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # the name is released once the actor is dead
            try:
                ray.get_actor(name, namespace=namespace)
            except ValueError:
                break
            time.sleep(0.2)
    except ValueError:
        pass
    try:
        remove_placement_group(get_placement_group(f"{name}-pg"))
        found = True
    except ValueError:
        pass
    return found


# --- client side: up / status / down ----------------------------------------------------------------------

def _tail(client, job_id: str, lines: int = 40) -> str:
    try:
        return "\n".join(client.get_job_logs(job_id).splitlines()[-lines:])
    except Exception as e:  # logs are a courtesy in an error message
        return f"(logs unavailable: {e})"


def wait_job(client, job_id: str, timeout_s: float, *, interval_s: float = 1.0) -> str:
    """Poll until the job is terminal; returns its status name. DeployError on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = str(client.get_job_status(job_id).value)
        if status in TERMINAL:
            return status
        if time.monotonic() > deadline:
            raise DeployError(f"job {job_id} still {status} after {timeout_s:.0f}s")
        time.sleep(interval_s)


def _submit(client, entrypoint: str, *, kind: str, working_dir: Path) -> str:
    job_id = f"rlt2t-{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    return client.submit_job(entrypoint=entrypoint, submission_id=job_id, metadata={"rlt2t": kind},
                             runtime_env={"working_dir": str(working_dir), "excludes": UPLOAD_EXCLUDES})


def _check_run_dir(cfg: Any) -> None:
    if not Path(cfg.run.dir).is_absolute():
        raise DeployError(f"run.dir={cfg.run.dir!r}: must be an absolute path that every node sees (the job runs "
                          "in an uploaded copy of the repo); e.g. run.dir=/shared/runs/exp1")


def up(address: str, *, config_paths: Sequence[str | Path] = (), overrides: Sequence[str] = (),
       python: str = "python", state_path: str | Path = DEFAULT_STATE, working_dir: Path = REPO_ROOT,
       timeout_s: float = 600.0, name: str = SERVER_NAME) -> DeployState:
    """Submit the training job and start the policy server; returns (and saves) what was started."""
    cfg = load_config(config_paths, overrides)  # fail here, not on the cluster, on a bad key
    _check_run_dir(cfg)
    addr = parse_address(address)
    if not addr.is_loopback:
        print(f"warning: {addr.host} is not this machine: run.dir={cfg.run.dir} and serve.checkpoint_dir must be "
              "on storage shared by every node (the server reads checkpoints the learner writes)", file=sys.stderr)
    dashboard = resolve_dashboard_url(addr)
    client = job_client(dashboard)
    previous = read_state(state_path)
    if previous and previous.train_job_id:
        running = False
        with contextlib.suppress(RuntimeError):  # a job this cluster does not know is not running
            running = str(client.get_job_status(previous.train_job_id).value) not in TERMINAL
        if running:
            raise DeployError(f"job {previous.train_job_id} from {state_path} is still running: `make undeploy` first")

    state = DeployState(dashboard_url=dashboard, run_dir=cfg.run.dir, server_name=name, python=python)
    # The server first, the training job once it is up: two jobs whose runtime envs unpack the same
    # working_dir package at the same moment on one node can break the one already importing from it.
    state.serve_job_id = _submit(
        client, serve_entrypoint(python, config_paths, overrides, working_dir, name=name, timeout_s=timeout_s),
        kind="serve", working_dir=working_dir)
    write_state(state_path, state)  # from here on `down` can clean up whatever follows
    status = wait_job(client, state.serve_job_id, timeout_s + 60)
    logs = client.get_job_logs(state.serve_job_id)
    url = parse_server_url(logs)
    if status != "SUCCEEDED" or url is None:
        tail = "\n".join(logs.splitlines()[-40:])
        raise DeployError(f"starting the policy server failed (job {state.serve_job_id}: {status}):\n{tail}")
    state.server_url = url
    write_state(state_path, state)
    state.train_job_id = _submit(client, train_entrypoint(python, config_paths, overrides, working_dir),
                                 kind="train", working_dir=working_dir)
    write_state(state_path, state)
    try:
        wait_healthy(url, 30.0 if addr.is_loopback else 5.0)
    except DeployError:
        if addr.is_loopback:
            raise
        print(f"note: {url} is healthy inside the cluster but not reachable from here (forward its port)",
              file=sys.stderr)
    train_status = str(client.get_job_status(state.train_job_id).value)
    if train_status in ("FAILED", "STOPPED"):
        raise DeployError(f"training job {state.train_job_id} {train_status}:\n{_tail(client, state.train_job_id)}")
    return state


def status(address: str | None, *, state_path: str | Path = DEFAULT_STATE, wait: bool = False,
           timeout_s: float = 24 * 3600.0) -> int:
    """Print the training job's status and the server's health; with ``wait``, block until the job ends.

    Returns the exit code: 0 when the job is running or succeeded, 1 when it failed or was stopped.
    """
    import httpx

    state = read_state(state_path)
    if state is None:
        print(f"nothing deployed from here ({state_path} does not exist)")
        return 0
    client = job_client(resolve_dashboard_url(parse_address(address)) if address else state.dashboard_url)
    job = "-"
    if state.train_job_id:
        job = wait_job(client, state.train_job_id, timeout_s) if wait else \
            str(client.get_job_status(state.train_job_id).value)
    health = "-"
    if state.server_url:
        try:
            health = "healthy" if httpx.get(f"{state.server_url}/healthz", timeout=5.0).status_code == 200 \
                else "unhealthy"
        except httpx.HTTPError as e:
            health = f"unreachable from here ({type(e).__name__})"
    print(f"dashboard:     {state.dashboard_url}")
    print(f"train job:     {state.train_job_id}  {job}")
    print(f"policy server: {state.server_url}  {health}")
    if job in ("FAILED", "STOPPED"):
        print(_tail(client, state.train_job_id))
        return 1
    return 0


def down(address: str | None, *, state_path: str | Path = DEFAULT_STATE, python: str | None = None,
         working_dir: Path = REPO_ROOT, timeout_s: float = 120.0) -> None:
    """Stop the training job, kill the server actor and its placement group; harmless when nothing runs."""
    state = read_state(state_path)
    if address:
        dashboard = resolve_dashboard_url(parse_address(address))
    elif state:
        dashboard = state.dashboard_url
    else:
        print(f"nothing to stop: no {state_path} and no address given")
        return
    client = job_client(dashboard)
    for job_id in (state.train_job_id, state.serve_job_id) if state else ():
        if not job_id:
            continue
        try:
            if client.stop_job(job_id):
                print(f"stopping job {job_id}")
            print(f"job {job_id}: {wait_job(client, job_id, timeout_s)}")
        except DeployError:
            raise
        except RuntimeError as e:  # the job is unknown to this cluster (e.g. the head was restarted)
            print(f"job {job_id}: {e}")
    name = state.server_name if state else SERVER_NAME
    py = python or (state.python if state else "python")
    teardown = _submit(client, teardown_entrypoint(py, name=name), kind="teardown", working_dir=working_dir)
    result = wait_job(client, teardown, timeout_s)
    logs = client.get_job_logs(teardown)
    if result != "SUCCEEDED":
        raise DeployError(f"stopping the policy server failed (job {teardown}: {result}):\n"
                          + "\n".join(logs.splitlines()[-40:]))
    print(next((line for line in logs.splitlines() if line.startswith("policy server")), "policy server stopped"))
    with contextlib.suppress(FileNotFoundError):
        Path(state_path).unlink()


# --- command line ----------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlt2t.deploy", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                       help="dashboard address http://HOST:8265 (or ray://HOST:10001, HOST:6379); default RAY_ADDRESS")
        q.add_argument("--state", default=str(DEFAULT_STATE), help="state file written by up, read by status/down")

    q = sub.add_parser("up", help="submit the training job and start the policy server")
    common(q)
    q.add_argument("--config", action="append", default=[], metavar="FILE", help="YAML config (repeatable)")
    q.add_argument("--python", default="python", help="interpreter of the jobs on the cluster (JOB_PYTHON)")
    q.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the server to be healthy")
    q.add_argument("overrides", nargs="*", metavar="key.path=value")

    q = sub.add_parser("status", help="job status and server health")
    common(q)
    q.add_argument("--wait", action="store_true", help="block until the training job ends; exit 1 if it failed")
    q.add_argument("--timeout", type=float, default=24 * 3600.0)

    q = sub.add_parser("down", help="stop the job and the server")
    common(q)
    q.add_argument("--python", default=None, help="interpreter of the teardown job (default: the one of up)")
    q.add_argument("--timeout", type=float, default=120.0)

    # Run on the cluster by the launcher and teardown jobs.
    q = sub.add_parser("serve-start", help="(internal) run by the launcher job on the cluster")
    q.add_argument("--name", default=SERVER_NAME)
    q.add_argument("--timeout", type=float, default=300.0)
    q.add_argument("--config", action="append", default=[])
    q.add_argument("overrides", nargs="*")
    q = sub.add_parser("serve-stop", help="(internal) run by the teardown job on the cluster")
    q.add_argument("--name", default=SERVER_NAME)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "up":
            if not args.address:
                raise DeployError("address: set RAY_ADDRESS or --address (e.g. http://127.0.0.1:8265)")
            st = up(args.address, config_paths=args.config, overrides=args.overrides, python=args.python,
                    state_path=args.state, timeout_s=args.timeout)
            print(f"dashboard:     {st.dashboard_url}")
            print(f"train job:     {st.train_job_id}   (ray job logs --address {st.dashboard_url} -f {st.train_job_id})")
            print(f"policy server: {st.server_url}")
            print(f"state:         {args.state}")
            return 0
        if args.command == "status":
            return status(args.address, state_path=args.state, wait=args.wait, timeout_s=args.timeout)
        if args.command == "down":
            down(args.address, state_path=args.state, python=args.python, timeout_s=args.timeout)
            return 0
        if args.command == "serve-start":
            url = start_policy_server(load_config(args.config, args.overrides), name=args.name,
                                      timeout_s=args.timeout)
            print(f"{URL_MARKER}{url}", flush=True)
            return 0
        if args.command == "serve-stop":
            found = stop_policy_server(args.name)
            print(f"policy server {args.name!r} {'stopped' if found else 'was not running'}", flush=True)
            return 0
    except (DeployError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
