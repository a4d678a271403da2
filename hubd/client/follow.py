"""Following the event feed: LISTEN for the hint, read the durable feed for the truth.

A notification on ``hubd_events`` names the position its event took and nothing else (any role
may listen, whatever its tenant); the feed (``hubd_v1.events_after``) holds every event in
commit order. The follower listens first and reads second, so an event that commits between the
two is read, and an event whose notification is lost (the connection dropped, the process
paused) is read when the connection is back, from the cursor. No event is skipped and none is
read twice. Each read also takes the feed's newest position in the same snapshot: a follower of
one allocation or tenant moves its cursor past the events it does not see, so a notification of
another tenant's event wakes it at most once.

A connection fault never ends a follower (:mod:`hubd.client.faults` says what is a fault): the
connection is terminated, a new one listens, and the feed is read from the cursor, which moves
only past events a read returned whole. A lost connection is known

- at once when it closes (the backend terminated, the server stopped or restarted, the socket
  reset): the driver's termination signal (``add_termination_listener``) wakes the follower;
- within two ``health_interval`` when it falls silent (a paused or partitioned server, a
  vanished host): after one of silence the follower sends ``SELECT 1`` and gives the connection
  up if no answer comes within another; a feed read is given up after :data:`READ_TIMEOUT`.

The first reconnect after a read that succeeded is immediate; the next ones wait a jittered,
doubling delay up to :data:`RECONNECT_CAP` (many applications' followers lose their connections
together when the server restarts). Nothing waits on a connection that does not answer when the
follower ends: it gets :data:`CLOSE_TIMEOUT` to ``UNLISTEN`` and go back to its pool, and is
terminated otherwise; :meth:`Follower.shut` (the client closing) terminates it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import Awaitable, Callable
from typing import Any, Final

import asyncpg

from hubd.backoff import Backoff
from hubd.client.faults import CAUGHT, ClientClosed, is_fault, refusal
from hubd.client.values import AllocationInfo, Event
from hubd.errors import AllocationNotFound

__all__ = [
    "CHANNEL",
    "CLOSE_TIMEOUT",
    "OPEN_TIMEOUT",
    "READ_TIMEOUT",
    "RECONNECT_CAP",
    "Follower",
]

CHANNEL: Final = "hubd_events"
READ_TIMEOUT: Final = 15.0
"""Seconds a feed read (at most a batch of rows, by index, with no lock to wait for) may take
before its connection is given up and the read made again on a new one."""
OPEN_TIMEOUT: Final = 10.0
"""Seconds one attempt to take a connection from the pool and ``LISTEN`` on it may take."""
CLOSE_TIMEOUT: Final = 2.0
"""Seconds an ending follower's connection gets to ``UNLISTEN`` and go back to its pool before
it is terminated instead."""
RECONNECT_CAP: Final = 5.0
"""The longest wait between two attempts to reconnect."""
_RECONNECTS: Final = Backoff(base=0.1, cap=RECONNECT_CAP)
_EVENTS_AFTER: Final = """
SELECT w.watermark, e.* FROM (SELECT hubd_v1.event_cursor() AS watermark) AS w
LEFT JOIN hubd_v1.events_after($1, $2, $3, $4) AS e ON true
ORDER BY e.position"""
_WALL: Final = "SELECT set_config('hubd.wall', $1, false)"
_STATE: Final = """
SELECT v.*, hubd_v1.event_cursor() AS feed_cursor FROM hubd_v1.allocations AS v WHERE v.id = $1"""


class _Lost(Exception):
    """The follower's connection failed or stopped answering."""


class _Session:
    """One pooled connection that listens on the channel."""

    def __init__(self, conn: Any, now: float, wake: Callable[[_Session], None]) -> None:
        self.conn = conn
        self.heard = now
        """When it last proved alive: an answer, or a notification."""
        self.ended = False
        """It closed (its termination listener ran) or was given up."""
        self.in_doubt = False
        """A statement on it was interrupted: its state is unknown, it never goes back to the
        pool as it is."""
        self._wake = wake

    def terminated(self, _conn: object) -> None:
        # The driver's termination listener, called soon after the connection closed, whatever
        # the follower was doing (waiting for a notification, most of the time).
        self.ended = True
        self._wake(self)


class Follower:
    """One connection of the pool that listens on ``hubd_events`` and reads the feed after
    ``cursor``, of one tenant or allocation when given; opened at its first read."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        cursor: int,
        tenant: str | None = None,
        allocation_id: str | None = None,
        health_interval: float,
        batch: int = 500,
        wall: str | None = None,
    ) -> None:
        """``wall``: read as a caller walled into that tenant (``hubd.wall``, docs/api.md)."""
        self.cursor = cursor
        self._wall = wall
        self.connections = 0
        """How many connections it has listened on (each loss opens one more)."""
        self._pool = pool
        self._tenant = tenant
        self._allocation_id = allocation_id
        self._health_interval = health_interval
        self._batch = batch
        self._session: _Session | None = None
        self._wake = asyncio.Event()
        self._shut = asyncio.Event()
        self._failures = 0
        """Connections lost (or not opened) since the last statement that succeeded."""

    async def __aenter__(self) -> Follower:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close()

    def shut(self) -> None:
        """End the follower from any task, waiting for nothing: its connection is terminated (so
        its pool has the slot back at once) and its next step raises :class:`ClientClosed`."""
        self._shut.set()
        self._wake.set()
        session, self._session = self._session, None
        if session is not None:
            _give_up(session)

    async def state(self, allocation_id: str) -> AllocationInfo:
        """The allocation now, and the cursor moved to the same instant (one snapshot)."""
        while True:
            session = await self._listening()
            try:
                row = await self._read(session, lambda c: c.fetchrow(_STATE, allocation_id))
            except _Lost:
                self._drop(session)
                continue
            if row is None:
                raise AllocationNotFound(f"no allocation {allocation_id}")
            self.cursor = max(self.cursor, int(row["feed_cursor"]))
            return AllocationInfo.from_row(row)

    async def next_batch(self) -> list[Event]:
        """The next events after the cursor (at least one), waiting for them as long as it
        takes; the cursor moves past them."""
        while True:
            session = await self._listening()
            try:
                # A notification that arrives during the read sets it again: read once more.
                self._wake.clear()
                rows = await self._read(
                    session,
                    lambda c: c.fetch(
                        _EVENTS_AFTER, self.cursor, self._tenant, self._allocation_id, self._batch
                    ),
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
                await self._wait(session)
            except _Lost:
                self._drop(session)

    async def _wait(self, session: _Session) -> None:
        """Until a notification names a later position or the connection closes (the next
        read then fails at once), asking whether it still answers after each silence."""
        loop = asyncio.get_running_loop()
        while not self._wake.is_set():
            if self._pool.is_closing():
                # Someone closes the pool this follower's client wraps: the pool waits for its
                # connections, so give this one back rather than follow on.
                raise ClientClosed("the pool the client wraps is closing")
            quiet = loop.time() - session.heard
            if quiet >= self._health_interval:
                await self._read(session, lambda c: c.fetchval("SELECT 1"), self._health_interval)
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._health_interval - quiet):
                    await self._wake.wait()

    async def _read(
        self,
        session: _Session,
        call: Callable[[Any], Awaitable[Any]],
        within: float = READ_TIMEOUT,
    ) -> Any:
        """One statement on ``session``; :class:`_Lost` on a fault, the database's refusal
        raised as hubd's error."""
        if session.ended:
            raise _Lost()
        try:
            async with asyncio.timeout(within):
                result = await call(session.conn)
        except CAUGHT as exc:
            if is_fault(exc):
                raise _Lost() from exc
            raise refusal(exc, "follow events") from exc
        except BaseException:
            # Cancelled by the application (its own timeout, its task ending) or a bug: where
            # the statement stopped is unknown.
            session.in_doubt = True
            raise
        session.heard = asyncio.get_running_loop().time()
        self._failures = 0
        return result

    async def _listening(self) -> _Session:
        """The connection to read on: the current one, or a new one that listens."""
        if self._shut.is_set():
            raise ClientClosed()
        session = self._session
        if session is not None and not session.ended:
            return session
        if session is not None:
            self._drop(session)
        return await self._open()

    async def _open(self) -> _Session:
        loop = asyncio.get_running_loop()
        while True:
            if self._failures > 1:
                # The first reconnect goes at once: a terminated backend is replaced in
                # milliseconds. One that follows a failed attempt waits.
                delay = _RECONNECTS.delay(self._failures - 2, random.random)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._shut.wait()
            if self._shut.is_set():
                raise ClientClosed()
            conn = None
            try:
                async with asyncio.timeout(OPEN_TIMEOUT):
                    conn = await self._pool.acquire()
                    session = _Session(conn, loop.time(), self._woken_by)
                    conn.add_termination_listener(session.terminated)
                    if self._wall is not None:
                        # For the connection's session: the pool resets it on release.
                        await conn.execute(_WALL, self._wall)
                    await conn.add_listener(CHANNEL, self._on_notify)
            except CAUGHT as exc:
                if conn is not None:
                    _terminate(conn)
                if self._pool.is_closing():
                    raise ClientClosed("the pool the client wraps is closed") from exc
                if not is_fault(exc):
                    raise refusal(exc, "follow events") from exc
                self._failures += 1
                continue
            except BaseException:
                if conn is not None:
                    _terminate(conn)
                raise
            if self._shut.is_set():
                _terminate(conn)
                raise ClientClosed()
            self._session = session
            self.connections += 1
            # Whatever committed while no one listened is in the feed: read it first.
            self._wake.set()
            return session

    def _woken_by(self, session: _Session) -> None:
        if session is self._session:
            self._wake.set()

    def _drop(self, session: _Session) -> None:
        """Give ``session`` up after a fault."""
        if self._session is session:
            self._session = None
        self._failures += 1
        _give_up(session)

    def _on_notify(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        if self._session is not None:
            self._session.heard = asyncio.get_running_loop().time()
        try:
            note = json.loads(payload)
            position = int(note["position"])
        except (ValueError, KeyError, TypeError):
            self._wake.set()  # unreadable: read the feed, which is the truth anyway
            return
        if position <= self.cursor:
            return
        self._wake.set()

    async def _close(self) -> None:
        session, self._session = self._session, None
        if session is None:
            return
        if session.ended or session.in_doubt:
            _give_up(session)
            return
        conn = session.conn
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT):
                conn.remove_termination_listener(session.terminated)
                await conn.remove_listener(CHANNEL, self._on_notify)
                await self._pool.release(conn, timeout=CLOSE_TIMEOUT)
        except CAUGHT:
            # It did not answer in time, or at all: its pool gets the slot back anyway.
            _give_up(session)
        except BaseException:
            _give_up(session)
            raise


def _give_up(session: _Session) -> None:
    session.ended = True
    _terminate(session.conn)


def _terminate(conn: Any) -> None:
    """Close ``conn`` without a word to the server; its pool takes the slot back (the driver
    releases a pooled connection that closes). One the pool has taken back already raises
    ``InterfaceError``: there is nothing left to do."""
    with contextlib.suppress(asyncpg.InterfaceError):
        conn.terminate()
