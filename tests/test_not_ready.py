"""A sidecar that can no longer serve says ``not_ready`` (architecture §4, *Publish and ready*):
where its allocation is ready once the sidecar says so, ``ready`` drops, the feed says so, and
the connect deadline's rules apply again. Real sockets, real PostgreSQL, the real reconciler."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection

from hubd.routing import Target
from hubd.store import AllocationStore, Database, LedgerStore, Status
from hubd.store.connections import ConnectionStore
from tests.pgtime import age_row
from tests.reconcilerkit import ReconcilerRig
from tests.wskit import (
    Hub,
    Sidecar,
    close_code_of,
    connection_seq,
    dial,
    record_row,
    running_hub,
    sidecar_in,
    welcome_of,
)

CONNECT_TIMEOUT = 30.0


@pytest.fixture
async def hub(db: Database) -> AsyncIterator[Hub]:
    options = {"connect_timeout": CONNECT_TIMEOUT}
    async with running_hub(db, ready_on_connect=True, router_options=options) as running:
        yield running


@pytest.fixture
def rig(
    db: Database, database_url: str, store: AllocationStore, ledger: LedgerStore
) -> ReconcilerRig:
    return ReconcilerRig(db=db, database_url=database_url, store=store, ledger=ledger)


async def declared_and_parked(store: AllocationStore, db: Database) -> Sidecar:
    """An allocated allocation that is ready once its sidecar says so, parked waiting for it
    (no lease: a declaration decides on its own)."""
    sidecar, _ = await sidecar_in(store, db)
    async with db.pool.acquire() as conn:
        await conn.execute(
            "UPDATE hubd_allocations SET ready_when = 'declared', lease_id = NULL, "
            "lease_expires_at = NULL WHERE id = $1",
            sidecar.allocation_id,
        )
    return sidecar


async def say(ws: ClientConnection, kind: str) -> dict[str, Any]:
    await ws.send(json.dumps({"type": kind}))
    answer: dict[str, Any] = json.loads(await ws.recv())
    return answer


async def row_of(db: Database, allocation_id: str) -> dict[str, Any]:
    async with db.pool.acquire() as conn:
        row = await conn.fetchrow(
            "SELECT connection_ready, connection_seq, next_attempt_at, lease_id, "
            "extract(epoch FROM connect_deadline - now())::float8 AS deadline_in, "
            "extract(epoch FROM next_attempt_at - now())::float8 AS due_in "
            "FROM hubd_allocations WHERE id = $1",
            allocation_id,
        )
    assert row is not None
    return dict(row)


async def events_of(db: Database, allocation_id: str) -> list[tuple[str, bool]]:
    """The feed's events of the allocation, oldest first: (event, ready)."""
    async with db.pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT event, ready FROM hubd_v1.events WHERE allocation_id = $1 ORDER BY position",
            allocation_id,
        )
    return [(row["event"], row["ready"]) for row in rows]


async def ledger_kinds(db: Database, allocation_id: str) -> list[str]:
    history = await LedgerStore(db, instance_id="t").history(allocation_id)
    return [entry.kind for entry in history]


class TestNotReady:
    async def test_ready_drops_and_comes_back(
        self, db: Database, store: AllocationStore, hub: Hub
    ) -> None:
        """A declared-ready allocation whose sidecar says ``not_ready`` reads not ready at
        once, with a ``not_ready`` event, a ledger row and a connect deadline
        ``connect_timeout`` away (when it is also due); the socket stays open, and its next
        ``ready`` makes it ready again."""
        sidecar = await declared_and_parked(store, db)
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcome_of(ws)
            await ws.send(json.dumps({"type": "welcome_ack"}))
            assert await say(ws, "ready") == {"type": "ready_recorded"}
            assert (await row_of(db, sidecar.allocation_id))["connection_ready"]
            before = await connection_seq(db, sidecar.allocation_id)
            assert await say(ws, "not_ready") == {"type": "not_ready_recorded"}
            row = await row_of(db, sidecar.allocation_id)
            assert not row["connection_ready"]
            assert row["connection_seq"] == before + 1
            assert CONNECT_TIMEOUT - 10 < row["deadline_in"] <= CONNECT_TIMEOUT
            assert row["due_in"] == pytest.approx(row["deadline_in"], abs=1)
            record = await record_row(db, sidecar.allocation_id)
            assert record is not None
            assert not record["declared_ready"]
            assert record["seq"] == before + 1
            readiness = await hub.connections.readiness(sidecar.target, 20)
            assert not readiness.connected
            assert not await hub.router.is_ready(sidecar.target)
            # Said twice, it changes nothing more.
            assert await say(ws, "not_ready") == {"type": "not_ready_recorded"}
            assert await connection_seq(db, sidecar.allocation_id) == before + 1
            assert await say(ws, "ready") == {"type": "ready_recorded"}
            row = await row_of(db, sidecar.allocation_id)
            assert row["connection_ready"]
            assert row["deadline_in"] is None
            assert row["next_attempt_at"] is None
            assert await events_of(db, sidecar.allocation_id) == [
                ("requested", False),
                ("provisioning", False),
                ("allocated", False),
                ("ready", True),
                ("not_ready", False),
                ("ready", True),
            ]
        assert hub.server.stats.declared_not_ready == 2
        kinds = await ledger_kinds(db, sidecar.allocation_id)
        assert kinds.count("sidecar_not_ready") == 1
        assert kinds.count("mark_ready") == 2

    async def test_before_ready_it_keeps_the_deadline(
        self, db: Database, store: AllocationStore, hub: Hub
    ) -> None:
        """A sidecar that declared and withdraws before its allocation became ready (a claim
        holds it) is undeclared again, its connection number bumped (the claim's next write
        sees it), its deadline and schedule as they were, and no ledger row written."""
        sidecar, _ = await sidecar_in(store, db)
        async with db.pool.acquire() as conn:
            await conn.execute(
                "UPDATE hubd_allocations SET ready_when = 'declared' WHERE id = $1",
                sidecar.allocation_id,
            )
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcome_of(ws)
            await ws.send(json.dumps({"type": "welcome_ack"}))
            assert await say(ws, "ready") == {"type": "ready_recorded"}
            declared = await row_of(db, sidecar.allocation_id)
            assert not declared["connection_ready"]
            assert (await hub.connections.readiness(sidecar.target, 20)).connected
            assert await say(ws, "not_ready") == {"type": "not_ready_recorded"}
            row = await row_of(db, sidecar.allocation_id)
            assert row["connection_seq"] == declared["connection_seq"] + 1
            assert row["next_attempt_at"] == declared["next_attempt_at"]
            assert row["lease_id"] == declared["lease_id"]
            assert not (await hub.connections.readiness(sidecar.target, 20)).connected
        assert "sidecar_not_ready" not in await ledger_kinds(db, sidecar.allocation_id)

    async def test_connected_mode_ignores_it(
        self, db: Database, hub: Hub, sidecar: Sidecar
    ) -> None:
        """Where connecting is enough, a ``not_ready`` is answered and writes nothing: the
        sidecar's word is not what makes such an allocation ready."""
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcome_of(ws)
            await ws.send(json.dumps({"type": "welcome_ack"}))
            before = await connection_seq(db, sidecar.allocation_id)
            assert await say(ws, "not_ready") == {"type": "not_ready_recorded"}
            assert await connection_seq(db, sidecar.allocation_id) == before

    async def test_before_ack_refused(self, db: Database, store: AllocationStore, hub: Hub) -> None:
        """A ``not_ready`` before the welcome is acknowledged closes the socket with 4003."""
        sidecar = await declared_and_parked(store, db)
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcome_of(ws)
            await ws.send(json.dumps({"type": "not_ready"}))
            assert await close_code_of(ws) == 4003
            assert ws.close_reason == "not_ready before welcome_ack"

    async def test_superseded_socket_withdraws_nothing(
        self, db: Database, store: AllocationStore, hub: Hub
    ) -> None:
        """A socket whose record a newer connection took over writes nothing when it says
        ``not_ready``, and is closed with 4000: only the current connection speaks for the
        sidecar."""
        sidecar = await declared_and_parked(store, db)
        async with dial(hub.url, sidecar.headers()) as old:
            await welcome_of(old)
            await old.send(json.dumps({"type": "welcome_ack"}))
            peer = ConnectionStore(db, instance_id="in_peer", ready_on_connect=True)
            taken = await peer.record("cn_peer", sidecar.target, sidecar.sidecar_id)
            assert taken.seq is not None
            declared = await peer.declare_ready("cn_peer", sidecar.target)
            assert declared.ready
            await old.send(json.dumps({"type": "not_ready"}))
            assert await close_code_of(old) == 4000
        assert (await row_of(db, sidecar.allocation_id))["connection_ready"]


class TestConnectDeadline:
    async def declared_ready(self, rig: ReconcilerRig) -> tuple[Target, str]:
        """An allocation made ready by its sidecar's declaration, through the reconciler:
        its target and the connection id of its record."""
        allocation = await rig.store.request(provisioner_id="fake", ready_when="declared")
        assert await rig.reconciler.reconcile_next()
        target = Target(allocation.id, 1)
        await rig.connect(target)
        assert await rig.reconciler.reconcile_next()
        assert not (await rig.store.get(allocation.id)).ready
        connection_id = rig.router.current[allocation.id][1]
        declared = await rig.router.connections.declare_ready(connection_id, target)
        assert declared.seq is not None
        assert await rig.reconciler.reconcile_next()
        assert (await rig.store.get(allocation.id)).ready
        return target, connection_id

    async def test_a_sidecar_that_stays_not_ready_is_abandoned(
        self, db: Database, rig: ReconcilerRig
    ) -> None:
        """After ``not_ready`` the allocation is treated as a connected sidecar that has not
        declared: when its connect deadline passes without a new ``ready``, the reconciler
        abandons the sidecar (``sidecar_connect_failed``), as for one that never connected."""
        target, connection_id = await self.declared_ready(rig)
        withdrawn = await rig.router.connections.declare_not_ready(
            connection_id, target, connect_timeout=CONNECT_TIMEOUT
        )
        assert withdrawn.withdrawn
        assert not await rig.reconciler.reconcile_next()  # nothing due before the deadline
        await age_row(db, target.allocation_id, CONNECT_TIMEOUT + 1)
        assert await rig.reconciler.reconcile_next()
        abandoned = await rig.store.get(target.allocation_id)
        assert abandoned.status in (Status.REPLACING, Status.RELEASING)
        assert abandoned.failure_code == "sidecar_connect_failed"

    async def test_a_new_ready_before_the_deadline_keeps_it(
        self, db: Database, rig: ReconcilerRig
    ) -> None:
        """A ``ready`` before the deadline makes the allocation ready again; the deadline
        passing afterwards abandons nothing."""
        target, connection_id = await self.declared_ready(rig)
        connections = rig.router.connections
        await connections.declare_not_ready(connection_id, target, connect_timeout=CONNECT_TIMEOUT)
        again = await connections.declare_ready(connection_id, target)
        assert again.seq is not None
        assert await rig.reconciler.reconcile_next()
        ready = await rig.store.get(target.allocation_id)
        assert ready.ready
        await age_row(db, target.allocation_id, CONNECT_TIMEOUT + 1)
        assert not await rig.reconciler.reconcile_next()
        assert (await rig.store.get(target.allocation_id)).ready
