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
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import asyncpg
import attrs
from asyncpg import Connection, Record

from hubd.errors import (
    API_SQLSTATES,
    AllocationNotFound,
    DatabaseUnavailable,
    InvalidRequest,
    SchemaMissing,
    StoreError,
)
from hubd.redaction import redact_dsn
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

# Errors after which a connection's protocol state cannot be trusted: it is closed rather than
# returned to its pool, since no reset query on release would notice (see _keep_session).
_BROKEN: tuple[type[BaseException], ...] = (
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    asyncpg.PostgresConnectionError,
)


class _QuietReconnects(logging.Filter):
    """asyncpg's pool logs a full traceback each time it fails to restore its connection floor,
    which it does many times during any database restart. An outage is an expected condition,
    reported by hubd's own warnings: keep asyncpg's record, without the traceback, as a warning
    that names the error in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            if isinstance(error, _UNAVAILABLE):
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
    """Per-connection setup: JSON columns round-trip as Python objects."""
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


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
            async with self._pools[pool].acquire() as pooled:
                try:
                    yield pooled
                except _BROKEN:
                    pooled.terminate()
                    raise

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
SESSION_SETTINGS = {"plan_cache_mode": "force_generic_plan", "enable_seqscan": "off"}


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
    with translate_errors(f"connect to {redact_dsn(dsn)}"):
        try:
            for which, size in sizes.items():
                opened[which] = await asyncpg.create_pool(
                    dsn,
                    min_size=1,
                    max_size=size,
                    init=init_connection,
                    reset=_keep_session,
                    timeout=connect_timeout,
                    server_settings=SESSION_SETTINGS,
                    **kwargs,
                )
        except BaseException:
            for each in opened.values():
                await each.close()
            raise
    return Database(
        dsn=dsn,
        pool=opened[Pool.MAIN],
        lease_pool=opened[Pool.LEASE],
        identity_pool=opened[Pool.IDENTITY],
        socket_pool=opened[Pool.SOCKETS],
    )
