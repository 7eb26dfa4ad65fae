"""Does rank RL beat continued SFT on the synthetic task? Validation score per epoch, several seeds.

    python bench/quality.py [--workdir DIR] [--size 4000] [--sft-epochs 4] [--rank-epochs 4]
                            [--train-subset 640] [--rank-lr LR] [--seeds 1,2,3]

From ONE SFT checkpoint (synthetic data, ids tokenizer, `small` preset, short denoising pretraining, then
SFT: the `rlt2t demo` stages, run through rlt2t.jobs), two arms continue for the same number of learner
steps through the same Ray learner (rlt2t.jobs.rank_job):

  rank RL       rank.loss_weight = 0.2 (the default λ): CE(gold) + 0.2 * pairwise rank loss;
  continued SFT rank.loss_weight = 0: CE on the gold targets only (rollouts still run, unused).

Each arm runs once per seed (run.seed: epoch order, dropout, sampling); every other setting is equal.
The score is what the driver logs per epoch in <arm>/logs/rank/metrics.jsonl (kind "valid"): greedy
decoding of the first metric.monitor_size validation examples, `monitor` (CIDEr-D, the checkpoint
selector) and `task_score` ((1-w)·CIDEr-D + w·BLEU-4, w = 1/3). Epoch 0 is the shared SFT checkpoint,
scored by the same LearnerRank.evaluate. Mean ± sample std (ddof 1) over seeds of the last epoch, the
per-seed paired difference (RL - SFT), and, as a held-out check, the test split score of each arm's last
checkpoint (rlt2t.jobs.eval_job, greedy). Note SFT picked its checkpoint by the validation monitor on the
same examples: epoch 0's validation score is slightly optimistic, equally for both arms.

A --workdir that already holds finished stages is resumed (a completed arm only reloads its last
checkpoint; its "seconds" then count that reload and it is marked "resumed").
Saves bench/results/quality.json and bench/results/quality.png (curves, Agg backend).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import RESULTS, save  # noqa: E402

from rlt2t.common.checkpoint import latest_complete_checkpoint  # noqa: E402
from rlt2t.common.config import Config, load_config  # noqa: E402
from rlt2t.common.io import atomic_open  # noqa: E402
from rlt2t.common.tracking import setup_logging  # noqa: E402
from rlt2t.jobs import (  # noqa: E402
    eval_job,
    load_split,
    prepare_sft,
    rank_job,
)
from rlt2t.learner.rank_learner import LearnerRank  # noqa: E402

log = logging.getLogger("bench.quality")
ARMS = {"rank_rl": 0.2, "continued_sft": 0.0}  # arm -> rank.loss_weight
SCORES = ("monitor", "task_score")


def base_config(workdir: Path, args: argparse.Namespace) -> Config:
    """The shared stages' config: data, tokenizer, pretraining and SFT under <workdir>/base."""
    return load_config(overrides=[
        f"run.dir={workdir / 'base'}", "run.progress=false", f"synth.size={args.size}",
        f"sft.epochs={args.sft_epochs}", f"pretrain.max_steps={args.pretrain_steps}",
        f"pretrain.enabled={args.pretrain_steps > 0}",
    ])


def arm_config(workdir: Path, base: Config, arm: str, seed: int, args: argparse.Namespace) -> Config:
    """One arm's config: its own run dir, the base run's data and tokenizer, the arm's λ and seed."""
    return load_config(overrides=[
        f"run.dir={workdir / f'{arm}-seed{seed}'}", "run.progress=false", f"run.seed={seed}",
        f"synth.size={args.size}", f"tokenizer.path={base.tokenizer_dir}",
        f"data.train={base.path(base.data.train)}", f"data.valid={base.path(base.data.valid)}",
        f"data.test={base.path(base.data.test)}", "eval.split=test",
        f"rank.epochs={args.rank_epochs}", f"rank.train_subset={args.train_subset}",
        f"rank.loss_weight={ARMS[arm]}", *([f"rank.lr={args.rank_lr}"] if args.rank_lr else []),
    ])


def score_checkpoint(cfg: Config, checkpoint: Path) -> dict[str, float]:
    """The driver's per-epoch validation (LearnerRank.evaluate) applied to ``checkpoint``, one thread like the actor."""
    valid = load_split(cfg, "valid")[: cfg.metric.monitor_size]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the learner actor decodes with one thread: same arithmetic, same greedy ties
    try:
        learner = LearnerRank(cfg.model, str(cfg.tokenizer_dir), cfg.rank, init_checkpoint=str(checkpoint), rank=0,
                              world_size=1, total_steps=1, seed=cfg.run.seed, max_source_len=cfg.data.max_source_len,
                              max_target_len=cfg.data.max_target_len)
        return learner.evaluate(valid, cfg.metric, cfg.eval.max_new_tokens)
    finally:
        torch.set_num_threads(threads)


def valid_curve(cfg: Config) -> list[dict[str, float]]:
    """The arm's kind="valid" rows, one per epoch (the last row wins if a resumed run logged an epoch twice)."""
    path = cfg.run_dir / "logs" / "rank" / "metrics.jsonl"
    by_epoch = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") == "valid":
            by_epoch[int(row["epoch"])] = {k: row[k] for k in ("step", *SCORES)}
    return [by_epoch[e] for e in sorted(by_epoch)]


def run_arm(cfg: Config, sft_ckpt: Path) -> dict[str, Any]:
    """rank_job from the SFT checkpoint (resumed if started before), then test-split eval of its last checkpoint."""
    # A resumed arm's seconds are only those of this call: flag it so nobody reads them as the arm's cost.
    resumed = latest_complete_checkpoint(cfg.run_dir / "rank" / "checkpoints") is not None
    t0 = time.perf_counter()
    result = rank_job(cfg, resume=True, init=sft_ckpt)
    seconds = time.perf_counter() - t0
    curve = valid_curve(cfg)
    if len(curve) != cfg.rank.epochs:
        raise RuntimeError(f"{cfg.run_dir}: {len(curve)} validation rows for {cfg.rank.epochs} epochs")
    test = eval_job(cfg, checkpoint=result.checkpoint, label="last")
    return {"seconds": round(seconds, 1), "resumed": resumed, "steps": result.steps, "checkpoint": str(result.checkpoint),
            "valid": curve, "test": {k: test[k] for k in ("task_score", "cider_d", "bleu4")}}


def mean_std(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation (ddof 1; 0 for a single value) and count."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def summarize(start: dict[str, float], arms: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Last-epoch validation and test scores per arm (mean ± std over seeds) and paired RL - SFT differences."""
    seeds = sorted(arms["rank_rl"])
    out: dict[str, Any] = {"start": {k: start[k] for k in SCORES}}
    for arm, runs in arms.items():
        out[arm] = {f"valid_{k}": mean_std([runs[s]["valid"][-1][k] for s in seeds]) for k in SCORES}
        out[arm]["test_task_score"] = mean_std([runs[s]["test"]["task_score"] for s in seeds])
    for key, get in (("valid_monitor", lambda r: r["valid"][-1]["monitor"]),
                     ("valid_task_score", lambda r: r["valid"][-1]["task_score"]),
                     ("test_task_score", lambda r: r["test"]["task_score"])):
        out[f"paired_diff_{key}"] = mean_std([get(arms["rank_rl"][s]) - get(arms["continued_sft"][s]) for s in seeds])
    diff = out["paired_diff_valid_task_score"]["mean"]
    out["winner_valid_task_score"] = "rank_rl" if diff > 0 else "continued_sft" if diff < 0 else "tie"
    return out


def plot(path: Path, start: dict[str, float], arms: dict[str, dict[int, dict[str, Any]]]) -> None:
    """Validation monitor and task score per epoch: thin lines per seed, thick mean ± std band per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(SCORES), figsize=(11, 4))
    colors = {"rank_rl": "tab:red", "continued_sft": "tab:blue"}
    labels = {"rank_rl": f"rank RL (λ={ARMS['rank_rl']})", "continued_sft": "continued SFT (λ=0)"}
    for ax, key in zip(axes, SCORES, strict=True):
        for arm, runs in arms.items():
            curves = np.array([[start[key]] + [row[key] for row in runs[s]["valid"]] for s in sorted(runs)])
            epochs = np.arange(curves.shape[1])
            for c in curves:
                ax.plot(epochs, c, color=colors[arm], alpha=0.25, linewidth=1)
            mean, std = curves.mean(0), curves.std(0, ddof=1) if len(curves) > 1 else np.zeros(curves.shape[1])
            ax.plot(epochs, mean, color=colors[arm], linewidth=2, marker="o", label=f"{labels[arm]}, {len(curves)} seeds")
            ax.fill_between(epochs, mean - std, mean + std, color=colors[arm], alpha=0.15)
        ax.set_xlabel("rank-stage epoch (0 = the SFT checkpoint)")
        ax.set_ylabel(f"validation {key} (greedy)")
        ax.set_xticks(epochs)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Rank RL vs continued SFT from one SFT checkpoint (mean ± std over seeds)")
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=None, help="run directory (default: a temp dir, removed)")
    ap.add_argument("--size", type=int, default=4000, help="synth.size, synthetic rows in all splits (default 4000)")
    ap.add_argument("--pretrain-steps", type=int, default=150, help="pretrain.max_steps (0: no pretraining)")
    ap.add_argument("--sft-epochs", type=int, default=4, help="sft.epochs of the shared SFT checkpoint")
    ap.add_argument("--rank-epochs", type=int, default=4, help="rank.epochs of each arm (one validation point each)")
    ap.add_argument("--train-subset", type=int, default=640,
                    help="rank.train_subset, training sources per rank epoch (0: all)")
    ap.add_argument("--rank-lr", type=float, default=None, help="rank.lr of both arms (default: the config's, 2e-4)")
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated run.seed values, one run of each arm per seed")
    ap.add_argument("--no-save", action="store_true", help="print only; leave bench/results/ alone")
    args = ap.parse_args()
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if not seeds or len(set(seeds)) != len(seeds):
        ap.error(f"--seeds must list distinct integers, got {args.seeds!r}")
    for name in ("size", "sft_epochs", "rank_epochs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.pretrain_steps < 0 or args.train_subset < 0:
        ap.error("--pretrain-steps and --train-subset must be >= 0")
    if args.rank_lr is not None and args.rank_lr <= 0:
        ap.error(f"--rank-lr must be > 0, got {args.rank_lr}")
    setup_logging()

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlt2t-quality-") as tmp:
        workdir = (args.workdir or Path(tmp)).resolve()
        base = base_config(workdir, args)
        t0 = time.perf_counter()
        sft_ckpt = prepare_sft(base)
        sft_seconds = time.perf_counter() - t0
        start = score_checkpoint(arm_config(workdir, base, "rank_rl", seeds[0], args), sft_ckpt)
        log.info("SFT checkpoint %s: validation %s", sft_ckpt, {k: round(start[k], 4) for k in SCORES})
        arms: dict[str, dict[int, dict[str, Any]]] = {arm: {} for arm in ARMS}
        try:
            for seed in seeds:
                for arm in ARMS:  # alternate arms so drift on a shared machine hits both alike
                    arms[arm][seed] = run_arm(arm_config(workdir, base, arm, seed, args), sft_ckpt)
                    last = arms[arm][seed]["valid"][-1]
                    log.info("%s seed %d: last-epoch validation %s, %.0fs", arm, seed,
                             {k: round(last[k], 4) for k in SCORES}, arms[arm][seed]["seconds"])
        finally:
            import ray

            ray.shutdown()  # train_rank started an embedded Ray; stop it before the temp dir goes
        sft_test = eval_job(arm_config(workdir, base, "continued_sft", seeds[0], args), checkpoint=sft_ckpt,
                            label="sft")["task_score"]

    summary = summarize(start, arms)
    print(f"\nvalidation, last of {args.rank_epochs} rank epochs, mean ± std over seeds {seeds}:")
    print(f"  {'SFT checkpoint':>15}: monitor {start['monitor']:.4f}  task_score {start['task_score']:.4f}"
          f"  (test task_score {sft_test:.4f})")
    for arm in ARMS:
        s = summary[arm]
        print(f"  {arm:>15}: monitor {s['valid_monitor']['mean']:.4f} ± {s['valid_monitor']['std']:.4f}  "
              f"task_score {s['valid_task_score']['mean']:.4f} ± {s['valid_task_score']['std']:.4f}  "
              f"(test task_score {s['test_task_score']['mean']:.4f} ± {s['test_task_score']['std']:.4f})")
    d = summary["paired_diff_valid_task_score"]
    print(f"  paired RL - SFT, validation task_score: {d['mean']:+.4f} ± {d['std']:.4f} -> "
          f"{summary['winner_valid_task_score']} wins; total {time.perf_counter() - t_start:.0f}s")
    if args.no_save:
        return
    payload = {
        "benchmark": "quality",
        "settings": {"size": args.size, "pretrain_steps": args.pretrain_steps, "sft_epochs": args.sft_epochs,
                     "rank_epochs": args.rank_epochs, "train_subset": args.train_subset, "seeds": seeds,
                     "preset": base.model.preset, "rank_lr": base.rank.lr, "rank_batch_size": base.rank.batch_size,
                     "monitor_size": base.metric.monitor_size, "arms_loss_weight": ARMS},
        "sft_checkpoint": {"name": sft_ckpt.name, "seconds": round(sft_seconds, 1), "valid": start,
                           "test_task_score": sft_test},
        "arms": {arm: {str(s): r for s, r in runs.items()} for arm, runs in arms.items()},
        "summary": summary, "total_seconds": round(time.perf_counter() - t_start, 1),
    }
    plot(RESULTS / "quality.png", start, arms)
    print("saved", save("quality", payload), "and", RESULTS / "quality.png")


if __name__ == "__main__":
    main()
