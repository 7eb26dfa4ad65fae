"""`rlt2t pretrain`, `sft`, `train` (RL on Ray), `average`, `convert-model` and `demo`: the training stages."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from rlt2t.cmd_common import load_cfg, print_table


def cmd_pretrain(args) -> None:
    cfg = load_cfg(args)  # a config error is reported before the seconds of importing torch
    from rlt2t.jobs import pretrain_job

    result = pretrain_job(cfg, resume=args.resume, init=args.init)
    print(f"pretrain: {result.steps} steps → {result.checkpoint}")


def cmd_sft(args) -> None:
    cfg = load_cfg(args)
    from rlt2t.jobs import sft_job

    result = sft_job(cfg, resume=args.resume, init=args.init)
    print(f"sft: {result.steps} steps → {result.checkpoint}")


def cmd_train(args) -> None:
    cfg = load_cfg(args)
    from rlt2t.jobs import rl_job

    result = rl_job(cfg, resume=args.resume, init=args.init)
    print(f"rl: {result.steps} steps, {result.items_used} sources, {result.redispatched} chunks re-dispatched "
          f"→ {result.checkpoint}")


def cmd_convert_model(args) -> None:
    from rlt2t.common.convert import shrink_vocabulary

    print(shrink_vocabulary(args.input, args.vocab_size, args.out, tokenizer_dir=args.tokenizer))


def cmd_average(args) -> None:
    from rlt2t.common.checkpoint import complete_checkpoints
    from rlt2t.common.convert import average_checkpoints, check_out_dir

    paths = list(args.checkpoints)
    if args.dir:
        if args.last < 1:  # infos[-0:] is every checkpoint, a negative count drops the oldest instead
            raise ValueError(f"--last must be >= 1 (how many of the newest checkpoints of --dir to average), "
                             f"got {args.last}")
        check_out_dir(args.out, [args.dir], force=args.force)  # not into the checkpoint root it reads
        infos = complete_checkpoints(args.dir)
        paths += [i.path for i in infos[-args.last :]]
    print(average_checkpoints(paths, args.out, force=args.force))


def cmd_demo(args) -> None:
    cfg = load_cfg(args)
    from rlt2t.eval_table import eval_table, print_eval_table
    from rlt2t.jobs import best_or_latest, clean_run, export_job, prepare_sft, rl_job
    from rlt2t.predict import predict

    if args.fresh:
        clean_run(cfg)
    t0 = time.perf_counter()
    prepare_sft(cfg)
    models = {"sft": best_or_latest(cfg.run_dir / "sft" / "checkpoints")}
    if cfg.rl.enabled:
        rl_job(cfg, resume=True)
        models[f"rl ({cfg.rl.algorithm})"] = best_or_latest(cfg.run_dir / "rl" / "checkpoints")
    # SFT against RL on validation and on the held-out test split (`rlt2t eval`'s tables, saved under eval/).
    for split in ("valid", "test"):
        if cfg.path(getattr(cfg.data, split)).is_file():
            table = eval_table(cfg, models, split=split, metrics=DEMO_METRICS)
            print_eval_table(table)
            table.save(cfg.run_dir / "eval", f"demo-{split}")
    if args.predict:
        # The last stage of the method: CTranslate2 exports of both models, ensemble rerank on the test split.
        exports = [export_job(cfg, path, cfg.path(cfg.export.out) / name.split()[0], force=True)
                   for name, path in models.items()]
        result = predict(cfg, exports, exports, cfg.path(cfg.data.test), cfg.run_dir / "predict" / "test.csv")
        if result.metrics:
            print_table(f"test split, CTranslate2 {cfg.export.quantization}: single models (beam "
                        f"{cfg.predict.beam_size}) vs ensemble ({result.rerank}) vs oracle", result.metrics)
        print(f"predictions: {result.csv_path}")
    print(f"demo finished in {time.perf_counter() - t0:.0f} s; run directory: {cfg.run_dir}")
    print(f"logs: tensorboard --logdir {cfg.run_dir / 'logs'}")


DEMO_METRICS = ("task_score", "cider_d", "bleu4", "rouge_l", "mean_length")


def register(sub: argparse._SubParsersAction, config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add this module's commands to the `rlt2t` parser."""
    for name, fn, what in (("pretrain", cmd_pretrain, "denoising pretraining (T5-style span corruption)"),
                           ("sft", cmd_sft, "supervised fine-tuning (CE, R-drop, augmentation, FGM)")):
        p = sub.add_parser(name, help=what)
        config_args(p)
        p.add_argument("--resume", action="store_true", help="continue from the stage's newest complete checkpoint")
        p.add_argument("--init", default=None, help="model directory or checkpoint root to start from")
        p.set_defaults(fn=fn)

    p = sub.add_parser("train", help="RL on Ray (rl.algorithm): rollout + reward actors, DDP learner")
    config_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the newest complete RL checkpoint")
    p.add_argument("--init", default=None, help="model dir or checkpoint root to start from (default: best SFT)")
    p.set_defaults(fn=cmd_train)

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
    p.add_argument("--out", required=True, help="output model directory (not inside or around an input)")
    p.add_argument("--force", action="store_true", help="replace an existing --out directory")
    p.set_defaults(fn=cmd_average)

    p = sub.add_parser("demo", help="the whole pipeline on the embedded default (synthetic data, small model)")
    config_args(p)
    p.add_argument("--fresh", action="store_true",
                   help="delete the demo's outputs in run.dir (its synthetic data, tokenizer, stages, eval, logs, "
                        "exports) first instead of resuming them; data the demo did not write stays; refused for "
                        "the root, home, the current directory or a parent of one")
    p.add_argument("--no-predict", dest="predict", action="store_false",
                   help="skip the CTranslate2 export and ensemble prediction at the end")
    p.set_defaults(fn=cmd_demo)
