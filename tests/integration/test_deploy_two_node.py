"""`make deploy` / `make undeploy` against a real two-node Ray cluster on loopback.

The head offers CPUs only; a second node (another `ray start --address`) advertises `fake_gpu`, standing in
for GPUs. Training asks for `fake_gpu` for its rollout workers and the policy server asks for it too, so
both must land on the second node. Only this test's cluster is stopped: its processes are found by its
own temp dir, never by name (other engineers run Ray on this machine).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rlt2t.common.checkpoint import latest_complete_checkpoint
from rlt2t.local_ray import cluster_processes, stop_cluster

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run(cmd: list[str], env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


# Ray's state API in a child process: the auth mode is read once per process, when Ray is first imported.
STATE_QUERY = """
import json, sys
from ray.util.state import list_actors, list_nodes, list_placement_groups
d = sys.argv[1]
print(json.dumps({
    "nodes": [{"id": n.node_id, "resources": n.resources_total} for n in list_nodes(address=d, detail=True)],
    "actors": [{"cls": a.class_name, "state": a.state, "node": a.node_id, "res": a.required_resources or {}}
               for a in list_actors(address=d, detail=True, limit=1000)],
    "pgs": [{"name": p.name, "state": p.state} for p in list_placement_groups(address=d, limit=1000)],
}))
"""


def cluster_state(dashboard: str, env: dict[str, str]) -> dict:
    out = run([sys.executable, "-c", STATE_QUERY, dashboard], env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_deploy_to_two_node_loopback_cluster(copy_prepared, tmp_path):
    # An SFT checkpoint to serve at once and to start rank RL from.
    run_dir = copy_prepared(tmp_path / "run")
    state = tmp_path / "state.json"
    ray_tmp = f"/tmp/rlt2t-dep-{os.getpid()}"
    gcs, dash, client, agent1, agent2 = free_ports(5)
    dashboard = f"http://127.0.0.1:{dash}"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env["RAY_AUTH_MODE"] = "token"
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # "0" would make the head refuse a second node

    sft_root = run_dir / "sft" / "checkpoints"
    token = run([RAY, "get-auth-token", "--generate"], env)
    assert token.returncode == 0, token.stderr
    try:
        head = run([RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=2",
                    "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
                    f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent1}",
                    f"--temp-dir={ray_tmp}", "--disable-usage-stats"], env)
        assert head.returncode == 0, head.stdout + head.stderr
        node = run([RAY, "start", f"--address=127.0.0.1:{gcs}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
                    '--resources={"fake_gpu": 2}', f"--dashboard-agent-listen-port={agent2}",
                    f"--temp-dir={ray_tmp}", "--disable-usage-stats"], env)
        assert node.returncode == 0, node.stdout + node.stderr
        assert latest_complete_checkpoint(sft_root) is not None

        deploy_env = {**env, "RAY_ADDRESS": dashboard}
        # Half a CPU each for the server and the rollout worker: they fit beside a learner rank if the
        # scheduler puts one on the second node too.
        args = ("rl.epochs=1 rl.train_subset=32 run.progress=false serve.port=0 serve.device=cpu "
                "serve.num_cpus=0.5 rl.rollout_cpus=0.5 "
                "'rl.rollout_resources={\"fake_gpu\": 1}' 'serve.resources={\"fake_gpu\": 1}' "
                f"serve.checkpoint_dir={sft_root}")
        up = run(["make", "--no-print-directory", "deploy", "DEPLOY_CONFIG=configs/tiny.yaml", f"RUN_DIR={run_dir}",
                  f"DEPLOY_STATE={state}", f"DEPLOY_ARGS={args}"], deploy_env, timeout=420)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        assert f"dashboard:     {dashboard}" in up.stdout
        job_id = re.search(r"train job:\s+(\S+)", up.stdout).group(1)
        url = re.search(r"policy server: (http://\S+)", up.stdout).group(1)
        assert json.loads(state.read_text())["train_job_id"] == job_id

        # The server answers while training runs; it serves the SFT checkpoint it was pointed at.
        deadline = time.monotonic() + 120
        while httpx.get(f"{url}/readyz", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "policy server never became ready"
            time.sleep(0.5)
        source = json.loads((run_dir / "data" / "valid.jsonl").read_text().splitlines()[0])["source"]
        r = httpx.post(f"{url}/v1/candidates", json={"sources": [source, source], "num_candidates": 3,
                                                     "top_k": 3}, timeout=60)
        assert r.status_code == 200, r.text
        cands = r.json()["candidates"]
        assert len(cands) == 2 and all(len(c) == 3 for c in cands)
        assert all(c["token_ids"] for per_source in cands for c in per_source)

        wait = run([sys.executable, "-m", "rlt2t.cli", "deploy", "status", "--wait", "--timeout", "400", "--state",
                    str(state)], deploy_env, timeout=420)
        assert wait.returncode == 0, wait.stdout[-3000:] + wait.stderr[-3000:]
        assert f"{job_id}  SUCCEEDED" in wait.stdout and "healthy" in wait.stdout
        ckpt = latest_complete_checkpoint(run_dir / "rl" / "checkpoints")
        assert ckpt is not None and ckpt.name == "epoch-0001"

        # Placement: everything that asked for fake_gpu ran on the node that has it.
        st = cluster_state(dashboard, env)
        assert len(st["nodes"]) == 2
        gpu_node = next(n["id"] for n in st["nodes"] if n["resources"].get("fake_gpu"))
        # In a placement group the demand shows as fake_gpu_group_<pg id>.
        wanted = [a for a in st["actors"] if any(k == "fake_gpu" or k.startswith("fake_gpu_group_") for k in a["res"])]
        assert {"RolloutWorker", "PolicyServerActor"} <= {a["cls"] for a in wanted}
        assert {a["node"] for a in wanted} == {gpu_node}

        down = run(["make", "--no-print-directory", "undeploy", f"DEPLOY_STATE={state}"], deploy_env)
        assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]
        assert "stopped" in down.stdout and not state.exists()
        st = cluster_state(dashboard, env)
        assert [a for a in st["actors"] if a["state"] != "DEAD"] == []
        assert [pg for pg in st["pgs"] if pg["state"] != "REMOVED"] == []
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/healthz", timeout=5)
        again = run(["make", "--no-print-directory", "undeploy", f"DEPLOY_STATE={state}"], deploy_env)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert "nothing to stop" in again.stdout and "no server was touched" in again.stdout
    finally:
        stop_cluster(ray_tmp)
        left = cluster_processes(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert left == [], [p.cmdline() for p in left]
