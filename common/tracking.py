"""Run logs: JSONL metrics (one line per event, flushed) and TensorBoard event files, side by side.

``<run>/logs/<stage>/metrics.jsonl`` is the machine-readable record (plots and tests read it);
``<run>/logs/<stage>/tb/`` is for ``tensorboard --logdir <run>/logs``.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

from rlt2t.common.io import JsonlAppender


class _CurrentStderr(logging.StreamHandler):
    """A handler on whatever ``sys.stderr`` is when a record is written (a notebook's or a test's capture that
    replaced it since), not on the stream of the first ``setup_logging`` call, which may be closed by then."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def setup_logging(level: int = logging.INFO) -> None:
    """Readable single-line logs on stderr for the CLI (idempotent)."""
    root = logging.getLogger()
    if any(getattr(h, "_rlt2t", False) for h in root.handlers):
        return
    handler = _CurrentStderr()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    handler._rlt2t = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    quiet_transformers()


def quiet_transformers() -> None:
    """transformers' own progress bars and save/load chatter drown our logs; keep its errors only."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def scores_line(scores: dict[str, float], monitor_by: str | None) -> str:
    """An epoch's validation scores as its log line says them, the monitor named by what it scores:
    ``monitor (chrf)=0.2370, cider_d=…``."""
    return ", ".join(f"{k if k != 'monitor' else f'monitor ({monitor_by})'}={v:.4f}" for k, v in scores.items())


class RunLogger:
    """Writes scalar metrics to JSONL and TensorBoard under ``<log_dir>``."""

    def __init__(self, log_dir: str | Path, stage: str, tensorboard: bool = True):
        self.dir = Path(log_dir)
        self.stage = stage
        self._jsonl = JsonlAppender(self.dir / "metrics.jsonl")
        if self._jsonl.dropped_partial_line:
            logging.getLogger("rlt2t.tracking").warning("%s: cut off a line a crash left unfinished",
                                                        self._jsonl.path)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.dir / "tb"))

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        row = {"stage": self.stage, "kind": kind, "step": step, "time": round(time.time(), 3), **metrics}
        self._jsonl.write(row)
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    self._tb.add_scalar(f"{kind}/{k}", v, step)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
