"""The application API (docs/api.md): hubd_v1's functions and views, the role that may use them,
the event feed in commit order, and the Python client on top of them."""

from __future__ import annotations

import asyncio
import json

import asyncpg
import pytest

from hubd.client import AllocationEnded, Client
from hubd.errors import (
    AllocationNotFound,
    EventCursorExpired,
    IdempotencyConflict,
    InvalidRequest,
)
from hubd.store import AllocationStore, Database, LedgerStore, Status
from hubd.store.events import EventStore
from tests.apikit import app_role
from tests.storekit import drive_to

VIEW_COLUMNS = {
    "id",
    "status",
    "ready",
    "generation",
    "provisioner",
    "tenant",
    "session",
    "spec",
    "idempotency_key",
    "ready_when",
    "endpoint",
    "metadata",
    "failure_code",
    "failure_message",
    "created_at",
    "updated_at",
    "finished_at",
    "expires_at",
    "end_reason",
    "idle_timeout",
    "idle_at",
    "warm",
}


@pytest.fixture
async def app_dsn(database_url: str) -> object:
    async with app_role(database_url) as dsn:
        yield dsn


@pytest.fixture
async def client(app_dsn: str) -> object:
    async with await Client.connect(app_dsn) as opened:
        yield opened


class TestSqlApi:
    async def test_request_from_sql_writes_the_row_its_ledger_row_and_a_wake_up(
        self, app_dsn: str, database_url: str
    ) -> None:
        admin = await asyncpg.connect(database_url)
        woken: asyncio.Queue[str] = asyncio.Queue()
        await admin.add_listener("hubd_wake", lambda *args: woken.put_nowait(args[3]))
        app = await asyncpg.connect(app_dsn)
        try:
            row = await app.fetchrow(
                "SELECT * FROM hubd_v1.request('fake', tenant => 't1', session => 's1', "
                """spec => '{"model": "small"}')"""
            )
            assert set(row.keys()) == VIEW_COLUMNS
            assert row["status"] == "pending"
            assert row["ready"] is False
            assert json.loads(row["spec"]) == {"model": "small"}
            assert (row["tenant"], row["session"], row["generation"]) == ("t1", "s1", 1)
            assert row["id"].startswith("al_")
            assert len(row["id"]) == 35
            assert await asyncio.wait_for(woken.get(), 10) == "fake"
            ledger = await admin.fetch(
                "SELECT kind, to_status, phase FROM hubd_allocation_ledger "
                "WHERE allocation_id = $1",
                row["id"],
            )
            assert [tuple(r) for r in ledger] == [("request", "pending", "committed")]
        finally:
            await app.close()
            await admin.close()

    async def test_a_request_commits_with_the_applications_own_transaction(
        self, app_dsn: str, database_url: str
    ) -> None:
        app = await asyncpg.connect(app_dsn)
        admin = await asyncpg.connect(database_url)
        try:
            tx = app.transaction()
            await tx.start()
            made = await app.fetchval("SELECT id FROM hubd_v1.request('fake')")
            assert await admin.fetchval("SELECT count(*) FROM hubd_allocations") == 0
            await tx.rollback()
            assert await admin.fetchval("SELECT count(*) FROM hubd_allocations") == 0
            assert await admin.fetchval("SELECT count(*) FROM hubd_events") == 0
            assert made.startswith("al_")
        finally:
            await app.close()
            await admin.close()

    @pytest.mark.parametrize(
        ("call", "names"),
        [
            ("hubd_v1.request('Not Valid')", "provisioner"),
            ("hubd_v1.request('fake', spec => '[1, 2]')", "spec must be a JSON object"),
            ("hubd_v1.request('fake', tenant => '')", "tenant"),
            ("hubd_v1.request('fake', session => E'a\\u202eb')", "session"),
            ("hubd_v1.request('fake', idempotency_key => repeat('k', 201))", "idempotency_key"),
            ("hubd_v1.request('fake', ready_when => 'eventually')", "ready_when"),
            ("hubd_v1.request('fake', spec => '{\"a\": ')", "not valid JSON"),
            ("hubd_v1.request('fake', spec => '{\"a\" 1}')", "not valid JSON"),
            ("hubd_v1.request('fake', spec => repeat('[', 100000))", "not valid JSON"),
            ("hubd_v1.request('fake', spec => repeat('[', 9000) || repeat(']', 9000))", "deeper"),
            (
                "hubd_v1.request('fake', spec => '{\"a\": \"' || repeat('x', 70000) || '\"}')",
                "64 KiB",
            ),
            (
                "hubd_v1.request('fake', spec => repeat('{\"a\": ', 40) || '1' || repeat('}', 40))",
                "deeper than 32",
            ),
        ],
    )
    async def test_bad_requests_are_refused_naming_the_argument_and_write_nothing(
        self, app_dsn: str, database_url: str, call: str, names: str
    ) -> None:
        app = await asyncpg.connect(app_dsn)
        try:
            with pytest.raises(asyncpg.InvalidParameterValueError, match=names):
                await app.fetchrow(f"SELECT * FROM {call}")  # noqa: S608 - the test's own text
        finally:
            await app.close()
        admin = await asyncpg.connect(database_url)
        try:
            assert await admin.fetchval("SELECT count(*) FROM hubd_allocations") == 0
        finally:
            await admin.close()

    async def test_a_spec_32_levels_deep_is_accepted(self, client: Client) -> None:
        spec: dict[str, object] = {}
        inner = spec
        for _ in range(31):
            inner["a"] = {}
            inner = inner["a"]  # type: ignore[assignment]
        made = await client.request("fake", spec=spec)
        assert made.spec == spec

    async def test_the_role_reads_no_secret_and_writes_no_table(
        self, app_dsn: str, store: AllocationStore, db: Database
    ) -> None:
        made = await store.request(provisioner_id="fake")
        app = await asyncpg.connect(app_dsn)
        try:
            for statement in [
                "SELECT token_hash FROM hubd_allocations",
                "SELECT * FROM hubd_allocations",
                "SELECT * FROM hubd_sidecar_secrets",
                "SELECT * FROM hubd_sidecar_connections",
                "SELECT * FROM hubd_allocation_ledger",
                "SELECT * FROM hubd_events",
                "INSERT INTO hubd_allocations (id, provisioner_id) VALUES ('al_x', 'fake')",
                "UPDATE hubd_allocations SET status = 'released'",
                "SELECT * FROM hubd_request_allocation('fake', NULL, NULL, '{}', NULL, NULL, "
                "'in_x')",
                "SELECT hubd_prune_events(0, 100)",
            ]:
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await app.execute(statement)
            columns = {
                r["column_name"]
                for r in await app.fetch(
                    "SELECT column_name FROM information_schema.columns "
                    "WHERE table_schema = 'hubd_v1'"
                )
            }
            assert not {"token_hash", "lease_id", "secret_hash", "sidecar_id"} & columns
            assert await app.fetchval(
                "SELECT status FROM hubd_v1.allocations WHERE id = $1", made.id
            ) == ("pending")
        finally:
            await app.close()

    async def test_api_functions_are_not_executable_by_public(
        self, database_url: str, postgres_server: object
    ) -> None:
        admin = await asyncpg.connect(database_url)
        try:
            granted = await admin.fetch(
                "SELECT p.proname, a.grantee::regrole::text AS grantee "
                "FROM pg_proc AS p, aclexplode(p.proacl) AS a "
                "WHERE p.pronamespace = 'hubd_v1'::regnamespace AND a.privilege_type = 'EXECUTE'"
            )
            grantees = {r["grantee"] for r in granted}
            assert "-" not in grantees  # PUBLIC shows as role 0
            assert "hubd_app" in grantees
            assert {r["proname"] for r in granted} == {
                "request",
                "release",
                "extend",
                "touch",
                "event_cursor",
                "events_after",
            }
        finally:
            await admin.close()


class TestIdempotency:
    async def test_the_same_key_returns_the_same_allocation(self, client: Client) -> None:
        first = await client.request("fake", spec={"a": 1}, idempotency_key="order-17")
        again = await client.request("fake", spec={"a": 1}, idempotency_key="order-17")
        assert again.id == first.id
        assert again.idempotency_key == "order-17"

    async def test_the_key_is_kept_after_release(self, client: Client) -> None:
        first = await client.request("fake", idempotency_key="k")
        await client.release(first.id)
        again = await client.request("fake", idempotency_key="k")
        assert again.id == first.id
        assert again.status == "released"

    async def test_a_different_request_under_a_used_key_is_refused_naming_it(
        self, client: Client, db: Database
    ) -> None:
        first = await client.request("fake", spec={"a": 1}, idempotency_key="order-17")
        with pytest.raises(IdempotencyConflict, match=r"'order-17'.*" + first.id):
            await client.request("fake", spec={"a": 2}, idempotency_key="order-17")
        with pytest.raises(IdempotencyConflict, match="order-17"):
            await client.request("other", spec={"a": 1}, idempotency_key="order-17")
        with pytest.raises(IdempotencyConflict, match="order-17"):
            await client.request("fake", spec={"a": 1}, session="s", idempotency_key="order-17")
        assert await db.pool.fetchval("SELECT count(*) FROM hubd_allocations") == 1

    async def test_keys_are_per_tenant(self, client: Client) -> None:
        a = await client.request("fake", tenant="a", idempotency_key="same")
        b = await client.request("fake", tenant="b", idempotency_key="same")
        none = await client.request("fake", idempotency_key="same")
        assert len({a.id, b.id, none.id}) == 3

    async def test_concurrent_requests_with_one_key_make_one_allocation(
        self, app_dsn: str, database_url: str
    ) -> None:
        conns = [await asyncpg.connect(app_dsn) for _ in range(8)]
        try:
            # Every request waits inside its transaction until all have inserted or blocked.
            txs = [conn.transaction() for conn in conns]
            for tx in txs:
                await tx.start()
            calls = {
                asyncio.create_task(
                    conn.fetchval(
                        "SELECT id FROM hubd_v1.request('fake', idempotency_key => 'race')"
                    )
                ): tx
                for conn, tx in zip(conns, txs, strict=True)
            }
            # One inserts; the others wait on its uncommitted row until it commits, then each
            # finds the key taken and returns the same allocation.
            ids = set()
            pending = set(calls)
            while pending:
                done, pending = await asyncio.wait(
                    pending, timeout=30, return_when=asyncio.FIRST_COMPLETED
                )
                assert done, "no request finished"
                for call in done:
                    ids.add(call.result())
                    await calls[call].commit()
        finally:
            for conn in conns:
                await conn.close()
        assert len(ids) == 1
        admin = await asyncpg.connect(database_url)
        try:
            assert await admin.fetchval("SELECT count(*) FROM hubd_allocations") == 1
            assert (
                await admin.fetchval(
                    "SELECT count(*) FROM hubd_allocation_ledger WHERE kind = 'request'"
                )
                == 1
            )
        finally:
            await admin.close()


class TestRelease:
    async def test_release_is_idempotent_and_an_unknown_id_is_named(
        self, client: Client, db: Database
    ) -> None:
        made = await client.request("fake")
        released = await client.release(made.id, reason="done")
        assert released.status == "released"  # pending: nothing was bound
        assert (await client.release(made.id)).status == "released"
        with pytest.raises(AllocationNotFound, match="al_0"):
            await client.release("al_" + "0" * 32)
        with pytest.raises(AllocationNotFound):
            await client.get("al_" + "0" * 32)
        history = await LedgerStore(db, instance_id="in_test").history(made.id)
        assert [(e.kind, e.message) for e in history] == [("request", None), ("release", "done")]


class TestFeed:
    async def test_a_transaction_that_commits_late_is_never_behind_the_cursor(
        self, app_dsn: str
    ) -> None:
        """Begun first and committed last, its event comes after the one that committed first,
        so a reader that moved past the first still reads it."""
        early, late, reader = [await asyncpg.connect(app_dsn) for _ in range(3)]
        try:
            start = await reader.fetchval("SELECT hubd_v1.event_cursor()")
            tx = early.transaction()
            await tx.start()
            slow = await early.fetchval("SELECT id FROM hubd_v1.request('fake', session => 'a')")
            fast = await late.fetchval("SELECT id FROM hubd_v1.request('fake', session => 'b')")
            seen = await reader.fetch("SELECT * FROM hubd_v1.events_after($1)", start)
            assert [r["allocation_id"] for r in seen] == [fast]
            cursor = seen[-1]["position"]
            await tx.commit()
            after = await reader.fetch("SELECT * FROM hubd_v1.events_after($1)", cursor)
            assert [(r["allocation_id"], r["event"]) for r in after] == [(slow, "requested")]
            assert after[0]["position"] > cursor
        finally:
            for conn in (early, late, reader):
                await conn.close()

    async def test_events_follow_the_lifecycle_and_carry_no_secret(
        self, client: Client, store: AllocationStore, db: Database
    ) -> None:
        start = await client.cursor()
        fence = await drive_to(store, db, Status.ALLOCATED)
        await db.pool.execute(
            "UPDATE hubd_allocations SET connection_ready = true WHERE id = $1",
            fence.allocation_id,
        )
        await store.release(fence.allocation_id)
        events = [e async for e in _take(client.events(since=start), 5)]
        assert [(e.event, e.status, e.ready, e.generation) for e in events] == [
            ("requested", "pending", False, 1),
            ("provisioning", "provisioning", False, 1),
            ("allocated", "allocated", False, 1),
            ("ready", "allocated", True, 1),
            ("releasing", "releasing", False, 2),
        ]
        assert {e.allocation_id for e in events} == {fence.allocation_id}
        made = await store.get(fence.allocation_id)
        rows = await db.pool.fetch("SELECT to_jsonb(e)::text AS doc FROM hubd_events AS e")
        token_hash = (await store.get(made.id)).token_hash
        for row in rows:
            assert "token" not in row["doc"]
            assert "lease" not in row["doc"]
            if token_hash is not None:
                assert token_hash.hex() not in row["doc"]

    async def test_the_notification_names_the_position_alone(
        self, app_dsn: str, client: Client
    ) -> None:
        listener = await asyncpg.connect(app_dsn)
        notes: asyncio.Queue[str] = asyncio.Queue()
        await listener.add_listener("hubd_events", lambda *args: notes.put_nowait(args[3]))
        try:
            made = await client.request("fake", tenant="t9")
            note = json.loads(await asyncio.wait_for(notes.get(), 10))
            (event,) = [e async for e in _take(client.events(since=0), 1)]
            # Any role may LISTEN on any channel: the payload says nothing it could not read.
            assert note == {"position": event.position}
            assert event.allocation_id == made.id
        finally:
            await listener.close()

    async def test_a_pruned_cursor_is_refused_not_skipped(
        self, client: Client, db: Database
    ) -> None:
        await client.request("fake")
        await client.request("fake")
        assert await EventStore(db).prune(0.0) == 2
        with pytest.raises(EventCursorExpired, match="older than the feed keeps"):
            await _first(client.events(since=0))
        head = await client.cursor()
        assert head >= 2
        later = await client.request("fake")
        (event,) = [e async for e in _take(client.events(since=head), 1)]
        assert event.allocation_id == later.id

    async def test_the_follower_misses_nothing_when_its_connection_drops(
        self, client: Client, database_url: str
    ) -> None:
        admin = await asyncpg.connect(database_url)
        try:
            start = await client.cursor()
            received: asyncio.Queue[str] = asyncio.Queue()

            async def follow() -> None:
                async for event in client.events(since=start, health_interval=0.5):
                    received.put_nowait(event.allocation_id)

            follower = asyncio.create_task(follow())
            try:
                first = await client.request("fake")
                assert await asyncio.wait_for(received.get(), 20) == first.id
                # Kill the follower's backend, commit while it is gone, and it still arrives.
                killed = await admin.fetchval(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE query LIKE '%hubd_v1.events_after%' AND pid <> pg_backend_pid() "
                    "AND usename <> current_user"
                )
                assert killed >= 1
                second = await client.request("fake")
                assert await asyncio.wait_for(received.get(), 30) == second.id
                assert received.empty()
            finally:
                follower.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await follower
        finally:
            await admin.close()


class TestClient:
    async def test_invalid_requests_raise_invalid_request(self, client: Client) -> None:
        with pytest.raises(InvalidRequest, match="provisioner"):
            await client.request("Bad Id")

    async def test_wait_ready_raises_when_the_allocation_ends_first(self, client: Client) -> None:
        made = await client.request("fake")

        async def release_soon() -> None:
            await client.release(made.id)

        waiting = asyncio.create_task(client.wait_ready(made.id, timeout=30))
        await release_soon()
        with pytest.raises(AllocationEnded, match="released"):
            await waiting

    async def test_wait_ready_times_out_naming_the_status(self, client: Client) -> None:
        made = await client.request("fake")
        with pytest.raises(TimeoutError, match="pending"):
            await client.wait_ready(made.id, timeout=0.5)

    async def test_snapshot_and_cursor_agree(self, client: Client) -> None:
        a = await client.request("fake")
        rows, cursor = await client.snapshot()
        assert [r.id for r in rows] == [a.id]
        b = await client.request("fake")
        (event,) = [e async for e in _take(client.events(since=cursor), 1)]
        assert event.allocation_id == b.id

    async def test_list_filters_by_tenant_and_status(self, client: Client) -> None:
        a = await client.request("fake", tenant="x")
        await client.request("fake", tenant="y")
        assert [r.id for r in await client.list(tenant="x")] == [a.id]
        assert await client.list(status="ready") == []
        await client.release(a.id)
        assert [r.id for r in await client.list(status="released")] == [a.id]


async def _take(events: object, count: int) -> object:
    taken = 0
    async with asyncio.timeout(30):
        async for event in events:  # type: ignore[attr-defined]
            yield event
            taken += 1
            if taken == count:
                return


async def _first(events: object) -> object:
    async with asyncio.timeout(30):
        async for event in events:  # type: ignore[attr-defined]
            return event
    return None
