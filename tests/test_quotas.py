"""Tenant quotas, decided in the request's own statement: no race admits past a limit, an
idempotent repeat is never refused, and a refusal says which limit and when to retry."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from hubd.errors import InvalidRequest, QuotaExceeded
from hubd.store import AllocationStore, Database, connect_database
from hubd.store.quotas import Quotas, QuotaScope
from tests.apikit import app_role
from tests.clikit import run_hubd_async


@pytest.fixture
def quotas(db: Database) -> Quotas:
    return Quotas(db)


@pytest.fixture
async def second_replica(database_url: str) -> AsyncIterator[AllocationStore]:
    """Another process's pools on the same database, as a second replica (or an application
    server) has them."""
    db = await connect_database(database_url, pool_size=8)
    try:
        yield AllocationStore(db, instance_id="in_second")
    finally:
        await db.close()


async def request_or_refusal(store: AllocationStore, tenant: str | None) -> str:
    try:
        await store.request(provisioner_id="p", tenant_id=tenant)
    except QuotaExceeded as exc:
        return f"refused: {exc}"
    return "admitted"


class TestLimits:
    async def test_max_active_is_never_passed_by_concurrent_requests(
        self, store: AllocationStore, second_replica: AllocationStore, quotas: Quotas
    ) -> None:
        """64 requests of one tenant at once, half through each of two replicas' pools, against
        max_active 10: exactly 10 are admitted; the others fail naming the limit."""
        await quotas.set(QuotaScope.tenant("acme"), max_active=10)
        stores = [store, second_replica]
        outcomes = await asyncio.gather(
            *(request_or_refusal(stores[i % 2], "acme") for i in range(64))
        )
        assert outcomes.count("admitted") == 10
        refusals = [o for o in outcomes if o != "admitted"]
        assert len(refusals) == 54
        assert all("tenant 'acme' has 10 allocations not yet ended" in r for r in refusals)
        assert all("max_active" in r for r in refusals)
        (usage,) = [u for u in await quotas.usage() if u.scope.key == "tenant:acme"]
        assert (usage.active, usage.pending) == (10, 10)

    async def test_a_released_allocation_makes_room(
        self, store: AllocationStore, quotas: Quotas
    ) -> None:
        await quotas.set(QuotaScope.tenant("acme"), max_active=1)
        first = await store.request(provisioner_id="p", tenant_id="acme")
        with pytest.raises(QuotaExceeded):
            await store.request(provisioner_id="p", tenant_id="acme")
        await store.release(first.id)  # pending: released at once
        await store.request(provisioner_id="p", tenant_id="acme")

    async def test_max_pending_counts_only_what_waits_for_a_sidecar(
        self, db: Database, store: AllocationStore, quotas: Quotas
    ) -> None:
        await quotas.set(QuotaScope.tenant("acme"), max_active=5, max_pending=2)
        made = [await store.request(provisioner_id="p", tenant_id="acme") for _ in range(2)]
        with pytest.raises(QuotaExceeded) as refused:
            await store.request(provisioner_id="p", tenant_id="acme")
        assert "max_pending" in str(refused.value)
        assert refused.value.retry_after is None
        # One is being provisioned now: it no longer waits.
        await db.pool.execute(
            "UPDATE hubd_allocations SET status = 'provisioning', sidecar_id = 'sc_x', "
            "token_hash = sha256('t') WHERE id = $1",
            made[0].id,
        )
        await store.request(provisioner_id="p", tenant_id="acme")

    async def test_the_rate_is_a_bucket_that_refills(
        self, db: Database, store: AllocationStore, quotas: Quotas
    ) -> None:
        """A burst of 3 at 1 a second: three at once, the fourth refused with when to retry;
        two seconds later (moved on the database's clock, not slept), two more."""
        await quotas.set(QuotaScope.tenant("acme"), rate=1.0, burst=3)
        for _ in range(3):
            await store.request(provisioner_id="p", tenant_id="acme")
        with pytest.raises(QuotaExceeded) as refused:
            await store.request(provisioner_id="p", tenant_id="acme")
        retry = refused.value.retry_after
        assert retry is not None
        assert 0 < retry <= 1.0
        assert "faster than its quota of 1 requests a second (burst 3)" in str(refused.value)
        await db.pool.execute(
            "UPDATE hubd_tenant_usage SET refilled_at = refilled_at - interval '2 seconds' "
            "WHERE tenant_key = 'tenant:acme'"
        )
        for _ in range(2):
            await store.request(provisioner_id="p", tenant_id="acme")
        with pytest.raises(QuotaExceeded):
            await store.request(provisioner_id="p", tenant_id="acme")

    async def test_an_idempotent_repeat_is_answered_whatever_the_quota(
        self, store: AllocationStore, quotas: Quotas
    ) -> None:
        await quotas.set(QuotaScope.tenant("acme"), max_active=1)
        first = await store.request(provisioner_id="p", tenant_id="acme", idempotency_key="k1")
        again = await store.request(provisioner_id="p", tenant_id="acme", idempotency_key="k1")
        assert again.id == first.id
        with pytest.raises(QuotaExceeded):
            await store.request(provisioner_id="p", tenant_id="acme", idempotency_key="k2")


class TestScopes:
    async def test_the_default_applies_to_each_tenant_without_its_own(
        self, store: AllocationStore, quotas: Quotas
    ) -> None:
        await quotas.set(QuotaScope.default(), max_active=1)
        await quotas.set(QuotaScope.tenant("big"), max_active=3)
        for tenant in ("a", "b", None):
            assert await request_or_refusal(store, tenant) == "admitted"
            assert (await request_or_refusal(store, tenant)).startswith("refused")
        outcomes = [await request_or_refusal(store, "big") for _ in range(4)]
        assert outcomes[:3] == ["admitted"] * 3
        assert outcomes[3].startswith("refused: ")
        assert "tenant 'big' has 3 allocations not yet ended" in outcomes[3]

    async def test_requests_with_no_tenant_have_a_quota_of_their_own(
        self, store: AllocationStore, quotas: Quotas
    ) -> None:
        await quotas.set(QuotaScope.untenanted(), max_active=2)
        outcomes = [await request_or_refusal(store, None) for _ in range(3)]
        assert outcomes[:2] == ["admitted", "admitted"]
        assert outcomes[2].startswith("refused: ")
        assert "requests with no tenant have 2 allocations not yet ended" in outcomes[2]
        assert await request_or_refusal(store, "other") == "admitted"  # no default

    async def test_limits_are_kept_removed_and_cleared(self, quotas: Quotas) -> None:
        scope = QuotaScope.tenant("acme")
        await quotas.set(scope, max_active=5, rate=2.0, burst=4)
        kept = await quotas.set(scope, max_pending=1)
        assert (kept.max_active, kept.max_pending, kept.rate, kept.burst) == (5, 1, 2.0, 4)
        removed = await quotas.set(scope, clear=frozenset({"rate", "max_active"}))
        assert (removed.max_active, removed.max_pending, removed.rate) == (None, 1, None)
        assert await quotas.clear(scope)
        assert not await quotas.clear(scope)

    @pytest.mark.parametrize(
        ("limits", "fragment"),
        [
            ({"max_active": -1}, "max_active must be 0"),
            ({"rate": 1.0}, "needs both a rate and a burst"),
            ({"rate": 0.0, "burst": 1}, "rate must be above 0"),
            ({"rate": 1.0, "burst": 0}, "burst must be 1"),
            ({"clear": frozenset({"max_everything"})}, "no such limit"),
        ],
    )
    async def test_bad_limits_are_refused(
        self, quotas: Quotas, limits: dict[str, object], fragment: str
    ) -> None:
        with pytest.raises(InvalidRequest) as refused:
            await quotas.set(QuotaScope.tenant("acme"), **limits)  # type: ignore[arg-type]
        assert fragment in str(refused.value)


class TestIsolation:
    async def test_a_repeatable_read_caller_that_raced_another_fails_to_serialize(
        self, database_url: str, quotas: Quotas
    ) -> None:
        """Two REPEATABLE READ transactions whose snapshots predate each other's request: the
        second cannot count without the first, so it fails with 40001 instead of admitting an
        eleventh."""
        await quotas.set(QuotaScope.tenant("acme"), max_active=1)
        first = await asyncpg.connect(database_url)
        second = await asyncpg.connect(database_url)
        try:
            one = first.transaction(isolation="repeatable_read")
            two = second.transaction(isolation="repeatable_read")
            await one.start()
            await two.start()
            for conn in (first, second):
                await conn.fetchval("SELECT count(*) FROM hubd_allocations")  # the snapshot
            await first.fetch(
                "SELECT * FROM hubd_request_allocation('p', 'acme', NULL, NULL, NULL, NULL, NULL)"
            )
            await one.commit()
            with pytest.raises(asyncpg.SerializationError):
                await second.fetch(
                    "SELECT * FROM hubd_request_allocation('p', 'acme', NULL, NULL, NULL, NULL, "
                    "NULL)"
                )
            await two.rollback()
            count = await first.fetchval(
                "SELECT count(*) FROM hubd_allocations WHERE tenant_id = 'acme'"
            )
            assert count == 1
        finally:
            await first.close()
            await second.close()

    async def test_an_application_role_gets_hu429(
        self, database_url: str, db: Database, quotas: Quotas
    ) -> None:
        """Through the application API, as a login holding only hubd_app: the refusal is
        HU429 with the message, and the role cannot read or change the quotas."""
        await quotas.set(QuotaScope.tenant("acme"), max_active=1)
        async with app_role(database_url) as dsn:
            app = await asyncpg.connect(dsn)
            try:
                await app.fetch("SELECT * FROM hubd_v1.request('p', tenant => 'acme')")
                with pytest.raises(asyncpg.PostgresError) as refused:
                    await app.fetch("SELECT * FROM hubd_v1.request('p', tenant => 'acme')")
                assert refused.value.sqlstate == "HU429"
                assert "max_active" in str(refused.value)
                for statement in (
                    "SELECT * FROM hubd_tenant_quotas",
                    "DELETE FROM hubd_tenant_quotas",
                    "UPDATE hubd_tenant_usage SET tokens = 1000",
                    "SELECT hubd_admit_request('acme')",
                ):
                    with pytest.raises(asyncpg.InsufficientPrivilegeError):
                        await app.execute(statement)
            finally:
                await app.close()


class TestCommand:
    async def test_quota_and_usage(self, database_url: str, store: AllocationStore) -> None:
        env = {"HUBD_DATABASE_URL": database_url}
        done = await run_hubd_async(
            "tenant", "quota", "--tenant", "acme", "--max-active", "2", "--rate", "5",
            "--burst", "10", env=env,
        )  # fmt: skip
        assert done.code == 0, done.err
        assert done.out.strip() == "tenant 'acme': max_active 2, rate 5/s burst 10"
        default = await run_hubd_async("tenant", "quota", "--default", "--max-pending", "3",
                                       env=env)  # fmt: skip
        assert default.code == 0, default.err
        await store.request(provisioner_id="p", tenant_id="acme")
        await store.request(provisioner_id="p", tenant_id="other")
        table = await run_hubd_async("tenant", "usage", env=env)
        assert table.code == 0, table.err
        lines = table.out.splitlines()
        assert lines[0].split() == ["TENANT", "ACTIVE", "PENDING", "QUOTA", "BUCKET"]
        assert lines[1].startswith("(default)")
        acme = next(line for line in lines if line.startswith("acme "))
        assert "max_active 2, rate 5/s burst 10" in acme
        other = next(line for line in lines if line.startswith("other "))
        assert "max_pending 3 (default)" in other
        bad = await run_hubd_async("tenant", "quota", "--tenant", "acme", "--rate", "5", env=env)
        assert bad.code == 2
        assert "--rate and --burst go together" in bad.err
        cleared = await run_hubd_async("tenant", "quota", "--tenant", "acme", "--clear", env=env)
        assert cleared.code == 0
        assert "quota removed" in cleared.out
