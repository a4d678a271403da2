"""``wait_settled`` on the event loop's clock and on virtual time: it reports whether the task
settled within the limit and never cancels the task."""

from __future__ import annotations

import asyncio

import pytest

from hubd.reconciler.clock import Clock, ManualClock, SystemClock, wait_settled
from tests.polling import eventually


async def test_a_task_that_settles_in_time_is_reported_settled() -> None:
    release = asyncio.Event()

    async def work() -> str:
        await release.wait()
        return "done"

    task = asyncio.ensure_future(work())
    # Released only once the wait is under way: a wait that ended early would say False.
    asyncio.get_running_loop().call_soon(release.set)
    assert await wait_settled(SystemClock(), task, 60.0) is True
    assert task.result() == "done"


async def test_a_late_task_is_reported_unsettled_and_left_running() -> None:
    release = asyncio.Event()
    task = asyncio.ensure_future(release.wait())
    assert await wait_settled(SystemClock(), task, 0.01) is False
    assert not task.done()
    assert not task.cancelled()
    release.set()
    await task


async def test_cancelling_the_waiter_leaves_the_task_alone() -> None:
    release = asyncio.Event()
    task = asyncio.ensure_future(release.wait())
    # The waiter is cancelled (by a timeout already due) once its wait is under way.
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0):
            await wait_settled(SystemClock(), task, 60.0)
    assert not task.done()
    release.set()
    await task


async def test_a_done_task_needs_no_wait() -> None:
    task: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task.set_result(1)
    assert await wait_settled(SystemClock(), task, 0.0) is True


async def test_on_virtual_time_only_the_clock_ends_the_wait() -> None:
    clock = ManualClock()
    release = asyncio.Event()
    task = asyncio.ensure_future(release.wait())
    waiting = asyncio.ensure_future(wait_settled(clock, task, 5.0))
    await eventually(lambda: clock.sleepers == 1, what="the wait's timer on the manual clock")
    assert not waiting.done()
    clock.advance(5.0)
    assert await waiting is False
    assert not task.done()
    release.set()
    await task


async def test_next_sleeper_waits_for_a_timer_started_after_it_that_wakes_in_time() -> None:
    """A sleep already running, or one that wakes too late, does not end the wait; the first
    sleep started afterwards that wakes by the given time does."""
    clock = ManualClock()
    early = asyncio.ensure_future(clock.sleep(1.0))
    await eventually(lambda: clock.sleepers == 1, what="the early sleeper")
    armed = asyncio.ensure_future(clock.next_sleeper(clock.monotonic() + 5.0))
    late = asyncio.ensure_future(clock.sleep(60.0))
    await eventually(lambda: clock.sleepers == 2, what="the late sleeper")
    assert not armed.done()
    timer = asyncio.ensure_future(clock.sleep(5.0))
    await armed
    assert not timer.done()
    clock.advance(60.0)
    await asyncio.gather(early, late, timer)


@pytest.mark.parametrize("clock", [SystemClock(), ManualClock()], ids=["loop", "manual"])
async def test_a_failed_task_counts_as_settled(clock: Clock) -> None:
    async def fail() -> None:
        raise ValueError("boom")

    task = asyncio.ensure_future(fail())
    assert await wait_settled(clock, task, 60.0) is True
    with pytest.raises(ValueError, match="boom"):
        task.result()
