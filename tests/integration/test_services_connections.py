"""Live uvicorn on loopback, raw sockets: connections that send nothing, half a head or half a body, and
idle keep-alive connections are closed on time (#18.6); a client that disconnects is dropped from its
running model call (#18.2); HEAD /healthz."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
import torch

from rlt2t.common.checkpoint import save_checkpoint
from rlt2t.common.config import load_config
from rlt2t.services import policy_app, reward_app

pytestmark = pytest.mark.integration

TIMEOUT = 0.5


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.delenv("RLT2T_API_TOKEN", raising=False)
    return load_config([], [f"run.dir={tmp_path}", "model.preset=tiny", "serve.max_wait_ms=0",
                            f"serve.header_timeout_s={TIMEOUT}", f"serve.body_timeout_s={TIMEOUT}",
                            f"serve.keepalive_timeout_s={TIMEOUT}"])


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took. A close that finds
    bytes of the client's still unread (its event loop had not got to them: two busy cores) reaches the client
    as a reset instead of an end of stream; both are the close."""
    start, data = time.monotonic(), b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data, time.monotonic() - start


def test_slow_heads_half_bodies_and_idle_connections_are_closed(cfg, live_server):
    with live_server(reward_app.create_app(cfg), serve=cfg.serve) as server:
        silent, half_head, half_body = connect(server.url), connect(server.url), connect(server.url)
        many = [connect(server.url) for _ in range(50)]  # the 500 half-open connections, scaled down
        half_head.sendall(b"POST /v1/reward HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        half_body.sendall(b"POST /v1/reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"candidates\": [")
        for sock in many:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        for sock in (silent, half_head, *many):
            data, waited = read_until_closed(sock)
            assert data == b"" and waited < TIMEOUT + 2
        data, waited = read_until_closed(half_body)
        assert data.startswith(b"HTTP/1.1 408 ") and b"serve.body_timeout_s" in data and waited < TIMEOUT + 2

        idle = connect(server.url)
        idle.sendall(b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        data, waited = read_until_closed(idle)  # answered, then closed once idle for keepalive_timeout_s
        assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"\r\n\r\n")  # HEAD: no body
        assert TIMEOUT * 0.8 < waited < TIMEOUT + 2

        # A keep-alive client pausing less than the timeouts between requests keeps its connection, however
        # long it lives: the head timer runs from each response, not from the connection.
        steady = connect(server.url)
        steady.settimeout(5)
        for _ in range(4):
            steady.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            while not data.endswith(b'{"status":"ok"}'):
                chunk = steady.recv(65536)
                assert chunk, "the server closed a connection that was not idle"
                data += chunk
            assert data.startswith(b"HTTP/1.1 200 ")
            time.sleep(TIMEOUT * 0.6)
        steady.close()


def test_a_client_that_disconnects_is_dropped_from_its_running_call(cfg, tmp_path, tiny_policy, live_server):
    with torch.no_grad():  # no EOS: every row decodes to max_new_tokens
        tiny_policy.model.final_logits_bias[0, tiny_policy.tokenizer.eos_token_id] = -1e4
    root = tmp_path / "checkpoints"
    save_checkpoint(root, "epoch-0001", model=tiny_policy.model, tokenizer=tiny_policy.tokenizer, step=1)
    cfg.serve.max_call_cost = 10**6
    body = {"sources": ["1 2 3"] * 8, "num_candidates": 6, "max_new_tokens": 255, "temperature": 100.0}
    app = policy_app.create_app(cfg, checkpoint_dir=root)
    with live_server(app, serve=cfg.serve) as server, httpx.Client(base_url=server.url) as http:
        t0 = time.perf_counter()
        assert http.post("/v1/candidates", json=body, timeout=60).status_code == 200
        full_s = time.perf_counter() - t0
        first_call_s = call_seconds(http.get("/metrics").text)
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            http.post("/v1/candidates", json=body, timeout=0.1 * full_s)
        deadline = time.monotonic() + 20
        while 'status="499"' not in (text := http.get("/metrics").text) or "batch_seconds_count 2.0" not in text:
            assert time.monotonic() < deadline, "the disconnect was never noticed"
            time.sleep(0.02)
    dropped_call_s = call_seconds(text) - first_call_s
    assert dropped_call_s < 0.5 * first_call_s, (first_call_s, dropped_call_s)


def call_seconds(metrics_text: str) -> float:
    """Seconds spent in model calls so far (the batch-time histogram's sum)."""
    return float(next(line.split()[-1] for line in metrics_text.splitlines()
                      if line.startswith("rlt2t_policy_batch_seconds_sum")))
