"""`make deploy` / `make undeploy` against a real two-node Ray cluster on loopback.

The head offers CPUs only; a second node (another `ray start --address`) advertises `fake_gpu`, standing in
for GPUs. Training asks for `fake_gpu` for its rollout workers and the policy server asks for it too, so
both must land on the second node. The cluster is conftest's `two_node_cluster`.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time

import httpx
import pytest

from rlt2t.common.checkpoint import latest_complete_checkpoint

pytestmark = pytest.mark.integration


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


def cluster_state(cluster) -> dict:
    out = cluster.run([sys.executable, "-c", STATE_QUERY, cluster.dashboard], timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_deploy_to_two_node_loopback_cluster(copy_prepared, two_node_cluster, tmp_path):
    # An SFT checkpoint to serve at once and to start rank RL from.
    run_dir = copy_prepared(tmp_path / "run")
    state = tmp_path / "state.json"
    cluster = two_node_cluster
    dashboard = cluster.dashboard
    sft_root = run_dir / "sft" / "checkpoints"
    assert latest_complete_checkpoint(sft_root) is not None
    # Half a CPU each for the server and the rollout worker: they fit beside a learner rank if the
    # scheduler puts one on the second node too.
    args = ("rl.epochs=1 rl.train_subset=32 run.progress=false serve.port=0 serve.device=cpu "
            "serve.num_cpus=0.5 rl.rollout_cpus=0.5 "
            "'rl.rollout_resources={\"fake_gpu\": 1}' 'serve.resources={\"fake_gpu\": 1}' "
            f"serve.checkpoint_dir={sft_root}")
    up = cluster.run(["make", "--no-print-directory", "deploy", "DEPLOY_CONFIG=configs/tiny.yaml",
                      f"RUN_DIR={run_dir}", f"DEPLOY_STATE={state}", f"DEPLOY_ARGS={args}"], timeout=420,
                     RAY_ADDRESS=dashboard)
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

    wait = cluster.run([sys.executable, "-m", "rlt2t.cli", "deploy", "status", "--wait", "--timeout", "400",
                        "--state", str(state)], timeout=420, RAY_ADDRESS=dashboard)
    assert wait.returncode == 0, wait.stdout[-3000:] + wait.stderr[-3000:]
    assert f"{job_id}  SUCCEEDED" in wait.stdout and "healthy" in wait.stdout
    ckpt = latest_complete_checkpoint(run_dir / "rl" / "checkpoints")
    assert ckpt is not None and ckpt.name == "epoch-0001"

    # Placement: everything that asked for fake_gpu ran on the node that has it.
    st = cluster_state(cluster)
    assert len(st["nodes"]) == 2
    gpu_node = next(n["id"] for n in st["nodes"] if n["resources"].get("fake_gpu"))
    # In a placement group the demand shows as fake_gpu_group_<pg id>.
    wanted = [a for a in st["actors"] if any(k == "fake_gpu" or k.startswith("fake_gpu_group_") for k in a["res"])]
    assert {"RolloutWorker", "PolicyServerActor"} <= {a["cls"] for a in wanted}
    assert {a["node"] for a in wanted} == {gpu_node}

    down = cluster.run(["make", "--no-print-directory", "undeploy", f"DEPLOY_STATE={state}"], RAY_ADDRESS=dashboard)
    assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]
    assert "stopped" in down.stdout and not state.exists()
    st = cluster_state(cluster)
    assert [a for a in st["actors"] if a["state"] != "DEAD"] == []
    assert [pg for pg in st["pgs"] if pg["state"] != "REMOVED"] == []
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/healthz", timeout=5)
    again = cluster.run(["make", "--no-print-directory", "undeploy", f"DEPLOY_STATE={state}"], RAY_ADDRESS=dashboard)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "nothing to stop" in again.stdout and "no server was touched" in again.stdout
