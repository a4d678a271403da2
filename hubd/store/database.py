"""Connections to PostgreSQL and the translation of driver errors into hubd's own.

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
SET, no cursors; the one advisory lock is released, or its connection closed, by its holder), so
a connection goes back to its pool without asyncpg's reset query: that saves a round trip on
every release. An open transaction is still rolled back by asyncpg itself.

Every connection has a bound on silence (docs/operations.md):

- a **read-only session is never kept**: every pool connects with
  ``target_session_attrs=read-write`` unless the URL names another value, so a connect walks
  the URL's host list to a writable server; a statement that meets a read-only server
  (SQLSTATE 25006: a standby, a server whose ``default_transaction_read_only`` was turned on
  under open sessions) closes its connection and expires every pool, which then reconnect
  through the host list;
- **TCP keepalives and ``TCP_USER_TIMEOUT``** on every TCP socket, on both ends;
- a **statement interrupted** by its budget (``command_timeout``, or any ``asyncio.timeout``
  around the block) closes its connection once its cancel request was heard, or after
  :data:`CANCEL_GRACE`: asyncpg would otherwise hold the pool's release until the server
  acknowledges the CancelRequest it sends over a new connection, which a partitioned network
  never does;
- a connection **idle for** :data:`QUIET_PERIOD` is checked with one short statement before it
  is handed out; a busy connection never is, so the hot paths keep one round trip per
  statement.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import socket
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import asyncpg
import attrs
from asyncpg import Connection, Record

from hubd.dburl import connect_options, host_labels
from hubd.errors import (
    API_SQLSTATES,
    AllocationNotFound,
    DatabaseReadOnly,
    DatabaseUnavailable,
    InvalidRequest,
    SchemaMissing,
    StoreError,
)
from hubd.redaction import redact_dsn
from hubd.store.hosts import try_hosts
from hubd.store.queries import Bound

__all__ = [
    "Database",
    "Pool",
    "connect_database",
    "connections_opened",
    "init_connection",
    "is_unavailable",
    "translate_errors",
]

# Errors that mean "the database cannot answer right now", not "the answer is no".
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.TooManyConnectionsError,
    asyncpg.InterfaceError,
    # The driver lost track of the protocol: seen when the server's shutdown message reaches
    # an idle pooled connection just before its next query.
    asyncpg.InternalClientError,
)

# Errors that mean "this server takes no writes": a standby, or a server set read-only. The
# second is asyncpg's answer when no host of the URL is writable.
_READ_ONLY: tuple[type[BaseException], ...] = (
    asyncpg.ReadOnlySQLTransactionError,
    asyncpg.TargetServerAttributeNotMatched,
)

# Errors after which a connection's protocol state cannot be trusted: it is closed rather than
# returned to its pool, since no reset query on release would notice (see _keep_session).
_BROKEN: tuple[type[BaseException], ...] = (
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    asyncpg.PostgresConnectionError,
)


# A statement's end that leaves the connection in doubt (see Database.connection).
_INTERRUPTED: tuple[type[BaseException], ...] = (*_BROKEN, TimeoutError, asyncio.CancelledError)


class _QuietReconnects(logging.Filter):
    """asyncpg's pool logs a full traceback each time it fails to restore its connection floor,
    which it does many times during any database restart. An outage is an expected condition,
    reported by hubd's own warnings: keep asyncpg's record, without the traceback, as a warning
    that names the error in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            if isinstance(error, (*_UNAVAILABLE, *_READ_ONLY)):
                record.msg = f"{record.getMessage()}: {type(error).__name__}: {error}"
                record.args = ()
                record.exc_info = None
                record.exc_text = None
                record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


logging.getLogger("asyncpg.pool").addFilter(_QuietReconnects())


def is_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` (a driver's error) means the database cannot answer right now."""
    return isinstance(exc, _UNAVAILABLE)


@contextmanager
def translate_errors(what: str) -> Iterator[None]:
    """Turn driver errors raised inside the block into :class:`StoreError` subclasses."""
    try:
        yield
    except StoreError:
        raise
    except asyncpg.UndefinedTableError as exc:
        # hubd's tables are missing altogether: a database nobody migrated (or the wrong one).
        raise SchemaMissing() from exc
    except asyncpg.ForeignKeyViolationError as exc:
        raise AllocationNotFound(f"{what}: no such allocation") from exc
    except (asyncpg.CheckViolationError, asyncpg.DataError, asyncpg.NotNullViolationError) as exc:
        api_error = API_SQLSTATES.get(getattr(exc, "sqlstate", "") or "")
        if api_error is not None:
            raise api_error(f"{what}: {exc}") from exc
        raise InvalidRequest(f"{what}: rejected by the schema ({exc.__class__.__name__})") from exc
    except _READ_ONLY as exc:
        raise DatabaseReadOnly(f"{what}: database read-only ({exc.__class__.__name__})") from exc
    except _UNAVAILABLE as exc:
        raise DatabaseUnavailable(
            f"{what}: database unavailable ({exc.__class__.__name__})"
        ) from exc
    except asyncpg.PostgresError as exc:
        # The application API's own refusals (hubd_v1, docs/api.md) carry their reason.
        api_error = API_SQLSTATES.get(getattr(exc, "sqlstate", "") or "")
        if api_error is not None:
            raise api_error(f"{what}: {exc}") from exc
        raise StoreError(f"{what}: {exc.__class__.__name__}: {exc}") from exc


async def init_connection(conn: asyncpg.Connection) -> None:
    """Per-connection setup: keepalives on its socket; JSON columns round-trip as Python
    objects."""
    bound_silence(conn)
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


# A TCP peer that vanished (a host that died, a NAT or firewall that lost the connection's
# state) is found by the kernel: an idle connection after KEEPIDLE + KEEPCNT * KEEPINTVL
# seconds, one with unacknowledged data after USER_TIMEOUT. PostgreSQL's own end gets the same
# settings (SESSION_SETTINGS), so the server ends a dead hubd session and its locks too.
TCP_KEEPIDLE = 10
TCP_KEEPINTVL = 5
TCP_KEEPCNT = 3
TCP_USER_TIMEOUT_MS = 25_000


def bound_silence(conn: asyncpg.Connection) -> None:
    """Turn on keepalives and ``TCP_USER_TIMEOUT`` on ``conn``'s socket (TCP only: a Unix
    socket has no silent peer). asyncpg takes no socket options, so they are set on the
    connected socket, which it exposes only through its transport."""
    transport = getattr(conn, "_transport", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", TCP_KEEPIDLE),
        ("TCP_KEEPINTVL", TCP_KEEPINTVL),
        ("TCP_KEEPCNT", TCP_KEEPCNT),
        ("TCP_USER_TIMEOUT", TCP_USER_TIMEOUT_MS),
    ):
        option = getattr(socket, name, None)
        if option is not None:  # Linux has them all; other platforms some
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


CANCEL_GRACE = 1.0
"""Seconds an interrupted statement's cancel request may take to reach the server before its
connection is closed anyway (on a partitioned network it never arrives)."""


async def _cancel_briefly(pooled: asyncpg.Connection) -> None:
    """Wait up to :data:`CANCEL_GRACE` for the cancel requests asyncpg sent for ``pooled``
    (each over a connection of its own) to be delivered."""
    sending = set(getattr(_raw(pooled), "_cancellations", ()))
    if sending:
        await asyncio.wait(sending, timeout=CANCEL_GRACE)


QUIET_PERIOD = 10.0
"""Seconds a pooled connection may sit unused before it is checked before its next use."""
IDLE_CHECK_TIMEOUT = 2.0
"""How long the check of an idle connection may take before the connection counts as dead."""

# One statement: a standby reads ``on`` (recovery forces it), as does a server whose
# default_transaction_read_only was turned on after the connection was made.
_IDLE_CHECK = "SELECT current_setting('transaction_read_only')"


class _Usage:
    """When each pooled connection was last handed back (or opened), to tell the quiet ones."""

    def __init__(self) -> None:
        self._last: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()

    async def opened(self, conn: asyncpg.Connection) -> None:
        """The pools' ``init`` hook: a session that starts read-only is refused here too (with
        ``target_session_attrs=any`` asyncpg would take it), from the settings the server
        reports at startup, so at no cost of a round trip."""
        settings = conn.get_settings()
        for name in ("default_transaction_read_only", "in_hot_standby"):
            if getattr(settings, name, "off") == "on":
                raise asyncpg.ReadOnlySQLTransactionError(f"session opened with {name} on")
        await init_connection(conn)
        self._last[conn] = time.monotonic()

    def used(self, pooled: asyncpg.Connection) -> None:
        raw = _raw(pooled)
        if raw is not None:
            self._last[raw] = time.monotonic()

    def quiet(self, pooled: asyncpg.Connection) -> bool:
        raw = _raw(pooled)
        last = self._last.get(raw) if raw is not None else None
        return last is None or time.monotonic() - last >= QUIET_PERIOD


def _raw(pooled: asyncpg.Connection) -> Any:
    # A pool hands out a proxy made anew on each acquire; the connection behind it is the
    # one thing that lives as long as the session (asyncpg names it nowhere public).
    return getattr(pooled, "_con", pooled)


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
    :func:`translate_errors` on a connection of ``pool``, or on ``conn`` when given, so that a
    write joins the caller's transaction.
    """

    dsn: str = attrs.field(repr=redact_dsn)
    pool: asyncpg.Pool
    lease_pool: asyncpg.Pool
    identity_pool: asyncpg.Pool
    socket_pool: asyncpg.Pool
    usage: _Usage = attrs.field(factory=_Usage, repr=False)

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
            except _READ_ONLY:
                await self._met_read_only(pooled)
                raise
            except _INTERRUPTED:
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
        """A connection of ``chosen``; one that sat unused for :data:`QUIET_PERIOD` first
        answers a check, or is closed and another one taken."""
        # Every connection of the pool may have died together (a partition, a restart): a
        # failed check expires them all, so the next acquire opens a new one.
        for _ in range(2):
            pooled: asyncpg.Connection = await chosen.acquire()
            if not self.usage.quiet(pooled):
                return pooled
            try:
                async with asyncio.timeout(IDLE_CHECK_TIMEOUT):
                    read_only = await pooled.fetchval(_IDLE_CHECK)
            except _READ_ONLY:
                await self._met_read_only(pooled)
                await chosen.release(pooled)
                raise
            except (Exception, asyncio.CancelledError) as exc:
                pooled.terminate()
                await chosen.release(pooled)
                if not isinstance(exc, (TimeoutError, *_UNAVAILABLE)):
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


# Every statement hubd runs is a prepared, parameterised one that finds its rows by key or by a
# partial index; PostgreSQL's default would plan most of them afresh on every execution (a custom
# plan is never costed above the generic one for these), and planning cost more than running.
# A generic plan is made per connection from the statistics of that moment, and kept as long as
# asyncpg caches the statement (five minutes). After a quiet spell the statistics say there are
# almost no active rows, and a burst of them then met sequential scans of the connection
# records, the reconnect secrets and the allocations themselves (identity look-ups, the park's
# look at the record): the CPU of a whole lifecycle run varied by 60% with when each connection
# planned. With sequential scans off, each of those statements takes its index; a statement no
# index serves still scans (docs/performance.md, "Plans that do not depend on the statistics").
SESSION_SETTINGS = {
    "plan_cache_mode": "force_generic_plan",
    "enable_seqscan": "off",
    # The server's end of the keepalives (see bound_silence); ignored on Unix sockets.
    "tcp_keepalives_idle": str(TCP_KEEPIDLE),
    "tcp_keepalives_interval": str(TCP_KEEPINTVL),
    "tcp_keepalives_count": str(TCP_KEEPCNT),
    "tcp_user_timeout": str(TCP_USER_TIMEOUT_MS),
}


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
    usage = _Usage()
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
            if len(host_labels(dsn)) > 1 and isinstance(exc, (*_UNAVAILABLE, *_READ_ONLY)):
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
