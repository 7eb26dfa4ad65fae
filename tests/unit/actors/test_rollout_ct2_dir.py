"""The CTranslate2 work directory of a rollout worker: named for its process, and swept by a later worker
when that process died without close() (a SIGKILL left a whole converted model in the temporary dir)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rlt2t.actors.rollout import RolloutWorker, sweep_stale_ct2_dirs
from rlt2t.common.config import ModelConfig, RolloutConfig


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_sweep_removes_directories_of_dead_pids_and_keeps_the_rest(tmp_path):
    dead = tmp_path / f"rlt2t-ct2-{dead_pid()}-ab_12x"
    live = tmp_path / f"rlt2t-ct2-{os.getpid()}-cd34yz"
    legacy = tmp_path / "rlt2t-ct2-abc123_9"  # no pid in the name: not ours to judge
    other = tmp_path / "something-else-1"
    for d in (dead, live, legacy, other):
        (d / "current").mkdir(parents=True)
        (d / "current" / "model.bin").write_bytes(b"x" * 16)
    assert sweep_stale_ct2_dirs(str(tmp_path)) == [str(dead)]
    assert not dead.exists()
    assert live.is_dir() and legacy.is_dir() and other.is_dir()


def test_a_ct2_worker_names_its_directory_for_its_pid_and_sweeps_first(ids_tokenizer_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = tmp_path / f"rlt2t-ct2-{dead_pid()}-zz9"
    stale.mkdir()
    worker = RolloutWorker(ModelConfig(preset="tiny", family="bart", dropout=0.0), str(ids_tokenizer_dir),
                           RolloutConfig(backend="ct2", num_samples=2, max_new_tokens=4), seed=0, max_source_len=16)
    try:
        assert not stale.exists()
        assert worker._ct2_dir is not None
        own = Path(worker._ct2_dir.name)
        assert own.parent == tmp_path and own.name.startswith(f"rlt2t-ct2-{os.getpid()}-")
        assert sweep_stale_ct2_dirs(str(tmp_path)) == [] and own.is_dir()
    finally:
        worker.close()
