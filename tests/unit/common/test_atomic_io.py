"""Atomic writes: the modes a plain write would give, and nothing lost when a replace is interrupted."""

from __future__ import annotations

import os

import pytest

from rlt2t.common import io
from rlt2t.common.io import atomic_directory, atomic_write_text


@pytest.fixture
def group_umask(monkeypatch):
    """A umask that lets the group read (as on a shared run directory), for this test only."""
    old = os.umask(0o027)
    monkeypatch.setattr(io, "_UMASK", 0o027)  # read once at import
    yield
    os.umask(old)


def test_written_files_and_directories_honour_the_umask_not_owner_only(tmp_path, group_umask):
    atomic_write_text(tmp_path / "a.txt", "x")
    with atomic_directory(tmp_path / "d") as d:
        (d / "f").write_text("y")
    plain = tmp_path / "plain.txt"
    plain.write_text("z")
    os.mkdir(tmp_path / "plain_dir")
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == plain.stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "d").stat().st_mode & 0o777 == (tmp_path / "plain_dir").stat().st_mode & 0o777 == 0o750


def test_a_private_file_is_owner_only_before_it_has_its_name(tmp_path, group_umask, monkeypatch):
    # A token file: readable by the group for no moment, not even between the rename and a later chmod.
    modes = []
    real_replace = os.replace

    def replace(src, dst):
        modes.append(os.stat(src).st_mode & 0o777)
        real_replace(src, dst)

    monkeypatch.setattr(io.os, "replace", replace)
    atomic_write_text(tmp_path / "alice.token", "secret\n", private=True)
    assert modes == [0o600] and (tmp_path / "alice.token").stat().st_mode & 0o777 == 0o600


def test_an_interrupted_directory_replace_puts_the_old_one_back(tmp_path, monkeypatch):
    target = tmp_path / "final"
    with atomic_directory(target) as d:
        (d / "v").write_text("1")
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # the old one has been moved aside; the new one is not in place yet
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(io.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt), atomic_directory(target) as d:
        (d / "v").write_text("2")
    assert (target / "v").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_a_killed_runs_old_copy_with_this_pid_is_not_in_the_way(tmp_path):
    # An earlier run killed after moving the old copy aside left .old-final-<pid>; a run with the same pid (pids
    # are reused, in containers often) failed to move its own old copy there (ENOTEMPTY).
    target = tmp_path / "final"
    with atomic_directory(target) as d:
        (d / "v").write_text("1")
    leftover = tmp_path / f".old-final-{os.getpid()}"
    leftover.mkdir()
    (leftover / "v").write_text("0")
    with atomic_directory(target) as d:
        (d / "v").write_text("2")
    assert (target / "v").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # the leftover is gone, no new one left


def test_a_directory_a_kill_left_missing_comes_back_from_its_old_copy(tmp_path):
    # Killed between the two renames: no `final`, only its old copy. The next write starts by putting it back,
    # so a write that then fails leaves the old content, not nothing; a sibling's old copy is not touched.
    target = tmp_path / "final"
    old = tmp_path / f".old-final-{os.getpid()}-0123abcd"
    old.mkdir()
    (old / "v").write_text("1")
    other = tmp_path / f".old-final-x-{os.getpid()}-0123abcd"  # the old copy of `final-x`
    other.mkdir()
    with pytest.raises(RuntimeError), atomic_directory(target) as d:
        assert (target / "v").read_text() == "1"
        (d / "v").write_text("2")
        raise RuntimeError("the write failed")
    assert (target / "v").read_text() == "1" and not old.exists() and other.is_dir()
