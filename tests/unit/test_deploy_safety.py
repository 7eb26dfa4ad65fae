"""`rlt2t deploy`: `down` without a state file touches no server it was not told to, and the server's placement
group never outlives a failed launch to block the next one. Ray's pieces are faked (no cluster)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

import rlt2t.deploy as deploy
from rlt2t.cli import main
from rlt2t.common.config import load_config
from rlt2t.deploy import SERVER_NAME, DeployError, DeployState, write_state

DASHBOARD = "http://127.0.0.1:8265"


class FakeJobs:
    """A JobSubmissionClient whose jobs succeed at once; the teardown job's log says what it stopped."""

    def __init__(self) -> None:
        self.submitted: list[str] = []
        self.stopped: list[str] = []

    def submit_job(self, *, entrypoint: str, submission_id: str, **_) -> str:
        self.submitted.append(entrypoint)
        return submission_id

    def stop_job(self, job_id: str) -> bool:
        self.stopped.append(job_id)
        return True

    def get_job_status(self, job_id: str):
        return SimpleNamespace(value="SUCCEEDED")

    def get_job_logs(self, job_id: str) -> str:
        name = self.submitted[-1].split("--name ")[-1] if self.submitted else "?"
        return f"policy server {name!r} stopped\n"


@pytest.fixture
def jobs(monkeypatch) -> FakeJobs:
    client = FakeJobs()
    monkeypatch.setattr(deploy, "job_client", lambda url: client)
    monkeypatch.setattr(deploy, "resolve_dashboard_url", lambda address: DASHBOARD)
    return client


def test_down_without_state_file_stops_no_server_unless_named(jobs, tmp_path, capsys):
    missing = tmp_path / "state.json"
    code = main(["deploy", "down", "--address", DASHBOARD, "--state", str(missing)])
    out = capsys.readouterr().out
    assert code == 0 and jobs.submitted == [], "the default name may be another run's server"
    assert str(missing) in out and "--name" in out and "no server was touched" in out

    code = main(["deploy", "down", "--address", DASHBOARD, "--state", str(missing), "--name", "mine"])
    assert code == 0 and len(jobs.submitted) == 1
    assert jobs.submitted[0].endswith("deploy serve-stop --name mine")


def test_down_with_a_state_file_stops_its_server_and_refuses_another_name(jobs, tmp_path, capsys):
    state = tmp_path / "state.json"
    write_state(state, DeployState(dashboard_url=DASHBOARD, run_dir="/r", train_job_id="t1", server_name="srv-a"))
    code = main(["deploy", "down", "--state", str(state), "--name", "srv-b"])
    assert code == 1 and "--name 'srv-b'" in capsys.readouterr().err and jobs.submitted == []
    assert main(["deploy", "down", "--state", str(state)]) == 0
    assert jobs.stopped == ["t1"] and jobs.submitted[-1].endswith("--name srv-a") and not state.exists()


def test_down_named_without_state_or_address_says_what_is_missing(jobs, tmp_path):
    with pytest.raises(DeployError, match="--address"):
        deploy.down(None, state_path=tmp_path / "none.json", name=SERVER_NAME)


# --- the placement group of start_policy_server ---------------------------------------------------------------

class _Created(Exception):
    """Stands for everything after the placement group's creation (the actor): the test stops there."""


class FakeRay:
    """Ray as start_policy_server sees it: no server actor of that name; placement groups by name."""

    def __init__(self, monkeypatch, *, existing: bool = False, holders=(), ready: bool = True) -> None:
        import ray
        import ray.util.state

        self.groups: dict[str, SimpleNamespace] = {}
        self.removed: list[str] = []
        self.created: list[str] = []
        self.holders = list(holders)
        if existing:
            self.groups[f"{SERVER_NAME}-pg"] = self._group(f"{SERVER_NAME}-pg")
        pg_module = importlib.import_module("ray.util.placement_group")

        def get_actor(name, namespace=None):
            raise ValueError(f"Failed to look up actor {name}")

        def get(ref, timeout=None):
            if not ready:
                raise ray.exceptions.GetTimeoutError("timed out")
            raise _Created

        def placement_group(bundles, strategy, name, lifetime):
            if name in self.groups:  # what Ray does with a taken name
                raise ray.exceptions.RaySystemError(f"Failed to create placement group '{name}': name already exists")
            self.created.append(name)
            self.groups[name] = self._group(name)
            return self.groups[name]

        def get_placement_group(name):
            if name not in self.groups:
                raise ValueError(f"Failed to look up placement group with name: {name}")
            return self.groups[name]

        def remove_placement_group(pg):
            self.removed.append(pg.name)
            self.groups.pop(pg.name, None)

        def list_actors(filters=None, limit=100, **_):
            assert filters == [("placement_group_id", "=", f"id-{SERVER_NAME}-pg")]
            return [SimpleNamespace(name=n, actor_id="a1", state=s) for n, s in self.holders]

        monkeypatch.setattr(ray, "init", lambda **kw: None)
        monkeypatch.setattr(ray, "get_actor", get_actor)
        monkeypatch.setattr(ray, "get", get)
        monkeypatch.setattr(pg_module, "placement_group", placement_group)
        monkeypatch.setattr(pg_module, "get_placement_group", get_placement_group)
        monkeypatch.setattr(pg_module, "remove_placement_group", remove_placement_group)
        monkeypatch.setattr(ray.util.state, "list_actors", list_actors)
        monkeypatch.setattr(importlib.import_module("rlt2t.groups"), "check_cluster", lambda cfg, **kw: None)

    @staticmethod
    def _group(name: str) -> SimpleNamespace:
        return SimpleNamespace(name=name, id=SimpleNamespace(hex=lambda: f"id-{name}"), ready=lambda: "ready-ref")


def _start():
    deploy.start_policy_server(load_config(["tiny"], ["run.dir=/shared/run"]), timeout_s=1)


def test_a_placement_group_that_times_out_is_removed_so_up_can_be_retried(monkeypatch):
    ray = FakeRay(monkeypatch, ready=False)
    with pytest.raises(DeployError, match="serve.num_cpus"):
        _start()
    assert ray.removed == [f"{SERVER_NAME}-pg"] and ray.groups == {}
    with pytest.raises(DeployError, match="within"):
        _start()  # the retry meets the same timeout, not "name already exists"
    assert ray.created == [f"{SERVER_NAME}-pg"] * 2


def test_a_group_left_by_a_dead_launch_is_removed_before_creating_it(monkeypatch, capsys):
    ray = FakeRay(monkeypatch, existing=True, holders=[("rlt2t-policy-server", "DEAD")])
    with pytest.raises(_Created):
        _start()
    assert ray.removed == [f"{SERVER_NAME}-pg"] and ray.created == [f"{SERVER_NAME}-pg"]
    assert "left by an earlier launch" in capsys.readouterr().out


def test_a_group_live_actors_still_run_in_is_kept_and_the_error_says_what_to_do(monkeypatch):
    ray = FakeRay(monkeypatch, existing=True, holders=[("other-server", "ALIVE")])
    with pytest.raises(DeployError, match=r"other-server.*deploy down --name rlt2t-policy-server"):
        _start()
    assert ray.removed == [] and ray.created == []


# --- up with a state file that records another server ----------------------------------------------------------

class ServingJobs(FakeJobs):
    """FakeJobs whose launcher jobs print the server's URL, as the real one does."""

    def get_job_logs(self, job_id: str) -> str:
        if "-serve-" in job_id:
            return f"{deploy.URL_MARKER}http://10.0.0.5:8000\n"
        return super().get_job_logs(job_id)


@pytest.fixture
def serving(monkeypatch) -> ServingJobs:
    client = ServingJobs()
    monkeypatch.setattr(deploy, "job_client", lambda url: client)
    monkeypatch.setattr(deploy, "resolve_dashboard_url", lambda address: DASHBOARD)
    monkeypatch.setattr(deploy, "wait_healthy", lambda *a, **k: None)
    return client


def _up(state, name: str) -> int:
    return main(["deploy", "up", "--address", DASHBOARD, "--state", str(state), "--name", name, "run.dir=/shared/r"])


def test_up_under_another_name_refuses_while_the_state_file_records_a_server(serving, tmp_path, capsys):
    state = tmp_path / "state.json"
    assert _up(state, "srv-a") == 0  # its training job then finishes (the fake's jobs all succeed at once)
    submitted = list(serving.submitted)
    capsys.readouterr()

    assert _up(state, "srv-b") == 1, "srv-a would be orphaned: its actor outlives its jobs"
    err = capsys.readouterr().err
    assert "--name 'srv-b'" in err and "'srv-a'" in err and "deploy down" in err and "--name srv-a" in err
    assert serving.submitted == submitted, "nothing submitted for srv-b"
    assert deploy.read_state(state).server_name == "srv-a"

    # `up` again under the same name is what it was: the launcher reuses that server
    assert _up(state, "srv-a") == 0 and deploy.read_state(state).server_name == "srv-a"

    # once srv-a is down (the state file gone), srv-b may go up
    assert main(["deploy", "down", "--state", str(state)]) == 0
    assert serving.submitted[-1].endswith("deploy serve-stop --name srv-a") and not state.exists()
    assert _up(state, "srv-b") == 0 and deploy.read_state(state).server_name == "srv-b"


@pytest.mark.parametrize("url", ["http://127.0.0.1:8265", None])
def test_ray_clients_see_the_given_address_not_ray_address_and_both_come_back_after(monkeypatch, url):
    import os

    monkeypatch.setenv("RAY_ADDRESS", "ray://elsewhere:10001")
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    with deploy._api_server_env(url):
        assert "RAY_ADDRESS" not in os.environ and os.environ.get("RAY_API_SERVER_ADDRESS") == url
        os.environ["RAY_API_SERVER_ADDRESS"] = "set by a client"  # undone on the way out, as before
    assert os.environ["RAY_ADDRESS"] == "ray://elsewhere:10001" and "RAY_API_SERVER_ADDRESS" not in os.environ
