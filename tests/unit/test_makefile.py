"""`make test` on a fresh machine: the Debian packages the tests need are installed first where that is allowed
(root), and a machine where it is not (no root, no network, no apt) still runs the suite: `system-deps` only
says what to install, and the tests that need a missing package skip (tests/conftest.py, SYSTEM_PACKAGES).

The Makefile's chain is run for real with stand-ins for the two things a test cannot be: the user id
(SYSTEM_DEPS_UID) and apt-get (APT_GET, a script that records its arguments)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MISSING = "rlt2t-no-such-package"

pytestmark = pytest.mark.skipif(shutil.which("make") is None or shutil.which("dpkg") is None,
                                reason="needs make and dpkg (a Debian-like machine)")


def make(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "-C", str(REPO), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)}, stdin=subprocess.DEVNULL)


def fake_apt(tmp_path: Path, succeed: bool) -> Path:
    """An apt-get that appends its arguments to calls.txt and succeeds or fails."""
    script = tmp_path / "apt-get"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'calls.txt'}\nexit {0 if succeed else 1}\n")
    script.chmod(0o755)
    return script


def test_make_test_runs_system_deps_as_optional_before_pytest(done_stamp):
    dry = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(REPO), "test", done_stamp],
                         capture_output=True, text=True, timeout=60).stdout
    deps, pytest_at = dry.find("dpkg -s"), dry.find("-m pytest tests")
    assert 0 <= deps < pytest_at, dry
    assert '[ -n "1" ]' in dry, "make test must run system-deps with SYSTEM_DEPS_OPTIONAL=1"


@pytest.mark.parametrize("optional", ["1", ""])
def test_not_root_prints_the_command_and_only_fails_when_required(tmp_path, optional):
    apt = fake_apt(tmp_path, succeed=True)
    done = make("system-deps", f"DEB_PACKAGES={MISSING}", "SYSTEM_DEPS_UID=1000", f"APT_GET={apt}",
                f"SYSTEM_DEPS_OPTIONAL={optional}", tmp_path=tmp_path)
    assert f"sudo apt-get install -y --no-install-recommends {MISSING}" in done.stdout
    assert not (tmp_path / "calls.txt").exists(), "apt-get must not run without root"
    assert (done.returncode == 0) == bool(optional), done.stdout + done.stderr


def test_root_installs_the_missing_packages_only(tmp_path):
    apt = fake_apt(tmp_path, succeed=True)
    done = make("system-deps", f"DEB_PACKAGES=dpkg {MISSING}", "SYSTEM_DEPS_UID=0", f"APT_GET={apt}",
                tmp_path=tmp_path)
    assert done.returncode == 0 and f"installed {MISSING}" in done.stdout, done.stdout + done.stderr
    assert (tmp_path / "calls.txt").read_text().split("\n")[0] == f"install -y -q --no-install-recommends {MISSING}"


@pytest.mark.parametrize("optional", ["1", ""])
def test_root_without_a_working_apt_goes_on_when_optional(tmp_path, optional):
    apt = fake_apt(tmp_path, succeed=False)
    done = make("system-deps", f"DEB_PACKAGES={MISSING}", "SYSTEM_DEPS_UID=0", f"APT_GET={apt}",
                f"SYSTEM_DEPS_OPTIONAL={optional}", tmp_path=tmp_path)
    assert f"apt-get install -y --no-install-recommends {MISSING}" in done.stdout, done.stdout
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert calls[0].startswith("install") and calls[1].startswith("update"), calls  # retried after an update
    assert (done.returncode == 0) == bool(optional), done.stdout + done.stderr


def test_nothing_to_do_when_every_package_is_there(tmp_path):
    apt = fake_apt(tmp_path, succeed=True)
    done = make("system-deps", "DEB_PACKAGES=dpkg", f"APT_GET={apt}", tmp_path=tmp_path)
    assert done.returncode == 0 and "all present (dpkg)" in done.stdout
    assert not (tmp_path / "calls.txt").exists()


@pytest.mark.parametrize(("unit", "rest", "status"), [(0, 0, 0), (1, 0, 1), (0, 2, 2), (5, 0, 0), (0, 5, 0),
                                                      (5, 5, 0), (5, 1, 1), (1, 2, 1)])
def test_make_test_runs_the_unit_part_on_workers_then_the_rest_and_fails_with_either(tmp_path, done_stamp, unit, rest,
                                                                                    status):
    """The unit tests on TEST_WORKERS processes, then the integration (and GPU) tests on INTEGRATION_WORKERS, a
    module per worker at a time; both run whatever the first gives, the first failure's status is make's, and 5 (a
    -k that leaves a part empty) is not a failure."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"  # a stand-in for the venv's python: records its arguments, exits as told
    python.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'calls.txt'}\ncase \"$*\" in *tests/unit*) exit {unit};; "
                      f"esac\nexit {rest}\n")
    python.chmod(0o755)
    done = make("test", done_stamp, f"BIN={bin_dir}", "DEB_PACKAGES=", "TEST_WORKERS=3", "INTEGRATION_WORKERS=4",
                "PYTEST_ARGS=-k x", tmp_path=tmp_path)
    assert done.returncode == (0 if status == 0 else 2), done.stdout + done.stderr  # make's own status for a failure
    if status:
        assert f"Error {status}" in done.stderr
    assert (tmp_path / "calls.txt").read_text().splitlines() == [
        "-m pytest tests/unit -n 3 -k x", "-m pytest tests/integration tests/gpu -n 4 --dist loadfile -k x"]
    assert ("no tests selected" in done.stdout.splitlines()) == (unit == rest == 5)  # a line of its own, not the recipe
