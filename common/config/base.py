"""The config's building blocks: the section base class, ConfigError, and the checks every section shares."""

from __future__ import annotations

import contextlib
import difflib
import os
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
)

Quantization = Literal["int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16",
                       "float32"]
"""CTranslate2's weight types (an export's `--quantization`, export.quantization)."""
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
ComputeType = Literal["default", "auto", Quantization]
"""What CTranslate2 computes in: a weight type, or `default` / `auto`."""


def _numeric(annotation: Any) -> bool:
    """Whether a field holds a number and not a boolean (``float``, ``int | None``, ...)."""
    if annotation in (int, float):
        return True
    if get_origin(annotation) is Annotated:
        return _numeric(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        args = get_args(annotation)
        return bool not in args and any(_numeric(a) for a in args)
    return False


def _boolean_numbers(tree: Any, model: type[BaseModel], prefix: str = "") -> list[str]:
    """The keys of ``tree`` (a config as loaded) that give a boolean for a number: pydantic reads true as 1 and
    false as 0, so `sft.lr=true` would train at lr 1.0."""
    if not isinstance(tree, dict):
        return []
    found = []
    for key, value in tree.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            continue  # unknown keys are pydantic's to name
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found += _boolean_numbers(value, annotation, f"{prefix}{key}.")
        elif isinstance(value, bool) and _numeric(annotation):
            found.append(f"{prefix}{key}: expected a number, got {str(value).lower()}")
    return found




class _Section(BaseModel):
    # Attribute docstrings become field descriptions (shown by `rlt2t config --explain`).
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


def shared_directory(path: str | os.PathLike) -> str | None:
    """Why ``path`` is no place of its own for a run, or None: it resolves to the filesystem root, the home
    directory or the current directory, or to a parent of one of them (``..``). The one rule of ``run.dir``,
    checked when a config is loaded and again before ``demo --fresh`` deletes anything."""
    try:
        resolved = Path(path).expanduser().resolve()
    except RuntimeError:  # ~user with no such user: a literal name, nothing shared
        return None
    protected = {"the filesystem root": Path(resolved.anchor)}
    for what, where in (("the current directory", Path.cwd), ("the home directory", Path.home)):
        with contextlib.suppress(OSError, RuntimeError):  # a deleted cwd, no home directory: nothing to protect
            protected[what] = where().resolve()
    for what, place in protected.items():
        if resolved == place or resolved in place.parents:
            return f"resolves to {resolved}, {what}" + ("" if resolved == place else " or a parent of it")
    return None


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the offending key."""


def did_you_mean(word: str, known: Sequence[str], *, cutoff: float = 0.8, prefix: str = "") -> str:
    """`` (did you mean rl.epochs?)`` when ``word`` is spelt near one of ``known`` (``prefix`` before it), else ''."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=cutoff)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""
