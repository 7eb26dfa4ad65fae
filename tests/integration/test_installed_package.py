"""rlt2t installed from its wheel (not editable, not from this checkout): the example configs ship with it
and deployment uploads the user's directory instead of assuming a source checkout."""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A venv holding only the rlt2t wheel; its dependencies come from this interpreter's site-packages
    (a .pth file, which does not pull in this checkout's editable install)."""
    tmp = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources it builds.
    source = tmp / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".venv", ".git", "runs", "build", "*.egg-info",
                                                                "__pycache__", ".pytest_cache", "bench", "tests",
                                                                ".typecheck"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(source),
                    "-w", str(tmp / "dist")], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp / "dist").glob("rlt2t-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    purelib = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    # Every site-packages directory this interpreter sees (a venv layered on another one included); a .pth line
    # adds a directory without running the .pth files in it, so no editable install of this checkout comes along.
    dirs = dict.fromkeys([sysconfig.get_paths()["purelib"], *site.getsitepackages(),
                          *(p for p in sys.path if p.endswith("site-packages"))])
    (purelib / "deps.pth").write_text("\n".join(dirs) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(purelib), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return py


def test_shipped_configs_and_deploy_work_from_the_installed_package(installed, tmp_path):
    code = ("import rlt2t, rlt2t.common.config as c, rlt2t.deploy as d; "
            "print(rlt2t.__file__); print(sorted(c.shipped_configs())); print(d.default_working_dir()); "
            "print(c.load_config(['tiny']).model.preset)")
    out = subprocess.run([installed, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path,
                         timeout=300).stdout.split("\n")
    assert str(REPO) not in out[0], "the test must import the installed package, not this checkout"
    assert "'tiny'" in out[1] and "'feedback'" in out[1]
    assert out[2] == str(tmp_path)  # an installed rlt2t uploads the user's directory
    assert out[3] == "tiny"
