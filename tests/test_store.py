"""AllocationStore and LedgerStore against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import asyncpg
import attrs
import pytest

from hubd.errors import AllocationNotFound, DatabaseUnavailable, InvalidRequest
from hubd.reconciler.writes import (
    Abandon,
    AcceptAndPark,
    BeginInitialization,
    BindInitial,
    BindReplacement,
    FailNow,
    MarkAllocated,
    MarkDestroyFailed,
    MarkReady,
    MarkReleased,
    Park,
    Retry,
)
from hubd.routing import Target
from hubd.store import (
    AllocationStore,
    AttemptKind,
    Database,
    EffectRow,
    Failure,
    Fence,
    LedgerStore,
    ParkMode,
    Phase,
    Status,
)
from hubd.store.connection_values import Disconnect
from hubd.store.connections import ConnectionStore
from hubd.store.counts import status_counts
from hubd.store.instances import InstanceStore
from hubd.store.ledger import new_effect_id
from hubd.store.queries import Statement
from hubd.store.rows import Claimed, InitialBinds
from tests.pgtime import age_row, expire_lease
from tests.polling import eventually
from tests.storekit import LEASE_SECONDS, claim_next, claim_one, drive_to, new_lease, token_hash

Transition = Callable[[AllocationStore, Fence], Awaitable[Any]]
FAIL = Failure("boom", "it broke")

# Every claim-owned transition, the status it starts from, and how to call it.
TRANSITIONS: dict[str, tuple[Status | None, Transition]] = {
    "bind_initial_sidecar": (
        Status.PENDING,
        lambda s, f: s.write(
            f,
            BindInitial(
                sidecar_id="sc_x",
                token_hash=token_hash(),
                connect_timeout=60,
                api_version="1",
                binding_fingerprint="fp",
            ).transition(),
        ),
    ),
    "bind_replacement_sidecar": (
        Status.REPLACING,
        lambda s, f: s.write(
            f,
            BindReplacement(
                sidecar_id="sc_y", token_hash=token_hash(), connect_timeout=60
            ).transition(),
        ),
    ),
    "mark_allocated": (
        Status.PROVISIONING,
        lambda s, f: s.write(f, MarkAllocated(external_ref="r").transition()),
    ),
    "begin_initialization": (
        Status.ALLOCATED,
        lambda s, f: s.write(f, BeginInitialization().transition()),
    ),
    "mark_connection_ready": (
        Status.ALLOCATED,
        lambda s, f: s.write(f, MarkReady(connection_seq=0).transition()),
    ),
    "schedule_retry": (
        Status.REPLACING,
        lambda s, f: s.write(
            f,
            Retry(
                expected=Status.REPLACING, delay=2, attempt_kind=AttemptKind.DESTROY, failure=FAIL
            ).transition(),
        ),
    ),
    "park": (
        None,
        lambda s, f: s.write(f, Park(mode=ParkMode.AWAIT_CONNECTION, delay=30).transition()),
    ),
    "begin_replacement": (
        Status.PROVISIONING,
        lambda s, f: s.write(
            f,
            Abandon(
                release=False, expected=Status.PROVISIONING, delay=1, failure=FAIL
            ).transition(),
        ),
    ),
    "begin_unrecoverable_release": (
        Status.ALLOCATED,
        lambda s, f: s.write(
            f, Abandon(release=True, expected=Status.ALLOCATED, delay=0, failure=FAIL).transition()
        ),
    ),
    "fail_without_infrastructure": (
        Status.PENDING,
        lambda s, f: s.write(f, FailNow(expected=Status.PENDING, failure=FAIL).transition()),
    ),
    "mark_destroy_failed": (
        Status.RELEASING,
        lambda s, f: s.write(f, MarkDestroyFailed(failure=FAIL).transition()),
    ),
    "mark_released": (Status.RELEASING, lambda s, f: s.write(f, MarkReleased().transition())),
}

# A status each transition does not accept, to prove the status guard.
WRONG_STATUS = {
    Status.PENDING: Status.PROVISIONING,
    Status.PROVISIONING: Status.ALLOCATED,
    Status.ALLOCATED: Status.PROVISIONING,
    Status.REPLACING: Status.ALLOCATED,
    Status.RELEASING: Status.ALLOCATED,
}


async def snapshot(db: Database, allocation_id: str) -> tuple[Any, int]:
    async with db.pool.acquire() as conn:
        row = await conn.fetchrow("SELECT * FROM hubd_allocations WHERE id = $1", allocation_id)
        entries = await conn.fetchval(
            "SELECT count(*) FROM hubd_allocation_ledger WHERE allocation_id = $1", allocation_id
        )
    return dict(row), entries


def nested(depth: int) -> Any:
    """A JSON value ``depth`` lists deep."""
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


class TestFences:
    @pytest.mark.parametrize("name", sorted(TRANSITIONS))
    async def test_right_fence_writes_and_logs(
        self, store: AllocationStore, db: Database, ledger: LedgerStore, name: str
    ) -> None:
        """A transition under the claim's own lease, generation and status updates the row and
        appends one committed ledger row naming that lease."""
        status, call = TRANSITIONS[name]
        fence = await drive_to(store, db, status or Status.ALLOCATED)
        _, before = await snapshot(db, fence.allocation_id)
        updated = await call(store, fence)
        assert updated is not None
        _, after = await snapshot(db, fence.allocation_id)
        assert after == before + 1
        last = (await ledger.history(fence.allocation_id))[-1]
        assert last.phase is Phase.COMMITTED
        assert last.lease_id == fence.lease_id
        assert last.instance_id == "in_test"
        assert last.to_status == str(updated.status)

    @pytest.mark.parametrize(
        ("name", "variant"),
        [
            (name, variant)
            for name in sorted(TRANSITIONS)
            for variant in ("lease", "generation", "status", "expired")
            # park accepts every active status: it has no wrong status to try.
            if not (variant == "status" and TRANSITIONS[name][0] is None)
        ],
    )
    async def test_wrong_fence_changes_nothing(
        self, store: AllocationStore, db: Database, name: str, variant: str
    ) -> None:
        """A transition with another lease, another generation, an unexpected status or an
        expired lease returns None and leaves the row and the ledger as they were."""
        status, call = TRANSITIONS[name]
        if variant == "status":
            assert status is not None
            fence = await drive_to(store, db, WRONG_STATUS[status])
        else:
            fence = await drive_to(store, db, status or Status.ALLOCATED)
        if variant == "lease":
            fence = Fence(
                allocation_id=fence.allocation_id, lease_id=new_lease(), generation=fence.generation
            )
        elif variant == "generation":
            fence = fence.advanced(fence.generation + 1)
        elif variant == "expired":
            await expire_lease(db, fence.allocation_id)
        before = await snapshot(db, fence.allocation_id)
        assert await call(store, fence) is None
        assert await snapshot(db, fence.allocation_id) == before


class TestRequestAndRelease:
    async def test_request_is_due_at_once(self, store: AllocationStore) -> None:
        """A new request is pending, generation 1, and claimable right away."""
        allocation = await store.request(
            provisioner_id="fake", tenant_id="t1", session_id="s1", spec={"cpu": 2}
        )
        assert allocation.status is Status.PENDING
        assert allocation.generation == 1
        assert allocation.spec == {"cpu": 2}
        fence = await claim_one(store, allocation.id)
        assert fence.generation == 1

    async def test_request_in_rolled_back_transaction_leaves_nothing(
        self, store: AllocationStore, database_url: str
    ) -> None:
        """A request made in the caller's transaction vanishes with its rollback, and no wake-up
        notification is delivered."""
        listener = await asyncpg.connect(database_url)
        notes: asyncio.Queue[str] = asyncio.Queue()
        await listener.add_listener("hubd_wake", lambda *args: notes.put_nowait(args[3]))
        conn = await asyncpg.connect(database_url)
        try:
            tx = conn.transaction()
            await tx.start()
            allocation = await store.request(provisioner_id="fake", spec={"a": 1}, conn=conn)
            assert allocation.spec == {"a": 1}
            await tx.rollback()
            with pytest.raises(AllocationNotFound):
                await store.get(allocation.id)
            # A committed request afterwards proves the listener works; only it arrives.
            await store.request(provisioner_id="fake-after")
            async with asyncio.timeout(5):
                assert await notes.get() == "fake-after"
            assert notes.empty()
        finally:
            await conn.close()
            await listener.close()

    async def test_requests_committed_together_wake_once_per_provisioner(
        self, store: AllocationStore, database_url: str
    ) -> None:
        """A wake-up names the provisioner, so the many requests of one transaction reach each
        listener as one notification per provisioner, not one per allocation."""
        listener = await asyncpg.connect(database_url)
        notes: asyncio.Queue[str] = asyncio.Queue()
        await listener.add_listener("hubd_wake", lambda *args: notes.put_nowait(args[3]))
        conn = await asyncpg.connect(database_url)
        try:
            async with conn.transaction():
                for n in range(30):
                    await store.request(provisioner_id=f"batch-{n % 2}", conn=conn)
            # Sent after the batch committed: once it arrives, everything before it has.
            await conn.execute("SELECT pg_notify('hubd_wake', 'marker')")
            heard: list[str] = []
            async with asyncio.timeout(5):
                while not heard or heard[-1] != "marker":
                    heard.append(await notes.get())
            assert sorted(heard) == ["batch-0", "batch-1", "marker"]
        finally:
            await conn.close()
            await listener.close()

    async def test_request_invisible_until_commit(
        self, store: AllocationStore, database_url: str
    ) -> None:
        """Until the caller commits, no claim can see the request."""
        conn = await asyncpg.connect(database_url)
        try:
            async with conn.transaction():
                allocation = await store.request(provisioner_id="fake", conn=conn)
                assert await claim_next(store, lease_id=new_lease(), lease_duration=60) is None
            fence = await claim_one(store, allocation.id)
            assert fence.allocation_id == allocation.id
        finally:
            await conn.close()

    async def test_release_in_rolled_back_transaction_leaves_nothing(
        self, store: AllocationStore, db: Database, database_url: str
    ) -> None:
        """A release inside a rolled-back transaction leaves the allocation as it was."""
        fence = await drive_to(store, db, Status.ALLOCATED)
        before = await snapshot(db, fence.allocation_id)
        conn = await asyncpg.connect(database_url)
        try:
            tx = conn.transaction()
            await tx.start()
            released = await store.release(fence.allocation_id, conn=conn)
            assert released.status is Status.RELEASING
            await tx.rollback()
        finally:
            await conn.close()
        assert await snapshot(db, fence.allocation_id) == before

    async def test_release_pending_goes_straight_to_released(self, store: AllocationStore) -> None:
        """Releasing a pending allocation ends it at once: nothing was bound."""
        allocation = await store.request(provisioner_id="fake")
        released = await store.release(allocation.id)
        assert released.status is Status.RELEASED
        assert released.generation == 1
        assert released.next_attempt_at is None

    async def test_release_bumps_generation_and_fences_claim(
        self, store: AllocationStore, db: Database
    ) -> None:
        """Releasing a provisioning allocation moves it to releasing under a new generation, so
        the claim that was provisioning it can write nothing more."""
        fence = await drive_to(store, db, Status.PROVISIONING)
        released = await store.release(fence.allocation_id)
        assert released.status is Status.RELEASING
        assert released.generation == fence.generation + 1
        assert await store.write(fence, MarkAllocated(external_ref="late").transition()) is None
        assert await store.release(fence.allocation_id) == released  # idempotent

    async def test_release_of_terminal_is_a_no_op(self, store: AllocationStore) -> None:
        """Releasing a released allocation returns it unchanged."""
        allocation = await store.request(provisioner_id="fake")
        first = await store.release(allocation.id)
        assert await store.release(allocation.id) == first


class TestBadInput:
    async def test_unknown_id(self, store: AllocationStore) -> None:
        """An id of the right shape that names nothing raises AllocationNotFound."""
        with pytest.raises(AllocationNotFound):
            await store.get("al_" + "0" * 32)
        with pytest.raises(AllocationNotFound):
            await store.release("al_" + "0" * 32)

    @pytest.mark.parametrize("bad", ["", "al_x", "'; DROP TABLE x; --", 42])
    async def test_malformed_id(self, store: AllocationStore, bad: Any) -> None:
        """A malformed id is refused before the database with InvalidRequest."""
        with pytest.raises(InvalidRequest, match="malformed allocation id"):
            await store.get(bad)

    @pytest.mark.parametrize(
        ("spec", "match"),
        [
            ([1, 2], "JSON object"),
            ("text", "JSON object"),
            ({"x": float("nan")}, "JSON-serializable"),
            ({"x": object()}, "JSON-serializable"),
            ({"x": "a" * 70_000}, "larger than"),
            ({"x": "\x00"}, "NUL"),
            ({"x": nested(1000)}, "deeper than 32"),
            ({"x": nested(32)}, "deeper than 32"),
        ],
    )
    async def test_malformed_spec(self, store: AllocationStore, spec: Any, match: str) -> None:
        """A spec that is not a small JSON object raises InvalidRequest naming the problem."""
        with pytest.raises(InvalidRequest, match=match):
            await store.request(provisioner_id="fake", spec=spec)
        assert await store.list_active() == []

    @pytest.mark.parametrize("provisioner", ["", "Has Space", "x" * 65, None])
    async def test_malformed_provisioner(self, store: AllocationStore, provisioner: Any) -> None:
        """A malformed provisioner id raises InvalidRequest."""
        with pytest.raises(InvalidRequest, match="provisioner id"):
            await store.request(provisioner_id=provisioner)

    async def test_bad_label(self, store: AllocationStore) -> None:
        """Tenant and session ids must be short printable strings."""
        with pytest.raises(InvalidRequest, match="tenant_id"):
            await store.request(provisioner_id="fake", tenant_id="a\nb")
        with pytest.raises(InvalidRequest, match="session_id"):
            await store.request(provisioner_id="fake", session_id="s" * 201)

    @pytest.mark.parametrize("bad", ["a\x9bb", "evil\u202etxt.exe", "x\u2066y", "\x85"])
    async def test_label_without_c1_or_bidi(self, store: AllocationStore, bad: str) -> None:
        """C1 controls (a terminal escape on their own) and bidirectional overrides are
        refused in labels, so listings print what was stored."""
        with pytest.raises(InvalidRequest, match="bidirectional"):
            await store.request(provisioner_id="fake", tenant_id=bad)
        assert await store.request(provisioner_id="fake", tenant_id="Zoë-日本") is not None

    async def test_spec_depth_at_the_limit(self, store: AllocationStore) -> None:
        """A spec nested exactly as deep as allowed is accepted."""
        assert await store.request(provisioner_id="fake", spec={"x": nested(31)}) is not None


def _claim_binds(slots: int) -> dict[str, object]:
    """The claim statement's binding arguments, as a daemon serving ``fake`` passes them."""
    return {
        "sidecar_ids": [f"sc_claim_{i}" for i in range(slots)],
        "token_hashes": [bytes(32) for _ in range(slots)],
        "bindings": json.dumps({"fake": ["1", "fp"]}),
        "connect_timeout": 60.0,
    }


async def _literal(conn: asyncpg.Connection, value: object) -> str:
    """``value`` as an SQL literal, for ``EXECUTE`` of a prepared statement."""
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return str(await conn.fetchval("SELECT quote_literal($1::bytea[]::text)", value))
    if isinstance(value, list):
        return str(await conn.fetchval("SELECT quote_literal($1::text[]::text)", value))
    if isinstance(value, bytes):
        return str(await conn.fetchval("SELECT quote_literal($1::bytea::text)", value))
    text = None if value is None else str(value)
    return str(await conn.fetchval("SELECT quote_nullable($1::text)", text))


def _plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every node of an EXPLAIN (FORMAT JSON) tree, ``node`` first."""
    yield node
    for child in node.get("Plans", []):
        yield from _plan_nodes(child)


def _rows_handled(node: dict[str, Any]) -> float:
    """The rows every node of an EXPLAIN ANALYZE tree produced or filtered out, in all loops."""
    return sum(
        (
            each.get("Actual Rows", 0)
            + each.get("Rows Removed by Filter", 0)
            + each.get("Rows Removed by Join Filter", 0)
        )
        * each.get("Actual Loops", 1)  # each count above is an average over the loops
        for each in _plan_nodes(node)
    )


def _subplan(node: dict[str, Any], name: str) -> dict[str, Any]:
    """The node of an EXPLAIN (FORMAT JSON) tree that heads the subplan ``name``."""
    for found in _plan_nodes(node):
        if found.get("Subplan Name") == name:
            return found
    raise LookupError(name)


async def _quiet_statistics(conn: asyncpg.Connection, finished: int) -> None:
    """Statistics of a database with no active row: ``finished`` released rows, analyzed."""
    await conn.execute(
        """
        INSERT INTO hubd_allocations (id, status, provisioner_id, finished_at)
        SELECT 'al_' || md5(i::text), 'released', 'fake', now()
        FROM generate_series(1, $1::integer) AS i
        """,
        finished,
    )
    await conn.execute(
        "ANALYZE hubd_allocations, hubd_sidecar_connections, hubd_sidecar_secrets, hubd_instances"
    )


async def _plan_now(conn: asyncpg.Connection, statements: dict[str, Statement]) -> None:
    """Prepare each statement as ``name`` and make its generic plan now, as the pools do at a
    statement's first use; it is kept while asyncpg caches the statement, and inserts do not
    invalidate it."""
    for name, statement in statements.items():
        await conn.execute(f"PREPARE {name} AS {statement.sql}")
        nulls = ", ".join(["NULL"] * len(statement.params))
        await conn.execute(f"EXPLAIN EXECUTE {name}({nulls})")


async def _connected_burst(conn: asyncpg.Connection, *, leased: bool) -> None:
    """3,000 allocations that read ready, each with a record: 2,000 on the live instance
    ``in_own``, 1,000 on ``in_gone``, whose heartbeat stopped an hour ago; each under a live
    lease if ``leased``."""
    await conn.execute(
        "INSERT INTO hubd_instances (id, hostname, pid, heartbeat_at) VALUES "
        "('in_own', 'here', 1, now()), ('in_gone', 'there', 2, now() - interval '1 hour')"
    )
    await conn.execute(
        """
        INSERT INTO hubd_allocations
            (id, status, provisioner_id, sidecar_id, token_hash, connection_ready,
             lease_id, lease_expires_at)
        SELECT 'al_' || md5('live' || i::text), 'allocated', 'fake', 'sc_' || i,
            sha256(i::text::bytea), true,
            CASE WHEN $1 THEN 'ls_' || i END, CASE WHEN $1 THEN now() + interval '1 minute' END
        FROM generate_series(1, 3000) AS i
        """,
        leased,
    )
    await conn.execute(
        """
        INSERT INTO hubd_sidecar_connections
            (connection_id, allocation_id, generation, sidecar_id, instance_id)
        SELECT 'cn_' || i, 'al_' || md5('live' || i::text), 1, 'sc_' || i,
            CASE WHEN i <= 2000 THEN 'in_own' ELSE 'in_gone' END
        FROM generate_series(1, 3000) AS i
        """
    )


class TestClaims:
    async def test_one_statement_claims_a_batch_oldest_first(
        self, store: AllocationStore, db: Database
    ) -> None:
        """A batch claim leases at most one row per lease id, oldest due first, each row under
        the lease id at its position, and skips the excluded rows and rows already leased."""
        rows = [await store.request(provisioner_id="fake") for _ in range(5)]
        for age, row in zip((50, 40, 30, 20, 10), rows, strict=True):
            await age_row(db, row.id, age)
        leased = await claim_one(store, rows[0].id)
        leases = [new_lease() for _ in range(3)]
        claimed = await store.claim_due(lease_ids=leases, lease_duration=60, exclude=[rows[2].id])
        assert [(c.allocation.id, c.lease_id) for c in claimed] == [
            (rows[1].id, leases[0]),
            (rows[3].id, leases[1]),
            (rows[4].id, leases[2]),
        ]
        assert all(c.allocation.lease_id == c.lease_id for c in claimed)
        assert not any(c.open_effects for c in claimed)
        assert (await store.get(rows[0].id)).lease_id == leased.lease_id
        more = await store.claim_due(lease_ids=[new_lease(), new_lease()], lease_duration=60)
        assert [c.allocation.id for c in more] == [rows[2].id]

    async def test_a_claim_binds_the_pending_rows_of_its_provisioners(
        self, store: AllocationStore, db: Database
    ) -> None:
        """Given identities, a claim binds each pending row of a provisioner it names, as a
        bind would, with the identity at the row's slot, and writes the bind and the ensure's
        intent under the new lease. A row of another provisioner, one bound to another version,
        and a row past pending are leased and left as they were."""
        allocated = await drive_to(store, db, Status.ALLOCATED)
        ours = [await store.request(provisioner_id="fake") for _ in range(2)]
        other = await store.request(provisioner_id="elsewhere")
        rebound = await store.request(provisioner_id="fake")
        await expire_lease(db, allocated.allocation_id)
        identity = (await store.get(allocated.allocation_id)).sidecar_id
        async with db.pool.acquire() as conn:
            await conn.execute(
                "UPDATE hubd_allocations SET provisioner_api_version = '0' WHERE id = $1",
                rebound.id,
            )
            await conn.execute(
                "UPDATE hubd_allocations SET next_attempt_at = now() - interval '1 hour' "
                "WHERE id = $1",
                allocated.allocation_id,
            )
        for age, row in zip((50, 40, 30, 20), (*ours, other, rebound), strict=True):
            await age_row(db, row.id, age)
        leases = [new_lease() for _ in range(6)]
        binds = InitialBinds(
            sidecar_ids=[f"sc_slot_{i}" for i in range(6)],
            token_hashes=[bytes([i]) * 32 for i in range(6)],
            provisioners={"fake": ("1", "fp")},
            connect_timeout=120.0,
        )
        claimed = await store.claim_due(lease_ids=leases, lease_duration=60, binds=binds)
        by_id = {c.allocation.id: (slot, c) for slot, c in enumerate(claimed)}
        assert set(by_id) == {allocated.allocation_id, *(r.id for r in (*ours, other, rebound))}
        for row in ours:
            slot, c = by_id[row.id]
            a = c.allocation
            assert a.status is Status.PROVISIONING
            assert (a.sidecar_id, a.token_hash) == (f"sc_slot_{slot}", bytes([slot]) * 32)
            assert (a.provisioner_api_version, a.provisioner_binding_fingerprint) == ("1", "fp")
            assert a.connect_deadline is not None
            assert a.lease_id == leases[slot]
            assert not c.open_effects
            assert c.ensure_intent is not None
            assert c.destroy_intent is None
            async with db.pool.acquire() as conn:
                ledger = await conn.fetch(
                    "SELECT kind, phase, from_status, to_status, lease_id, effect_id "
                    "FROM hubd_allocation_ledger WHERE allocation_id = $1 AND kind <> 'request' "
                    "ORDER BY seq",
                    row.id,
                )
            assert [tuple(r) for r in ledger] == [
                ("bind_sidecar", "committed", "pending", "provisioning", leases[slot], None),
                (
                    "ensure",
                    "intent",
                    "provisioning",
                    "provisioning",
                    leases[slot],
                    c.ensure_intent,
                ),
            ]
        for untouched in (other.id, rebound.id, allocated.allocation_id):
            _, c = by_id[untouched]
            before = Status.ALLOCATED if untouched == allocated.allocation_id else Status.PENDING
            assert c.allocation.status is before
            assert c.ensure_intent is None
            assert c.allocation.lease_id is not None
        assert by_id[other.id][1].allocation.sidecar_id is None
        assert by_id[rebound.id][1].allocation.sidecar_id is None
        assert by_id[allocated.allocation_id][1].allocation.sidecar_id == identity

    async def test_a_claim_says_whether_a_plugin_call_was_left_without_outcome(
        self, store: AllocationStore, db: Database
    ) -> None:
        """An intent an earlier lease recorded and never answered shows in the next claim of
        the row, so that claim settles it; once settled, or answered, claims say there is none."""
        ledger = LedgerStore(db, instance_id="in_test")
        fence = await drive_to(store, db, Status.PROVISIONING)
        assert await ledger.record_effect(
            fence,
            effect_id=new_effect_id(),
            kind="ensure",
            phase=Phase.INTENT,
            status=Status.PROVISIONING,
        )
        await expire_lease(db, fence.allocation_id)
        async with db.pool.acquire() as conn:
            await conn.execute(
                "UPDATE hubd_allocations SET next_attempt_at = now() WHERE id = $1",
                fence.allocation_id,
            )
        (claimed,) = await store.claim_due(lease_ids=[new_lease()], lease_duration=60)
        assert claimed.open_effects
        settled = Fence(
            allocation_id=fence.allocation_id,
            lease_id=claimed.lease_id,
            generation=fence.generation,
        )
        assert await ledger.settle_open_effects(settled) == 1
        await expire_lease(db, fence.allocation_id)
        (again,) = await store.claim_due(lease_ids=[new_lease()], lease_duration=60)
        assert not again.open_effects

    async def test_batch_claims_never_share_a_row(self, store: AllocationStore) -> None:
        """Concurrent batch claims (as from several replicas) lease every due row exactly once."""
        ids = {(await store.request(provisioner_id="fake")).id for _ in range(40)}
        batches = await asyncio.gather(
            *(
                store.claim_due(lease_ids=[new_lease() for _ in range(8)], lease_duration=60)
                for _ in range(8)
            )
        )
        claimed = [c.allocation.id for batch in batches for c in batch]
        assert sorted(claimed) == sorted(ids)

    async def test_binding_claims_never_share_a_row(
        self, store: AllocationStore, db: Database
    ) -> None:
        """Concurrent claims that bind (as from several replicas) bind every pending row
        exactly once, each with an identity of the claim that leased it, and write one bind
        and one ensure intent per row."""
        ids = {(await store.request(provisioner_id="fake")).id for _ in range(40)}

        async def claim(claimer: int) -> list[tuple[int, Claimed]]:
            binds = InitialBinds(
                sidecar_ids=[f"sc_{claimer}_{slot}" for slot in range(8)],
                token_hashes=[bytes([claimer]) * 32 for _ in range(8)],
                provisioners={"fake": ("1", "fp")},
                connect_timeout=60.0,
            )
            leased = await store.claim_due(
                lease_ids=[new_lease() for _ in range(8)], lease_duration=60, binds=binds
            )
            return [(claimer, c) for c in leased]

        batches = await asyncio.gather(*(claim(claimer) for claimer in range(8)))
        claimed = [pair for batch in batches for pair in batch]
        assert sorted(c.allocation.id for _, c in claimed) == sorted(ids)
        for claimer, c in claimed:
            assert c.allocation.status is Status.PROVISIONING
            assert (c.allocation.sidecar_id or "").startswith(f"sc_{claimer}_")
            assert c.allocation.token_hash == bytes([claimer]) * 32
        async with db.pool.acquire() as conn:
            kinds = await conn.fetch(
                "SELECT kind, phase, count(*) AS n, count(DISTINCT allocation_id) AS rows "
                "FROM hubd_allocation_ledger WHERE kind IN ('bind_sidecar', 'ensure') "
                "GROUP BY kind, phase ORDER BY kind"
            )
        assert [tuple(r) for r in kinds] == [
            ("bind_sidecar", "committed", 40, 40),
            ("ensure", "intent", 40, 40),
        ]

    async def test_renewals_in_one_statement_grant_only_held_live_leases(
        self, store: AllocationStore, db: Database
    ) -> None:
        """One renewal covers every pair given; it grants the leases still held and live and
        refuses a lease taken over, an expired one and one never held."""
        held, stolen, expired = [await store.request(provisioner_id="fake") for _ in range(3)]
        held_fence = await claim_one(store, held.id)
        stolen_fence = await claim_one(store, stolen.id)
        expired_fence = await claim_one(store, expired.id)
        async with db.pool.acquire() as conn:
            await conn.execute(
                "UPDATE hubd_allocations SET lease_id = 'ls_thief' WHERE id = $1", stolen.id
            )
        await expire_lease(db, expired.id)
        granted = await store.renew_leases(
            [
                (held.id, held_fence.lease_id),
                (stolen.id, stolen_fence.lease_id),
                (expired.id, expired_fence.lease_id),
                (held.id, new_lease()),
            ],
            60,
        )
        assert granted == {held.id}

    async def test_dropped_lease_is_claimable_at_once(self, store: AllocationStore) -> None:
        """A claim that gives its lease back leaves the row due and claimable by anyone; a
        lease no longer held cannot be dropped."""
        allocation = await store.request(provisioner_id="fake")
        fence = await claim_one(store, allocation.id)
        assert not await store.drop_lease(allocation.id, new_lease())
        assert await store.drop_lease(allocation.id, fence.lease_id)
        again = await claim_one(store, allocation.id)
        assert again.generation == fence.generation
        assert not await store.drop_lease(allocation.id, fence.lease_id)

    async def test_oldest_due_first_and_exclusion(
        self, store: AllocationStore, db: Database
    ) -> None:
        """Claims take the oldest due row first and never a row in the exclusion list."""
        first = await store.request(provisioner_id="fake")
        second = await store.request(provisioner_id="fake")
        third = await store.request(provisioner_id="fake")
        await age_row(db, third.id, 30)
        await age_row(db, first.id, 10)
        order = []
        for _ in range(3):
            claimed = await claim_next(store, lease_id=new_lease(), lease_duration=60)
            assert claimed is not None
            order.append(claimed.id)
        assert order == [third.id, first.id, second.id]

        other = await store.request(provisioner_id="fake")
        excluded = await store.request(provisioner_id="fake")
        await age_row(db, excluded.id, 5)
        claimed = await claim_next(
            store, lease_id=new_lease(), lease_duration=60, exclude=[excluded.id]
        )
        assert claimed is not None
        assert claimed.id == other.id
        assert (
            await claim_next(store, lease_id=new_lease(), lease_duration=60, exclude=[excluded.id])
            is None
        )

    async def test_not_due_not_claimed(self, store: AllocationStore, db: Database) -> None:
        """A row scheduled in the future, or leased, is not claimable until then."""
        fence = await drive_to(store, db, Status.ALLOCATED)
        await store.write(fence, Park(mode=ParkMode.AWAIT_CONNECTION, delay=30).transition())
        assert await claim_next(store, lease_id=new_lease(), lease_duration=60) is None
        await age_row(db, fence.allocation_id, 121)
        assert (await claim_one(store, fence.allocation_id)).generation == fence.generation

    async def test_expired_lease_is_claimable_again(
        self, store: AllocationStore, db: Database
    ) -> None:
        """A live lease blocks other claims; once it expires the row is claimed under a new
        lease and the old lease's writes are refused."""
        allocation = await store.request(provisioner_id="fake")
        first = await claim_one(store, allocation.id)
        assert await claim_next(store, lease_id=new_lease(), lease_duration=60) is None
        await expire_lease(db, allocation.id)
        assert not await store.renew_lease(allocation.id, first.lease_id, 60)
        second = await claim_one(store, allocation.id)
        assert second.lease_id != first.lease_id
        assert await store.renew_lease(allocation.id, second.lease_id, 60)
        assert await store.write(first, MarkAllocated(external_ref=None).transition()) is None

    async def test_renewal_extends_by_database_clock(
        self, store: AllocationStore, db: Database
    ) -> None:
        """Renewing a live lease moves its expiry to now + duration on the database clock."""
        allocation = await store.request(provisioner_id="fake")
        fence = await claim_one(store, allocation.id)
        await age_row(db, allocation.id, 50)
        assert await store.renew_lease(allocation.id, fence.lease_id, LEASE_SECONDS)
        async with db.pool.acquire() as conn:
            remaining = await conn.fetchval(
                "SELECT extract(epoch FROM lease_expires_at - now()) FROM hubd_allocations "
                "WHERE id = $1",
                allocation.id,
            )
        assert 55 < float(remaining) <= 60
        assert not await store.renew_lease(allocation.id, new_lease(), LEASE_SECONDS)

    async def test_claim_walks_the_due_index_whatever_the_statistics(
        self, store: AllocationStore, db: Database
    ) -> None:
        """Statistics taken while the tables were empty say almost nothing is due and the ledger
        is small; a burst of 3,000 due rows among 20,000 finished ones then arrives, with 40,000
        ledger rows. The claim still walks the due index in order and stops at the 16 rows it
        wants (a few pages, where fetching every due row to sort them reads hundreds), takes the
        oldest, and looks for open plugin calls in the claimed rows' own ledger rows, not in the
        whole ledger's."""
        from hubd.store.allocations import CLAIMS as SQL

        async with db.pool.acquire() as conn:
            await conn.execute("ANALYZE hubd_allocations, hubd_allocation_ledger")
            await conn.execute(
                """
                INSERT INTO hubd_allocations (id, status, provisioner_id, finished_at)
                SELECT 'al_' || md5(i::text), 'released', 'fake', now()
                FROM generate_series(1, 20000) AS i
                """
            )
            await conn.execute(
                """
                INSERT INTO hubd_allocations (id, status, provisioner_id, next_attempt_at)
                SELECT 'al_' || md5('due' || i::text), 'provisioning', 'fake',
                    now() - i * interval '1 ms'
                FROM generate_series(1, 3000) AS i
                """
            )
            # Each finished allocation has a settled plugin call: 40,000 ledger rows.
            await conn.execute(
                """
                INSERT INTO hubd_allocation_ledger
                    (allocation_id, generation, kind, to_status, phase, effect_id)
                SELECT 'al_' || md5(i::text), 1, 'ensure', 'provisioning', phase,
                    'ef_' || md5(i::text)
                FROM generate_series(1, 20000) AS i, unnest(ARRAY['intent', 'committed']) AS phase
                """
            )
            claim = SQL.claim_due(
                lease_ids=[new_lease() for _ in range(16)],
                effect_ids=[f"ef_{i}" for i in range(16)],
                **_claim_binds(16),
                instance_id="test",
                lease_duration=60.0,
                exclude=[],
                room=None,
                listed=[],
                rooms=[],
            )
            oldest = await conn.fetch(
                "SELECT id FROM hubd_allocations WHERE next_attempt_at IS NOT NULL "
                "ORDER BY next_attempt_at, id LIMIT 16"
            )
            # Each run rolls back, so both see the same rows: the claim itself, then its plan.
            await conn.execute("BEGIN")
            try:
                claimed = await conn.fetch(claim.sql, *claim.args)
            finally:
                await conn.execute("ROLLBACK")
            await conn.execute("BEGIN")
            try:
                plan = await conn.fetchval(
                    "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + claim.sql, *claim.args
                )
            finally:
                await conn.execute("ROLLBACK")
        assert [r["id"] for r in claimed] == [r["id"] for r in oldest]
        due = _subplan(json.loads(plan)[0]["Plan"], "CTE due")
        assert due["Actual Rows"] == 16
        pages = due["Shared Hit Blocks"] + due["Shared Read Blocks"]
        assert pages < 60, f"the claim's row choice read {pages} pages"
        whole = json.loads(plan)[0]["Plan"]
        pages = whole["Shared Hit Blocks"] + whole["Shared Read Blocks"]
        assert pages < 1000, f"the claim read {pages} pages"

    @pytest.mark.parametrize("finished", [0, 20_000])
    async def test_key_lookups_keep_their_indexes_after_statistics_without_active_rows(
        self, store: AllocationStore, db: Database, finished: int
    ) -> None:
        """Statistics taken while no row was active (a new deployment, or a quiet spell with
        only ``finished`` rows); 2,000 connected allocations and 5,000 new ones then arrive. On
        hubd's own connections, whose plans are made once and kept a while, a release and a
        bind still find their row by key (not by reading a whole partial index, or every row of
        their status), a park's and a readiness look's check of the allocation's own connection
        record reads that record (not every record), the handshake's identity look-up reads its
        allocations and their secrets by key, and a claim updates the rows it chose by key, with
        no sequential scan. Each plan is made before the burst arrives, as a daemon's first
        statements are."""
        from hubd.store.allocations import CLAIMS
        from hubd.store.allocations import SQL as ALLOCATIONS
        from hubd.store.connections import SQL as CONNECTIONS
        from hubd.store.transitions import SQL as TRANSITIONS

        async with db.pool.acquire() as conn:
            await _quiet_statistics(conn, finished)
            statements = {
                "release": ALLOCATIONS.release_allocation,
                "lookup": CONNECTIONS.identities,
                "bind": TRANSITIONS.bind_initial_sidecar,
                "park": TRANSITIONS.park,
                "readiness": CONNECTIONS.readiness,
                "claim": CLAIMS.claim_due,
            }
            await _plan_now(conn, statements)
            await conn.execute(
                """
                INSERT INTO hubd_allocations
                    (id, status, provisioner_id, sidecar_id, token_hash, connection_ready)
                SELECT 'al_' || md5('live' || i::text), 'allocated', 'fake', 'sc_' || i,
                    sha256(i::text::bytea), true
                FROM generate_series(1, 2000) AS i
                """
            )
            await conn.execute(
                """
                INSERT INTO hubd_sidecar_secrets
                    (allocation_id, generation, sidecar_id, secret_hash, acknowledged)
                SELECT 'al_' || md5('live' || i::text), 1, 'sc_' || i,
                    sha256(('s' || i)::bytea), true
                FROM generate_series(1, 2000) AS i
                """
            )
            await conn.execute(
                """
                INSERT INTO hubd_allocations
                    (id, provisioner_id, next_attempt_at, lease_id, lease_expires_at)
                SELECT 'al_' || md5('new' || i::text), 'fake', now() + interval '1 hour',
                    'ls_' || i, now() + interval '1 minute'
                FROM generate_series(1, 5000) AS i
                """
            )
            await conn.execute(
                "INSERT INTO hubd_instances (id, hostname, pid) VALUES ('test', 'here', 1)"
            )
            await conn.execute(
                """
                INSERT INTO hubd_sidecar_connections
                    (connection_id, allocation_id, generation, sidecar_id, instance_id)
                SELECT 'cn_' || i, 'al_' || md5('live' || i::text), 1, 'sc_' || i, 'test'
                FROM generate_series(1, 2000) AS i
                """
            )
            pending = await conn.fetchval(
                "SELECT id FROM hubd_allocations WHERE status = 'pending' ORDER BY id LIMIT 1"
            )
            lease = await conn.fetchval(
                "SELECT lease_id FROM hubd_allocations WHERE id = $1", pending
            )
            ids = await conn.fetch(
                "SELECT id FROM hubd_allocations WHERE status = 'allocated' "
                "ORDER BY id DESC LIMIT 8"
            )
            wanted = [row["id"] for row in ids]
            release = ALLOCATIONS.release_allocation(
                allocation_id=wanted[0], instance_id="test", reason="test"
            )
            lookup = CONNECTIONS.identities(allocation_ids=wanted)
            bind = TRANSITIONS.bind_initial_sidecar(
                allocation_id=pending,
                lease_id=lease,
                generation=1,
                instance_id="test",
                effects="[]",
                sidecar_id="sc_new",
                token_hash=bytes(32),
                connect_timeout=60.0,
                api_version="1",
                binding_fingerprint="fp",
                ready_when="connected",
            )
            await conn.execute(
                "UPDATE hubd_allocations SET lease_id = 'ls_park', "
                "lease_expires_at = now() + interval '1 minute' WHERE id = $1",
                wanted[1],
            )
            # In set form, one row: each parameter an array of one, written as text for the
            # literals of EXECUTE (the statement's casts read them).
            park = TRANSITIONS.park(
                allocation_id=[wanted[1]],
                lease_id=["ls_park"],
                generation=["1"],
                instance_id=["test"],
                effects=["[]"],
                accept=["false"],
                external_ref=[None],
                endpoint=[None],
                metadata=[None],
                mode=["await_connection"],
                delay=["1.0"],
                failure_code=[None],
                failure_message=[None],
                connection_seq=["0"],
                ready_within=["20.0"],
            )
            readiness = CONNECTIONS.readiness(
                allocation_id=wanted[2], generation=1, ttl=20.0, instance_id="test"
            )
            await conn.execute(
                """
                INSERT INTO hubd_allocations (id, provisioner_id, next_attempt_at)
                SELECT 'al_' || md5('due' || i::text), 'fake', now()
                FROM generate_series(1, 100) AS i
                """
            )
            claim = CLAIMS.claim_due(
                lease_ids=[f"ls_claim_{i}" for i in range(16)],
                effect_ids=[f"ef_claim_{i}" for i in range(16)],
                **_claim_binds(16),
                instance_id="test",
                lease_duration=60.0,
                exclude=[],
                room=None,
                listed=[],
                rooms=[],
            )
            bounds = {
                "release": release,
                "lookup": lookup,
                "bind": bind,
                "park": park,
                "readiness": readiness,
                "claim": claim,
            }
            # A release runs in a PL/pgSQL function (hubd_release_allocation): its first call
            # in a session reads the catalogs to compile it, which is not what this measures.
            warm = ALLOCATIONS.release_allocation(
                allocation_id=wanted[1], instance_id="test", reason="warm-up"
            )
            await conn.execute("BEGIN")
            try:
                await conn.execute(warm.sql, *warm.args)
            finally:
                await conn.execute("ROLLBACK")
            plans = []
            for name, bound in bounds.items():
                literals = [await _literal(conn, arg) for arg in bound.args]
                await conn.execute("BEGIN")
                try:
                    explained = await conn.fetchval(
                        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
                        f"EXECUTE {name}({', '.join(literals)})"
                    )
                    plans.append(json.loads(explained)[0]["Plan"])
                finally:
                    await conn.execute("ROLLBACK")
                await conn.execute(f"DEALLOCATE {name}")
        for plan in plans:
            assert "Seq Scan" not in json.dumps(plan), plan
        pages = {
            name: plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
            for name, plan in zip(statements, plans, strict=True)
        }
        # One row each; the claim leases 16 (about 15 pages a row: its update, the indexes, the
        # look for open plugin calls). Planned on empty tables, a full walk of the primary key
        # read 12,343 pages for the claim and about 7,000 for a release or a look-up.
        claim = pages.pop("claim")
        assert claim < 1_000, f"pages read by the claim: {claim}"
        assert max(pages.values()) < 100, f"pages read: {pages}"

    @pytest.mark.parametrize("finished", [0, 20_000])
    async def test_repair_sweep_reads_each_row_once_after_statistics_without_active_rows(
        self, db: Database, finished: int
    ) -> None:
        """The repair sweep's plan is made on a daemon's connection at start-up, from statistics
        of a database with no active row (a new deployment, or a quiet spell with only
        ``finished`` rows). 2,000 connected allocations then arrive, and 1,000 that read ready
        although their only record is on an instance that stopped heartbeating. The sweep marks
        exactly those 1,000 lost, once each, and reads each row and its record by key: a few
        pages a row, where checking every row's record against every record, or joining every
        candidate back against every allocated row, read millions."""
        from hubd.store.allocations import SWEEPS as SQL

        async with db.pool.acquire() as conn:
            await _quiet_statistics(conn, finished)
            statement = SQL.mark_unconnected
            await _plan_now(conn, {"sweep": statement})
            await _connected_burst(conn, leased=False)
            bound = statement(instance_id="in_own", instance_ttl=20.0, connect_timeout=60.0)
            literals = [await _literal(conn, arg) for arg in bound.args]
            await conn.execute("BEGIN")
            try:
                explained = await conn.fetchval(
                    f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE sweep({', '.join(literals)})"
                )
                lost = await conn.fetch(
                    "SELECT a.id, a.connection_ready, a.connect_deadline IS NOT NULL AS deadline,"
                    " (SELECT count(*) FROM hubd_allocation_ledger AS l"
                    "  WHERE l.allocation_id = a.id AND l.kind = 'connection_lost') AS logged"
                    " FROM hubd_allocations AS a JOIN hubd_sidecar_connections AS c"
                    " ON c.allocation_id = a.id WHERE c.instance_id = 'in_gone'"
                )
                kept = await conn.fetchval(
                    "SELECT count(*) FROM hubd_allocations AS a"
                    " JOIN hubd_sidecar_connections AS c ON c.allocation_id = a.id"
                    " WHERE c.instance_id = 'in_own' AND a.connection_ready"
                    " AND a.connect_deadline IS NULL"
                )
            finally:
                await conn.execute("ROLLBACK")
            await conn.execute("DEALLOCATE sweep")
        plan = json.loads(explained)[0]["Plan"]
        assert plan["Actual Rows"] == 1000
        assert len(lost) == 1000
        assert all(not r["connection_ready"] and r["deadline"] and r["logged"] == 1 for r in lost)
        assert kept == 2000
        assert "Seq Scan" not in json.dumps(plan), plan
        work = _rows_handled(plan)
        assert work < 30 * 3000, f"the sweep handled {work} rows for 3,000"
        # About 11 pages a row: its record and that record's instance by key, and for the 1,000
        # it marks, the update, its index entries and the ledger row. Planned as joins on these
        # statistics, the sweep read 19,900,000.
        pages = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
        assert pages < 60_000, f"the sweep read {pages} pages for 3,000 rows"

    @pytest.mark.parametrize("finished", [0, 20_000])
    async def test_periodic_statements_read_by_key_after_statistics_without_active_rows(
        self, db: Database, finished: int
    ) -> None:
        """The statements a daemon runs every few seconds, and the one that clears a batch of
        closed sockets, planned (as on their first use) from statistics of a database with no
        active row, then run against 3,000 connected allocations, 1,000 of them recorded on an
        instance that stopped heartbeating: lease renewal, the socket check, the dead
        instance's sweep, the orphan sweep's owner lookup and the close of 1,000 sockets each
        read the rows they name by key, never every allocation or every record."""
        from hubd.store.allocations import CLAIMS, SWEEPS
        from hubd.store.connections import SQL as CONNECTIONS

        async with db.pool.acquire() as conn:
            await _quiet_statistics(conn, finished)
            statements = {
                "renew": CLAIMS.renew_leases,
                "verify": CONNECTIONS.check_sockets,
                "sweep": CONNECTIONS.sweep_stale,
                "owners": SWEEPS.sidecar_owners,
                "closes": CONNECTIONS.disconnect_many,
            }
            await _plan_now(conn, statements)
            await _connected_burst(conn, leased=True)
            own = await conn.fetch(
                "SELECT allocation_id, connection_id FROM hubd_sidecar_connections"
                " WHERE instance_id = 'in_own' ORDER BY allocation_id"
            )
            leased = await conn.fetch(
                "SELECT id, lease_id FROM hubd_allocations WHERE lease_id IS NOT NULL"
                " ORDER BY id LIMIT 16"
            )
            bounds = {
                "renew": CLAIMS.renew_leases(
                    allocation_ids=[r["id"] for r in leased],
                    lease_ids=[r["lease_id"] for r in leased],
                    lease_duration=60.0,
                ),
                "verify": CONNECTIONS.check_sockets(
                    allocation_ids=[r["allocation_id"] for r in own],
                    connection_ids=[r["connection_id"] for r in own],
                ),
                "sweep": CONNECTIONS.sweep_stale(
                    ttl=20.0, instance_id="in_own", connect_timeout=60.0
                ),
                "owners": SWEEPS.sidecar_owners(
                    sidecar_ids=[f"sc_{i}" for i in range(1, 101)],
                    allocation_ids=[""] * 100,
                ),
                "closes": CONNECTIONS.disconnect_many(
                    allocation_ids=[r["allocation_id"] for r in own[:1000]],
                    connection_ids=[r["connection_id"] for r in own[:1000]],
                    instance_id="in_own",
                    connect_timeout=60.0,
                ),
            }
            plans, results = {}, {}
            for name, bound in bounds.items():
                literals = ", ".join([await _literal(conn, arg) for arg in bound.args])
                # Each run rolls back, so both see the same rows: the statement, then its plan.
                for explain in (False, True):
                    await conn.execute("BEGIN")
                    try:
                        if explain:
                            explained = await conn.fetchval(
                                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
                                f"EXECUTE {name}({literals})"
                            )
                            plans[name] = json.loads(explained)[0]["Plan"]
                        else:
                            results[name] = await conn.fetch(f"EXECUTE {name}({literals})")
                    finally:
                        await conn.execute("ROLLBACK")
                await conn.execute(f"DEALLOCATE {name}")
        assert {r["id"] for r in results["renew"]} == {r["id"] for r in leased}
        assert {
            (r["allocation_id"], r["recorded_connection_id"], r["status"])
            for r in results["verify"]
        } == {(r["allocation_id"], r["connection_id"], "allocated") for r in own}
        assert len(results["sweep"]) == 1000
        assert {r["instance_id"] for r in results["sweep"]} == {"in_gone"}
        assert results["sweep"][0]["logged"] == 1000
        assert [r["current"] for r in results["owners"]] == [True] * 100
        assert {r["connection_id"] for r in results["closes"]} == {
            r["connection_id"] for r in own[:1000]
        }
        named = {"renew": 16, "verify": 2000, "sweep": 1000, "owners": 100, "closes": 1000}
        for name, plan in plans.items():
            assert "Seq Scan" not in json.dumps(plan), (name, plan)
            # Rows every node produced or filtered out: a lookup planned as a join against a
            # rescanned table or list grows with the product of the two (2,000,000 and more
            # here), one by key with the rows named.
            work = _rows_handled(plan)
            assert work < 30 * named[name] + 1_000, f"{name} handled {work} rows"
        pages = {
            name: plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
            for name, plan in plans.items()
        }
        # Renewal read every row of the table, and the owner lookup every key of it, where the
        # plan was made on an empty table: 6,172 and 8,036 pages.
        assert pages["renew"] < 1_000, pages
        assert pages["owners"] < 5_000, pages

    async def test_status_counts_cost_follows_active_rows(
        self, store: AllocationStore, db: Database
    ) -> None:
        """With 100,000 finished rows, the status counts are exact for active statuses and
        estimated from statistics for terminal ones, and neither statement scans the table:
        the exact count reads the active rows' index alone."""
        async with db.pool.acquire() as conn:
            await conn.execute(
                """
                INSERT INTO hubd_allocations (id, status, provisioner_id, finished_at)
                SELECT 'al_' || md5(i::text), CASE WHEN i % 4 = 0 THEN 'failed' ELSE 'released'
                END, 'fake', now()
                FROM generate_series(1, 100000) AS i
                """
            )
            await conn.execute(
                """
                INSERT INTO hubd_allocations (id, provisioner_id, next_attempt_at)
                SELECT 'al_' || md5('due' || i::text), 'fake', now()
                FROM generate_series(1, 300) AS i
                """
            )
            # As autovacuum leaves a table whose rows stopped changing.
            await conn.execute("VACUUM ANALYZE hubd_allocations")
            from hubd.store.counts import SQL

            plans = [
                json.loads(await conn.fetchval("EXPLAIN (FORMAT JSON) " + bound.sql))
                for bound in (SQL.count_active(), SQL.estimate_statuses())
            ]
        count_scans, estimate_scans = (
            [
                (node["Node Type"], node.get("Index Name"))
                for node in _plan_nodes(plan[0]["Plan"])
                if node.get("Relation Name") == "hubd_allocations"
            ]
            for plan in plans
        )
        assert count_scans == [("Index Only Scan", "hubd_allocations_active_idx")], count_scans
        # The estimate reads the planner's statistics, never the table.
        assert estimate_scans == [], estimate_scans
        counts = await status_counts(db)
        assert counts[Status.PENDING] == 300
        assert counts[Status.ALLOCATED] == 0
        assert 70_000 <= counts[Status.RELEASED] <= 80_000
        assert 20_000 <= counts[Status.FAILED] <= 30_000
        assert counts[Status.DESTROY_FAILED] == 0

    async def test_concurrent_claimers_never_share_a_row(
        self, store: AllocationStore, db: Database
    ) -> None:
        """Eight claimers racing over 2,000 due rows claim every row exactly once."""
        async with db.pool.acquire() as conn:
            await conn.execute(
                """
                INSERT INTO hubd_allocations (id, provisioner_id, next_attempt_at)
                SELECT 'al_' || md5(i::text), 'fake', now() FROM generate_series(1, 2000) AS i
                """
            )
        claims: list[tuple[str, str]] = []

        async def claimer() -> None:
            while True:
                lease = new_lease()
                claimed = await claim_next(store, lease_id=lease, lease_duration=60)
                if claimed is None:
                    return
                claims.append((claimed.id, lease))

        async with asyncio.TaskGroup() as group:
            for _ in range(8):
                group.create_task(claimer())
        ids = [allocation_id for allocation_id, _ in claims]
        assert len(ids) == 2000
        assert len(set(ids)) == 2000
        async with db.pool.acquire() as conn:
            rows = await conn.fetch("SELECT id, lease_id FROM hubd_allocations")
        assert {row["id"]: row["lease_id"] for row in rows} == dict(claims)


class TestTransitions:
    async def test_release_path_and_history(
        self, store: AllocationStore, db: Database, ledger: LedgerStore
    ) -> None:
        """The ledger tells the story of an allocation oldest first with from/to statuses."""
        fence = await drive_to(store, db, Status.ALLOCATED)
        await store.write(fence, BeginInitialization().transition())
        ready = await store.write(fence, MarkReady(connection_seq=0).transition())
        assert ready is not None
        assert ready.ready
        assert ready.lease_id is None
        assert ready.next_attempt_at is None
        history = await ledger.history(fence.allocation_id)
        assert [(e.kind, e.from_status, e.to_status) for e in history] == [
            ("request", None, "pending"),
            ("bind_sidecar", "pending", "provisioning"),
            ("mark_allocated", "provisioning", "allocated"),
            ("begin_initialization", "allocated", "allocated"),
            ("mark_ready", "allocated", "allocated"),
        ]

    async def test_connection_facts_fence_the_claims_writes(
        self, store: AllocationStore, db: Database
    ) -> None:
        """A connect or disconnect recorded after a claim looked (connection number N) leaves
        the claim's lease alone, but turns its park into "due now" and its mark-ready into a
        follow-up; a park at the number it saw waits for the connect deadline."""
        fence = await drive_to(store, db, Status.ALLOCATED)
        row = await store.get(fence.allocation_id)
        assert row.sidecar_id is not None
        await InstanceStore(db).register("in_test", "here", 1, None)
        connections = ConnectionStore(db, instance_id="in_test")
        target = Target(fence.allocation_id, fence.generation)
        record = await connections.record("cn_1", target, row.sidecar_id)
        assert record.seq == row.connection_seq + 1
        leased = await store.get(fence.allocation_id)
        assert leased.lease_id == fence.lease_id
        follow_up = await store.write(
            fence, MarkReady(connection_seq=row.connection_seq).transition()
        )
        assert follow_up is not None
        assert not follow_up.connection_ready
        assert follow_up.lease_id is None
        assert follow_up.next_attempt_at is not None
        again = await claim_one(store, fence.allocation_id)
        assert await connections.disconnect(fence.allocation_id, "cn_1", connect_timeout=30)
        lost = await store.get(fence.allocation_id)
        assert lost.lease_id == again.lease_id, "a disconnect never touches a claim's lease"
        stale = await store.write(
            again,
            Park(mode=ParkMode.AWAIT_CONNECTION, delay=30, connection_seq=record.seq).transition(),
        )
        assert stale is not None
        assert stale.next_attempt_at is not None
        assert stale.connect_deadline is not None
        assert stale.next_attempt_at < stale.connect_deadline
        third = await claim_one(store, fence.allocation_id)
        parked = await store.write(
            third,
            Park(
                mode=ParkMode.AWAIT_CONNECTION, delay=30, connection_seq=lost.connection_seq
            ).transition(),
        )
        assert parked is not None
        assert parked.next_attempt_at == parked.connect_deadline

    async def test_disconnects_in_one_statement_each_as_if_alone(
        self, store: AllocationStore, db: Database
    ) -> None:
        """disconnect_many clears each closed connection's record and marks its sidecar lost
        exactly as disconnect does alone: of twin allocations in the same state, one is
        disconnected alone and the other in one batch with every other case, and the twins
        end alike (answer, record, status, readiness, schedule, lease, ledger)."""
        await InstanceStore(db).register("in_test", "here", 1, None)
        connections = ConnectionStore(db, instance_id="in_test")

        async def prepared(case: str, twin: str) -> Disconnect:
            status = Status.PROVISIONING if case == "provisioning" else Status.ALLOCATED
            fence = await drive_to(store, db, status)
            row = await store.get(fence.allocation_id)
            assert row.sidecar_id is not None
            target = Target(fence.allocation_id, fence.generation)
            closed = f"cn_{case}_{twin}"
            if case != "gone":
                await connections.record(closed, target, row.sidecar_id)
            if case == "superseded":
                await connections.record(f"cn_newer_{twin}", target, row.sidecar_id)
            if case != "leased":
                # Parked: no claim holds the row, so a loss reschedules it.
                async with db.pool.acquire() as conn:
                    await conn.execute(
                        "UPDATE hubd_allocations SET lease_id = NULL, lease_expires_at = NULL, "
                        "next_attempt_at = now() + interval '1 hour', "
                        "connect_deadline = now() + interval '1 hour' WHERE id = $1",
                        fence.allocation_id,
                    )
            return Disconnect(fence.allocation_id, closed)

        async def shape(closed: Disconnect, seq_before: int) -> tuple[object, ...]:
            row = await store.get(closed.allocation_id)
            async with db.pool.acquire() as conn:
                record = await conn.fetchval(
                    "SELECT connection_id FROM hubd_sidecar_connections WHERE allocation_id = $1",
                    closed.allocation_id,
                )
            history = await LedgerStore(db, instance_id="in_test").history(closed.allocation_id)
            return (
                str(row.status),
                row.connection_ready,
                row.connection_seq - seq_before,
                row.lease_id is None,
                row.next_attempt_at is not None and row.next_attempt_at == row.connect_deadline,
                None if record is None else record.split("_")[1],
                history[-1].kind,
            )

        cases = ["parked", "leased", "superseded", "provisioning", "gone"]
        alone = {case: await prepared(case, "a") for case in cases}
        batched = {case: await prepared(case, "b") for case in cases}
        seqs = {
            closed: (await store.get(closed.allocation_id)).connection_seq
            for closed in (*alone.values(), *batched.values())
        }
        answers_alone = {
            case: await connections.disconnect(
                closed.allocation_id, closed.connection_id, connect_timeout=30
            )
            for case, closed in alone.items()
        }
        answers = await connections.disconnect_many(list(batched.values()), connect_timeout=30)
        assert {case: answers[closed] for case, closed in batched.items()} == answers_alone
        assert answers_alone == {
            "parked": True,
            "leased": True,
            "superseded": False,
            "provisioning": True,
            "gone": False,
        }
        for case in cases:
            assert await shape(batched[case], seqs[batched[case]]) == await shape(
                alone[case], seqs[alone[case]]
            ), case
        parked = await shape(alone["parked"], seqs[alone["parked"]])
        assert parked == ("allocated", False, 1, True, True, None, "connection_lost")
        leased = await shape(alone["leased"], seqs[alone["leased"]])
        assert leased[3] is False, "a disconnect never touches a claim's lease"

    async def test_replacement_only_if_initialization_incomplete(
        self, store: AllocationStore, db: Database
    ) -> None:
        """A replacement conditioned on an incomplete initialization does nothing once the
        initialization marker is gone, and replaces while it is recorded."""
        fence = await drive_to(store, db, Status.ALLOCATED)
        conditional = Abandon(
            release=False,
            expected=Status.ALLOCATED,
            delay=1.0,
            failure=Failure("sidecar_initialization_uncertain", "x"),
            only_if_initialization_incomplete=True,
        )
        assert await store.write(fence, conditional.transition()) is None
        started = await store.write(fence, BeginInitialization().transition())
        assert started is not None
        assert started.initialization_lease_id == fence.lease_id
        assert (
            await store.write(
                fence,
                attrs.evolve(
                    conditional, expected_initialization_lease_id=new_lease()
                ).transition(),
            )
            is None
        )
        replaced = await store.write(fence, conditional.transition())
        assert replaced is not None
        assert replaced.status is Status.REPLACING
        assert replaced.generation == fence.generation + 1
        assert replaced.ensure_attempts == 1
        assert replaced.initialization_lease_id is None

    async def test_retry_bumps_named_counter(self, store: AllocationStore, db: Database) -> None:
        """A destroy retry bumps the destroy counter, records the failure and drops the lease."""
        fence = await drive_to(store, db, Status.REPLACING)
        retried = await store.write(
            fence,
            Retry(
                expected=Status.REPLACING,
                delay=4,
                attempt_kind=AttemptKind.DESTROY,
                failure=Failure("destroy_failed", "nope"),
            ).transition(),
        )
        assert retried is not None
        assert retried.destroy_attempts == 1
        assert retried.failure_code == "destroy_failed"
        assert retried.lease_id is None

    async def test_wake_and_reconnect_repair(self, store: AllocationStore, db: Database) -> None:
        """wake makes a parked row due now; the reconnect repair schedules only an unleased
        allocated row that reads ready without a live record."""
        fence = await drive_to(store, db, Status.ALLOCATED)
        await store.write(fence, Park(mode=ParkMode.AWAIT_CONNECTION, delay=30).transition())
        assert await store.wake(fence.allocation_id, fence.generation + 1) is False
        assert await store.wake(fence.allocation_id, fence.generation) is True
        again = await claim_one(store, fence.allocation_id)
        ready = await store.write(again, MarkReady(connection_seq=0).transition())
        assert ready is not None
        assert ready.ready
        async with db.pool.acquire() as conn:
            await conn.execute(
                "UPDATE hubd_allocations SET lease_id = 'ls_x', "
                "lease_expires_at = now() + interval '1 minute' WHERE id = $1",
                fence.allocation_id,
            )
        assert await store.mark_unconnected(instance_ttl=20, connect_timeout=30) == 0  # leased
        await expire_lease(db, fence.allocation_id)
        assert await store.mark_unconnected(instance_ttl=20, connect_timeout=30) == 1
        repaired = await store.get(fence.allocation_id)
        assert repaired.next_attempt_at is not None
        assert not repaired.connection_ready

    async def test_terminal_rows_refuse_schedule(self, db: Database) -> None:
        """The schema itself refuses a terminal row with a schedule or a lease."""
        async with db.pool.acquire() as conn:
            with pytest.raises(asyncpg.CheckViolationError):
                await conn.execute(
                    "INSERT INTO hubd_allocations (id, status, provisioner_id, next_attempt_at) "
                    "VALUES ('al_x', 'released', 'fake', now())"
                )
            with pytest.raises(asyncpg.CheckViolationError):
                await conn.execute(
                    "INSERT INTO hubd_allocations (id, status, provisioner_id) "
                    "VALUES ('al_y', 'lost', 'fake')"
                )
            with pytest.raises(asyncpg.CheckViolationError):
                await conn.execute(
                    "INSERT INTO hubd_allocations (id, generation, provisioner_id) "
                    "VALUES ('al_z', 0, 'fake')"
                )

    @pytest.mark.parametrize(
        ("table", "column", "value"),
        [
            ("hubd_allocations", "ensure_attempts", "-1"),
            ("hubd_allocations", "destroy_attempts", "-1"),
            ("hubd_allocations", "spec", "'[]'::jsonb"),
            ("hubd_allocations", "token_hash", "'\\x00'::bytea"),
            ("hubd_allocation_ledger", "phase", "'done'"),
            ("hubd_allocation_ledger", "generation", "0"),
            ("hubd_allocation_ledger", "error_code", "repeat('x', 65)"),
            ("hubd_allocation_ledger", "message", "repeat('x', 501)"),
            ("hubd_allocation_ledger", "duration_ms", "-0.5"),
            ("hubd_sidecar_secrets", "generation", "0"),
            ("hubd_sidecar_secrets", "secret_hash", "'\\x00'::bytea"),
            ("hubd_sidecar_secrets", "previous_hash", "'\\x00'::bytea"),
        ],
    )
    async def test_each_column_rule_refuses_a_bad_value(
        self, store: AllocationStore, db: Database, table: str, column: str, value: str
    ) -> None:
        """Each rule about one column (a domain since migration 11) refuses a value that breaks
        it, in an update that assigns only that column, and the row keeps what it had."""
        allocation = await store.request(provisioner_id="fake")
        async with db.pool.acquire() as conn:
            await conn.execute(
                "INSERT INTO hubd_allocation_ledger (allocation_id, generation, kind, phase) "
                "VALUES ($1, 1, 'test', 'committed')",
                allocation.id,
            )
            await conn.execute(
                "INSERT INTO hubd_sidecar_secrets (allocation_id, generation, sidecar_id) "
                "VALUES ($1, 1, 'sc_x')",
                allocation.id,
            )
            key = "allocation_id" if table != "hubd_allocations" else "id"
            # The names and values are this test's own parameters, not input.
            read = f"SELECT {column}::text FROM {table} WHERE {key} = $1"  # noqa: S608
            before = await conn.fetchval(read, allocation.id)
            with pytest.raises(asyncpg.CheckViolationError):
                await conn.execute(
                    f"UPDATE {table} SET {column} = {value} WHERE {key} = $1",  # noqa: S608
                    allocation.id,
                )
            after = await conn.fetchval(read, allocation.id)
            assert after == before


class TestLedger:
    async def test_effects_are_fenced(
        self, store: AllocationStore, db: Database, ledger: LedgerStore
    ) -> None:
        """An effect is recorded under the live lease and refused under a lost one."""
        fence = await drive_to(store, db, Status.PROVISIONING)
        assert await ledger.record_effect(
            fence, effect_id="ef_1", kind="ensure", phase=Phase.INTENT, status=Status.PROVISIONING
        )
        await expire_lease(db, fence.allocation_id)
        assert not await ledger.record_effect(
            fence,
            effect_id="ef_1",
            kind="ensure",
            phase=Phase.COMMITTED,
            status=Status.PROVISIONING,
        )

    async def test_open_intents_settle_as_ambiguous_once(
        self, store: AllocationStore, db: Database, ledger: LedgerStore
    ) -> None:
        """An intent left open by an earlier lease is recorded ambiguous by the next owner,
        exactly once; intents with an outcome are left alone."""
        fence = await drive_to(store, db, Status.PROVISIONING)
        for effect_id in ("ef_open", "ef_done"):
            await ledger.record_effect(
                fence,
                effect_id=effect_id,
                kind="ensure",
                phase=Phase.INTENT,
                status=Status.PROVISIONING,
            )
        await ledger.record_effect(
            fence,
            effect_id="ef_done",
            kind="ensure",
            phase=Phase.COMMITTED,
            status=Status.PROVISIONING,
        )
        await expire_lease(db, fence.allocation_id)
        await age_row(db, fence.allocation_id, 1)
        second = await claim_one(store, fence.allocation_id)
        assert await ledger.settle_open_effects(second) == 1
        assert await ledger.settle_open_effects(second) == 0
        ambiguous = [
            e for e in await ledger.history(fence.allocation_id) if e.phase is Phase.AMBIGUOUS
        ]
        assert [(e.effect_id, e.lease_id, e.kind) for e in ambiguous] == [
            ("ef_open", fence.lease_id, "ensure")
        ]

    async def test_transitions_carry_a_plugin_calls_rows_in_order(
        self, store: AllocationStore, db: Database, ledger: LedgerStore
    ) -> None:
        """A bind writes the ensure's intent after its own row; the acceptance writes the
        outcome before its own rows, and parks in the same statement."""
        allocation = await store.request(provisioner_id="fake")
        fence = await claim_one(store, allocation.id)
        intent = EffectRow(
            effect_id=new_effect_id(), kind="ensure", phase=Phase.INTENT, status=Status.PROVISIONING
        )
        bound = await store.write(
            fence,
            BindInitial(
                sidecar_id="sc_" + "a" * 32,
                token_hash=token_hash(),
                connect_timeout=120,
                api_version="1",
                binding_fingerprint="fp",
            ).transition([intent]),
        )
        assert bound is not None
        outcome = attrs.evolve(intent, phase=Phase.COMMITTED, duration_ms=1.5)
        parked = await store.write(
            fence,
            AcceptAndPark(
                accepted=MarkAllocated(external_ref="ref-9"),
                park=Park(
                    mode=ParkMode.AWAIT_CONNECTION,
                    delay=30,
                    connection_seq=bound.connection_seq,
                    ready_within=20,
                ),
            ).transition([outcome]),
        )
        assert parked is not None
        assert parked.status is Status.ALLOCATED
        assert parked.external_ref == "ref-9"
        assert parked.lease_id is None
        assert parked.next_attempt_at == parked.connect_deadline
        rows = [
            (e.kind, str(e.phase), e.effect_id, e.lease_id)
            for e in await ledger.history(allocation.id)
        ]
        assert rows == [
            ("request", "committed", None, None),
            ("bind_sidecar", "committed", None, fence.lease_id),
            ("ensure", "intent", intent.effect_id, fence.lease_id),
            ("ensure", "committed", intent.effect_id, fence.lease_id),
            ("mark_allocated", "committed", None, fence.lease_id),
            ("park_await_connection", "committed", None, fence.lease_id),
        ]

    async def test_an_outcome_is_written_only_with_its_transition(
        self, store: AllocationStore, db: Database, ledger: LedgerStore
    ) -> None:
        """A transition whose fence no longer holds writes neither itself nor the plugin call's
        outcome: the intent stays open for the next owner to settle."""
        fence = await drive_to(store, db, Status.RELEASING)
        intent = EffectRow(
            effect_id=new_effect_id(), kind="destroy", phase=Phase.INTENT, status=Status.RELEASING
        )
        assert await ledger.record_effect(
            fence,
            effect_id=intent.effect_id,
            kind=intent.kind,
            phase=intent.phase,
            status=intent.status,
        )
        before = await ledger.history(fence.allocation_id)
        await expire_lease(db, fence.allocation_id)
        outcome = attrs.evolve(intent, phase=Phase.COMMITTED)
        assert await store.write(fence, MarkReleased().transition([outcome])) is None
        assert await ledger.history(fence.allocation_id) == before
        await age_row(db, fence.allocation_id, 1)
        claimed = await store.claim_due(lease_ids=[new_lease()], lease_duration=LEASE_SECONDS)
        assert [c.open_effects for c in claimed] == [True]

    async def test_a_claim_to_destroy_writes_the_destroy_intent(
        self, store: AllocationStore, db: Database, ledger: LedgerStore
    ) -> None:
        """Claiming a releasing row with a bound sidecar writes the destroy's intent under the
        new lease; giving the lease back settles it as never called."""
        fence = await drive_to(store, db, Status.PROVISIONING)
        await store.release(fence.allocation_id)
        await age_row(db, fence.allocation_id, LEASE_SECONDS + 1)
        lease = new_lease()
        (claimed,) = await store.claim_due(lease_ids=[lease], lease_duration=LEASE_SECONDS)
        assert claimed.destroy_intent is not None
        assert not claimed.open_effects
        intents = [e for e in await ledger.history(fence.allocation_id) if e.kind == "destroy"]
        assert [(e.effect_id, e.lease_id, str(e.phase), e.to_status) for e in intents] == [
            (claimed.destroy_intent, lease, "intent", "releasing")
        ]
        assert await store.drop_lease(fence.allocation_id, lease)
        settled = [e for e in await ledger.history(fence.allocation_id) if e.kind == "destroy"]
        assert [(str(e.phase), e.error_code) for e in settled] == [
            ("intent", None),
            ("failed", "not_called"),
        ]
        again = await claim_one(store, fence.allocation_id)
        assert again.lease_id != lease

    async def test_a_claim_that_calls_nothing_writes_no_intent(
        self, store: AllocationStore, db: Database, ledger: LedgerStore
    ) -> None:
        """Claiming a pending row, or a releasing one with nothing bound, writes no intent."""
        allocation = await store.request(provisioner_id="fake")
        (claimed,) = await store.claim_due(lease_ids=[new_lease()], lease_duration=60)
        assert claimed.destroy_intent is None
        assert [e.kind for e in await ledger.history(allocation.id)] == ["request"]

    async def test_ledger_is_append_only(self, store: AllocationStore, db: Database) -> None:
        """The schema refuses updates and deletes of ledger rows."""
        await store.request(provisioner_id="fake")
        async with db.pool.acquire() as conn:
            with pytest.raises(asyncpg.RaiseError, match="append-only"):
                await conn.execute("UPDATE hubd_allocation_ledger SET kind = 'x'")
            with pytest.raises(asyncpg.RaiseError, match="append-only"):
                await conn.execute("DELETE FROM hubd_allocation_ledger")

    async def test_messages_are_scrubbed(
        self, store: AllocationStore, db: Database, ledger: LedgerStore
    ) -> None:
        """A failure message carrying a token is stored with the token redacted."""
        canary = "hubd_sc_" + "ab" * 32
        fence = await drive_to(store, db, Status.PROVISIONING)
        await store.write(
            fence,
            Abandon(
                release=False,
                expected=Status.PROVISIONING,
                delay=1,
                failure=Failure("ensure_failed", f"plugin said {canary} and Bearer {canary}"),
            ).transition(),
        )
        async with db.pool.acquire() as conn:
            dump = await conn.fetchval(
                "SELECT string_agg(t::text, ' ') FROM (SELECT * FROM hubd_allocations) t"
            )
            dump += await conn.fetchval(
                "SELECT string_agg(t::text, ' ') FROM (SELECT * FROM hubd_allocation_ledger) t"
            )
        assert canary not in dump
        assert "***" in dump


class TestLeasePool:
    async def test_renewal_does_not_wait_behind_a_saturated_pool(
        self, store: AllocationStore, db: Database
    ) -> None:
        """With every connection of the ordinary pool held by slow work, lease renewals still
        go through on the lease pool."""
        allocation = await store.request(provisioner_id="fake")
        fence = await claim_one(store, allocation.id)
        held = [await db.pool.acquire() for _ in range(db.pool.get_max_size())]
        try:
            async with asyncio.timeout(5):
                assert await store.renew_lease(allocation.id, fence.lease_id, LEASE_SECONDS)
        finally:
            for conn in held:
                await db.pool.release(conn)


class TestBrokenConnections:
    @pytest.mark.parametrize(
        "error",
        [
            asyncpg.InternalClientError(
                "cannot switch to state 12; another operation (2) is in progress"
            ),
            asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
        ],
        ids=["protocol-state-lost", "closed-mid-operation"],
    )
    async def test_a_driver_error_is_an_outage_and_the_connection_is_not_reused(
        self, db: Database, error: Exception
    ) -> None:
        """When the driver loses a connection mid-protocol (the server's shutdown message
        reaching an idle pooled connection just before its next query), the caller sees the
        database as unavailable, the connection is closed rather than pooled again, and the
        next statement runs on a sound one."""
        backends = []

        async def broken_statement() -> None:
            async with db.connection("a statement") as conn:
                backends.append(conn.get_server_pid())
                raise error

        with pytest.raises(DatabaseUnavailable):
            await broken_statement()
        (backend,) = backends

        async def backend_gone() -> bool:
            async with db.connection("look") as other:
                alive = await other.fetchval(
                    "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)", backend
                )
            return not alive

        await eventually(backend_gone, within=10, what="the broken connection's backend gone")
        assert await status_counts(db) == dict.fromkeys(Status, 0)


async def test_a_statement_is_planned_once_per_connection(db: Database) -> None:
    """The daemon's connections keep one generic plan per prepared statement: PostgreSQL's
    default would plan these parameterised statements afresh on every execution, and planning
    cost more than running them."""
    from hubd.store.allocations import SQL

    async with db.connection("plans") as conn:
        for _ in range(8):
            await db.fetchrow("get", SQL.get_allocation(allocation_id="al_missing"), conn=conn)
        plans = await conn.fetchrow(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement = $1",
            SQL.get_allocation(allocation_id="al_missing").sql,
        )
    assert plans is not None
    assert plans["custom_plans"] == 0
    assert plans["generic_plans"] == 8
