"""Does `make demo`'s verdict hold on every seed? The demo rerun as a user runs it, seed by seed.

    python bench/demo_seeds.py [--seeds 1,2,3,4,5] [--workdir DIR] [--name demo_seeds] [key=value ...]

For each seed, ``rlt2t demo --fresh run.seed=N run.dir=<workdir>/seed<N> [key=value ...]`` runs in a subprocess
(its wall time is what a user waits after the install), then its ``eval/demo-summary.json`` gives the task score
of the SFT checkpoint, continued SFT and RL on validation (greedy), on test (greedy) and on test with CTranslate2
(int8, beam ``predict.beam_size``). The demo's synthetic data (``synth.seed``) is the same for every seed; the seed
changes pretraining and SFT initialisation, data order, dropout and RL's sampling.

Saved to ``bench/results/<name>.json``: the per-seed figures, mean ± sample std over seeds, the paired
differences RL − SFT and RL − continued SFT per table, and whether RL is ahead of both on every table of every
seed. A seed whose run directory already holds a summary made with the same arguments is reused (``--rerun``
runs it again).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import save  # noqa: E402

TABLES = ("valid", "test_greedy", "test_ct2_beam")
MODELS = ("sft", "continued_sft", "rl")


def run_seed(seed: int, workdir: Path, overrides: list[str], rerun: bool) -> dict:
    """One demo run (or the saved one of the same arguments) → its per-seed record."""
    run_dir = workdir / f"seed{seed}"
    args = ["demo", "--fresh", f"run.seed={seed}", f"run.dir={run_dir}", *overrides]
    done, summary_path = run_dir / "bench-args.json", run_dir / "eval" / "demo-summary.json"
    if not rerun and summary_path.is_file() and done.is_file() and json.loads(done.read_text()) == args:
        print(f"seed {seed}: reusing {summary_path}", flush=True)
    else:
        print(f"seed {seed}: rlt2t {' '.join(args)}", flush=True)
        t0 = time.perf_counter()
        log = workdir / f"seed{seed}.log"
        workdir.mkdir(parents=True, exist_ok=True)
        with log.open("w") as out:
            proc = subprocess.run([sys.executable, "-m", "rlt2t.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if proc.returncode != 0:
            raise SystemExit(f"seed {seed}: the demo exited {proc.returncode}; see {log}")
        (run_dir / "bench-wall-seconds.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
        done.write_text(json.dumps(args))
    summary = json.loads(summary_path.read_text())
    wall = float((run_dir / "bench-wall-seconds.txt").read_text())
    record = {"seconds": summary["seconds"], "wall_seconds": wall, "rl_algorithm": summary["rl_algorithm"],
              **{t: summary["scores"][t] for t in TABLES}, "rl_ahead": all(summary["rl_ahead"].values()),
              "tables": summary.get("tables", {}), "titles": summary.get("titles", {}),
              "verdict": summary.get("verdict", "")}
    print(f"seed {seed}: {record}", flush=True)
    return record


def stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def summarize(seeds: dict[str, dict]) -> dict:
    """Mean ± std of each model on each table, and the paired differences RL − each baseline."""
    runs = list(seeds.values())
    out: dict = {"metric": "task_score", "seconds": stats([r["seconds"] for r in runs]),
                 "wall_seconds": stats([r["wall_seconds"] for r in runs])}
    out["paired_diff"] = {}
    for t in TABLES:
        out[t] = {m: stats([r[t][m] for r in runs]) for m in MODELS}
        out["paired_diff"][t] = {f"rl-{m}": {**stats([r[t]["rl"] - r[t][m] for r in runs]),
                                             "relative": statistics.fmean(
                                                 [(r[t]["rl"] - r[t][m]) / r[t][m] for r in runs])}
                                 for m in ("sft", "continued_sft")}
    out["rl_ahead_on_every_seed"] = all(r["rl_ahead"] for r in runs)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1,2,3,4,5", help="comma-separated run.seed values")
    parser.add_argument("--workdir", default=None,
                        help="where the runs go, one run.dir per seed (default /tmp/bench-demo/<name>)")
    parser.add_argument("--name", default="demo_seeds", help="results file stem under bench/results")
    parser.add_argument("--rerun", action="store_true", help="run seeds again even when a saved run matches")
    parser.add_argument("--note", default="",
                        help="what else ran on the machine while the seeds were timed (shown beside the seconds)")
    parser.add_argument("overrides", nargs="*", help="config overrides passed to every demo (key.path=value)")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    workdir = Path(args.workdir or f"/tmp/bench-demo/{args.name}")
    per_seed = {str(s): run_seed(s, workdir, args.overrides, args.rerun) for s in seeds}
    summary = summarize(per_seed)
    command = " ".join(["python bench/demo_seeds.py", f"--seeds {args.seeds}",
                        *([f"--name {args.name}"] if args.name != "demo_seeds" else []), *args.overrides])
    # The synthetic task's generator version, as each seed's data recorded it (a reused run keeps its data).
    versions = sorted({json.loads((workdir / f"seed{s}" / "data" / "synth_meta.json").read_text())["version"]
                       for s in seeds})
    path = save(args.name, {"benchmark": "demo_seeds", "command": command,
                            "settings": {"seeds": seeds, "overrides": args.overrides, "note": args.note,
                                         "synth_generator_version": versions[0] if len(versions) == 1 else versions},
                            "seeds": per_seed,
                            "summary": summary})
    for t in TABLES:
        row = ", ".join(f"{m} {summary[t][m]['mean']:.3f} ± {summary[t][m]['std']:.3f}" for m in MODELS)
        diffs = ", ".join(f"{k} {d['mean']:+.3f} ± {d['std']:.3f} ({d['relative']:+.1%})"
                          for k, d in summary["paired_diff"][t].items())
        print(f"{t:<14} {row}\n{'':<14} {diffs}")
    print(f"RL ahead of both baselines on every table of every seed: {summary['rl_ahead_on_every_seed']}; "
          f"demo {summary['seconds']['mean']:.0f} ± {summary['seconds']['std']:.0f} s "
          f"(wall {summary['wall_seconds']['mean']:.0f} s) → {path}")
    return 0 if summary["rl_ahead_on_every_seed"] else 1


if __name__ == "__main__":
    sys.exit(main())
