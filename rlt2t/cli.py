"""`rlt2t` command line: one subcommand per stage, every one reading the same config tree.

    rlt2t <command> [--config FILE ...] [key.path=value ...]

Each command module (``rlt2t/cmd_*.py``) exposes ``register(sub, config_args)``; this module only builds
the parser from them and runs the chosen command with one error policy.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from rlt2t import (
    cmd_annotate,
    cmd_data,
    cmd_deploy,
    cmd_eval,
    cmd_export,
    cmd_reward,
    cmd_serve,
    cmd_train,
    cmd_warm_start,
)
from rlt2t.cmd_common import config_args
from rlt2t.common.config import ConfigError
from rlt2t.common.errors import ResumableFailure
from rlt2t.common.tracking import setup_logging

log = logging.getLogger("rlt2t.cli")

COMMAND_MODULES = (cmd_data, cmd_train, cmd_warm_start, cmd_eval, cmd_export, cmd_serve, cmd_deploy, cmd_annotate,
                   cmd_reward)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlt2t", description="RL fine-tuning of encoder-decoder text-to-text models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging and full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for module in COMMAND_MODULES:
        module.register(sub, config_args)
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
        code = args.fn(args)
    except (ConfigError, ValueError, FileNotFoundError, FileExistsError) as e:
        if args.verbose:
            raise
        print(f"rlt2t {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ResumableFailure as e:
        if args.verbose:
            raise
        print(f"rlt2t {args.command}: {e}\nthe newest complete checkpoint is kept: rerun with --resume",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; completed checkpoints are kept (resume with --resume)", file=sys.stderr)
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
