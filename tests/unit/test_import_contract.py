"""The packages import each other in one direction: common <- learner, actors, services <- rlt2t (the CLI
and job wiring). Checked on the source of every module, imports inside functions included, so a cycle
cannot hide in a late import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# package -> the rlt2t packages it may import (besides itself)
ALLOWED = {
    "common": set(),
    "learner": {"common"},
    "actors": {"common"},
    "services": {"common"},
}


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
    return out


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "rlt2t":
        return None
    if len(parts) > 1 and parts[1] in ALLOWED:
        return parts[1]
    return "rlt2t"  # the top layer: rlt2t.cli, rlt2t.driver, rlt2t.jobs, ...


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_go_one_way(package):
    violations = []
    for path in sorted((REPO / package).rglob("*.py")):
        for line, module in _imports(path):
            target = _package_of(module)
            if target is None or target == package:
                continue
            if target not in ALLOWED[package]:
                violations.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not violations, "imports against the direction common <- learner/actors/services <- rlt2t:\n" + \
        "\n".join(violations)


def test_the_check_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from rlt2t.services.client import PolicyClient\n")
    assert _imports(module) == [(2, "rlt2t.services.client")]
    assert _package_of("rlt2t.services.client") == "services" and _package_of("rlt2t.driver") == "rlt2t"


def test_the_command_line_and_the_config_load_without_torch():
    """`rlt2t --help`, `rlt2t config` and a config error answer at once: parsing commands and validating a
    config import neither torch nor transformers (each command imports what it runs when it runs)."""
    import subprocess
    import sys

    code = ("import sys, rlt2t.cli; from rlt2t.common.config import load_config; load_config(); "
            "rlt2t.cli.build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
