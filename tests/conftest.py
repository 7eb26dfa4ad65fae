"""Shared fixtures: a tiny id tokenizer and tiny BART policy built from config (no hub access)."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import uvicorn

from rlt2t.common.config import ModelConfig
from rlt2t.common.policy import load_policy
from rlt2t.common.tokenization import build_ids_tokenizer, save_tokenizer
from rlt2t.services.http import uvicorn_config

# Two cores, many small ops: extra threads only add contention in tests.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ids_tokenizer_dir(tmp_path_factory) -> Path:
    """An integer-id tokenizer: 60 data tokens, 4 sentinels (offset 10, 70 ids in all)."""
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(build_ids_tokenizer(num_data_tokens=60, num_sentinels=4), out)
    return out


@pytest.fixture
def tiny_policy(ids_tokenizer_dir):
    return load_policy(ModelConfig(preset="tiny", dropout=0.0), ids_tokenizer_dir, seed=0)


@pytest.fixture(autouse=True, scope="session")
def _quiet_transformers():
    from rlt2t.common.tracking import quiet_transformers

    quiet_transformers()


class LiveServer:
    """uvicorn serving ``app`` on a loopback port (0: a free one), in a thread; ``url`` once it accepts.
    With ``serve`` (a ServeConfig), the servers' own uvicorn settings (connection timeouts)."""

    def __init__(self, app, port: int = 0, serve=None) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = (uvicorn_config(app, serve, log_level="warning", lifespan="on") if serve is not None
                  else uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()


@pytest.fixture
def live_server() -> type[LiveServer]:
    """The LiveServer class: `with live_server(app) as s: httpx.get(s.url + ...)`."""
    return LiveServer
