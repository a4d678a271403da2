"""Lease keepers and the batched renewer on virtual time, renewing against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

import asyncpg
import pytest

from hubd.errors import LeaseLost
from hubd.reconciler.clock import ManualClock
from hubd.reconciler.lease import LeaseKeeper, LeaseRenewer
from hubd.store import AllocationStore, Database
from tests.reconcilerkit import poll_until
from tests.storekit import claim_next, new_lease

LEASE = 30.0
T = TypeVar("T")


class Leases:
    """Real claims' keepers and one renewer, on a manual clock, with every request counted."""

    def __init__(self, store: AllocationStore) -> None:
        self.clock = ManualClock()
        self.lost: dict[str, list[LeaseLost]] = {}
        self.renewals: list[asyncio.Task[Any]] = []
        self.batches: list[list[tuple[str, str]]] = []
        self.tasks: list[asyncio.Task[Any]] = []
        self.keepers: list[LeaseKeeper] = []

        async def renew_many(leases: list[tuple[str, str]]) -> frozenset[str]:
            self.batches.append(leases)
            return await store.renew_leases(leases, LEASE)

        def spawn(coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
            task = asyncio.ensure_future(coro)
            (self.renewals if name == "lease renewal" else self.tasks).append(task)
            return task

        self.renewer = LeaseRenewer(
            renew_many=renew_many, clock=self.clock, lease_duration=LEASE, spawn=spawn
        )

    def keep(self, allocation_id: str, lease_id: str) -> LeaseKeeper:
        lost = self.lost.setdefault(allocation_id, [])
        keeper = LeaseKeeper(
            allocation_id=allocation_id,
            lease_id=lease_id,
            clock=self.clock,
            lease_duration=LEASE,
            started=self.clock.monotonic(),
            on_lost=lost.append,
        )
        keeper.watch()
        self.keepers.append(keeper)
        self.renewer.register(keeper)
        return keeper

    async def sleeping(self, count: int) -> None:
        """Wait until ``count`` deadline watches and tasks are parked on the manual clock."""
        await poll_until(lambda: _is(self.clock.sleepers == count))

    def stop(self) -> None:
        for keeper in self.keepers:
            keeper.stop()
        for task in self.tasks:
            task.cancel()


async def _is(value: bool) -> bool:
    return value


async def expiry(db: Database, allocation_id: str) -> float:
    async with db.pool.acquire() as conn:
        value = await conn.fetchval(
            "SELECT extract(epoch FROM lease_expires_at) FROM hubd_allocations WHERE id = $1",
            allocation_id,
        )
    return float(value)


async def claim(store: AllocationStore) -> tuple[str, str]:
    allocation = await store.request(provisioner_id="fake")
    lease = new_lease()
    assert await claim_next(store, lease_id=lease, lease_duration=LEASE) is not None
    return allocation.id, lease


class TestLeaseRenewal:
    async def test_one_statement_renews_every_lease_each_third(
        self, store: AllocationStore, db: Database
    ) -> None:
        """After a third of the lease one request renews every registered lease in the
        database, and each keeper moves its local deadline to that request's start plus the
        lease duration."""
        claims = [await claim(store) for _ in range(3)]
        before = {aid: await expiry(db, aid) for aid, _ in claims}
        leases = Leases(store)
        keepers = [leases.keep(aid, lease) for aid, lease in claims]
        await leases.sleeping(4)  # three deadline watches and the renewer
        assert leases.batches == []
        leases.clock.advance(LEASE / 3)
        await poll_until(lambda: _is(len(leases.renewals) == 1 and leases.renewals[0].done()))
        await leases.sleeping(4)
        assert sorted(leases.batches[0]) == sorted(claims)
        for keeper in keepers:
            assert keeper.deadline == 1000 + LEASE / 3 + LEASE
            assert await expiry(db, keeper.allocation_id) > before[keeper.allocation_id]
        assert not any(leases.lost.values())
        leases.stop()

    async def test_refused_renewal_loses_only_that_lease(
        self, store: AllocationStore, db: Database
    ) -> None:
        """A lease the database no longer grants (someone else holds the row) is lost; the
        others in the same round are renewed."""
        (kept, kept_lease), (taken, taken_lease) = [await claim(store) for _ in range(2)]
        leases = Leases(store)
        keeper = leases.keep(kept, kept_lease)
        leases.keep(taken, taken_lease)
        await leases.sleeping(3)
        async with db.pool.acquire() as conn:
            await conn.execute(
                "UPDATE hubd_allocations SET lease_id = 'ls_thief' WHERE id = $1", taken
            )
        leases.clock.advance(LEASE / 3)
        await poll_until(lambda: _is(bool(leases.lost[taken])))
        assert [str(e) for e in leases.lost[taken]] == ["lease renewal was refused"]
        assert leases.lost[kept] == []
        assert keeper.deadline == 1000 + LEASE / 3 + LEASE
        leases.stop()

    async def test_deadline_watch_follows_renewals(self, store: AllocationStore) -> None:
        """The deadline watch is a timer set for the deadline it saw: when it goes off after a
        renewal moved the deadline, it watches the new one instead of losing the lease."""
        allocation_id, lease = await claim(store)
        leases = Leases(store)
        keeper = leases.keep(allocation_id, lease)
        await leases.sleeping(2)  # the deadline watch and the renewer
        leases.clock.advance(LEASE / 3)
        await poll_until(lambda: _is(len(leases.renewals) == 1 and leases.renewals[0].done()))
        assert keeper.deadline == 1000 + LEASE / 3 + LEASE
        # Past the first deadline: the watch goes off, finds the lease renewed, and re-arms.
        leases.renewer.unregister(keeper)
        leases.clock.advance(LEASE * 2 / 3 + 1)
        await leases.sleeping(1)
        assert leases.lost[allocation_id] == []
        leases.clock.advance(LEASE / 3)
        await poll_until(lambda: _is(bool(leases.lost[allocation_id])))
        assert [str(e) for e in leases.lost[allocation_id]] == ["the local lease deadline passed"]
        await leases.sleeping(0)
        leases.stop()

    async def test_unanswered_renewal_loses_at_the_local_deadline(
        self, store: AllocationStore, database_url: str
    ) -> None:
        """A renewal that hangs (its row locked by another transaction) is given up when the
        local deadline passes, even though the database never answered."""
        allocation_id, lease = await claim(store)
        leases = Leases(store)
        leases.keep(allocation_id, lease)
        await leases.sleeping(2)
        blocker = await asyncpg.connect(database_url)
        try:
            tx = blocker.transaction()
            await tx.start()
            await blocker.execute(
                "SELECT 1 FROM hubd_allocations WHERE id = $1 FOR UPDATE", allocation_id
            )
            leases.clock.advance(LEASE / 3)
            await poll_until(lambda: _is(len(leases.renewals) == 1))
            # The deadline watch, and the renewer waiting on the request until the deadline.
            await leases.sleeping(2)
            assert not leases.renewals[0].done()
            leases.clock.advance(LEASE)
            await poll_until(lambda: _is(bool(leases.lost[allocation_id])))
            assert [str(e) for e in leases.lost[allocation_id]] == [
                "lease renewal did not answer before the local deadline"
            ]
            await tx.rollback()
        finally:
            await blocker.close()
        with pytest.raises(asyncio.CancelledError):
            await leases.renewals[0]
        leases.stop()

    async def test_idle_renewer_sends_nothing(self, store: AllocationStore) -> None:
        """With no lease registered the renewer runs no loop and sends no request; the loop
        stops as soon as the last lease is given up."""
        leases = Leases(store)
        leases.clock.advance(LEASE)
        assert leases.batches == []
        assert leases.tasks == []
        allocation_id, lease = await claim(store)
        keeper = leases.keep(allocation_id, lease)
        await leases.sleeping(2)
        leases.renewer.unregister(keeper)
        leases.stop()
        await leases.sleeping(0)
        leases.clock.advance(LEASE)
        assert leases.batches == []


class TestStoppedKeeper:
    @pytest.mark.usefixtures("collector_off")
    def test_a_stopped_keeper_reports_nothing_and_lets_its_claim_go(self) -> None:
        """A keeper stopped when its claim ends drops its loss callback: a loss reported late
        (a renewal answering after the claim ended) reaches nobody, and the claim, which the
        callback refers to and which refers to the keeper, is freed as its last reference
        goes, not when the garbage collector next runs."""

        class Claim:
            def __init__(self) -> None:
                self.lost: list[LeaseLost] = []
                # As the reconciler's: the keeper's callback reaches the claim that holds it.
                self.keeper = LeaseKeeper(
                    allocation_id="al_1",
                    lease_id="ls_1",
                    clock=ManualClock(),
                    lease_duration=LEASE,
                    started=0.0,
                    on_lost=self.report,
                )

            def report(self, cause: LeaseLost) -> None:
                self.lost.append(cause)

        claim = Claim()
        reports = claim.lost
        keeper = claim.keeper
        ended = weakref.ref(claim)
        keeper.stop()
        keeper.lose("the renewal answered late")
        del claim
        assert ended() is None
        assert reports == []
