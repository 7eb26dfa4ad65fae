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
