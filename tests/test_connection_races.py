"""Connection writes racing each other inside PostgreSQL: one replica's statement holds the
allocation's row lock, uncommitted, while another replica's statement starts and blocks on it.
What the second decides once the first commits is read back from the rows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import structlog

from hubd.reconciler.writes import MarkReady, Park
from hubd.routing import Target
from hubd.store import AllocationStore, Database, Fence, LedgerStore, ParkMode, Status
from hubd.store.connection_values import Disconnect, RecordOutcome, RecordRequest
from hubd.store.connections import SQL as CONNECTION_SQL
from hubd.store.connections import ConnectionStore
from hubd.store.instances import InstanceStore
from hubd.store.rows import effects_json
from hubd.store.transitions import SQL as TRANSITION_SQL
from tests.polling import eventually
from tests.storekit import drive_to
from tests.wskit import Sidecar, dial, record_row, running_hub, sidecar_in, welcome_of


@asynccontextmanager
async def record_held_open(
    database_url: str, connection_id: str, target: Target, sidecar_id: str, instance: str
) -> AsyncIterator[asyncpg.Connection]:
    """Replica ``instance`` records ``connection_id`` in a transaction left open (the row lock
    held) until the block ends, then commits."""
    conn = await asyncpg.connect(database_url)
    try:
        async with conn.transaction():
            record = CONNECTION_SQL.record(
                connection_ids=[connection_id],
                allocation_ids=[target.allocation_id],
                generations=[target.generation],
                sidecar_ids=[sidecar_id],
                instance_id=instance,
                ready_on_connect=False,
                rotates=[False],
                seen_hashes=[None],
                secret_hashes=[None],
                presented_hashes=[None],
                authenticates=[False],
                versions=[2],
                token_hashes=[None],
                key=b"k",
            )
            row = await conn.fetchrow(record.sql, *record.args)
            assert row["seq"] is not None
            yield conn
    finally:
        await conn.close()


async def blocked_on_a_lock(database_url: str, sessions: int = 1) -> None:
    """Wait until ``sessions`` other sessions wait for a row lock (the statements under test)."""
    conn = await asyncpg.connect(database_url)
    try:

        async def waiting() -> bool:
            n = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
            return bool(n >= sessions)

        await eventually(waiting, within=10, what="a statement waiting on the row lock")
    finally:
        await conn.close()


class TestRacingStatements:
    async def test_repair_blocked_behind_a_connect_does_not_mark_it_lost(
        self, db: Database, database_url: str, store: AllocationStore
    ) -> None:
        """A repair sweep that found no live record, then waited on the row lock of a connect
        being recorded on another replica, writes nothing once that connect commits: the
        connection number it was fenced on moved."""
        await InstanceStore(db).register("in_a", "a", 1, None)
        sidecar, fence = await sidecar_in(store, db)
        seen = await ConnectionStore(db, instance_id="in_a").readiness(sidecar.target, 20)
        ready = await store.write(fence, MarkReady(connection_seq=seen.connection_seq).transition())
        assert ready is not None
        assert ready.ready  # reads ready with no record at all: a repair candidate
        async with record_held_open(
            database_url, "cn_b", sidecar.target, sidecar.sidecar_id, "in_a"
        ):
            repair = asyncio.create_task(
                store.mark_unconnected(instance_ttl=20, connect_timeout=60)
            )
            await blocked_on_a_lock(database_url)
            assert not repair.done()
        assert await repair == 0
        after = await store.get(sidecar.allocation_id)
        assert after.ready
        assert after.connection_seq == ready.connection_seq + 1

    async def test_repair_keeps_its_own_record_when_its_instance_row_is_gone(
        self, db: Database, store: AllocationStore
    ) -> None:
        """A replica whose instance row a peer deleted (its heartbeat lapsed in an outage) still
        holds its sockets: the repair sweep it runs does not mark their allocations lost, as
        its park and readiness look do not. A peer's sweep, which holds none of them, does."""
        instances = InstanceStore(db)
        await instances.register("in_a", "a", 1, None)
        sidecar, fence = await sidecar_in(store, db)
        own = ConnectionStore(db, instance_id="in_a")
        recorded = await own.record("cn_a", sidecar.target, sidecar.sidecar_id)
        assert recorded.seq is not None
        ready = await store.write(fence, MarkReady(connection_seq=recorded.seq).transition())
        assert ready is not None
        assert ready.ready
        async with db.pool.acquire() as conn:
            await conn.execute("DELETE FROM hubd_instances WHERE id = 'in_a'")
        mine = AllocationStore(db, instance_id="in_a")
        assert await mine.mark_unconnected(instance_ttl=20, connect_timeout=60) == 0
        assert (await store.get(sidecar.allocation_id)).ready
        peer = AllocationStore(db, instance_id="in_b")
        assert await peer.mark_unconnected(instance_ttl=20, connect_timeout=60) == 1
        after = await store.get(sidecar.allocation_id)
        assert not after.connection_ready
        assert after.connect_deadline is not None

    async def test_reassert_blocked_behind_a_takeover_leaves_the_new_record(
        self, db: Database, database_url: str, store: AllocationStore
    ) -> None:
        """Replica A writing back its swept record while the sidecar's new socket is being
        recorded on replica B: once B commits, A writes nothing (the newer record stays) and is
        told so, so it closes its socket instead of stealing the record back."""
        instances = InstanceStore(db)
        await instances.register("in_a", "a", 1, None)
        await instances.register("in_b", "b", 2, None)
        sidecar, _ = await sidecar_in(store, db)
        a = ConnectionStore(db, instance_id="in_a")
        assert (await a.record("cn_a", sidecar.target, sidecar.sidecar_id)).seq is not None
        async with db.pool.acquire() as conn:  # a peer's sweep removed A's record
            await conn.execute("DELETE FROM hubd_sidecar_connections WHERE connection_id = 'cn_a'")
        async with record_held_open(
            database_url, "cn_b", sidecar.target, sidecar.sidecar_id, "in_b"
        ):
            reassert = asyncio.create_task(a.reassert("cn_a", sidecar.target, sidecar.sidecar_id))
            await blocked_on_a_lock(database_url)
        assert await reassert is None
        record = await record_row(db, sidecar.allocation_id)
        assert record is not None
        assert (record["connection_id"], record["instance_id"]) == ("cn_b", "in_b")

    async def test_disconnect_blocked_behind_a_reconnect_changes_nothing(
        self, db: Database, database_url: str, store: AllocationStore
    ) -> None:
        """The close of A's socket, waiting on the lock of the sidecar's reconnect being
        recorded on B, clears nothing and marks nothing lost once B commits."""
        instances = InstanceStore(db)
        await instances.register("in_a", "a", 1, None)
        await instances.register("in_b", "b", 2, None)
        sidecar, fence = await sidecar_in(store, db)
        a = ConnectionStore(db, instance_id="in_a")
        record = await a.record("cn_a", sidecar.target, sidecar.sidecar_id)
        assert record.seq is not None
        ready = await store.write(fence, MarkReady(connection_seq=record.seq).transition())
        assert ready is not None
        async with record_held_open(
            database_url, "cn_b", sidecar.target, sidecar.sidecar_id, "in_b"
        ):
            disconnect = asyncio.create_task(
                a.disconnect(sidecar.allocation_id, "cn_a", connect_timeout=60)
            )
            await blocked_on_a_lock(database_url)
        assert await disconnect is False
        after = await store.get(sidecar.allocation_id)
        assert after.ready
        assert after.status is Status.ALLOCATED
        kept = await record_row(db, sidecar.allocation_id)
        assert kept is not None
        assert kept["connection_id"] == "cn_b"

    async def test_batched_disconnects_one_blocked_behind_a_reconnect(
        self, db: Database, database_url: str, store: AllocationStore
    ) -> None:
        """Two of A's sockets close in one batch while one sidecar's reconnect is being
        recorded on B: once B commits, that allocation keeps B's record and stays ready, and the
        other is cleared and marked lost, each as it would be alone."""
        instances = InstanceStore(db)
        await instances.register("in_a", "a", 1, None)
        await instances.register("in_b", "b", 2, None)
        a = ConnectionStore(db, instance_id="in_a")
        sidecars = []
        for _ in range(2):
            sidecar, fence = await sidecar_in(store, db)
            record = await a.record(
                "cn_a_" + sidecar.allocation_id, sidecar.target, sidecar.sidecar_id
            )
            assert record.seq is not None
            assert await store.write(fence, MarkReady(connection_seq=record.seq).transition())
            sidecars.append(sidecar)
        moved, left = sidecars
        closed = [Disconnect(s.allocation_id, "cn_a_" + s.allocation_id) for s in sidecars]
        async with record_held_open(database_url, "cn_b", moved.target, moved.sidecar_id, "in_b"):
            batch = asyncio.create_task(a.disconnect_many(closed, connect_timeout=60))
            await blocked_on_a_lock(database_url)
        answers = await batch
        assert [answers[each] for each in closed] == [False, True]
        kept = await store.get(moved.allocation_id)
        assert kept.ready
        kept_record = await record_row(db, moved.allocation_id)
        assert kept_record is not None
        assert kept_record["connection_id"] == "cn_b"
        lost = await store.get(left.allocation_id)
        assert lost.status is Status.ALLOCATED
        assert not lost.connection_ready
        assert lost.connect_deadline is not None
        assert await record_row(db, left.allocation_id) is None

    async def test_release_blocked_behind_a_connect_deletes_its_record(
        self, db: Database, database_url: str, store: AllocationStore
    ) -> None:
        """A user's release waiting on the row lock of a connect being recorded on replica B
        moves the allocation to a new generation once B commits, and deletes the record B just
        wrote in the same transaction: no record of the fenced sidecar outlives it, though no
        socket close will clear it."""
        await InstanceStore(db).register("in_b", "b", 2, None)
        sidecar, _ = await sidecar_in(store, db)
        async with record_held_open(
            database_url, "cn_b", sidecar.target, sidecar.sidecar_id, "in_b"
        ):
            release = asyncio.create_task(store.release(sidecar.allocation_id))
            await blocked_on_a_lock(database_url)
        released = await release
        assert (released.status, released.generation) == (Status.RELEASING, sidecar.generation + 1)
        assert await record_row(db, sidecar.allocation_id) is None

    async def test_connect_blocked_behind_a_release_writes_nothing(
        self, db: Database, database_url: str, store: AllocationStore
    ) -> None:
        """Replica B recording a connect while a user's release holds the row lock writes no
        record once the release commits: the sidecar it names is fenced."""
        sidecar, _ = await sidecar_in(store, db)
        b = ConnectionStore(db, instance_id="in_b")
        async with db.connection("hold a release open") as conn, conn.transaction():
            await store.release(sidecar.allocation_id, conn=conn)
            record = asyncio.create_task(b.record("cn_b", sidecar.target, sidecar.sidecar_id))
            await blocked_on_a_lock(database_url)
        assert (await record).outcome is RecordOutcome.FENCED
        assert await record_row(db, sidecar.allocation_id) is None

    async def test_records_are_told_apart_by_allocation_not_by_connection_id(
        self, db: Database, store: AllocationStore
    ) -> None:
        """A connection id is unique by its random per-process prefix, not by an index: two
        replicas' records that carried the same id would still be two records, and each
        statement that reads or clears one names its allocation, so neither touches the
        other's."""
        instances = InstanceStore(db)
        await instances.register("in_a", "a", 1, None)
        await instances.register("in_b", "b", 2, None)
        on_a, on_b = [(await sidecar_in(store, db))[0] for _ in range(2)]
        a = ConnectionStore(db, instance_id="in_a")
        b = ConnectionStore(db, instance_id="in_b")
        assert (await a.record("cn_same", on_a.target, on_a.sidecar_id)).seq is not None
        assert (await b.record("cn_same", on_b.target, on_b.sidecar_id)).seq is not None

        assert await b.disconnect(on_b.allocation_id, "cn_same", connect_timeout=30)
        assert await record_row(db, on_b.allocation_id) is None
        assert await owner_of_record(db, on_a.allocation_id) == ("cn_same", "in_a")
        checks = await a.check_sockets([(on_a.allocation_id, "cn_same")])
        assert [(c.allocation_id, c.recorded_connection_id) for c in checks] == [
            (on_a.allocation_id, "cn_same")
        ]

    async def test_two_replicas_recording_the_same_allocations_do_not_deadlock(
        self, db: Database, database_url: str, store: AllocationStore
    ) -> None:
        """Two replicas' record statements over the same two allocations, given in opposite
        orders and both held up behind a third session's lock on one of them, lock rows in one
        order: both complete, and the one that went second owns both records."""
        both = [(await sidecar_in(store, db))[0] for _ in range(2)]
        first, second = sorted(both, key=lambda sidecar: sidecar.allocation_id)
        a = ConnectionStore(db, instance_id="in_a")
        b = ConnectionStore(db, instance_id="in_b")
        async with db.connection("hold the first row") as conn, conn.transaction():
            await conn.execute(
                "SELECT 1 FROM hubd_allocations WHERE id = $1 FOR UPDATE", first.allocation_id
            )
            by_a = asyncio.create_task(
                a.record_many([request("cn_a1", first), request("cn_a2", second)])
            )
            await blocked_on_a_lock(database_url)
            by_b = asyncio.create_task(
                b.record_many([request("cn_b2", second), request("cn_b1", first)])
            )
            await blocked_on_a_lock(database_url, sessions=2)
        outcomes = [record.outcome for record in [*(await by_a).values(), *(await by_b).values()]]
        assert outcomes == [RecordOutcome.RECORDED] * 4
        owners = {
            (row := await record_row(db, each.allocation_id)) and row["instance_id"]
            for each in (first, second)
        }
        assert len(owners) == 1


async def both_behind_the_row(
    db: Database,
    database_url: str,
    allocation_id: str,
    first: Coroutine[Any, Any, Any],
    second: Coroutine[Any, Any, Any],
) -> tuple[Any, Any]:
    """Start ``first``, then ``second`` once ``first`` waits, both queued behind a third
    session's lock on the allocation's row; what each returns once that session commits."""
    async with db.connection("hold the row") as conn, conn.transaction():
        await conn.execute("SELECT 1 FROM hubd_allocations WHERE id = $1 FOR UPDATE", allocation_id)
        one = asyncio.create_task(first)
        await blocked_on_a_lock(database_url)
        two = asyncio.create_task(second)
        await blocked_on_a_lock(database_url, sessions=2)
    return await one, await two


async def recorded_on_a(db: Database, store: AllocationStore, *instances: str) -> Sidecar:
    """A sidecar whose connection ``cn_a`` is recorded by instance ``in_a`` (``instances``, all
    registered, include it)."""
    for instance in instances:
        await InstanceStore(db).register(instance, instance, 1, None)
    sidecar, _ = await sidecar_in(store, db)
    a = ConnectionStore(db, instance_id="in_a")
    assert (await a.record("cn_a", sidecar.target, sidecar.sidecar_id)).seq is not None
    return sidecar


async def owner_of_record(db: Database, allocation_id: str) -> tuple[str, str] | None:
    row = await record_row(db, allocation_id)
    return None if row is None else (row["connection_id"], row["instance_id"])


async def assert_not_lost(
    db: Database, store: AllocationStore, sidecar: Sidecar, seq: int | None
) -> None:
    """The allocation still stands as the reconnect left it: a clear that waited behind the
    reconnect marked nothing lost (no connection number past the reconnect's, no ledger row)."""
    row = await store.get(sidecar.allocation_id)
    assert seq is not None
    assert row.connection_seq == seq
    ledger = await LedgerStore(db, instance_id="in_test").history(sidecar.allocation_id)
    assert not [e for e in ledger if e.kind in ("connection_lost", "connection_swept")]


class TestLockOrder:
    """Statements that clear records take the allocation's row before the record's, as records
    and transitions do. The other way round, a clear and a write of the same allocation at the
    same moment wait on each other and PostgreSQL aborts one of them (a handshake refused with
    1011, or a sweep, a close or a release failing once). Each test queues the two statements
    behind a third session's lock on the allocation, so that both are under way when it commits:
    the order in which each takes its locks decides whether they can both complete."""

    async def test_a_close_and_a_reconnect_on_another_replica_both_complete(
        self, db: Database, database_url: str, store: AllocationStore
    ) -> None:
        sidecar = await recorded_on_a(db, store, "in_a", "in_b")
        a = ConnectionStore(db, instance_id="in_a")
        b = ConnectionStore(db, instance_id="in_b")
        reconnect, close = await both_behind_the_row(
            db,
            database_url,
            sidecar.allocation_id,
            b.record("cn_b", sidecar.target, sidecar.sidecar_id),
            a.disconnect(sidecar.allocation_id, "cn_a", connect_timeout=60),
        )
        # The reconnect queued first, so it goes first; the close then finds B's record.
        assert reconnect.outcome is RecordOutcome.RECORDED
        assert close is False
        assert await owner_of_record(db, sidecar.allocation_id) == ("cn_b", "in_b")
        await assert_not_lost(db, store, sidecar, reconnect.seq)

    async def test_a_close_and_a_release_both_complete(
        self, db: Database, database_url: str, store: AllocationStore
    ) -> None:
        sidecar = await recorded_on_a(db, store, "in_a")
        a = ConnectionStore(db, instance_id="in_a")
        released, close = await both_behind_the_row(
            db,
            database_url,
            sidecar.allocation_id,
            store.release(sidecar.allocation_id),
            a.disconnect(sidecar.allocation_id, "cn_a", connect_timeout=60),
        )
        assert (released.status, released.generation) == (Status.RELEASING, sidecar.generation + 1)
        # The release's own transaction deleted the record: the close has nothing left to do.
        assert close is False
        assert await owner_of_record(db, sidecar.allocation_id) is None

    async def test_a_sweep_and_a_reconnect_to_a_live_replica_both_complete(
        self, db: Database, database_url: str, store: AllocationStore
    ) -> None:
        sidecar = await recorded_on_a(db, store, "in_a", "in_b", "in_c")
        async with db.pool.acquire() as conn:  # A stops heartbeating
            await conn.execute(
                "UPDATE hubd_instances SET heartbeat_at = now() - interval '1 hour'"
                " WHERE id = 'in_a'"
            )
        b = ConnectionStore(db, instance_id="in_b")
        sweeper = ConnectionStore(db, instance_id="in_c")
        reconnect, swept = await both_behind_the_row(
            db,
            database_url,
            sidecar.allocation_id,
            b.record("cn_b", sidecar.target, sidecar.sidecar_id),
            sweeper.sweep_stale(60, connect_timeout=60),
        )
        assert reconnect.outcome is RecordOutcome.RECORDED
        # B's record replaced A's before the sweep got the row: a live replica's, left alone.
        assert swept == []
        assert await owner_of_record(db, sidecar.allocation_id) == ("cn_b", "in_b")
        await assert_not_lost(db, store, sidecar, reconnect.seq)

    async def test_a_clean_stop_and_a_reconnect_to_another_replica_both_complete(
        self, db: Database, database_url: str, store: AllocationStore
    ) -> None:
        sidecar = await recorded_on_a(db, store, "in_a", "in_b")
        a = ConnectionStore(db, instance_id="in_a")
        b = ConnectionStore(db, instance_id="in_b")
        reconnect, stopped = await both_behind_the_row(
            db,
            database_url,
            sidecar.allocation_id,
            b.record("cn_b", sidecar.target, sidecar.sidecar_id),
            a.release_instance(connect_timeout=60),
        )
        assert reconnect.outcome is RecordOutcome.RECORDED
        assert stopped == []
        assert await owner_of_record(db, sidecar.allocation_id) == ("cn_b", "in_b")
        await assert_not_lost(db, store, sidecar, reconnect.seq)


async def parked(store: AllocationStore, db: Database) -> tuple[Sidecar, Fence]:
    """An allocated sidecar whose claim parked it to wait for its connect (no lease held)."""
    sidecar, fence = await sidecar_in(store, db)
    current = await store.get(sidecar.allocation_id)
    written = await store.write(
        fence,
        Park(
            mode=ParkMode.AWAIT_CONNECTION, delay=60, connection_seq=current.connection_seq
        ).transition(),
    )
    assert written is not None
    assert written.lease_id is None
    return sidecar, fence


def request(connection_id: str, sidecar: Sidecar) -> RecordRequest:
    return RecordRequest(connection_id, sidecar.target, sidecar.sidecar_id)


class TestReadyOnConnect:
    async def test_connect_of_a_parked_allocation_makes_it_ready_in_the_same_statement(
        self, db: Database, store: AllocationStore
    ) -> None:
        """With no on-ready hook, the record of a parked allocation's connect makes it ready,
        unscheduled and unleased, with its ledger row, and no claim is needed."""
        sidecar, _ = await parked(store, db)
        connections = ConnectionStore(db, instance_id="in_a", ready_on_connect=True)
        record = await connections.record("cn_a", sidecar.target, sidecar.sidecar_id)
        assert record.ready
        after = await store.get(sidecar.allocation_id)
        assert after.ready
        assert after.next_attempt_at is None
        assert after.connect_deadline is None
        assert after.lease_id is None
        assert after.connection_seq == record.seq
        history = await LedgerStore(db, instance_id="in_a").history(sidecar.allocation_id)
        assert history[-1].kind == "mark_ready"
        assert history[-1].instance_id == "in_a"

    async def test_a_connect_made_ready_logs_one_line(
        self, db: Database, store: AllocationStore
    ) -> None:
        """A connect that its record statement makes ready is one ``sidecar_connected`` line
        saying so, with the socket's identity; a connect that only wakes its allocation says
        ``ready`` false on the same line."""
        sidecar, _ = await parked(store, db)
        waking, _ = await sidecar_in(store, db)
        with structlog.testing.capture_logs() as logs:
            async with running_hub(db, ready_on_connect=True) as hub:
                for each in (sidecar, waking):
                    async with dial(hub.url, each.headers()) as ws:
                        await welcome_of(ws)
                await eventually(lambda: len(hub.events.disconnected) == 2)
        connected = [entry for entry in logs if entry["event"] == "sidecar_connected"]
        assert [(entry["allocation_id"], entry["ready"]) for entry in connected] == [
            (sidecar.allocation_id, True),
            (waking.allocation_id, False),
        ]
        for entry in connected:
            assert {"generation", "sidecar_id", "connection_id", "remote", "seq"} <= set(entry)
        assert not [entry for entry in logs if entry["event"] == "sidecar_ready_on_connect"]

    async def test_connect_with_a_hook_or_under_a_live_lease_only_wakes(
        self, db: Database, store: AllocationStore
    ) -> None:
        """With an on-ready hook to run, or while a claim holds the lease, the record only
        makes the allocation due: the claim decides."""
        leased, fence = await sidecar_in(store, db)
        sidecar, _ = await parked(store, db)
        hooked = ConnectionStore(db, instance_id="in_a", ready_on_connect=False)
        record = await hooked.record("cn_a", sidecar.target, sidecar.sidecar_id)
        assert not record.ready
        after = await store.get(sidecar.allocation_id)
        assert not after.ready
        assert after.next_attempt_at is not None

        direct = ConnectionStore(db, instance_id="in_a", ready_on_connect=True)
        record = await direct.record("cn_b", leased.target, leased.sidecar_id)
        assert not record.ready
        after = await store.get(leased.allocation_id)
        assert not after.ready
        assert after.lease_id == fence.lease_id

    async def test_connect_blocked_behind_a_claim_leaves_it_to_the_claim(
        self, db: Database, database_url: str, store: AllocationStore
    ) -> None:
        """A connect recorded while another replica's claim of the parked allocation holds its
        row lock, uncommitted: once the claim commits, the record sees the live lease and only
        bumps the connection number, so the claim's park or ready falls through to a look."""
        sidecar, _ = await parked(store, db)
        async with db.pool.acquire() as conn:
            await conn.execute(
                "UPDATE hubd_allocations SET next_attempt_at = now() WHERE id = $1",
                sidecar.allocation_id,
            )
        claimer = await asyncpg.connect(database_url)
        try:
            async with claimer.transaction():
                await claimer.execute(
                    "UPDATE hubd_allocations SET lease_id = 'ls_claim', "
                    "lease_expires_at = now() + interval '60 seconds' WHERE id = $1",
                    sidecar.allocation_id,
                )
                connections = ConnectionStore(db, instance_id="in_a", ready_on_connect=True)
                record = asyncio.create_task(
                    connections.record("cn_a", sidecar.target, sidecar.sidecar_id)
                )
                await blocked_on_a_lock(database_url)
                assert not record.done()
        finally:
            await claimer.close()
        assert not (await record).ready
        after = await store.get(sidecar.allocation_id)
        assert not after.ready
        assert after.lease_id == "ls_claim"

    async def test_connect_blocked_behind_the_claims_acceptance_makes_it_ready(
        self, db: Database, database_url: str, store: AllocationStore
    ) -> None:
        """A connect recorded while the claim's park accepting the ensure (provisioning →
        allocated, parked for the connect) holds the row lock, uncommitted: once the claim
        commits, the record finds the allocation parked for it and makes it ready, in one
        statement. The record's snapshot still shows the row provisioning; building the new row
        from that version must not trip the ready-only-when-allocated check."""
        fence = await drive_to(store, db, Status.PROVISIONING)
        bound = await store.get(fence.allocation_id)
        assert bound.sidecar_id is not None
        claim = await asyncpg.connect(database_url)
        try:
            async with claim.transaction():
                park = TRANSITION_SQL.park(
                    **fence.parameters(store.instance_id),
                    effects=effects_json((), accepted=True),
                    accept=True,
                    external_ref="ref-1",
                    endpoint=None,
                    metadata=None,
                    mode=str(ParkMode.AWAIT_CONNECTION),
                    delay=30.0,
                    failure_code=None,
                    failure_message=None,
                    connection_seq=bound.connection_seq,
                    ready_within=30.0,
                )
                # The statement is in set form: each parameter an array, here of one row.
                parked_row = await claim.fetchrow(park.sql, *([arg] for arg in park.args))
                assert parked_row["status"] == "allocated"
                assert not parked_row["connection_ready"]
                connections = ConnectionStore(db, instance_id="in_a", ready_on_connect=True)
                record = asyncio.create_task(
                    connections.record(
                        "cn_a", Target(fence.allocation_id, fence.generation), bound.sidecar_id
                    )
                )
                await blocked_on_a_lock(database_url)
                assert not record.done()
        finally:
            await claim.close()
        recorded = await record
        assert recorded.outcome is RecordOutcome.RECORDED
        assert recorded.ready
        after = await store.get(fence.allocation_id)
        assert (after.status, after.ready, after.lease_id) == (Status.ALLOCATED, True, None)
        kinds = [
            entry.kind
            for entry in await LedgerStore(db, instance_id="in_a").history(fence.allocation_id)
        ]
        assert kinds[-2:] == ["park_await_connection", "mark_ready"]


class TestPools:
    async def test_connect_is_recorded_while_claims_and_lookups_hold_every_connection(
        self, db: Database, store: AllocationStore
    ) -> None:
        """With every connection of the main pool (claims) and the identity pool (handshake
        look-ups) taken, a sidecar's connect is still recorded and made ready at once: socket
        records have connections of their own."""
        sidecar, _ = await parked(store, db)
        held = [
            (pool, await pool.acquire())
            for pool in (db.pool, db.identity_pool)
            for _ in range(pool.get_max_size())
        ]
        try:
            connections = ConnectionStore(db, instance_id="in_a", ready_on_connect=True)
            async with asyncio.timeout(10):
                record = await connections.record("cn_a", sidecar.target, sidecar.sidecar_id)
            assert record.ready
        finally:
            for pool, conn in held:
                await pool.release(conn)
        assert (await store.get(sidecar.allocation_id)).ready

    async def test_a_released_connection_keeps_its_session(self, db: Database) -> None:
        """Connections go back to their pool without asyncpg's reset round trip: a session
        setting made on one is still there for its next user (hubd makes none; this is how
        the saved round trip shows)."""
        async with db.pool.acquire() as conn:
            pid = await conn.fetchval("SELECT pg_backend_pid()")
            await conn.execute("SET application_name = 'hubd-kept'")
        async with db.pool.acquire() as conn:
            assert await conn.fetchval("SELECT pg_backend_pid()") == pid
            assert await conn.fetchval("SHOW application_name") == "hubd-kept"
            await conn.execute("RESET application_name")


class TestParkOrReady:
    async def test_a_park_finding_its_sidecar_connected_makes_it_ready(
        self, db: Database, store: AllocationStore
    ) -> None:
        """A claim parking with no on-ready hook to run, whose sidecar already holds a live
        record, makes the row ready in the same statement, with a mark_ready ledger row; one
        whose sidecar has not connected parks until the connect deadline."""
        await InstanceStore(db).register("in_a", "a", 1, None)
        sidecar, fence = await sidecar_in(store, db)
        waiting, waiting_fence = await sidecar_in(store, db)
        connections = ConnectionStore(db, instance_id="in_a")
        assert (await connections.record("cn_a", sidecar.target, sidecar.sidecar_id)).seq
        current = await store.get(sidecar.allocation_id)
        ready = await store.write(
            fence,
            Park(
                mode=ParkMode.AWAIT_CONNECTION,
                delay=60,
                connection_seq=current.connection_seq,
                ready_within=20,
            ).transition(),
        )
        assert ready is not None
        assert ready.ready
        assert ready.next_attempt_at is None
        assert ready.connect_deadline is None
        assert ready.lease_id is None
        history = await LedgerStore(db, instance_id="in_a").history(sidecar.allocation_id)
        assert history[-1].kind == "mark_ready"

        before = await store.get(waiting.allocation_id)
        parked_row = await store.write(
            waiting_fence,
            Park(
                mode=ParkMode.AWAIT_CONNECTION,
                delay=60,
                connection_seq=before.connection_seq,
                ready_within=20,
            ).transition(),
        )
        assert parked_row is not None
        assert not parked_row.ready
        assert parked_row.next_attempt_at == before.connect_deadline

    async def test_a_park_blocked_behind_a_disconnect_does_not_make_it_ready(
        self, db: Database, database_url: str, store: AllocationStore
    ) -> None:
        """The park's look finds the record, then waits on the row lock of the sidecar's
        disconnect on another replica: once that commits, the row is not made ready (its
        connection number moved past the look) but due now for another look."""
        await InstanceStore(db).register("in_a", "a", 1, None)
        sidecar, fence = await sidecar_in(store, db)
        connections = ConnectionStore(db, instance_id="in_a")
        assert (await connections.record("cn_a", sidecar.target, sidecar.sidecar_id)).seq
        seen = (await store.get(sidecar.allocation_id)).connection_seq
        closer = await asyncpg.connect(database_url)
        try:
            async with closer.transaction():
                gone = CONNECTION_SQL.disconnect_many(
                    allocation_ids=[sidecar.allocation_id],
                    connection_ids=["cn_a"],
                    instance_id="in_a",
                    connect_timeout=60.0,
                )
                assert (await closer.fetchrow(gone.sql, *gone.args))["connection_id"] == "cn_a"
                park = asyncio.create_task(
                    store.write(
                        fence,
                        Park(
                            mode=ParkMode.AWAIT_CONNECTION,
                            delay=60,
                            connection_seq=seen,
                            ready_within=20,
                        ).transition(),
                    )
                )
                await blocked_on_a_lock(database_url)
                assert not park.done()
        finally:
            await closer.close()
        written = await park
        assert written is not None
        assert not written.ready
        assert written.connection_seq == seen + 1
        history = await LedgerStore(db, instance_id="in_a").history(sidecar.allocation_id)
        assert history[-1].kind == "follow_up"
