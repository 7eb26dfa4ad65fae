"""README.md's marked blocks: the results at a glance, from bench/results/*.json."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

from docgen.benchmarks import RESULTS
from docgen.markdown import header, paired, sigmas_of, table
from docgen.results import page_of

# -- README: results at a glance ----------------------------------------------------------------------------

def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def short_machine(data: dict) -> str:
    m = data.get("machine", {})
    cpu = re.sub(r"\(R\)|\(TM\)| Processor| CPU", "", str(m.get("cpu", ""))).strip()
    return f"{m.get('cores', '?')}-core {cpu}" + (f", {m['cuda']}" if m.get("cuda") else "")


def glance_demo(results_dir: Path) -> list[str] | None:
    data = read_json(results_dir / "demo_seeds.json")
    if data is None:
        return None
    s = data["summary"]
    greedy = s["paired_diff"]["test_greedy"]
    n = len(data.get("seeds", {}))
    algorithms = sorted({str(seed.get("rl_algorithm")) for seed in data.get("seeds", {}).values()})
    return [f"`make demo` pipeline: RL ({', '.join(algorithms)}) vs SFT and continued SFT (test, greedy)",
            f"{paired(greedy['rl-sft'])} over SFT, {paired(greedy['rl-continued_sft'])} over continued SFT; "
            f"ahead of both on every table on {sum(bool(r.get('rl_ahead')) for r in data.get('seeds', {}).values())} "
            f"of {n} seeds",
            f"{n} seeds, {short_machine(data)}", "demo_seeds"]


def glance_algorithm(results_dir: Path, stem: str, arm: str, what: str) -> list[str] | None:
    data = read_json(results_dir / f"{stem}.json")
    if data is None:
        return None
    each = data["summary"][arm]["paired_diff_test_each"]
    steps = next(iter(data["arms"][arm].values()))["steps"]
    return [what, f"{paired(each['sft'])} over the SFT checkpoint, {paired(each['continued_sft'])} over "
            "continued SFT (test task score)",
            f"{len(data['settings']['seeds'])} seeds, {steps} learner steps, {short_machine(data)}", page_of(stem)]


def glance_serving(results_dir: Path) -> list[str] | None:
    data = read_json(results_dir / "serve_load.json")
    if data is None:
        return None
    phases = data["phases"]
    return ["Policy server: request batching",
            f"{phases['batched']['requests_per_s']:.1f} vs {phases['batch1']['requests_per_s']:.1f} requests/s "
            f"unbatched ({data['speedup']:.2f}×)",
            f"{phases['batched']['clients']} clients, {data['model']}, {short_machine(data)}", "serve_load"]


def glance_ct2(results_dir: Path) -> list[str] | None:
    figures = []
    for stem in ("ct2_sampling", "ct2_sampling_t5"):
        data = read_json(results_dir / f"{stem}.json")
        if data is not None:
            family = data.get("model", {}).get("family", "t5" if stem.endswith("t5") else "bart")
            figures.append((f"{family}: {data['speedup_vs_hf_generate']:.2f}× ({data['best_ct2_sampling']})",
                            short_machine(data)))
    if not figures:
        return None
    machines = sorted({m for _, m in figures})
    return ["CTranslate2 sampling vs Hugging Face `generate`", "; ".join(f for f, _ in figures),
            f"K = 6, 48 tokens, {'; '.join(machines)}", "ct2_sampling"]


def _short(diff: dict) -> str:
    """A paired difference as `+9 % (3.1 σ)`: short enough for three tasks in one README row (the benchmark page
    has the means and stds)."""
    sigmas = sigmas_of(diff)
    return f"{100 * diff['relative']:+.0f} %" + (f" ({sigmas:.1f} σ)" if isinstance(sigmas, int | float) else "")


DECODING_POOLS = (("", "16 top-p: "), ("_eps64", ""))
"""The decoding benchmark's pools the glance row may show (a method's suffix, its label): the one configs/mbr.yaml
ships (64 ε samples) where a task measured it, else the first protocol's; the page has them all."""


def glance_decoding(results_dir: Path) -> list[str] | None:
    data = read_json(results_dir / "decoding.json")
    if data is None:
        return None
    figures, seeds, machines = [], set(), set()
    for task, s in data["summary"].items():
        by = {(d["comparison"], d["metric"]): d for d in s["paired"]}
        suffix, label = next((p for p in reversed(DECODING_POOLS)
                              if (f"grpo: mbr_task_score{p[0]} - beam", "task_score") in by), DECODING_POOLS[0])
        over_beam = by[(f"grpo: mbr_task_score{suffix} - beam", "task_score")]
        # the stronger beam baseline (no_repeat_ngram_size=3), where it was measured
        nr3 = by.get((f"grpo: mbr_task_score{suffix} - beam_norepeat3", "task_score"))
        both = by[(f"grpo mbr_task_score{suffix} - sft greedy", "task_score")]
        figures.append(f"{task}: {label}{_short(over_beam)}" + (f", nr3 {_short(nr3)}" if nr3 else "")
                       + f" / {100 * both['relative']:+.0f} %")
        seeds.add(over_beam["n"])
        machines.add(short_machine(data.get("tasks", {}).get(task, data)))
    return ["MBR (task score) over 4 beams + 64 ε samples, GRPO checkpoint: over beam, over beam with "
            "no-repeat-3 (nr3) / RL + MBR over SFT greedy",
            "; ".join(figures),
            f"{'/'.join(str(n) for n in sorted(seeds))} seeds per task, test split, {'; '.join(sorted(machines))}",
            "decoding"]


def glance_block(results_dir: Path = RESULTS) -> str:
    rows = []
    for make in (glance_demo,
                 lambda d: glance_algorithm(d, "algorithms_synth_batchstd", "grpo:batchstd",
                                            "GRPO vs likelihood training, synthetic task"),
                 lambda d: glance_algorithm(d, "algorithms_docstring_names_rlsplit_batchstd", "grpo:batchstd",
                                            "GRPO vs likelihood training, several-reference names (held back)"),
                 lambda d: glance_algorithm(d, "dpo_synth", "dpo:e6lr2e-5",
                                            "DPO (offline pairs, rl.lr 2e-5) vs likelihood training, synthetic task"),
                 glance_decoding, glance_serving, glance_ct2):
        try:
            row = make(results_dir)
        except (KeyError, TypeError, ValueError, StopIteration, AttributeError):
            row = None  # a result without the figure: no row rather than a wrong one
        if row is not None:
            rows.append([*row[:3], f"[{row[3]}](docs/benchmarks/{row[3]}.md)"])
    return "\n".join([header("bench/results/*.json").rstrip(), "",
                      *table(["result", "figure", "setting", "details"], rows)])




# -- README: the demo's output, one seed's as a sample, with the figures over every seed --------------------

def _plain_table(title: str, rows: dict[str, dict[str, float]]) -> list[str]:
    """A metric table as plain aligned text (the demo draws it with box characters)."""
    columns = list(next(iter(rows.values())))
    width = max(len(label) for label in rows) + 2
    lines = [title, "  " + "model".ljust(width) + "".join(f"{c:>13}" for c in columns)]
    lines += ["  " + label.ljust(width) + "".join(f"{v:>13.4f}" for v in values.values())
              for label, values in rows.items()]
    return lines + [""]


def demo_block(results_dir: Path = RESULTS) -> str:
    """The README's quick-start sample: the tables and verdict one seed of bench/results/demo_seeds.json
    printed, then mean ± std over all its seeds (empty without that file)."""
    data = read_json(results_dir / "demo_seeds.json")
    if data is None or not data.get("seeds"):
        return ""
    seeds, s = data["seeds"], data["summary"]
    seed, run = next(iter(seeds.items()))
    sample: list[str] = []
    for key in ("valid", "test_greedy", "test_ct2_beam"):
        if run.get("tables", {}).get(key):
            sample += _plain_table(run["titles"].get(key, key), run["tables"][key])
    sample += [*run.get("verdict", "").splitlines(), f"demo finished in {run['seconds']:.0f} s"]
    greedy, beam = s["paired_diff"]["test_greedy"], s["paired_diff"]["test_ct2_beam"]
    ahead = sum(bool(r.get("rl_ahead")) for r in seeds.values())
    every = "on every seed" if ahead == len(seeds) else f"on {ahead} of the {len(seeds)} seeds"
    summary = (f"Over {len(seeds)} seeds (`run.seed={','.join(seeds)}`, {short_machine(data)}) RL is ahead of both "
               f"baselines on validation, test greedy and test beam search {every}: on test, greedy, RL − SFT "
               f"{paired(greedy['rl-sft'])} and RL − continued SFT {paired(greedy['rl-continued_sft'])}; with "
               f"CTranslate2 beam search {paired(beam['rl-sft'])} and {paired(beam['rl-continued_sft'])}. The demo "
               f"took {s['wall_seconds']['mean']:.0f} ± {s['wall_seconds']['std']:.0f} s there"
               f"{' (' + note + ')' if (note := data.get('settings', {}).get('note')) else ''} "
               f"([demo seeds](docs/benchmarks/demo_seeds.md)). Below, seed {seed}'s output, abridged:")
    return "\n".join([header("bench/results/demo_seeds.json").rstrip(),
                      textwrap.fill(summary, 115, break_on_hyphens=False), "", "```", *sample, "```"])
