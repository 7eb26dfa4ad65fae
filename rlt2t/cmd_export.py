"""`rlt2t export` (CTranslate2 conversion) and `rlt2t predict` (ensemble inference), registered by rlt2t.cli."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from rlt2t import api
from rlt2t.cmd_common import load_cfg, print_table
from rlt2t.common.config.base import QUANTIZATIONS
from rlt2t.common.rerank import PREDICT_RERANK_MODES

RERANK_HELP = (
    "mean_logprob: length-normalised log-likelihood averaged over scorers; idf: the same, tokens weighted by "
    "the IDF of training n-grams covering them; consensus: among the predict.consensus_top best by "
    "likelihood, the one with the highest mean CIDEr-D against the others; reward: the highest reward.terms score "
    "without references (python, reward_model and classifier terms; ties to the better likelihood); mbr: "
    "minimum Bayes risk, the highest expected predict.mbr_utility (default the task score) over the "
    "pool (predict.pool: beams, samples or both; predict.mbr_weights; at most predict.max_pool candidates) "
    "(default: predict.rerank)"
)
RERANK_CHOICES = list(PREDICT_RERANK_MODES)


def _paths(value: str, flag: str) -> list[str]:
    paths = [v.strip() for v in value.split(",") if v.strip()]
    if not paths:
        raise ValueError(f"{flag}: give one or more comma-separated directories")
    return paths


def cmd_export(args) -> None:
    cfg = load_cfg(args)
    out = api.export(cfg, args.checkpoint, args.out, quantization=args.quantization, force=args.force)
    print(f"export: {args.checkpoint} → {out} ({args.quantization or cfg.export.quantization})")


def cmd_predict(args) -> None:
    cfg = load_cfg(args)
    result = api.predict(cfg, _paths(args.generators, "--generators"), _paths(args.scorers, "--scorers"), args.input,
                         args.out, rerank=args.rerank)
    print(f"predict: {len(result.ids)} inputs, {result.mean_candidates:.1f} candidates each, rerank={result.rerank}")
    timing = ", ".join(f"{k} {v:.4f}" for k, v in result.seconds_per_source.items())
    print(f"seconds per input: {timing}")
    print(f"predictions: {result.csv_path}\ncandidates: {result.jsonl_path}")
    if result.metrics:
        print_table(f"{Path(args.input).name}: single generators vs ensemble vs oracle", result.metrics)


def register(sub: argparse._SubParsersAction, config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add this module's subcommands to the `rlt2t` parser; `config_args` adds --config and overrides."""
    p = sub.add_parser("export", help="convert a checkpoint to CTranslate2 (int8 by default) with its IDF table")
    config_args(p)
    p.add_argument("--checkpoint", required=True,
                   help="model directory, checkpoint, or checkpoint root (its best, else its newest)")
    p.add_argument("--out", default=None,
                   help="export directory (default: {export.out}/<stage>-<checkpoint name>, e.g. sft-epoch-0003; "
                        "a model directory: its name)")
    p.add_argument("--quantization", default=None,
                   choices=QUANTIZATIONS,
                   help="weight type (default: export.quantization)")
    p.add_argument("--force", action="store_true", help="replace an existing export directory")
    p.set_defaults(fn=cmd_export)

    p = sub.add_parser("predict", help="ensemble inference: generators propose, scorers score, rerank picks")
    config_args(p)
    p.add_argument("--generators", required=True, help="comma-separated export dirs (or model dirs: exported on "
                                                       "the fly into {export.out}/cache)")
    p.add_argument("--scorers", required=True, help="comma-separated export dirs (or model dirs)")
    p.add_argument("--input", required=True, help="a data file read as data.train is (JSONL, a CSV with a header, "
                                                  "Parquet, a datasets directory: id, source[, target] by "
                                                  "data.*_field) or a competition CSV (no header)")
    p.add_argument("--out", required=True, help="submission CSV (report_id,prediction); the candidates JSONL "
                                                "goes beside it as <stem>.candidates.jsonl")
    p.add_argument("--rerank", default=None, choices=RERANK_CHOICES, help=RERANK_HELP)
    p.set_defaults(fn=cmd_predict)
