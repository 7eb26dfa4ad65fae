"""`rlt2t` command line: one subcommand per stage, every one reading the same config tree.

    rlt2t <command> [--config FILE ...] [key.path=value ...]

Each command module (``rlt2t/cmd_*.py``) exposes ``register(sub, config_args)``; this module only builds
the parser from them and runs the chosen command with one error policy.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator, Sequence

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


# A config override `key.path=value` (a dotted key: a file name with `=` in it rarely has one before the `=`).
OVERRIDE = re.compile(r"^[a-z_]+(\.[a-z_0-9]+)+=")


def _chosen_parsers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and the subcommand parsers ``args`` went through."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None) or "")
            if chosen is not None:
                yield from _chosen_parsers(chosen, args)


def _take_trailing_overrides(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Overrides an option of many values swallowed (`--files a.jsonl run.dir=X`): taken out of its list and
    returned. A value that is an existing file stays a value."""
    moved: list[str] = []
    for p in _chosen_parsers(parser, args):
        for action in p._actions:
            values = getattr(args, action.dest, None)
            if not action.option_strings or action.nargs not in ("+", "*") or not isinstance(values, list):
                continue
            kept = [v for v in values if not (isinstance(v, str) and OVERRIDE.match(v) and not os.path.exists(v))]
            if len(kept) == len(values):
                continue
            moved += [v for v in values if v not in kept]
            if not kept and action.nargs == "+":
                parser.error(f"argument {'/'.join(action.option_strings)}: expected at least one value before the "
                             f"overrides ({' '.join(values)})")
            setattr(args, action.dest, kept)
    return moved


def _import_from_the_current_directory() -> None:
    """Modules in the directory `rlt2t` runs from import (a reward term's `my_rewards:fn`, `reward.plugins`), in
    this process and in the Ray workers it starts (they inherit its path), as under `python -m rlt2t.cli`: the
    installed console script's path starts at its own bin/ directory instead. Appended, so an installed package
    of the same name still comes first."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come before or after options (`demo --fresh a=1 b=2`): argparse leaves the later ones over,
    # or an option of many values takes them (`data validate --files a.jsonl run.dir=X`).
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if x.startswith("-") or "=" not in x or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if hasattr(args, "overrides"):
        args.overrides = [*args.overrides, *_take_trailing_overrides(parser, args), *extra]
    setup_logging(logging.DEBUG if args.verbose else logging.INFO)
    _import_from_the_current_directory()
    if os.environ.get("CI") or not sys.stderr.isatty():
        os.environ.setdefault("TQDM_MININTERVAL", "5")
    try:
        code = args.fn(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
    except BrokenPipeError:  # `rlt2t config --explain | head`: the reader has gone, nothing is wrong
        with contextlib.suppress(OSError, ValueError, AttributeError):  # no more writes to the closed pipe, at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a command the pipe ended
    except (ConfigError, ValueError, OSError, FloatingPointError) as e:
        if args.verbose:
            raise
        print(f"rlt2t {args.command}: error: {_message(e)}", file=sys.stderr)
        return 2
    except ResumableFailure as e:
        if args.verbose:
            raise
        where = ("no checkpoint was complete yet: rerun with --resume once the cause is fixed (it starts over)"
                 if e.checked and not e.checkpoint
                 else f"the newest complete checkpoint ({e.checkpoint}) is kept: rerun with --resume" if e.checkpoint
                 else "the newest complete checkpoint is kept: rerun with --resume")
        print(f"rlt2t {args.command}: {_plain(str(e))}\n{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; completed checkpoints are kept (resume with --resume)", file=sys.stderr)
        return 130
    except Exception as e:
        if args.verbose or not _is_service_error(e):
            raise
        resume = "\nthe newest complete checkpoint is kept: rerun with --resume" if hasattr(args, "resume") else ""
        if _unreachable(e):
            resume = ("\nnothing answers at that address: is the server running (`rlt2t serve policy` / `rlt2t "
                      "serve reward`), and is the URL right?" + resume)
        print(f"rlt2t {args.command}: error: {e}{resume}", file=sys.stderr)  # a server that is down, refusing, ...
        return 1
    return int(code or 0)


def _is_service_error(e: Exception) -> bool:
    """An error of the HTTP clients (a policy or reward server that is down, slow or refusing): a line, not a
    traceback. Only a command that loaded the clients can raise one."""
    client = sys.modules.get("rlt2t.services.client")
    return client is not None and isinstance(e, client.ServiceError)


def _unreachable(e: Exception) -> bool:
    """A service error where nothing answered at all (no connection, retries spent): not a server's refusal."""
    client = sys.modules["rlt2t.services.client"]
    return isinstance(e, client.Unavailable) and e.status is None


def _plain(text: str) -> str:
    """``text`` without terminal colour codes (Ray colours the actor names in the errors it wraps)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _message(e: Exception) -> str:
    """One line for an error: an operating-system error as `<file>: <reason>` (not `[Errno 21] Is a ...`)."""
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        files = f"{e.filename} -> {e.filename2}" if e.filename2 is not None else f"{e.filename}"
        return f"{files}: {e.strerror}"
    return _plain(str(e))


if __name__ == "__main__":
    sys.exit(main())
