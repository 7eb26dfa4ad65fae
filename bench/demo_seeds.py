"""Does `make demo`'s verdict hold on every seed? The demo rerun as a user runs it, seed by seed.

    python bench/demo_seeds.py [--seeds 1,2,3,4,5] [--workdir DIR] [--name demo_seeds] [--reranks M1,M2]
                               [key=value ...]

For each seed, ``rlt2t demo --fresh run.seed=N run.dir=<workdir>/seed<N> [key=value ...]`` runs in a subprocess
(its wall time is what a user waits after the install), then its ``eval/demo-summary.json`` gives the task score
of the SFT checkpoint, continued SFT and RL on validation (greedy), on test (greedy) and on test with CTranslate2
(int8, beam ``predict.beam_size``). The demo's synthetic data (``synth.seed``) is the same for every seed; the seed
changes pretraining and SFT initialisation, data order, dropout and RL's sampling.

``--reranks`` (e.g. ``mean_logprob,mbr,consensus``) predicts the test split again from each seed's exports, once
per rerank mode, as the demo's last table does (the three models generate and score, ``predict.*`` of the demo's
config, whatever mode it picked with): each mode's ensemble task score, its seconds per source, and its paired
differences against the demo's own ensemble and against RL's beam search alone.

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


def rerank_seed(seed: int, workdir: Path, overrides: list[str], modes: list[str]) -> dict[str, dict]:
    """The demo's last table with each rerank mode in ``modes``: {mode: {"task_score", "seconds_per_source"}}."""
    import rlt2t

    run_dir = workdir / f"seed{seed}"
    cfg = rlt2t.load_config(overrides=[f"run.seed={seed}", f"run.dir={run_dir}", *overrides])
    exports = [cfg.path(cfg.export.out) / m for m in MODELS]
    out: dict[str, dict] = {}
    for mode in modes:
        result = rlt2t.predict(cfg, exports, exports, cfg.path(cfg.data.test), run_dir / "predict" / f"test-{mode}.csv",
                               rerank=mode, metrics=["task_score"])
        assert result.metrics is not None, "the demo's test split has targets"
        out[mode] = {"task_score": result.metrics[f"ensemble ({mode})"]["task_score"],
                     "seconds_per_source": result.seconds_per_source}
        print(f"seed {seed}: rerank {mode}: task_score {out[mode]['task_score']:.4f}, "
              f"{result.seconds_per_source['rerank'] * 1e3:.2f} ms per source to rerank", flush=True)
    return out


def stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def paired(values: list[float], base: list[float]) -> dict:
    """Seed-by-seed differences ``values − base``: their stats and the mean relative difference."""
    pairs = list(zip(values, base, strict=True))
    return {**stats([a - b for a, b in pairs]), "relative": statistics.fmean([(a - b) / b for a, b in pairs])}


def summarize(seeds: dict[str, dict]) -> dict:
    """Mean ± std of each model on each table, and the paired differences RL − each baseline."""
    runs = list(seeds.values())
    out: dict = {"metric": "task_score", "seconds": stats([r["seconds"] for r in runs]),
                 "wall_seconds": stats([r["wall_seconds"] for r in runs])}
    out["paired_diff"] = {}
    for t in TABLES:
        out[t] = {m: stats([r[t][m] for r in runs]) for m in MODELS}
        out["paired_diff"][t] = {f"rl-{m}": paired([r[t]["rl"] for r in runs], [r[t][m] for r in runs])
                                 for m in ("sft", "continued_sft")}
    out["rl_ahead_on_every_seed"] = all(r["rl_ahead"] for r in runs)
    if all("reranks" in r for r in runs):
        demo = [_demo_ensemble(r) for r in runs]
        rl = [r["test_ct2_beam"]["rl"] for r in runs]
        out["reranks"] = {}
        for mode in runs[0]["reranks"]:
            scores = [r["reranks"][mode]["task_score"] for r in runs]
            out["reranks"][mode] = {
                "task_score": stats(scores),
                "rerank_ms_per_source": stats([r["reranks"][mode]["seconds_per_source"]["rerank"] * 1e3
                                               for r in runs]),
                "minus_demo_ensemble": paired(scores, demo), "minus_rl_beam": paired(scores, rl)}
    return out


def _demo_ensemble(record: dict) -> float:
    """The task score of the demo's own ensemble row (``ensemble (<its mode>)``) on its last table."""
    (row,) = [v for k, v in record["tables"]["test_ct2_beam"].items() if k.startswith("ensemble (")]
    return row["task_score"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1,2,3,4,5", help="comma-separated run.seed values")
    parser.add_argument("--workdir", default=None,
                        help="where the runs go, one run.dir per seed (default /tmp/bench-demo/<name>)")
    parser.add_argument("--name", default="demo_seeds", help="results file stem under bench/results")
    parser.add_argument("--rerun", action="store_true", help="run seeds again even when a saved run matches")
    parser.add_argument("--note", default="",
                        help="what else ran on the machine while the seeds were timed (shown beside the seconds)")
    parser.add_argument("--reranks", default="",
                        help="comma-separated predict rerank modes to run again on each seed's exports (default: none)")
    parser.add_argument("overrides", nargs="*", help="config overrides passed to every demo (key.path=value)")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    workdir = Path(args.workdir or f"/tmp/bench-demo/{args.name}")
    modes = [m for m in args.reranks.split(",") if m]
    per_seed = {str(s): run_seed(s, workdir, args.overrides, args.rerun) for s in seeds}
    if modes:
        for s in seeds:
            per_seed[str(s)]["reranks"] = rerank_seed(s, workdir, args.overrides, modes)
    summary = summarize(per_seed)
    command = " ".join(["python bench/demo_seeds.py", f"--seeds {args.seeds}",
                        *([f"--name {args.name}"] if args.name != "demo_seeds" else []),
                        *([f"--reranks {args.reranks}"] if modes else []), *args.overrides])
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
    for mode, r in summary.get("reranks", {}).items():
        print(f"rerank {mode:<13} {r['task_score']['mean']:.3f} ± {r['task_score']['std']:.3f}, "
              + ", ".join(f"{k.removeprefix('minus_')} {r[k]['mean']:+.3f} ± {r[k]['std']:.3f} "
                          f"({r[k]['relative']:+.1%})" for k in ("minus_demo_ensemble", "minus_rl_beam"))
              + f", {r['rerank_ms_per_source']['mean']:.2f} ms per source to rerank")
    print(f"RL ahead of both baselines on every table of every seed: {summary['rl_ahead_on_every_seed']}; "
          f"demo {summary['seconds']['mean']:.0f} ± {summary['seconds']['std']:.0f} s "
          f"(wall {summary['wall_seconds']['mean']:.0f} s) → {path}")
    return 0 if summary["rl_ahead_on_every_seed"] else 1


if __name__ == "__main__":
    sys.exit(main())
