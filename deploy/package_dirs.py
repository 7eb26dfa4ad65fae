"""Create the package directories pyproject.toml lists, each with an empty ``__init__.py``.

The Dockerfile's dependency layer installs the project (for its dependencies) before the sources are copied,
so that editing code does not re-resolve them; setuptools refuses a listed package whose directory is missing.
Derived from ``[tool.setuptools]`` packages and package-dir, so a package added there needs no edit here.

    python deploy/package_dirs.py [ROOT]      # ROOT holds pyproject.toml (default: the current directory)
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def package_dirs(pyproject: str | Path) -> dict[str, Path]:
    """Each listed package's directory, relative to pyproject.toml's, as setuptools maps it: the longest
    package-dir prefix of its dotted name, then the remaining parts as subdirectories."""
    tool = tomllib.loads(Path(pyproject).read_text(encoding="utf-8"))["tool"]["setuptools"]
    mapping: dict[str, str] = tool.get("package-dir", {})
    out = {}
    for package in tool["packages"]:
        parts = package.split(".")
        prefix = next((n for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in mapping), 0)
        base = mapping[".".join(parts[:prefix])] if prefix else mapping.get("", ".")
        out[package] = Path(base, *parts[prefix:])
    return out


def main(argv: list[str]) -> None:
    root = Path(argv[1]) if len(argv) > 1 else Path()
    for path in package_dirs(root / "pyproject.toml").values():
        (root / path).mkdir(parents=True, exist_ok=True)
        (root / path / "__init__.py").touch()


if __name__ == "__main__":
    main(sys.argv)
