"""Crash-safe file writing: everything rlt2t persists goes through here.

A reader never sees a half-written file or directory: content is written under a temporary
name in the same directory, flushed and fsync'ed, then renamed into place (``os.replace`` is
atomic on POSIX within one filesystem).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any


def _read_umask() -> int:
    mask = os.umask(0)  # the only way to read it; set straight back
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # once, at import: setting it to read it would race with threads creating files


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem allows opening a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8", *,
                private: bool = False) -> Iterator[IO[Any]]:
    """Open ``path`` for writing; the file appears under its name only if the block succeeds. ``private``: the
    owner alone may read it, from its first byte (secrets); otherwise the umask decides, as for open()."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file owner-only; a plain open() would honour the umask (a run directory shared by
        # a group, a server running as another user, must read what is written here)
        os.fchmod(fd, 0o600 if private else 0o666 & ~_UMASK)
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str, *, private: bool = False) -> None:
    with atomic_open(path, private=private) as f:
        f.write(text)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def atomic_write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> int:
    """Write one JSON object per line; returns the number of rows written."""
    n = 0
    with atomic_open(path) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
            n += 1
    return n


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling directory that is renamed to ``path`` when the block succeeds.

    An existing ``path`` is replaced (moved aside to a uniquely named ``.old-NAME-*``, then deleted) only after
    the new one is complete. Temporary directories start with ``.tmp-`` so scanners can ignore them. What a
    killed earlier write left behind is dealt with first: a ``path`` that a kill between the two renames left
    missing comes back from its ``.old-NAME-*`` copy, other such copies are deleted.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _recover_old_copies(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))
    old: Path | None = None
    try:
        os.chmod(tmp, 0o777 & ~_UMASK)  # mkdtemp makes it owner-only (see atomic_open)
        yield tmp
        for sub in tmp.rglob("*"):
            if sub.is_file():
                with open(sub, "rb") as f:
                    os.fsync(f.fileno())
        if path.exists():
            # a fresh name: a leftover of a killed run (with this pid, say) cannot be in the way
            old = path.parent / f".old-{path.name}-{os.getpid()}-{secrets.token_hex(4)}"
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        if old is not None and old.exists() and not path.exists():  # interrupted between the two renames
            os.replace(old, path)
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _recover_old_copies(path: Path) -> None:
    """Before writing ``path``: the newest ``.old-NAME-<pid>-<hex>`` copy becomes ``path`` again when ``path`` is
    missing (a process killed between atomic_directory's two renames); the other copies are deleted. A copy of a
    live other process is its replacement in progress: left alone."""
    pattern = re.compile(rf"\.old-{re.escape(path.name)}-(\d+)(-[0-9a-f]{{8}})?")
    olds = []
    for p in path.parent.iterdir():
        if (m := pattern.fullmatch(p.name)) and p.is_dir() and not p.is_symlink() and not _alive(int(m[1])):
            olds.append(p)
    olds.sort(key=lambda p: p.stat().st_mtime)
    if olds and not path.exists() and not path.is_symlink():
        os.replace(olds.pop(), path)
    for old in olds:
        shutil.rmtree(old, ignore_errors=True)


def _alive(pid: int) -> bool:
    """Whether another process ``pid`` runs (this one's own pid: a killed run's, reused)."""
    return pid != os.getpid() and pid_running(pid)


def pid_running(pid: int) -> bool:
    """Whether a process ``pid`` runs here (another user's counts; a number no pid can be, too: left alone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


class JsonlAppender:
    """Append-only JSONL log (metrics); each line is flushed so a crash loses at most the last line. A line
    a crash left unfinished is cut off when the log is opened again (a resumed run), so the next row does
    not run into it and every line stays JSON."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.dropped_partial_line = _drop_partial_last_line(self.path)
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - long-lived handle

    def write(self, row: dict) -> None:
        self._f.write(json.dumps(row, sort_keys=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _drop_partial_last_line(path: Path) -> bool:
    """Truncate ``path`` after its last newline when bytes follow it (a write a crash cut short)."""
    if not path.is_file() or path.stat().st_size == 0:
        return False
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - 1))
        if f.read(1) == b"\n":
            return False
        block, end = 1 << 16, size  # find the last newline, reading backwards
        while end > 0:
            start = max(0, end - block)
            f.seek(start)
            chunk = f.read(end - start)
            if (i := chunk.rfind(b"\n")) >= 0:
                f.truncate(start + i + 1)
                return True
            end = start
        f.truncate(0)
        return True
