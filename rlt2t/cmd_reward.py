"""`rlt2t reward-model ...`, `rlt2t classifier ...` and `rlt2t feedback-loop` (registered by rlt2t.cli).

    rlt2t reward-model train [--rank-lists F ...] [--pairs F ...] [--ratings F ...] [--init DIR] [--resume]
    rlt2t reward-model score --model DIR --input JSONL [--out JSONL]
    rlt2t classifier train --train JSONL [--valid JSONL] --init DIR [--resume]
    rlt2t feedback-loop [feedback.rounds=N] [feedback.prefer_token=T] ...   (the loop, scripted)
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from rlt2t.cmd_common import load_cfg, print_table


def _flag_overrides(key: str, flag_values: dict[str, list[str] | str | None]) -> list[str]:
    """Overrides from command-line flags (they replace the config's lists / values)."""
    return [f"{key}.{field}={json.dumps(value)}" for field, value in flag_values.items() if value]


def cmd_reward_model_train(args) -> None:
    from rlt2t.common.checkpoint import complete_checkpoint
    from rlt2t.reward_jobs import reward_model_job

    flags = _flag_overrides("reward_model", {"rank_lists": args.rank_lists, "pairs": args.pairs,
                                             "ratings": args.ratings, "init": args.init})
    result = reward_model_job(load_cfg(args, flags), resume=args.resume)
    best = complete_checkpoint(result.checkpoint).meta.get("best")
    print(f"reward-model: {result.steps} steps → {result.checkpoint}"
          + (f"; best held-out pair accuracy {best['score']:.3f} ({best['path']})" if best else
             "; no held-out sources (reward_model.valid_fraction)"))


def cmd_reward_model_score(args) -> None:
    from rlt2t.common.io import atomic_write_jsonl
    from rlt2t.common.reward_model import load_reward_model

    rows = _score_rows(args.input)  # before the model loads: a bad line is named at once
    model = load_reward_model(args.model)
    scores = model.score([r["source"] for r in rows], [r["candidate"] for r in rows], batch_size=args.batch_size)
    out = [{**r, "reward": float(s)} for r, s in zip(rows, scores, strict=True)]
    if args.out:
        atomic_write_jsonl(args.out, out)
        print(f"reward-model: {len(out)} scores → {args.out}")
    else:
        for row in out:
            print(json.dumps(row, ensure_ascii=False))


def _score_rows(path: str) -> list[dict]:
    """The JSON objects of a `reward-model score` input (string `source` and `candidate`); ValueError naming
    ``--input``, the file's own line number and the problem."""
    from rlt2t.common.data import DataError
    from rlt2t.common.preferences import json_objects

    try:
        return [row for _, row in json_objects(path, ("source", "candidate"))]
    except DataError as e:
        raise ValueError(f"--input {e}") from None


def cmd_classifier_train(args) -> None:
    from rlt2t.reward_jobs import classifier_job

    flags = _flag_overrides("classifier", {"train": args.train, "valid": args.valid, "init": args.init})
    result = classifier_job(load_cfg(args, flags), resume=args.resume)
    print(f"classifier: {result.steps} steps → {result.checkpoint}")


def cmd_feedback_loop(args) -> None:
    from rlt2t.feedback import run_loop, summary_rows

    cfg = load_cfg(args)
    summaries = run_loop(cfg)
    print_table(f"feedback loop (scripted annotator prefers token {summaries[0]['token']!r}): held-out sources",
                summary_rows(summaries))
    print(f"rounds: {cfg.run_dir / 'feedback'} (candidates, rank lists, reward models, RL runs, eval.json)")


def register(sub: argparse._SubParsersAction, config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add this module's subcommands to the `rlt2t` parser; `config_args` adds --config and overrides."""
    rm = sub.add_parser("reward-model", help="learned rewards: train a reward model from preferences, score with it"
                        ).add_subparsers(dest="reward_model_command", required=True, metavar="subcommand")
    p = rm.add_parser("train", help="train r(source, candidate) from rank lists, pairs or ratings "
                                    "(-log σ(r_better - r_worse) over every ordered pair)")
    config_args(p)
    p.add_argument("--rank-lists", nargs="+", default=None, metavar="TSV",
                   help="rank-list TSV: source<TAB>best<TAB>...<TAB>worst per line (reward_model.rank_lists)")
    p.add_argument("--pairs", nargs="+", default=None, metavar="JSONL",
                   help="pairwise JSONL: source, chosen, rejected (reward_model.pairs)")
    p.add_argument("--ratings", nargs="+", default=None, metavar="JSONL",
                   help="ratings JSONL: source, candidate, rating (reward_model.ratings)")
    p.add_argument("--init", default=None, help="backbone: a policy checkpoint / seq2seq dir, or an encoder / "
                                                "sequence-classification dir, or all-MiniLM-L6-v2 (the packaged "
                                                "copy) (default: the run's best SFT)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.set_defaults(fn=cmd_reward_model_train)

    p = rm.add_parser("score", help="score (source, candidate) JSONL lines with a reward model")
    p.add_argument("--model", required=True,
                   help="reward model directory or checkpoint root (its best, else its newest)")
    p.add_argument("--input", required=True, help="JSONL with `source` and `candidate` per line")
    p.add_argument("--out", default=None, help="output JSONL (the input lines plus `reward`); default stdout")
    p.add_argument("--batch-size", type=int, default=64)
    p.set_defaults(fn=cmd_reward_model_score)

    clf = sub.add_parser("classifier", help="classifier rewards: train a sequence classifier").add_subparsers(
        dest="classifier_command", required=True, metavar="subcommand")
    p = clf.add_parser("train", help="fine-tune an encoder on labelled JSONL (text, label) for a small label set")
    config_args(p)
    p.add_argument("--train", default=None, help="labelled JSONL (classifier.train)")
    p.add_argument("--valid", default=None, help="held-out labelled JSONL (default: classifier.valid_fraction of "
                                                 "--train)")
    p.add_argument("--init", default=None, help="encoder or sequence-classification directory, or "
                                                "all-MiniLM-L6-v2 (the packaged copy) (classifier.init)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.set_defaults(fn=cmd_classifier_train)

    p = sub.add_parser("feedback-loop", help="the human-feedback loop with a scripted annotator: sample → rank "
                                             "→ reward model → RL → sample again (feedback.*)")
    config_args(p)
    p.set_defaults(fn=cmd_feedback_loop)
