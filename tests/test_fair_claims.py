"""A claim shares the due work among the tenants that have some (hubd_due_allocations): a burst
of one tenant does not queue another's request behind it, nor hold every claim slot while
another tenant is in sight (Reconciler.rooms, [reconciler] max_claims_per_tenant)."""

from __future__ import annotations

import asyncio

import asyncpg
import attrs
import pytest

from hubd.claimrules import DEFAULT_CLAIMS
from hubd.routing import MemoryRouter
from hubd.store import AllocationStore, Database
from tests.polling import scaled
from tests.reconcilerkit import SETTINGS, Gate, ScriptedProvisioner, make_reconciler


async def request(store: AllocationStore, tenant: str | None, count: int = 1) -> list[str]:
    return [(await store.request(provisioner_id="p", tenant_id=tenant)).id for _ in range(count)]


async def due(conn: asyncpg.Connection, wanted: int, exclude: list[str] | None = None) -> list[str]:
    rows = await conn.fetch(
        "SELECT id FROM hubd_due_allocations($1::text[], $2)", exclude or [], wanted
    )
    return [row["id"] for row in rows]


class TestSharing:
    async def test_a_burst_does_not_queue_another_tenant_behind_it(
        self, db: Database, store: AllocationStore
    ) -> None:
        """Tenant a asked for 200 before b and c asked for one each: the first claim of four
        takes a's oldest, b's and c's, then a's next; each tenant's rows in their own order."""
        burst = await request(store, "a", 200)
        (late_b,) = await request(store, "b")
        (late_c,) = await request(store, "c")
        async with db.pool.acquire() as conn, conn.transaction():
            taken = await due(conn, 4)
        assert taken == [burst[0], late_b, late_c, burst[1]]

    async def test_requests_with_no_tenant_are_a_tenant_too(
        self, db: Database, store: AllocationStore
    ) -> None:
        burst = await request(store, None, 50)
        (late,) = await request(store, "b")
        async with db.pool.acquire() as conn, conn.transaction():
            assert await due(conn, 2) == [burst[0], late]

    async def test_one_tenant_is_served_in_due_order(
        self, db: Database, store: AllocationStore
    ) -> None:
        made = await request(store, "a", 10)
        async with db.pool.acquire() as conn, conn.transaction():
            assert await due(conn, 10) == made

    async def test_excluded_leased_and_future_rows_are_left(
        self, db: Database, store: AllocationStore
    ) -> None:
        made = await request(store, "a", 4)
        await db.pool.execute(
            "UPDATE hubd_allocations SET lease_id = 'ls_x', "
            "lease_expires_at = now() + interval '1 minute' WHERE id = $1",
            made[1],
        )
        await db.pool.execute(
            "UPDATE hubd_allocations SET next_attempt_at = now() + interval '1 minute' "
            "WHERE id = $1",
            made[2],
        )
        async with db.pool.acquire() as conn, conn.transaction():
            assert await due(conn, 4, exclude=[made[0]]) == [made[3]]

    async def test_concurrent_claimers_take_different_rows(
        self, db: Database, store: AllocationStore
    ) -> None:
        """Two claim statements at once (two replicas): each locks its own rows, none twice,
        and between them they take the oldest eight."""
        made = await request(store, "a", 12)
        async with (
            db.pool.acquire() as first,
            db.pool.acquire() as second,
            first.transaction(),
            second.transaction(),
        ):
            one = await due(first, 4)
            two = await due(second, 4)
        assert len(one) == len(two) == 4
        assert not set(one) & set(two)
        assert sorted(one + two) == sorted(made[:8])


class TestBound:
    async def test_a_tenant_at_its_bound_leaves_the_slots_to_the_others(
        self, db: Database, store: AllocationStore
    ) -> None:
        """A tenant takes no more than its room: a with none left takes nothing and b gets the
        slots; with room for one, a takes one, and b (not listed) the default room of three."""
        burst = await request(store, "a", 20)
        late = await request(store, "b", 2)
        async with db.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                "SELECT id FROM hubd_due_allocations($1::text[], $2, $3, $4, $5)",
                [],
                4,
                3,
                ["a"],
                [0],
            )
            assert [row["id"] for row in rows] == late
        async with db.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                "SELECT id FROM hubd_due_allocations($1::text[], $2, $3, $4, $5)",
                [],
                4,
                3,
                ["a"],
                [1],
            )
            assert [row["id"] for row in rows] == [burst[0], late[0], late[1]]

    @pytest.mark.parametrize(
        ("claims", "per_tenant", "room"),
        [(4, 0, 2), (4, 1, 1), (DEFAULT_CLAIMS, 0, 4), (DEFAULT_CLAIMS, 8, 8)],
    )
    async def test_a_burst_leaves_the_other_slots_to_another_tenant(
        self, db: Database, store: AllocationStore, claims: int, per_tenant: int, room: int
    ) -> None:
        """While another tenant is in sight, a's burst claims its room of the slots and no
        more, however many of its rows are due (half by default and 4 at most, or the
        operator's max_claims_per_tenant): b's request, made while those claims still run, is
        claimed at once instead of waiting for one of them to end."""
        provisioner = ScriptedProvisioner("p")
        settings = attrs.evolve(
            SETTINGS, max_concurrent_claims=claims, max_claims_per_tenant=per_tenant
        )
        reconciler = make_reconciler(db, MemoryRouter(), provisioner, settings=settings)
        await request(store, "b")
        assert await reconciler.claim_batch() == 1
        await asyncio.wait_for(reconciler.wait_claims(), scaled(10))
        release = asyncio.Event()
        provisioner.ensure_script.extend(Gate(release=release) for _ in range(room + 1))
        await request(store, "a", 20)
        assert await reconciler.claim_batch() == room
        assert reconciler.holding_back
        (late,) = await request(store, "b")
        try:
            assert await reconciler.claim_batch() == 1
            leased = await db.pool.fetch(
                "SELECT tenant_id, count(*) AS n FROM hubd_allocations "
                "WHERE lease_expires_at > now() GROUP BY tenant_id ORDER BY tenant_id"
            )
            assert [(row["tenant_id"], row["n"]) for row in leased] == [("a", room), ("b", 1)]
            assert (await store.get(late)).lease_id is not None
        finally:
            release.set()
            await asyncio.wait_for(reconciler.wait_claims(), scaled(10))

    async def test_one_tenant_may_take_every_slot(
        self, db: Database, store: AllocationStore
    ) -> None:
        """With one tenant in sight nothing is held back: a burst fills all four slots."""
        provisioner = ScriptedProvisioner("p")
        reconciler = make_reconciler(db, MemoryRouter(), provisioner)
        release = asyncio.Event()
        provisioner.ensure_script.extend(Gate(release=release) for _ in range(4))
        await request(store, "a", 20)
        try:
            assert await reconciler.claim_batch() == 4
            assert not reconciler.holding_back
        finally:
            release.set()
            await asyncio.wait_for(reconciler.wait_claims(), scaled(10))
