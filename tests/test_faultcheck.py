"""The fault checker itself: each kind of violation, planted by hand in a real database, is
caught; a history that breaks nothing reports nothing."""

from __future__ import annotations

import asyncpg

from hubd.reconciler.writes import MarkReleased
from hubd.store import AllocationStore, Database, LedgerStore, Status
from tests.faultkit import broken, install_observer, violations
from tests.storekit import drive_to


async def run(dsn: str, *statements: tuple[str, tuple[object, ...]]) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for sql, args in statements:
            await conn.execute(sql, *args)
    finally:
        await conn.close()


class TestChecker:
    async def test_an_honest_history_breaks_nothing(
        self, database_url: str, store: AllocationStore, db: Database
    ) -> None:
        """Claims, fenced transitions, a release and a terminal write leave no violation."""
        await install_observer(database_url)
        fence = await drive_to(store, db, Status.RELEASING)
        assert await store.write(fence, MarkReleased().transition()) is not None
        await drive_to(store, db, Status.REPLACING)
        assert broken(await violations(database_url)) == {}

    async def test_planted_violations_are_caught(
        self, database_url: str, store: AllocationStore, ledger: LedgerStore, db: Database
    ) -> None:
        """A generation that goes back, a lease that comes back after another, a ledger row
        written under an expired lease and a terminal row that changes are each reported."""
        await install_observer(database_url)
        regress = await drive_to(store, db, Status.REPLACING)
        interleave = await drive_to(store, db, Status.ALLOCATED)
        stale = await drive_to(store, db, Status.ALLOCATED)
        final = await drive_to(store, db, Status.RELEASING)
        assert await store.write(final, MarkReleased().transition()) is not None
        update = "UPDATE hubd_allocations SET {} WHERE id = $1"
        await run(
            database_url,
            (update.format("generation = generation - 1"), (regress.allocation_id,)),
            (
                update.format("lease_id = $2, lease_expires_at = now() + interval '1 minute'"),
                (interleave.allocation_id, "ls_other"),
            ),
            (
                update.format("lease_id = $2, lease_expires_at = now() + interval '1 minute'"),
                (interleave.allocation_id, interleave.lease_id),
            ),
            (
                update.format("lease_expires_at = now() - interval '1 second'"),
                (stale.allocation_id,),
            ),
            (
                "INSERT INTO hubd_allocation_ledger (allocation_id, generation, lease_id, kind, "
                "phase) VALUES ($1, 1, $2, 'planted', 'committed')",
                (stale.allocation_id, stale.lease_id),
            ),
            (update.format("failure_message = 'changed'"), (final.allocation_id,)),
        )
        found = broken(await violations(database_url))
        assert set(found) == {
            "generation_regressions",
            "interleaved_leases",
            "stale_lease_writes",
            "terminal_rows_changed",
        }
        assert regress.allocation_id in found["generation_regressions"][0]
        assert interleave.allocation_id in found["interleaved_leases"][0]
        assert [stale.allocation_id in line for line in found["stale_lease_writes"]] == [True]
        assert final.allocation_id in found["terminal_rows_changed"][0]
        del ledger
