"""The lease keeper on virtual time, renewing against a real PostgreSQL."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from hubd.errors import LeaseLost
from hubd.reconciler.clock import ManualClock
from hubd.reconciler.lease import LeaseKeeper
from hubd.store import AllocationStore, Database
from tests.reconcilerkit import poll_until
from tests.storekit import new_lease

LEASE = 30.0


class Keeper:
    """A keeper for a real claim, on a manual clock, with its renewals tracked."""

    def __init__(self, store: AllocationStore, allocation_id: str, lease_id: str) -> None:
        self.clock = ManualClock()
        self.lost: list[LeaseLost] = []
        self.renewals: list[asyncio.Task[bool]] = []

        def spawn(coro: object) -> asyncio.Task[bool]:
            task: asyncio.Task[bool] = asyncio.ensure_future(coro)  # type: ignore[arg-type]
            self.renewals.append(task)
            return task

        self.keeper = LeaseKeeper(
            renew=lambda: store.renew_lease(allocation_id, lease_id, LEASE),
            clock=self.clock,
            lease_duration=LEASE,
            started=self.clock.monotonic(),
            spawn=spawn,
            on_lost=self.lost.append,
        )

    async def sleeping(self, count: int = 1) -> None:
        """Wait until the keeper is parked on the manual clock."""
        await poll_until(lambda: _is(self.clock.sleepers == count))


async def _is(value: bool) -> bool:
    return value


async def expiry(db: Database, allocation_id: str) -> float:
    async with db.pool.acquire() as conn:
        value = await conn.fetchval(
            "SELECT extract(epoch FROM lease_expires_at) FROM hubd_allocations WHERE id = $1",
            allocation_id,
        )
    return float(value)


@pytest.fixture
async def claimed(store: AllocationStore) -> tuple[str, str]:
    allocation = await store.request(provisioner_id="fake")
    lease = new_lease()
    assert await store.claim_next(lease_id=lease, lease_duration=LEASE) is not None
    return allocation.id, lease


class TestLeaseKeeper:
    async def test_renews_every_third_and_moves_the_deadline(
        self, store: AllocationStore, db: Database, claimed: tuple[str, str]
    ) -> None:
        """After a third of the lease the keeper renews in the database and moves its local
        deadline to the renewal's start plus the lease duration."""
        allocation_id, lease = claimed
        k = Keeper(store, allocation_id, lease)
        before = await expiry(db, allocation_id)
        run = asyncio.create_task(k.keeper.run())
        await k.sleeping()
        assert k.renewals == []
        k.clock.advance(LEASE / 3)
        await poll_until(lambda: _is(len(k.renewals) == 1 and k.renewals[0].done()))
        await k.sleeping()
        assert k.keeper.deadline == 1000 + LEASE / 3 + LEASE
        assert await expiry(db, allocation_id) > before
        assert not k.lost
        run.cancel()

    async def test_refused_renewal_is_lost(
        self, store: AllocationStore, db: Database, claimed: tuple[str, str]
    ) -> None:
        """A renewal the database refuses (someone else holds the row) loses the lease."""
        allocation_id, lease = claimed
        k = Keeper(store, allocation_id, lease)
        run = asyncio.create_task(k.keeper.run())
        await k.sleeping()
        async with db.pool.acquire() as conn:
            await conn.execute(
                "UPDATE hubd_allocations SET lease_id = 'ls_thief' WHERE id = $1", allocation_id
            )
        k.clock.advance(LEASE / 3)
        await run
        assert [str(e) for e in k.lost] == ["lease renewal was refused"]

    async def test_unanswered_renewal_loses_at_the_local_deadline(
        self, store: AllocationStore, db: Database, database_url: str, claimed: tuple[str, str]
    ) -> None:
        """A renewal that hangs (its row locked by another transaction) is given up when the
        local deadline passes, even though the database never answered."""
        allocation_id, lease = claimed
        k = Keeper(store, allocation_id, lease)
        run = asyncio.create_task(k.keeper.run())
        await k.sleeping()
        blocker = await asyncpg.connect(database_url)
        try:
            tx = blocker.transaction()
            await tx.start()
            await blocker.execute(
                "SELECT 1 FROM hubd_allocations WHERE id = $1 FOR UPDATE", allocation_id
            )
            k.clock.advance(LEASE / 3)
            await poll_until(lambda: _is(len(k.renewals) == 1))
            await k.sleeping()  # waiting on the renewal with the deadline as its limit
            assert not k.renewals[0].done()
            k.clock.advance(LEASE)
            await run
            assert [str(e) for e in k.lost] == [
                "lease renewal did not answer before the local deadline"
            ]
            await tx.rollback()
        finally:
            await blocker.close()
        with pytest.raises(asyncio.CancelledError):
            await k.renewals[0]
