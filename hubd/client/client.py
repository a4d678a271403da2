"""The application's client: request, release, read and wait on allocations through the SQL API.

Everything here goes through ``hubd_v1`` (docs/api.md), the same functions and views every
other language uses, so a role that holds only ``hubd_app`` is enough. The daemon's store is not
involved: an application needs neither its pools nor its privileges.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from datetime import timedelta
from typing import Any, Final

import asyncpg

from hubd.client.faults import CAUGHT, ClientClosed, translated
from hubd.client.follow import CLOSE_TIMEOUT, Follower
from hubd.client.values import AllocationInfo, Event
from hubd.errors import (
    AllocationNotFound,
    DatabaseUnavailable,
    HubdError,
)

__all__ = ["AllocationEnded", "Client", "ClientClosed", "settled"]

HEALTH_INTERVAL: Final = 5.0
"""Seconds of silence after which a follower asks its connection whether it still answers, and
how long it waits for the answer (a connection whose peer vanished delivers nothing, and says
nothing either); a connection that closes is known at once."""

_REQUEST: Final = """
SELECT * FROM hubd_v1.request($1, $2, $3, $4, $5, $6, $7, $8)"""
_RELEASE: Final = "SELECT * FROM hubd_v1.release($1, $2)"
_EXTEND: Final = "SELECT * FROM hubd_v1.extend($1, $2)"
_TOUCH: Final = "SELECT * FROM hubd_v1.touch($1)"
_GET: Final = "SELECT * FROM hubd_v1.allocations WHERE id = $1"
_LIST: Final = """
SELECT * FROM hubd_v1.allocations
WHERE ($1::text IS NULL OR status = $1) AND ($2::text IS NULL OR tenant = $2)
  AND ($4::text IS NULL OR session = $4)
ORDER BY created_at DESC, id LIMIT $3"""
_SNAPSHOT: Final = """
SELECT * FROM hubd_v1.allocations
WHERE status NOT IN ('released', 'failed', 'destroy_failed')
  AND ($1::text IS NULL OR tenant = $1)
ORDER BY created_at, id"""
_CURSOR: Final = "SELECT hubd_v1.event_cursor()"
_PAGE: Final = "SELECT * FROM hubd_v1.events_after($1, NULL, $2, $3)"
# The wall of a walled client (docs/api.md): for one transaction, or for a follower's session.
_WALL_LOCAL: Final = "SELECT set_config('hubd.wall', $1, true)"
_WALL: Final = "SELECT set_config('hubd.wall', $1, false)"


class AllocationEnded(HubdError):
    """The allocation was released or failed before it became ready."""

    def __init__(self, info: AllocationInfo) -> None:
        reason = f": {info.failure_code}: {info.failure_message}" if info.failure_code else ""
        super().__init__(f"allocation {info.id} is {info.status}{reason}")
        self.info = info


async def _setup(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


class Client:
    """An application's door to hubd: a handful of methods on a small pool.

    Open one with :meth:`connect` (``async with await Client.connect(dsn) as client``) or wrap a
    pool of your own. ``request`` and ``release`` also take ``conn=``, a connection of yours,
    so the allocation commits (and the daemon hears of it) with your own transaction.
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        owns_pool: bool = False,
        wall: str | None = None,
        timeout: float | None = None,
    ) -> None:
        """``wall``: act as a caller walled into that tenant (see :meth:`for_tenant`).
        ``timeout``: how long each call of ``request``, ``get``, ``list``, ``release``,
        ``extend``, ``touch``, ``cursor`` and ``events_page`` may take, the wait for a
        connection included; past it the call raises :class:`~hubd.errors.DatabaseUnavailable`
        and its connection is closed (a statement on a connection the network lost would
        otherwise wait for TCP to give up, minutes later). ``None``: as long as it takes."""
        self._pool = pool
        self._owns_pool = owns_pool
        self._wall = wall
        self._timeout = timeout
        self._closed = False
        self._followers: set[Follower] = set()

    def for_tenant(self, tenant: str) -> Client:
        """A client on the same pool whose every statement runs walled into ``tenant``
        (``hubd.wall``, docs/api.md): it sees, requests and follows that tenant's allocations
        alone, as a role walled into it would. A caller walled into another tenant stays in its
        own. Closing it ends its followers, not the pool."""
        return Client(self._pool, wall=tenant, timeout=self._timeout)

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        max_size: int = 4,
        timeout: float | None = None,  # noqa: ASYNC109 -- a bound on each later call
    ) -> Client:
        """A client on a pool of its own: one connection at first, at most ``max_size``
        (each event follower holds one while it follows); ``timeout`` as in the constructor."""
        with translated("connect"):
            pool = await asyncpg.create_pool(dsn, min_size=1, max_size=max_size, init=_setup)
        assert pool is not None
        return cls(pool, owns_pool=True, timeout=timeout)

    async def close(self) -> None:
        """End every follower (:meth:`events`, :meth:`watch`, :meth:`wait_ready`) at once, each
        raising :class:`ClientClosed` where it is, then close the pool if the client opened it.

        Returns within ``CLOSE_TIMEOUT`` (2 s) whatever the connections are doing: the
        followers' are terminated, and the pool's others get that long to finish their
        statements and close before they are terminated too. Idempotent."""
        self._closed = True
        for follower in list(self._followers):
            follower.shut()
        if not self._owns_pool:
            return
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT):
                await self._pool.close()
        except CAUGHT:
            # A connection still busy (a statement stuck on a paused server), or one whose
            # close was not answered: Pool.close() waits for each as long as it takes.
            self._pool.terminate()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def request(
        self,
        provisioner: str,
        *,
        tenant: str | None = None,
        session: str | None = None,
        spec: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
        ready_when: str | None = None,
        lifetime: timedelta | None = None,
        idle_timeout: timedelta | None = None,
        conn: asyncpg.Connection | None = None,
    ) -> AllocationInfo:
        """Ask for a sidecar of ``provisioner``; returns the new (pending) allocation.

        With ``idempotency_key``, a retry returns the allocation the key already names (never a
        second one); a key used for a different request raises
        :class:`~hubd.errors.IdempotencyConflict`. ``ready_when`` is ``"connected"`` or
        ``"declared"`` (the sidecar says when it is ready); by default the provisioner's.
        ``lifetime`` bounds its life from now (default: the provisioner's ``max_lifetime``, if
        any; longer than that raises :class:`~hubd.errors.InvalidRequest`); at its end it is
        released, ``end_reason`` ``expired``, an ``expiring`` event coming first.
        ``idle_timeout`` (default: the provisioner's, if any; never longer): once ready, it is
        released as ``idle`` after that long with no activity from its sidecar or from
        :meth:`touch` or :meth:`extend`.
        """
        args = (
            provisioner,
            tenant,
            session,
            json.dumps(dict(spec or {})),
            idempotency_key,
            ready_when,
            lifetime,
            idle_timeout,
        )
        return await self._one("request", _REQUEST, args, conn)

    async def extend(
        self,
        allocation_id: str,
        lifetime: timedelta,
        *,
        conn: asyncpg.Connection | None = None,
    ) -> AllocationInfo:
        """The allocation now ends ``lifetime`` from now, within its provisioner's
        ``max_lifetime`` from its request (:class:`~hubd.errors.InvalidRequest` beyond it);
        one being released or ended is returned as it is."""
        return await self._one("extend", _EXTEND, (allocation_id, lifetime), conn)

    async def touch(
        self, allocation_id: str, *, conn: asyncpg.Connection | None = None
    ) -> AllocationInfo:
        """The application is still using the allocation: its idle clock starts again (where
        it has an idle timeout). Returns it as it now stands."""
        return await self._one("touch", _TOUCH, (allocation_id,), conn)

    async def release(
        self,
        allocation_id: str,
        *,
        reason: str = "release requested",
        conn: asyncpg.Connection | None = None,
    ) -> AllocationInfo:
        """Give the allocation up (idempotent); returns it as it now stands, usually
        ``releasing``: the daemon destroys the sidecar, then it is ``released``."""
        return await self._one("release", _RELEASE, (allocation_id, reason), conn)

    async def get(
        self, allocation_id: str, *, conn: asyncpg.Connection | None = None
    ) -> AllocationInfo:
        """The allocation as it stands; :class:`~hubd.errors.AllocationNotFound` if unknown."""
        info = await self._maybe("get", _GET, (allocation_id,), conn)
        if info is None:
            raise AllocationNotFound(f"no allocation {allocation_id}")
        return info

    async def list(
        self,
        *,
        status: str | None = None,
        tenant: str | None = None,
        session: str | None = None,
        limit: int = 100,
    ) -> list[AllocationInfo]:
        """Allocations, newest first, of one status, tenant and session when given."""
        with translated("list"):
            async with self._statement(None) as conn:
                rows = await conn.fetch(_LIST, status, tenant, limit, session)
        return [AllocationInfo.from_row(row) for row in rows]

    async def events_page(
        self, *, after: int, allocation_id: str | None = None, limit: int = 500
    ) -> builtins.list[Event]:
        """The events after position ``after``, oldest first, at most ``limit``: one read of
        the feed, for a caller that waits for more on its own (:meth:`events` follows it)."""
        with translated("events"):
            async with self._statement(None) as conn:
                rows = await conn.fetch(_PAGE, after, allocation_id, limit)
        return [Event.from_row(row) for row in rows]

    async def snapshot(
        self, *, tenant: str | None = None
    ) -> tuple[builtins.list[AllocationInfo], int]:
        """Every active allocation (of ``tenant`` when given) and the event cursor of the same
        instant: follow :meth:`events` from that cursor and nothing is missed or seen twice."""
        with translated("snapshot"):
            async with (
                self._pool.acquire() as conn,
                conn.transaction(isolation="repeatable_read", readonly=True),
            ):
                if self._wall is not None:
                    await conn.execute(_WALL, self._wall)
                rows = await conn.fetch(_SNAPSHOT, tenant)
                cursor = await conn.fetchval(_CURSOR)
        return [AllocationInfo.from_row(row) for row in rows], int(cursor)

    async def cursor(self) -> int:
        """The position of the newest event: :meth:`events` from here sees only what follows."""
        with translated("cursor"):
            async with self._statement(None) as conn:
                return int(await conn.fetchval(_CURSOR))

    async def events(
        self,
        *,
        since: int,
        tenant: str | None = None,
        allocation_id: str | None = None,
        health_interval: float = HEALTH_INTERVAL,
    ) -> AsyncGenerator[Event, None]:
        """Every event after position ``since``, oldest first, and then each one as it commits,
        forever (break out of the loop to stop). Keep the last ``position`` you handled: after
        a restart, ``since=position`` resumes with no gap. The follower waits on
        ``LISTEN hubd_events`` and reads the feed when told; a dropped connection is reopened
        and the feed read from the cursor, so nothing is missed. A cursor the feed no longer
        keeps raises :class:`~hubd.errors.EventCursorExpired`: read :meth:`snapshot` again.
        Close it when done (``contextlib.aclosing``), so its connection goes back at once."""
        follower = Follower(
            self._pool,
            cursor=since,
            tenant=tenant,
            allocation_id=allocation_id,
            health_interval=health_interval,
            wall=self._wall,
        )
        async with self._following(follower):
            while True:
                for event in await follower.next_batch():
                    yield event

    async def watch(
        self, allocation_id: str, *, health_interval: float = HEALTH_INTERVAL
    ) -> AsyncGenerator[AllocationInfo, None]:
        """The allocation as it stands now, then again after each of its events, forever
        (break out to stop); :class:`~hubd.errors.AllocationNotFound` if unknown. Waits on
        notifications, not by polling. Close it when done (``contextlib.aclosing``)."""
        follower = Follower(
            self._pool,
            cursor=0,
            allocation_id=allocation_id,
            health_interval=health_interval,
            wall=self._wall,
        )
        async with self._following(follower):
            yield await follower.state(allocation_id)
            while True:
                # Each batch holds at least one event of this allocation: look again, on the
                # follower's connection (a fault there is one more reconnect, not an error).
                await follower.next_batch()
                yield await follower.state(allocation_id)

    async def wait_ready(
        self,
        allocation_id: str,
        timeout: float,  # noqa: ASYNC109 - a deadline is what an application asks for here
        *,
        health_interval: float = HEALTH_INTERVAL,
    ) -> AllocationInfo:
        """Wait until the allocation is ready; returns it then (with its endpoint).

        Raises :class:`AllocationEnded` if it is released or fails first, and
        :class:`TimeoutError` after ``timeout`` seconds (the allocation is left as it is).
        Waits on notifications, not by polling.
        """
        info: AllocationInfo | None = None
        try:
            states = self.watch(allocation_id, health_interval=health_interval)
            async with asyncio.timeout(timeout), contextlib.aclosing(states):
                async for info in states:
                    if settled(info):
                        break
        except TimeoutError:
            status = f" (it is {info.status})" if info is not None else ""
            raise TimeoutError(
                f"allocation {allocation_id} not ready after {timeout:g}s{status}"
            ) from None
        assert info is not None
        if not info.ready:
            raise AllocationEnded(info)
        return info

    @contextlib.asynccontextmanager
    async def _following(self, follower: Follower) -> AsyncIterator[None]:
        """Run ``follower`` as one of this client's, which :meth:`close` ends."""
        if self._closed:
            raise ClientClosed()
        self._followers.add(follower)
        try:
            async with follower:
                yield
        finally:
            self._followers.discard(follower)

    async def _one(
        self, what: str, sql: str, args: tuple[Any, ...], conn: asyncpg.Connection | None
    ) -> AllocationInfo:
        info = await self._maybe(what, sql, args, conn)
        assert info is not None
        return info

    async def _maybe(
        self, what: str, sql: str, args: tuple[Any, ...], conn: asyncpg.Connection | None
    ) -> AllocationInfo | None:
        with translated(what):
            async with self._statement(conn) as on:
                row = await on.fetchrow(sql, *args)
        return AllocationInfo.from_row(row) if row is not None else None

    @contextlib.asynccontextmanager
    async def _statement(self, conn: asyncpg.Connection | None) -> AsyncIterator[Any]:
        """Where one statement runs: ``conn`` (the caller's, whose own transaction holds the
        wall it set), else a connection of the pool, walled for the statement's transaction
        when this client is."""
        if conn is not None and self._wall is None:
            yield conn
        elif conn is not None:
            # A savepoint within the caller's transaction, or one of its own: a local setting
            # outside a transaction would hold for this statement's implicit one only.
            async with conn.transaction():
                await conn.execute(_WALL_LOCAL, self._wall)
                yield conn
        elif self._wall is None:
            async with self._acquired() as acquired:
                yield acquired
        else:
            async with self._acquired() as acquired, acquired.transaction():
                await acquired.execute(_WALL_LOCAL, self._wall)
                yield acquired

    @contextlib.asynccontextmanager
    async def _acquired(self) -> AsyncIterator[Any]:
        """A connection of the pool, closed at once when this client's ``timeout`` runs out
        before the block ends: what waits on it then fails as the connection lost."""
        if self._timeout is None:
            async with self._pool.acquire() as conn:
                yield conn
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        try:
            conn = await self._pool.acquire(timeout=self._timeout)
        except TimeoutError:
            raise DatabaseUnavailable(
                f"no database connection within {self._timeout:g} s"
            ) from None
        guard = loop.call_at(deadline, conn.terminate)
        try:
            yield conn
        finally:
            guard.cancel()
            await self._pool.release(conn)


def settled(info: AllocationInfo) -> bool:
    """Ready, or never going to be (releasing or finished)."""
    return info.ready or info.terminal or info.status == "releasing"
