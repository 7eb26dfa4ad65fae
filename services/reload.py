"""Hot reload of the policy server: poll the checkpoint root, load a newer complete checkpoint in the
background, hand it to the batcher. It never goes backwards on its own.

Only complete checkpoints are ever considered (``complete_checkpoints`` checks the marker and the size
of every file it lists), so a checkpoint being written, or a directory copied half-way, is skipped until
it is whole. "Newer" is the checkpoint order (step, then marker time): a checkpoint is loaded only when
it comes after the one being served. Loading happens on the watcher's own thread while the batcher keeps
serving the old weights; the swap itself happens between two model calls (``Batcher.swap_backend``). A
checkpoint that fails to load is logged and not retried until it changes.

If the served checkpoint disappears from disk (deleted, pruned, a run restarted over it), the server keeps
serving the weights it has loaded, logs it once, and says so in ``/v1/model`` (``on_disk: false`` and a
note naming the newest one left): serving an older checkpoint is an operator's decision, made with
:meth:`CheckpointWatcher.load_newest` (``POST /v1/reload``) or a restart. A plain model directory (no
checkpoint marker) is served as is and not watched.

A reward model's watcher (``follow_best``) serves instead the checkpoint the root's newest records as its best
(else the newest), as the RL job loads a reward model from a root: it follows the best as training records
another, back to an older checkpoint when that is the best.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from rlt2t.common.checkpoint import MARKER, CheckpointInfo, best_of, complete_checkpoints, read_checkpoint

log = logging.getLogger("rlt2t.services.reload")

class Versioned(Protocol):
    @property
    def version(self) -> int:
        """The policy version (or training step) of the loaded weights."""
        ...


Served = TypeVar("Served", bound=Versioned)
"""What a checkpoint loads into: a policy backend, or a reward model."""


def checkpoint_key(path: Path) -> tuple[str, float] | None:
    """Identity of a complete checkpoint: its path and marker write time (a rewrite changes it)."""
    info = read_checkpoint(path)
    return None if info is None else _key(info)


def _key(info: CheckpointInfo) -> tuple[str, float]:
    return str(info.path), float(info.meta.get("time", 0.0))


def _order(info: CheckpointInfo) -> tuple[int, float]:
    """Where a checkpoint stands among others: the order ``complete_checkpoints`` sorts by."""
    return info.step, float(info.meta.get("time", 0.0))


def is_checkpoint_root(path: Path) -> bool:
    """True when ``path`` holds checkpoints to watch (not a plain model dir or a single checkpoint)."""
    return not (path / "config.json").is_file() and not (path / MARKER).is_file()


class CheckpointWatcher(Generic[Served]):
    """Polls ``root`` every ``interval_s`` seconds; calls ``install(loader(newest))`` on a newer one (with
    ``follow_best``, ``install(loader(best))`` when the recorded best changes).

    ``current`` is the path of the checkpoint being served (so a restart does not reload it).
    """

    def __init__(self, root: str | Path, *, loader: Callable[[Path], Served], install: Callable[[Served], None],
                 interval_s: float, current: str | Path | None = None, follow_best: bool = False) -> None:
        self.root = Path(root)
        self.follow_best = follow_best
        """Serve the checkpoint the root's newest one records as its best (else the newest), as the RL job
        loads a reward model: a reward model in training is served at its best held-out accuracy, and the
        served one may go back to an older checkpoint when that is the best."""
        self.loader = loader
        self.install = install
        self.interval_s = interval_s
        info = read_checkpoint(current) if current is not None else None
        self._current: CheckpointInfo | None = info
        self._failed: tuple[str, float] | None = None
        self._lock = threading.Lock()  # the poll thread and POST /v1/reload
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reloads = 0
        self.note: str | None = None
        """Why the newest checkpoint on disk is not being served (None when it is, or none exists)."""
        self.on_disk = True
        """False once the served checkpoint has disappeared from disk."""

    def check_once(self) -> bool:
        """Load and install the newest complete checkpoint if it comes after the served one; True when one
        was installed. A served checkpoint that has disappeared is noted, and nothing older is loaded."""
        with self._lock:
            infos = complete_checkpoints(self.root)
            newest = infos[-1] if infos else None
            current = self._current
            self._check_on_disk()
            if self.follow_best and newest is not None:
                best = best_of(infos)
                return False if current is not None and _key(best) == _key(current) else self._load(best)
            if newest is None:
                self.note = None if self.on_disk else "the served checkpoint was deleted; no other on disk"
                return False
            if current is not None and _order(newest) <= _order(current):
                older = _key(newest) != _key(current)
                note = (f"newest checkpoint on disk, {newest.path}, is older than the one served; serving it is "
                        "POST /v1/reload or a restart" if older else None)
                if note is not None and note != self.note:
                    log.warning("not going back on my own: %s", note)
                self.note = note
                return False
            return self._load(newest)

    def load_newest(self) -> bool:
        """The operator's choice: load the newest complete checkpoint even when it is older than the one
        served (after the served one was deleted). True when one was installed; False when the root holds
        none, or the newest is the one being served. Raises what the loader raises."""
        with self._lock:
            infos = complete_checkpoints(self.root)
            self._check_on_disk()  # as of now, not of the last poll
            if not infos or (self._current is not None and _key(infos[-1]) == _key(self._current)
                             and self.on_disk):
                return False
            self._failed = None
            return self._load(infos[-1], raise_errors=True)

    def _check_on_disk(self) -> None:
        """Update ``on_disk`` for the served checkpoint (under the lock), warning once when it has gone."""
        current = self._current
        if current is None:
            return
        on_disk = checkpoint_key(current.path) == _key(current)
        if on_disk != self.on_disk:
            self.on_disk = on_disk
            if not on_disk:
                log.warning("the served checkpoint %s is gone from disk; still serving its weights (loaded in "
                            "memory)", current.path)

    def _load(self, info: CheckpointInfo, raise_errors: bool = False) -> bool:
        key = _key(info)
        if key == self._failed:
            return False
        try:
            backend = self.loader(info.path)
        except Exception:  # a bad checkpoint must not take the server down; keep serving the old one
            log.exception("could not load %s; still serving %s", info.path,
                          self._current.path if self._current else "-")
            self._failed = key
            if raise_errors:
                raise
            return False
        self.install(backend)
        self._current, self.on_disk, self.note = info, True, None
        self.reloads += 1
        log.info("now serving %s (version %d)", info.path, backend.version)
        return True

    def start(self) -> None:
        """Poll on a daemon thread until :meth:`stop`."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="rlt2t-reload", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check_once()
            except Exception:  # e.g. the root vanished for a moment: try again next tick
                log.exception("checkpoint poll of %s failed", self.root)
