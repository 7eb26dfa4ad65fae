"""A natural-language task from text shipped in the installed Python packages: docstring generation.

The public functions of well-kept libraries (torch, transformers, numpy, sympy, matplotlib, ...) carry a
human-written summary line: ``compute_num_masked_span(input_length)`` → "Given input length, compute how many
spans should be masked". The task: given a function's name and arguments, write that summary. It is the code-
summarisation task of CodeSearchNet's docstring generation, built offline from what this environment installs:
the targets are real English written by the libraries' authors, varied, and learnable by a small model in
minutes (the name carries much of the meaning), which makes it a useful second benchmark task beside the
synthetic one.

Sources are the function's package and module, then its name and arguments, with snake_case and CamelCase
split into lower-case words (``transformers wav2vec2 : compute num masked span ( input length )``); targets
are the docstring's first sentence, lower-cased and split into word and punctuation tokens (as coco-caption's
tokenizer does before CIDEr-D). Boilerplate summaries (generated stubs, "see ...", "deprecated ...") and
summaries shared by more than three functions are left out. The same installed packages and arguments give the
same bytes (files and functions are walked in sorted order, rows drawn with ``random.Random(seed)``); the
package versions are recorded.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import logging
import os
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

from rlt2t.common.data import write_sampled_task
from rlt2t.common.wordnet import tokenize

log = logging.getLogger("rlt2t.docstrings")

# Libraries rlt2t installs (or its dependencies do): their docstrings are the corpus.
PACKAGES = ("torch", "transformers", "numpy", "sympy", "matplotlib", "sqlalchemy", "nltk", "networkx",
            "pydantic", "peft", "accelerate", "tokenizers", "ray", "scipy", "pandas", "rich", "jinja2", "yaml")
_WORDS = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")
_BOILERPLATE = re.compile(r"^(missing associated documentation|see |deprecated|alias (for|of)|todo|fixme|"
                          r"overrides? |implements? |same as |this (method|function) is deprecated)", re.I)


def split_name(name: str) -> str:
    """``compute_num_maskedSpan`` → ``compute num masked span``."""
    return " ".join(w.lower() for w in _WORDS.findall(name))


def first_sentence(doc: str) -> str:
    """The summary of a docstring: its first paragraph up to the first sentence end, on one line."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    return re.split(r"(?<=[.!?])\s", paragraph, maxsplit=1)[0].strip()


def package_dirs(packages: Sequence[str] = PACKAGES) -> list[Path]:
    """The installed directories of ``packages`` (those that are installed; found, not imported)."""
    out = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        if locations:
            out.append(Path(locations[0]))
    return out


def _functions(path: Path) -> Iterator[tuple[str, list[str], str]]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"), filename=str(path))
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if doc:
                args = [a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)
                        if a.arg not in ("self", "cls")]
                yield node.name, args, doc


def docstring_pairs(dirs: Sequence[Path]) -> list[dict[str, str]]:
    """(name + arguments → summary) rows of every public documented function under ``dirs``, tests left out;
    ``id`` = ``<package>:<relative path>:<name>:<n>``. Logs each package as it is read (a large one takes a
    while), with the running count of rows."""
    rows: list[dict[str, str]] = []
    for i, base in enumerate(dirs, 1):
        files = sorted(base.rglob("*.py"))
        log.info("docstrings: reading %s (%d of %d packages, %d files); %d pairs so far", base.name, i, len(dirs),
                 len(files), len(rows))
        for path in files:
            rel = path.relative_to(base.parent)
            if any(part in ("tests", "test", "testing", "_vendor", "vendored") for part in rel.parts):
                continue
            for n, (name, args, doc) in enumerate(_functions(path)):
                summary = first_sentence(doc)
                if not 4 <= len(summary.split()) <= 30 or _BOILERPLATE.match(summary) or "`" * 2 in summary[:2]:
                    continue
                module = " ".join(split_name(p) for p in (rel.parts[0], rel.stem) if p != "__init__")
                arguments = " , ".join(split_name(a) for a in args if split_name(a))
                source = f"{module} : {split_name(name)} ( {arguments} )"
                target = tokenize(summary)
                if target and split_name(name):
                    rows.append({"id": f"{rel.as_posix()}:{name}:{n}", "source": " ".join(source.split()),
                                 "target": target})
    log.info("docstrings: %d pairs from %d packages, before shared summaries and duplicates are left out",
             len(rows), len(dirs))
    counts = Counter(r["target"] for r in rows)
    seen: set[tuple[str, str]] = set()
    out = []
    for r in rows:  # generic summaries shared by many functions say little; exact duplicates teach nothing new
        key = (r["source"], r["target"])
        if counts[r["target"]] <= 3 and key not in seen:
            seen.add(key)
            out.append(r)
    return out


def write_docstring_task(out_dir: str | os.PathLike, size: int, seed: int, valid_fraction: float = 0.05,
                         test_fraction: float = 0.05, packages: Sequence[str] = PACKAGES) -> dict[str, Path]:
    """Write ``train``/``valid``/``test`` JSONL of ``size`` rows and ``docstrings_meta.json`` (written last,
    with the package versions the rows came from). Returns the paths keyed ``train``, ``valid``, ``test``,
    ``meta``."""
    dirs = package_dirs(packages)
    if not dirs:
        raise FileNotFoundError(f"none of the packages {', '.join(packages)} is installed in this environment")
    rows = docstring_pairs(dirs)
    if size > len(rows):
        raise ValueError(f"size={size}: the installed packages give only {len(rows)} documented functions")
    versions = {}
    for d in dirs:
        try:
            versions[d.name] = importlib.metadata.version(d.name if d.name != "yaml" else "pyyaml")
        except importlib.metadata.PackageNotFoundError:
            versions[d.name] = "unknown"
    return write_sampled_task(out_dir, rows, size, seed, valid_fraction, test_fraction, "docstrings_meta.json",
                              {"task": "docstring-summaries", "packages": versions})
