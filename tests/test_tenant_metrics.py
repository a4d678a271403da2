"""Tenants in /metrics: per-tenant gauges whose labels stay bounded however many tenants there
are, and quota refusals counted where the refused transaction's rollback cannot undo them,
out of an application role's reach."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hubd.config import AdminConfig
from hubd.daemon.metrics import Metrics, tenant_label
from hubd.errors import ConfigError, QuotaExceeded
from hubd.store import AllocationStore, Database, Status
from hubd.store.counts import SQL, MetricCounts, TenantCount, metric_counts
from hubd.store.migrate import available_migrations
from hubd.store.quotas import Quotas, QuotaScope
from tests.apikit import app_role
from tests.conftest import PostgresServer, drop_database, fresh_database
from tests.daemonkit import DaemonProcess, http_get, write_config

ACTIVE = "hubd_tenant_active_allocations"
PENDING = "hubd_tenant_pending_allocations"
REFUSALS = "hubd_quota_refusals_total"


def samples(metrics: Metrics, name: str) -> dict[tuple[str, ...], float]:
    rendered = metrics.render().decode()
    found: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(rendered):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(v for _, v in sorted(sample.labels.items()))] = sample.value
    return found


def by_key(counts: MetricCounts) -> dict[str, TenantCount]:
    keyed = {count.key: count for count in counts.tenants}
    assert len(keyed) == len(counts.tenants), "a key counted twice"
    return keyed


async def make(store: AllocationStore, tenant: str | None, n: int) -> list[str]:
    return [(await store.request(provisioner_id="p", tenant_id=tenant)).id for _ in range(n)]


async def refused(store: AllocationStore, tenant: str | None) -> QuotaExceeded:
    with pytest.raises(QuotaExceeded) as caught:
        await store.request(provisioner_id="p", tenant_id=tenant)
    return caught.value


class TestGauges:
    async def test_each_labelled_tenant_counted(self, db: Database, store: AllocationStore) -> None:
        """Quota tenants (even with nothing), the most active other, the rest summed, and the
        allocations with no tenant; a gauge per key, ended allocations not counted."""
        quotas = Quotas(db)
        await quotas.set(QuotaScope.tenant("acme"), max_active=100)
        await quotas.set(QuotaScope.tenant("idle"), max_active=5)
        acme = await make(store, "acme", 3)
        await make(store, "beta", 2)
        await make(store, "gamma", 1)
        await make(store, "delta", 1)
        await make(store, None, 2)
        ended = await make(store, "beta", 1)
        await store.release(ended[0])  # pending: released at once, no longer counted
        await db.pool.execute(
            "UPDATE hubd_allocations SET status = 'provisioning', sidecar_id = 'sc_x', "
            "token_hash = sha256('t') WHERE id = $1",
            acme[0],
        )
        counts = by_key(await metric_counts(db, tenant_labels=1))
        gauges = {key: (c.active, c.pending) for key, c in counts.items()}
        assert gauges == {
            "tenant:acme": (3, 2),
            "tenant:idle": (0, 0),
            "tenant:beta": (2, 2),
            "other": (2, 2),
            "untenanted": (2, 2),
        }
        metrics = Metrics()
        metrics.set_tenant_counts(counts.values())
        assert samples(metrics, ACTIVE) == {
            ("acme",): 3,
            ("idle",): 0,
            ("beta",): 2,
            ("_other",): 2,
            ("_none",): 2,
        }
        assert samples(metrics, PENDING)[("acme",)] == 2

    async def test_labels_stay_bounded_with_more_tenants_than_allowed(
        self, db: Database, store: AllocationStore
    ) -> None:
        """40 tenants, 6 labels: the six most active (ties by name), the quota tenants, one
        _other and one _none; the gauges still add up to every allocation not yet ended."""
        await Quotas(db).set(QuotaScope.tenant("t39"), max_pending=1000)
        await db.pool.execute(
            """
            INSERT INTO hubd_allocations (id, provisioner_id, tenant_id, next_attempt_at)
            SELECT 'al_' || md5(t::text || '.' || i::text), 'p', 't' || lpad(t::text, 2, '0'), now()
            FROM generate_series(0, 39) AS t, generate_series(1, 1 + t % 7) AS i
            """
        )
        counts = await metric_counts(db, tenant_labels=6)
        keys = [c.key for c in counts.tenants]
        # 1 + t % 7 allocations: 7 for t = 6, 13, 20, 27, 34, then 6 for t = 5, 12, …, of
        # which t05 comes first by name; t39 is named for its quota row.
        named = {f"tenant:t{t:02}" for t in (5, 6, 13, 20, 27, 34)}
        assert set(keys) == named | {"tenant:t39", "other", "untenanted"}
        total = sum(1 + t % 7 for t in range(40))
        assert sum(c.active or 0 for c in counts.tenants) == total
        assert counts.statuses[Status.PENDING] == total
        unlabelled = by_key(await metric_counts(db, tenant_labels=0))
        assert set(unlabelled) == {"tenant:t39", "other", "untenanted"}
        assert unlabelled["other"].active == total - (1 + 39 % 7)

    async def test_a_tenant_that_leaves_the_labels_leaves_the_scrape(self) -> None:
        metrics = Metrics()
        metrics.set_tenant_counts([TenantCount(key="tenant:a", active=4, pending=1, refusals=None)])
        assert samples(metrics, ACTIVE) == {("a",): 4}
        metrics.set_tenant_counts([TenantCount(key="tenant:b", active=5, pending=0, refusals=None)])
        assert samples(metrics, ACTIVE) == {("b",): 5}

    def test_no_tenant_takes_a_groups_label(self) -> None:
        assert [
            tenant_label(key)
            for key in ("tenant:acme", "tenant:_other", "tenant:__x", "untenanted", "other",
                        "default")
        ] == ["acme", "__other", "___x", "_none", "_other", "_default"]  # fmt: skip

    def test_the_bound_is_configured_and_checked(self) -> None:
        assert AdminConfig().tenant_labels == 20
        assert AdminConfig(tenant_labels=0).tenant_labels == 0
        for bad in (-1, 1001):
            with pytest.raises(ConfigError, match=r"admin\.tenant_labels"):
                AdminConfig(tenant_labels=bad)


class TestRefusals:
    async def test_counted_after_the_refused_transaction_rolled_back(
        self, db: Database, store: AllocationStore
    ) -> None:
        """Each refusal rolls back with its transaction (or savepoint), the count stays: by
        the quota row that refused and the limit it names."""
        quotas = Quotas(db)
        await quotas.set(QuotaScope.tenant("acme"), max_active=1)
        await quotas.set(QuotaScope.tenant("fast"), rate=0.001, burst=1)
        await quotas.set(QuotaScope.untenanted(), max_pending=0)
        await quotas.set(QuotaScope.default(), max_active=0)
        await make(store, "acme", 1)
        await make(store, "fast", 1)
        for _ in range(3):
            await refused(store, "acme")
        await refused(store, "fast")
        await refused(store, None)
        await refused(store, "anyone")
        await refused(store, "someone")
        async with db.pool.acquire() as conn:
            with pytest.raises(asyncpg.PostgresError) as caught:
                async with conn.transaction():
                    await conn.execute("SELECT hubd_v1.request('p', tenant => 'acme')")
            assert caught.value.sqlstate == "HU429"
            async with conn.transaction():
                with pytest.raises(asyncpg.PostgresError):
                    async with conn.transaction():  # a savepoint
                        await conn.execute("SELECT hubd_v1.request('p', tenant => 'acme')")
                await conn.execute("SELECT 1")
        counts = by_key(await metric_counts(db, tenant_labels=20))
        refusals = {key: dict(c.refusals) for key, c in counts.items() if c.refusals}
        assert refusals == {
            "tenant:acme": {"max_active": 5, "max_pending": 0, "rate": 0},
            "tenant:fast": {"max_active": 0, "max_pending": 0, "rate": 1},
            "untenanted": {"max_active": 0, "max_pending": 1, "rate": 0},
            "default": {"max_active": 2, "max_pending": 0, "rate": 0},
        }
        assert counts["default"].active is None
        assert "tenant:anyone" not in counts  # refused: nothing of it is active
        assert (
            await db.pool.fetchval("SELECT count(*) FROM hubd_allocations WHERE tenant_id = 'acme'")
            == 1
        )
        metrics = Metrics()
        metrics.set_tenant_counts(counts.values())
        assert samples(metrics, REFUSALS)[("max_active", "acme")] == 5
        assert samples(metrics, REFUSALS)[("max_active", "_default")] == 2
        assert samples(metrics, REFUSALS)[("max_pending", "_none")] == 1

    async def test_a_cleared_quota_takes_its_counters_along(
        self, db: Database, store: AllocationStore
    ) -> None:
        quotas = Quotas(db)
        await quotas.set(QuotaScope.tenant("acme"), max_active=0)
        await refused(store, "acme")
        names = "SELECT count(*) FROM pg_class WHERE relname LIKE 'hubd\\_quota\\_refusals\\_%'"
        assert await db.pool.fetchval(names) == 3
        assert await quotas.clear(QuotaScope.tenant("acme"))
        assert await db.pool.fetchval(names) == 0
        await store.request(provisioner_id="p", tenant_id="acme")
        await quotas.set(QuotaScope.tenant("acme"), max_active=1)
        await quotas.set(QuotaScope.tenant("acme"), max_pending=5)  # an update: same counters
        await refused(store, "acme")
        counts = by_key(await metric_counts(db, tenant_labels=0))
        assert counts["tenant:acme"].refusals == {"max_active": 1, "max_pending": 0, "rate": 0}
        assert await db.pool.fetchval(names) == 3

    async def test_an_application_role_can_neither_read_nor_move_the_counters(
        self, database_url: str, db: Database, store: AllocationStore
    ) -> None:
        """As a login holding only hubd_app, walled into tenant 'mine': its own refusals are
        counted (against its tenant only); no counter can be read, moved, reset or dropped,
        and no relation's name says which tenants have a quota."""
        quotas = Quotas(db)
        await quotas.set(QuotaScope.tenant("mine"), max_active=0)
        await quotas.set(QuotaScope.tenant("theirs"), max_active=0)
        await refused(store, "theirs")
        async with app_role(database_url) as dsn:
            role = urlsplit(dsn).username
            await db.pool.execute(
                "INSERT INTO hubd_tenant_roles (role_name, tenant_id) VALUES ($1, 'mine')", role
            )
            app = await asyncpg.connect(dsn)
            try:
                with pytest.raises(asyncpg.PostgresError) as caught:
                    await app.execute("SELECT hubd_v1.request('p')")
                assert caught.value.sqlstate == "HU429"
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await app.execute("SELECT hubd_v1.request('p', tenant => 'theirs')")
                names = await app.fetch(
                    "SELECT relname FROM pg_class WHERE relname LIKE 'hubd\\_quota\\_refusals%'"
                )
                assert len(names) == 6
                assert not any("mine" in n[0] or "theirs" in n[0] for n in names)
                assert (
                    await app.fetchval(
                        "SELECT count(last_value) FROM pg_sequences "
                        "WHERE sequencename LIKE 'hubd\\_quota\\_refusals%'"
                    )
                    == 0
                )
                for row in names:
                    name = row[0]
                    assert (
                        await app.fetchval("SELECT pg_sequence_last_value($1::regclass)", name)
                        is None
                    )
                    for statement in (
                        f"SELECT * FROM {name}",  # noqa: S608 — hubd's own names, from pg_class
                        f"SELECT nextval('{name}')",
                        f"SELECT setval('{name}', 1000)",
                        f"SELECT currval('{name}')",
                        f"ALTER SEQUENCE {name} RESTART",
                        f"DROP SEQUENCE {name}",
                        f"GRANT SELECT ON {name} TO PUBLIC",
                    ):
                        with pytest.raises(asyncpg.InsufficientPrivilegeError):
                            await app.execute(statement)
                for statement in (
                    "SELECT hubd_count_refusal(1, 'max_active')",
                    "SELECT hubd_refusal_counter(1, 'max_active')",
                    "SELECT counter_id FROM hubd_tenant_quotas",
                    "DELETE FROM hubd_tenant_quotas",
                ):
                    with pytest.raises(asyncpg.InsufficientPrivilegeError):
                        await app.execute(statement)
            finally:
                await app.close()
        counts = by_key(await metric_counts(db, tenant_labels=0))
        assert counts["tenant:mine"].refusals == {"max_active": 1, "max_pending": 0, "rate": 0}
        assert counts["tenant:theirs"].refusals == {"max_active": 1, "max_pending": 0, "rate": 0}

    async def test_counters_shadowed_in_the_temporary_schema_leave_the_count_with_hubd(
        self, database_url: str, db: Database
    ) -> None:
        """A walled role makes a temporary sequence of each of its quota's counter names, then
        is refused: hubd's own counter counts the refusal (the functions look in pg_temp last),
        and the role's sequences are never moved."""
        quotas = Quotas(db)
        await quotas.set(QuotaScope.tenant("mine"), max_active=0)
        counters = [
            row[0]
            for row in await db.pool.fetch(
                "SELECT relname FROM pg_class WHERE relname LIKE 'hubd\\_quota\\_refusals\\_%'"
            )
        ]
        assert len(counters) == 3
        async with app_role(database_url) as dsn:
            role = urlsplit(dsn).username
            await db.pool.execute(
                "INSERT INTO hubd_tenant_roles (role_name, tenant_id) VALUES ($1, 'mine')", role
            )
            app = await asyncpg.connect(dsn)
            try:
                for name in counters:
                    await app.execute(f"CREATE TEMP SEQUENCE {name}")
                with pytest.raises(asyncpg.PostgresError) as caught:
                    await app.execute("SELECT hubd_v1.request('p')")
                assert caught.value.sqlstate == "HU429"
                shadows = await app.fetch(
                    "SELECT sequencename, last_value FROM pg_sequences "
                    "WHERE schemaname LIKE 'pg\\_temp\\_%'"
                )
            finally:
                await app.close()
        assert sorted(r["sequencename"] for r in shadows) == sorted(counters)
        assert [r["last_value"] for r in shadows] == [None, None, None]
        counts = by_key(await metric_counts(db, tenant_labels=0))
        assert counts["tenant:mine"].refusals == {"max_active": 1, "max_pending": 0, "rate": 0}

    async def test_quotas_set_before_the_migration_get_counters(
        self, postgres_server: PostgresServer
    ) -> None:
        """Migrated up to 0026 with quotas in place, then 0027: each row gets its counters."""
        dsn = await fresh_database(postgres_server, "hubd_tenant_metrics_upgrade")
        try:
            conn = await asyncpg.connect(dsn)
            try:
                for migration in available_migrations():
                    if migration.version == 27:
                        await conn.execute(
                            "INSERT INTO hubd_tenant_quotas (tenant_key, max_active) "
                            "VALUES ('tenant:acme', 0), ('default', 0)"
                        )
                    await conn.execute(migration.sql)
                for tenant in ("acme", "other"):
                    with pytest.raises(asyncpg.PostgresError) as caught:
                        await conn.execute("SELECT hubd_admit_request($1)", tenant)
                    assert caught.value.sqlstate == "HU429"
                values = await conn.fetch(
                    "SELECT q.tenant_key, pg_sequence_last_value(to_regclass("
                    "hubd_refusal_counter(q.counter_id, 'max_active'))) AS n "
                    "FROM hubd_tenant_quotas AS q ORDER BY 1"
                )
            finally:
                await conn.close()
            assert [tuple(v) for v in values] == [("default", 1), ("tenant:acme", 1)]
        finally:
            await drop_database(postgres_server, "hubd_tenant_metrics_upgrade")


def plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from plan_nodes(child)


class TestCost:
    async def test_one_statement_for_10000_allocations_of_500_tenants(self, db: Database) -> None:
        """The scrape's per-tenant read, with 10,000 allocations not yet ended of 500 tenants
        scattered among 100,000 ended ones: one statement, its answer bounded by the labels,
        reading the tenants' index alone once the table is vacuumed, not the rows
        (docs/operations.md, "Tenants in the metrics", gives the measured time)."""
        quotas = Quotas(db)
        for t in range(10):
            await quotas.set(QuotaScope.tenant(f"t{t:03}"), max_active=1000)
        async with db.pool.acquire() as conn:
            await conn.execute(
                """
                INSERT INTO hubd_allocations (id, status, provisioner_id, tenant_id,
                    next_attempt_at, finished_at)
                SELECT 'al_' || md5(i::text), CASE WHEN i % 11 = 0 THEN 'pending'
                       ELSE 'released' END, 'p',
                       CASE WHEN i % 5511 = 0 THEN NULL ELSE 't' || lpad((i % 500)::text, 3, '0')
                       END,
                       CASE WHEN i % 11 = 0 THEN now() END, CASE WHEN i % 11 <> 0 THEN now() END
                FROM generate_series(1, 110000) AS i
                """
            )
            # As autovacuum leaves a table whose rows stopped changing.
            await conn.execute("VACUUM ANALYZE hubd_allocations")
            bound = SQL.tenant_counts(labels=20)
            # Once first, as a pooled connection has: its first read of each counter loads the
            # counter's catalog entry (about 17 pages each) into the connection's cache.
            await conn.fetch(bound.sql, *bound.args)
            plan = json.loads(
                await conn.fetchval(
                    "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + bound.sql, *bound.args
                )
            )
        scans = [
            (node["Node Type"], node.get("Index Name"))
            for node in plan_nodes(plan[0]["Plan"])
            if node.get("Relation Name") == "hubd_allocations"
        ]
        assert scans == [("Index Only Scan", "hubd_allocations_tenant_idx")], scans
        buffers = plan[0]["Plan"]["Shared Hit Blocks"] + plan[0]["Plan"]["Shared Read Blocks"]
        # The tenants' index, the quota rows, a page per counter; the heap is over 2,000 pages.
        assert buffers < 100, buffers
        started = time.perf_counter()
        counts = await metric_counts(db, tenant_labels=20)
        elapsed = time.perf_counter() - started
        keyed = by_key(counts)
        assert len(keyed) == 10 + 20 + 2
        assert sum(c.active or 0 for c in counts.tenants) == 10000
        assert keyed["untenanted"].active == 19  # i a multiple of 5511 = 11 * 501
        assert elapsed < 2.0, elapsed


class TestScrape:
    async def test_the_daemon_serves_them(
        self, database_url: str, db: Database, store: AllocationStore, marker: str,
        state_dir: Path,
    ) -> None:  # fmt: skip
        """A running daemon's /metrics, with HUBD_ADMIN_TENANT_LABELS=1: the quota tenant with
        its refusal, the most active other, the rest summed."""
        await Quotas(db).set(QuotaScope.tenant("acme"), max_active=1)
        await make(store, "acme", 1)
        await refused(store, "acme")
        await make(store, "beta", 2)
        await make(store, "gamma", 1)
        config = write_config(
            state_dir / "hubd.toml", database_url=database_url, state_dir=state_dir, marker=marker
        )
        daemon = DaemonProcess(config, env={"HUBD_ADMIN_TENANT_LABELS": "1"})
        await daemon.start()
        try:
            status, body = await http_get(daemon.admin_url + "/metrics")
        finally:
            await daemon.signal(signal.SIGTERM)
            await daemon.wait()
        assert status == 200
        lines = set(body.splitlines())
        for line in (
            'hubd_tenant_active_allocations{tenant="acme"} 1.0',
            'hubd_tenant_active_allocations{tenant="beta"} 2.0',
            'hubd_tenant_active_allocations{tenant="_other"} 1.0',
            'hubd_tenant_active_allocations{tenant="_none"} 0.0',
            'hubd_tenant_pending_allocations{tenant="beta"} 2.0',
            'hubd_quota_refusals_total{limit="max_active",tenant="acme"} 1.0',
            'hubd_quota_refusals_total{limit="rate",tenant="acme"} 0.0',
        ):
            assert line in lines, body
        assert 'tenant="gamma"' not in body
