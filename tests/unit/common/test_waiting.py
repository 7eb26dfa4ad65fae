from __future__ import annotations

import pytest

from rlt2t.common.waiting import NotYet, wait_until


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_returns_the_checks_value_once_done_and_announces_the_wait_once():
    clock, calls, waits = FakeClock(), [], []

    def check():
        calls.append(clock.now)
        if len(calls) < 3:
            raise NotYet(f"attempt {len(calls)}")
        return "ready"

    assert wait_until(check, timeout_s=10, what="x", interval_s=1, clock=clock, sleep=clock.sleep,
                      on_wait=waits.append) == "ready"
    assert calls == [0.0, 1.0, 2.0] and waits == ["attempt 1"]


def test_timeout_names_what_and_the_last_reason():
    clock = FakeClock()

    def check():
        raise NotYet(f"HTTP 503 at {clock.now:g}")

    with pytest.raises(RuntimeError, match=r"server ready within 2 s \(HTTP 503 at 2.5\)"):
        wait_until(check, timeout_s=2, what="server ready", interval_s=0.5, error=RuntimeError, clock=clock,
                   sleep=clock.sleep)


def test_other_errors_propagate_at_once():
    def check():
        raise PermissionError("token refused")

    with pytest.raises(PermissionError):
        wait_until(check, timeout_s=100, what="x", sleep=lambda s: pytest.fail("must not wait"))
