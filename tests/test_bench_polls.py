"""The bench's progress polls: every 50 ms while the end is far, sooner when the rate so far
says it is near, never more often than every 5 ms; and what they count."""

from __future__ import annotations

import asyncpg
import pytest

from bench.phases import FINAL_POLL, POLL_INTERVAL, START, _poll_until, next_poll
from hubd.store.allocations import AllocationStore

# Statuses written directly: the polls read rows, whichever transitions made them.
FINISH = (
    "UPDATE hubd_allocations SET status = 'released', next_attempt_at = NULL, "
    "connection_ready = false, lease_id = NULL, lease_expires_at = NULL "
    "WHERE id = ANY($1::text[])"
)
MAKE_READY = (
    "UPDATE hubd_allocations SET status = 'allocated', connection_ready = true WHERE id = $1"
)


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


async def test_the_polls_count_this_runs_rows_only(
    store: AllocationStore, database_url: str
) -> None:
    """Ready: the run's allocated rows with a ready connection. Finished: the run's rows no
    longer active, whatever earlier runs left terminal in the table."""
    conn = await asyncpg.connect(database_url)
    try:
        earlier = [(await store.request(provisioner_id="fake")).id for _ in range(2)]
        await conn.execute(FINISH, earlier)
        # After the earlier rows' commit, as the bench reads it before its request.
        since, _ = await conn.fetchrow(START)
        ids = [(await store.request(provisioner_id="fake")).id for _ in range(3)]
        await conn.execute(MAKE_READY, ids[0])
        await conn.execute(FINISH, [ids[1]])

        # No time to wait: one poll each, which reads what is there.
        assert await _poll_until(conn, ids, since, ready=True, within=0) == (False, 1, 1)
        assert await _poll_until(conn, ids, since, ready=False, within=0) == (False, 1, 1)

        await conn.execute(FINISH, ids)
        assert await _poll_until(conn, ids, since, ready=True, within=0) == (False, 0, 1)
        assert await _poll_until(conn, ids, since, ready=False, within=0) == (True, 3, 1)
    finally:
        await conn.close()
