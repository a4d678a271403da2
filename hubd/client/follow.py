"""Following the event feed: LISTEN for the hint, read the durable feed for the truth.

A notification on ``hubd_events`` names the position its event took and nothing else (any role
may listen, whatever its tenant); the feed (``hubd_v1.events_after``) holds every event in
commit order. The follower listens first and reads second, so an event that commits between the
two is read, and an event whose notification is lost (the connection dropped, the process
paused) is read when the connection is back, from the cursor. No event is skipped and none is
read twice. Each read also takes the feed's newest position in the same snapshot: a follower of
one allocation or tenant moves its cursor past the events it does not see, so a notification of
another tenant's event wakes it at most once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any, Final

import asyncpg

from hubd.client.values import AllocationInfo, Event
from hubd.errors import API_SQLSTATES, AllocationNotFound, StoreError

__all__ = ["CHANNEL", "Follower"]

CHANNEL: Final = "hubd_events"
_EVENTS_AFTER: Final = """
SELECT w.watermark, e.* FROM (SELECT hubd_v1.event_cursor() AS watermark) AS w
LEFT JOIN hubd_v1.events_after($1, $2, $3, $4) AS e ON true
ORDER BY e.position"""
_STATE: Final = """
SELECT v.*, hubd_v1.event_cursor() AS feed_cursor FROM hubd_v1.allocations AS v WHERE v.id = $1"""
_HEALTH_TIMEOUT: Final = 10.0
_BACKOFF_CAP: Final = 5.0
_LOST: Final = (OSError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError, TimeoutError)


class _Lost(Exception):
    """The follower's connection stopped answering."""


class Follower:
    """One connection of the pool that listens on ``hubd_events`` and reads the feed after
    ``cursor``, of one tenant or allocation when given."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        cursor: int,
        tenant: str | None = None,
        allocation_id: str | None = None,
        health_interval: float,
        batch: int = 500,
    ) -> None:
        self.cursor = cursor
        self._pool = pool
        self._tenant = tenant
        self._allocation_id = allocation_id
        self._health_interval = health_interval
        self._batch = batch
        self._conn: Any = None
        self._wake = asyncio.Event()

    async def __aenter__(self) -> Follower:
        await self._open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close()

    async def start_at_state(self, allocation_id: str) -> AllocationInfo:
        """The allocation now, and the cursor moved to the same instant (one snapshot)."""
        while True:
            try:
                row = await self._checked(lambda: self._conn.fetchrow(_STATE, allocation_id))
            except _Lost:
                await self._reopen()
                continue
            if row is None:
                raise AllocationNotFound(f"no allocation {allocation_id}")
            self.cursor = int(row["feed_cursor"])
            return AllocationInfo.from_row(row)

    async def next_batch(self) -> list[Event]:
        """The next events after the cursor (at least one), waiting for them as long as it
        takes; the cursor moves past them."""
        while True:
            try:
                self._wake.clear()
                rows = await self._checked(
                    lambda: self._conn.fetch(
                        _EVENTS_AFTER, self.cursor, self._tenant, self._allocation_id, self._batch
                    )
                )
                events = [Event.from_row(row) for row in rows if row["position"] is not None]
                if events:
                    self.cursor = events[-1].position
                if len(events) < self._batch:
                    # The read saw every position up to the watermark (one snapshot): what it
                    # did not return belongs to other allocations or tenants.
                    self.cursor = max(self.cursor, int(rows[0]["watermark"]))
                if events:
                    return events
                await self._wait()
            except _Lost:
                await self._reopen()

    async def _wait(self) -> None:
        """Until a notification says there is more, checking the connection meanwhile."""
        while True:
            try:
                async with asyncio.timeout(self._health_interval):
                    await self._wake.wait()
                return
            except TimeoutError:
                pass
            await self._checked(lambda: self._conn.fetchval("SELECT 1"), within=_HEALTH_TIMEOUT)

    async def _checked(
        self, call: Callable[[], Awaitable[Any]], *, within: float | None = None
    ) -> Any:
        try:
            async with asyncio.timeout(within):
                return await call()
        except asyncpg.PostgresError as exc:
            if isinstance(exc, asyncpg.PostgresConnectionError):
                raise _Lost() from exc
            mapped = API_SQLSTATES.get(exc.sqlstate or "")
            if mapped is not None:
                raise mapped(f"follow events: {exc}") from exc
            raise StoreError(f"follow events: {exc.__class__.__name__}: {exc}") from exc
        except _LOST as exc:
            raise _Lost() from exc

    def _on_notify(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        try:
            note = json.loads(payload)
            position = int(note["position"])
        except (ValueError, KeyError, TypeError):
            self._wake.set()  # unreadable: read the feed, which is the truth anyway
            return
        if position <= self.cursor:
            return
        self._wake.set()

    async def _open(self) -> None:
        delay = 0.1
        while True:
            conn = None
            try:
                conn = await self._pool.acquire()
                await conn.add_listener(CHANNEL, self._on_notify)
            except _LOST:
                if conn is not None:
                    await self._discard(conn)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_CAP)
                continue
            self._conn = conn
            # Whatever committed while no one listened is in the feed: read it first.
            self._wake.set()
            return

    async def _reopen(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await self._discard(conn)
        await self._open()

    async def _discard(self, conn: Any) -> None:
        # The pool may have taken a connection the server closed back already.
        with contextlib.suppress(*_LOST):
            conn.terminate()
        with contextlib.suppress(*_LOST):
            await self._pool.release(conn)

    async def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            await conn.remove_listener(CHANNEL, self._on_notify)
            await self._pool.release(conn)
        except _LOST:
            await self._discard(conn)
