"""RL pipeline overlap: does the asynchronous loop hide generation behind learning?

    python bench/pipeline.py [--algorithm rank|grpo|ppo|...] [--sources 512] [--skip-async]

One core each for rollout and learner. On one epoch of N synthetic training sources, with a
from-scratch `small`-preset policy (seed 0, saved as a checkpoint directory) as the sampling policy:

  G      generate + score alone: RolloutWorker.sample then RewardWorker.score, chunk by chunk,
         sequentially, in this process with torch.set_num_threads(1); measured once;
  L      learn alone: a fresh Learner steps over G's scored items (batches in dataset order), in this
         process, threads=1, after the learner's preflight (rl.preflight: one forward and backward
         on the largest batch, which the job's learners run at setup, before their epoch);
  sync   the synchronous loop = G then L back to back (so sync = G + L by construction);
  async  the real RL job (`rlt2t.driver.train`) for one epoch on a Ray started locally by
         `init_ray`: 1 learner (1 CPU, 1 thread), 1 rollout worker (1 CPU), 1 reward worker.

The algorithm's own defaults apply (rank RL publishes once per epoch, the policy gradients every step, so
their rollouts run one step behind the learner). Reported: async wall vs max(G, L) (target: within 10%) and
the learner busy fraction the job logs in <run>/logs/rl/metrics.jsonl (target: >= 90% when L >= G). The
machine's speed drifts by 10-20% over minutes (a shared VM), more than the margin being measured, so the
measurement runs in rounds (--async-runs, default 3): L, then an async epoch on a fresh Ray, each async wall
judged against the max(G, L) of its own round. The median round is reported and every round's ratio is listed.
The async wall is split into the learner's compute (the sum of the steps' step_s) and the time it waited.

The job's learners run their preflight (rl.preflight) right after they start, while the rollout and
reward workers are constructed; whatever of it is not over when the epoch starts delays the first step
and counts in the async wall. The preflight's cost outside the epoch shows in async.excluded and
train_total_s.

What the async wall excludes, and how: Ray startup (init_ray is called, and timed, before train, which
then finds Ray running) and actor construction (the job waits for every worker to answer before its first
epoch; the epoch method is wrapped to time the real epoch alone). The final checkpoint write and actor
shutdown after the epoch are excluded too. The excluded seconds are reported next to the epoch wall, as
is the total wall of the train call.

The from-scratch policy mostly samples EOS at once (such empty candidates are dropped, so many pairs
are gold vs. one rambling sample) and now and then runs to rollout.max_new_tokens, which keeps its
batch decoding: G comes out at roughly a quarter of L (2-core machine, N = 64-320), so this run is
learner-bound and tests the learner busy fraction. --num-samples makes G heavier to probe G ~ L.
Candidate lengths are reported (mean_candidate_tokens).

Saves bench/results/pipeline.json for rank RL, pipeline_<algorithm>.json for the others (_no_preflight with
--no-preflight), with the machine description.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import save  # noqa: E402

from rlt2t.actors.reward import RewardWorker  # noqa: E402
from rlt2t.actors.rollout import RolloutWorker  # noqa: E402
from rlt2t.common.config import Config, ModelConfig, load_config  # noqa: E402
from rlt2t.common.data import Example, reference_sets  # noqa: E402
from rlt2t.common.io import atomic_directory  # noqa: E402
from rlt2t.common.metrics import DocumentFrequency  # noqa: E402
from rlt2t.common.policy import load_policy  # noqa: E402
from rlt2t.common.synth import generate_synthetic  # noqa: E402
from rlt2t.common.tokenization import build_ids_tokenizer, save_tokenizer  # noqa: E402
from rlt2t.common.tracking import quiet_transformers  # noqa: E402
from rlt2t.learner.learner import Learner  # noqa: E402
from rlt2t.learner.trainer import epoch_order  # noqa: E402

WALL_TARGET = 1.10  # async wall <= 1.10 * max(G, L)
BUSY_TARGET = 0.90  # learner busy fraction when L >= G


def prepare(workdir: Path) -> tuple[Path, Path]:
    """Tokenizer dir and a from-scratch `small` policy (seed 0) saved as a checkpoint dir under workdir."""
    tok_dir, ckpt = workdir / "tokenizer", workdir / "init"
    with atomic_directory(tok_dir) as tmp:
        save_tokenizer(build_ids_tokenizer(1894), tmp)
    policy = load_policy(ModelConfig(preset="small"), tok_dir, seed=0)
    with atomic_directory(ckpt) as tmp:
        policy.model.save_pretrained(tmp)
        save_tokenizer(policy.tokenizer, tmp)
    return tok_dir, ckpt


def bench_config(workdir: Path, tok_dir: Path, algorithm: str, chunk_size: int, batch_size: int, num_samples: int,
                 preflight: bool = True) -> Config:
    """One epoch, one learner / rollout / reward worker, one CPU each for learner and rollout, no validation."""
    return load_config(overrides=[f"rl.preflight={str(preflight).lower()}", f"rl.algorithm={algorithm}",
        f"run.dir={workdir / 'run'}", "run.progress=false", f"tokenizer.path={tok_dir}", "model.preset=small",
        "rl.epochs=1", "rl.learners=1", "rl.rollout_workers=1", "rl.reward_workers=1",
        "rl.learner_cpus=1", "rl.rollout_cpus=1", "metric.monitor_size=0", "run.log_every=1",
        f"rl.chunk_size={chunk_size}", f"rl.batch_size={batch_size}", f"rollout.num_samples={num_samples}",
    ])


def epoch_chunks(cfg: Config, train: list[Example]) -> list[list[Example]]:
    """Epoch 0's sources in the job's order (epoch_order), cut into rl.chunk_size chunks as it does."""
    examples = [train[i] for i in epoch_order(len(train), cfg.run.seed, 0)]
    return [examples[o : o + cfg.rl.chunk_size] for o in range(0, len(examples), cfg.rl.chunk_size)]


def generate(cfg: Config, train: list[Example], ckpt: Path) -> tuple[list[Any], dict[str, Any]]:
    """G: sample + score every chunk, sequentially, one thread; returns the scored items and G's timings."""
    df = DocumentFrequency.from_references(reference_sets(train))  # as the job computes it
    start = load_policy(cfg.model, cfg.tokenizer_dir, checkpoint=ckpt).model.state_dict()
    spec = cfg.rl.rollout_spec
    rollout = RolloutWorker(cfg.model, str(cfg.tokenizer_dir), cfg.rollout, seed=cfg.run.seed,
                            max_source_len=cfg.data.max_source_len, spec=spec, start_weights=start)
    # Version 0 = the init checkpoint's weights, exactly what the job publishes first.
    rollout.set_weights(0, start)
    reward = RewardWorker(cfg.reward, df)

    sample_s = score_s = 0.0
    items: list[Any] = []
    t_g = time.perf_counter()
    for chunk in epoch_chunks(cfg, train):
        t0 = time.perf_counter()
        sampled = rollout.sample(chunk)
        t1 = time.perf_counter()
        items += reward.score(sampled)
        sample_s, score_s = sample_s + t1 - t0, score_s + time.perf_counter() - t1
    g = time.perf_counter() - t_g
    lengths = [len(t) for i in items
               for t in (i.group.token_ids if hasattr(i, "group") else [i.a.split(), i.b.split()])]
    mean_len = sum(lengths) / max(1, len(lengths))
    print(f"G (generate + score): {g:.1f}s  (sample {sample_s:.1f}s, score {score_s:.1f}s, {len(items)} items, "
          f"{mean_len:.1f} tokens per candidate)", flush=True)
    return items, {"G_s": round(g, 2), "G_sample_s": round(sample_s, 2), "G_score_s": round(score_s, 2),
                   "items": len(items), "mean_candidate_tokens": round(mean_len, 1)}


def learn(cfg: Config, items: list[Any], ckpt: Path) -> dict[str, Any]:
    """L: a fresh learner (as the job's, after its preflight) steps over every scored item, one thread."""
    r = cfg.rl
    steps = math.ceil(len(items) / r.batch_size)
    learner = Learner(cfg.model, str(cfg.tokenizer_dir), r, cfg.rollout, init_checkpoint=str(ckpt), rank=0,
                      world_size=1, total_steps=steps, seed=cfg.run.seed, max_source_len=cfg.data.max_source_len,
                      max_target_len=cfg.data.max_target_len, threads=1)
    preflight_s = None
    if r.preflight:  # as the job's learner does at setup (outside its epoch, as here outside L)
        preflight_s = round(learner.preflight()["seconds"], 2)
    t0 = time.perf_counter()
    metrics: dict[str, float] = {}
    step_s = []
    for first in range(0, len(items), r.batch_size):
        metrics = learner.train_step(items[first : first + r.batch_size])
        step_s.append(round(metrics["step_s"], 3))
    took = time.perf_counter() - t0
    print(f"L (learn): {took:.1f}s  ({steps} steps, {took / steps:.2f}s/step; first {step_s[0]:.2f}s, "
          f"median {statistics.median(step_s):.2f}s; preflight before it {preflight_s}s)", flush=True)
    return {"L_s": round(took, 2), "steps": steps, "learner_preflight_s": preflight_s, "step_s": step_s,
            "last_step": metrics}


def run_async(cfg: Config, train: list[Example], ckpt: Path) -> dict[str, Any]:
    """The real RL job for one epoch; returns its phase timings and what it logged."""
    import ray

    from rlt2t import driver as job
    from rlt2t.groups import init_ray

    # A reused --workdir: start the run clean, so its metrics.jsonl holds this epoch only.
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    init_ray(cfg)
    ray_start = time.perf_counter() - t0
    print(f"Ray started in {ray_start:.1f}s", flush=True)

    marks: dict[str, float] = {}
    real_run_epoch = job._Job._run_epoch

    def timed_run_epoch(self, *args, **kwargs):
        # The job has waited for every worker to answer before its first epoch: the epoch wall (and the
        # learner_busy the job measures inside it) covers the pipeline only.
        marks["setup_end"] = marks["epoch_start"] = time.perf_counter()
        # The rollout worker sets no thread count itself: record what Ray's per-actor OMP setting gave it.
        marks["rollout_threads"] = ray.get(self.rollouts.actors[0].__ray_call__.remote(
            lambda _: torch.get_num_threads()))
        marks["epoch_start"] = time.perf_counter()
        out = real_run_epoch(self, *args, **kwargs)
        marks["epoch_end"] = time.perf_counter()
        return out

    job._Job._run_epoch = timed_run_epoch  # timing wrapper only: the real loop runs unchanged
    try:
        t_call = time.perf_counter()
        result = job.train(cfg, train, [], init=ckpt)
        t_done = time.perf_counter()
    finally:
        job._Job._run_epoch = real_run_epoch
        ray.shutdown()

    rows = [json.loads(line) for line in (cfg.run_dir / "logs" / "rl" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [row for row in rows if row.get("kind") == "train"]
    if not train_rows:
        raise RuntimeError(f"{cfg.run_dir}/logs/rl/metrics.jsonl has no train rows")
    last = train_rows[-1]
    epoch = marks["epoch_end"] - marks["epoch_start"]
    step_s = [round(row["step_s"], 3) for row in train_rows]  # run.log_every=1: one row per step
    out = {
        "epoch_wall_s": round(epoch, 2), "learner_busy": round(last["learner_busy"], 4),
        "steps": result.steps, "items_used": result.items_used, "rollout_threads": marks["rollout_threads"],
        "excluded": {
            "ray_start_s": round(ray_start, 2),
            "train_setup_s": round(marks["setup_end"] - t_call, 2),
            "checkpoint_and_shutdown_s": round(t_done - marks["epoch_end"], 2),
        },
        "train_total_s": round(t_done - t_call, 2),
        # The epoch wall = the learner's compute (sum of step_s) + the time it waited: for the first chunk,
        # between steps (the driver's round trip), or for samples.
        "step_s": step_s, "learner_compute_s": round(sum(step_s), 2),
        "learner_waiting_s": round(epoch - sum(step_s), 2),
        "last_step": {k: v for k, v in last.items() if k not in ("stage", "kind", "time")},
    }
    print(f"async epoch: {epoch:.1f}s = learner compute {sum(step_s):.1f}s (first step {step_s[0]:.2f}s, median "
          f"{statistics.median(step_s):.2f}s) + waiting {epoch - sum(step_s):.1f}s", flush=True)
    print(f"async epoch: {epoch:.1f}s, learner busy {last['learner_busy']:.1%}  "
          f"(train total {out['train_total_s']:.1f}s; excluded {out['excluded']})", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algorithm", default="rank", help="rl.algorithm (its own defaults apply)")
    ap.add_argument("--sources", type=int, default=512,
                    help="N, training sources in the epoch (default 512: L ~40 s, G ~1/4 of that, "
                         "on a quiet 2-core machine)")
    ap.add_argument("--chunk-size", type=int, default=32, help="rl.chunk_size, sources per rollout task")
    ap.add_argument("--batch-size", type=int, default=32, help="rl.batch_size, sources per learner step")
    ap.add_argument("--num-samples", type=int, default=6,
                    help="rollout.num_samples, candidates per source (default 6); raise it to make G the bottleneck")
    ap.add_argument("--async-runs", type=int, default=3,
                    help="rounds of (L, async epoch on a fresh Ray); the median round is reported")
    ap.add_argument("--no-preflight", action="store_true",
                    help="rl.preflight=false (for L and the job): the learners' first step then pays the fresh "
                         "process's warm-up inside the epoch; saved as pipeline_no_preflight.json")
    ap.add_argument("--skip-async", action="store_true", help="measure G, L and sync only (no Ray)")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a temp dir, removed)")
    ap.add_argument("--no-save", action="store_true", help="print only; leave bench/results/ alone")
    args = ap.parse_args()
    for name in ("sources", "chunk_size", "batch_size", "num_samples", "async_runs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    quiet_transformers()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)  # G and L alone get one core each, like the actors

    with tempfile.TemporaryDirectory(prefix="rlt2t-pipeline-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        tok_dir, ckpt = prepare(workdir)
        cfg = bench_config(workdir, tok_dir, args.algorithm, args.chunk_size, args.batch_size, args.num_samples,
                           preflight=not args.no_preflight)
        train = generate_synthetic(args.sources, seed=1)
        items, gen = generate(cfg, train, ckpt)
        # This machine's speed drifts by 10-20% over minutes: each async epoch is paired with an L measured
        # just before it, and judged against its own max(G, L).
        rounds = []
        for i in range(1 if args.skip_async else args.async_runs):
            lrn = learn(cfg, items, ckpt)
            if args.skip_async:
                rounds.append({"L": lrn, "async": None})
                continue
            a = run_async(cfg, train, ckpt)
            ratio = a["epoch_wall_s"] / max(gen["G_s"], lrn["L_s"])
            rounds.append({"L": lrn, "async": a, "ratio": ratio})
            print(f"round {i + 1}: async {a['epoch_wall_s']:.1f}s / max(G {gen['G_s']:.1f}s, L {lrn['L_s']:.1f}s) = "
                  f"{ratio:.3f}", flush=True)

    first_l = rounds[0]["L"]
    sync = {**gen, **first_l, "sync_s": round(gen["G_s"] + first_l["L_s"], 2),
            "L_s_each_round": [x["L"]["L_s"] for x in rounds]}
    summary: dict[str, Any] = {"sync_over_max": round(sync["sync_s"] / max(gen["G_s"], first_l["L_s"]), 3),
                               "max_G_L_s": max(gen["G_s"], first_l["L_s"])}
    asyn = None
    if not args.skip_async:
        ratios = [x["ratio"] for x in rounds]
        mid = sorted(range(len(rounds)), key=lambda i: ratios[i])[len(rounds) // 2]  # the median round
        asyn, lm = rounds[mid]["async"], rounds[mid]["L"]
        bound = max(gen["G_s"], lm["L_s"])
        learner_bound = lm["L_s"] >= gen["G_s"]
        summary |= {
            "max_G_L_s": bound, "median_round": mid + 1,
            "async_over_max": round(ratios[mid], 3),
            "async_over_sync": round(asyn["epoch_wall_s"] / (gen["G_s"] + lm["L_s"]), 3),
            "async_runs_over_max": [round(x, 3) for x in ratios],
            "all_async_runs_meet_wall_target": all(x <= WALL_TARGET for x in ratios),
            "meets_wall_target": ratios[mid] <= WALL_TARGET, "learner_bound": learner_bound,
            # The busy target only applies when the learner is the bottleneck.
            "meets_busy_target": asyn["learner_busy"] >= BUSY_TARGET if learner_bound else None,
            # Deterministic: every L and every async epoch must end on the same loss.
            "same_last_loss_as_sync": all(
                math.isclose(x["async"]["last_step"]["loss"], first_l["last_step"]["loss"], rel_tol=1e-5, abs_tol=1e-6)
                and x["L"]["last_step"]["loss"] == first_l["last_step"]["loss"] for x in rounds),
        }
        each = ", ".join(f"{x:.2f}" for x in ratios)
        print(f"\nG {gen['G_s']:.1f}s  L {lm['L_s']:.1f}s  sync {gen['G_s'] + lm['L_s']:.1f}s  "
              f"async {asyn['epoch_wall_s']:.1f}s (median of {len(rounds)} rounds) = {ratios[mid]:.2f} x max(G, L) "
              f"(target <= {WALL_TARGET:.2f}; rounds: {each})  "
              f"learner busy {asyn['learner_busy']:.1%} (target >= {BUSY_TARGET:.0%} when L >= G: "
              f"{'applies' if learner_bound else 'G > L here'})")
    if args.no_save:
        return
    payload = {
        "benchmark": "pipeline", "algorithm": args.algorithm, "sources": args.sources, "chunk_size": args.chunk_size,
        "batch_size": args.batch_size, "num_samples": args.num_samples, "preflight": not args.no_preflight,
        "policy": "small preset, from scratch (seed 0)", "threads": {"rollout": 1, "learner": 1},
        "targets": {"async_over_max": WALL_TARGET, "learner_busy": BUSY_TARGET},
        "sync": sync, "async": asyn, "summary": summary,
        "rounds": [{"L_s": x["L"]["L_s"], "async_epoch_wall_s": x["async"]["epoch_wall_s"],
                    "async_learner_compute_s": x["async"]["learner_compute_s"],
                    "async_learner_waiting_s": x["async"]["learner_waiting_s"],
                    "train_total_s": x["async"]["train_total_s"], "excluded": x["async"]["excluded"]}
                   for x in rounds if x["async"] is not None],
        "notes": "async wall = the real epoch of the RL job, timed after every actor is constructed; "
                 "Ray startup, actor construction, final checkpoint and shutdown excluded and listed under "
                 "async.excluded. G (once) and L run in this process (no Ray), one thread each; each async "
                 "epoch is paired with an L measured just before it (rounds), the median round is reported.",
    }
    name = "pipeline" if args.algorithm == "rank" else f"pipeline_{args.algorithm}"
    print("saved", save(name + ("_no_preflight" if args.no_preflight else ""), payload))


if __name__ == "__main__":
    main()
