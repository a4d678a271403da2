"""What the client makes of a failure: a fault of the connection, or the database's answer,
raised to the application as :mod:`hubd.errors` name it (:func:`translated`); a follower reads
again on a new connection after a fault.

A follower (:mod:`hubd.client.follow`) must not die of a connection fault, whatever form the
driver gives it: the backend terminated (``AdminShutdownError`` mid-statement,
``ConnectionDoesNotExistError`` when idle), the server shutting down or restarting, a statement
cancelled from outside (``QueryCanceledError``), the driver's own protocol state left behind by
one of these (``InternalClientError: cannot switch to state …``), a socket error, a timeout.
Each of them ends the connection and the follower reads on a new one, from its cursor. Only what
no new connection would change is raised: the application API's refusals (an expired cursor,
an unknown allocation), a role without the privileges or a database without the schema.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Final

import asyncpg

from hubd.errors import API_SQLSTATES, DatabaseUnavailable, HubdError, StoreError

__all__ = ["CAUGHT", "ClientClosed", "is_fault", "refusal", "translated"]


class ClientClosed(HubdError):
    """The client was closed (or the pool it wraps), so its followers end."""


# Errors that are not the database's answer but the connection's (or the driver's) trouble.
_DRIVER_FAULTS: Final[tuple[type[BaseException], ...]] = (
    OSError,
    EOFError,
    TimeoutError,
    asyncpg.InterfaceError,  # the connection is closed, or was released under us
    asyncpg.InternalClientError,  # the driver's protocol state no longer matches the server's
)

CAUGHT: Final[tuple[type[BaseException], ...]] = (asyncpg.PostgresError, *_DRIVER_FAULTS)
"""Every failure :func:`is_fault` judges; anything else is a bug, and propagates."""

# SQLSTATE classes whose answer a new connection would not change: a role that may not run
# hubd_v1 (42501), a database with no hubd_v1 (3F000, 42883), a login refused (28xxx), a
# database that does not exist (3D000). Every other error is taken for a fault: 08 (connection
# exception), 57 (operator intervention: a terminated backend, a cancelled statement, a
# shutdown), 53 (too many connections), 25P03 (idle in transaction), XX (internal).
_FINAL_CLASSES: Final = frozenset({"42", "3F", "28", "3D"})


def is_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is a fault of the connection, after which the follower reads again on a
    new one (rather than an answer to raise)."""
    if isinstance(exc, asyncpg.PostgresError):
        sqlstate = exc.sqlstate or ""
        return sqlstate not in API_SQLSTATES and sqlstate[:2] not in _FINAL_CLASSES
    return isinstance(exc, _DRIVER_FAULTS)


def refusal(exc: BaseException, what: str) -> StoreError:
    """The error to raise for the database's answer ``exc`` (one :func:`is_fault` refuses)."""
    sqlstate = getattr(exc, "sqlstate", None)
    mapped = API_SQLSTATES.get(sqlstate or "")
    if mapped is not None:
        return mapped(f"{what}: {exc}")
    if sqlstate == "42501":
        return StoreError(f"{what}: {exc} (the role needs hubd_app: GRANT hubd_app TO <role>)")
    if sqlstate == "3F000":
        return StoreError(f"{what}: no hubd_v1 schema here: is this hubd's database, migrated?")
    return StoreError(f"{what}: {exc.__class__.__name__}: {exc}")


@contextlib.contextmanager
def translated(what: str) -> Iterator[None]:
    """Raise what ``what`` failed with as :mod:`hubd.errors` say: a connection's trouble as
    :class:`~hubd.errors.DatabaseUnavailable`, the database's answer as :func:`refusal` maps it."""
    try:
        yield
    except (OSError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError) as exc:
        # Before PostgresError, of which a connection lost mid-statement is one.
        raise DatabaseUnavailable(
            f"{what}: database unavailable ({exc.__class__.__name__})"
        ) from exc
    except asyncpg.PostgresError as exc:
        raise refusal(exc, what) from exc
