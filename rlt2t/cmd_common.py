"""What every `rlt2t` command module shares: the config arguments, loading the config, printing a table."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import TextIO

from rlt2t import api
from rlt2t.common.config import Config


def config_args(p: argparse.ArgumentParser) -> None:
    """--config FILE (repeatable) and key.path=value overrides."""
    p.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="YAML config file (repeatable; later files win)")
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help="config overrides, e.g. sft.lr=3e-4")


def load_cfg(args: argparse.Namespace, extra: Sequence[str] = ()) -> Config:
    """The config tree of a command's --config files and overrides, then ``extra`` overrides (from its flags)."""
    return api.load_config(*args.config, overrides=[*args.overrides, *extra])


def print_table(title: str, rows: Mapping[str, Mapping[str, float]], file: TextIO | None = None) -> None:
    """A metric table in the terminal: one row per model, one column per metric (the first row's keys)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    columns = list(next(iter(rows.values())).keys()) if rows else []
    table.add_column("model")
    for c in columns:
        table.add_column(c, justify="right")
    for name, metrics in rows.items():
        table.add_row(name, *(f"{metrics[c]:.4f}" for c in columns))
    Console(file=file or sys.stdout, width=max(100, 14 * (len(columns) + 1))).print(table)
