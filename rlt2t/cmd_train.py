"""`rlt2t pretrain`, `sft`, `train` (RL on Ray), `average`, `convert-model` and `demo`: the training stages."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from rlt2t import api
from rlt2t.cmd_common import load_cfg


def best_note(checkpoint: Path) -> str:
    """`; best by the monitor (reward): epoch-0002 (0.4812)` from a stage's last checkpoint: the one its checkpoint
    root means to eval, export and predict. Empty when it has none (no validation split)."""
    from rlt2t.common.checkpoint import read_checkpoint

    info = read_checkpoint(checkpoint)
    best = (info.meta if info is not None else {}).get("best")
    if not best:
        return ""
    by = f" ({best['by']})" if best.get("by") else ""
    return f"; best by the monitor{by}: {Path(best['path']).name} ({best['score']:.4f})"


def cmd_pretrain(args) -> None:
    result = api.pretrain(load_cfg(args), resume=args.resume, init=args.init)
    print(f"pretrain: {result.steps} steps → {result.checkpoint}")


def cmd_sft(args) -> None:
    result = api.sft(load_cfg(args), resume=args.resume, init=args.init)
    print(f"sft: {result.steps} steps → {result.checkpoint}{best_note(result.checkpoint)}")


def cmd_train(args) -> None:
    cfg = load_cfg(args)
    result = api.train(cfg, resume=args.resume, init=args.init)
    used = "preference pairs" if cfg.rl.unit.data == "preferences" else "sources"
    print(f"rl: {result.steps} steps, {result.items_used} {used}, {result.redispatched} chunks re-dispatched "
          f"→ {result.checkpoint}{best_note(result.checkpoint)}")


def cmd_convert_model(args) -> None:
    from rlt2t.common.convert import shrink_vocabulary

    print(shrink_vocabulary(args.input, args.vocab_size, args.out, tokenizer_dir=args.tokenizer, force=args.force))


def cmd_average(args) -> None:
    from rlt2t.common.checkpoint import complete_checkpoints
    from rlt2t.common.convert import average_checkpoints, check_out_dir

    paths = list(args.checkpoints)
    if args.dir:
        if args.last < 1:  # infos[-0:] is every checkpoint, a negative count drops the oldest instead
            raise ValueError(f"--last must be >= 1 (how many of the newest checkpoints of --dir to average), "
                             f"got {args.last}")
        check_out_dir(args.out, [args.dir], force=args.force)  # not into the checkpoint root it reads
        if not Path(args.dir).is_dir():
            raise FileNotFoundError(f"--dir {args.dir}: no such directory (a checkpoint root, e.g. runs/exp1/sft/"
                                    "checkpoints)")
        infos = complete_checkpoints(args.dir)
        paths += [i.path for i in infos[-args.last :]]
    print(average_checkpoints(paths, args.out, force=args.force))


def cmd_demo(args) -> None:
    cfg = load_cfg(args)
    result = api.demo(cfg, fresh=args.fresh, predict=args.predict)
    print(f"demo finished in {result.seconds:.0f} s; run directory: {cfg.run_dir}")
    if result.curves_png:
        print(f"validation curves: {result.curves_png}")
    print(f"logs: tensorboard --logdir {cfg.run_dir / 'logs'}")


def register(sub: argparse._SubParsersAction, config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add this module's commands to the `rlt2t` parser."""
    for name, fn, what in (("pretrain", cmd_pretrain, "denoising pretraining (span corruption: pretrain.objective)"),
                           ("sft", cmd_sft, "supervised fine-tuning (CE, R-drop, augmentation, FGM)")):
        p = sub.add_parser(name, help=what)
        config_args(p)
        p.add_argument("--resume", action="store_true", help="continue from the stage's newest complete checkpoint")
        p.add_argument("--init", default=None,
                       help="model directory or checkpoint root (its best, else its newest) to start from")
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
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory whose special ids the config takes (saved beside the model)")
    p.add_argument("--force", action="store_true", help="replace an existing --out directory")
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
