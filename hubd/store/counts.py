"""Allocations by status for metrics, at a cost that does not grow with finished rows."""

from __future__ import annotations

from hubd.store.database import Database
from hubd.store.models import Status
from hubd.store.queries import load_queries

__all__ = ["status_counts"]

SQL = load_queries("counts.sql")


async def status_counts(db: Database) -> dict[Status, int]:
    """Active statuses counted exactly; terminal ones estimated from the planner's statistics
    (zero before the table's first ANALYZE)."""
    # One transaction for both: every replica runs this every poll interval, and it is one
    # of the few commits an idle daemon makes.
    async with db.connection("count allocations") as conn, conn.transaction():
        estimated = await db.fetch("count allocations", SQL.estimate_statuses(), conn=conn)
        active = await db.fetch("count allocations", SQL.count_active(), conn=conn)
    counts = dict.fromkeys(Status, 0)
    for row in estimated:
        if row["status"] in Status.__members__.values():
            status = Status(row["status"])
            if status.terminal:
                counts[status] = int(row["n"])
    for row in active:
        counts[Status(row["status"])] = int(row["n"])
    return counts
