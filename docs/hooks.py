"""mkdocs hooks: the benchmark plots enter the site from bench/results/ at build time, and mkdocstrings reads the
Python API's source under its installed names.

The generated benchmark pages (docs/generate.py) show ``img/<result>.png``; the PNGs stay where the benchmark
scripts save them, beside their JSON, instead of a second committed copy under docs/.

The API page (docs/reference/api.md) documents ``rlt2t.common...`` and ``rlt2t.services...`` objects, whose
folders are ``common/`` and ``services/`` (pyproject's package-dir): static analysis cannot follow the editable
install's import hook, so the build reads them through a link tree of the installed layout (the one
``.ci/typecheck.py`` builds for mypy) in a temporary directory.
"""

from __future__ import annotations

import atexit
import importlib.util
import shutil
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files


@event_priority(100)  # before mkdocstrings' own on_config, which creates its python handler from this config
def on_config(config):
    rlt2t = importlib.util.find_spec("rlt2t")  # the checkout the installed rlt2t comes from (editable install)
    assert rlt2t is not None and rlt2t.origin is not None, "the API page needs rlt2t installed (pip install -e .)"
    root = Path(rlt2t.origin).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("rlt2t_typecheck", root / ".ci" / "typecheck.py")
    assert spec is not None and spec.loader is not None
    typecheck = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(typecheck)
    tree = tempfile.mkdtemp(prefix="rlt2t-api-src-")
    atexit.register(shutil.rmtree, tree, True)  # also after a failed build
    typecheck.build_link_tree(root, Path(tree))
    config.plugins["mkdocstrings"].config.handlers.setdefault("python", {})["paths"] = [tree]
    return config


def on_files(files: Files, config) -> Files:
    results = Path(config.config_file_path).resolve().parent / "bench" / "results"
    for png in sorted(results.glob("*.png")):
        files.append(File.generated(config, f"benchmarks/img/{png.name}", abs_src_path=str(png)))
    return files
