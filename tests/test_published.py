"""What a sidecar is told and what it tells: the welcome's spec, tenant and session, its publish
and its declared readiness (architecture §4), over real sockets and real PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed
from websockets.typing import Subprotocol

from hubd.reconciler.writes import Abandon, Park
from hubd.store import AllocationStore, Database, Failure, Status
from hubd.store.connections import ConnectionStore
from hubd.store.inputs import ParkMode
from hubd.store.instances import InstanceStore
from hubd.store.ledger import LedgerStore
from tests.polling import eventually
from tests.wskit import (
    INSTANCE_ID,
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


async def assert_alive(ws: ClientConnection) -> None:
    pong = await ws.ping()
    async with asyncio.timeout(10):
        await pong


@pytest.fixture
async def hub(db: Database) -> AsyncIterator[Hub]:
    async with running_hub(db) as running:
        yield running


async def serve_for(
    db: Database, sidecar: Sidecar, *, spec: dict[str, Any], tenant: str, session: str
) -> None:
    """Give the sidecar's allocation what an application requested with."""
    async with db.pool.acquire() as conn:
        await conn.execute(
            "UPDATE hubd_allocations SET spec = $2::text::jsonb, tenant_id = $3, session_id = $4"
            " WHERE id = $1",
            sidecar.allocation_id,
            json.dumps(spec),
            tenant,
            session,
        )


class TestWelcome:
    @pytest.mark.parametrize("version", ["hubd.sidecar.v2", "hubd.sidecar.v1"])
    async def test_welcome_says_what_the_sidecar_serves(
        self, db: Database, store: AllocationStore, hub: Hub, version: str
    ) -> None:
        """The welcome of either protocol version carries the allocation's spec, tenant and
        session, and how it becomes ready."""
        sidecar, _ = await sidecar_in(store, db)
        spec = {"image": "worker:1", "limits": {"cpu": 2}, "tags": ["a", "b"]}
        await serve_for(db, sidecar, spec=spec, tenant="acme", session="s-42")
        async with dial(hub.url, sidecar.headers(), subprotocols=[Subprotocol(version)]) as ws:
            welcome = await welcome_of(ws)
        assert welcome["spec"] == spec
        assert welcome["tenant"] == "acme"
        assert welcome["session"] == "s-42"
        assert welcome["ready_when"] == "connected"
        assert ("reconnect_secret" in welcome) == (version == "hubd.sidecar.v2")

    async def test_unlabelled_allocation(self, hub: Hub, sidecar: Sidecar) -> None:
        """An allocation requested without tenant or session says so with nulls, and an
        empty spec."""
        async with dial(hub.url, sidecar.headers()) as ws:
            welcome = await welcome_of(ws)
        assert (welcome["spec"], welcome["tenant"], welcome["session"]) == ({}, None, None)


async def published_of(db: Database, allocation_id: str) -> tuple[str | None, Any]:
    """The row's endpoint and metadata."""
    async with db.pool.acquire() as conn:
        row = await conn.fetchrow(
            "SELECT endpoint, metadata FROM hubd_allocations WHERE id = $1", allocation_id
        )
    assert row is not None
    return row["endpoint"], row["metadata"]


async def answer_of(ws: ClientConnection) -> dict[str, Any]:
    async with asyncio.timeout(10):
        answer: dict[str, Any] = json.loads(await ws.recv())
    return answer


async def welcomed(ws: ClientConnection) -> dict[str, Any]:
    """The welcome, acknowledged."""
    welcome = await welcome_of(ws)
    await ws.send(json.dumps({"type": "welcome_ack"}))
    return welcome


async def publish(ws: ClientConnection, **fields: Any) -> dict[str, Any]:
    await ws.send(json.dumps({"type": "publish", **fields}))
    return await answer_of(ws)


async def set_ready_when(db: Database, allocation_id: str, ready_when: str) -> None:
    async with db.pool.acquire() as conn:
        await conn.execute(
            "UPDATE hubd_allocations SET ready_when = $2 WHERE id = $1", allocation_id, ready_when
        )


async def park(db: Database, allocation_id: str) -> None:
    """Parked waiting for its sidecar: no lease, so a connect (or a declaration) decides."""
    async with db.pool.acquire() as conn:
        await conn.execute(
            "UPDATE hubd_allocations SET lease_id = NULL, lease_expires_at = NULL WHERE id = $1",
            allocation_id,
        )


async def is_ready(db: Database, allocation_id: str) -> bool:
    async with db.pool.acquire() as conn:
        ready: bool = await conn.fetchval(
            "SELECT connection_ready FROM hubd_allocations WHERE id = $1", allocation_id
        )
    return ready


class TestPublish:
    async def test_publish_lands_on_the_row(self, db: Database, hub: Hub, sidecar: Sidecar) -> None:
        """A publish is stored on the allocation's row and answered with ``published``; a
        later one merges its metadata key by key, a key given null removes it, and an
        endpoint it does not name stays."""
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcomed(ws)
            first = await publish(
                ws, endpoint="http://10.0.0.5:8080", metadata={"pid": 41, "zone": "a"}
            )
            assert first == {"type": "published"}
            assert await published_of(db, sidecar.allocation_id) == (
                "http://10.0.0.5:8080",
                {"pid": 41, "zone": "a"},
            )
            await publish(ws, metadata={"zone": None, "port": 8080})
            assert await published_of(db, sidecar.allocation_id) == (
                "http://10.0.0.5:8080",
                {"pid": 41, "port": 8080},
            )
            await assert_alive(ws)
        assert hub.server.stats.published == 2

    async def test_v1_publishes_after_its_welcome(
        self, db: Database, hub: Hub, sidecar: Sidecar
    ) -> None:
        """A v1 sidecar, which sends no acknowledgement, may publish once welcomed."""
        v1 = [Subprotocol("hubd.sidecar.v1")]
        async with dial(hub.url, sidecar.headers(), subprotocols=v1) as ws:
            await welcome_of(ws)
            assert await publish(ws, endpoint="unix:///run/s.sock") == {"type": "published"}
        assert (await published_of(db, sidecar.allocation_id))[0] == "unix:///run/s.sock"

    async def test_publish_before_ack_refused(
        self, db: Database, hub: Hub, sidecar: Sidecar
    ) -> None:
        """A v2 publish before the welcome is acknowledged is closed with 4003, nothing
        written."""
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcome_of(ws)
            await ws.send(json.dumps({"type": "publish", "endpoint": "http://early"}))
            assert await close_code_of(ws) == 4003
            assert ws.close_reason == "publish before welcome_ack"
        assert await published_of(db, sidecar.allocation_id) == (None, None)
        await eventually(lambda: hub.events.disconnected == [sidecar.target])

    @pytest.mark.parametrize(
        "fields",
        [
            {"metadata": [1, 2]},
            {"metadata": "text"},
            {"endpoint": 42},
            {"endpoint": ""},
            {"endpoint": "x" * 1025},
            {"endpoint": "http://a\nb"},
            {"metadata": {"blob": "x" * 16 * 1024}},
            {"metadata": {"deep": json.loads("[" * 20 + "]" * 20)}},
            {},
            {"endpoint": None, "metadata": None},
        ],
        ids=[
            "list",
            "string",
            "endpoint-number",
            "endpoint-empty",
            "endpoint-long",
            "endpoint-control",
            "oversized",
            "too-deep",
            "empty",
            "nulls",
        ],
    )
    async def test_bad_publish_closed_4003(
        self, db: Database, hub: Hub, sidecar: Sidecar, fields: dict[str, Any]
    ) -> None:
        """A malformed, oversized or empty publish closes the socket with 4003 and a reason,
        and writes nothing; the hub goes on serving."""
        async with dial(hub.url, sidecar.headers()) as ws:
            welcome = await welcomed(ws)
            await ws.send(json.dumps({"type": "publish", "endpoint": "http://kept"}))
            assert await answer_of(ws) == {"type": "published"}
            await ws.send(json.dumps({"type": "publish", **fields}))
            assert await close_code_of(ws) == 4003
            assert ws.close_reason.startswith("publish: ")
        assert await published_of(db, sidecar.allocation_id) == ("http://kept", None)
        assert hub.server.stats.protocol_errors == 1
        # The listener still serves: the sidecar reconnects with its secret (the token alone
        # stops being accepted once the welcome's acknowledgement has committed).
        secret = {"Hubd-Reconnect-Secret": welcome["reconnect_secret"]}
        async with dial(hub.url, sidecar.headers(**secret)) as again:
            await welcome_of(again)

    async def test_merge_past_the_cap_refused(
        self, db: Database, hub: Hub, sidecar: Sidecar
    ) -> None:
        """Two publishes that each fit but together pass 16 KiB: the second is refused with
        4003 and the first stays as it was."""
        half = {"a": "x" * 9000}
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcomed(ws)
            await publish(ws, metadata=half)
            await ws.send(json.dumps({"type": "publish", "metadata": {"b": "y" * 9000}}))
            assert await close_code_of(ws) == 4003
            assert "merged metadata" in ws.close_reason
        assert (await published_of(db, sidecar.allocation_id))[1] == half

    async def test_superseded_socket_publishes_nothing(
        self, db: Database, hub: Hub, sidecar: Sidecar
    ) -> None:
        """A socket whose record a newer connection of its sidecar took over writes nothing
        when it publishes; it is closed with 4000."""
        async with dial(hub.url, sidecar.headers()) as old:
            await welcomed(old)
            # A newer record written by a peer, which this hub has not acted on when the old
            # socket publishes (the publish is what finds it out).
            peer = ConnectionStore(db, instance_id="in_peer")
            taken = await peer.record("cn_peer", sidecar.target, sidecar.sidecar_id)
            assert taken.seq is not None
            await old.send(json.dumps({"type": "publish", "endpoint": "http://stale"}))
            assert await close_code_of(old) == 4000
        assert await published_of(db, sidecar.allocation_id) == (None, None)

    async def test_fenced_socket_publishes_nothing(
        self, db: Database, store: AllocationStore, hub: Hub
    ) -> None:
        """A socket of a generation its allocation left behind writes nothing when it
        publishes, and nothing reaches the new generation."""
        sidecar, fence = await sidecar_in(store, db)
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcomed(ws)
            replaced = await store.write(
                fence,
                Abandon(
                    release=False,
                    expected=Status.ALLOCATED,
                    delay=0,
                    failure=Failure("sidecar_connect_failed", "test"),
                ).transition(),
            )
            assert replaced is not None
            with contextlib.suppress(ConnectionClosed):
                await ws.send(json.dumps({"type": "publish", "endpoint": "http://old-gen"}))
            assert await close_code_of(ws) == 4002
        assert await published_of(db, sidecar.allocation_id) == (None, None)


class TestDeclaredReadiness:
    async def test_ready_when_the_sidecar_says_so(
        self, db: Database, store: AllocationStore
    ) -> None:
        """With ready_when 'declared', a connect leaves a parked allocation not ready; the
        sidecar's ``ready`` makes it ready in the statement that records it, with its ledger
        row, and is answered."""
        sidecar, _ = await sidecar_in(store, db)
        await set_ready_when(db, sidecar.allocation_id, "declared")
        await park(db, sidecar.allocation_id)
        async with (
            running_hub(db, ready_on_connect=True) as hub,
            dial(hub.url, sidecar.headers()) as ws,
        ):
            welcome = await welcomed(ws)
            assert welcome["ready_when"] == "declared"
            await publish(ws, endpoint="http://10.0.0.9:80")
            readiness = await hub.connections.readiness(sidecar.target, 20)
            assert not readiness.connected
            assert not await is_ready(db, sidecar.allocation_id)
            await ws.send(json.dumps({"type": "ready"}))
            assert await answer_of(ws) == {"type": "ready_recorded"}
            assert await is_ready(db, sidecar.allocation_id)
            assert (await hub.connections.readiness(sidecar.target, 20)).connected
            assert await hub.router.is_ready(sidecar.target)
            # A second declaration changes nothing.
            seq = await connection_seq(db, sidecar.allocation_id)
            await ws.send(json.dumps({"type": "ready"}))
            assert await answer_of(ws) == {"type": "ready_recorded"}
            assert await connection_seq(db, sidecar.allocation_id) == seq
        history = await LedgerStore(db, instance_id="t").history(sidecar.allocation_id)
        assert [entry.kind for entry in history].count("mark_ready") == 1

    async def test_declaration_wakes_a_claim_when_it_cannot_decide(
        self, db: Database, store: AllocationStore, hub: Hub
    ) -> None:
        """Under a live lease (or with an on-ready hook) the declaration does not make the
        allocation ready itself: it bumps the connection number, which fences the claim's
        next connection-dependent write, and makes the row due."""
        sidecar, _ = await sidecar_in(store, db)
        await set_ready_when(db, sidecar.allocation_id, "declared")
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcomed(ws)
            before = await connection_seq(db, sidecar.allocation_id)
            await ws.send(json.dumps({"type": "ready"}))
            assert await answer_of(ws) == {"type": "ready_recorded"}
            assert await connection_seq(db, sidecar.allocation_id) == before + 1
            assert not await is_ready(db, sidecar.allocation_id)
            row = await record_row(db, sidecar.allocation_id)
            assert row is not None
            assert row["declared_ready"]
            assert row["seq"] == before + 1
            assert (await hub.connections.readiness(sidecar.target, 20)).connected

    async def test_connected_mode_ignores_the_declaration(
        self, db: Database, hub: Hub, sidecar: Sidecar
    ) -> None:
        """Where connecting is enough, a ``ready`` is answered and writes nothing."""
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcomed(ws)
            before = await connection_seq(db, sidecar.allocation_id)
            await ws.send(json.dumps({"type": "ready"}))
            assert await answer_of(ws) == {"type": "ready_recorded"}
            assert await connection_seq(db, sidecar.allocation_id) == before

    async def test_ready_before_ack_refused(self, db: Database, hub: Hub, sidecar: Sidecar) -> None:
        """A ``ready`` before the welcome is acknowledged closes the socket with 4003."""
        await set_ready_when(db, sidecar.allocation_id, "declared")
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcome_of(ws)
            await ws.send(json.dumps({"type": "ready"}))
            assert await close_code_of(ws) == 4003
        row = await record_row(db, sidecar.allocation_id)
        assert row is None or not row["declared_ready"]

    async def test_park_does_not_take_a_connect_for_a_declaration(
        self, db: Database, store: AllocationStore
    ) -> None:
        """A claim that parks an allocated row whose sidecar is connected but has not
        declared leaves it not ready, due at its connect deadline: at that deadline the claim
        finds it not connected, as if the sidecar had never dialled."""
        sidecar, fence = await sidecar_in(store, db)
        await set_ready_when(db, sidecar.allocation_id, "declared")
        peer = ConnectionStore(db, instance_id=INSTANCE_ID)
        await InstanceStore(db).register(INSTANCE_ID, "here", 1, None)
        record = await peer.record("cn_one", sidecar.target, sidecar.sidecar_id)
        assert record.seq is not None
        readiness = await peer.readiness(sidecar.target, 20)
        assert not readiness.connected
        parked = await store.write(
            fence,
            Park(
                mode=ParkMode.AWAIT_CONNECTION,
                delay=60,
                connection_seq=readiness.connection_seq,
                ready_within=20,
            ).transition(),
        )
        assert parked is not None
        assert not parked.connection_ready
        assert parked.next_attempt_at is not None


class TestAcrossReplicas:
    async def test_only_the_current_replica_socket_publishes(
        self, db: Database, sidecar: Sidecar
    ) -> None:
        """A sidecar that reconnected to another replica (with its secret) publishes there;
        its old socket, still open on the first replica, which has not heard of the takeover,
        writes nothing when it publishes and is closed with 4000."""
        async with (
            running_hub(db, instance_id="in_one") as one,
            running_hub(db, instance_id="in_two") as two,
            dial(one.url, sidecar.headers()) as old,
        ):
            welcome = await welcomed(old)
            headers = sidecar.headers(**{"Hubd-Reconnect-Secret": welcome["reconnect_secret"]})
            async with dial(two.url, headers) as new:
                await welcomed(new)
                await old.send(json.dumps({"type": "publish", "endpoint": "http://one"}))
                assert await close_code_of(old) == 4000
                assert await published_of(db, sidecar.allocation_id) == (None, None)
                assert await publish(new, endpoint="http://two") == {"type": "published"}
        assert (await published_of(db, sidecar.allocation_id))[0] == "http://two"
