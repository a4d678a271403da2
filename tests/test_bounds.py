"""The listener's resource bounds against real sockets over loopback and real PostgreSQL.

Loopback answers on every 127.x.y.z address, so attackers here dial from 127.0.0.2 and up
while the legitimate sidecar dials from 127.0.0.1, as distinct hosts would.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import json
import socket
from typing import Any

import structlog
from websockets.exceptions import ConnectionClosed
from websockets.server import ServerProtocol

from hubd.config import Config, ServerConfig
from hubd.daemon.metrics import Metrics
from hubd.daemon.running import Listening
from hubd.server.connection import SidecarConnection
from hubd.server.limits import ListenerLimits
from hubd.server.slots import OVER_SHARE, SLOW
from hubd.server.sockets import SocketEntry
from hubd.store import AllocationStore, Database
from hubd.store.channels import NoticeKey
from tests.polling import eventually
from tests.test_daemon import metric_total
from tests.wskit import (
    Hub,
    Sidecar,
    close_code_of,
    connection_seq,
    dial,
    http_status,
    masked_frame,
    raw_socket,
    record_row,
    rejection,
    running_hub,
    sidecar_in,
    upgrade_request,
    welcome_of,
    wrong_token,
)

PING = 0x9


def sample(metrics: Metrics, name: str) -> float:
    """``name`` in a scrape of ``metrics``."""
    return metric_total(metrics.render().decode(), name)


async def closed_by_hub(reader: asyncio.StreamReader) -> bool:
    """Whether the hub ends the connection (EOF or reset) within the deadline."""
    try:
        async with asyncio.timeout(15):
            while await reader.read(65536):
                pass
    except (ConnectionError, OSError):
        pass
    return True


async def legit_welcome(hub: Hub, sidecar: Sidecar) -> None:
    async with dial(hub.url, sidecar.headers()) as ws:
        assert (await welcome_of(ws))["type"] == "welcome"


class TestHandshakeBounds:
    async def test_oversized_headers_refused(self, db: Database, store: AllocationStore) -> None:
        """A handshake whose headers exceed the byte cap is refused with 431 after at most the
        cap was read; the slot is freed and a legitimate sidecar still connects."""
        sidecar, _ = await sidecar_in(store, db)
        async with running_hub(db) as hub:
            async with raw_socket(hub.server, source="127.0.0.2") as (reader, writer):
                padding = [f"X-Pad-{i}: {'a' * 1000}" for i in range(64)]
                writer.write(upgrade_request(hub.url, sidecar.headers(), *padding))
                status, _, body = await http_status(reader)
                assert (status, body) == (431, b"request header too large\n")
            await eventually(lambda: hub.server.gate.handshakes == 0)
            await legit_welcome(hub, sidecar)

    async def test_many_headers_refused(self, db: Database, store: AllocationStore) -> None:
        """More header lines than the protocol needs are refused with 431."""
        sidecar, _ = await sidecar_in(store, db)
        async with (
            running_hub(db) as hub,
            raw_socket(hub.server, source="127.0.0.2") as (reader, writer),
        ):
            many = [f"X-{i}: 1" for i in range(40)]
            writer.write(upgrade_request(hub.url, sidecar.headers(), *many))
            status, _, body = await http_status(reader)
            assert (status, body) == (431, b"too many request headers\n")

    async def test_long_line_refused(self, db: Database, store: AllocationStore) -> None:
        """A header line longer than the protocol needs is refused with 431."""
        sidecar, _ = await sidecar_in(store, db)
        async with (
            running_hub(db) as hub,
            raw_socket(hub.server, source="127.0.0.2") as (reader, writer),
        ):
            writer.write(upgrade_request(hub.url, sidecar.headers(), "X-Long: " + "b" * 4000))
            status, _, body = await http_status(reader)
            assert (status, body) == (431, b"request header line too long\n")

    async def test_over_source_cap_waits_for_a_slot(
        self, db: Database, store: AllocationStore
    ) -> None:
        """A sidecar whose address already holds its cap of unfinished handshakes is neither
        refused nor read: it waits, and is welcomed once one of its address's slots frees;
        another address connects meanwhile."""
        sidecar, _ = await sidecar_in(store, db)
        bystander, _ = await sidecar_in(store, db)
        limits = ListenerLimits(max_handshakes_per_source=2)
        async with running_hub(db, limits=limits) as hub, contextlib.AsyncExitStack() as stack:
            holders = [
                await stack.enter_async_context(raw_socket(hub.server, source="127.0.0.2"))
                for _ in range(2)
            ]
            for _, writer in holders:
                writer.write(b"GET / HTTP/1.1\r\n")
            await eventually(lambda: hub.server.gate.handshakes == 2)

            async def queued() -> dict[str, Any]:
                async with dial(hub.url, sidecar.headers(), local_addr=("127.0.0.2", 0)) as ws:
                    return await welcome_of(ws)

            metrics = Metrics()
            metrics.bind_listener(hub.server.stats, hub.server.gate)
            waiting = asyncio.create_task(queued())
            await eventually(lambda: hub.server.gate.waiting == 1)
            assert sample(metrics, "hubd_handshakes_waiting") == 1
            assert sample(metrics, "hubd_handshakes_in_progress") == 2
            await legit_welcome(hub, bystander)
            assert not waiting.done()
            holders[0][1].close()
            async with asyncio.timeout(10):
                assert (await waiting)["allocation_id"] == sidecar.allocation_id
            assert hub.server.stats.queued == 1
            assert sample(metrics, "hubd_handshakes_queued_total") == 1
            assert sample(metrics, "hubd_handshakes_waiting") == 0
            assert not hub.server.stats.rejected
            assert not hub.server.stats.refused_early
        await eventually(lambda: hub.server.gate.sources == 0)

    async def test_unfinished_handshakes_capped_in_total(
        self, db: Database, store: AllocationStore
    ) -> None:
        """Over the total cap of unfinished handshakes a new socket waits for a slot, and is
        refused with 503 and Retry-After once it has waited its bound with none freed."""
        limits = ListenerLimits(
            max_handshakes=2, max_queue_wait=0.2, header_timeout=600, min_header_budget=600
        )
        async with running_hub(db, limits=limits) as hub:
            async with (
                raw_socket(hub.server, source="127.0.0.2") as _,
                raw_socket(hub.server, source="127.0.0.3") as _,
            ):
                await eventually(lambda: hub.server.gate.handshakes == 2)
                async with raw_socket(hub.server, source="127.0.0.4") as (reader, _):
                    status, headers, body = await http_status(reader)
                assert (status, body) == (503, b"too many handshakes\n")
                assert headers["retry-after"] == str(limits.retry_after)
            await eventually(lambda: hub.server.gate.sockets == 0)

    async def test_slow_request_evicted_before_an_older_complete_one(
        self, db: Database, store: AllocationStore
    ) -> None:
        """With every slot taken, the handshake that has not sent its whole request within the
        budget is evicted, not the older one whose request is complete and waits for the
        database, which is then welcomed."""
        fast, _ = await sidecar_in(store, db)
        limits = ListenerLimits(max_handshakes=2, min_header_budget=0.3)
        async with running_hub(db, limits=limits, lookup_timeout=60) as hub:
            locker = await db.pool.acquire()
            transaction = locker.transaction()
            await transaction.start()
            try:
                await locker.execute("LOCK TABLE hubd_allocations IN ACCESS EXCLUSIVE MODE")

                async def welcomed() -> dict[str, Any]:
                    async with dial(hub.url, fast.headers()) as ws:
                        return await welcome_of(ws)

                first = asyncio.create_task(welcomed())
                await eventually(lambda: hub.server.stats.handshakes_in_progress == 1)
                async with raw_socket(hub.server, source="127.0.0.2") as (slow, writer):
                    writer.write(b"GET /v1/sidecars/connect HTTP/1.1\r\nHost: x\r\n")
                    await eventually(lambda: hub.server.gate.handshakes == 2)
                    async with asyncio.timeout(10):
                        with contextlib.suppress(ConnectionError):
                            assert await slow.read() == b""  # aborted, never answered
                assert hub.server.stats.aborted == {SLOW: 1}
                assert not first.done()
            finally:
                await transaction.rollback()
                await db.pool.release(locker)
            async with asyncio.timeout(30):
                assert (await first)["allocation_id"] == fast.allocation_id
        assert not hub.server.stats.rejected

    async def test_range_over_its_share_gives_way(
        self, db: Database, store: AllocationStore
    ) -> None:
        """One address (and so its /24) holding more than its share of the unfinished-handshake
        slots gives one up at once to a sidecar of another range that waits, although none of
        its handshakes has run out of time and the sidecar's range has an unfinished handshake
        of its own (it is not in good standing)."""
        sidecar, _ = await sidecar_in(store, db)
        limits = ListenerLimits(
            max_handshakes=4,
            max_handshakes_per_source=4,
            max_handshakes_per_prefix=2,
            header_timeout=600,
            min_header_budget=600,
        )
        async with running_hub(db, limits=limits) as hub, contextlib.AsyncExitStack() as stack:
            for source in ("127.0.2.1", "127.0.2.1", "127.0.2.1", "127.0.0.9"):
                _, writer = await stack.enter_async_context(raw_socket(hub.server, source=source))
                writer.write(b"GET / HTTP/1.1\r\n")
            await eventually(lambda: hub.server.gate.handshakes == 4)
            async with asyncio.timeout(10):
                await legit_welcome(hub, sidecar)
            assert hub.server.stats.aborted == {OVER_SHARE: 1}
            assert not hub.server.stats.rejected

    async def test_sidecar_takes_the_slot_of_an_unfinished_handshake(
        self, db: Database, store: AllocationStore
    ) -> None:
        """With every slot held by handshakes that sent part of their request and stopped, a
        sidecar of another range is welcomed at once, not after their budget: the oldest gives
        up its slot to it."""
        sidecar, _ = await sidecar_in(store, db)
        limits = ListenerLimits(max_handshakes=2, header_timeout=600, min_header_budget=600)
        async with running_hub(db, limits=limits) as hub:
            async with (
                raw_socket(hub.server, source="127.0.2.1") as (oldest, first),
                raw_socket(hub.server, source="127.0.3.1") as (_, second),
            ):
                first.write(b"GET / HTTP/1.1\r\n")
                second.write(b"GET / HTTP/1.1\r\n")
                await eventually(lambda: hub.server.gate.handshakes == 2)
                async with asyncio.timeout(10):
                    await legit_welcome(hub, sidecar)
                    with contextlib.suppress(ConnectionError):
                        assert await oldest.read() == b""  # aborted, never answered
                assert hub.server.stats.aborted == {SLOW: 1}
            await eventually(lambda: hub.server.gate.sockets == 0)

    async def test_closed_handshakes_leave_no_cyclic_garbage(
        self, db: Database, store: AllocationStore
    ) -> None:
        """A socket that closes before its request, one that closes halfway through its headers,
        one refused for its token and one that opened and closed are freed by reference
        counting: a flood of them leaves the cyclic collector (whose pauses hold the
        interpreter's lock, the admin thread's /readyz included) none of the hub's objects."""
        sidecar, _ = await sidecar_in(store, db)
        loop = asyncio.get_running_loop()
        rounds = 20
        # Every round refuses a token and reconnects: neither may be throttled here.
        limits = ListenerLimits(bad_handshake_burst=10 * rounds, reconnect_burst=10 * rounds)
        async with running_hub(db, limits=limits) as hub:
            half = upgrade_request(hub.url, sidecar.headers())[:-2]
            server = hub.server._server
            assert server is not None

            async def dial_and_close(payload: bytes) -> None:
                with socket.socket() as sock:
                    sock.setblocking(False)
                    await loop.sock_connect(sock, ("127.0.0.1", hub.server.port))
                    if payload:
                        await loop.sock_sendall(sock, payload)

            gc.collect()
            gc.disable()
            try:
                for _ in range(rounds):
                    await dial_and_close(b"")
                    await dial_and_close(half)
                    refused = await rejection(
                        hub.url, sidecar.headers(Authorization=f"Bearer {wrong_token()}")
                    )
                    assert refused.response.status_code == 401
                    await legit_welcome(hub, sidecar)
                await eventually(lambda: hub.server.gate.sockets == 0)
                await eventually(lambda: not server.handler_tasks)
                # Unreachable objects stay in the collector's lists until it runs.
                # (By exact type: the collector's lists hold weak proxies too, which an
                # isinstance of a dead one raises on.)
                kept = {ServerProtocol, SidecarConnection, SocketEntry}
                left = [type(o).__name__ for o in gc.get_objects() if type(o) in kept]
            finally:
                gc.enable()
        # Left to the cyclic collector, each of the 80 sockets would leave its protocol here.
        assert left == [], collections.Counter(left)

    async def test_socket_cap(self, db: Database, store: AllocationStore) -> None:
        """Established sockets are capped: one more is refused with 503 and Retry-After before
        its headers are read, and admitted again once a socket closes."""
        first, _ = await sidecar_in(store, db)
        second, _ = await sidecar_in(store, db)
        async with running_hub(db, max_connections=1) as hub:
            async with dial(hub.url, first.headers()) as ws:
                await welcome_of(ws)
                refused = await rejection(hub.url, second.headers())
                assert refused.response.status_code == 503
                assert refused.response.headers["Retry-After"] == "5"
            await eventually(lambda: hub.server.gate.sockets == 0)
            await legit_welcome(hub, second)

    async def test_daemon_listener_takes_configured_cap(
        self, db: Database, notice_key: NoticeKey
    ) -> None:
        """``hubd run`` builds its listener with ``server.max_connections`` as the socket cap
        (the open-file limit, raised to the hard limit at start, is far above these)."""
        for cap in (1, 300):
            config = Config(server=ServerConfig(max_connections=cap))
            parts = Listening.build(
                config, db, "", "in_test", notice_key=notice_key, ready_on_connect=True
            )
            assert parts.server.gate.max_connections == cap

    async def test_failing_source_refused(self, db: Database, store: AllocationStore) -> None:
        """An address that keeps failing handshakes is refused with 429 before its headers are
        read, even with a good token; other addresses are unaffected. A flood of refusals is a
        few log lines, not one per refusal."""
        sidecar, _ = await sidecar_in(store, db)
        limits = ListenerLimits(bad_handshake_burst=3, bad_handshake_rate=0.01)
        bad = sidecar.headers(Authorization=f"Bearer {wrong_token()}")
        async with running_hub(db, limits=limits) as hub:
            with structlog.testing.capture_logs() as logs:
                for _ in range(3):
                    refused = await rejection(hub.url, bad, local_addr=("127.0.0.2", 0))
                    assert refused.response.status_code == 401
                for _ in range(30):
                    refused = await rejection(
                        hub.url, sidecar.headers(), local_addr=("127.0.0.2", 0)
                    )
                    assert refused.response.status_code == 429
                    assert int(refused.response.headers["Retry-After"]) >= 5
            await legit_welcome(hub, sidecar)
        lines = [e for e in logs if e["event"] in ("handshake_rejected", "connection_refused")]
        assert 0 < len(lines) <= 10


class TestSocketBounds:
    async def test_ping_flood_closed_1008(self, db: Database, store: AllocationStore) -> None:
        """Pings spend the message budget: a ping flood is closed with 1008."""
        sidecar, _ = await sidecar_in(store, db)
        async with (
            running_hub(db, message_rate=1.0, message_burst=5) as hub,
            dial(hub.url, sidecar.headers()) as ws,
        ):
            await welcome_of(ws)
            try:
                for index in range(50):
                    await ws.ping(str(index))
            except ConnectionClosed:
                pass
            assert await close_code_of(ws) == 1008
            await eventually(lambda: hub.events.disconnected == [sidecar.target])

    async def test_non_reading_peer_aborted(self, db: Database, store: AllocationStore) -> None:
        """A peer that pings (within its budget) and never reads is aborted once the pongs it
        leaves unread fill the write buffer or stall it, and its disconnect is reported."""
        sidecar, _ = await sidecar_in(store, db)
        async with running_hub(db, message_rate=1e9, message_burst=10**9) as hub:
            async with raw_socket(hub.server, rcvbuf=4096) as (reader, writer):
                writer.write(upgrade_request(hub.url, sidecar.headers()))
                async with asyncio.timeout(10):
                    await reader.readuntil(b"\r\n\r\n")
                await eventually(lambda: hub.events.connected == [sidecar.target])
                ping = masked_frame(PING, b"p" * 125)

                async def flood() -> None:
                    try:
                        while True:
                            writer.write(ping * 64)
                            await writer.drain()
                    except (ConnectionError, OSError):
                        return

                async with asyncio.timeout(30):
                    flooding = asyncio.create_task(flood())
                    await eventually(lambda: sum(hub.server.stats.aborted.values()) == 1, within=30)
                    flooding.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await flooding
            await eventually(lambda: hub.events.disconnected == [sidecar.target])
            assert hub.router.connection_count == 0
            assert hub.server.gate.sockets == 0

    async def test_reconnects_per_allocation(self, db: Database, store: AllocationStore) -> None:
        """A token holder reconnecting in a loop is refused with 429 and Retry-After once its
        allocation's reconnect budget is spent; another allocation is unaffected."""
        looping, _ = await sidecar_in(store, db)
        other, _ = await sidecar_in(store, db)
        limits = ListenerLimits(reconnect_burst=3, reconnect_rate=0.01)
        async with running_hub(db, limits=limits) as hub:
            for _ in range(3):
                await legit_welcome(hub, looping)

            async def unrecorded() -> bool:
                return await record_row(db, looping.allocation_id) is None

            # The last socket's record is cleared (a bump of its own) before the count.
            await eventually(unrecorded)
            await eventually(lambda: hub.router.busy_allocations == 0)
            seq = await connection_seq(db, looping.allocation_id)
            refused = await rejection(hub.url, looping.headers())
            assert refused.response.status_code == 429
            assert int(refused.response.headers["Retry-After"]) >= 1
            # Spent or not, the budget opens nothing for a wrong token, and says nothing of it.
            impostor = looping.headers(Authorization=f"Bearer {wrong_token()}")
            assert (await rejection(hub.url, impostor)).response.status_code == 401
            # A refused handshake writes nothing: no record, no bump of the connection number.
            assert await connection_seq(db, looping.allocation_id) == seq
            await legit_welcome(hub, other)
            message = json.dumps({"type": "heartbeat"})
            async with dial(hub.url, other.headers()) as ws:
                await welcome_of(ws)
                await ws.send(message)
                await eventually(lambda: hub.server.stats.heartbeats == 1)


class TestIdentityPool:
    async def test_lookups_wait_on_their_own_pool(
        self, db: Database, store: AllocationStore
    ) -> None:
        """Identity look-ups use a pool of their own: with it exhausted, handshakes get 503
        while the ordinary pool (claims, readiness) still answers; then they succeed again."""
        sidecar, _ = await sidecar_in(store, db)
        async with running_hub(db, lookup_timeout=0.5) as hub:
            held = [
                await db.identity_pool.acquire() for _ in range(db.identity_pool.get_max_size())
            ]
            try:
                refused = await rejection(hub.url, sidecar.headers())
                assert refused.response.status_code == 503
                async with asyncio.timeout(5), db.connection("claims") as conn:
                    assert await conn.fetchval("SELECT 1") == 1
            finally:
                for conn in held:
                    await db.identity_pool.release(conn)
            await legit_welcome(hub, sidecar)
