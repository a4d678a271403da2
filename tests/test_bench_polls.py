"""The bench's progress polls: every 50 ms while the end is far, sooner when the rate so far
says it is near, never more often than every 5 ms."""

from __future__ import annotations

import pytest

from bench.phases import FINAL_POLL, POLL_INTERVAL, next_poll


def test_far_from_the_end_the_poll_waits_the_full_interval() -> None:
    # 100 of 2,000 in one second: the rest is 19 s away.
    assert next_poll(100, 2000, 1.0) == POLL_INTERVAL


def test_near_the_end_the_poll_comes_when_the_rate_says_the_rest_is_done() -> None:
    # 1,980 of 2,000 in 1.98 s, 1,000 a second: the last 20 are 20 ms away.
    assert next_poll(1980, 2000, 1.98) == pytest.approx(0.02)


def test_the_poll_never_comes_sooner_than_the_floor() -> None:
    assert next_poll(1999, 2000, 1.0) == FINAL_POLL


@pytest.mark.parametrize(("reached", "elapsed"), [(0, 1.0), (0, 0.0), (10, 0.0)])
def test_with_no_rate_yet_the_poll_waits_the_full_interval(reached: int, elapsed: float) -> None:
    assert next_poll(reached, 2000, elapsed) == POLL_INTERVAL
