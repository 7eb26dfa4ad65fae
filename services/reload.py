"""Hot reload of the policy server: poll the checkpoint root, load the newest complete checkpoint in
the background, hand it to the batcher.

Only complete checkpoints are ever considered (``latest_complete_checkpoint`` checks the marker and
the size of every file it lists), so a checkpoint being written, or a directory copied half-way, is
skipped until it is whole. Loading happens on the watcher's own thread while the batcher keeps serving
the old weights; the swap itself happens between two batches (``Batcher.swap_backend``). A checkpoint
that fails to load is logged and not retried until it changes. A plain model directory (no checkpoint
marker) is served as is and not watched.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from rlt2t.common.checkpoint import MARKER, latest_complete_checkpoint, read_checkpoint
from rlt2t.services.backends import PolicyBackend

log = logging.getLogger("rlt2t.services.reload")

Loader = Callable[[Path], PolicyBackend]


def checkpoint_key(path: Path) -> tuple[str, float] | None:
    """Identity of a complete checkpoint: its path and marker write time (a rewrite changes it)."""
    info = read_checkpoint(path)
    return None if info is None else (str(info.path), float(info.meta.get("time", 0.0)))


def is_checkpoint_root(path: Path) -> bool:
    """True when ``path`` holds checkpoints to watch (not a plain model dir or a single checkpoint)."""
    return not (path / "config.json").is_file() and not (path / MARKER).is_file()


class CheckpointWatcher:
    """Polls ``root`` every ``interval_s`` seconds; calls ``install(loader(newest))`` on a newer one.

    ``current`` is the path of the checkpoint being served (so a restart does not reload it).
    """

    def __init__(self, root: str | Path, *, loader: Loader, install: Callable[[PolicyBackend], None],
                 interval_s: float, current: str | Path | None = None) -> None:
        self.root = Path(root)
        self.loader = loader
        self.install = install
        self.interval_s = interval_s
        self._current = checkpoint_key(Path(current)) if current is not None else None
        self._failed: tuple[str, float] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reloads = 0

    def check_once(self) -> bool:
        """Load and install the newest complete checkpoint if it is new; True when one was installed."""
        latest = latest_complete_checkpoint(self.root)
        if latest is None:
            return False
        key = checkpoint_key(latest)
        if key is None or key == self._current or key == self._failed:
            return False
        try:
            backend = self.loader(latest)
        except Exception:  # a bad checkpoint must not take the server down; keep serving the old one
            log.exception("could not load %s; still serving %s", latest, self._current[0] if self._current else "-")
            self._failed = key
            return False
        self.install(backend)
        self._current = key
        self.reloads += 1
        log.info("now serving %s (version %d)", latest, backend.version)
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
