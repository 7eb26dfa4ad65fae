"""The request gate's UTF-8 rule (services/http.py), on every server: a JSON body in UTF-16, UTF-32 or Latin-1
is a 415 naming UTF-8 before any route parses it (``json.loads`` would guess UTF-16 and UTF-32 from the bytes
and take them). The annotation app's share of it is in test_annotation_revisions.py."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from rlt2t.services import policy_app, reward_app
from rlt2t.services.http import RequestGate

ENCODINGS = ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "latin-1"]
JSON = {"content-type": "application/json"}


@pytest.fixture
def servers(serve_cfg, tmp_path):
    """The policy server (no checkpoint yet: the gate answers before the route would say 503) and the reward
    server."""
    (tmp_path / "empty").mkdir()
    with TestClient(policy_app.create_app(serve_cfg, checkpoint_dir=tmp_path / "empty")) as policy, \
            TestClient(reward_app.create_app(serve_cfg)) as reward:
        yield {"policy": (policy, "/v1/candidates", {"sources": ["é 1"], "max_new_tokens": 2}),
               "reward": (reward, "/v1/reward", {"candidates": ["é 1"], "references": ["é 1"]})}


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("server", ["policy", "reward"])
def test_a_body_not_in_utf8_is_a_415_naming_utf8(servers, server, encoding):
    client, path, body = servers[server]
    r = client.post(path, content=json.dumps(body, ensure_ascii=False).encode(encoding), headers=JSON)
    assert r.status_code == 415, r.text
    detail = r.json()["detail"]
    assert "UTF-8" in detail and "application/json" in detail


def test_the_same_body_in_utf8_passes_the_gate(servers):
    client, path, body = servers["reward"]
    r = client.post(path, content=json.dumps(body, ensure_ascii=False).encode("utf-8"), headers=JSON)
    assert r.status_code == 200, r.text
    client, path, body = servers["policy"]
    r = client.post(path, content=json.dumps(body, ensure_ascii=False).encode("utf-8"), headers=JSON)
    assert r.status_code == 503  # past the gate: the route says the model is not loaded yet


@pytest.fixture
def gated():
    app = FastAPI()

    @app.post("/json")
    async def take_json(request: Request) -> dict:
        return {"got": await request.json()}

    @app.post("/form")
    async def take_form(request: Request) -> dict:
        return {"got": (await request.body()).decode()}

    app.add_middleware(RequestGate, token=None, max_bytes=1000, body_timeout_s=5.0, form_paths=("/form",))
    with TestClient(app) as c:
        yield c


def test_the_gate_names_where_a_body_stops_being_utf8(gated):
    r = gated.post("/json", content=b'{"a": "\xff"}', headers=JSON)
    assert r.status_code == 415 and r.json()["detail"].startswith("request body is not UTF-8 (byte 0xff at offset 7)")
    r = gated.post("/json", content='{"a": 1}'.encode("utf-16-le"), headers=JSON)
    assert r.status_code == 415 and "NUL byte at offset 1 (UTF-16 or UTF-32?)" in r.json()["detail"]
    assert gated.post("/json", content='{"a": "é"}'.encode(), headers=JSON).json() == {"got": {"a": "é"}}


def test_form_paths_take_a_utf8_form_and_nothing_else(gated):
    form = {"content-type": "application/x-www-form-urlencoded"}
    assert gated.post("/form", content=b"a=%C3%A9", headers=form).json() == {"got": "a=%C3%A9"}
    r = gated.post("/form", content=b'{"a": 1}', headers=JSON)
    assert r.status_code == 415 and "application/x-www-form-urlencoded" in r.json()["detail"]
    r = gated.post("/form", content="a=é".encode("latin-1"), headers=form)
    assert r.status_code == 415 and "UTF-8" in r.json()["detail"]
    r = gated.post("/json", content=b"a=1", headers=form)  # a form anywhere else is not JSON
    assert r.status_code == 415 and "application/json" in r.json()["detail"]
