"""How far apart a source's K sampled rewards are, at the start of RL: what GRPO's per-source scale amplifies.

    python bench/group_spread.py bench/results/algorithms_docstring_names_rlsplit_batchstd.json [--arm grpo]
        [--sources 256]

GRPO divides each source's reward deviations by the std of that source's K rewards (rl.pg.grpo_scale=group).
A source whose K samples all score near 0, apart by a stray n-gram, then gets advantages of +-1 like a source
whose samples range from poor to perfect. For every seed of a saved bench/algorithms.py result whose run
directories still exist (its --workdir), this draws K samples (rollout.num_samples, temperature 1, the whole
vocabulary, as the arm's rollouts do) from the arm's starting checkpoint, the seed's SFT checkpoint, for the
first ``--sources`` distinct sources the arm trained on, scores them with the arm's reward (its config and the
CIDEr-D document frequencies its job saved), and reports the spread of each source's K rewards: the share of
sources whose rewards all tie, the share whose std is under 0.05 (nonzero), under 0.2, the median std, the
mean reward and the distinct samples per source. Saves bench/results/<result stem>_group_spread.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algorithms import _draws  # noqa: E402
from machine_info import save  # noqa: E402

from rlt2t.common.config import load_config  # noqa: E402
from rlt2t.common.data import load_examples  # noqa: E402
from rlt2t.common.metrics import DocumentFrequency  # noqa: E402
from rlt2t.common.policy import load_policy  # noqa: E402
from rlt2t.common.rewards import build_reward  # noqa: E402
from rlt2t.jobs import best_or_latest  # noqa: E402


def spread(stds: list[float], means: list[float], distinct: list[int]) -> dict[str, float]:
    """Summary of the per-source reward stds (ddof 1), mean rewards and distinct samples."""
    s = np.asarray(stds)
    return {"sources": len(stds), "tied": float(np.mean(s == 0)),
            "std_under_0.05": float(np.mean((s > 0) & (s < 0.05))),
            "std_under_0.2": float(np.mean((s > 0) & (s < 0.2))), "median_std": float(np.median(s)),
            "mean_reward": statistics.fmean(means), "distinct_samples": statistics.fmean(distinct)}


@torch.no_grad()
def measure_seed(run_dir: Path, sources: int) -> dict[str, float]:
    cfg = load_config([run_dir / "config" / "rl.yaml"])
    start = best_or_latest(run_dir.parent / "base" / "sft" / "checkpoints")
    rows = load_examples(cfg.path(cfg.data.train))
    if cfg.rl.train_subset:
        rows = rows[: cfg.rl.train_subset]
    first = {}  # source -> its first row, in the order the job reads them
    for e in rows:
        first.setdefault(e.source, e)
    picked = list(first.values())[:sources]
    df = DocumentFrequency.load(run_dir / "rl" / "document_frequency.json")
    reward = build_reward(cfg.reward, document_frequency=df)
    policy = load_policy(cfg.model, cfg.tokenizer_dir, checkpoint=start)
    policy.model.eval()
    k = cfg.rollout.num_samples
    stds, means, distinct = [], [], []
    done = 0
    for _, draws in _draws(cfg, policy, picked, k, "group-spread"):
        texts = policy.decode([r.token_ids for r in draws])
        for j in range(0, len(texts), k):
            e = picked[done]
            done += 1
            r = reward.score([e.source] * k, texts[j : j + k], [list(e.refs)] * k)
            stds.append(float(np.std(r, ddof=1)))
            means.append(float(np.mean(r)))
            distinct.append(len(set(texts[j : j + k])))
    return {"start": str(start), "k": k, **spread(stds, means, distinct)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", type=Path, help="a bench/algorithms.py result (JSON) whose --workdir still exists")
    ap.add_argument("--arm", default="grpo", help="the arm whose sources, reward and K are used")
    ap.add_argument("--sources", type=int, default=256, help="distinct training sources per seed")
    ap.add_argument("--no-save", action="store_true", help="print only; leave bench/results/ alone")
    args = ap.parse_args()
    payload = json.loads(args.result.read_text())
    runs: dict[str, Any] = payload["arms"].get(args.arm) or {}
    if not runs:
        ap.error(f"--arm {args.arm}: not in {args.result} (arms: {', '.join(payload['arms'])})")
    readings = {}
    for seed, run in runs.items():
        readings[seed] = r = measure_seed(Path(run["checkpoint"]).parents[2], args.sources)
        print(f"seed {seed}: {r['sources']} sources, mean reward {r['mean_reward']:.2f}; reward std per source: "
              f"all tied {r['tied']:.0%}, under 0.05 {r['std_under_0.05']:.0%}, under 0.2 {r['std_under_0.2']:.0%}, "
              f"median {r['median_std']:.3f}; distinct samples {r['distinct_samples']:.2f} of {r['k']}", flush=True)
    if not args.no_save:
        print("saved", save(f"{args.result.stem}_group_spread", {
            "benchmark": "group_spread", "result": args.result.name, "arm": args.arm, "sources": args.sources,
            "readings": readings}))


if __name__ == "__main__":
    main()
