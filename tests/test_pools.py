"""Warm pools in the database: a request takes a ready member in its own statement, never one
taken, lost or another's; members no tenant took are hubd's alone; the refill keeps a pool at
its size, at its rate, and releases what no pool has room for (docs/pools.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import asyncpg
import pytest

from hubd.client import Client
from hubd.errors import PoolEmpty
from hubd.store import Database, connect_database
from hubd.store.connections import ConnectionStore
from hubd.store.pools import Pool, PoolStore
from hubd.store.quotas import Quotas, QuotaScope
from tests.apikit import app_role
from tests.polling import eventually

SPEC: dict[str, object] = {"image": "python:3.12", "cpu": 1}
REQUEST = "SELECT * FROM hubd_v1.request($1, $2, spec => $3, idempotency_key => $4)"


@pytest.fixture
def pools(db: Database) -> PoolStore:
    return PoolStore(db, instance_id="test-instance")


async def keep(
    pools: PoolStore,
    size: int,
    *,
    rate: float = 1000.0,
    spec: dict[str, object] = SPEC,
    miss: str = "cold",
    miss_wait: float = 0.0,
) -> None:
    pool = Pool(
        id="warm",
        provisioner="local",
        spec=spec,
        size=size,
        refill_rate=rate,
        miss=miss,
        miss_wait=miss_wait,
    )
    await pools.set_pools([pool], served=["local"])


async def ready_members(db: Database) -> list[str]:
    """Every pending member made ready, as a daemon would once its sidecar connected."""
    rows = await db.pool.fetch(
        "UPDATE hubd_allocations SET status = 'allocated', connection_ready = true, "
        "ready_when = 'connected', next_attempt_at = NULL "
        "WHERE pool_id IS NOT NULL AND taken_at IS NULL AND status = 'pending' RETURNING id"
    )
    return sorted(r["id"] for r in rows)


async def filled(db: Database, pools: PoolStore, size: int, **options: object) -> list[str]:
    await keep(pools, size, **options)  # type: ignore[arg-type]
    made = await pools.refill("warm", most=size)
    assert (made.made, made.lacking) == (size, 0)
    return await ready_members(db)


@contextlib.asynccontextmanager
async def walled(database_url: str, tenant: str | None) -> AsyncIterator[asyncpg.Connection]:
    """A connection of a role holding only hubd_app, walled into ``tenant`` (every tenant with
    ``None``)."""
    async with app_role(database_url) as dsn:
        admin = await asyncpg.connect(database_url)
        name = urlsplit(dsn).username
        try:
            await admin.execute(
                "INSERT INTO hubd_tenant_roles (role_name, tenant_id, every_tenant) "
                "VALUES ($1, $2, $3)",
                name,
                tenant,
                tenant is None,
            )
            conn = await asyncpg.connect(dsn)
            try:
                yield conn
            finally:
                await conn.close()
        finally:
            await admin.execute("DELETE FROM hubd_tenant_roles WHERE role_name = $1", name)
            await admin.close()


async def request(
    conn: asyncpg.Connection, tenant: str | None, key: str | None = None
) -> asyncpg.Record:
    row = await conn.fetchrow(REQUEST, "local", tenant, json.dumps(SPEC), key)
    assert row is not None
    return row


class TestTake:
    async def test_a_request_takes_a_ready_member_and_the_tenant_sees_it_ready_at_once(
        self, db: Database, pools: PoolStore, database_url: str
    ) -> None:
        members = await filled(db, pools, 2)
        async with walled(database_url, "acme") as acme:
            cursor = await acme.fetchval("SELECT hubd_v1.event_cursor()")
            made = await request(acme, None)
            assert made["id"] == members[0]  # the oldest first
            assert (made["tenant"], made["status"], made["ready"], made["warm"]) == (
                "acme", "allocated", True, True,
            )  # fmt: skip
            feed = "SELECT event, warm, ready FROM hubd_v1.events_after($1)"
            # The take's events wait for its announcement (architecture §8).
            assert await acme.fetch(feed, cursor) == []
            announced = await ConnectionStore(db, instance_id="in_a").announce_takes(
                stale_after=0.0
            )
            assert [(a.handover.target.allocation_id, a.owed) for a in announced] == [
                (made["id"], True)
            ]
            events = await acme.fetch(feed, cursor)
            assert [tuple(e) for e in events] == [("requested", True, True), ("ready", True, True)]
        ledger = await db.pool.fetch(
            "SELECT kind FROM hubd_allocation_ledger WHERE allocation_id = $1 ORDER BY seq",
            made["id"],
        )
        assert [r["kind"] for r in ledger][-1] == "take"
        refilled = await pools.refill("warm", most=10)
        assert refilled.made == 1
        stats = (await pools.stats())[0]
        assert (stats.ready, stats.starting, stats.taken, stats.missed) == (1, 1, 1, 0)

    async def test_another_spec_or_ready_when_or_no_ready_member_goes_cold(
        self, db: Database, pools: PoolStore
    ) -> None:
        await filled(db, pools, 1)
        async with db.pool.acquire() as conn:
            other = await conn.fetchrow(REQUEST, "local", None, json.dumps({"cpu": 2}), None)
            declared = await conn.fetchrow(
                "SELECT * FROM hubd_v1.request('local', spec => $1, ready_when => 'declared')",
                json.dumps(SPEC),
            )
            assert other is not None
            assert declared is not None
            assert (other["warm"], declared["warm"]) == (False, False)
            # The member's sidecar was lost: not ready, so not taken.
            await conn.execute(
                "UPDATE hubd_allocations SET connection_ready = false WHERE pool_id = 'warm'"
            )
            lost = await request(conn, None)
            assert (lost["warm"], lost["status"]) == (False, "pending")
        # Another spec matches no pool; another ready_when matches it and finds no member.
        stats = (await pools.stats())[0]
        assert (stats.taken, stats.missed) == (0, 2)

    async def test_concurrent_requests_on_many_connections_never_share_a_member(
        self, db: Database, pools: PoolStore, database_url: str
    ) -> None:
        members = set(await filled(db, pools, 10))
        # Two pools of connections, as two replicas or applications would hold.
        async with (
            asyncpg.create_pool(database_url, min_size=16, max_size=16) as one,
            asyncpg.create_pool(database_url, min_size=16, max_size=16) as two,
        ):
            start = asyncio.Event()

            async def ask(via: asyncpg.Pool, n: int) -> asyncpg.Record:
                async with via.acquire() as conn:
                    await start.wait()
                    return await request(conn, f"tenant-{n % 4}")

            tasks = [asyncio.ensure_future(ask(one if n % 2 else two, n)) for n in range(32)]
            start.set()
            made = await asyncio.gather(*tasks)
        warm = [r for r in made if r["warm"]]
        assert len({r["id"] for r in made}) == 32
        assert {r["id"] for r in warm} == members
        taken = await db.pool.fetch(
            "SELECT id, tenant_id FROM hubd_allocations WHERE pool_id = 'warm'"
        )
        assert {r["id"]: r["tenant_id"] for r in taken} == {r["id"]: r["tenant"] for r in warm}

    async def test_requests_racing_with_one_key_get_one_allocation(
        self, db: Database, pools: PoolStore, database_url: str
    ) -> None:
        await filled(db, pools, 4)
        async with asyncpg.create_pool(database_url, min_size=8, max_size=8) as many:
            start = asyncio.Event()

            async def ask() -> asyncpg.Record:
                async with many.acquire() as conn:
                    await start.wait()
                    return await request(conn, "acme", "order-1")

            tasks = [asyncio.ensure_future(ask()) for _ in range(8)]
            start.set()
            made = await asyncio.gather(*tasks)
        assert len({r["id"] for r in made}) == 1
        assert made[0]["warm"] is True
        assert (await pools.stats())[0].ready == 3

    async def test_a_member_another_transaction_is_losing_is_skipped_not_waited_for(
        self, db: Database, pools: PoolStore
    ) -> None:
        """A daemon marking a member's sidecar lost holds its row: a request meanwhile goes
        cold at once rather than wait, and never takes the member it would find lost."""
        [member] = await filled(db, pools, 1)
        async with db.pool.acquire() as daemon, db.pool.acquire() as app:
            losing = daemon.transaction()
            await losing.start()
            await daemon.execute(
                "UPDATE hubd_allocations SET connection_ready = false WHERE id = $1", member
            )
            during = await asyncio.wait_for(request(app, "acme"), 30)
            await losing.commit()
            after = await request(app, "acme")
        assert (during["warm"], after["warm"]) == (False, False)
        taken = await db.pool.fetchval(
            "SELECT taken_at FROM hubd_allocations WHERE id = $1", member
        )
        assert taken is None

    async def test_a_take_rolled_back_leaves_the_member_in_the_pool(
        self, db: Database, pools: PoolStore
    ) -> None:
        [member] = await filled(db, pools, 1)
        async with db.pool.acquire() as conn:
            transaction = conn.transaction()
            await transaction.start()
            assert (await request(conn, "acme"))["id"] == member
            await transaction.rollback()
            again = await request(conn, "globex")
        assert (again["id"], again["tenant"]) == (member, "globex")


class TestWall:
    async def test_a_member_no_tenant_took_is_no_applications(
        self, db: Database, pools: PoolStore, database_url: str
    ) -> None:
        [member] = await filled(db, pools, 1)
        async with walled(database_url, None) as every:
            assert (
                await every.fetchval(
                    "SELECT count(*) FROM hubd_v1.allocations WHERE id = $1", member
                )
                == 0
            )
            assert await every.fetchval("SELECT count(*) FROM hubd_v1.events_after(0)") == 0
            for call in (
                "SELECT hubd_v1.release($1)",
                "SELECT hubd_v1.touch($1)",
                "SELECT hubd_v1.extend($1, interval '1 hour')",
            ):
                with pytest.raises(asyncpg.NoDataFoundError):
                    await every.execute(call, member)
        status = await db.pool.fetchval("SELECT status FROM hubd_allocations WHERE id = $1", member)
        assert status == "allocated"

    async def test_a_take_held_open_stalls_no_one_and_the_pools_are_out_of_reach(
        self, db: Database, pools: PoolStore, database_url: str
    ) -> None:
        members = await filled(db, pools, 2)
        counter = await db.pool.fetchval("SELECT counter_id FROM hubd_pools")
        async with walled(database_url, "acme") as acme, walled(database_url, "globex") as globex:
            holding = acme.transaction()
            await holding.start()
            held = await request(acme, None, "order-1")
            # Another tenant, keyed or not, waits on nothing acme holds: it takes the other
            # member, then goes cold (the deadline only says "not stalled").
            other = await asyncio.wait_for(request(globex, None, "order-1"), 30)
            cold = await asyncio.wait_for(request(globex, None), 30)
            assert (held["warm"], other["warm"], cold["warm"]) == (True, True, False)
            assert {held["id"], other["id"]} == set(members)
            for attack in (
                "SELECT * FROM hubd_pools FOR UPDATE",
                "LOCK TABLE hubd_pools",
                f"SELECT nextval('hubd_pool_taken_{counter}')",
                "SELECT hubd_take_member('warm', 'globex', NULL, NULL, NULL, NULL, NULL, NULL)",
                "SELECT * FROM hubd_refill_pool('warm', 1, NULL)",
                "SELECT hubd_release_orphaned_members(NULL)",
            ):
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    async with globex.transaction():
                        await globex.execute(attack)
            await holding.rollback()
        # Rolled back, acme's member is the pool's again.
        assert (await pools.stats())[0].ready == 1

    async def test_counters_shadowed_in_the_temporary_schema_leave_the_count_with_hubd(
        self, db: Database, pools: PoolStore, database_url: str
    ) -> None:
        await filled(db, pools, 1)
        counter = await db.pool.fetchval("SELECT counter_id FROM hubd_pools")
        async with walled(database_url, "acme") as acme:
            for kind in ("taken", "missed"):
                await acme.execute(f"CREATE TEMPORARY SEQUENCE hubd_pool_{kind}_{counter}")
            assert (await request(acme, None))["warm"] is True
            assert (await request(acme, None))["warm"] is False
            shadows = await acme.fetch(
                "SELECT sequencename, last_value FROM pg_sequences "
                "WHERE sequencename LIKE 'hubd\\_pool\\_%' AND schemaname LIKE 'pg\\_temp%'"
            )
        assert sorted((r["sequencename"], r["last_value"]) for r in shadows) == [
            (f"hubd_pool_missed_{counter}", None),
            (f"hubd_pool_taken_{counter}", None),
        ]
        stats = (await pools.stats())[0]
        assert (stats.taken, stats.missed) == (1, 1)

    async def test_members_count_against_no_quota_of_requests_with_no_tenant(
        self, db: Database, pools: PoolStore
    ) -> None:
        await filled(db, pools, 3, spec={"other": True})
        await Quotas(db).set(QuotaScope.untenanted(), max_active=1)
        async with db.pool.acquire() as conn:
            first = await request(conn, None)
            assert first["warm"] is False
            with pytest.raises(asyncpg.PostgresError, match="max_active"):
                await request(conn, None)
        usage = {u.scope.key: u.active for u in await Quotas(db).usage()}
        assert usage["untenanted"] == 1


class TestRefill:
    async def test_the_refill_keeps_the_size_at_the_pools_rate(
        self, db: Database, pools: PoolStore
    ) -> None:
        await keep(pools, 5, rate=2.0)
        first = await pools.refill("warm", most=100)
        # A second's worth at most: two members, three still lacking.
        assert (first.made, first.lacking) == (2, 3)
        again = await pools.refill("warm", most=100)
        assert again.made == 0

    async def test_replicas_refilling_at_once_never_make_more_than_the_size(
        self, db: Database, pools: PoolStore, database_url: str
    ) -> None:
        await keep(pools, 7)
        replica = await connect_database(database_url, pool_size=8)
        try:
            other = PoolStore(replica, instance_id="other-instance")
            start = asyncio.Event()

            async def refill(store: PoolStore) -> int:
                await start.wait()
                return (await store.refill("warm", most=3)).made

            tasks = [asyncio.ensure_future(refill(pools if n % 2 else other)) for n in range(16)]
            start.set()
            made = await asyncio.gather(*tasks)
            # Whoever held the pool's lock made what it lacked, at most 3 a turn; the others
            # skipped their turn, and the next turns made the rest.
            while (await pools.refill("warm", most=3)).made:
                pass
        finally:
            await replica.close()
        members = await db.pool.fetchval(
            "SELECT count(*) FROM hubd_allocations WHERE pool_id = 'warm' AND taken_at IS NULL"
        )
        assert members == 7
        assert sum(made) <= 7

    async def test_a_shrunk_changed_or_removed_pool_releases_its_surplus(
        self, db: Database, pools: PoolStore
    ) -> None:
        await filled(db, pools, 4)
        await keep(pools, 2)
        shrunk = await pools.refill("warm", most=100)
        assert (shrunk.made, shrunk.released) == (0, 2)
        await keep(pools, 2, spec={"image": "python:3.13"})
        changed = await pools.refill("warm", most=100)
        assert (changed.made, changed.released) == (2, 2)
        await pools.set_pools([], served=["local"])
        assert await pools.release_orphaned() == 2
        rows = await db.pool.fetch(
            "SELECT status, end_reason FROM hubd_allocations WHERE pool_id = 'warm'"
        )
        assert {(r["status"], r["end_reason"]) for r in rows} <= {
            ("releasing", "pool"),
            ("released", "pool"),
        }
        assert len(rows) == 6


class TestMiss:
    async def test_a_pool_that_refuses_a_miss_says_when_to_retry(
        self, db: Database, pools: PoolStore
    ) -> None:
        await keep(pools, 1, miss="refuse")
        await pools.refill("warm", most=1)  # a member on its way, none ready
        async with db.pool.acquire() as conn:
            with pytest.raises(asyncpg.PostgresError, match="retry in 1 s") as refused:
                await request(conn, "acme")
        assert refused.value.sqlstate == "HU503"
        assert (await pools.stats())[0].missed == 1
        assert await db.pool.fetchval("SELECT count(*) FROM hubd_allocations") == 1

    async def test_the_client_raises_pool_empty_and_returns_warm_allocations(
        self, db: Database, pools: PoolStore, database_url: str
    ) -> None:
        [member] = await filled(db, pools, 1, miss="refuse")
        client = await Client.connect(database_url)
        try:
            taken = await client.request("local", tenant="acme", spec=SPEC)
            assert (taken.id, taken.warm, taken.ready) == (member, True, True)
            with pytest.raises(PoolEmpty) as refused:
                await client.request("local", tenant="acme", spec=SPEC)
        finally:
            await client.close()
        assert refused.value.retry_after == 1.0

    async def test_a_pool_that_waits_takes_the_member_made_ready_meanwhile(
        self, db: Database, pools: PoolStore, database_url: str
    ) -> None:
        await keep(pools, 1, miss="wait", miss_wait=30.0)
        await pools.refill("warm", most=1)
        other = await asyncpg.connect(database_url)
        try:
            asking = asyncio.ensure_future(request(other, "acme"))

            async def waiting() -> bool:
                # The request's backend sleeps between its looks at the pool.
                return bool(
                    await db.pool.fetchval(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE wait_event = 'PgSleep' AND query LIKE '%hubd_v1.request%'"
                    )
                )

            await eventually(waiting, within=30, every=0.05)
            [member] = await ready_members(db)
            made = await asyncio.wait_for(asking, 30)
        finally:
            await other.close()
        assert (made["id"], made["warm"], made["ready"]) == (member, True, True)
        stats = (await pools.stats())[0]
        assert (stats.taken, stats.missed) == (1, 0)

    async def test_a_wait_that_runs_out_goes_cold(self, db: Database, pools: PoolStore) -> None:
        await keep(pools, 1, miss="wait", miss_wait=0.2)
        await pools.refill("warm", most=1)
        async with db.pool.acquire() as conn:
            made = await request(conn, "acme")
        assert (made["warm"], made["status"]) == (False, "pending")
        assert (await pools.stats())[0].missed == 1
