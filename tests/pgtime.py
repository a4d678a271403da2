"""Moving database time for a row: the store reads the database clock, so a test that needs a
deadline or a lease to pass shifts the row's timestamps into the past instead of sleeping."""

from __future__ import annotations

from hubd.store import Database


async def age_row(db: Database, allocation_id: str, seconds: float) -> None:
    """Make ``seconds`` pass for one active allocation's schedule, lease and connect deadline.

    Terminal rows keep their timestamps: nothing about them depends on time any more."""
    async with db.pool.acquire() as conn:
        await conn.execute(
            """
            UPDATE hubd_allocations SET
                next_attempt_at = next_attempt_at - make_interval(secs => $2),
                lease_expires_at = lease_expires_at - make_interval(secs => $2),
                connect_deadline = connect_deadline - make_interval(secs => $2)
            WHERE id = $1
              AND status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing')
            """,
            allocation_id,
            float(seconds),
        )


async def expire_lease(db: Database, allocation_id: str) -> None:
    """Let the allocation's lease run out now, as if its holder stopped renewing."""
    async with db.pool.acquire() as conn:
        await conn.execute(
            """
            UPDATE hubd_allocations SET lease_expires_at = now() - interval '1 millisecond'
            WHERE id = $1 AND lease_id IS NOT NULL
            """,
            allocation_id,
        )
