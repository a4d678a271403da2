"""The pools hubd holds on one PostgreSQL database, and the one way to run a statement on them.

Four pools, so that no workload waits on another's connections:

- ``pool`` for claims and ordinary work;
- ``lease_pool`` for lease renewals and heartbeats: a pool saturated by slow statements can
  never starve the renewals that keep claims alive;
- ``identity_pool`` for the sidecar handshake's admissions (authenticate and record in one
  statement) and identity look-ups, which any process that can reach the listener can cause: a
  flood of handshakes waits for its own few connections;
- ``socket_pool`` for the other statements of open sockets (re-assert, clear, disconnect,
  secret acknowledgements, socket checks): a sidecar's disconnect or acknowledgement is never
  delayed because many claims are busy, nor because of a flood of handshakes.

hubd owns every use of a pooled connection and leaves no session state behind (no LISTEN, no
SET, no cursors; the sweep lock's transaction is ended, or its connection closed, by its holder), so
a connection goes back to its pool without asyncpg's reset query: that saves a round trip on
every release. An open transaction is still rolled back by asyncpg itself.

Every connection has a bound on silence (docs/operations.md); what a session carries from its
start (keepalives on both ends, the refusal of one that starts read-only) is in
:mod:`hubd.store.sessions`, and the pools add:

- a **read-only session is never kept**: every pool connects with
  ``target_session_attrs=read-write`` unless the URL names another value, so a connect walks
  the URL's host list to a writable server; a statement that meets a read-only server
  (SQLSTATE 25006: a standby, a server whose ``default_transaction_read_only`` was turned on
  under open sessions) closes its connection and expires every pool, which then reconnect
  through the host list;
- a **statement interrupted** by its budget (``command_timeout``, or any ``asyncio.timeout``
  around the block) closes its connection once its cancel request was heard, or after
  :data:`CANCEL_GRACE`: asyncpg would otherwise hold the pool's release until the server
  acknowledges the CancelRequest it sends over a new connection, which a partitioned network
  never does;
- a connection **idle for** :data:`~hubd.store.sessions.QUIET_PERIOD` is checked with one short
  statement before it is handed out; a busy connection never is, so the hot paths keep one
  round trip per statement.

Driver errors raised anywhere in a block on a connection are translated
(:mod:`hubd.store.driver_errors`).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import attrs
from asyncpg import Connection, Record

from hubd.dburl import connect_options, host_labels, single_host_url
from hubd.errors import DatabaseUnavailable
from hubd.redaction import redact_dsn
from hubd.store.driver_errors import INTERRUPTED, READ_ONLY, UNAVAILABLE, translate_errors
from hubd.store.queries import Bound
from hubd.store.sessions import SESSION_SETTINGS, SessionUsage, session_of

__all__ = ["Database", "Pool", "connect_database", "connections_opened", "try_hosts"]

CANCEL_GRACE = 1.0
"""Seconds an interrupted statement's cancel request may take to reach the server before its
connection is closed anyway (on a partitioned network it never arrives)."""


async def _cancel_briefly(pooled: asyncpg.Connection) -> None:
    """Wait up to :data:`CANCEL_GRACE` for the cancel requests asyncpg sent for ``pooled``
    (each over a connection of its own) to be delivered."""
    sending = set(getattr(session_of(pooled), "_cancellations", ()))
    if sending:
        await asyncio.wait(sending, timeout=CANCEL_GRACE)


IDLE_CHECK_TIMEOUT = 2.0
"""How long the check of an idle connection may take before the connection counts as dead."""

# One statement: a standby reads ``on`` (recovery forces it), as does a server whose
# default_transaction_read_only was turned on after the connection was made.
_IDLE_CHECK = "SELECT current_setting('transaction_read_only')"


class Pool(enum.Enum):
    """Which of the database's pools a statement runs on (see the module docstring)."""

    MAIN = "main"
    LEASE = "lease"
    IDENTITY = "identity"
    SOCKETS = "sockets"


@attrs.define(kw_only=True)
class Database:
    """The pools hubd uses against one PostgreSQL database, and the one way to run a statement.

    ``fetchrow``, ``fetch``, ``fetchval`` and ``execute`` run a bound statement inside
    :func:`~hubd.store.driver_errors.translate_errors` on a connection of ``pool``, or on
    ``conn`` when given, so that a write joins the caller's transaction.
    """

    dsn: str = attrs.field(repr=redact_dsn)
    pool: asyncpg.Pool
    lease_pool: asyncpg.Pool
    identity_pool: asyncpg.Pool
    socket_pool: asyncpg.Pool
    usage: SessionUsage = attrs.field(factory=SessionUsage, repr=False)

    @asynccontextmanager
    async def connection(
        self,
        what: str,
        *,
        pool: Pool = Pool.MAIN,
        conn: asyncpg.Connection | None = None,
    ) -> AsyncIterator[asyncpg.Connection]:
        """A connection of ``pool`` (or ``conn``) for the block; driver errors raised anywhere
        in the block are translated."""
        with translate_errors(what):
            if conn is not None:
                yield conn
                return
            chosen = self._pools[pool]
            pooled = await self._acquire(chosen)
            try:
                yield pooled
            except READ_ONLY:
                await self._met_read_only(pooled)
                raise
            except INTERRUPTED:
                # Interrupted mid-statement (its budget, a claim's deadline, a shutdown), the
                # connection may have a cancellation in flight, which asyncpg's release would
                # wait for without a limit; and a broken one cannot be trusted. Either way:
                # close it, so the caller is free at its budget, but only once the server had
                # CANCEL_GRACE to hear the cancel request: closing the socket alone does not
                # stop a statement the server is still running (one waiting on a lock would
                # commit when it gets it), and closing cancels asyncpg's request in flight.
                try:
                    await _cancel_briefly(pooled)
                finally:
                    pooled.terminate()
                raise
            else:
                self.usage.used(pooled)
            finally:
                await chosen.release(pooled)

    async def _acquire(self, chosen: asyncpg.Pool) -> asyncpg.Connection:
        """A connection of ``chosen``; one that sat unused for
        :data:`~hubd.store.sessions.QUIET_PERIOD` first answers a check, or is closed and
        another one taken."""
        # Every connection of the pool may have died together (a partition, a restart): a
        # failed check expires them all, so the next acquire opens a new one.
        for _ in range(2):
            pooled: asyncpg.Connection = await chosen.acquire()
            if not self.usage.quiet(pooled):
                return pooled
            try:
                async with asyncio.timeout(IDLE_CHECK_TIMEOUT):
                    read_only = await pooled.fetchval(_IDLE_CHECK)
            except READ_ONLY:
                await self._met_read_only(pooled)
                await chosen.release(pooled)
                raise
            except (Exception, asyncio.CancelledError) as exc:
                pooled.terminate()
                await chosen.release(pooled)
                if not isinstance(exc, (TimeoutError, *UNAVAILABLE)):
                    raise
                await _expire(chosen)
                continue
            if read_only == "on":
                await self._met_read_only(pooled)
                await chosen.release(pooled)
                raise asyncpg.ReadOnlySQLTransactionError("idle check: session is read-only")
            self.usage.used(pooled)
            return pooled
        # Two dead in a row: let the caller retry as it would after any outage.
        raise TimeoutError("no pooled connection answered its idle check")

    async def _met_read_only(self, pooled: asyncpg.Connection) -> None:
        """A read-only session is never kept: close it, and have every pool replace its
        connections, which are most likely on the same server; the new ones walk the host
        list to a writable one."""
        pooled.terminate()
        await self.expire_all()

    async def expire_all(self) -> None:
        """Have every pool replace every connection it holds: each idle one closed now, each
        busy one when released. For when the connections are likely dead or on the wrong
        server; returns at once."""
        for each in self._pools.values():
            await _expire(each)

    async def fetchrow(
        self, what: str, query: Bound, *, pool: Pool = Pool.MAIN, conn: Connection | None = None
    ) -> Record | None:
        row: Record | None = await self._run(Connection.fetchrow, what, query, pool, conn)
        return row

    async def fetch(
        self, what: str, query: Bound, *, pool: Pool = Pool.MAIN, conn: Connection | None = None
    ) -> list[Record]:
        rows: list[Record] = await self._run(Connection.fetch, what, query, pool, conn)
        return rows

    async def fetchval(
        self, what: str, query: Bound, *, pool: Pool = Pool.MAIN, conn: Connection | None = None
    ) -> Any:
        return await self._run(Connection.fetchval, what, query, pool, conn)

    async def execute(
        self, what: str, query: Bound, *, pool: Pool = Pool.MAIN, conn: Connection | None = None
    ) -> str:
        status: str = await self._run(Connection.execute, what, query, pool, conn)
        return status

    async def _run(
        self,
        method: Callable[..., Awaitable[Any]],
        what: str,
        query: Bound,
        pool: Pool,
        conn: Connection | None,
    ) -> Any:
        async with self.connection(what, pool=pool, conn=conn) as used:
            return await method(used, query.sql, *query.args)

    @property
    def _pools(self) -> Mapping[Pool, asyncpg.Pool]:
        return {
            Pool.MAIN: self.pool,
            Pool.LEASE: self.lease_pool,
            Pool.IDENTITY: self.identity_pool,
            Pool.SOCKETS: self.socket_pool,
        }

    async def close(self) -> None:
        for pool in reversed(list(self._pools.values())):
            await pool.close()

    def terminate(self) -> None:
        for pool in reversed(list(self._pools.values())):
            pool.terminate()


async def _expire(pool: asyncpg.Pool) -> None:
    """``pool.expire_connections()``, with its idle connections closed at once, without a
    goodbye. asyncpg would close each politely at its next acquire, in a task nobody awaits;
    on a connection a partition killed, that close waits out its timeout and ends in an
    unretrieved exception (a traceback in the log). A busy one is replaced when released:
    if it was interrupted, :meth:`Database.connection` has already closed it."""
    await pool.expire_connections()
    for holder in getattr(pool, "_holders", ()):
        con = getattr(holder, "_con", None)
        if con is not None and getattr(holder, "_in_use", None) is None and not con.is_closed():
            con.terminate()


async def _keep_session(conn: asyncpg.Connection) -> None:
    """The pools' reset hook: nothing to undo (see the module docstring)."""


LEASE_POOL_SIZE = 2
IDENTITY_POOL_SIZE = 2
SOCKET_POOL_SIZE = 4


def connections_opened(pool_size: int) -> int:
    """The most connections the daemon's pools open with a main pool of ``pool_size``."""
    return pool_size + LEASE_POOL_SIZE + IDENTITY_POOL_SIZE + SOCKET_POOL_SIZE


async def connect_database(
    dsn: str,
    *,
    pool_size: int = 10,
    lease_pool_size: int = LEASE_POOL_SIZE,
    identity_pool_size: int = IDENTITY_POOL_SIZE,
    socket_pool_size: int = SOCKET_POOL_SIZE,
    connect_timeout: float = 10.0,
    **kwargs: Any,
) -> Database:
    """Open every pool; a server that cannot be reached raises :class:`DatabaseUnavailable`."""
    sizes = {
        Pool.MAIN: pool_size,
        Pool.LEASE: lease_pool_size,
        Pool.IDENTITY: identity_pool_size,
        Pool.SOCKETS: socket_pool_size,
    }
    opened: dict[Pool, asyncpg.Pool] = {}
    usage = SessionUsage()
    options = {**connect_options(dsn), **kwargs}
    with translate_errors(f"connect to {redact_dsn(dsn)}"):
        try:
            for which, size in sizes.items():
                opened[which] = await asyncpg.create_pool(
                    dsn,
                    min_size=1,
                    max_size=size,
                    init=usage.opened,
                    reset=_keep_session,
                    timeout=connect_timeout,
                    server_settings=SESSION_SETTINGS,
                    **options,
                )
        except BaseException as exc:
            for each in opened.values():
                await each.close()
            if len(host_labels(dsn)) > 1 and isinstance(exc, (*UNAVAILABLE, *READ_ONLY)):
                # asyncpg reports the last host's error alone: say what each one answered.
                tried = "; ".join(await try_hosts(dsn, within=connect_timeout))
                raise DatabaseUnavailable(
                    f"connect to {redact_dsn(dsn)}: no writable host ({tried})"
                ) from exc
            raise
    return Database(
        dsn=dsn,
        pool=opened[Pool.MAIN],
        lease_pool=opened[Pool.LEASE],
        identity_pool=opened[Pool.IDENTITY],
        socket_pool=opened[Pool.SOCKETS],
        usage=usage,
    )


async def _try_host(url: str, host: str, within: float) -> str:
    try:
        async with asyncio.timeout(within):
            conn = await asyncpg.connect(single_host_url(url, host), timeout=within)
            try:
                recovery, read_only = await conn.fetchrow(
                    "SELECT pg_catalog.pg_is_in_recovery(), "
                    "current_setting('default_transaction_read_only')"
                )
            finally:
                conn.terminate()
    except TimeoutError:
        return "timed out"
    except ConnectionRefusedError:
        return "refused"
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    except (asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        # The class, never the message: an authentication error may quote the user.
        return type(exc).__name__
    if recovery:
        return "read-only (a standby, in recovery)"
    if read_only == "on":
        return "read-only (default_transaction_read_only)"
    return "writable"


async def try_hosts(url: str, *, within: float = 5.0) -> list[str]:
    """Each host of ``url`` tried on its own, at once: ``"host:port: what it answered"``."""
    hosts = host_labels(url)
    answers = await asyncio.gather(*(_try_host(url, host, within) for host in hosts))
    return [f"{host}: {answer}" for host, answer in zip(hosts, answers, strict=True)]
