"""The benchmark pages: one per benchmark script or task, an index, and the nav entries of mkdocs.yml."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

from docgen.markdown import Files, code_block, header, table
from docgen.renderers import RENDERERS, rerun_command
from docgen.results import PAGES, Page, Unreadable, generic_figures, load_results, machine_line

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
FINDINGS = ROOT / "bench" / "findings"


# -- one result file ---------------------------------------------------------------------------------------

def file_section(stem: str, data: Any) -> list[str]:
    """A result file's section: heading, source and machine, rerun command, figures, plot."""
    lines = [f"## {stem}", ""]
    if isinstance(data, Unreadable):
        return lines + [f"`bench/results/{stem}.json` could not be read: {data.error}", ""]
    if not isinstance(data, dict):
        return lines + code_block(json.dumps(data, indent=1, sort_keys=True).splitlines(), "json")
    source = f"From `bench/results/{stem}.json`"
    machine = machine_line(data.get("machine"))
    lines += [source + (f", measured on {machine}." if machine else "."), ""]
    try:
        body = RENDERERS.get(str(data.get("benchmark")), generic_figures)(data)
        command = rerun_command(stem, data)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError) as e:
        body = [f"*(not the usual shape of a `{data.get('benchmark')}` result ({type(e).__name__}: {e}): its "
                "figures as recorded)*", "", *generic_figures(data)]
        command = None
    if command:
        lines += ["Rerun:", "", *code_block([command], "bash")]
    return lines + body


def plot_line(stem: str, results_dir: Path) -> list[str]:
    return [f"![{stem}](img/{stem}.png)", ""] if (results_dir / f"{stem}.png").is_file() else []


# -- benchmarks: pages --------------------------------------------------------------------------------------

def script_docstring(script: str) -> str:
    import ast

    path = ROOT / "bench" / f"{script}.py"
    with contextlib.suppress(OSError, SyntaxError):
        return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return ""


def script_summary(script: str) -> tuple[str, list[str]]:
    """The first paragraph of the script's docstring (what it measures) and its usage lines."""
    doc = script_docstring(script)
    summary = " ".join(doc.split("\n\n", 1)[0].split())
    usage = [line.strip() for line in doc.splitlines() if line.strip().startswith(f"python bench/{script}.py")]
    return summary, usage


def make_bench_lines(script: str, makefile: Path = ROOT / "Makefile") -> list[str]:
    """The `make bench` recipe lines that run bench/<script>.py, continuations joined."""
    try:
        text = makefile.read_text(encoding="utf-8")
    except OSError:
        return []
    recipe = re.search(r"^bench:.*\n((?:\t.*\n|\n)*)", text, re.M)
    if not recipe:
        return []
    commands = re.sub(r"\\\n\t*", "", recipe.group(1)).splitlines()
    return [" ".join(c.strip().replace("$(BIN)/", "").split()) for c in commands
            if f"bench/{script}.py" in c and not c.strip().startswith("#")]


def page_info(name: str) -> tuple[str, str, str]:
    """Title, script and what the benchmark measures."""
    page = PAGES.get(name, Page(name.replace("_", " "), name))
    measures, _ = script_summary(page.script)
    return page.title, page.script, page.measures or measures or "(no description recorded)"


def render_benchmark_page(name: str, results: dict[str, Any], results_dir: Path, findings_dir: Path) -> str:
    title, script, measures = page_info(name)
    findings_file = findings_dir / f"{name}.md"
    findings = findings_file.read_text(encoding="utf-8").strip() if findings_file.is_file() else ""
    sources = [f"bench/results/{stem}.json" for stem in results]
    if findings:
        sources.append(f"bench/findings/{name}.md")
    lines = [header(*sources), f"# {title}", "", measures, ""]
    if findings:
        lines += ["## Findings", "", findings, ""]
    for stem, data in results.items():
        lines += file_section(stem, data) + plot_line(stem, results_dir)
    _, usage = script_summary(script)
    make_lines = make_bench_lines(script)
    if usage or make_lines:
        lines += ["## Running it", ""]
        if make_lines:
            lines += ["`make bench` runs:", "", *code_block(make_lines, "bash")]
        if usage:
            lines += ["Usage:", "", *code_block(usage, "bash")]
    return "\n".join(lines).rstrip() + "\n"


def render_benchmark_index(pages: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, results in pages.items():
        title, _, measures = page_info(name)
        dates = sorted(d["machine"]["date"][:10] for d in results.values()
                       if isinstance(d, dict) and isinstance(d.get("machine"), dict) and d["machine"].get("date"))
        when = (dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}") if dates else ""
        rows.append([f"[{title}]({name}.md)", measures, len(results), when])
    sources = "bench/results/*.json"
    return "\n".join([header(sources), "# Benchmarks", "",
                      "Each page is generated from the result files the benchmark scripts (`bench/`, `make bench`) "
                      "save in `bench/results/`, with the machine each ran on. Figures from one machine do not "
                      "carry over to another.", "", *table(["benchmark", "what it measures", "result files",
                                                             "measured"], rows)])


def benchmark_pages(results_dir: Path = RESULTS, findings_dir: Path = FINDINGS) -> Files:
    pages = load_results(results_dir)
    files: Files = {"benchmarks/index.md": render_benchmark_index(pages)}
    for name, results in pages.items():
        files[f"benchmarks/{name}.md"] = render_benchmark_page(name, results, results_dir, findings_dir)
    return files


def nav_block(results_dir: Path = RESULTS) -> str:
    """mkdocs.yml's Benchmarks entries (between NAV_MARKERS), indented as the nav there is."""
    entries = ["      - benchmarks/index.md"]
    entries += [f"      - {json.dumps(page_info(name)[0])}: benchmarks/{name}.md" for name in load_results(results_dir)]
    return "\n".join(entries) + "\n      "


