"""Benchmark result files: which page each belongs to, how each is read, and the figures of any shape."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from docgen.markdown import table

# -- benchmarks: which files make which page ----------------------------------------------------------------

@dataclass(frozen=True)
class Page:
    title: str
    script: str  # bench/<script>.py
    measures: str = ""  # what it measures, when the script's docstring is not the right words


ALGORITHMS = ("Which RL algorithm raises the task score above likelihood training (the SFT checkpoint, or "
              "continued SFT for the same steps), over seeds: each seed reruns the whole pipeline, then every arm "
              "trains the same learner steps from that seed's SFT checkpoint.")

# A page gathers the result files whose names start with its name (the longest such name wins); in this order
# in the index and the nav. A result file no page claims gets a page of its own.
PAGES = {
    "demo_seeds": Page("Demo over seeds: SFT, continued SFT and RL", "demo_seeds",
                       "The whole `make demo` pipeline rerun on several seeds: the SFT checkpoint, continued SFT "
                       "and the RL policy scored on validation, on test with greedy decoding and on test with "
                       "the CTranslate2 export's beam search."),
    "algorithms_synth": Page("RL algorithms: synthetic task", "algorithms", ALGORITHMS + " The task: the demo's "
                             "synthetic reports (ids tokenizer), where the likeliest phrasing is not the one the "
                             "metric scores best."),
    "algorithms_docstring_names": Page("RL algorithms: several-reference names task", "algorithms", ALGORITHMS +
                                       " The task: a function name → the summary line of its docstring, every "
                                       "summary written for that name a reference (up to 10; human-written "
                                       "English, subword tokenizer)."),
    "algorithms_docstrings": Page("RL algorithms: docstring task", "algorithms", ALGORITHMS + " The task: a "
                                  "function's name and arguments → the summary line its authors wrote, one "
                                  "reference (human-written English, subword tokenizer)."),
    "dpo_synth": Page("DPO against continued SFT and GRPO: synthetic task", "algorithms",
                      "Offline preference optimisation (DPO) from the SFT checkpoint, its pairs the best and the "
                      "worst of 6 samples per source by the task score, against continued SFT (the same 48 "
                      "learner steps as GRPO) and GRPO, with DPO given about GRPO's wall time; each seed reruns "
                      "the whole pipeline. The task: the demo's synthetic reports (ids tokenizer)."),
    "sft_step": Page("SFT step", "sft_step"),
    "learner_step": Page("Rank-RL learner step: shared encoder", "learner_step"),
    "group_step": Page("Group policy-gradient step: shared encoder", "group_step"),
    "pipeline": Page("Pipeline overlap of rollout and learning", "pipeline"),
    "decoding": Page("Decoding: MBR, reward rerank and the oracle", "decoding"),
    "serve_load": Page("Policy server under load", "serve_load"),
    "ct2_sampling": Page("CTranslate2 sampling throughput", "ct2_sampling"),
    "reward_throughput": Page("Learned-reward throughput", "reward_throughput"),
    "annotate_load": Page("Annotation app under load", "annotate_load"),
    "warm_start": Page("Warm start from a pretrained encoder", "warm_start"),
    "lora": Page("LoRA vs full fine-tuning", "lora"),
    "data_load": Page("Loading a million-row Parquet file", "data_load"),
    "omp_wait": Page("CPU threads beside other work: the OpenMP wait policy", "omp_wait"),
}


def page_of(stem: str) -> str:
    claims = [name for name in PAGES if stem == name or stem.startswith(name + "_")]
    return max(claims, key=len) if claims else stem


@dataclass(frozen=True)
class Unreadable:
    """A result file that is not JSON."""

    error: str


def load_results(results_dir: Path) -> dict[str, dict[str, Any]]:
    """page name -> {stem: parsed JSON, or an Unreadable}, pages and files sorted."""
    pages: dict[str, dict[str, Any]] = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            data: Any = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            data = Unreadable(str(e))
        pages.setdefault(page_of(path.stem), {})[path.stem] = data
    order = list(PAGES)
    return dict(sorted(pages.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in PAGES else len(order), kv[0])))


# -- benchmarks: one result file ----------------------------------------------------------------------------

def machine_line(machine: Any) -> str:
    if not isinstance(machine, dict):
        return ""
    parts = [machine.get("cpu") or "unknown CPU"]
    if machine.get("cores"):
        parts.append(f"{machine['cores']} cores")
    if machine.get("memory_gib"):
        parts.append(f"{machine['memory_gib']} GiB")
    if machine.get("cuda"):
        parts.append(str(machine["cuda"]))
    parts += [f"{what} {machine[key]}" for key, what in (("torch", "torch"), ("python", "Python"),
                                                          ("torch_threads", "torch threads:")) if machine.get(key)]
    return ", ".join(str(p) for p in parts) + (f"; {machine['date']}" if machine.get("date") else "")


def is_row_table(value: Any) -> bool:
    """A list of records, or a mapping of two or more records: one table, a row each."""
    if isinstance(value, list):
        return bool(value) and all(isinstance(v, dict) for v in value)
    return isinstance(value, dict) and len(value) >= 2 and all(isinstance(v, dict) for v in value.values())


def flatten(record: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def row_table(value: list | dict, name_column: str) -> list[str]:
    records = list(value.items()) if isinstance(value, dict) else [(str(i + 1), v) for i, v in enumerate(value)]
    flat = [(name, flatten(record)) for name, record in records]
    keys = sorted({k for _, f in flat for k in f})
    return table([name_column, *keys], [[name, *(f.get(k, "") for k in keys)] for name, f in flat])


def generic_figures(data: dict, skip: tuple[str, ...] = ("machine", "benchmark", "command")) -> list[str]:
    """Any result: its top-level scalars in one table; each top-level mapping in a table of its own (its
    `summary` first), nested mappings flattened to dotted keys; each list or mapping of records as a table
    with a row per record."""
    top = {k: v for k, v in data.items() if k not in skip}
    order = sorted(top, key=lambda k: (isinstance(top[k], dict) and bool(top[k]), k != "summary"))
    return figure_tables({k: top[k] for k in order}, "", sections=True)


def figure_tables(node: dict, title: str, sections: bool = False) -> list[str]:
    pairs: list[list[Any]] = []
    tables: list[str] = []

    def walk(sub: dict, prefix: str) -> None:
        for key, value in sub.items():
            path = f"{prefix}{key}"
            if is_row_table(value):
                tables.extend([f"**{title}{path}**", "", *row_table(value, "entry")])
            elif isinstance(value, dict) and value and sections:
                tables.extend(figure_tables(value, f"{path}."))
            elif isinstance(value, dict) and value:
                walk(value, f"{path}.")
            else:
                pairs.append([f"`{path}`", value])

    walk(node, "")
    heading = [f"**{title.rstrip('.')}**", ""] if title and pairs else []
    return heading + (table(["figure", "value"], pairs) if pairs else []) + tables


