"""`rlt2t serve ...` subcommands (registered by rlt2t.cli)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def register(sub: argparse._SubParsersAction, config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add this module's subcommands to the `rlt2t` parser; `config_args` adds --config and overrides."""
