"""Two replicas on one database, real sockets on each: connection truth is the database's, every
connection write is safe against the other replica, and sockets follow the database wherever
they are held. Each interleaving is forced with a pause point, and each test reads the rows and
the ledger."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest

from hubd.reconciler.settings import HookContext
from hubd.store import Allocation, AllocationStore, Database, LedgerStore, Status
from tests.polling import eventually
from tests.replicakit import Replica, ReplicaRig, sidecar_of, until
from tests.wskit import close_code_of, first_message_or_close, record_row


@pytest.fixture
async def rig(
    db: Database, database_url: str, store: AllocationStore, ledger: LedgerStore
) -> AsyncIterator[ReplicaRig]:
    async with AsyncExitStack() as exits:
        yield ReplicaRig(db=db, database_url=database_url, store=store, ledger=ledger, exits=exits)


class TestConnectsLandingOnAPeer:
    async def test_connect_on_peer_before_the_park_is_seen_by_the_park(
        self, rig: ReplicaRig
    ) -> None:
        """A sidecar that connects to replica B after replica A's ensure was accepted, but
        before A parks (no on-ready hook): A's park looks at the record in its own statement and
        makes the allocation ready, under A's lease, with no second claim."""
        async with rig.pair() as (a, b):
            allocation, claim = await rig.connect_before_the_park(a, b)
            assert await claim
            ready = await rig.store.get(allocation.id)
            assert ready.ready
            assert ready.lease_id is None
            assert ready.next_attempt_at is None
            assert ready.generation == 1
            entries = await rig.ledger.history(allocation.id)
            assert entries[-1].kind == "mark_ready"
            assert entries[-1].instance_id == "hubA"
            assert not await b.reconciler.reconcile_next()

    async def test_connect_on_peer_while_a_hooked_claim_parks(self, rig: ReplicaRig) -> None:
        """With an on-ready hook to run, a sidecar that connects to replica B after replica A's
        claim found it absent, but before A parks, makes A's park fall through to "due now": the
        allocation is ready at the next claim (after the hook), not at the connect deadline."""
        hooked: list[str] = []

        async def on_ready(allocation: Allocation, _context: HookContext) -> None:
            hooked.append(allocation.id)

        async with rig.pair(on_ready=on_ready, peer_on_ready=on_ready) as (a, b):
            allocation, claim = await rig.connect_before_the_park(a, b)
            assert await claim
            after_park = await rig.store.get(allocation.id)
            assert after_park.lease_id is None
            assert after_park.next_attempt_at is not None
            assert after_park.connect_deadline is not None
            assert after_park.next_attempt_at < after_park.connect_deadline
            assert not after_park.ready
            assert await b.reconciler.reconcile_next()
            ready = await rig.store.get(allocation.id)
            assert ready.ready
            assert ready.generation == 1
            assert hooked == [allocation.id]
            assert "follow_up" in await rig.kinds(allocation.id)

    async def test_restart_during_initialization_reaching_the_peer(self, rig: ReplicaRig) -> None:
        """A sidecar restarted while A's on_ready hook runs, whose new socket reaches B, takes
        over (A's old socket gets 4000) and makes A's mark-ready an immediate follow-up: the
        hook runs again before the allocation is ready."""
        hook_calls = 0
        first_hook = asyncio.Event()
        hook_may_finish = asyncio.Event()

        async def on_ready(_allocation: Allocation, _context: HookContext) -> None:
            nonlocal hook_calls
            hook_calls += 1
            if hook_calls == 1:
                first_hook.set()
                await hook_may_finish.wait()

        async with rig.pair(on_ready=on_ready, peer_on_ready=on_ready) as (a, b):
            allocation = await rig.store.request(provisioner_id="fake")
            assert await a.reconciler.reconcile_next()
            sidecar = sidecar_of(a.provisioner.ensure_calls[-1])
            old = await rig.open_socket(a, sidecar)
            claim = asyncio.create_task(a.reconciler.reconcile_next())
            await first_hook.wait()
            await rig.open_socket(b, sidecar)
            assert await close_code_of(old) == 4000
            hook_may_finish.set()
            assert await claim
            follow_up = await rig.store.get(allocation.id)
            assert not follow_up.ready
            assert follow_up.initialization_lease_id is None
            assert await b.reconciler.reconcile_next()
            ready = await rig.store.get(allocation.id)
            assert ready.ready
            assert ready.generation == 1
            assert hook_calls == 2
            history = await rig.kinds(allocation.id)
            assert history.index("follow_up") < history.index("mark_ready")


class TestDisconnects:
    async def test_late_disconnect_cannot_undo_the_peers_record(self, rig: ReplicaRig) -> None:
        """A's disconnect write, held until the sidecar has reconnected to B, clears nothing and
        marks nothing lost: the allocation stays ready on B's record."""
        async with rig.pair() as (a, b):
            ready, sidecar, ws = await rig.ready_on(a, a)
            disconnect = a.connections.pauses["disconnect"].arm()
            await ws.close()
            await disconnect.reached.wait()
            await rig.open_socket(b, sidecar)
            disconnect.proceed.set()
            await until(lambda: _settled(a))
            after = await rig.store.get(ready.id)
            assert after.ready
            record = await record_row(rig.db, ready.id)
            assert record is not None
            assert record["instance_id"] == "hubB"
            assert "connection_lost" not in await rig.kinds(ready.id)

    async def test_start_up_repair_never_touches_a_peers_lease(self, rig: ReplicaRig) -> None:
        """B's start-up repair, run while A's claim initializes a connected sidecar, leaves A's
        lease and the row alone; A then marks it ready."""
        started = asyncio.Event()
        finish = asyncio.Event()

        async def on_ready(_allocation: Allocation, _context: HookContext) -> None:
            started.set()
            await finish.wait()

        async with rig.pair(on_ready=on_ready) as (a, b):
            allocation = await rig.store.request(provisioner_id="fake")
            assert await a.reconciler.reconcile_next()
            await rig.open_socket(a, sidecar_of(a.provisioner.ensure_calls[-1]))
            claim = asyncio.create_task(a.reconciler.reconcile_next())
            await started.wait()
            before = await rig.store.get(allocation.id)
            await b.reconciler.initialize()
            during = await rig.store.get(allocation.id)
            assert during.lease_id == before.lease_id
            assert during.lease_id is not None
            assert during.next_attempt_at == before.next_attempt_at
            finish.set()
            assert await claim
            assert (await rig.store.get(allocation.id)).ready


class TestSocketControlAcrossReplicas:
    async def test_release_on_one_replica_fences_the_socket_on_the_other(
        self, rig: ReplicaRig
    ) -> None:
        """A release written anywhere closes the sidecar's socket on the replica holding it
        with 4002, and its record goes with it."""
        async with rig.pair() as (a, b):
            ready, _sidecar, ws = await rig.ready_on(a, b)
            await rig.store.release(ready.id)
            assert await close_code_of(ws) == 4002
            await until(lambda: _settled(b))
            assert await record_row(rig.db, ready.id) is None

    async def test_terminal_status_retires_the_socket_on_the_other(self, rig: ReplicaRig) -> None:
        """An allocation that becomes terminal while its sidecar is connected to another
        replica has that socket closed with 4001."""
        async with rig.pair() as (a, b):
            ready, _sidecar, ws = await rig.ready_on(a, b)
            async with rig.db.pool.acquire() as conn:
                await conn.execute(
                    "UPDATE hubd_allocations SET status = 'failed', connection_ready = false, "
                    "next_attempt_at = NULL, finished_at = now() WHERE id = $1",
                    ready.id,
                )
            assert await close_code_of(ws) == 4001

    async def test_takeover_across_replicas_supersedes_the_old_socket(
        self, rig: ReplicaRig
    ) -> None:
        """The same sidecar connecting to B while its socket on A is open takes over: A's socket
        gets 4000 (and must not reconnect), B's stays, and the record is B's."""
        async with rig.pair() as (a, b):
            ready, sidecar, old = await rig.ready_on(a, a)
            new = await rig.open_socket(b, sidecar)
            assert await close_code_of(old) == 4000
            await until(lambda: _settled(a))
            record = await record_row(rig.db, ready.id)
            assert record is not None
            assert record["instance_id"] == "hubB"
            assert b.router.connection_count == 1
            assert new.close_code is None
            after = await rig.store.get(ready.id)
            assert after.status is Status.ALLOCATED

    async def test_an_admission_outrun_while_its_replica_froze_is_superseded(
        self, rig: ReplicaRig
    ) -> None:
        """A's admission commits its record, then A freezes before acting on it; meanwhile the
        same sidecar is admitted on B, whose newer record A hears of while frozen. When A
        resumes, its socket opens only to be closed with 4000, never welcomed: the record, the
        only open socket and the welcome are B's."""
        async with rig.pair() as (a, b):
            allocation = await rig.store.request(provisioner_id="fake")
            assert await a.reconciler.reconcile_next()
            sidecar = sidecar_of(a.provisioner.ensure_calls[-1])
            frozen = a.connections.pauses["admitted"].arm()
            on_a = asyncio.create_task(first_message_or_close(a.url, sidecar))
            await frozen.reached.wait()
            first = await record_row(rig.db, allocation.id)
            assert first is not None
            assert first["instance_id"] == "hubA"
            new = await rig.open_socket(b, sidecar)
            second = await record_row(rig.db, allocation.id)
            assert second is not None
            assert second["instance_id"] == "hubB"
            assert second["seq"] > first["seq"]

            def heard() -> bool:
                return any(e.seen_seq == second["seq"] for e in a.router.pending(allocation.id))

            await eventually(heard)
            frozen.proceed.set()
            assert await on_a == (4000, None)
            # Its handler ends once the close handshake does, a moment after the client's.
            await eventually(lambda: a.router.connection_count == 0)
            assert a.router.sockets(allocation.id) == []
            record = await record_row(rig.db, allocation.id)
            assert record is not None
            assert record["connection_id"] == second["connection_id"]
            assert new.close_code is None
            assert b.router.connection_count == 1

    async def test_socket_check_closes_what_a_lost_notification_missed(
        self, rig: ReplicaRig
    ) -> None:
        """When the notification of a newer generation never arrives (the LISTEN connection was
        down), the periodic socket check closes the stale socket with 4002."""
        async with rig.pair() as (a, b):
            ready, _sidecar, ws = await rig.ready_on(a, b)
            async with rig.db.pool.acquire() as conn, conn.transaction():
                # Triggers off for this transaction only: the release happens, its
                # notification does not.
                await conn.execute("SET LOCAL session_replication_role = replica")
                await conn.execute(
                    "UPDATE hubd_allocations SET status = 'releasing', "
                    "generation = generation + 1, connection_ready = false WHERE id = $1",
                    ready.id,
                )
            assert b.router.sockets(ready.id), "the socket should still be open"
            assert await b.router.repair.verify() == (0, 1)
            assert await close_code_of(ws) == 4002


class TestSweptRecords:
    async def test_swept_records_come_back_at_the_same_generation(self, rig: ReplicaRig) -> None:
        """B sweeps A's records while A cannot heartbeat (an outage, a pause); A's socket check
        writes them back, and the allocation is ready again at the same generation with the
        same socket: nothing healthy is released or replaced."""
        async with rig.pair() as (a, b):
            ready, _sidecar, ws = await rig.ready_on(b, a)
            async with rig.db.pool.acquire() as conn:
                await conn.execute(
                    "UPDATE hubd_instances SET heartbeat_at = now() - interval '1 hour' "
                    "WHERE id = 'hubA'"
                )
            swept = await b.connections.sweep_stale(20, connect_timeout=60)
            assert [s.allocation_id for s in swept] == [ready.id]
            lost = await rig.store.get(ready.id)
            assert not lost.ready
            assert await a.connections.sweep_stale(20, connect_timeout=60) == []
            async with rig.db.pool.acquire() as conn:
                await conn.execute("UPDATE hubd_instances SET heartbeat_at = now()")
            assert await a.router.repair.verify() == (1, 0)
            assert await b.reconciler.reconcile_next()
            again = await rig.store.get(ready.id)
            assert again.ready
            assert again.generation == ready.generation
            assert ws.close_code is None
            history = await rig.kinds(ready.id)
            assert "connection_swept" in history
            assert "begin_replacement" not in history
            assert "begin_unrecoverable_release" not in history

    async def test_own_records_are_never_swept(self, rig: ReplicaRig) -> None:
        """A replica whose own heartbeat looks stale (it just came back from an outage) does not
        sweep its own records: its sockets are open."""
        async with rig.replica("hubA") as a:
            ready, _sidecar, _ws = await rig.ready_on(a, a)
            async with rig.db.pool.acquire() as conn:
                await conn.execute(
                    "UPDATE hubd_instances SET heartbeat_at = now() - interval '1 hour'"
                )
            assert await a.connections.sweep_stale(20, connect_timeout=60) == []
            assert await record_row(rig.db, ready.id) is not None
            assert (await rig.store.get(ready.id)).ready


async def _settled(hub: Replica) -> bool:
    """No connection step running and no socket left on ``hub``."""
    return hub.router.busy_allocations == 0 and hub.router.connection_count == 0
