"""Environment variables set for the length of a block (``with environment({...}):``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


def _put(values: Mapping[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def environment(values: Mapping[str, str | None]) -> Iterator[None]:
    """``os.environ`` with ``values`` set inside the block (None: unset), each as it was after it."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        _put(values)
        yield
    finally:
        _put(saved)
