"""What the driver's errors mean to hubd, and their translation into hubd's own.

Driver errors are translated at the store's boundary only (:func:`translate_errors`): above the
store, a failure is a :class:`~hubd.errors.StoreError`, and :class:`DatabaseUnavailable` means
"the database cannot answer right now", never "the answer is no". The classes of errors below
also decide what becomes of the connection a statement failed on
(:meth:`hubd.store.database.Database.connection`), and which of the pool's own log records are an
outage's, told in one line (:func:`hubd.logs.configure_logging`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

import asyncpg

from hubd.errors import (
    API_SQLSTATES,
    AllocationNotFound,
    DatabaseReadOnly,
    DatabaseUnavailable,
    InvalidRequest,
    SchemaMissing,
    StoreError,
)

__all__ = [
    "BROKEN",
    "INTERRUPTED",
    "READ_ONLY",
    "UNAVAILABLE",
    "is_unavailable",
    "translate_errors",
]

# Errors that mean "the database cannot answer right now", not "the answer is no".
UNAVAILABLE: Final[tuple[type[BaseException], ...]] = (
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
READ_ONLY: Final[tuple[type[BaseException], ...]] = (
    asyncpg.ReadOnlySQLTransactionError,
    asyncpg.TargetServerAttributeNotMatched,
)

# Errors after which a connection's protocol state cannot be trusted: it is closed rather than
# returned to its pool, since no reset query on release would notice (the pools run none).
BROKEN: Final[tuple[type[BaseException], ...]] = (
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    asyncpg.PostgresConnectionError,
)


# A statement's end that leaves the connection in doubt: it is closed, once its cancel request
# had its chance to reach the server.
INTERRUPTED: Final[tuple[type[BaseException], ...]] = (
    *BROKEN,
    TimeoutError,
    asyncio.CancelledError,
)


def is_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` (a driver's error) means the database cannot answer right now."""
    return isinstance(exc, UNAVAILABLE)


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
    except READ_ONLY as exc:
        raise DatabaseReadOnly(f"{what}: database read-only ({exc.__class__.__name__})") from exc
    except UNAVAILABLE as exc:
        raise DatabaseUnavailable(
            f"{what}: database unavailable ({exc.__class__.__name__})"
        ) from exc
    except asyncpg.PostgresError as exc:
        # The application API's own refusals (hubd_v1, docs/api.md) carry their reason.
        api_error = API_SQLSTATES.get(getattr(exc, "sqlstate", "") or "")
        if api_error is not None:
            raise api_error(f"{what}: {exc}") from exc
        raise StoreError(f"{what}: {exc.__class__.__name__}: {exc}") from exc
