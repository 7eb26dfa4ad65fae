"""The generated documentation (docs/generate.py): fresh in the repo, stale when its sources change, and a site
that builds with --strict."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = "run `.venv/bin/python docs/generate.py` and commit what it writes"


def _load_generator():
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


generate = _load_generator()
from docgen import benchmarks, glance, reference, renderers  # noqa: E402  (on the path docs/generate.py puts first)

MACHINE = {"cpu": "Test CPU", "cores": 2, "memory_gib": 23.5, "torch": "2.13.0+cpu", "python": "3.11.7",
           "platform": "Linux-test", "date": "2026-11-28 10:00:00 UTC", "torch_threads": 2, "cuda": None}


def _stat(mean: float, std: float, n: int = 2) -> dict:
    return {"mean": mean, "std": std, "n": n}


def demo_seeds_result() -> dict:
    """A bench/results/demo_seeds.json of the shape bench/demo_seeds.py writes, two seeds."""
    def seed(seconds, valid, greedy, beam):
        return {"seconds": seconds, "wall_seconds": seconds + 20, "rl_algorithm": "grpo", "rl_ahead": True,
                "valid": dict(zip(("sft", "continued_sft", "rl"), valid, strict=True)),
                "test_greedy": dict(zip(("sft", "continued_sft", "rl"), greedy, strict=True)),
                "test_ct2_beam": dict(zip(("sft", "continued_sft", "rl"), beam, strict=True))}

    return {
        "benchmark": "demo_seeds", "command": "python bench/demo_seeds.py --seeds 1,2", "machine": MACHINE,
        "settings": {"seeds": [1, 2], "overrides": []},
        "seeds": {"1": seed(250.1, (1.6, 1.55, 1.9), (1.6, 1.5, 1.9), (1.5, 1.5, 1.8)),
                  "2": seed(260.3, (1.7, 1.65, 2.0), (1.7, 1.6, 2.1), (1.6, 1.6, 2.0))},
        "summary": {
            "metric": "task_score", "seconds": _stat(255.2, 7.2), "wall_seconds": _stat(275.2, 7.2),
            "valid": {"sft": _stat(1.65, 0.0707), "continued_sft": _stat(1.6, 0.0707), "rl": _stat(1.95, 0.0707)},
            "test_greedy": {"sft": _stat(1.65, 0.0707), "continued_sft": _stat(1.55, 0.0707),
                            "rl": _stat(2.0, 0.1414)},
            "test_ct2_beam": {"sft": _stat(1.55, 0.0707), "continued_sft": _stat(1.55, 0.0707),
                              "rl": _stat(1.9, 0.1414)},
            "paired_diff": {"test_greedy": {"rl-sft": {**_stat(0.35, 0.0707), "relative": 0.2125},
                                            "rl-continued_sft": _stat(0.45, 0.0707)},
                            "test_ct2_beam": {"rl-sft": _stat(0.35, 0.0707),
                                              "rl-continued_sft": _stat(0.35, 0.0707)},
                            "valid": {"rl-sft": _stat(0.3, 0.01), "rl-continued_sft": _stat(0.35, 0.01)}},
            "rl_ahead_on_every_seed": True,
        },
    }


def _write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data) if not isinstance(data, str) else data, encoding="utf-8")
    return path


@pytest.fixture
def results_copy(tmp_path) -> Path:
    """A copy of bench/results to change."""
    return Path(shutil.copytree(ROOT / "bench" / "results", tmp_path / "results"))


def _benchmarks_run(tmp_path: Path, results: Path, write: bool, readme: Path | None = None) -> list[str]:
    return generate.run(docs_dir=tmp_path / "docs", results_dir=results, findings_dir=ROOT / "bench" / "findings",
                        readme=readme or tmp_path / "no-readme.md", mkdocs_yml=tmp_path / "no-mkdocs.yml",
                        write=write, reference=False)


# -- the repo's generated files ------------------------------------------------------------------------------

def test_generated_docs_in_the_repo_are_fresh():
    problems = generate.run(write=False)
    assert problems == [], f"stale generated docs ({REGENERATE}):\n" + "\n".join(problems)


# -- staleness is detected ------------------------------------------------------------------------------------

def test_a_changed_benchmark_figure_makes_its_page_stale(tmp_path, results_copy):
    assert _benchmarks_run(tmp_path, results_copy, write=True)  # first write: everything missing
    assert _benchmarks_run(tmp_path, results_copy, write=False) == []
    page = (tmp_path / "docs" / "benchmarks" / "serve_load.md").read_text(encoding="utf-8")
    assert "| `speedup` | 6.616 |" in page

    result = json.loads((results_copy / "serve_load.json").read_text(encoding="utf-8"))
    result["speedup"] = 9.25
    _write(results_copy / "serve_load.json", result)
    assert _benchmarks_run(tmp_path, results_copy, write=False) == [
        f"stale {tmp_path / 'docs' / 'benchmarks' / 'serve_load.md'}"]

    _benchmarks_run(tmp_path, results_copy, write=True)
    assert "| `speedup` | 9.25 |" in (tmp_path / "docs" / "benchmarks" / "serve_load.md").read_text(encoding="utf-8")


def test_a_removed_result_leaves_an_extra_page_that_is_reported_and_deleted(tmp_path, results_copy):
    _benchmarks_run(tmp_path, results_copy, write=True)
    (results_copy / "lora.json").unlink()
    lora_page = tmp_path / "docs" / "benchmarks" / "lora.md"
    assert f"extra {lora_page}" in _benchmarks_run(tmp_path, results_copy, write=False)
    _benchmarks_run(tmp_path, results_copy, write=True)
    assert not lora_page.exists()
    assert "lora.md" not in (tmp_path / "docs" / "benchmarks" / "index.md").read_text(encoding="utf-8")


def test_a_changed_config_default_changes_the_config_page(tmp_path, monkeypatch):
    from rlt2t.common.config import RunConfig, SFTConfig

    before = reference.render_config()
    assert "| `run.seed` | int | `1234` |" in before
    assert generate.sync_files({"reference/config.md": before}, tmp_path, write=True, owned=())

    monkeypatch.setattr(RunConfig.model_fields["seed"], "default", 4321)
    monkeypatch.setattr(SFTConfig.model_fields["lr"], "default", 0.125)
    after = reference.render_config()
    assert "| `run.seed` | int | `4321` |" in after
    assert "| `sft.lr` | float (> 0.0) | `0.125` |" in after
    assert generate.sync_files({"reference/config.md": after}, tmp_path, write=False, owned=()) == [
        f"stale {tmp_path / 'reference' / 'config.md'}"]


def test_the_config_page_has_every_key_of_config_explain():
    from rlt2t.common.config import explain

    page = reference.render_config()
    keys = [line.split(" = ")[0] for line in explain() if not line.startswith(" ")]
    assert len(keys) > 200
    missing = [k for k in keys if f"| `{k}` |" not in page]
    assert missing == []


# -- reference pages ------------------------------------------------------------------------------------------

def test_the_cli_page_has_every_subcommand_whatever_the_terminal_width(monkeypatch):
    from rlt2t.cli import build_parser

    monkeypatch.setenv("COLUMNS", "40")
    narrow = reference.render_cli()
    monkeypatch.setenv("COLUMNS", "300")
    assert reference.render_cli() == narrow
    assert os.environ["COLUMNS"] == "300"  # put back

    progs = [p.prog for p in reference.walk_parsers(build_parser())]
    assert {"rlt2t data synth", "rlt2t serve policy", "rlt2t annotate serve"} <= set(progs)
    for prog in progs:
        assert f"\n## {prog}\n" in narrow
    assert max(len(line) for line in narrow.split("```text")[1].splitlines()) <= 100


def test_the_http_page_documents_every_route_of_the_three_apps():
    documents = reference.openapi_documents()
    page = reference.render_http(documents)
    assert set(documents) == {"policy", "reward", "annotation"}
    for doc in documents.values():
        for path, item in doc["paths"].items():
            for method in item:
                assert f"### `{method.upper()} {path}`" in page
    assert "### `POST /v1/candidates` (bearer token)" in page  # the token the apps were built with
    assert '<a id="policy-candidatesrequest"></a>' in page
    assert "&lt;sep>" in page  # a tag-like word in a description is text, not HTML


# -- benchmark pages ------------------------------------------------------------------------------------------

def test_the_demo_seeds_page_renders_from_its_result(tmp_path):
    results = tmp_path / "results"
    _write(results / "demo_seeds.json", demo_seeds_result())
    files = benchmarks.benchmark_pages(results, tmp_path / "no-findings")
    page = files["benchmarks/demo_seeds.md"]
    assert page.startswith("<!-- generated by docs/generate.py from bench/results/demo_seeds.json; do not edit")
    assert "**Verdict: RL ahead of `sft` and `continued_sft` on every seed: yes**" in page
    assert "| test, greedy | 1.650 ± 0.071 | 1.550 ± 0.071 | 2.000 ± 0.141 | +0.350 ± 0.071 (5.0 σ, +21 %) | " \
           "+0.450 ± 0.071 (6.4 σ) |" in page
    assert "| 2 | 1.700 / 1.650 / 2.000 | 1.700 / 1.600 / 2.100 | 1.600 / 1.600 / 2.000 | grpo | yes | 260.3 | " \
           "280.3 |" in page
    assert "Time per seed: job 255 ± 7 s; wall 275 ± 7 s." in page
    assert "python bench/demo_seeds.py --seeds 1,2" in page
    assert "Test CPU, 2 cores" in page
    assert "[Demo over seeds" in files["benchmarks/index.md"]


def test_the_demo_reranks_are_paired_seed_by_seed_and_rendered(tmp_path, bench_script):
    """bench/demo_seeds.py --reranks: each mode's ensemble against the demo's own ensemble row (whatever mode the
    demo used) and against RL's beam alone, paired seed by seed, and the page's table of them."""
    demo_seeds = bench_script("demo_seeds")
    data = demo_seeds_result()
    for seed, (ensemble, mbr) in {"1": (1.7, 1.9), "2": (1.8, 2.2)}.items():
        data["seeds"][seed]["tables"] = {"test_ct2_beam": {"ensemble (mean_logprob)": {"task_score": ensemble}}}
        data["seeds"][seed]["reranks"] = {"mbr": {"task_score": mbr, "seconds_per_source": {"rerank": 0.002}}}
    reranks = demo_seeds.summarize(data["seeds"])["reranks"]
    assert reranks["mbr"]["task_score"]["mean"] == pytest.approx(2.05)
    assert reranks["mbr"]["minus_demo_ensemble"]["mean"] == pytest.approx(0.3)  # +0.2 and +0.4
    assert reranks["mbr"]["minus_demo_ensemble"]["std"] == pytest.approx(0.1414, abs=1e-4)
    assert reranks["mbr"]["minus_rl_beam"]["mean"] == pytest.approx(0.15)  # against RL's beam, 1.8 and 2.0
    assert reranks["mbr"]["rerank_ms_per_source"]["mean"] == pytest.approx(2.0)
    data["summary"]["reranks"] = reranks
    data["settings"]["note"] = "seed 1 beside other work"
    _write(tmp_path / "results" / "demo_seeds.json", data)
    page = benchmarks.benchmark_pages(tmp_path / "results", tmp_path / "no-findings")["benchmarks/demo_seeds.md"]
    assert "> seed 1 beside other work" in page
    assert "| `mbr` | 2.050 ± 0.212 | +0.300 ± 0.141 (2.1 σ, +17 %) | +0.150 ± 0.071 (2.1 σ, +8 %) | 2.00 ± 0.00 |" \
        in page, page


def test_the_readme_demo_sample_is_a_seeds_printed_output_with_the_figures_over_seeds(tmp_path):
    results = tmp_path / "results"
    demo = demo_seeds_result()
    rows = {"sft": {"task_score": 1.6, "cider_d": 2.3}, "continued sft": {"task_score": 1.55, "cider_d": 2.2},
            "rl (grpo)": {"task_score": 1.9, "cider_d": 2.7}}
    demo["seeds"]["1"].update(tables={"valid": rows}, titles={"valid": "valid split, greedy decoding"},
                              verdict="rl (grpo) against sft and continued sft (task_score):\n  ahead")
    _write(results / "demo_seeds.json", demo)
    block = glance.demo_block(results)
    assert "valid split, greedy decoding\n  model" in block and "rl (grpo)" in block and "1.9000" in block
    assert "rl (grpo) against sft and continued sft (task_score):\n  ahead\ndemo finished in 250 s" in block
    assert "Over 2 seeds" in block and "on every seed" in block and "+0.350 ± 0.071" in block
    assert "seed 1's output" in block and "2-core Test" in block and "`run.seed=1,2`" in block
    assert max(map(len, block.splitlines())) <= 120, "the summary is wrapped"
    demo["seeds"]["2"]["rl_ahead"] = False
    _write(results / "demo_seeds.json", demo)
    assert "on 1 of the 2 seeds" in glance.demo_block(results), "a seed where RL is behind is counted, not hidden"
    assert glance.demo_block(tmp_path / "none") == ""


def test_an_unknown_or_broken_result_still_gets_a_page(tmp_path):
    results = tmp_path / "results"
    _write(results / "mystery.json", {"machine": MACHINE, "summary": {"speed": 1.5, "runs": [1.0, 2.0, 4.0]},
                                      "rows": [{"x": 1}, {"y": {"z": 2}}]})
    _write(results / "algorithms_odd.json", {"benchmark": "algorithms", "summary": 3, "settings": "x"})
    _write(results / "listed.json", [1, 2])
    _write(results / "broken.json", "{not json")
    files = benchmarks.benchmark_pages(results, tmp_path / "no-findings")

    mystery = files["benchmarks/mystery.md"]
    assert "# mystery" in mystery and "Test CPU, 2 cores" in mystery
    assert "| `speed` | 1.5 |" in mystery
    assert "| `runs` | 2 (median of 3; 1–4) |" in mystery
    assert "| entry | x | y.z |" in mystery
    assert "not the usual shape of a `algorithms` result" in files["benchmarks/algorithms_odd.md"]
    assert "could not be read" in files["benchmarks/broken.md"]
    assert "```json" in files["benchmarks/listed.md"]


def test_the_readme_block_is_replaced_between_its_markers_only(tmp_path, results_copy):
    _write(results_copy / "demo_seeds.json", demo_seeds_result())
    start, end = generate.README_MARKERS
    readme = _write(tmp_path / "README.md", f"# title\n\nbefore\n{start}\nold figures\n{end}\nafter\n")
    problems = _benchmarks_run(tmp_path, results_copy, write=True, readme=readme)
    assert f"stale {readme} (between {start} and {end})" in problems

    text = readme.read_text(encoding="utf-8")
    assert text.startswith(f"# title\n\nbefore\n{start}\n<!-- generated by docs/generate.py")
    assert text.endswith(f"\n{end}\nafter\n")
    assert "old figures" not in text
    assert "(docs/benchmarks/demo_seeds.md)" in text and "(docs/benchmarks/algorithms_synth.md)" in text
    assert _benchmarks_run(tmp_path, results_copy, write=False, readme=readme) == []

    plain = _write(tmp_path / "PLAIN.md", "# no markers here\n")
    assert _benchmarks_run(tmp_path, results_copy, write=True, readme=plain) == []
    assert plain.read_text(encoding="utf-8") == "# no markers here\n"


def test_pages_show_the_plots_the_site_takes_from_bench_results(tmp_path, results_copy):
    _benchmarks_run(tmp_path, results_copy, write=True)
    assert "![algorithms_synth](img/algorithms_synth.png)" in (
        tmp_path / "docs" / "benchmarks" / "algorithms_synth.md").read_text(encoding="utf-8")
    assert not (tmp_path / "docs" / "benchmarks" / "img").exists(), "no second copy of the plots under docs/"


def test_the_algorithms_rerun_command_parses_as_the_script_does():
    result = json.loads((ROOT / "bench" / "results" / "algorithms_docstring_names_rlsplit_batchstd.json")
                        .read_text(encoding="utf-8"))
    command = renderers.algorithms_command("algorithms_docstring_names_rlsplit_batchstd", result).split()
    assert command[:2] == ["python", "bench/algorithms.py"]
    ap = argparse.ArgumentParser()
    for flag in ("--task", "--seeds", "--arms", "--rl-epochs", "--train-subset", "--batch-size", "--heldout",
                 "--fresh-sources", "--rl-split", "--results-name"):
        ap.add_argument(flag)
    ap.add_argument("--override", action="append", default=[])
    ap.add_argument("--base-override", action="append", default=[])
    args = ap.parse_args(command[2:])
    settings = result["settings"]
    assert args.seeds == ",".join(str(s) for s in settings["seeds"])
    assert args.arms.split(",") == settings["arms"]
    assert float(args.rl_split) == settings["rl_split"] and args.base_override == settings["base_overrides"]
    assert args.results_name == "algorithms_docstring_names_rlsplit_batchstd"


# -- the site -------------------------------------------------------------------------------------------------

def _mkdocs(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs-material is not installed (pip install -e '.[test]' installs it)")


@needs_mkdocs
def test_the_site_builds_strict(tmp_path):
    done = _mkdocs(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    for page in ("index.html", "reference/config/index.html", "benchmarks/index.html",
                 "benchmarks/algorithms_synth/index.html", "changelog/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    assert (tmp_path / "site" / "benchmarks" / "img" / "algorithms_synth.png").is_file()
    assert not (tmp_path / "site" / "generate.py").exists()
    changelog = (tmp_path / "site" / "changelog" / "index.html").read_text(encoding="utf-8")
    assert (ROOT / "CHANGELOG.md").read_text(encoding="utf-8").splitlines()[0].lstrip("# ") in changelog


@needs_mkdocs
def test_a_broken_link_fails_the_site_build(tmp_path):
    for name in ("mkdocs.yml", "CHANGELOG.md", "CONTRIBUTING.md"):  # docs/changelog.md, contributing.md include them
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "bench" / "results", tmp_path / "bench" / "results")  # the plots (docs/hooks.py)
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    with (tmp_path / "docs" / "reference" / "cli.md").open("a", encoding="utf-8") as f:
        f.write("\nSee [the options](#no-such-heading).\n")
    done = _mkdocs(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "#no-such-heading" in done.stdout + done.stderr


def test_the_readme_is_a_manual_of_at_most_300_lines_none_over_400_characters():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail to docs/"
    long = [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > 400]
    assert not long, f"README.md lines over 400 characters (line, length): {long}"


def test_the_decoding_glance_shows_the_64_sample_pool_where_measured_against_both_beams(tmp_path):
    def diff(name: str, relative: float, sigmas: float) -> dict:
        return {"comparison": name, "metric": "task_score", "relative": relative, "sigmas": sigmas, "n": 3,
                "mean": relative, "std": relative / sigmas}

    def summary(eps: bool) -> dict:
        paired = [diff("grpo: mbr_task_score - beam", 0.09, 3.1), diff("grpo mbr_task_score - sft greedy", 0.28, 1.4)]
        if eps:
            paired += [diff("grpo: mbr_task_score_eps64 - beam", 0.13, 2.9),
                       diff("grpo: mbr_task_score_eps - beam", 0.12, 2.5),
                       diff("grpo: mbr_task_score_eps64 - beam_norepeat3", 0.04, 0.3),
                       diff("grpo mbr_task_score_eps64 - sft greedy", 0.41, 9.0)]
        return {"paired": paired}

    other = {**MACHINE, "cpu": "Other CPU", "cores": 16}
    _write(tmp_path / "decoding.json", {"machine": MACHINE, "summary": {"a": summary(True), "b": summary(False)},
                                        "tasks": {"a": {"machine": MACHINE}, "b": {"machine": other}}})
    title, figures, note, stem = glance.glance_decoding(tmp_path)
    # the 64-sample pool against beam, beam with the repetition control and SFT greedy where it was measured; else
    # the first pool, labelled (not the 16-sample epsilon pool: the page has it)
    assert figures == "a: +13 % (2.9 σ), nr3 +4 % (0.3 σ) / +41 %; b: 16 top-p: +9 % (3.1 σ) / +28 %"
    assert title == ("MBR (task score) over 4 beams + 64 ε samples, GRPO checkpoint: over beam, over beam with "
                     "no-repeat-3 (nr3) / RL + MBR over SFT greedy")
    assert note == "3 seeds per task, test split, 16-core Other; 2-core Test" and stem == "decoding"


def test_the_decoding_page_shows_each_tasks_methods_targets_and_machine():
    def row(model: str, method: str, score: float) -> dict:
        return {"model": model, "method": method, "task_score": score, "task_score_std": 0.01, "rouge_l": 0.3,
                "rouge_l_std": 0.02, "cpu_ms_per_source": 12.0, "cpu_ms_per_source_std": 1.0}

    def diff(name: str, metric: str, mean: float, **target) -> dict:
        return {"comparison": name, "metric": metric, "mean": mean, "std": 0.01, "sigmas": mean / 0.01,
                "relative": mean / 0.5, "n": 3, "per_seed": [mean - 0.01, mean, mean + 0.01], **target}

    summary = {"seeds": "1, 2, 3", "rows": [row(m, x, s) for m in ("sft", "grpo")
                                             for x, s in (("beam", 0.5), ("mbr_task_score", 0.55))],
               "paired": [diff("sft: mbr_task_score - beam", "task_score", 0.05, target=">= +8% at > 2 σ", met=True),
                          diff("sft: mbr_task_score - beam", "rouge_l", 0.002),
                          diff("grpo: beam - greedy", "task_score", 0.03),
                          diff("grpo: beam - greedy", "rouge_l", -0.004)]}
    other = {**MACHINE, "cpu": "Other CPU"}
    data = {"benchmark": "decoding", "machine": MACHINE, "summary": {"a": summary},
            "protocol": {"pool": ["predict.pool=both", "predict.num_samples=16"],
                         "later_pools": {"eps64": ["predict.epsilon=0.02", "predict.num_samples=64"]}},
            "tasks": {"a": {"machine": other, "test_rows": 428, "train_overrides": ["model.family=mbart"],
                            "seconds": None}}}
    page = "\n".join(renderers.RENDERERS["decoding"](data))
    assert "- `eps64` (the methods ending `_eps64`): the first pool with predict.epsilon=0.02; " \
           "predict.num_samples=64" in page
    assert "seeds 1, 2, 3; 428 test rows; checkpoints trained with `model.family=mbart`; measured on Other CPU" in page
    assert "s of decoding" not in page  # unknown work seconds are left out, not shown as a figure
    assert "| `mbr_task_score` | 0.550 ± 0.010 | 0.550 ± 0.010 | 0.300 ± 0.020 | 0.300 ± 0.020 | 12.0 ± 1.0 |" in page
    target_table, others = page.split("The other paired differences:")
    assert ("| sft: mbr_task_score - beam | +0.050 ± 0.010 (5.0 σ, +10 %) | +0.040, +0.050, +0.060 | >= +8% at > 2 σ "
            "| yes | +0.002 ± 0.010 (0.2 σ, +0 %) |") in target_table
    assert "mbr_task_score - beam" not in others  # each comparison once
    assert "| grpo: beam - greedy | +0.030 ± 0.010 (3.0 σ, +6 %) | -0.004 ± 0.010 (-0.4 σ, -1 %) |" in others
