"""Fixtures of the service tests: a tiny checkpoint on disk and a config that serves it."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlt2t.common.checkpoint import save_checkpoint
from rlt2t.common.config import Config, load_config


@pytest.fixture
def checkpoint_root(tmp_path, tiny_policy) -> Path:
    """A checkpoint root holding epoch-0001 (step 1, policy_version 0) of the tiny policy."""
    root = tmp_path / "checkpoints"
    save_checkpoint(root, "epoch-0001", model=tiny_policy.model, tokenizer=tiny_policy.tokenizer, step=1,
                    meta={"policy_version": 0})
    return root


@pytest.fixture
def serve_cfg(tmp_path, monkeypatch) -> Config:
    """Tiny-preset config; no bearer token unless a test sets one."""
    monkeypatch.delenv("RLT2T_API_TOKEN", raising=False)
    return load_config([], [f"run.dir={tmp_path}", "model.preset=tiny", "serve.max_wait_ms=0",
                            "serve.max_sources_per_call=8", "serve.max_candidates_per_source=6",
                            "serve.max_tokens_per_source=40",
                            "rollout.num_samples=6"])  # /v1/pairs' default K, within the cap of 6
