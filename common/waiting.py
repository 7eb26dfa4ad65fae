"""The one wait-until loop: poll a check until it is done or a deadline passes, with a message that says
what was waited for and the last reason it was not done. Readiness of servers, deployed jobs and actors
all go through it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class NotYet(Exception):
    """Raised by a check that is not done yet; its message (the reason) is reported on timeout."""


def wait_until(check: Callable[[], T], *, timeout_s: float, what: str, interval_s: float = 0.5,
               error: type[Exception] = TimeoutError, on_wait: Callable[[str], None] | None = None,
               clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> T:
    """Call ``check`` every ``interval_s`` until it returns (its value is returned) instead of raising
    :class:`NotYet`. Past ``timeout_s`` raise ``error("<what> within <timeout> s (<last reason>)")``; any other
    exception from ``check`` propagates at once. ``on_wait(reason)`` is called once, at the first wait (to
    say what is being waited for)."""
    deadline = clock() + timeout_s
    announced = False
    while True:
        try:
            return check()
        except NotYet as e:
            reason = str(e) or "not ready"
        if clock() > deadline:
            raise error(f"{what} within {timeout_s:g} s ({reason})")
        if on_wait is not None and not announced:
            on_wait(reason)
            announced = True
        sleep(interval_s)
