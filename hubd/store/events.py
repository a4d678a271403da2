"""EventStore: the daemon's side of the application event feed (``hubd_events``).

Applications read the feed through ``hubd_v1.events_after`` (docs/api.md, ``hubd.client``);
events are written by a trigger at the commit of each change. The daemon keeps the feed to its
retention, a batch per repair sweep, so one sweep after a long outage never deletes millions of
rows in one transaction.
"""

from __future__ import annotations

from typing import Final

from hubd.store.database import Database
from hubd.store.queries import load_queries

__all__ = ["PRUNE_BATCH", "EventStore"]

SQL = load_queries("events.sql")

PRUNE_BATCH: Final = 10_000
"""Events deleted by one statement at most."""


class EventStore:
    """The statements on ``hubd_events`` the daemon runs."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def prune(self, keep: float, *, batch: int = PRUNE_BATCH) -> int:
        """Delete up to ``batch`` events older than ``keep`` seconds; returns how many went."""
        pruned = await self._db.fetchval(
            "prune events", SQL.prune(keep=float(keep), batch=int(batch))
        )
        return int(pruned or 0)
