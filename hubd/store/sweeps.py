"""The statements orphan collection runs on ``hubd_allocations``: who owns a sidecar a
provisioner reports, and the cluster-wide lock one sweeper holds. Part of
:class:`~hubd.store.allocations.AllocationStore`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

import asyncpg

from hubd.store.database import Database
from hubd.store.queries import load_queries

__all__ = ["SweepQueries"]

SQL = load_queries("allocations.sql")


class SweepQueries:
    _db: Database

    async def sidecar_owners(
        self, sidecars: Sequence[tuple[str, str | None]]
    ) -> dict[str, tuple[bool, bool]]:
        """For each (sidecar id, allocation id it names): (current sidecar of an active
        allocation, allocation known here)."""
        rows = await self._db.fetch(
            "look up sidecar owners",
            SQL.sidecar_owners(
                sidecar_ids=[sidecar for sidecar, _ in sidecars],
                allocation_ids=[allocation or "" for _, allocation in sidecars],
            ),
        )
        return {row["sidecar_id"]: (row["current"], row["known"]) for row in rows}

    @contextlib.asynccontextmanager
    async def sweep_lock(self, name: str) -> AsyncIterator[asyncpg.Connection | None]:
        """Hold the cluster-wide sweep lock ``name`` for the block: yields the connection that
        holds it (closed means lost), or ``None`` when another replica holds it. The lock is
        ``name``'s row in ``hubd_sweep_locks``, locked by a transaction that lasts the block."""
        what = "orphan sweep lock"
        async with self._db.connection(what) as conn:
            await self._db.execute(what, SQL.add_sweep_lock(lock_name=name), conn=conn)
            transaction = conn.transaction()
            await transaction.start()
            try:
                held = await self._db.fetchval(what, SQL.try_sweep_lock(lock_name=name), conn=conn)
                if held is None:
                    await transaction.rollback()
                    yield None
                    return
                yield conn
            finally:
                if not conn.is_closed() and conn.is_in_transaction():
                    try:
                        await transaction.rollback()
                    except BaseException:
                        # Pooled connections are not reset on release: one that may still hold
                        # the lock must not go back to the pool. Closing it releases the lock.
                        conn.terminate()
                        raise
