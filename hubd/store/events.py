"""EventStore: the daemon's side of the application event feed (``hubd_events``).

Applications read the feed through ``hubd_v1.events_after`` (docs/api.md, ``hubd.client``);
events are written by a trigger at the commit of each change. The daemon keeps the feed to its
retention, a batch per repair sweep, so one sweep after a long outage never deletes millions of
rows in one transaction.

Every commit that writes an event takes the feed's lock (``hubd_feed_lock``) and holds it to its
end, which is what makes positions commit order. A transaction that takes it early (an
application's ``SET CONSTRAINTS ALL IMMEDIATE`` after a request) and then idles holds every other
commit that changes an allocation: the daemon watches the lock in ``pg_locks``
(:meth:`EventStore.feed_lock`) and may end such a holder
(:meth:`EventStore.terminate_feed_lock_holder`, docs/operations.md). Both run on the lease pool,
whose statements never change an allocation and so never wait for the lock they watch.
"""

from __future__ import annotations

import enum
from typing import Final

import asyncpg
import attrs

from hubd.errors import StoreError
from hubd.store.database import Database, Pool
from hubd.store.queries import load_queries

__all__ = ["PRUNE_BATCH", "EventStore", "FeedLock", "FeedLockHolder", "Outcome", "Termination"]

SQL = load_queries("events.sql")

PRUNE_BATCH: Final = 10_000
"""Events deleted by one statement at most."""


@attrs.frozen(kw_only=True)
class FeedLockHolder:
    """The transaction that holds the feed's lock."""

    pid: int | None
    """Its backend; ``None`` for a prepared transaction, which no backend runs."""
    role: str | None
    """Its backend's login role (``pg_stat_activity.usename``)."""
    state: str | None
    """Its backend's state (``idle in transaction``…), where this role may read it."""
    own_role: bool
    """Whether its role is the daemon's own (``current_user``): never ended by the daemon."""


@attrs.frozen(kw_only=True)
class FeedLock:
    """The feed's lock as ``pg_locks`` showed it at one instant."""

    waiters: int
    """Transactions waiting for it."""
    longest_wait: float
    """Seconds the first of them has waited (database clock); 0 with none."""
    holder: FeedLockHolder | None
    """Who holds it; ``None`` when nobody does."""
    own_role: str
    """The role it was read as: the daemon's."""


class Outcome(enum.Enum):
    """What became of a holder the daemon tried to end."""

    TERMINATED = "terminated"
    """The backend was signalled; its transaction rolls back and lets the lock go."""
    GONE = "gone"
    """It no longer held the lock (or was of the daemon's role): nothing was done."""
    REFUSED = "refused"
    """The server refused: the daemon's role may not signal that backend."""


@attrs.frozen
class Termination:
    """What :meth:`EventStore.terminate_feed_lock_holder` did."""

    outcome: Outcome
    refusal: str | None = None
    """The server's reason, when it refused."""


class EventStore:
    """The statements on ``hubd_events`` and its lock that the daemon runs."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def prune(self, keep: float, *, batch: int = PRUNE_BATCH) -> int:
        """Delete up to ``batch`` events older than ``keep`` seconds; returns how many went."""
        pruned = await self._db.fetchval(
            "prune events", SQL.prune(keep=float(keep), batch=int(batch))
        )
        return int(pruned or 0)

    async def feed_lock(self) -> FeedLock:
        """Who holds the feed's lock and how long commits have waited for it."""
        row = await self._db.fetchrow("read the feed lock", SQL.feed_lock(), pool=Pool.LEASE)
        assert row is not None  # one row always: the holder is joined to a constant
        holder = (
            FeedLockHolder(
                pid=row["holder_pid"],
                role=row["holder_role"],
                state=row["holder_state"],
                own_role=bool(row["holder_own_role"]),
            )
            if row["held"]
            else None
        )
        return FeedLock(
            waiters=int(row["waiters"]),
            longest_wait=float(row["longest_wait"]),
            holder=holder,
            own_role=row["own_role"],
        )

    async def terminate_feed_lock_holder(
        self, pid: int, *, waited: float | None = None
    ) -> Termination:
        """End backend ``pid`` if it still holds the feed's lock, is not of the daemon's role
        and, with ``waited``, a commit has waited that many seconds for the lock by the
        database's clock at that moment."""
        try:
            signalled = await self._db.fetchval(
                "terminate the feed lock's holder",
                SQL.terminate_feed_lock_holder(
                    pid=int(pid), waited=None if waited is None else float(waited)
                ),
                pool=Pool.LEASE,
            )
        except StoreError as exc:
            if isinstance(exc.__cause__, asyncpg.InsufficientPrivilegeError):
                return Termination(Outcome.REFUSED, str(exc.__cause__))
            raise
        return Termination(Outcome.TERMINATED if signalled else Outcome.GONE)
