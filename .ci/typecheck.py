"""mypy over the packages under the names they install as: ``rlt2t``, ``rlt2t.common``, ``rlt2t.learner``, ...

The source folders (``common/``, ``learner/``, ...) do not sit where their import names say (pyproject's
``[tool.setuptools] package-dir``), and the editable install finds them through an import hook that mypy
cannot follow. So this script builds the installed layout as a tree of symlinks under ``.typecheck/``
(ignored by git, rebuilt on every run from ``package-dir``, so a new package or module needs no edit here),
runs ``mypy -p rlt2t`` on it with the settings of ``[tool.mypy]`` in pyproject.toml, and prints mypy's
report with the real source paths (``common/config.py``, not ``.typecheck/rlt2t/common/config.py``).

    python .ci/typecheck.py [more mypy arguments]     # `make lint` runs it; exit status is mypy's
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ".typecheck"  # relative to ROOT; mypy's cache lives in it too ([tool.mypy] cache_dir)
TOP = "rlt2t"


def build_link_tree(root: Path = ROOT, out: Path | None = None) -> dict[str, str]:
    """Create ``out/rlt2t`` (default ``root/.typecheck/rlt2t``) with the installed layout; return {tree path:
    source path} prefixes, relative to ``root``. (The docs site's hook builds one too: mkdocstrings reads the
    Python API's source through it.)

    A package that has other mapped packages inside it (``rlt2t`` itself) becomes a real directory whose
    entries are symlinks to the source folder's entries; every other package is one symlink to its folder.
    """
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools["package-dir"]
    out = out or root / TREE
    tree = out / TOP
    shutil.rmtree(tree, ignore_errors=True)
    prefixes: dict[str, str] = {}
    for name in sorted(package_dir, key=lambda n: n.count(".")):  # parents before children
        src = root / package_dir[name]
        if not (src / "__init__.py").exists():
            continue
        dest = out / name.replace(".", "/")
        inner = {n.rpartition(".")[2] for n in package_dir if n.rpartition(".")[0] == name}  # mapped children
        if inner:
            dest.mkdir(parents=True)
            for entry in sorted(src.iterdir()):
                if entry.name not in inner and entry.name != "__pycache__":
                    (dest / entry.name).symlink_to(os.path.relpath(entry, dest))
        else:
            dest.symlink_to(os.path.relpath(src, dest.parent), target_is_directory=True)
        prefixes[f"{Path(os.path.relpath(dest, root)).as_posix()}/"] = f"{src.relative_to(root).as_posix()}/"
    return prefixes


def real_paths(report: str, prefixes: dict[str, str]) -> str:
    """mypy's report with each link-tree path replaced by its source path (longest prefix first)."""
    order = sorted(prefixes, key=len, reverse=True)
    lines = []
    for line in report.splitlines(keepends=True):
        for prefix in order:
            if line.startswith(prefix):
                line = prefixes[prefix] + line[len(prefix):]
                break
        lines.append(line)
    return "".join(lines)


def main(argv: list[str]) -> int:
    prefixes = build_link_tree()
    env = {**os.environ, "MYPYPATH": TREE}
    proc = subprocess.run([sys.executable, "-m", "mypy", "-p", TOP, *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    sys.stdout.write(real_paths(proc.stdout, prefixes))
    sys.stderr.write(real_paths(proc.stderr, prefixes))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
