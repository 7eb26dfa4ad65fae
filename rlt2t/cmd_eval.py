"""`rlt2t eval` (registered by rlt2t.cli): one metric table over several models.

    rlt2t eval [--checkpoint sft|rl|PATH|LABEL=PATH ...] [--metrics m1,m2|all] [--split S] [--rerank MODE]
               [--name N] [overrides]

Rows are models, columns metrics; the table is printed and saved as ``{run}/eval/<name>.csv``, ``.json``,
``.md`` and a ``.png`` bar chart, beside each model's ``<label>-<split>.json`` and predictions.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from rlt2t import api
from rlt2t.cmd_common import load_cfg
from rlt2t.cmd_export import RERANK_CHOICES


def cmd_eval(args) -> None:
    cfg = load_cfg(args)
    from rlt2t.common.metrics import check_dependencies
    from rlt2t.common.plugins import load_plugins
    from rlt2t.eval_table import resolve_metric_names

    load_plugins(cfg.reward.plugins)  # metrics of your own, before their names are read
    # Before any model decodes: a column whose data or package is missing (meteor: WordNet) fails now, naming the fix.
    check_dependencies(resolve_metric_names(cfg, args.metrics), "--metrics" if args.metrics else "eval.metrics")
    table = api.evaluate(cfg, args.checkpoint, split=args.split, metrics=args.metrics, rerank=args.rerank)
    from rlt2t.eval_table import print_eval_table

    print_eval_table(table)
    paths = table.save(cfg.run_dir / "eval", args.name)
    print("saved: " + ", ".join(str(p) for p in paths.values()))


def register(sub: argparse._SubParsersAction, config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add `eval` to the `rlt2t` parser; `config_args` adds --config and overrides."""
    p = sub.add_parser("eval", help="decode a split with one or more models and print one metric table")
    config_args(p)
    p.add_argument("--checkpoint", action="append", default=[], metavar="MODEL",
                   help="repeatable: a stage of the run (sft, rl; rank is rl's former name, pretrain), a model "
                        "directory, a checkpoint, or a checkpoint root (its best, else its newest); LABEL=PATH names "
                        "the row "
                        "(default: the run's sft and rl stages that have checkpoints)")
    p.add_argument("--metrics", default=None,
                   help="comma-separated columns, e.g. rouge1,rouge2,rougeL,rougeLsum,meteor,sacrebleu,perplexity,"
                        "mean_length; reward: the mean of reward.terms over the outputs; 'all' for every metric "
                        "(default: eval.metrics)")
    p.add_argument("--split", default=None, choices=["train", "valid", "test"], help="default: eval.split")
    p.add_argument("--rerank", default=None, choices=["none", *RERANK_CHOICES],
                   help="none: decode with eval.num_beams; otherwise each model generates a pool (predict.pool) and "
                        "scores it, and this picks one per source as `rlt2t predict --rerank` does (default: "
                        "eval.rerank)")
    p.add_argument("--name", default=None, help="file stem of the saved table (default: table-<split>)")
    p.set_defaults(fn=cmd_eval)
