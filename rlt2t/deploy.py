"""Deploy RL training and the policy server to a Ray cluster (`rlt2t deploy`, `make deploy` / `make undeploy`).

    rlt2t deploy up     [--address URL] [--config FILE ...] run.dir=/shared/runs/exp1 [key=value ...]
    rlt2t deploy status [--wait]
    rlt2t deploy down   [--name SERVER]

Everything goes through the cluster's job API (the dashboard address, port 8265 by default), so a laptop
needs nothing but that port (``ray dashboard cluster.yaml`` or ``kubectl port-forward`` forward it):

* ``up`` submits ``rlt2t train`` as one job, and a short *launcher* job that creates the policy server:
  a detached named actor (namespace ``rlt2t``) in a detached placement group sized from ``serve.num_cpus``,
  ``serve.num_gpus`` and ``serve.resources`` (``rlt2t.services.deploy_actor``), running uvicorn on
  ``create_app`` in a thread, once the cluster is checked to hold it and the training job. The launcher
  waits, inside the cluster, until the server's ``/healthz`` answers, prints its URL and exits; the actor
  outlives it. ``up`` writes what it started to a state file (``.deploy/state.json``); while that file
  records a server under another name (one not brought down), ``up`` refuses rather than orphan it.
* ``down`` stops the training job, then a teardown job kills the actor and removes its placement group.
  Running it twice is harmless. Without the state file it stops nothing unless ``--name`` names the server
  (the default name may be another run's server on a shared cluster).

The training job and the server read and write ``run.dir`` on whichever node they land: on a real
cluster it must be shared storage (EFS, NFS, a ReadWriteMany volume) mounted at the same path everywhere.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from rlt2t.common.config import Config, load_config
from rlt2t.common.environ import environment
from rlt2t.common.io import atomic_write_json
from rlt2t.common.waiting import NotYet, wait_until
from rlt2t.services.deploy_actor import PolicyServerActor, url_host, wait_healthy

NAMESPACE = "rlt2t"
SERVER_NAME = "rlt2t-policy-server"
PLACEMENT_GROUP_NAME = "rlt2t-policy-server-pg"
DEFAULT_DASHBOARD_PORT = 8265
DEFAULT_GCS_PORT = 6379
DEFAULT_STATE = Path(".deploy/state.json")
# Never uploaded with the job: virtualenvs, run outputs and VCS data are large and node-specific.
UPLOAD_EXCLUDES = [".venv", "runs", ".git", ".deploy", "**/__pycache__", ".pytest_cache", ".ruff_cache",
                   "*.egg-info", ".typecheck"]
URL_MARKER = "RLT2T_POLICY_URL="
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def default_working_dir() -> Path:
    """What the jobs upload: this source checkout when rlt2t runs from one (the cluster then runs the same
    code), else the current directory (an installed rlt2t: the cluster runs its own install; the upload
    carries the user's configs)."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "rlt2t" / "cli.py").is_file() else Path.cwd()


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
        return f"{self.scheme}://{url_host(self.host)}:{self.port}" if self.kind == "dashboard" else None


def is_loopback_host(host: str) -> bool:
    """True for localhost and 127.0.0.0/8 or ::1."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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


def _api_server_env(url: str | None) -> contextlib.AbstractContextManager[None]:
    """Ray's job and state clients prefer RAY_ADDRESS from the environment over their argument; pin ours."""
    # Both restored after the block, as they were (whatever Ray's clients set meanwhile).
    return environment({"RAY_ADDRESS": None, "RAY_API_SERVER_ADDRESS": url or os.environ.get("RAY_API_SERVER_ADDRESS")})


def resolve_dashboard_url(address: ClusterAddress) -> str:
    """The job API URL of the cluster (GCS and Ray Client addresses are asked for it)."""
    if address.dashboard_url:
        return address.dashboard_url
    from ray.dashboard.utils import ray_address_to_api_server_url, ray_client_address_to_api_server_url

    raw = f"ray://{url_host(address.host)}:{address.port}" if address.kind == "client" \
        else f"{url_host(address.host)}:{address.port}"
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
    return shlex.join([python, "-m", "rlt2t.cli", "deploy", "serve-start", "--name", name, "--timeout", str(timeout_s),
                       *_config_args(config_paths, working_dir), *overrides])


def teardown_entrypoint(python: str, *, name: str) -> str:
    return shlex.join([python, "-m", "rlt2t.cli", "deploy", "serve-stop", "--name", name])


def parse_server_url(logs: str) -> str | None:
    """The URL the launcher job printed (its last ``RLT2T_POLICY_URL=`` line)."""
    urls = [line.split(URL_MARKER, 1)[1].strip() for line in logs.splitlines() if URL_MARKER in line]
    return urls[-1] if urls else None


# --- the server actor, started and stopped by jobs on the cluster -------------------------------------------

def start_policy_server(cfg: Config, *, name: str = SERVER_NAME, namespace: str = NAMESPACE,
                        timeout_s: float = 300.0) -> str:
    """Create the detached placement group and server actor (inside a job on the cluster); returns its URL.

    An already running server of that name is reused, so `up` can be repeated.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rlt2t.groups import ClusterTooSmall, check_cluster  # Ray and torch: only where the server is placed

    ray.init(namespace=namespace, log_to_driver=True)
    actor: Any  # Ray types a handle as the handle or the class itself; its remote calls are untyped
    try:
        actor = ray.get_actor(name, namespace=namespace)
        serving, wanted = ray.get(actor.serving.remote(), timeout=60), str(cfg.path(cfg.serve.checkpoint_dir))
        if serving != wanted:
            raise DeployError(f"policy server {name!r} is already running for {serving}, not {wanted}: "
                              "run `make undeploy` first")
        print(f"policy server {name!r} is already running for {serving}; reusing it")
    except ValueError:
        # The server and the training job beside it must fit in the cluster, or one of them waits forever.
        try:
            check_cluster(cfg, policy_server=True)
        except ClusterTooSmall as e:
            raise DeployError(str(e)) from None
        s = cfg.serve
        bundle = {"CPU": s.num_cpus, **({"GPU": s.num_gpus} if s.num_gpus else {}), **s.resources}
        remove_stale_placement_group(name, namespace)
        pg = placement_group([bundle], strategy="STRICT_PACK", name=f"{name}-pg", lifetime="detached")
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)  # detached: left pending, it would hold the name and block every retry
            raise DeployError(f"no node offers the policy server's resources {bundle} within {timeout_s:.0f}s "
                              "(serve.num_cpus / serve.num_gpus / serve.resources); its placement group "
                              "was removed") from None
        actor = ray.remote(PolicyServerActor).options(
            name=name, namespace=namespace, lifetime="detached", max_restarts=3,
            num_cpus=s.num_cpus, num_gpus=s.num_gpus, resources=dict(s.resources),
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                 placement_group_bundle_index=0),
        ).remote(cfg, startup_timeout_s=timeout_s)
    return ray.get(actor.healthy_url.remote(timeout_s), timeout=timeout_s + 30)


def remove_stale_placement_group(name: str, namespace: str = NAMESPACE, timeout_s: float = 60.0) -> None:
    """Remove a ``{name}-pg`` that an earlier launch left behind (it timed out, or died before its actor
    started) and no live actor runs in, so a new one of that name can be created; DeployError when live
    actors still hold it. Runs where the server is placed, with Ray initialised."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    group = f"{name}-pg"
    try:
        pg = get_placement_group(group)
    except ValueError:
        return  # none: the usual case
    holders = live_actors_in(pg.id.hex(), namespace)
    if holders:
        raise DeployError(f"placement group {group!r} already exists and live actors run in it ({', '.join(holders)})"
                          f": stop them first (`rlt2t deploy down --name {name}` or `make undeploy`), or deploy "
                          "under another name (`rlt2t deploy up --name ...`)")
    print(f"removing placement group {group!r} left by an earlier launch (no live actor holds it)", flush=True)
    remove_placement_group(pg)

    def released() -> None:  # removal is asynchronous: the name is free once the lookup fails
        try:
            get_placement_group(group)
        except ValueError:
            return
        raise NotYet("the placement group's name is still taken")

    wait_until(released, timeout_s=timeout_s, interval_s=0.2, what=f"placement group {group!r} removed",
               error=DeployError)


def live_actors_in(placement_group_id: str, namespace: str = NAMESPACE) -> list[str]:
    """Names (or ids) of the actors not dead in a placement group, by Ray's state API."""
    from ray.util.state import list_actors

    try:
        actors = list_actors(filters=[("placement_group_id", "=", placement_group_id)], limit=1000)
    except Exception as e:  # the state API is the dashboard's: unreachable, or a version mismatch
        raise DeployError(f"cannot list the actors of placement group {placement_group_id} to check that it is "
                          f"unused ({e}); remove it by hand (`ray list placement-groups`) if it is") from None
    return [a.name or a.actor_id for a in actors if a.state != "DEAD"]


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

        def released() -> None:  # the name is released once the actor is dead
            try:
                ray.get_actor(name, namespace=namespace)
            except ValueError:
                return
            raise NotYet("the actor's name is still taken")

        wait_until(released, timeout_s=timeout_s, interval_s=0.2, what=f"policy server {name!r} gone",
                   error=DeployError)
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

    def terminal() -> str:
        status = str(client.get_job_status(job_id).value)
        if status not in TERMINAL:
            raise NotYet(f"still {status}")
        return status

    return wait_until(terminal, timeout_s=timeout_s, interval_s=interval_s, what=f"job {job_id} finished",
                      error=DeployError)


def _submit(client, entrypoint: str, *, kind: str, working_dir: Path) -> str:
    job_id = f"rlt2t-{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    return client.submit_job(entrypoint=entrypoint, submission_id=job_id, metadata={"rlt2t": kind},
                             runtime_env={"working_dir": str(working_dir), "excludes": UPLOAD_EXCLUDES})


def _check_run_dir(cfg: Config) -> None:
    if not Path(cfg.run.dir).is_absolute():
        raise DeployError(f"run.dir={cfg.run.dir!r}: must be an absolute path that every node sees (the job runs "
                          "in an uploaded copy of the repo); e.g. run.dir=/shared/runs/exp1")


def up(address: str, *, config_paths: Sequence[str | Path] = (), overrides: Sequence[str] = (),
       python: str = "python", state_path: str | Path = DEFAULT_STATE, working_dir: Path | None = None,
       timeout_s: float = 600.0, name: str = SERVER_NAME) -> DeployState:
    """Submit the training job and start the policy server; returns (and saves) what was started."""
    cfg = load_config(config_paths, overrides)  # fail here, not on the cluster, on a bad key
    working_dir = working_dir or default_working_dir()
    _check_run_dir(cfg)
    previous = read_state(state_path)
    if previous and previous.server_name != name:
        # `down` deletes the state file once it has stopped the server, so one still here records a server that
        # may still run (a detached actor and placement group outlive the jobs). Overwriting it would orphan
        # that server: `down` would stop only the new one and refuse --name for the old one.
        raise DeployError(
            f"--name {name!r}: {state_path} still records the server {previous.server_name!r} (run.dir="
            f"{previous.run_dir}, {previous.dashboard_url}), which was not brought down; stop it first "
            f"(`rlt2t deploy down --state {state_path}`, or `rlt2t deploy down --state {state_path} --name "
            f"{previous.server_name}`), or deploy {name!r} beside it with its own --state file")
    addr = parse_address(address)
    if not addr.is_loopback:
        print(f"warning: {addr.host} is not this machine: run.dir={cfg.run.dir} and serve.checkpoint_dir must be "
              "on storage shared by every node (the server reads checkpoints the learner writes)", file=sys.stderr)
    dashboard = resolve_dashboard_url(addr)
    client = job_client(dashboard)
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
        wait_healthy(url, 30.0 if addr.is_loopback else 5.0, error=DeployError)
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
    if job in ("FAILED", "STOPPED") and state.train_job_id is not None:  # job is "-" without one
        print(_tail(client, state.train_job_id))
        return 1
    return 0


def down(address: str | None, *, state_path: str | Path = DEFAULT_STATE, python: str | None = None,
         working_dir: Path | None = None, timeout_s: float = 120.0, name: str | None = None) -> None:
    """Stop the training job, kill the server actor and its placement group; harmless when nothing runs.

    The server is the one the state file names; without a state file only a server named by ``name`` is
    stopped (the default name may be another run's server on a shared cluster)."""
    state = read_state(state_path)
    if state is None and name is None:
        print(f"nothing to stop: no {state_path}, so nothing was deployed from here; no server was touched "
              f"(to stop one anyway, name it: `rlt2t deploy down --name {SERVER_NAME} --address URL`)")
        return
    if state is not None and name is not None and name != state.server_name:
        raise DeployError(f"--name {name!r}: {state_path} records the server {state.server_name!r}; "
                          "drop --name, or pass another --state")
    if address:
        dashboard = resolve_dashboard_url(parse_address(address))
    elif state:
        dashboard = state.dashboard_url
    else:
        raise DeployError(f"--name {name}: no {state_path} to take the cluster from; set RAY_ADDRESS or --address")
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
    working_dir = working_dir or default_working_dir()
    name = state.server_name if state else name
    assert name is not None, "refused above without a state file or --name"
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
