"""Live servers: real uvicorn on 127.0.0.1 (port 0) + the typed clients; hot reload under traffic; the CLI."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rlt2t.common.checkpoint import save_checkpoint
from rlt2t.common.config import load_config
from rlt2t.services import policy_app, reward_app
from rlt2t.services.client import AsyncPolicyClient, PolicyClient, RequestError, RewardClient

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.setenv("RLT2T_API_TOKEN", "live-token")
    return load_config([], [f"run.dir={tmp_path}", "model.preset=tiny", "serve.reload_interval_s=0.2",
                            "serve.max_wait_ms=2"])


@pytest.fixture
def root(tmp_path, tiny_policy) -> Path:
    root = tmp_path / "checkpoints"
    save_checkpoint(root, "epoch-0001", model=tiny_policy.model, tokenizer=tiny_policy.tokenizer, step=1,
                    meta={"policy_version": 0})
    return root


def test_clients_against_live_servers(cfg, root, live_server):
    with live_server(policy_app.create_app(cfg, checkpoint_dir=root)) as policy, \
            live_server(reward_app.create_app(cfg)) as reward:
        with PolicyClient(policy.url, token="live-token") as c:
            assert c.healthz().status == "ok" and c.readyz().status == "ready"
            out = c.candidates(["11 12 13", "14 <sep> 15"], num_candidates=3, top_k=3, max_new_tokens=6)
            assert out.policy_version == 0 and [len(x) for x in out.candidates] == [3, 3]
            scored = c.score("11 12 13", [out.candidates[0][0].text])
            assert len(scored.scores[0].logprobs) == len(scored.scores[0].token_ids)
            pairs = c.pairs(["11 12 13"], ["14 15"], num_samples=2, max_new_tokens=5, seed=1)
            assert pairs.pairs[0].score_a >= pairs.pairs[0].score_b
            assert c.model().checkpoint.endswith("epoch-0001")
            with pytest.raises(RequestError) as bad:
                c._request("POST", "/v1/candidates", type(out), {"sources": ["1"], "num_candidates": 10_000})
            assert bad.value.status == 422 and bad.value.detail[0]["loc"] == ["body", "num_candidates"]
        with PolicyClient(policy.url, token="wrong", retries=0) as c, pytest.raises(RequestError) as denied:
            c.model()
        assert denied.value.status == 401

        async def concurrent():
            async with AsyncPolicyClient(policy.url, token="live-token") as c:
                outs = await asyncio.gather(*(c.candidates([f"{i} 1 2"], max_new_tokens=4) for i in range(12)))
            return outs

        assert all(len(o.candidates) == 1 for o in asyncio.run(concurrent()))
        with RewardClient(reward.url, token="live-token") as r:
            got = r.reward(["1 2 3 4", "9"], ["1 2 3 4", ["4", "9"]], metrics=["bleu4", "task_score"])
            assert got.scores["bleu4"][0] == pytest.approx(1.0) and len(got.scores["task_score"]) == 2


def test_hot_reload_under_traffic_fails_no_request(cfg, root, tiny_policy, live_server):
    app = policy_app.create_app(cfg, checkpoint_dir=root)
    versions: list[list[int]] = [[] for _ in range(4)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def hammer(i: int, url: str) -> None:
        with PolicyClient(url, token="live-token", retries=0) as c:
            while not stop.is_set():
                try:
                    out = c.candidates([f"{i} 11 12"], num_candidates=2, max_new_tokens=6)
                    versions[i].append(out.policy_version)
                except BaseException as e:  # noqa: BLE001 - any failure fails the test
                    errors.append(e)
                    return

    with live_server(app) as server:
        threads = [threading.Thread(target=hammer, args=(i, server.url)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        with torch.no_grad():
            for p in tiny_policy.model.parameters():
                p.mul_(1.1)
        save_checkpoint(root, "epoch-0002", model=tiny_policy.model, tokenizer=tiny_policy.tokenizer, step=2,
                        meta={"policy_version": 1})  # written aside and renamed into place
        deadline = time.monotonic() + 20
        while not all(v and v[-1] == 1 for v in versions) and time.monotonic() < deadline and not errors:
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(20)
    assert errors == []
    for v in versions:
        assert v[0] == 0 and v[-1] == 1, v
        assert v == sorted(v)  # once a client sees the new version it never sees the old one again
    assert app.state.watcher.reloads == 1


def test_cli_prints_the_url_and_stops_cleanly_on_sigterm(tmp_path, root):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RLT2T_API_TOKEN", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlt2t.cli", "serve", "policy", "--checkpoint-dir", str(root), "--port", "0",
         f"run.dir={tmp_path}", "model.preset=tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving policy on http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        url = line.split()[-1]
        with PolicyClient(url) as c:
            assert c.candidates(["1 2 3"], max_new_tokens=3).policy_version == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
