"""Generate the documentation pages that must not drift: reference pages from the code, benchmark pages from
bench/results/*.json.

    .venv/bin/python docs/generate.py            # write them
    .venv/bin/python docs/generate.py --check    # write nothing; exit 1 listing stale, missing or extra files

What it writes, and from what:

- docs/reference/cli.md: every `rlt2t` command and subcommand with its --help (rlt2t.cli.build_parser()),
  formatted 100 columns wide whatever the terminal;
- docs/reference/config.md: every config key with its type, default and meaning, from the config models
  (rlt2t.common.config, what `rlt2t config --explain` prints), so a changed default changes the page;
- docs/reference/http.md and openapi-<app>.json: the routes and bodies of the policy server, the reward
  server and the annotation app, from each FastAPI app's OpenAPI document (apps built with no model);
- docs/benchmarks/<page>.md and index.md: one page per benchmark script or task, from the result
  files whose names start with the page's name, with the hand-written findings of bench/findings/<page>.md
  and the commands that rerun them (recorded in the file, else the Makefile's `bench` lines and the script's
  usage); a result of an unknown shape still gets a page (its figures flattened);
- the benchmark entries of mkdocs.yml's nav, and README.md's "results at a glance" table and quick-start demo
  sample (one seed's printed output and the figures over every seed of bench/results/demo_seeds.json), each
  between its markers (a file without the markers is left alone).

The pieces live in docs/docgen/ (markdown, reference, results, renderers, benchmarks, glance).
Everything is deterministic: no date of generation, nothing of this machine but what the result files
record. tests/unit/test_docs.py fails when a generated file is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # docs/docgen, run as a script or loaded from a path
from docgen.benchmarks import FINDINGS, RESULTS, benchmark_pages, nav_block  # noqa: E402
from docgen.glance import demo_block, glance_block  # noqa: E402
from docgen.markdown import Files, replace_between  # noqa: E402
from docgen.reference import reference_pages  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GENERATED_DIRS = ("reference", "benchmarks")  # wholly generated: a file the generator would not write is extra
README_MARKERS = ("<!-- results-at-a-glance:start -->", "<!-- results-at-a-glance:end -->")
DEMO_MARKERS = ("<!-- demo-output:start -->", "<!-- demo-output:end -->")
NAV_MARKERS = ("# benchmarks:start", "# benchmarks:end")


# -- writing and checking -----------------------------------------------------------------------------------

def generate(results_dir: Path = RESULTS, findings_dir: Path = FINDINGS, reference: bool = True) -> Files:
    """Every generated file under the docs dir (the reference pages need the services importable)."""
    return {**(reference_pages() if reference else {}), **benchmark_pages(results_dir, findings_dir)}


def sync_files(files: Files, docs_dir: Path, write: bool, owned: tuple[str, ...] = GENERATED_DIRS) -> list[str]:
    """Compare (or write) ``files`` under ``docs_dir``; the files of the ``owned`` dirs it would not write are
    extra (deleted when writing). Returns the problems found: `stale X`, `missing X`, `extra X`."""
    problems = []
    for rel, content in sorted(files.items()):
        path = docs_dir / rel
        data = content.encode("utf-8") if isinstance(content, str) else content
        current = path.read_bytes() if path.is_file() else None
        if current != data:
            problems.append(f"{'stale' if current is not None else 'missing'} {path}")
            if write:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
    for folder in owned:
        for path in sorted((docs_dir / folder).rglob("*")):
            if path.is_file() and path.relative_to(docs_dir).as_posix() not in files:
                problems.append(f"extra {path}")
                if write:
                    path.unlink()
    return problems


def sync_block(path: Path, markers: tuple[str, str], block: str, write: bool) -> list[str]:
    """Compare (or write) the block between ``markers`` in ``path``; a file without them is left alone."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return []
    updated = replace_between(text, markers, block)
    if updated is None or updated == text:
        return []
    if write:
        path.write_text(updated, encoding="utf-8")
    return [f"stale {path} (between {markers[0]} and {markers[1]})"]


def run(docs_dir: Path = DOCS, results_dir: Path = RESULTS, findings_dir: Path = FINDINGS,
        readme: Path = ROOT / "README.md", mkdocs_yml: Path = ROOT / "mkdocs.yml", write: bool = True,
        reference: bool = True) -> list[str]:
    problems = sync_files(generate(results_dir, findings_dir, reference), docs_dir, write,
                          GENERATED_DIRS if reference else ("benchmarks",))
    problems += sync_block(mkdocs_yml, NAV_MARKERS, nav_block(results_dir), write)
    problems += sync_block(readme, README_MARKERS, glance_block(results_dir) + "\n", write)
    problems += sync_block(readme, DEMO_MARKERS, demo_block(results_dir) + "\n", write)
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated file is stale")
    args = ap.parse_args(argv)
    problems = run(write=not args.check)
    for problem in problems:
        print(problem if args.check else problem.replace("stale ", "updated ").replace("missing ", "wrote ")
              .replace("extra ", "deleted "))
    if args.check and problems:
        print("the generated docs are stale: run .venv/bin/python docs/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
