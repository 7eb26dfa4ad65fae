"""`rlt2t` command line: one subcommand per stage, every one reading the same config tree.

    rlt2t <command> [--config FILE ...] [key.path=value ...]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rlt2t.common.config import ConfigError, config_to_yaml, explain, load_config
from rlt2t.common.tracking import setup_logging

log = logging.getLogger("rlt2t.cli")


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="YAML config file (repeatable; later files win)")
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help="config overrides, e.g. sft.lr=3e-4")


def _cfg(args):
    return load_config(args.config, args.overrides)


def print_table(title: str, rows: dict[str, dict[str, float]]) -> None:
    """Metric table: one row per model, one column per metric."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    columns = list(next(iter(rows.values())).keys()) if rows else []
    table.add_column("model")
    for c in columns:
        table.add_column(c, justify="right")
    for name, metrics in rows.items():
        table.add_row(name, *(f"{metrics[c]:.4f}" for c in columns))
    Console(file=sys.stdout, width=max(100, 16 * (len(columns) + 1))).print(table)


# --- commands -------------------------------------------------------------------------------------------

def cmd_config(args) -> None:
    if args.explain:
        print("\n".join(explain()))
    else:
        print(config_to_yaml(_cfg(args)), end="")


def cmd_data_synth(args) -> None:
    from rlt2t.jobs import make_synthetic_data

    files = make_synthetic_data(_cfg(args), fmt=args.format)
    for split, path in files.items():
        print(f"{split}: {path}")


def cmd_data_wordnet(args) -> None:
    from rlt2t.jobs import make_wordnet_data

    for split, path in make_wordnet_data(_cfg(args), size=args.size, seed=args.seed,
                                         wordnet_dir=args.wordnet_dir).items():
        print(f"{split}: {path}")


def cmd_data_import(args) -> None:
    from rlt2t.common.data import import_competition_csv, split_examples, write_examples

    cfg = _cfg(args)
    examples = import_competition_csv(args.input, on_error=cfg.data.on_error)
    out = Path(args.out)
    if args.unlabeled:
        write_examples(out / "test.jsonl", examples)
        print(f"test: {out / 'test.jsonl'} ({len(examples)} rows)")
        return
    parts = split_examples(examples, args.valid_fraction, args.test_fraction, cfg.run.seed)
    for split, rows in zip(("train", "valid", "test"), parts, strict=True):
        if rows:
            write_examples(out / f"{split}.jsonl", rows)
            print(f"{split}: {out / f'{split}.jsonl'} ({len(rows)} rows)")


def cmd_data_validate(args) -> None:
    from rlt2t.common.data import load_examples
    from rlt2t.common.tokenization import load_tokenizer, text_checker

    cfg = _cfg(args)
    check = text_checker(load_tokenizer(cfg.tokenizer_dir)) if cfg.tokenizer_dir.is_dir() else None
    for path in args.files:
        loaded = load_examples(path, require_target=not args.unlabeled, on_error=cfg.data.on_error, check_text=check)
        print(loaded.report.summary())


def cmd_tokenizer_build(args) -> None:
    from rlt2t.jobs import build_tokenizer_job

    print(build_tokenizer_job(_cfg(args)))


def cmd_pretrain(args) -> None:
    from rlt2t.jobs import pretrain_job

    result = pretrain_job(_cfg(args), resume=args.resume, init=args.init)
    print(f"pretrain: {result.steps} steps → {result.checkpoint}")


def cmd_sft(args) -> None:
    from rlt2t.jobs import sft_job

    result = sft_job(_cfg(args), resume=args.resume, init=args.init)
    print(f"sft: {result.steps} steps → {result.checkpoint}")


def cmd_train(args) -> None:
    from rlt2t.jobs import rank_job

    result = rank_job(_cfg(args), resume=args.resume, init=args.init)
    print(f"rank: {result.steps} steps, {result.pairs_used} pairs, {result.redispatched} chunks re-dispatched "
          f"→ {result.checkpoint}")


def cmd_eval(args) -> None:
    from rlt2t.jobs import eval_job

    cfg = _cfg(args)
    metrics = eval_job(cfg, args.checkpoint)
    print_table(f"{cfg.eval.split} ({'greedy' if cfg.eval.num_beams == 1 else f'beam {cfg.eval.num_beams}'})",
                {str(args.checkpoint or "sft"): metrics})


def cmd_convert_model(args) -> None:
    from rlt2t.common.convert import shrink_vocabulary

    print(shrink_vocabulary(args.input, args.vocab_size, args.out, tokenizer_dir=args.tokenizer))


def cmd_average(args) -> None:
    from rlt2t.common.checkpoint import complete_checkpoints
    from rlt2t.common.convert import average_checkpoints

    paths = list(args.checkpoints)
    if args.dir:
        infos = complete_checkpoints(args.dir)
        paths += [i.path for i in infos[-args.last :]]
    print(average_checkpoints(paths, args.out))


def cmd_demo(args) -> None:
    from rlt2t.jobs import best_or_latest, clean_run, eval_job, export_job, prepare_sft, rank_job
    from rlt2t.predict import predict

    cfg = _cfg(args)
    if args.fresh:
        clean_run(cfg)
    t0 = time.perf_counter()
    prepare_sft(cfg)
    rows = {"sft": eval_job(cfg, label="sft")}
    models = {"sft": best_or_latest(cfg.run_dir / "sft" / "checkpoints")}
    if cfg.rank.enabled:
        rank_job(cfg, resume=True)
        models["rank"] = best_or_latest(cfg.run_dir / "rank" / "checkpoints")
        rows["rank RL"] = eval_job(cfg, checkpoint=models["rank"], label="rank")
    print_table(f"{cfg.eval.split} split, {'greedy' if cfg.eval.num_beams == 1 else 'beam'} decoding", rows)
    if args.predict:
        # The last stage of the method: CTranslate2 exports of both models, ensemble rerank on the test split.
        exports = [export_job(cfg, path, cfg.path(cfg.export.out) / name, force=True) for name, path in models.items()]
        result = predict(cfg, exports, exports, cfg.path(cfg.data.test), cfg.run_dir / "predict" / "test.csv")
        if result.metrics:
            print_table(f"test split, CTranslate2 {cfg.export.quantization}: single models (beam "
                        f"{cfg.predict.beam_size}) vs ensemble ({result.rerank}) vs oracle", result.metrics)
        print(f"predictions: {result.csv_path}")
    print(f"demo finished in {time.perf_counter() - t0:.0f} s; run directory: {cfg.run_dir}")
    print(f"logs: tensorboard --logdir {cfg.run_dir / 'logs'}")


# --- parser ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlt2t", description="RL fine-tuning of encoder-decoder (BART) models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging and full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")

    p = sub.add_parser("config", help="print the resolved config (or every key with --explain)")
    _config_args(p)
    p.add_argument("--explain", action="store_true", help="list every key with its default and meaning")
    p.set_defaults(fn=cmd_config)

    data = sub.add_parser("data", help="make, import and validate data").add_subparsers(
        dest="data_command", required=True, metavar="subcommand")
    p = data.add_parser("synth", help="write the synthetic report task (synth.size, synth.seed) to data.train's dir")
    _config_args(p)
    p.add_argument("--format", choices=["jsonl", "csv"], default="jsonl", help="JSONL, or the competition CSV layout")
    p.set_defaults(fn=cmd_data_synth)
    p = data.add_parser("wordnet", help="write the WordNet definition-modelling task (natural language) to "
                        "data.train's dir")
    _config_args(p)
    p.add_argument("--size", type=int, default=8000, help="rows in all (train + synth.valid/test_fraction)")
    p.add_argument("--seed", type=int, default=7, help="which rows are drawn and how they are split")
    p.add_argument("--wordnet-dir", default=None, help="WordNet dict directory (default: Debian's wordnet-base)")
    p.set_defaults(fn=cmd_data_wordnet)
    p = data.add_parser("import-csv", help="convert a competition CSV (report_id,description,diagnosis[,clinical])")
    _config_args(p)
    p.add_argument("--input", required=True, help="header-less competition CSV")
    p.add_argument("--out", required=True, help="output directory for train/valid/test JSONL")
    p.add_argument("--valid-fraction", type=float, default=0.05)
    p.add_argument("--test-fraction", type=float, default=0.0)
    p.add_argument("--unlabeled", action="store_true", help="the file is a test set without diagnoses")
    p.set_defaults(fn=cmd_data_import)
    p = data.add_parser("validate", help="check JSONL files (and their tokens against the run's tokenizer)")
    _config_args(p)
    p.add_argument("--files", nargs="+", required=True)
    p.add_argument("--unlabeled", action="store_true", help="targets are optional")
    p.set_defaults(fn=cmd_data_validate)

    tok = sub.add_parser("tokenizer", help="build the tokenizer").add_subparsers(
        dest="tokenizer_command", required=True, metavar="subcommand")
    p = tok.add_parser("build", help="build (ids), train (subword) or import (pretrained) per tokenizer.kind")
    _config_args(p)
    p.set_defaults(fn=cmd_tokenizer_build)

    for name, fn, what in (("pretrain", cmd_pretrain, "denoising pretraining (T5-style span corruption)"),
                           ("sft", cmd_sft, "supervised fine-tuning (CE, R-drop, augmentation, FGM)")):
        p = sub.add_parser(name, help=what)
        _config_args(p)
        p.add_argument("--resume", action="store_true", help="continue from the stage's newest complete checkpoint")
        p.add_argument("--init", default=None, help="model directory or checkpoint root to start from")
        p.set_defaults(fn=fn)

    p = sub.add_parser("train", help="rank RL on Ray: rollout + reward actors, DDP learner (CE + λ·rank)")
    _config_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the newest complete rank checkpoint")
    p.add_argument("--init", default=None, help="model dir or checkpoint root to start from (default: best SFT)")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("eval", help="decode a split and print the metric table")
    _config_args(p)
    p.add_argument("--checkpoint", default=None, help="model dir or checkpoint root (default: the run's best SFT)")
    p.set_defaults(fn=cmd_eval)

    p = sub.add_parser("convert-model", help="shrink a pretrained BART's vocabulary")
    p.add_argument("--input", required=True, help="pretrained BART directory (from_pretrained)")
    p.add_argument("--vocab-size", type=int, required=True, help="rows to keep")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory whose special ids the config takes")
    p.set_defaults(fn=cmd_convert_model)

    p = sub.add_parser("average", help="uniform average of checkpoints")
    p.add_argument("checkpoints", nargs="*", help="checkpoint directories")
    p.add_argument("--dir", default=None, help="a checkpoint root: average its newest --last complete ones")
    p.add_argument("--last", type=int, default=3)
    p.add_argument("--out", required=True)
    p.set_defaults(fn=cmd_average)

    p = sub.add_parser("demo", help="the whole pipeline on the embedded default (synthetic data, small model)")
    _config_args(p)
    p.add_argument("--fresh", action="store_true", help="delete run.dir first instead of resuming it")
    p.add_argument("--no-predict", dest="predict", action="store_false",
                   help="skip the CTranslate2 export and ensemble prediction at the end")
    p.set_defaults(fn=cmd_demo)

    from rlt2t import cmd_export, cmd_serve, cmd_warm_start

    cmd_serve.register(sub, _config_args)
    cmd_export.register(sub, _config_args)
    cmd_warm_start.register(sub, _config_args)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come before or after options (`demo --fresh a=1 b=2`): argparse leaves the later ones over.
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if x.startswith("-") or "=" not in x or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    setup_logging(logging.DEBUG if args.verbose else logging.INFO)
    if os.environ.get("CI") or not sys.stderr.isatty():
        os.environ.setdefault("TQDM_MININTERVAL", "5")
    try:
        args.fn(args)
    except (ConfigError, ValueError, FileNotFoundError, FileExistsError) as e:
        if args.verbose:
            raise
        print(f"rlt2t {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if args.verbose or type(e).__name__ != "LearnerDied":
            raise
        print(f"rlt2t {args.command}: {e}\nthe newest complete checkpoint is kept: rerun with --resume",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; completed checkpoints are kept (resume with --resume)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
