"""The figures of the result files whose shape is known: the RL-efficacy benchmark (bench/algorithms.py), the
demo over seeds (bench/demo_seeds.py) and the decoding benchmark (bench/decoding.py), and the command that reruns
a file."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from docgen.markdown import drop_empty_columns, fmt, mean_std, paired, table
from docgen.results import machine_line

# -- benchmarks: the RL-efficacy results (bench/algorithms.py) ----------------------------------------------

ALGORITHM_META = ("baseline", "baseline_candidates", "excluded_seeds")


def algorithm_arms(data: dict) -> list[str]:
    """The SFT checkpoint, then the arms in the order they were run."""
    summary = data["summary"]
    arms = [a for a in data.get("settings", {}).get("arms", []) if a in summary]
    return ["sft", *arms, *sorted(a for a in summary if a not in arms and a != "sft" and a not in ALGORITHM_META)]


def algorithms_summary(data: dict) -> list[str]:
    summary = data["summary"]
    baseline = summary.get("baseline", "sft")
    lines = [f"Baseline: `{baseline}` (of {', '.join(f'`{c}`' for c in summary.get('baseline_candidates', []))}, "
             "the one with the best mean validation score). Scores are the task score, mean ± std over seeds; "
             "differences are paired seed by seed (σ = mean / std of the differences, % relative to the "
             "baseline).", ""]
    head = ["arm", "valid", "test", "held out", f"test − {baseline}", f"valid − {baseline}",
            f"held out − {baseline}", "KL to start", "seconds"]
    rows = []
    for arm in algorithm_arms(data):
        s = summary[arm]
        rows.append([f"`{arm}`", mean_std(s.get("valid_task_score")), mean_std(s.get("test_task_score")),
                     mean_std(s.get("heldout_task_score")), paired(s.get("paired_diff_test")),
                     paired(s.get("paired_diff_valid")), paired(s.get("paired_diff_heldout")),
                     mean_std(s.get("kl_to_start"), 2), mean_std(s.get("seconds"), 0)])
    lines += table(*drop_empty_columns(head, rows))
    return lines + algorithms_each_baseline(data) + algorithms_per_seed(data) + algorithms_extras(data)


def algorithms_each_baseline(data: dict) -> list[str]:
    summary = data["summary"]
    arms = [a for a in algorithm_arms(data) if "paired_diff_test_each" in summary[a]]
    if not arms:
        return []
    others = list(dict.fromkeys([*summary.get("baseline_candidates", []),
                                 *(b for a in arms for b in summary[a]["paired_diff_test_each"])]))
    others = [b for b in others if any(b in summary[a]["paired_diff_test_each"] for a in arms)]
    rows = [[f"`{a}`", *(paired(summary[a]["paired_diff_test_each"].get(b)) for b in others)] for a in arms]
    return ["Test difference of each arm to each likelihood-trained model:", "",
            *table(["arm", *(f"− {b}" for b in others)], rows)]


def algorithms_per_seed(data: dict) -> list[str]:
    sft, arms = data.get("sft", {}), data.get("arms", {})
    seeds = list(dict.fromkeys([*sft, *(s for a in arms.values() for s in a)]))
    names = [a for a in algorithm_arms(data) if a in arms]

    def test_score(arm: str, seed: str) -> Any:
        if arm == "sft":
            return sft.get(seed, {}).get("test_task_score", "")
        return arms.get(arm, {}).get(seed, {}).get("test", {}).get("task_score", "")

    rows = [[seed, *(fmt3(test_score(a, seed)) for a in ["sft", *names])] for seed in seeds]
    return ["Test task score per seed:", "", *table(["seed", *(f"`{a}`" for a in ["sft", *names])], rows)]


def fmt3(x: Any) -> str:
    """A task score to 3 decimals (an empty cell stays empty)."""
    if x == "":
        return ""
    return f"{x:.3f}" if isinstance(x, float) else fmt(x)


def algorithms_extras(data: dict) -> list[str]:
    """The SFT checkpoint's headroom, the synthetic task's phrasings and oracles, exclusions."""
    summary, lines = data["summary"], []
    for key, what in (("headroom_test", "test"), ("headroom_heldout", "held-out")):
        headroom = summary.get("sft", {}).get(key)
        if isinstance(headroom, dict):
            lines += [f"SFT checkpoint's headroom on the {what} split (greedy decode vs a consensus pick among it "
                      "and 6 samples, one sample, and the best by the reference):", "",
                      *table(list(headroom), [[mean_std(v) for v in headroom.values()]])]
    phrasing_arms = [a for a in algorithm_arms(data) if isinstance(summary[a].get("phrasings"), dict)]
    if phrasing_arms:
        kinds = list(summary[phrasing_arms[0]]["phrasings"])
        rows = [[f"`{a}`", *(mean_std(summary[a]["phrasings"].get(k)) for k in kinds)] for a in phrasing_arms]
        lines += ["Share of each phrasing in the test outputs (A: the likeliest, scored lowest by the metric):", "",
                  *table(["arm", *kinds], rows)]
    if isinstance(data.get("oracles"), dict):
        lines += ["Oracles: " + ", ".join(f"{k} {fmt(v)}" for k, v in data["oracles"].items()) + ".", ""]
    if summary.get("excluded_seeds"):
        lines += [f"Excluded seeds: {fmt(summary['excluded_seeds'])}.", ""]
    return lines


def algorithms_notes(data: dict) -> list[str]:
    notes = [str(data[key]) for key in ("note",) if data.get(key)]
    if data.get("reaggregated"):
        notes.append(f"Reaggregated {data['reaggregated']}.")
    if isinstance(data.get("pooled_from"), list):
        notes.append("Pooled (`--pool`) from runs of these settings on disjoint seeds, measured on: "
                     + "; ".join(machine_line(m) for m in data["pooled_from"]) + ".")
    return [f"> {n}" for n in notes] + ([""] if notes else [])


def render_algorithms(data: dict) -> list[str]:
    settings = data.get("settings", {})
    lines = algorithms_notes(data)
    seeds = ", ".join(str(seed) for seed in settings.get("seeds", []))
    lines += [f"Task `{data.get('task')}`, seeds {seeds}, RL epochs {settings.get('rl_epochs')} "
              f"of {settings.get('train_subset')} sources, batch {settings.get('batch_size')}; total "
              f"{fmt(data.get('total_seconds'))} s.", ""]
    return lines + algorithms_summary(data)


def algorithms_command(stem: str, data: dict) -> str:
    s, task = data.get("settings", {}), data.get("task")
    args = [f"--task {task}"]
    for key, flag in (("seeds", "--seeds"), ("arms", "--arms")):
        if s.get(key):
            args.append(f"{flag} {','.join(str(v) for v in s[key])}")
    for key, flag in (("rl_epochs", "--rl-epochs"), ("train_subset", "--train-subset"),
                      ("batch_size", "--batch-size"), ("heldout", "--heldout"),
                      ("fresh_sources", "--fresh-sources"), ("rl_split", "--rl-split")):
        if s.get(key):
            args.append(f"{flag} {s[key]}")
    args += [f"--base-override {o}" for o in s.get("base_overrides", [])]
    args += [f"--override {o}" for o in s.get("overrides", [])]
    if stem != f"algorithms_{task}":
        args.append(f"--results-name {stem}")
    return "python bench/algorithms.py " + " ".join(args)


# -- benchmarks: the demo over seeds (bench/demo_seeds.py) --------------------------------------------------

DEMO_SPLITS = (("valid", "validation"), ("test_greedy", "test, greedy"), ("test_ct2_beam", "test, CT2 beam search"))


def render_demo_seeds(data: dict) -> list[str]:
    summary, seeds = data.get("summary", {}), data.get("seeds", {})
    models = list(dict.fromkeys(m for s in seeds.values() for split, _ in DEMO_SPLITS for m in s.get(split, {})))
    every = summary.get("rl_ahead_on_every_seed")
    lines = [f"**Verdict: RL ahead of {' and '.join(f'`{m}`' for m in models if m != 'rl')} on every seed: "
             f"{fmt(every)}** (metric: {summary.get('metric', 'task score')}).", ""]
    diff_names = list(dict.fromkeys(d for split in summary.get("paired_diff", {}).values() for d in split))
    rows = []
    for split, title in DEMO_SPLITS:
        stats, diffs = summary.get(split, {}), summary.get("paired_diff", {}).get(split, {})
        rows.append([title, *(mean_std(stats.get(m)) for m in models), *(paired(diffs.get(d)) for d in diff_names)])
    lines += ["Mean ± std over seeds, and paired differences (σ = mean / std of the differences):", "",
              *table(["split", *(f"`{m}`" for m in models), *(f"`{d}`" for d in diff_names)], rows)]
    head = ["seed", *(f"{title}: {' / '.join(models)}" for _, title in DEMO_SPLITS), "RL algorithm", "RL ahead",
            "job s", "wall s"]
    per_seed = [[seed, *(" / ".join(fmt3(s.get(split, {}).get(m, "")) for m in models) for split, _ in DEMO_SPLITS),
                 s.get("rl_algorithm", ""), s.get("rl_ahead", ""), s.get("seconds", ""), s.get("wall_seconds", "")]
                for seed, s in seeds.items()]
    lines += ["Per seed (job s: the demo job's own time; wall s: the whole command's):", "",
              *table(*drop_empty_columns(head, per_seed))]
    times = [f"{what} {mean_std(summary[key], 0)} s" for key, what in (("seconds", "job"), ("wall_seconds", "wall"))
             if isinstance(summary.get(key), dict)]
    lines += [f"Time per seed: {'; '.join(times)}.", ""] if times else []
    if note := data.get("settings", {}).get("note"):
        lines += [f"> {note}", ""]
    return lines + demo_reranks(summary.get("reranks"))


def demo_reranks(reranks: dict | None) -> list[str]:
    """The demo's last table again per rerank mode (``--reranks``): the ensemble's test task score, paired
    against the demo's own ensemble and against RL's beam search alone."""
    if not reranks:
        return []
    rows = [[f"`{mode}`", mean_std(r.get("task_score")), paired(r.get("minus_demo_ensemble")),
             paired(r.get("minus_rl_beam")), mean_std(r.get("rerank_ms_per_source"), 2)]
            for mode, r in reranks.items()]
    return ["The demo's last table with each rerank mode (`--reranks`): the ensemble of the three exports on the "
            "test split (task score), mean ± std over seeds, and paired differences:", "",
            *table(["rerank", "ensemble", "− the demo's ensemble", "− RL's beam alone", "rerank ms per source"],
                   rows)]


# -- benchmarks: decoding (bench/decoding.py) ------------------------------------------------------------------

def decoding_pools(protocol: dict) -> list[str]:
    """The pools the methods pick from: the first one's settings, then each later one's changes to it."""
    lines = [f"- `pool` (every method but greedy, beam and the `_<pool>` ones): {'; '.join(protocol['pool'])}"]
    lines += [f"- `{name}` (the methods ending `_{name}`): the first pool with {'; '.join(changes)}"
              for name, changes in protocol.get("later_pools", {}).items()]
    return ["Pools (seeded by the run seed; deduplicated, each text's entries counted):", "", *lines, ""]


def decoding_task(task: str, summary: dict, record: dict) -> list[str]:
    """One task: how it was measured, each method's test figures per checkpoint, #41's targets and the other
    paired differences."""
    lines = [f"### {task}", ""]
    facts = [f"seeds {summary['seeds']}", f"{record.get('test_rows', '?')} test rows"]
    if record.get("train_overrides"):
        facts.append("checkpoints trained with " + ", ".join(f"`{o}`" for o in record["train_overrides"]))
    if record.get("machine"):
        facts.append(f"measured on {machine_line(record['machine'])}")
    if record.get("seconds") is not None:
        facts.append(f"{fmt(record['seconds'])} s of decoding and reward-model training in all")
    lines += ["; ".join(facts) + ".", ""]
    models = list(dict.fromkeys(r["model"] for r in summary["rows"]))
    methods = list(dict.fromkeys(r["method"] for r in summary["rows"]))
    at = {(r["model"], r["method"]): r for r in summary["rows"]}
    head = ["method", *(f"`{m}` task score" for m in models), *(f"`{m}` ROUGE-L" for m in models),
            *(f"`{m}` CPU ms / source" for m in models)]
    rows = [[f"`{x}`",
             *(mean_std({"mean": at[m, x]["task_score"], "std": at[m, x]["task_score_std"]}) for m in models),
             *(mean_std({"mean": at[m, x]["rouge_l"], "std": at[m, x]["rouge_l_std"]}) for m in models),
             *(mean_std({"mean": at[m, x]["cpu_ms_per_source"], "std": at[m, x]["cpu_ms_per_source_std"]}, 1)
               for m in models)] for x in methods]
    lines += ["Test split, mean ± std over seeds (CPU ms: one torch thread; a pool method's are the pool's "
              "generation, its teacher-forced scores and the pick):", "", *table(head, rows)]
    by = {(d["comparison"], d["metric"]): d for d in summary["paired"]}
    targets = [d for d in summary["paired"] if "target" in d]
    lines += ["#41's targets, paired seed by seed (σ = mean / std of the differences, % of the baseline's mean; the "
              "targets are on the task score, ROUGE-L beside it):", "",
              *table(["comparison", "task score difference", "per seed", "target", "met", "ROUGE-L difference"],
                     [[d["comparison"], paired(d), ", ".join(f"{v:+.3f}" for v in d["per_seed"]), d["target"],
                       d["met"], paired(by.get((d["comparison"], "rouge_l")))] for d in targets])]
    named = {d["comparison"] for d in targets}
    others = list(dict.fromkeys(name for name, _ in by if name not in named))
    lines += ["The other paired differences:", "",
              *table(["comparison", "task score", "ROUGE-L"],
                     [[name, paired(by.get((name, "task_score"))), paired(by.get((name, "rouge_l")))]
                      for name in others])]
    return lines


def render_decoding(data: dict) -> list[str]:
    tasks = data.get("tasks", {})
    lines = ["Each task was measured on the machine its section names (the line above names the last one saved).",
             ""]
    lines += decoding_pools(data.get("protocol", {"pool": []}))
    for task, summary in data["summary"].items():
        lines += decoding_task(task, summary, tasks.get(task, {}))
    return lines


RENDERERS: dict[str, Callable[[dict], list[str]]] = {"algorithms": render_algorithms, "demo_seeds": render_demo_seeds,
                                                     "decoding": render_decoding}


def rerun_command(stem: str, data: dict) -> str | None:
    """The command that produced this file, where the file records enough to say."""
    if isinstance(data.get("command"), str):
        return data["command"]
    kind = data.get("benchmark")
    if kind == "algorithms" and "pooled_from" not in data:
        return algorithms_command(stem, data)
    if kind == "group_spread" and data.get("result"):
        return (f"python bench/group_spread.py bench/results/{data['result']} --arm {data.get('arm')} "
                f"--sources {data.get('sources')}")
    if kind == "paired_bootstrap" and data.get("result"):
        return f"python bench/paired_bootstrap.py bench/results/{data['result']} --samples {data.get('samples')}"
    return None


