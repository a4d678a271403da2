"""Local work per allocation: tracked tasks and one FIFO queue per allocation (architecture §3).

Every task the reconciler starts is tracked here until it settles, by allocation where it has
one. An allocation with a queued step or a task still running (a query that outlived its time
limit, a plugin call that ignored cancellation) is *busy*: it is excluded from claims and counts
against the claim budget until the work settles. Queues are dropped when they empty, so idle
allocations cost no memory.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import structlog

from hubd.aio import TrackedTasks

__all__ = ["LocalWork"]

T = TypeVar("T")
log = structlog.get_logger(__name__)


def _failed(name: str, exc: BaseException) -> None:
    log.debug("tracked_task_failed", task=name, error=exc)


class LocalWork:
    def __init__(self, on_settled: Callable[[], None] | None = None) -> None:
        # Called when an allocation's last local work settles: it was excluded from claims
        # until now and may be due, with no notification coming to say so.
        self._on_settled = on_settled or (lambda: None)
        self._queues: dict[str, asyncio.Task[None]] = {}
        self._inflight: dict[str, int] = {}
        # A failure is retrieved there so a task whose awaiter gave up never logs "never
        # retrieved"; whoever awaited it has already handled the error.
        self._tasks = TrackedTasks(on_failure=_failed)

    @property
    def queue_depth(self) -> int:
        """Allocations with queued steps."""
        return len(self._queues)

    def busy(self) -> frozenset[str]:
        """Allocations with queued steps or tasks still running."""
        return frozenset(self._queues) | frozenset(self._inflight)

    def is_busy(self, allocation_id: str) -> bool:
        return allocation_id in self._queues or allocation_id in self._inflight

    async def drain(self) -> None:
        """Wait until every tracked task has settled."""
        await self._tasks.drain()

    def spawn(
        self, coro: Coroutine[Any, Any, T], *, allocation_id: str | None, name: str
    ) -> asyncio.Task[T]:
        """Start a tracked task; while it runs, ``allocation_id`` is busy."""
        task = self._tasks.spawn(coro, name=name)
        if allocation_id is not None:
            task.add_done_callback(functools.partial(self._settled, allocation_id))
            self._inflight[allocation_id] = self._inflight.get(allocation_id, 0) + 1
        return task

    def _settled(self, allocation_id: str, _done: asyncio.Task[Any]) -> None:
        remaining = self._inflight[allocation_id] - 1
        if remaining:
            self._inflight[allocation_id] = remaining
        else:
            del self._inflight[allocation_id]
            self._on_settled()

    def enqueue(
        self, allocation_id: str, step: Callable[[], Awaitable[None]], name: str
    ) -> asyncio.Task[None]:
        """Run ``step`` after every step queued before it for ``allocation_id`` has settled."""
        previous = self._queues.get(allocation_id)

        async def run() -> None:
            if previous is not None:
                # Ordering only: the previous step's outcome belongs to its own caller.
                await asyncio.wait({previous})
            await step()

        task = self.spawn(run(), allocation_id=None, name=f"{name} {allocation_id}")
        self._queues[allocation_id] = task

        def settled(done: asyncio.Task[None]) -> None:
            if self._queues.get(allocation_id) is done:
                del self._queues[allocation_id]
                self._on_settled()

        task.add_done_callback(settled)
        return task
