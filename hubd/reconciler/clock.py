"""Injected time for the reconciler: the monotonic clock, sleeps, and waits with a time limit.

:class:`SystemClock` is the event loop's clock. :class:`ManualClock` only moves when a test
advances it, so lease deadlines and renewal intervals can be tested on virtual time.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

__all__ = ["Clock", "ManualClock", "SystemClock", "Timer", "wait_settled"]

T = TypeVar("T")


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        """Call ``callback`` on the running loop once this clock reads ``when``: a deadline
        watched without a task of its own."""

    async def settle(self, task: asyncio.Future[Any], limit: float) -> bool:
        """Wait up to ``limit`` seconds of this clock for ``task``; ``True`` if it settled.
        Never cancels ``task``."""


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        # Relative to this clock, not to the loop's: the two need not share an origin.
        delay = max(0.0, when - time.monotonic())
        return asyncio.get_running_loop().call_later(delay, callback)

    async def settle(self, task: asyncio.Future[Any], limit: float) -> bool:
        # A timer handle and a callback on the task, not a sleeping task and asyncio.wait:
        # every store and plugin call of a claim waits here, several per allocation, and the
        # sleeping task cost more than the wait.
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()

        def wake(_: object = None) -> None:
            if not waiter.done():
                waiter.set_result(None)

        timer = loop.call_later(max(0.0, limit), wake)
        task.add_done_callback(wake)
        try:
            await waiter
        finally:
            timer.cancel()
            task.remove_done_callback(wake)
        return task.done()


class _ManualTimer:
    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback: Callable[[], None] | None = callback

    def cancel(self) -> None:
        self.callback = None

    def done(self) -> bool:
        return self.callback is None


class ManualClock:
    """A clock that stands still until :meth:`advance` is called."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        # Sleeps (their futures) and timers, by the time they wake.
        self._sleepers: list[tuple[float, int, asyncio.Future[None] | _ManualTimer]] = []
        self._order = itertools.count()
        # Waiters of next_sleeper: each for a sleeper that wakes by its time.
        self._arming: list[tuple[float, asyncio.Future[None]]] = []

    def monotonic(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        wake = self._now + seconds
        heapq.heappush(self._sleepers, (wake, next(self._order), future))
        for until, waiter in self._arming:
            if wake <= until and not waiter.done():
                waiter.set_result(None)
        await future

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        """A timer counts as a sleeper (it waits on this clock) but is never a ``next_sleeper``:
        it is no sleep of a task."""
        timer = _ManualTimer(callback)
        heapq.heappush(self._sleepers, (when, next(self._order), timer))
        return timer

    async def next_sleeper(self, until: float) -> None:
        """Wait until a sleep starts, from now on, that wakes by ``until`` (a timer of the code
        under test is armed, so advancing past it now times it out)."""
        entry = (until, asyncio.get_running_loop().create_future())
        self._arming.append(entry)
        try:
            await entry[1]
        finally:
            self._arming.remove(entry)

    async def settle(self, task: asyncio.Future[Any], limit: float) -> bool:
        timer = asyncio.ensure_future(self.sleep(limit))
        try:
            await asyncio.wait({task, timer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await timer
        return task.done()

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose time has come."""
        self._now += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, waiting = heapq.heappop(self._sleepers)
            if isinstance(waiting, _ManualTimer):
                callback = waiting.callback
                if callback is not None:
                    waiting.cancel()
                    # On the loop, as a sleeper woken here runs: after this call returns.
                    asyncio.get_running_loop().call_soon(callback)
            elif not waiting.done():
                waiting.set_result(None)

    @property
    def sleepers(self) -> int:
        """Sleeps and timers still waiting on this clock."""
        return sum(1 for _, _, waiting in self._sleepers if not waiting.done())


async def wait_settled(clock: Clock, task: asyncio.Future[Any], limit: float) -> bool:
    """Wait up to ``limit`` seconds of ``clock`` for ``task``; ``True`` if it settled.

    Never cancels ``task``: the caller decides whether a late task is cancelled or left to
    settle while it stays accounted for.
    """
    return task.done() or await clock.settle(task, limit)
