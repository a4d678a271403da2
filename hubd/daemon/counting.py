"""Allocations by status for ``/metrics``, counted when a scrape asks for them.

Counting on a timer cost every replica a database transaction per poll interval whether or not
anything ever read the gauges: on an idle daemon, one of its few commits a second. Counted at
scrape time, the cost follows the scraper's interval instead, and a counted answer is reused
for ``max_age`` seconds, so a scraper polling hard (or several scraping one daemon) costs at
most one count per ``max_age``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping

import structlog

from hubd.errors import StoreError
from hubd.store.rows import Status

__all__ = ["AllocationCounts"]

log = structlog.get_logger(__name__)


class AllocationCounts:
    """Refreshes the allocations-by-status gauges on demand, at most once per ``max_age``.

    ``count`` reads the counts from the database; ``publish`` sets the gauges. A count that fails
    or takes longer than ``timeout`` leaves the gauges at their last values (the database's own
    health is ``hubd_database_up``, set by the heartbeat): a scrape is never refused because
    the database is slow.
    """

    def __init__(
        self,
        *,
        count: Callable[[], Awaitable[Mapping[Status, int]]],
        publish: Callable[[Mapping[str, int]], None],
        max_age: float,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._count = count
        self._publish = publish
        self._max_age = max_age
        self._timeout = timeout
        self._clock = clock
        self._counted_at: float | None = None
        # Scrapes that arrive during a count wait for it and then reuse its answer.
        self._lock = asyncio.Lock()

    async def refresh(self) -> None:
        async with self._lock:
            if self._counted_at is not None and self._clock() - self._counted_at < self._max_age:
                return
            try:
                async with asyncio.timeout(self._timeout):
                    counts = await self._count()
            except (StoreError, TimeoutError) as exc:
                log.debug("allocation_counts_unavailable", error=str(exc) or "timed out")
                return
            self._counted_at = self._clock()
            self._publish({str(status): n for status, n in counts.items()})
