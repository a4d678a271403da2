"""The sidecar server, router and connection records: real clients over loopback, real
PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import logging
import os
import resource
import secrets
import ssl
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.http11 import Request

from hubd.backoff import Backoff
from hubd.config import ServerConfig
from hubd.daemon.metrics import Metrics
from hubd.daemon.running import wake_listener
from hubd.errors import DatabaseUnavailable
from hubd.reconciler.writes import Abandon, MarkReady, MarkReleased
from hubd.routing import SidecarNotConnected, Target
from hubd.server import HandshakeRequest, SidecarServer, SocketRouter
from hubd.server.connection import SidecarConnection
from hubd.server.handshake import SECRET_HEADER
from hubd.server.limits import ListenerLimits
from hubd.server.sockets import new_connection_id
from hubd.sidecar.client import SidecarClient
from hubd.sidecar.settings import SidecarConfigError, SidecarSettings
from hubd.store import AllocationStore, Database, Failure, Status, connect_database
from hubd.store.channels import NoticeKey
from hubd.store.connection_values import RecordOutcome
from hubd.store.connections import ConnectionStore
from hubd.store.inputs import new_allocation_id
from hubd.store.instances import InstanceStore
from hubd.tokens import (
    hash_token,
    new_sidecar_id,
    new_token,
    reconnect_secret_is_well_formed,
)
from tests.polling import eventually
from tests.storekit import claim_one
from tests.test_bounds import sample
from tests.wskit import (
    CONNECT_PATH,
    INSTANCE_ID,
    Hub,
    Sidecar,
    bring_back,
    close_code_of,
    dial,
    record_row,
    rejection,
    running_hub,
    sidecar_in,
    take_away,
    welcome_of,
    wrong_token,
)


@pytest.fixture
async def hub(db: Database) -> AsyncIterator[Hub]:
    async with running_hub(db) as running:
        yield running


@pytest.fixture
async def spare_db(database_url: str) -> AsyncIterator[Database]:
    """A second set of pools on the test database, for a test to take away and bring back."""
    database = await connect_database(database_url, pool_size=4)
    try:
        yield database
    finally:
        await database.close()


async def assert_alive(ws: ClientConnection) -> None:
    """The socket still answers a ping: nothing that happened elsewhere stalled it."""
    pong = await ws.ping()
    async with asyncio.timeout(10):
        await pong


class TestHandshake:
    async def test_welcome(self, db: Database, hub: Hub, sidecar: Sidecar) -> None:
        """A good handshake is upgraded, gets its welcome, and is recorded durably first."""
        async with dial(hub.url, sidecar.headers()) as ws:
            assert ws.subprotocol == "hubd.sidecar.v2"
            welcome = await welcome_of(ws)
            secret = welcome.pop("reconnect_secret")
            assert reconnect_secret_is_well_formed(secret)
            assert welcome == {
                "type": "welcome",
                "allocation_id": sidecar.allocation_id,
                "sidecar_id": sidecar.sidecar_id,
                "generation": sidecar.generation,
                "heartbeat_interval_s": 20.0,
                "spec": {},
                "tenant": None,
                "session": None,
                "ready_when": "connected",
            }
            # The record is written before the welcome is sent.
            row = await record_row(db, sidecar.allocation_id)
            assert row is not None
            assert row["instance_id"] == INSTANCE_ID
            assert row["sidecar_id"] == sidecar.sidecar_id
            assert await hub.router.is_ready(sidecar.target)
            await eventually(lambda: hub.events.connected == [sidecar.target])

    async def test_handshake_headers_not_kept(self, hub: Hub, sidecar: Sidecar) -> None:
        """Once the socket is open, the server keeps no header of its handshake: not the
        token, not the reconnect secret (and not the memory they take per socket)."""
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcome_of(ws)
            (entry,) = hub.router.sockets(sidecar.allocation_id)
            held = entry.ws
            assert isinstance(held, SidecarConnection)
            assert held.request is not None
            assert held.response is not None
            assert held.request.path == CONNECT_PATH
            assert held.response.status_code == 101
            assert list(held.request.headers.raw_items()) == []
            assert list(held.response.headers.raw_items()) == []
            # Nor anywhere else: websockets' parser keeps the request it parsed for as long as
            # the socket lives, so a request replaced on the connection would keep the token.
            kept = [
                request.path  # the path alone: a failure must not print the token
                for request in gc.get_objects()
                # type(), not isinstance(): the heap holds weak proxies, some of them dead.
                if type(request) is Request
                and request is not ws.request
                and any(sidecar.token in value for _, value in request.headers.raw_items())
            ]
            assert kept == []

    async def test_provisioning_accepted(
        self, db: Database, store: AllocationStore, hub: Hub
    ) -> None:
        """A sidecar may dial in while its allocation is still provisioning."""
        provisioning, _ = await sidecar_in(store, db, Status.PROVISIONING)
        async with dial(hub.url, provisioning.headers()) as ws:
            assert (await welcome_of(ws))["type"] == "welcome"

    @pytest.mark.parametrize(
        "name", ["Authorization", "Hubd-Allocation-Id", "Hubd-Sidecar-Id", "Hubd-Generation"]
    )
    async def test_missing_header_400(self, hub: Hub, sidecar: Sidecar, name: str) -> None:
        """A missing handshake header is refused with 400 before the upgrade."""
        refused = await rejection(hub.url, sidecar.headers(**{name: None}))
        assert refused.response.status_code == 400
        assert refused.response.body == f"missing {name} header\n".encode()

    @pytest.mark.parametrize(
        ("name", "value"),
        [
            ("Authorization", "Basic dXNlcjpwYXNz"),
            ("Authorization", "Bearer hubd_sc_tooshort"),
            ("Hubd-Allocation-Id", "al_nothex"),
            ("Hubd-Sidecar-Id", "bad id"),
            ("Hubd-Generation", "0"),
            ("Hubd-Generation", "one"),
        ],
    )
    async def test_malformed_header_400(
        self, hub: Hub, sidecar: Sidecar, name: str, value: str
    ) -> None:
        """A malformed handshake header is refused with 400 naming the header."""
        refused = await rejection(hub.url, sidecar.headers(**{name: value}))
        assert refused.response.status_code == 400
        assert name.encode() in refused.response.body

    async def test_unknown_path_404(self, hub: Hub, sidecar: Sidecar) -> None:
        """Only /v1/sidecars/connect is served."""
        refused = await rejection(hub.server.url + "/v1/other", sidecar.headers())
        assert refused.response.status_code == 404

    async def test_missing_subprotocol_400(self, hub: Hub, sidecar: Sidecar) -> None:
        """A client that offers neither hubd.sidecar.v2 nor v1 is refused with 400."""
        refused = await rejection(hub.url, sidecar.headers(), subprotocols=None)
        assert refused.response.status_code == 400

    async def test_unknown_allocation_401(self, hub: Hub, sidecar: Sidecar) -> None:
        """An allocation id that does not exist is 401, answered exactly like a wrong token: a
        refusal does not say which allocation ids exist."""
        headers = sidecar.headers(**{"Hubd-Allocation-Id": new_allocation_id()})
        unknown = await rejection(hub.url, headers)
        wrong = await rejection(hub.url, sidecar.headers(Authorization=f"Bearer {wrong_token()}"))
        assert unknown.response.status_code == wrong.response.status_code == 401
        assert unknown.response.body == wrong.response.body == b"unauthorized\n"
        assert (
            dict(unknown.response.headers.raw_items()).keys()
            == dict(wrong.response.headers.raw_items()).keys()
        )

    async def test_wrong_sidecar_401(self, hub: Hub, sidecar: Sidecar) -> None:
        """The right token with another sidecar id is 401."""
        refused = await rejection(hub.url, sidecar.headers(**{"Hubd-Sidecar-Id": new_sidecar_id()}))
        assert refused.response.status_code == 401
        assert refused.response.body == b"unauthorized\n"

    async def test_wrong_token_of_right_length_401(self, hub: Hub, sidecar: Sidecar) -> None:
        """A well-formed token of the right length that is not the allocation's is 401."""
        token = wrong_token()
        assert len(token) == len(sidecar.token)
        refused = await rejection(hub.url, sidecar.headers(Authorization=f"Bearer {token}"))
        assert refused.response.status_code == 401
        assert token.encode() not in refused.response.body

    async def test_newer_generation_401(self, hub: Hub, sidecar: Sidecar) -> None:
        """A generation newer than the allocation's is no identity the hub knows: 401."""
        headers = sidecar.headers(**{"Hubd-Generation": str(sidecar.generation + 1)})
        refused = await rejection(hub.url, headers)
        assert refused.response.status_code == 401

    async def test_origin_403(self, db: Database, sidecar: Sidecar) -> None:
        """A handshake with an Origin not in the config is 403; a listed one is accepted."""
        async with running_hub(db, allowed_origins=("https://ok.example",)) as hub:
            refused = await rejection(hub.url, sidecar.headers(), origin="https://evil.example")
            assert refused.response.status_code == 403
            async with dial(hub.url, sidecar.headers(), origin="https://ok.example") as ws:
                assert (await welcome_of(ws))["type"] == "welcome"

    async def test_stale_generation_409(
        self, db: Database, store: AllocationStore, hub: Hub
    ) -> None:
        """A sidecar of a replaced generation is refused with 409, token checked or not."""
        old, fence = await sidecar_in(store, db, Status.PROVISIONING)
        replaced = await store.write(
            fence,
            Abandon(
                release=False,
                expected=Status.PROVISIONING,
                delay=0,
                failure=Failure("sidecar_connect_failed", "test"),
            ).transition(),
        )
        assert replaced is not None
        assert replaced.generation == old.generation + 1
        refused = await rejection(hub.url, old.headers())
        assert refused.response.status_code == 409
        assert refused.response.body == b"stale generation: this sidecar was replaced\n"

    @pytest.mark.parametrize("status", [Status.RELEASING, Status.RELEASED, Status.REPLACING])
    async def test_not_accepting_409(
        self, db: Database, store: AllocationStore, hub: Hub, status: Status
    ) -> None:
        """An allocation that is releasing, replacing or finished accepts no sidecar: 409."""
        if status is Status.RELEASED:
            sidecar, fence = await sidecar_in(store, db, Status.RELEASING)
            assert await store.write(fence, MarkReleased().transition()) is not None
        else:
            sidecar, _ = await sidecar_in(store, db, status)
        refused = await rejection(hub.url, sidecar.headers())
        assert refused.response.status_code == 409
        assert refused.response.body == b"allocation no longer accepts sidecars\n"


class TestUnavailableDatabase:
    async def test_503_then_recovers(
        self,
        db: Database,
        store: AllocationStore,
        spare_db: Database,
        database_url: str,
    ) -> None:
        """Identity that cannot be looked up is 503 + Retry-After, never 401; connected
        sockets keep working through it, and handshakes succeed once the database is back."""
        first, _ = await sidecar_in(store, db)
        second, _ = await sidecar_in(store, db)
        async with (
            running_hub(db, lookup_db=spare_db, retry_after=3) as hub,
            dial(hub.url, first.headers()) as connected,
        ):
            await welcome_of(connected)
            await take_away(spare_db)
            refused = await rejection(hub.url, second.headers())
            assert refused.response.status_code == 503
            assert refused.response.headers["Retry-After"] == "3"
            await assert_alive(connected)
            await connected.send(json.dumps({"type": "heartbeat"}))
            await eventually(lambda: hub.server.stats.heartbeats == 1)

            await bring_back(spare_db, database_url)
            async with dial(hub.url, second.headers()) as ws:
                assert (await welcome_of(ws))["allocation_id"] == second.allocation_id
            await assert_alive(connected)

    async def test_lookup_timeout_503(
        self, db: Database, sidecar: Sidecar, spare_db: Database
    ) -> None:
        """A look-up that does not answer within its timeout is 503, not a hung handshake."""
        async with (
            running_hub(db, lookup_db=spare_db, lookup_timeout=0.2) as hub,
            db.pool.acquire() as locker,
            locker.transaction(),
        ):
            await locker.execute("LOCK TABLE hubd_allocations IN ACCESS EXCLUSIVE MODE")
            refused = await rejection(hub.url, sidecar.headers())
            assert refused.response.status_code == 503
            assert "Retry-After" in refused.response.headers
        async with (
            running_hub(db, lookup_db=spare_db) as hub,
            dial(hub.url, sidecar.headers()) as ws,
        ):
            assert (await welcome_of(ws))["type"] == "welcome"

    async def test_pending_handshake_cap_503(
        self, db: Database, store: AllocationStore, spare_db: Database
    ) -> None:
        """Over the cap of handshakes being authenticated, a new one waits its bound for a
        slot (an authenticating handshake is never evicted) and is then refused with 503 and
        Retry-After; the held one completes when its look-up can."""
        held, _ = await sidecar_in(store, db)
        other, _ = await sidecar_in(store, db)
        limits = ListenerLimits(max_handshakes=1, max_queue_wait=0.2, min_header_budget=0.05)
        async with running_hub(db, lookup_db=spare_db, limits=limits, lookup_timeout=60) as hub:
            locker = await db.pool.acquire()
            transaction = locker.transaction()
            await transaction.start()
            try:
                await locker.execute("LOCK TABLE hubd_allocations IN ACCESS EXCLUSIVE MODE")

                async def held_handshake() -> dict[str, Any]:
                    async with dial(hub.url, held.headers()) as ws:
                        return await welcome_of(ws)

                task = asyncio.create_task(held_handshake())
                await eventually(lambda: hub.server.stats.handshakes_in_progress == 1)
                refused = await rejection(hub.url, other.headers())
                assert refused.response.status_code == 503
                assert refused.response.body == b"too many handshakes\n"
                assert "Retry-After" in refused.response.headers
                assert not hub.server.stats.aborted
            finally:
                await transaction.rollback()
                await db.pool.release(locker)
            assert (await task)["allocation_id"] == held.allocation_id

    async def test_unadmittable_handshake_is_503(
        self, db: Database, sidecar: Sidecar, spare_db: Database
    ) -> None:
        """A handshake whose admission (authenticate and record) cannot run is refused with
        503 and Retry-After (the sidecar retries), reported to nobody, and leaves nothing
        behind: readiness is never claimed without its record."""
        await take_away(spare_db)
        async with running_hub(db, lookup_db=spare_db, retry_after=2) as hub:
            refused = await rejection(hub.url, sidecar.headers())
            assert refused.response.status_code == 503
            assert refused.response.headers["Retry-After"] == "2"
            await eventually(lambda: hub.router.busy_allocations == 0)
            assert hub.router.connection_count == 0
            assert hub.events.connected == []
            assert hub.events.disconnected == []
        assert await record_row(db, sidecar.allocation_id) is None

    async def test_clear_retried_until_database_returns(
        self, db: Database, sidecar: Sidecar, spare_db: Database, database_url: str
    ) -> None:
        """A disconnect while the database is away is retried until the record is cleared,
        and only then reported."""
        async with running_hub(db, records_db=spare_db) as hub:
            async with dial(hub.url, sidecar.headers()) as ws:
                await welcome_of(ws)
                await take_away(spare_db)
            await eventually(lambda: hub.router.connection_count == 0)
            assert hub.router.busy_allocations == 1  # the clear is being retried
            assert hub.events.disconnected == []
            await bring_back(spare_db, database_url)
            await eventually(lambda: hub.events.disconnected == [sidecar.target])
            assert await record_row(db, sidecar.allocation_id) is None

    async def test_failed_takeover_leaves_the_open_socket_alone(
        self, db: Database, sidecar: Sidecar, spare_db: Database, database_url: str
    ) -> None:
        """A takeover whose admission cannot run is refused (503) before anything happens to
        the socket it would have taken over: that one stays open, recorded and ready."""
        async with (
            running_hub(db, lookup_db=spare_db) as hub,
            dial(hub.url, sidecar.headers()) as old,
        ):
            welcome = await welcome_of(old)
            headers = sidecar.headers(**{SECRET_HEADER: welcome["reconnect_secret"]})
            (current,) = hub.router.sockets(sidecar.allocation_id)
            await take_away(spare_db)
            refused = await rejection(hub.url, headers)
            assert refused.response.status_code == 503
            await assert_alive(old)
            assert hub.router.sockets(sidecar.allocation_id) == [current]
            row = await record_row(db, sidecar.allocation_id)
            assert row is not None
            assert row["connection_id"] == current.connection_id
            assert await hub.router.is_ready(sidecar.target)
            assert hub.events.disconnected == []
            await bring_back(spare_db, database_url)


class TestRouter:
    async def test_takeover(self, db: Database, hub: Hub, sidecar: Sidecar) -> None:
        """A second socket of the same allocation and generation takes over: the older one
        gets 4000, its close is no disconnect, and the allocation stays connected."""
        async with dial(hub.url, sidecar.headers()) as old:
            await welcome_of(old)
            async with dial(hub.url, sidecar.headers()) as new:
                await welcome_of(new)
                assert await close_code_of(old) == 4000
                await eventually(lambda: hub.router.connection_count == 1)
                assert hub.events.disconnected == []
                assert await hub.router.is_ready(sidecar.target)
                (current,) = hub.router.sockets(sidecar.allocation_id)
                row = await record_row(db, sidecar.allocation_id)
                assert row is not None
                assert row["connection_id"] == current.connection_id
                await assert_alive(new)
                assert hub.events.connected == [sidecar.target, sidecar.target]

    async def test_disconnect(self, db: Database, hub: Hub, sidecar: Sidecar) -> None:
        """When the current socket closes, its record is cleared and the disconnect reported
        (the daemon's metrics count both events)."""
        metrics = Metrics()
        hub.events.forward = metrics
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcome_of(ws)
            await eventually(lambda: hub.events.connected == [sidecar.target])
            assert sample(metrics, "hubd_sidecar_connects_total") == 1
            assert sample(metrics, "hubd_sidecar_disconnects_total") == 0
        await eventually(lambda: hub.events.disconnected == [sidecar.target])
        assert sample(metrics, "hubd_sidecar_disconnects_total") == 1
        assert await record_row(db, sidecar.allocation_id) is None
        assert not await hub.router.is_ready(sidecar.target)
        assert hub.router.connection_count == 0
        assert hub.router.busy_allocations == 0

    async def test_lost_and_reconnected(
        self, db: Database, store: AllocationStore, hub: Hub
    ) -> None:
        """The router's own writes carry the connection facts: a disconnect marks the
        allocation lost with a connect deadline in the statement that clears the record, and a
        reconnect before it wakes the allocation in the statement that records it."""
        sidecar, fence = await sidecar_in(store, db)
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcome_of(ws)
            await eventually(lambda: len(hub.events.connected) == 1)
            seen = await hub.connections.readiness(sidecar.target, 20)
            assert seen.connected
            ready = await store.write(
                fence, MarkReady(connection_seq=seen.connection_seq).transition()
            )
            assert ready is not None
            assert ready.ready
        await eventually(lambda: len(hub.events.disconnected) == 1)

        lost = await store.get(sidecar.allocation_id)
        assert not lost.ready
        assert lost.status is Status.ALLOCATED
        assert lost.connect_deadline is not None
        async with db.pool.acquire() as conn:
            assert await conn.fetchval("SELECT $1::timestamptz > now()", lost.connect_deadline)
        assert lost.next_attempt_at == lost.connect_deadline
        assert not await hub.router.is_ready(sidecar.target)

        async with dial(hub.url, sidecar.headers()) as ws:
            await welcome_of(ws)
            assert await hub.router.is_ready(sidecar.target)
            await eventually(lambda: len(hub.events.connected) == 2)
            woken = await store.get(sidecar.allocation_id)
            async with db.pool.acquire() as conn:
                assert await conn.fetchval("SELECT $1::timestamptz <= now()", woken.next_attempt_at)
            # What the reconciler does next: claim the woken allocation and record it ready.
            seen = await hub.connections.readiness(sidecar.target, 20)
            again = await store.write(
                await claim_one(store, sidecar.allocation_id),
                MarkReady(connection_seq=seen.connection_seq).transition(),
            )
            assert again is not None
            assert again.ready

    async def test_fence(self, db: Database, hub: Hub, sidecar: Sidecar) -> None:
        """fence() closes sockets of older generations with 4002, and only those; no
        disconnect is reported, and the record is gone with the transition that fenced it."""
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcome_of(ws)
            hub.router.fence(sidecar.allocation_id, sidecar.generation)
            await assert_alive(ws)
            await db.pool.execute(
                "UPDATE hubd_allocations SET generation = generation + 1 WHERE id = $1",
                sidecar.allocation_id,
            )
            hub.router.fence(sidecar.allocation_id, sidecar.generation + 1)
            assert await close_code_of(ws) == 4002
        await eventually(
            lambda: hub.router.busy_allocations == 0 and hub.router.connection_count == 0
        )
        assert await record_row(db, sidecar.allocation_id) is None
        assert hub.events.disconnected == []

    async def test_hub_close_is_one_info_line(self, hub: Hub, sidecar: Sidecar) -> None:
        """A socket the hub closes is one info line when it is gone, ``sidecar_disconnected``
        with the socket's identity, the close code and its reason; the decision to close is
        only at debug."""
        with structlog.testing.capture_logs() as logs:
            async with dial(hub.url, sidecar.headers()) as ws:
                await welcome_of(ws)
                hub.router.fence(sidecar.allocation_id, sidecar.generation + 1)
                assert await close_code_of(ws) == 4002
            await eventually(lambda: hub.router.connection_count == 0)
        closing = [e for e in logs if e["event"] in ("closing_sidecar", "sidecar_disconnected")]
        assert [(e["event"], e["log_level"]) for e in closing] == [
            ("closing_sidecar", "debug"),
            ("sidecar_disconnected", "info"),
        ]
        gone = closing[1]
        assert (gone["closed_by_hub"], gone["reason"]) == (4002, "fenced")
        assert gone["allocation_id"] == sidecar.allocation_id
        assert gone["generation"] == sidecar.generation
        assert {"sidecar_id", "connection_id", "remote"} <= set(gone)

    async def test_retire(self, db: Database, hub: Hub, sidecar: Sidecar) -> None:
        """retire() closes every socket of the allocation with 4001, reporting no disconnect;
        the record is gone with the transition that retired it."""
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcome_of(ws)
            await db.pool.execute(
                "UPDATE hubd_allocations SET status = 'released', next_attempt_at = NULL,"
                " connection_ready = false, lease_id = NULL, lease_expires_at = NULL"
                " WHERE id = $1",
                sidecar.allocation_id,
            )
            hub.router.retire(sidecar.allocation_id, sidecar.generation)
            assert await close_code_of(ws) == 4001
        await eventually(
            lambda: hub.router.busy_allocations == 0 and hub.router.connection_count == 0
        )
        assert await record_row(db, sidecar.allocation_id) is None
        assert hub.events.disconnected == []

    async def test_oversized_frame_1009(self, hub: Hub, sidecar: Sidecar) -> None:
        """A message over 64 KiB is answered with close code 1009 and counts as a disconnect."""
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcome_of(ws)
            await ws.send("x" * (64 * 1024 + 1))
            assert await close_code_of(ws) == 1009
        await eventually(lambda: hub.events.disconnected == [sidecar.target])

    async def test_garbage_ignored(
        self, db: Database, store: AllocationStore, hub: Hub, sidecar: Sidecar
    ) -> None:
        """Binary, non-JSON, non-object, untyped, unknown and deeply nested messages are
        ignored and counted; the socket and its neighbours keep working."""
        neighbour, _ = await sidecar_in(store, db)
        async with (
            dial(hub.url, sidecar.headers()) as noisy,
            dial(hub.url, neighbour.headers()) as quiet,
        ):
            await welcome_of(noisy)
            await welcome_of(quiet)
            for garbage in (
                b"\x00\xff binary",
                "not json {",
                "[1, 2, 3]",
                '{"no": "type"}',
                '{"type": 5}',
                '{"type": "launch_missiles"}',
                "[" * 60_000,
            ):
                await noisy.send(garbage)
            await eventually(lambda: hub.server.stats.ignored_messages == 7)
            assert hub.server.stats.ignored_by_kind == {
                "binary": 1,
                "not_json": 2,
                "no_type": 3,
                "unknown_type": 1,
            }
            await quiet.send(json.dumps({"type": "heartbeat"}))
            await noisy.send(json.dumps({"type": "heartbeat"}))
            await eventually(lambda: hub.server.stats.heartbeats == 2)
            await assert_alive(noisy)
            await assert_alive(quiet)
        await eventually(lambda: hub.events.disconnected.count(sidecar.target) == 1)

    async def test_flood_closed_1008(self, db: Database, store: AllocationStore) -> None:
        """A socket that floods messages is closed with 1008; its neighbour is untouched."""
        flooder, _ = await sidecar_in(store, db)
        neighbour, _ = await sidecar_in(store, db)
        async with (
            running_hub(db, message_rate=1.0, message_burst=5) as hub,
            dial(hub.url, flooder.headers()) as noisy,
            dial(hub.url, neighbour.headers()) as quiet,
        ):
            await welcome_of(noisy)
            await welcome_of(quiet)
            try:
                for _ in range(50):
                    await noisy.send(json.dumps({"type": "heartbeat"}))
            except ConnectionClosed:
                pass
            assert await close_code_of(noisy) == 1008
            await assert_alive(quiet)
            await eventually(lambda: hub.events.disconnected == [flooder.target])

    async def test_shutdown(self, db: Database, store: AllocationStore, hub: Hub) -> None:
        """Shutdown closes every socket with 1001 and reports no disconnect; the records stay
        for the daemon to settle, and read as disconnected to peers once the instance row is
        removed."""
        first, _ = await sidecar_in(store, db)
        second, _ = await sidecar_in(store, db)
        async with dial(hub.url, first.headers()) as a, dial(hub.url, second.headers()) as b:
            await welcome_of(a)
            await welcome_of(b)
            await hub.server.close()
            assert await close_code_of(a) == 1001
            assert await close_code_of(b) == 1001
        assert hub.events.disconnected == []
        assert await hub.router.is_ready(first.target)
        await InstanceStore(db).remove(INSTANCE_ID)
        peer = ConnectionStore(db, instance_id="in_peer")
        assert not await peer.is_connected(first.target, 20)
        stale = await hub.connections.stale(20)
        assert {s.target for s in stale} == {first.target, second.target}


class TestWaitReady:
    async def test_local_connect(self, hub: Hub, sidecar: Sidecar) -> None:
        """wait_ready resolves when the sidecar connects to this instance."""
        waiting = asyncio.create_task(hub.router.wait_ready(sidecar.target, 30))
        await eventually(lambda: hub.router.waiter_count == 1)
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcome_of(ws)
            await waiting
        assert hub.router.waiter_count == 0

    async def test_already_connected(self, hub: Hub, sidecar: Sidecar) -> None:
        """wait_ready returns at once when the database already records the sidecar."""
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcome_of(ws)
            await hub.router.wait_ready(sidecar.target, 5)
        assert hub.router.waiter_count == 0

    async def test_other_replica_notification(
        self, db: Database, sidecar: Sidecar, database_url: str, notice_key: NoticeKey
    ) -> None:
        """A connect recorded by another replica reaches wait_ready here through the daemon's
        own wake-up listener: the hubd_connected NOTIFY written by the same statement as the
        record, heard on the LISTEN connection and handed to the router as the daemon wires
        it."""
        instances = InstanceStore(db)
        await instances.register(INSTANCE_ID, "here", 1, None)
        await instances.register("in_peer", "there", 2, None)
        router = SocketRouter(ConnectionStore(db, instance_id=INSTANCE_ID), notice_key=notice_key)
        peer = ConnectionStore(db, instance_id="in_peer")
        wakes: list[None] = []
        listener = wake_listener(
            dsn=database_url,
            db=db,
            router=router,
            metrics=Metrics(),
            on_wake=lambda: wakes.append(None),
            on_reconnected=lambda: None,
            poll_interval=5.0,
        )
        listening = asyncio.create_task(listener.run(), name="wake-listener")
        try:
            async with asyncio.timeout(30):
                await listener.up.wait()
            woken_at_start = len(wakes)
            waiting = asyncio.create_task(router.wait_ready(sidecar.target, 30))
            await eventually(lambda: router.waiter_count == 1)
            record = await peer.record("cn_peer", sidecar.target, sidecar.sidecar_id)
            assert record.outcome is RecordOutcome.RECORDED
            await waiting
            assert await router.is_ready(sidecar.target)
            # The record's own hubd_wake wakes the claim loops: it did not make the allocation
            # ready, so a claim may have to.
            await eventually(lambda: len(wakes) > woken_at_start)
        finally:
            listening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listening
        assert router.waiter_count == 0
        assert not listener.healthy

    async def test_a_connect_made_ready_wakes_no_claim(
        self, db: Database, store: AllocationStore, database_url: str, notice_key: NoticeKey
    ) -> None:
        """A connect whose record made the allocation ready reaches the listener as a
        connect, not as a wake-up: no claim runs for it. Notifications arrive in the order
        they were sent, so a wake sent after the record is the first one heard."""
        sidecar, _ = await sidecar_in(store, db)
        async with db.pool.acquire() as conn:
            # Parked waiting for its sidecar: no lease, so the connect makes it ready.
            await conn.execute(
                "UPDATE hubd_allocations SET lease_id = NULL, lease_expires_at = NULL "
                "WHERE id = $1",
                sidecar.allocation_id,
            )
        await InstanceStore(db).register(INSTANCE_ID, "here", 1, None)
        router = SocketRouter(ConnectionStore(db, instance_id=INSTANCE_ID), notice_key=notice_key)
        wakes: list[int] = []
        connected: list[None] = []
        listener = wake_listener(
            dsn=database_url,
            db=db,
            router=router,
            metrics=Metrics(),
            on_wake=lambda: wakes.append(len(connected)),
            on_reconnected=lambda: None,
            poll_interval=5.0,
        )
        listening = asyncio.create_task(listener.run(), name="wake-listener")
        try:
            async with asyncio.timeout(30):
                await listener.up.wait()
            woken_at_start = len(wakes)
            waiting = asyncio.create_task(router.wait_ready(sidecar.target, 30))
            await eventually(lambda: router.waiter_count == 1)
            direct = ConnectionStore(db, instance_id="in_peer", ready_on_connect=True)
            record = await direct.record("cn_peer", sidecar.target, sidecar.sidecar_id)
            assert record.ready
            await waiting
            connected.append(None)
            async with db.pool.acquire() as conn:
                await conn.execute("SELECT pg_notify('hubd_wake', 'after')")
            await eventually(lambda: len(wakes) > woken_at_start)
            # The first wake heard since the record is the one sent after it.
            assert wakes[woken_at_start] == 1
        finally:
            listening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listening

    async def test_timeout(self, hub: Hub, sidecar: Sidecar) -> None:
        """wait_ready raises SidecarNotConnected when nothing connects in time, leaking no
        waiter."""
        with pytest.raises(SidecarNotConnected):
            await hub.router.wait_ready(sidecar.target, 0.2)
        assert hub.router.waiter_count == 0

    async def test_cancelled(self, hub: Hub, sidecar: Sidecar) -> None:
        """A cancelled wait leaks no waiter."""
        waiting = asyncio.create_task(hub.router.wait_ready(sidecar.target, 30))
        await eventually(lambda: hub.router.waiter_count == 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert hub.router.waiter_count == 0

    async def test_unknown_is_not_absent(
        self, spare_db: Database, sidecar: Sidecar, notice_key: NoticeKey
    ) -> None:
        """is_ready and wait_ready raise DatabaseUnavailable when the database cannot answer."""
        router = SocketRouter(
            ConnectionStore(spare_db, instance_id=INSTANCE_ID), notice_key=notice_key
        )
        await take_away(spare_db)
        with pytest.raises(DatabaseUnavailable):
            await router.is_ready(sidecar.target)
        with pytest.raises(DatabaseUnavailable):
            await router.wait_ready(sidecar.target, 5)
        assert router.waiter_count == 0


class TestConnectionStore:
    async def test_record_guards(self, db: Database, store: AllocationStore) -> None:
        """A record is written only for the allocation's current generation and sidecar while
        it accepts sidecars; otherwise the outcome says fenced or retired."""
        connections = ConnectionStore(db, instance_id=INSTANCE_ID)
        sidecar, fence = await sidecar_in(store, db)
        assert (
            await connections.record("cn_a", sidecar.target, "sc_someone_else")
        ).outcome is RecordOutcome.FENCED
        stale = Target(sidecar.allocation_id, sidecar.generation + 1)
        assert (
            await connections.record("cn_b", stale, sidecar.sidecar_id)
        ).outcome is RecordOutcome.FENCED
        missing = Target(new_allocation_id(), 1)
        assert (await connections.record("cn_c", missing, "sc_x")).outcome is RecordOutcome.RETIRED
        assert (
            await connections.record("cn_d", sidecar.target, sidecar.sidecar_id)
        ).outcome is RecordOutcome.RECORDED
        released = await store.release(sidecar.allocation_id)
        assert released.status is Status.RELEASING
        assert (
            await connections.record("cn_e", sidecar.target, sidecar.sidecar_id)
        ).outcome is RecordOutcome.FENCED
        del fence

    async def test_record_retired(self, db: Database, store: AllocationStore) -> None:
        """A finished allocation's record is refused as retired."""
        connections = ConnectionStore(db, instance_id=INSTANCE_ID)
        sidecar, fence = await sidecar_in(store, db, Status.RELEASING)
        assert await store.write(fence, MarkReleased().transition()) is not None
        assert (
            await connections.record("cn_a", sidecar.target, sidecar.sidecar_id)
        ).outcome is RecordOutcome.RETIRED

    async def test_retiring_transition_removes_the_record(
        self, db: Database, store: AllocationStore
    ) -> None:
        """The transition that makes an allocation terminal deletes its connection record in
        its own transaction, so the retired socket's close has nothing left to clear."""
        sidecar, fence = await sidecar_in(store, db, Status.RELEASING)
        # Written directly: a releasing allocation no longer accepts a record from a handshake.
        await db.pool.execute(
            "INSERT INTO hubd_sidecar_connections"
            " (connection_id, allocation_id, generation, sidecar_id, instance_id)"
            " VALUES ('cn_a', $1, $2, $3, $4)",
            sidecar.allocation_id,
            sidecar.target.generation,
            sidecar.sidecar_id,
            INSTANCE_ID,
        )
        assert await store.write(fence, MarkReleased().transition()) is not None
        assert await records_of(db, sidecar.allocation_id) == []

    async def test_fencing_transition_removes_the_older_record(
        self, db: Database, sidecar: Sidecar
    ) -> None:
        """A move to a newer generation deletes the older generation's record with it."""
        connections = ConnectionStore(db, instance_id=INSTANCE_ID)
        await connections.record("cn_a", sidecar.target, sidecar.sidecar_id)
        assert await records_of(db, sidecar.allocation_id) == ["cn_a"]
        await db.pool.execute(
            "UPDATE hubd_allocations SET generation = generation + 1 WHERE id = $1",
            sidecar.allocation_id,
        )
        assert await records_of(db, sidecar.allocation_id) == []

    async def test_instance_liveness(self, db: Database, store: AllocationStore) -> None:
        """Records count only while their instance heartbeats (for every instance but the one
        holding the socket); stale ones are listed for the sweep, and release_instance forgets
        an instance's records and marks them lost."""
        instances = InstanceStore(db)
        await instances.register(INSTANCE_ID, "here", 1, "ws://127.0.0.1:1")
        connections = ConnectionStore(db, instance_id=INSTANCE_ID)
        peer = ConnectionStore(db, instance_id="in_peer")
        sidecar, _ = await sidecar_in(store, db)
        await connections.record("cn_a", sidecar.target, sidecar.sidecar_id)
        assert await connections.is_connected(sidecar.target, 20)
        assert await connections.stale(20) == []
        async with db.pool.acquire() as conn:
            await conn.execute(
                "UPDATE hubd_instances SET heartbeat_at = now() - interval '1 hour' WHERE id = $1",
                INSTANCE_ID,
            )
        assert not await peer.is_connected(sidecar.target, 20)
        # The instance holding the socket still counts its own record, whatever its heartbeat.
        assert await connections.is_connected(sidecar.target, 20)
        (stale,) = await connections.stale(20)
        assert stale.connection_id == "cn_a"
        assert stale.instance_id == INSTANCE_ID
        assert await instances.heartbeat(INSTANCE_ID)
        assert await connections.is_connected(sidecar.target, 20)
        assert await connections.release_instance(connect_timeout=60) == [sidecar.target]
        assert not await connections.is_connected(sidecar.target, 20)
        assert not await peer.is_connected(sidecar.target, 20)


class TestInstanceStore:
    async def test_lifecycle(self, db: Database) -> None:
        """An instance registers, heartbeats, is listed alive, and is gone once removed."""
        instances = InstanceStore(db)
        await instances.register("in_a", "host-a", 10, "ws://a:1")
        await instances.register("in_a", "host-a2", 11, "ws://a:2")
        (listed,) = await instances.list(20)
        assert (listed.id, listed.hostname, listed.pid, listed.ws_url) == (
            "in_a",
            "host-a2",
            11,
            "ws://a:2",
        )
        assert listed.alive
        assert await instances.heartbeat("in_a")
        async with db.pool.acquire() as conn:
            await conn.execute("UPDATE hubd_instances SET heartbeat_at = now() - interval '1 hour'")
        assert not (await instances.list(20))[0].alive
        await instances.remove("in_a")
        assert not await instances.heartbeat("in_a")
        assert await instances.list(20) == []

    async def test_long_dead_instances_are_deleted(self, db: Database) -> None:
        """Rows of instances dead for longer than the bound are deleted; live ones stay."""
        instances = InstanceStore(db)
        await instances.register("in_dead", "host-a", 10, None)
        await instances.register("in_live", "host-b", 11, None)
        async with db.pool.acquire() as conn:
            await conn.execute(
                "UPDATE hubd_instances SET heartbeat_at = now() - interval '201 seconds' "
                "WHERE id = 'in_dead'"
            )
        assert await instances.delete_dead(200) == ["in_dead"]
        assert [i.id for i in await instances.list(20)] == ["in_live"]

    async def test_clean_stop_marks_its_sidecars_lost_at_once(
        self, db: Database, store: AllocationStore
    ) -> None:
        """An instance that stops cleanly clears its records and marks their allocations lost
        with a connect deadline in the same statement: nothing reads ready behind a gone socket,
        and a record a sidecar already wrote on a peer is left alone."""
        await InstanceStore(db).register(INSTANCE_ID, "here", 1, None)
        here = ConnectionStore(db, instance_id=INSTANCE_ID)
        peer = ConnectionStore(db, instance_id="in_peer")
        mine, fence = await sidecar_in(store, db)
        moved, moved_fence = await sidecar_in(store, db)
        seen = await here.readiness(mine.target, 20)
        assert (await here.record("cn_1", mine.target, mine.sidecar_id)).seq is not None
        await here.record("cn_2", moved.target, moved.sidecar_id)
        await peer.record("cn_3", moved.target, moved.sidecar_id)  # reconnected to a peer
        for sidecar, claim in ((mine, fence), (moved, moved_fence)):
            readiness = await here.readiness(sidecar.target, 20)
            assert await store.write(
                claim, MarkReady(connection_seq=readiness.connection_seq).transition()
            )
        assert await here.release_instance(connect_timeout=60) == [mine.target]
        lost = await store.get(mine.allocation_id)
        assert not lost.ready
        assert lost.connect_deadline is not None
        assert lost.connection_seq > seen.connection_seq
        assert (await store.get(moved.allocation_id)).ready


class TestListener:
    async def test_tls(
        self, db: Database, sidecar: Sidecar, tmp_path: Path, notice_key: NoticeKey
    ) -> None:
        """With a certificate and key configured, the listener speaks wss://."""
        cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
        openssl = await asyncio.create_subprocess_exec(
            "openssl", "req", "-x509", "-newkey", "ec",
            "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-keyout", str(key), "-out", str(cert), "-days", "1", "-nodes",
            "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        assert await openssl.wait() == 0
        await InstanceStore(db).register(INSTANCE_ID, "localhost", 1, None)
        connections = ConnectionStore(db, instance_id=INSTANCE_ID)
        config = ServerConfig(listen="127.0.0.1:0", tls_cert=str(cert), tls_key=str(key))
        server = SidecarServer.from_config(
            config, router=SocketRouter(connections, notice_key=notice_key), connections=connections
        )
        client_context = ssl.create_default_context(cafile=str(cert))
        async with server:
            assert server.url.startswith("wss://127.0.0.1:")
            url = server.url + "/v1/sidecars/connect"
            async with dial(url, sidecar.headers(), ssl=client_context) as ws:
                assert (await welcome_of(ws))["type"] == "welcome"

    async def test_plain_non_loopback_warns(self, db: Database, notice_key: NoticeKey) -> None:
        """A plain ws:// listener on a non-loopback address logs a warning at start."""
        connections = ConnectionStore(db, instance_id=INSTANCE_ID)
        server = SidecarServer(
            router=SocketRouter(connections, notice_key=notice_key),
            connections=connections,
            host="0.0.0.0",  # noqa: S104 -- the case under test
        )
        with structlog.testing.capture_logs() as logs:
            async with server:
                pass
        assert any(entry["event"] == "sidecar_listener_without_tls" for entry in logs)


class TestScale:
    @pytest.mark.slow
    async def test_thousand_sidecars(self, db: Database) -> None:
        """1,000 sidecars dialing one server at once all get their welcome (any refused by the
        handshake caps retries with backoff and jitter, as the reference sidecar does)."""
        count = 1000
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = 4 * count + 256
        if soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
        sidecars = [
            Sidecar(
                allocation_id=new_allocation_id(),
                sidecar_id=new_sidecar_id(),
                generation=1,
                token=new_token(),
            )
            for _ in range(count)
        ]
        async with db.pool.acquire() as conn:
            await conn.execute(
                """
                INSERT INTO hubd_allocations (id, status, generation, provisioner_id, sidecar_id,
                                              token_hash)
                SELECT id, 'allocated', 1, 'fake', sidecar_id, token_hash
                FROM unnest($1::text[], $2::text[], $3::bytea[]) AS t(id, sidecar_id, token_hash)
                """,
                [s.allocation_id for s in sidecars],
                [s.sidecar_id for s in sidecars],
                [hash_token(s.token) for s in sidecars],
            )
        refusals = 0
        opened: list[ClientConnection] = []
        try:
            async with running_hub(db) as hub:
                backoff = Backoff(base=0.25, cap=4.0)
                jitter = secrets.SystemRandom().random

                async def one(sidecar: Sidecar) -> dict[str, Any]:
                    nonlocal refusals
                    for attempt in itertools.count():
                        try:
                            ws = await dial(hub.url, sidecar.headers(), ping_interval=None)
                        except InvalidStatus as exc:
                            if exc.response.status_code not in (429, 503):
                                raise
                            refusals += 1
                            await asyncio.sleep(backoff.delay(attempt, jitter))
                            continue
                        except (InvalidHandshake, OSError):
                            # Refused beyond the cap of lingering refusals: the socket was
                            # reset, which the reference sidecar retries the same way.
                            refusals += 1
                            await asyncio.sleep(backoff.delay(attempt, jitter))
                            continue
                        opened.append(ws)
                        return await welcome_of(ws)
                    raise AssertionError("unreachable")

                async with asyncio.timeout(90):
                    welcomes = await asyncio.gather(*(one(s) for s in sidecars))
                assert [w["allocation_id"] for w in welcomes] == [s.allocation_id for s in sidecars]
                assert hub.router.connection_count == count
                async with db.pool.acquire() as conn:
                    recorded = await conn.fetchval("SELECT count(*) FROM hubd_sidecar_connections")
                assert recorded == count
                logging.getLogger(__name__).info("refusals while connecting: %d", refusals)
                await asyncio.gather(*(ws.close() for ws in opened))
                await eventually(lambda: hub.router.connection_count == 0, within=60)
        finally:
            await asyncio.gather(*(ws.close() for ws in opened), return_exceptions=True)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


CANARY = "hubd_sc_" + "c4a7" * 16
CANARY_WRONG = "hubd_sc_" + "deadbeef" * 8
CANARY_MALFORMED = "hubd_sc_CANARYcanary" + "7" * 40
CANARY_FRAGMENTS = (CANARY, CANARY_WRONG, CANARY_MALFORMED, "c4a7c4a7", "deadbeefdead", "CANARY")


class TestSecrets:
    async def test_canary_tokens_never_surface(
        self,
        db: Database,
        store: AllocationStore,
        spare_db: Database,
        database_url: str,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """Known canary tokens fed through good and bad handshakes, takeover, an unavailable
        database, the reference sidecar and its settings appear in no log line, no rejection
        body and no exception text."""
        caplog.set_level(logging.DEBUG)
        texts: list[str] = []

        def keep(*items: object) -> None:
            texts.extend(repr(item) for item in items)
            texts.extend(str(item) for item in items)

        with structlog.testing.capture_logs() as logs:
            sidecar, _ = await sidecar_in(store, db, token=CANARY)
            replaced, _ = await sidecar_in(store, db, Status.RELEASING, token=CANARY)
            async with running_hub(db, lookup_db=spare_db) as hub:
                async with dial(hub.url, sidecar.headers()) as first:
                    keep(await welcome_of(first))
                    async with dial(hub.url, sidecar.headers()) as second:
                        keep(await welcome_of(second))
                        assert await close_code_of(first) == 4000
                await eventually(lambda: hub.events.disconnected == [sidecar.target])
                keep(hub.router.sockets(sidecar.allocation_id), hub.server.stats)

                refusals = [
                    (sidecar.headers(Authorization=f"Bearer {CANARY_WRONG}"), {}, 401),
                    (sidecar.headers(Authorization=f"Bearer {CANARY_MALFORMED}"), {}, 400),
                    (sidecar.headers(Authorization=f"Basic {CANARY}"), {}, 400),
                    (sidecar.headers(Authorization=CANARY), {}, 400),
                    (sidecar.headers(**{"Hubd-Allocation-Id": new_allocation_id()}), {}, 401),
                    (sidecar.headers(**{"Hubd-Generation": "2"}), {}, 401),
                    (sidecar.headers(**{"Hubd-Sidecar-Id": CANARY}), {}, 401),
                    (sidecar.headers(**{"Hubd-Generation": CANARY}), {}, 400),
                    (sidecar.headers(), {"origin": f"https://{CANARY}.example"}, 403),
                    (replaced.headers(), {}, 409),
                ]
                for headers, options, status in refusals:
                    refused = await rejection(hub.url, headers, **options)
                    assert refused.response.status_code == status
                    keep(refused, refused.response.body, refused.response.headers)

                await take_away(spare_db)
                refused = await rejection(hub.url, sidecar.headers())
                assert refused.response.status_code == 503
                keep(refused, refused.response.body, refused.response.headers)
                await bring_back(spare_db, database_url)

                good = SidecarSettings.from_env(sidecar.env(hub.server.url))
                client = SidecarClient(good, backoff=Backoff(base=0.05, cap=0.2))
                task = asyncio.create_task(client.run())
                await eventually(lambda: client.welcomes == 1)
                client.stop()
                keep(await task, good, client.decisions)

                bad = SidecarSettings.from_env(
                    {**sidecar.env(hub.server.url), "HUBD_TOKEN": CANARY_WRONG}
                )
                keep(await SidecarClient(bad).run(), bad)

            with pytest.raises(SidecarConfigError) as malformed:
                SidecarSettings.from_env(
                    {**sidecar.env("ws://h:1"), "HUBD_TOKEN": CANARY_MALFORMED}
                )
            keep(malformed.value)
            keep(
                HandshakeRequest(
                    allocation_id=sidecar.allocation_id,
                    sidecar_id=sidecar.sidecar_id,
                    generation=1,
                    token=CANARY,
                    origin=None,
                ),
                await ConnectionStore(db, instance_id=INSTANCE_ID).identity(sidecar.allocation_id),
            )

        assert logs, "nothing was logged: the test would prove nothing"
        assert any(entry["event"] == "handshake_rejected" for entry in logs)
        everything = "\n".join([*texts, repr(logs), caplog.text])
        for fragment in CANARY_FRAGMENTS:
            assert fragment not in everything


async def records_of(db: Database, allocation_id: str) -> list[str]:
    rows = await db.pool.fetch(
        "SELECT connection_id FROM hubd_sidecar_connections WHERE allocation_id = $1",
        allocation_id,
    )
    return [row["connection_id"] for row in rows]


def test_connection_ids_are_unique_and_a_forked_child_names_its_own_apart() -> None:
    """Connection ids count up under a random prefix per process; a child forked from the
    daemon draws a prefix of its own instead of counting on from its parent's."""
    first, second = new_connection_id(), new_connection_id()
    assert first != second
    assert first[:19] == second[:19]
    read, write = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12 warns about forking a process that has threads; the child only writes.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover -- the child
        os.write(write, new_connection_id().encode())
        os._exit(0)
    os.close(write)
    try:
        child = os.read(read, 64).decode()
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert child.startswith("cn_")
    assert len(child) == len(first)
    assert child[:19] != first[:19]
