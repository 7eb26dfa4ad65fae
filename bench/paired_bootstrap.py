"""How much of a seed's paired difference is the test split's own sampling noise.

    python bench/paired_bootstrap.py bench/results/algorithms_docstring_names_rlsplit_pooled.json [--samples 300]

The target of bench/algorithms.py is a paired difference (arm minus baseline, seed by seed) over its std across
seeds. That std has two parts: the effect itself varies from one pipeline (seed) to the next, and each seed's
difference is read on one finite test split. This script measures the second part. For every arm and seed of a
saved result whose run directories still exist (the run's --workdir), it resamples the test sources with
replacement and recomputes, on the same resample, the task score of the arm's last checkpoint and of each
baseline (the SFT checkpoint, and continued SFT when the result has it), from the greedy predictions the
benchmark saved. The std over resamples is that seed's test noise. What the noise leaves of the spread over seeds,
sqrt(std² − mean noise²), is the effect's own spread: no larger test split reduces it.

Each full-sample score is checked against the one the benchmark saved, so a run directory that changed since is
refused. Saves bench/results/<result stem>_bootstrap.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import save  # noqa: E402

from rlt2t.common.config import load_config  # noqa: E402
from rlt2t.common.metrics import Metric, get_metric  # noqa: E402


def paired_bootstrap(arm: Sequence[str], base: Sequence[str], refs: Sequence[Sequence[str]], metric: Metric,
                     samples: int, seed: int = 0) -> tuple[float, float]:
    """(corpus score of ``arm`` − that of ``base``, the std of that difference over ``samples`` resamples of the
    rows with replacement, both scored on the same resample)."""
    if not len(arm) == len(base) == len(refs) > 0:
        raise ValueError(f"{len(arm)} arm predictions, {len(base)} baseline predictions and {len(refs)} reference "
                         "lists: need the same rows, at least one")
    if samples < 2:
        raise ValueError(f"samples must be at least 2, got {samples}")
    rng = random.Random(seed)
    rows = range(len(refs))
    diffs = []
    for _ in range(samples):
        pick = [rng.choice(rows) for _ in rows]
        pick_refs = [refs[i] for i in pick]
        diffs.append(metric.corpus([arm[i] for i in pick], pick_refs)
                     - metric.corpus([base[i] for i in pick], pick_refs))
    return metric.corpus(list(arm), list(refs)) - metric.corpus(list(base), list(refs)), statistics.stdev(diffs)


def _predictions(path: Path) -> dict[str, tuple[str, list[str]]]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no saved predictions (is the benchmark's --workdir still there?)")
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {r["id"]: (r["prediction"], r["references"]) for r in rows}


def measure(payload: dict[str, Any], samples: int, only: Sequence[str] = ()) -> dict[str, Any]:
    """Per arm (those in ``only``, or all) and baseline: each seed's difference and its bootstrap std, and the
    spread over seeds."""
    arms = payload["arms"]
    if unknown := sorted(set(only) - set(arms)):
        raise ValueError(f"--arms: {', '.join(unknown)} not in the result (arms: {', '.join(arms)})")
    baselines = ["sft"] + (["continued_sft"] if "continued_sft" in arms else [])
    checked: dict[Path, tuple[list[str], list[str], list[list[str]]]] = {}

    def read(path: Path, saved: float, what: str, metric: Metric) -> tuple[list[str], list[str], list[list[str]]]:
        """(ids, predictions, references) of a predictions file, once per file (a seed's SFT readings serve every
        arm), after checking that they score what the result saved."""
        if path not in checked:
            preds = _predictions(path)
            ids = sorted(preds)
            texts, refs = [preds[i][0] for i in ids], [preds[i][1] for i in ids]
            got = metric.corpus(texts, refs)
            if not math.isclose(got, saved, abs_tol=1e-9):
                raise ValueError(f"{what}: the saved predictions score {got:.6f}, the result says {saved:.6f}")
            checked[path] = ids, texts, refs
        return checked[path]

    out: dict[str, Any] = {}
    for arm, runs in arms.items():
        if only and arm not in only:
            continue
        for baseline in baselines:
            if arm == baseline or (arm.startswith("continued_sft") and baseline == "continued_sft"):
                continue
            per_seed = {}
            for seed, run in runs.items():
                run_dir = Path(run["checkpoint"]).parents[2]  # <run>/rl/checkpoints/epoch-N
                cfg = load_config([run_dir / "config" / "rl.yaml"])
                metric = get_metric("task_score", bleu_weight=cfg.metric.bleu_weight, sigma=cfg.metric.cider_sigma)
                ids, texts, refs = read(run_dir / "eval" / "last-test.predictions.jsonl", run["test"]["task_score"],
                                        f"{arm} seed {seed}", metric)
                if baseline == "sft":
                    path = run_dir.parent / "continued_sft" / "eval" / "sft-test.predictions.jsonl"
                    saved = payload["sft"][seed]["test_task_score"]
                else:
                    path = Path(arms[baseline][seed]["checkpoint"]).parents[2] / "eval" / "last-test.predictions.jsonl"
                    saved = arms[baseline][seed]["test"]["task_score"]
                base_ids, base_texts, _ = read(path, saved, f"{baseline} seed {seed}", metric)
                if base_ids != ids:
                    raise ValueError(f"{arm} seed {seed}: the {baseline} predictions cover other test sources")
                diff, noise = paired_bootstrap(texts, base_texts, refs, metric, samples)
                per_seed[seed] = {"diff": diff, "noise_std": noise}
            diffs = [v["diff"] for v in per_seed.values()]
            noise2 = statistics.fmean(v["noise_std"] ** 2 for v in per_seed.values())
            spread = statistics.stdev(diffs) if len(diffs) > 1 else None
            out[f"{arm} - {baseline}"] = {
                "per_seed": per_seed, "mean": statistics.fmean(diffs), "seed_std": spread,
                "noise_std": math.sqrt(noise2),
                "effect_std": None if spread is None else math.sqrt(max(spread**2 - noise2, 0.0))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", type=Path, help="a bench/algorithms.py result (JSON) whose --workdir still exists")
    ap.add_argument("--samples", type=int, default=300, help="bootstrap resamples of the test sources")
    ap.add_argument("--arms", default="", help="comma-separated arms to measure (default: every arm)")
    ap.add_argument("--no-save", action="store_true", help="print only; leave bench/results/ alone")
    args = ap.parse_args()
    payload = json.loads(args.result.read_text())
    try:
        readings = measure(payload, args.samples, [a for a in args.arms.split(",") if a])
    except (OSError, ValueError, KeyError) as e:
        ap.error(str(e))
    for name, r in readings.items():
        seeds = ", ".join(f"{s}: {v['diff']:+.3f} ± {v['noise_std']:.3f}" for s, v in r["per_seed"].items())
        spread = "" if r["seed_std"] is None else (f"; std over seeds {r['seed_std']:.3f}, of which the effect's "
                                                   f"own {r['effect_std']:.3f}")
        print(f"{name}: mean {r['mean']:+.3f}; test noise {r['noise_std']:.3f} per seed ({seeds}){spread}")
    if not args.no_save:
        print("saved", save(f"{args.result.stem}_bootstrap", {
            "benchmark": "paired_bootstrap", "result": args.result.name, "samples": args.samples,
            "readings": readings}))


if __name__ == "__main__":
    main()
