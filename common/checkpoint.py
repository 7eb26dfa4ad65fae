"""Checkpoint store: atomic, consistently named, never read half-written.

A checkpoint is a directory ``<root>/<name>`` (``epoch-0003``, ``step-000120``) that is also a
Hugging Face model directory (``from_pretrained`` works on it) with the tokenizer, plus
``training_state.pt`` (optimizer, scheduler, RNG) and ``rlt2t_checkpoint.json`` (step, epoch, data
position, metrics, the file list). It is written in a ``.tmp-*`` sibling and renamed into place; the
marker file lists every file with its size, so a directory copied or written by anything else
half-way is recognised as incomplete and skipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlt2t.common.io import atomic_directory
from rlt2t.common.tokenization import save_tokenizer

log = logging.getLogger("rlt2t.checkpoint")

MARKER = "rlt2t_checkpoint.json"
STATE_FILE = "training_state.pt"
_NAME = re.compile(r"^(epoch-\d{4}|step-\d{6}|final)$")


def checkpoint_name(*, epoch: int | None = None, step: int | None = None) -> str:
    """``epoch-0003`` for end-of-epoch checkpoints, ``step-000120`` for mid-epoch ones."""
    if (epoch is None) == (step is None):
        raise ValueError("give exactly one of epoch or step")
    return f"epoch-{epoch:04d}" if epoch is not None else f"step-{step:06d}"


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    meta: dict[str, Any]


def check_schedule_length(stage: str, resume_from: CheckpointInfo, total_steps: int, settings: str,
                          restart: str) -> None:
    """ValueError when ``resume_from`` was written for a learning-rate schedule of another length than
    ``total_steps``: the restored scheduler keeps its own length, so a longer run would train its extra steps at
    the floor rate, and a resumed RL epoch would sample other sources than the checkpoint's. ``settings`` names
    what sets the length, ``restart`` how to start the stage over."""
    planned = resume_from.meta.get("total_steps")
    if planned is not None and planned != total_steps:
        raise ValueError(f"{stage}: {resume_from.path} belongs to a schedule of {planned} steps, these settings "
                         f"give {total_steps} ({settings} or the data changed); resume with the settings it was "
                         f"trained with, or start the stage over ({restart})")


def weights_checksum(model_dir: str | Path) -> str:
    """sha256 over a model directory's weight files (safetensors / bin, by name; the training state and the
    marker are not weights): the one identity of a set of weights (export provenance, served version, caches)."""
    digest = hashlib.sha256()
    files = sorted(p for p in Path(model_dir).iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin")
                   and p.name not in (STATE_FILE, MARKER) and not p.name.startswith("."))
    for path in files:
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


@dataclass
class BestCheckpoint:
    """The best checkpoint of a stage by its validation monitor, carried across resumes in checkpoint meta
    (``meta["best"] = {"score", "path", "by"}``) and protected from pruning. ``by`` names what the monitor
    measures (``metric.monitor``, ``loss``): scores by another measure do not compare."""

    score: float | None = None
    path: Path | None = None
    by: str | None = None

    @classmethod
    def from_meta(cls, meta: dict[str, Any] | None, by: str | None = None) -> BestCheckpoint:
        """The best a resumed run had found; none (a warning) when it was chosen by another measure than ``by``
        (the run resumed with another ``metric.monitor``): its score does not compare with this run's."""
        best = (meta or {}).get("best")
        if not best:
            return cls(by=by)
        if by is not None and best.get("by") not in (None, by):
            log.warning("the best checkpoint so far (%s) was chosen by monitor %s, and this run's monitor is %s: the "
                        "best starts afresh from the next validation, and %s is no longer kept from pruning (copy it "
                        "if you want it)", Path(best["path"]).name, best["by"], by, best["path"])
            return cls(by=by)
        return cls(best["score"], Path(best["path"]), by if by is not None else best.get("by"))

    def offer(self, score: float, path: Path) -> bool:
        """Take ``path`` if its score beats the best so far; returns whether it did."""
        if self.score is None or score > self.score:
            self.score, self.path = score, Path(path)
            return True
        return False

    def meta(self) -> dict[str, Any] | None:
        return {"score": self.score, "path": str(self.path), "by": self.by} if self.path is not None else None

    def protect(self) -> set[Path]:
        return {self.path} if self.path is not None else set()


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: str | Path,
    name: str,
    *,
    model,
    tokenizer,
    step: int,
    meta: dict[str, Any] | None = None,
    training_state: dict[str, Any] | None = None,
    fill: Callable[[Path], None] | None = None,
) -> Path:
    """Write a complete checkpoint atomically; returns its path.

    ``training_state`` holds whatever exact resume needs (optimizer/scheduler state dicts, RNG);
    ``meta`` is small JSON (epoch, data position, metrics) read without loading tensors. ``fill(directory)``
    writes more files into the checkpoint before it is marked complete (the other ranks' states of a stage on
    several ranks); the marker lists them with the rest.
    """
    if not _NAME.match(name):
        raise ValueError(f"checkpoint name {name!r} does not match epoch-NNNN / step-NNNNNN / final")
    target = Path(root) / name
    with atomic_directory(target) as tmp:
        model.save_pretrained(tmp)
        save_tokenizer(tokenizer, tmp)
        if training_state is not None:
            torch.save(training_state, tmp / STATE_FILE)
        if fill is not None:
            fill(tmp)
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        marker = {"name": name, "step": step, "time": time.time(), "files": files, **(meta or {})}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    return target


def read_checkpoint(path: str | Path) -> CheckpointInfo | None:
    """The checkpoint at ``path`` if it is complete, else None (never raises on a partial one)."""
    path = Path(path)
    if path.name.startswith(".") or not path.is_dir():
        return None
    try:
        meta = json.loads((path / MARKER).read_text())
        for rel, size in meta["files"].items():
            if (path / rel).stat().st_size != size:
                return None
        return CheckpointInfo(path=path, step=int(meta["step"]), meta=meta)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def complete_checkpoint(path: str | Path) -> CheckpointInfo:
    """The checkpoint at ``path``, which must be complete (FileNotFoundError naming it otherwise)."""
    info = read_checkpoint(path)
    if info is None:
        raise FileNotFoundError(f"{path}: not a complete checkpoint")
    return info


def complete_checkpoints(root: str | Path) -> list[CheckpointInfo]:
    """Complete checkpoints under ``root``, oldest first (by step, then write time)."""
    root = Path(root)
    if not root.is_dir():
        return []
    infos = [i for p in root.iterdir() if _NAME.match(p.name) and (i := read_checkpoint(p)) is not None]
    return sorted(infos, key=lambda i: (i.step, i.meta.get("time", 0.0)))


def latest_complete_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None. Partial directories are skipped."""
    infos = complete_checkpoints(root)
    return infos[-1].path if infos else None


def resume_point(root: str | Path, resume: bool, *, elsewhere: str = "use another run.dir") -> Path | None:
    """Where a stage writing checkpoints under ``root`` starts: with ``resume`` its newest complete checkpoint
    (None when there is none yet); without, None, and FileExistsError when ``root`` already holds checkpoints
    (a new run would write over them). ``elsewhere`` says where else the run may go."""
    root = Path(root)
    if resume:
        return latest_complete_checkpoint(root)
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"{root} already holds checkpoints; pass --resume (resume=True in Python) to continue "
                              f"(with the settings it was written with), {elsewhere}, or remove {root.parent} to "
                              "start it over")
    return None


def best_or_latest(ckpt_root: str | os.PathLike[str]) -> Path:
    """The checkpoint the stage's monitor picked as best (recorded in its newest complete checkpoint), else the
    newest complete one."""
    infos = complete_checkpoints(Path(ckpt_root))
    if not infos:
        raise FileNotFoundError(f"{Path(ckpt_root)}: no complete checkpoint")
    return best_of(infos).path


def best_of(infos: Sequence[CheckpointInfo]) -> CheckpointInfo:
    """Of a root's complete checkpoints (oldest first, :func:`complete_checkpoints`), the one the newest records
    as its best, else the newest. Recorded paths are spelled as the run.dir of the run that wrote them (relative,
    or a place the run has since moved from): the best is found by its name."""
    best = (infos[-1].meta.get("best") or {}).get("path")
    name = Path(best).name if best else None
    return next((info for info in infos if info.path.name == name), infos[-1])


def best_beside(checkpoint: Path) -> Path:
    """The best checkpoint of the stage ``checkpoint`` is one of (:func:`best_or_latest` of its root), or
    ``checkpoint`` itself when it is not in a checkpoint root: a stage result's ``best``."""
    root = checkpoint.parent
    return best_or_latest(root) if root.name == "checkpoints" else checkpoint


def checkpoint_by_name(ckpt_root: Path, recorded: str) -> Path | None:
    """The complete checkpoint of ``recorded``'s name under ``ckpt_root``, or None. Recorded paths are spelled
    as the run.dir of the run that wrote them (relative, or a place the run has since moved from)."""
    path = ckpt_root / Path(recorded).name
    return path if read_checkpoint(path) is not None else None


def resolve_model_dir(path: str | os.PathLike[str]) -> Path:
    """A model directory or checkpoint itself, or, for a checkpoint root, the checkpoint its stage's monitor
    picked as best, else its newest complete one (:func:`best_or_latest`): what eval, export, predict and a
    stage's ``--init`` load from a root. A server following a training run reads the newest itself."""
    path = Path(path)
    if (path / "config.json").is_file() and not path.joinpath(MARKER).exists():
        return path  # a plain HF directory
    if read_checkpoint(path) is not None:
        return path
    try:
        return best_or_latest(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: neither a model directory nor a directory of complete checkpoints") from None


def load_training_state(path: str | Path, *, mmap: bool = False) -> dict[str, Any]:
    """A checkpoint's training state. ``mmap``: its tensors map the file instead of being read (copy-on-write),
    so a reader that needs a part of it (one learner rank's state, the list of published versions) does not
    hold the rest in memory."""
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no {STATE_FILE}; this checkpoint cannot resume training")
    return torch.load(file, map_location="cpu", weights_only=False, mmap=mmap)


def prune_checkpoints(root: str | Path, keep_last: int, protect: set[Path] | frozenset = frozenset()) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (and never those in ``protect``).
    Protected checkpoints are matched by name under ``root``: a run resumed with its directory spelled
    otherwise (relative, absolute, moved) still keeps its best one."""
    infos = complete_checkpoints(root)
    keep = {Path(p).name for p in protect}
    doomed = [i.path for i in infos[: max(0, len(infos) - keep_last)] if i.path.name not in keep]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
        log.info("removed old checkpoint %s", p)
    return doomed
