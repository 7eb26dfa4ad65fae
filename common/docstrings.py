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

A second task from the same functions has several references per source, as image captioning does (each
image described by several people): a function's *name* alone → the summaries of every documented function
of that name across the packages (``close`` → "closes the plot window .", "close the connection .", ...).
The metric scores an output against all of them; likelihood training learns a mixture of them and its greedy
decode the mode, where CIDEr-D rewards what the references share (`write_docstring_names_task`).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import logging
import os
import random
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

from rlt2t.common.data import split_sizes, write_sampled_task
from rlt2t.common.io import atomic_write_json, atomic_write_jsonl
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
    return write_sampled_task(out_dir, rows, size, seed, valid_fraction, test_fraction, "docstrings_meta.json",
                              {"task": "docstring-summaries", "packages": package_versions(dirs)})


def package_versions(dirs: Sequence[Path]) -> dict[str, str]:
    """The installed version of each package directory's distribution ("unknown" when none is found)."""
    versions = {}
    for d in dirs:
        try:
            versions[d.name] = importlib.metadata.version(d.name if d.name != "yaml" else "pyyaml")
        except importlib.metadata.PackageNotFoundError:
            versions[d.name] = "unknown"
    return versions


def name_of(source: str) -> str:
    """The function name words of a docstring-task source (``module : name words ( arguments )``)."""
    return source.split(" : ", 1)[1].split(" ( ", 1)[0]


def write_docstring_names_task(out_dir: str | os.PathLike, seed: int, valid_fraction: float = 0.08,
                               test_fraction: float = 0.13, min_references: int = 2, max_references: int = 10,
                               packages: Sequence[str] = PACKAGES) -> dict[str, Path]:
    """The several-reference task: every function name with at least ``min_references`` distinct summaries,
    at most ``max_references`` of them kept (drawn with ``random.Random(seed)``), names split into valid, test
    and train. Train has one row per reference (``target`` that reference, ``references`` all of them), the
    likelihood training of captioning; valid and test one row per name (``target`` the first reference).
    Writes ``train``/``valid``/``test`` JSONL and ``docstring_names_meta.json`` last; returns their paths."""
    if not 1 <= min_references <= max_references:
        raise ValueError(f"need 1 <= min_references <= max_references, got {min_references} and {max_references}")
    dirs = package_dirs(packages)
    if not dirs:
        raise FileNotFoundError(f"none of the packages {', '.join(packages)} is installed in this environment")
    summaries: dict[str, list[str]] = {}
    for row in docstring_pairs(dirs):
        refs = summaries.setdefault(name_of(row["source"]), [])
        if row["target"] not in refs:
            refs.append(row["target"])
    rng = random.Random(seed)
    names = sorted(name for name, refs in summaries.items() if len(refs) >= min_references)
    rng.shuffle(names)
    kept = {name: rng.sample(summaries[name], min(max_references, len(summaries[name]))) for name in names}
    n_valid, n_test = split_sizes(len(names), valid_fraction, test_fraction, "function names")
    splits = {"valid": names[:n_valid], "test": names[n_valid : n_valid + n_test], "train": names[n_valid + n_test :]}
    out = Path(out_dir)
    paths = {split: out / f"{split}.jsonl" for split in splits}
    atomic_write_jsonl(paths["train"], ({"id": f"{name}:{i}", "source": name, "target": ref, "references": kept[name]}
                                        for name in splits["train"] for i, ref in enumerate(kept[name])))
    for split in ("valid", "test"):
        atomic_write_jsonl(paths[split], ({"id": name, "source": name, "target": kept[name][0],
                                           "references": kept[name]} for name in splits[split]))
    paths["meta"] = out / "docstring_names_meta.json"
    atomic_write_json(paths["meta"], {
        "task": "docstring-names", "seed": seed, "min_references": min_references,
        "max_references": max_references, **{f"{k}_sources": len(v) for k, v in splits.items()},
        "train_rows": sum(len(kept[name]) for name in splits["train"]),
        "references_per_source": round(sum(map(len, kept.values())) / max(len(kept), 1), 2),
        "packages": package_versions(dirs)})
    return paths
