"""Allocations by status and by tenant, and quota refusals, for metrics, at a cost that does
not grow with finished rows nor with the number of tenants' labels exported."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import asyncpg
import attrs

from hubd.store.database import Database
from hubd.store.pools import PoolStats, pool_stats, untaken_members
from hubd.store.queries import load_queries
from hubd.store.rows import Status

__all__ = ["LIMITS", "MetricCounts", "TenantCount", "metric_counts", "status_counts"]

SQL = load_queries("counts.sql")

UNTENANTED: Final = "untenanted"
LIMITS: Final = ("max_active", "max_pending", "rate")
"""The limits a refusal names (its ``DETAIL`` ``limit=``), each counted on its own."""


@attrs.frozen(kw_only=True)
class TenantCount:
    """One key of the per-tenant metrics: ``tenant:<id>`` (a tenant with a quota row of its own,
    or one of the most active others), ``untenanted``, ``other`` (every tenant not named) or
    ``default`` (the default quota's refusals)."""

    key: str
    active: int | None
    """Allocations not yet ended; ``None`` for ``default``, which has no gauge."""
    pending: int | None
    refusals: Mapping[str, int] | None
    """Refusals by limit (:data:`LIMITS`) since the key's quota row was made; ``None``: no
    quota row of its own."""


@attrs.frozen(kw_only=True)
class MetricCounts:
    statuses: dict[Status, int]
    tenants: tuple[TenantCount, ...]
    pools: tuple[PoolStats, ...] = ()


async def status_counts(db: Database) -> dict[Status, int]:
    """Active statuses counted exactly; terminal ones estimated from the planner's statistics
    (zero before the table's first ANALYZE)."""
    # One transaction for both: every replica runs this every poll interval, and it is one
    # of the few commits an idle daemon makes.
    async with db.connection("count allocations") as conn, conn.transaction():
        return await _status_counts(db, conn)


async def metric_counts(db: Database, *, tenant_labels: int) -> MetricCounts:
    """:func:`status_counts`, and the per-tenant counts with at most ``tenant_labels`` tenants
    named beside those with a quota row of their own."""
    # One snapshot for all three statements: allocations with no tenant are the active ones
    # less the tenants', which spares the count a pass over the active rows' heap (no index
    # holds their tenant but the tenants' own).
    async with (
        db.connection("count allocations") as conn,
        conn.transaction(isolation="repeatable_read", readonly=True),
    ):
        statuses = await _status_counts(db, conn)
        rows = await db.fetch("count tenants", SQL.tenant_counts(labels=tenant_labels), conn=conn)
        # Members no tenant took are hubd's: not the untenanted requests' allocations.
        members, members_pending = await untaken_members(db, conn)
        pools = await pool_stats(db, conn)
    tenants = [_tenant_count(row) for row in rows]
    untenanted = [t for t in tenants if t.key == UNTENANTED]
    rest = [t for t in tenants if t.key != UNTENANTED]
    active = sum(n for status, n in statuses.items() if not status.terminal)
    pending = statuses[Status.PENDING]
    rest.append(
        TenantCount(
            key=UNTENANTED,
            active=active - members - sum(t.active or 0 for t in rest),
            pending=pending - members_pending - sum(t.pending or 0 for t in rest),
            refusals=untenanted[0].refusals if untenanted else None,
        )
    )
    return MetricCounts(statuses=statuses, tenants=tuple(rest), pools=tuple(pools))


async def _status_counts(db: Database, conn: asyncpg.Connection) -> dict[Status, int]:
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


def _tenant_count(row: Mapping[str, Any]) -> TenantCount:
    refused = row["refused_rate"] is not None
    return TenantCount(
        key=row["tenant_key"],
        active=row["active"],
        pending=row["pending"],
        refusals={limit: int(row[f"refused_{limit}"]) for limit in LIMITS} if refused else None,
    )
