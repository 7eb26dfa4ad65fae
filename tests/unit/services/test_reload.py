"""Hot reload: the watcher installs only newer *complete* checkpoints, keeps serving on a bad one, and the
app reports the new version afterwards."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import torch
from fastapi.testclient import TestClient

from rlt2t.common.checkpoint import MARKER, save_checkpoint
from rlt2t.services.backends import checkpoint_version
from rlt2t.services.policy_app import create_app
from rlt2t.services.reload import CheckpointWatcher


def perturbed(policy, seed: int):
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in policy.model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    return policy


def test_watcher_installs_newer_complete_checkpoints_only(checkpoint_root, tiny_policy):
    installed, loaded = [], []

    def loader(path):
        loaded.append(path.name)
        if path.name == "epoch-0003":
            raise OSError("corrupt weights")
        return SimpleNamespace(name=path.name, version=int(path.name[-4:]))

    w = CheckpointWatcher(checkpoint_root, loader=loader, install=lambda b: installed.append(b.name), interval_s=1,
                          current=checkpoint_root / "epoch-0001")
    assert not w.check_once() and loaded == []  # already serving the newest
    # A half-written checkpoint: the marker lists a file size the directory does not match.
    partial = checkpoint_root / "epoch-0002"
    shutil.copytree(checkpoint_root / "epoch-0001", partial)
    marker = json.loads((partial / MARKER).read_text())
    marker["step"] = 2
    marker["files"]["model.safetensors"] += 1
    (partial / MARKER).write_text(json.dumps(marker))
    (checkpoint_root / ".tmp-epoch-0004-x").mkdir()  # an atomic write in progress
    assert not w.check_once() and loaded == []
    save_checkpoint(checkpoint_root, "epoch-0002", model=tiny_policy.model, tokenizer=tiny_policy.tokenizer, step=2)
    assert w.check_once() and installed == ["epoch-0002"]
    save_checkpoint(checkpoint_root, "epoch-0003", model=tiny_policy.model, tokenizer=tiny_policy.tokenizer, step=3)
    assert not w.check_once() and not w.check_once()  # the failing one is tried once, not in a loop
    assert loaded == ["epoch-0002", "epoch-0003"] and installed == ["epoch-0002"] and w.reloads == 1


def test_version_is_policy_version_else_step(tmp_path, tiny_policy, checkpoint_root):
    assert checkpoint_version(checkpoint_root / "epoch-0001") == 0  # policy_version 0 beats step 1
    plain = save_checkpoint(tmp_path, "step-000007", model=tiny_policy.model, tokenizer=tiny_policy.tokenizer, step=7)
    assert checkpoint_version(plain) == 7
    tiny_policy.model.save_pretrained(tmp_path / "hf")
    assert checkpoint_version(tmp_path / "hf") == 0


def test_app_swaps_to_the_new_checkpoint(serve_cfg, checkpoint_root, tiny_policy):
    app = create_app(serve_cfg, checkpoint_dir=checkpoint_root)
    body = {"sources": ["11 12 13"], "num_candidates": 2, "max_new_tokens": 6, "seed": 1}
    with TestClient(app) as c:
        before = c.post("/v1/candidates", json=body).json()
        checksum = c.get("/v1/model").json()["checksum"]
        save_checkpoint(checkpoint_root, "epoch-0002", model=perturbed(tiny_policy, 3).model,
                        tokenizer=tiny_policy.tokenizer, step=2, meta={"policy_version": 1})
        assert app.state.watcher.check_once()
        after = c.post("/v1/candidates", json=body).json()
        info = c.get("/v1/model").json()
        assert "rlt2t_policy_reloads_total 1.0" in c.get("/metrics").text
    assert (before["policy_version"], after["policy_version"]) == (0, 1)
    assert info["version"] == 1 and info["checkpoint"].endswith("epoch-0002") and info["checksum"] != checksum
    assert after["candidates"] != before["candidates"]  # new weights, same seed


def test_hot_reload_never_goes_back_on_its_own(serve_cfg, checkpoint_root, tiny_policy, caplog):
    """The issue's reproducer: the served (newest) checkpoint is deleted while an older one remains. The
    server keeps serving what it loaded, says so in /v1/model and the log; POST /v1/reload is the explicit
    way back; a newer checkpoint is still picked up by itself."""
    save_checkpoint(checkpoint_root, "epoch-0002", model=perturbed(tiny_policy, 3).model,
                    tokenizer=tiny_policy.tokenizer, step=2, meta={"policy_version": 1})
    app = create_app(serve_cfg, checkpoint_dir=checkpoint_root)
    body = {"sources": ["11 12 13"], "num_candidates": 2, "max_new_tokens": 6, "seed": 1}
    with TestClient(app) as c:
        assert c.get("/v1/model").json()["version"] == 1
        before = c.post("/v1/candidates", json=body).json()
        shutil.rmtree(checkpoint_root / "epoch-0002")
        with caplog.at_level("WARNING", logger="rlt2t.services.reload"):
            assert not app.state.watcher.check_once() and not app.state.watcher.check_once()
        info = c.get("/v1/model").json()
        assert info["version"] == 1 and info["checkpoint"].endswith("epoch-0002") and info["on_disk"] is False
        assert "epoch-0001" in info["note"] and "POST /v1/reload" in info["note"]
        assert c.post("/v1/candidates", json=body).json() == before  # the loaded weights, still served
        warnings = [r.getMessage() for r in caplog.records]
        assert sum("is gone from disk" in m for m in warnings) == 1  # said once, not at every poll
        assert sum("not going back on my own" in m for m in warnings) == 1

        back = c.post("/v1/reload")  # the operator's decision
        assert back.status_code == 200, back.text
        assert back.json()["version"] == 0 and back.json()["checkpoint"].endswith("epoch-0001")
        assert back.json()["on_disk"] is True and back.json()["note"] is None
        assert c.post("/v1/candidates", json=body).json()["policy_version"] == 0

        save_checkpoint(checkpoint_root, "epoch-0003", model=tiny_policy.model, tokenizer=tiny_policy.tokenizer,
                        step=3, meta={"policy_version": 2})
        assert app.state.watcher.check_once()  # forward is still automatic
        assert c.get("/v1/model").json()["version"] == 2
        assert c.post("/v1/reload").status_code == 200  # already the newest: nothing to change, not an error

        # every checkpoint deleted: nothing to load, and the answer says what is still served
        for ckpt in checkpoint_root.iterdir():
            shutil.rmtree(ckpt)
        r = c.post("/v1/reload")  # at once, before the watcher's next poll has seen it
        assert r.status_code == 409, r.text
        assert f"no complete checkpoint under {checkpoint_root}" in r.json()["detail"]
        assert "still serving" in r.json()["detail"] and "epoch-0003" in r.json()["detail"]
        assert c.post("/v1/candidates", json=body).json()["policy_version"] == 2


def test_reload_route_without_a_checkpoint_root_is_a_409(serve_cfg, checkpoint_root):
    with TestClient(create_app(serve_cfg, checkpoint_dir=checkpoint_root / "epoch-0001")) as c:
        r = c.post("/v1/reload")
    assert r.status_code == 409 and "single model directory" in r.json()["detail"]
