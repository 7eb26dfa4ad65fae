"""Python rewards where they run: Ray reward workers on the embedded local Ray and on a two-node cluster through
`ray job submit` (the user's code shipped by the job's working_dir), the reward server, and a failing function
failing the job at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlt2t.common.checkpoint import read_checkpoint
from rlt2t.common.data import load_examples
from rlt2t.common.io import atomic_write_jsonl
from rlt2t.services.client import RewardClient

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
# One GRPO step over 16 sources, K = 4: the step's logged reward is the mean of exactly 64 calls' outputs.
ONE_STEP = ["rl.algorithm=grpo", "rl.epochs=1", "rl.train_subset=16", "rl.batch_size=16", "rollout.num_samples=4",
            "run.log_every=1", "metric.monitor_size=4", "run.progress=false"]

USER_SCRIPT = '''
import ray
from rlt2t.actors.reward import RewardWorker
from rlt2t.common.config import MetricTerm, PythonTerm, RewardConfig
from rlt2t.common.metrics import register_metric
from rlt2t.common.python_rewards import RewardError, register_reward
from rlt2t.common.rewards import UserRegistrations


@register_metric("exclaims")
class Exclaims:
    name = "exclaims"

    def per_sample(self, hyps, refs):
        return [float(h.count("!")) for h in hyps]

    def corpus(self, hyps, refs):
        return 0.0


@register_reward("shout")
def shout(sources, candidates, references):
    return [float(c.isupper()) for c in candidates]


def broken(sources, candidates, references):
    return [1.0 / len(c.split()) for c in candidates]


ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
cfg = RewardConfig(terms=[MetricTerm(name="exclaims"), PythonTerm(fn="shout", weight=10)])
worker = ray.remote(RewardWorker)
try:
    ray.get(worker.remote(cfg, None).pid.remote())
except Exception as e:  # what a script's registration meant to a Ray worker before jobs shipped them
    print("without:", str(e).splitlines()[-1])
shipped = worker.remote(cfg, None, UserRegistrations.used_by(cfg))  # as the RL job starts them
print("with:", ray.get(shipped.score_texts.remote(["s", "s"], ["a!!", "AB!"], [["r"], ["r"]])))
failing = worker.remote(RewardConfig(terms=[PythonTerm(fn=broken)]), None)
try:
    ray.get(failing.score_texts.remote(["first", "second"], ["x y", ""], None))
except RewardError as e:  # the driver's `except RewardError` sees it through Ray
    print("error:", str(e.cause))
'''


def test_what_a_script_registers_reaches_the_ray_reward_workers_of_its_jobs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"OMP_NUM_THREADS": "1"}
    (tmp_path / "user_script.py").write_text(USER_SCRIPT)
    out = subprocess.run([sys.executable, "user_script.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith(("without:", "with:", "error:"))]
    assert lines[0].startswith("without:") and "unknown metric 'exclaims'" in lines[0], lines
    assert lines[1] == "with: [2.0, 11.0]"  # exclaims + 10 x shout
    assert lines[2].startswith("error: reward term python:__main__:broken raised ZeroDivisionError: float division "
                               "by zero at user_script.py:"), lines  # the user's line, not Ray's
    assert lines[2].endswith("`return [1.0 / len(c.split()) for c in candidates]` (first failing source: 'second', "
                             "candidate 1: '')"), lines


FAILING = '''
def fn(sources, candidates, references):
    raise RuntimeError("the reward service is down")
'''


def test_a_failing_reward_function_fails_the_job_at_once_naming_the_term(copy_prepared, tmp_path):
    run = copy_prepared(tmp_path / "run")
    project = tmp_path / "project"  # the job runs from here: its modules import (the workers' sys.path has it too)
    project.mkdir()
    (project / "failing_rewards.py").write_text(FAILING)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "rlt2t.cli", "train", "--config", "tiny", f"run.dir={run}", *ONE_STEP,
                          "reward.terms=[{kind: python, fn: 'failing_rewards:fn'}]"],
                         cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("rlt2t train: error: rl: reward term python:failing_rewards:fn raised RuntimeError: the "
                           "reward service is down at failing_rewards.py:3 in fn `raise RuntimeError("
                           "\"the reward service is down\")` (first failing source: "), last
    assert "re-dispatching" not in out.stderr  # not retried: the same candidates would fail the same way


def test_rlt2t_serve_reward_serves_a_python_term_from_the_current_directory(tmp_path):
    (tmp_path / "served_mod.py").write_text("def words(sources, candidates, references, **row_fields):\n"
                                            "    return [float(len(c.split())) for c in candidates]\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RLT2T_API_TOKEN")}
    proc = subprocess.Popen([sys.executable, "-m", "rlt2t.cli", "serve", "reward", "--port", "0",
                             f"run.dir={tmp_path / 'run'}",
                             "reward.named={words: [{kind: python, fn: 'served_mod:words'}]}"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving reward on http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        with RewardClient(line.split()[-1]) as client:
            assert client.reward(["1 2 3", "4"], sources=["a", "b"], metrics=["words"]).scores == {"words": [3.0, 1.0]}
    finally:
        proc.terminate()
        proc.wait(30)


USER_REWARDS = '''
"""The user's reward: scores token overlap with the references (a sibling module) plus a bonus row field, and
records every call in a log, for the test to compare with what the job logs."""
import json

from overlap import token_overlap


def overlap_reward(sources, candidates, references, bonus, log=None):
    scores = [token_overlap(c, refs) + 0.25 * b for c, refs, b in zip(candidates, references, bonus)]
    if log:
        with open(log, "a") as f:
            for row in zip(sources, candidates, references, bonus, scores):
                f.write(json.dumps(dict(zip(("source", "candidate", "references", "bonus", "score"), row))) + "\\n")
    return scores
'''

OVERLAP = '''
def token_overlap(candidate, references):
    words = set(candidate.split())
    return max(len(words & set(r.split())) / max(len(set(r.split())), 1) for r in references)
'''


def test_a_python_reward_shipped_with_ray_job_submit_scores_on_a_two_node_cluster(copy_prepared, two_node_cluster,
                                                                                  tmp_path):
    """The user's module lives outside the package, in a project directory that `ray job submit --working-dir`
    ships to the cluster; the rewards the job logs equal that function's outputs on the same samples, row fields
    (an extra column of the data) included. With `metric.monitor=reward` the same function, on the validation
    rows' greedy outputs, picks the best checkpoint."""
    run = copy_prepared(tmp_path / "run")
    train = [e.to_dict() for e in load_examples(run / "data" / "train.jsonl")]
    atomic_write_jsonl(run / "data" / "train.jsonl", [{**row, "bonus": i % 3} for i, row in enumerate(train)])
    valid = [e.to_dict() for e in load_examples(run / "data" / "valid.jsonl")]
    atomic_write_jsonl(run / "data" / "valid.jsonl", [{**row, "bonus": 1} for row in valid])
    project, calls = tmp_path / "project", tmp_path / "calls.jsonl"
    project.mkdir()
    (project / "my_rewards.py").write_text(USER_REWARDS)
    (project / "overlap.py").write_text(OVERLAP)
    (project / "reward.yaml").write_text(textwrap.dedent(f"""
        reward:
          terms:
            - kind: python
              fn: my_rewards:overlap_reward
              params: {{log: {json.dumps(str(calls))}}}
    """))
    ray_bin = str(Path(sys.executable).with_name("ray"))
    job = two_node_cluster.run(
        [ray_bin, "job", "submit", "--address", two_node_cluster.dashboard, "--working-dir", str(project), "--",
         sys.executable, "-m", "rlt2t.cli", "train", "--config", "tiny", "--config", "reward.yaml", f"run.dir={run}",
         *ONE_STEP, "metric.monitor=reward"], timeout=420)
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-3000:]
    assert "succeeded" in (job.stdout + job.stderr).lower()

    logged = [json.loads(line) for line in (run / "logs" / "rl" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in logged if r["kind"] == "train" and r["step"] == 1)
    rows = [json.loads(line) for line in calls.read_text().splitlines()]
    rows, monitored = rows[: 16 * 4], rows[16 * 4 :]  # every sample of the step, scored once; then the monitor's
    assert [r["source"] for r in monitored] == [row["source"] for row in valid[:4]]  # metric.monitor_size=4
    assert all(r["bonus"] == 1 for r in monitored)
    epoch = next(r for r in logged if r["kind"] == "valid")
    assert epoch["monitor"] == pytest.approx(sum(r["score"] for r in monitored) / 4, rel=1e-9)
    best = read_checkpoint(run / "rl" / "checkpoints" / "epoch-0001").meta["best"]
    assert best["by"] == "reward" and best["path"].endswith("epoch-0001")
    bonuses: dict[str, set[int]] = {}
    for i, row in enumerate(train[:16]):  # rl.train_subset: the first 16 rows
        bonuses.setdefault(row["source"], set()).add(i % 3)
    assert {r["source"] for r in rows} == set(bonuses) and all(r["bonus"] in bonuses[r["source"]] for r in rows)
    sys.path.insert(0, str(project))
    try:
        from my_rewards import overlap_reward  # the same function, here, on the same samples
    finally:
        sys.path.remove(str(project))
    again = overlap_reward([r["source"] for r in rows], [r["candidate"] for r in rows],
                           [r["references"] for r in rows], [r["bonus"] for r in rows])
    assert again == [r["score"] for r in rows]
    assert len(set(again)) > 1
    assert step["reward_mean"] == pytest.approx(sum(again) / len(again), rel=1e-5)
