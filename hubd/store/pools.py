"""Warm pools: allocations made before anyone asks, ready for a request to take.

A row of ``hubd_pools`` (migration 0029) keeps ``size`` members of one provisioner and spec:
ordinary allocations that no tenant owns yet. A request with that provisioner and spec takes
a ready member in its own statement (``hubd_request_allocation``); the daemons serving the
provisioner write the pools from their configuration and make new members in place of those
taken, lost or ended (docs/pools.md). Here they are written, refilled and read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import asyncpg
import attrs

from hubd.store.database import Database
from hubd.store.queries import load_queries

__all__ = ["Pool", "PoolStats", "PoolStore", "Refilled", "pool_stats", "untaken_members"]

SQL = load_queries("pools.sql")


@attrs.frozen(kw_only=True)
class Pool:
    """One pool as the configuration sets it."""

    id: str
    provisioner: str
    spec: dict[str, object] = attrs.field(factory=dict, hash=False)
    size: int
    refill_rate: float
    """At most this many members made a second, by all daemons together."""
    miss: str = "cold"
    """What a request does when no member is ready: ``cold``, ``wait`` or ``refuse``."""
    miss_wait: float = 0.0
    """With ``wait``: how long it looks for a member before it goes cold (seconds)."""


@attrs.frozen(kw_only=True)
class Refilled:
    made: int
    released: int
    lacking: int
    """Members the pool still lacks after this turn (its refill rate held them back, or
    another daemon held the pool)."""


@attrs.frozen(kw_only=True)
class PoolStats:
    """A pool's size, its members not taken, and its takes and misses so far."""

    id: str
    provisioner: str
    size: int
    refill_rate: float
    ready: int
    starting: int
    taken: int
    missed: int


class PoolStore:
    def __init__(self, db: Database, *, instance_id: str) -> None:
        self._db = db
        self._instance_id = instance_id

    async def set_pools(self, pools: Sequence[Pool], *, served: Sequence[str]) -> None:
        """Write this daemon's pools; a pool of a provisioner in ``served`` that ``pools`` no
        longer names is removed (its members go at the next :meth:`release_orphaned`)."""
        await self._db.execute(
            "set pools",
            SQL.set_pools(
                pool_ids=[p.id for p in pools],
                provisioner_ids=[p.provisioner for p in pools],
                specs=[json.dumps(p.spec) for p in pools],
                sizes=[p.size for p in pools],
                refill_rates=[p.refill_rate for p in pools],
                misses=[p.miss for p in pools],
                miss_waits=[p.miss_wait for p in pools],
                served=list(served),
            ),
        )

    async def refill(self, pool_id: str, *, most: int) -> Refilled:
        """Make up to ``most`` members the pool lacks and release its surplus; nothing when
        another daemon is refilling it at this moment."""
        row = await self._db.fetchrow(
            "refill pool",
            SQL.refill(pool_id=pool_id, most=most, instance_id=self._instance_id),
        )
        assert row is not None
        return Refilled(made=row["made"], released=row["released"], lacking=row["lacking"])

    async def release_orphaned(self) -> int:
        """Release the members of pools no longer configured; how many."""
        released: int = await self._db.fetchval(
            "release orphaned members",
            SQL.release_orphaned_members(instance_id=self._instance_id),
        )
        return released

    async def stats(self) -> list[PoolStats]:
        return await pool_stats(self._db)


async def pool_stats(db: Database, conn: asyncpg.Connection | None = None) -> list[PoolStats]:
    """Every pool's size, members and counters, on ``conn`` when given."""
    rows = await db.fetch("pool stats", SQL.pool_stats(), conn=conn)
    return [
        PoolStats(
            id=row["pool_id"],
            provisioner=row["provisioner_id"],
            size=row["size"],
            refill_rate=row["refill_rate"],
            ready=row["ready"],
            starting=row["starting"],
            taken=row["taken"],
            missed=row["missed"],
        )
        for row in rows
    ]


async def untaken_members(db: Database, conn: asyncpg.Connection | None = None) -> tuple[int, int]:
    """Members no tenant took and not yet ended: how many, and how many of them pending."""
    row = await db.fetchrow("count pool members", SQL.untaken_members(), conn=conn)
    assert row is not None
    return row["active"], row["pending"]
