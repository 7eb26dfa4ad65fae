from __future__ import annotations

import pytest

from rlt2t.driver import needed_version


def test_epoch_refresh_samples_with_the_epoch_start_weights():
    assert [needed_version(s, 20, 0) for s in (20, 25, 39)] == [20, 20, 20]


@pytest.mark.parametrize("refresh", [1, 2, 5])
def test_step_refresh_bounds_staleness(refresh):
    for step in range(60):
        v = needed_version(step, 0, refresh)
        assert v % refresh == 0 and v <= step
        if step >= 2 * refresh:  # after the first two intervals: between N and 2N-1 steps stale
            assert refresh <= step - v <= 2 * refresh - 1
    # monotone in the step, so chunks dispatched in order never need an older version than earlier ones
    versions = [needed_version(s, 0, refresh) for s in range(60)]
    assert versions == sorted(versions)
