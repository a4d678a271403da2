"""Helpers for the websocket tests: sidecar identities, a running hub, real clients."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from typing import Any

import asyncpg
import attrs
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.typing import Subprotocol

from hubd.routing import Target
from hubd.server import CONNECT_PATH, SUBPROTOCOL, SidecarServer, SocketRouter
from hubd.server.wire import WireLogger
from hubd.store import AllocationStore, Database, Fence, Status
from hubd.store.channels import (
    HANDOVER_CHANNEL,
    NoticeKey,
    parse_handover_payload,
    read_notice_key,
)
from hubd.store.connections import ConnectionStore
from hubd.store.instances import InstanceStore
from hubd.store.sessions import init_connection
from hubd.tokens import hash_token, new_sidecar_id, new_token
from tests.storekit import drive_to

INSTANCE_ID = "in_test"  # the conftest store's instance id


@attrs.frozen(kw_only=True)
class Sidecar:
    """A sidecar identity as the provisioner hands it out: the raw token included."""

    allocation_id: str
    sidecar_id: str
    generation: int
    token: str = attrs.field(repr=False)

    @property
    def target(self) -> Target:
        return Target(self.allocation_id, self.generation)

    def headers(self, **overrides: str | None) -> dict[str, str]:
        """Handshake headers; an override of ``None`` drops that header."""
        headers: dict[str, str | None] = {
            "Authorization": f"Bearer {self.token}",
            "Hubd-Allocation-Id": self.allocation_id,
            "Hubd-Sidecar-Id": self.sidecar_id,
            "Hubd-Generation": str(self.generation),
        }
        headers.update(overrides)
        return {name: value for name, value in headers.items() if value is not None}

    def env(self, url: str) -> dict[str, str]:
        return {
            "HUBD_URL": url,
            "HUBD_TOKEN": self.token,
            "HUBD_ALLOCATION_ID": self.allocation_id,
            "HUBD_SIDECAR_ID": self.sidecar_id,
            "HUBD_GENERATION": str(self.generation),
        }


async def bind_identity(db: Database, allocation_id: str, *, token: str | None = None) -> Sidecar:
    """Give an allocation a sidecar identity whose raw token the test knows."""
    token = token or new_token()
    async with db.pool.acquire() as conn:
        generation = await conn.fetchval(
            """
            UPDATE hubd_allocations SET sidecar_id = $2, token_hash = $3 WHERE id = $1
            RETURNING generation
            """,
            allocation_id,
            new_sidecar_id(),
            hash_token(token),
        )
        sidecar_id = await conn.fetchval(
            "SELECT sidecar_id FROM hubd_allocations WHERE id = $1", allocation_id
        )
    return Sidecar(
        allocation_id=allocation_id, sidecar_id=sidecar_id, generation=generation, token=token
    )


async def sidecar_in(
    store: AllocationStore,
    db: Database,
    status: Status = Status.ALLOCATED,
    *,
    token: str | None = None,
) -> tuple[Sidecar, Fence]:
    """A new allocation in ``status`` with a known sidecar identity, and its claim's fence."""
    fence = await drive_to(store, db, status)
    return await bind_identity(db, fence.allocation_id, token=token), fence


@attrs.define
class RecordingEvents:
    """A ConnectionEvents sink that remembers what it was told, and optionally forwards it."""

    connected: list[Target] = attrs.field(factory=list)
    disconnected: list[Target] = attrs.field(factory=list)
    forward: Any = None

    def handle_connected(self, target: Target) -> None:
        self.connected.append(target)
        if self.forward is not None:
            self.forward.handle_connected(target)

    def handle_disconnect(self, target: Target) -> None:
        self.disconnected.append(target)
        if self.forward is not None:
            self.forward.handle_disconnect(target)


@attrs.define
class Hub:
    """A started sidecar server with its router, stores and event sink."""

    server: SidecarServer
    router: SocketRouter
    connections: ConnectionStore
    events: RecordingEvents
    notice_key: NoticeKey

    @property
    def url(self) -> str:
        return self.server.url + CONNECT_PATH


@asynccontextmanager
async def running_hub(
    db: Database,
    *,
    lookup_db: Database | None = None,
    records_db: Database | None = None,
    port: int = 0,
    router_options: Mapping[str, Any] | None = None,
    instance_id: str = INSTANCE_ID,
    ready_on_connect: bool = False,
    **server_options: Any,
) -> AsyncIterator[Hub]:
    """A hub on 127.0.0.1 whose instance row is registered (readiness needs a live instance).

    ``lookup_db`` serves the handshake's identity look-ups and ``records_db`` the router's
    connection records, so a test can take either away.
    """
    await InstanceStore(db).register(instance_id, "localhost", 1, None)
    connections = ConnectionStore(
        records_db or db, instance_id=instance_id, ready_on_connect=ready_on_connect
    )
    events = RecordingEvents()
    notice_key = await read_notice_key(db)
    router = SocketRouter(
        connections, notice_key=notice_key, events=events, **(router_options or {})
    )
    lookups = ConnectionStore(
        lookup_db or db, instance_id=instance_id, ready_on_connect=ready_on_connect
    )
    server = SidecarServer(
        router=router, connections=lookups, host="127.0.0.1", port=port, **server_options
    )
    async with server:
        yield Hub(
            server=server,
            router=router,
            connections=connections,
            events=events,
            notice_key=notice_key,
        )


@asynccontextmanager
async def hearing(database_url: str, *hubs: Hub) -> AsyncIterator[list[str]]:
    """What each daemon's listener does with ``hubd_handover``: its router sweeps for takes.
    Yields the notices heard, each checked as the daemon checks it."""
    heard: list[str] = []

    def notified(_conn: object, _pid: int, _channel: str, payload: str) -> None:
        assert parse_handover_payload(payload, hubs[0].notice_key) is not None, payload
        heard.append(payload)
        for hub in hubs:
            hub.router.handover.heard()

    conn = await asyncpg.connect(database_url)
    try:
        await conn.add_listener(HANDOVER_CHANNEL, notified)
        yield heard
    finally:
        await conn.close()


def dial(url: str, headers: Mapping[str, str], **options: Any) -> Any:
    """A real websocket client (use as ``async with``), quiet about its headers."""
    options.setdefault("subprotocols", [Subprotocol(SUBPROTOCOL)])
    return connect(
        url,
        additional_headers=dict(headers),
        compression=None,
        proxy=None,
        logger=WireLogger("tests.client"),
        open_timeout=10,
        **options,
    )


async def welcome_of(ws: ClientConnection) -> dict[str, Any]:
    async with asyncio.timeout(10):
        message = await ws.recv()
    data: dict[str, Any] = json.loads(message)
    return data


async def rejection(url: str, headers: Mapping[str, str], **options: Any) -> InvalidStatus:
    """Dial and return the HTTP refusal; fails the test if the hub upgraded instead."""
    try:
        async with dial(url, headers, **options):
            pass
    except InvalidStatus as exc:
        return exc
    raise AssertionError("the hub accepted a handshake it should have refused")


async def first_message_or_close(
    url: str, sidecar: Sidecar, while_open: Callable[[], Awaitable[None]] | None = None
) -> tuple[int | None, str | None]:
    """Dial as ``sidecar``: the close code, and the type of the first message (``None``: the
    hub closed the socket before sending one). After a first message, ``while_open`` runs and
    the client closes the socket."""
    async with dial(url, sidecar.headers()) as ws:
        try:
            async with asyncio.timeout(10):
                message = await ws.recv()
        except ConnectionClosed:
            return ws.close_code, None
        if while_open is not None:
            await while_open()
    kind: str = json.loads(message)["type"]
    return ws.close_code, kind


async def close_code_of(ws: ClientConnection) -> int | None:
    """Wait for the hub to close ``ws`` and return the code it sent."""
    try:
        async with asyncio.timeout(10):
            while True:
                await ws.recv()
    except ConnectionClosed as exc:
        return exc.rcvd.code if exc.rcvd is not None else None


def wrong_token() -> str:
    """A well-formed token of the right length that matches nothing."""
    return "hubd_sc_" + secrets.token_hex(32)


async def connection_seq(db: Database, allocation_id: str) -> int:
    """The allocation's connection number: every record and every clear bumps it."""
    async with db.pool.acquire() as conn:
        seq: int = await conn.fetchval(
            "SELECT connection_seq FROM hubd_allocations WHERE id = $1", allocation_id
        )
    return seq


async def record_row(db: Database, allocation_id: str) -> dict[str, Any] | None:
    async with db.pool.acquire() as conn:
        row = await conn.fetchrow(
            "SELECT * FROM hubd_sidecar_connections WHERE allocation_id = $1", allocation_id
        )
    return dict(row) if row is not None else None


async def secret_row(db: Database, allocation_id: str) -> dict[str, Any] | None:
    """The allocation's reconnect-secret row (digests only)."""
    async with db.pool.acquire() as conn:
        row = await conn.fetchrow(
            "SELECT * FROM hubd_sidecar_secrets WHERE allocation_id = $1", allocation_id
        )
    return dict(row) if row is not None else None


async def secret_acknowledged(db: Database, allocation_id: str) -> bool:
    row = await secret_row(db, allocation_id)
    return row is not None and bool(row["acknowledged"])


async def take_away(database: Database) -> None:
    """Close the ordinary, identity and socket pools: every statement on them now fails as
    "database unavailable"."""
    await database.pool.close()
    await database.identity_pool.close()
    await database.socket_pool.close()


async def bring_back(database: Database, database_url: str) -> None:
    """Give ``database`` working ordinary, identity and socket pools again."""
    database.pool = await asyncpg.create_pool(
        database_url, min_size=1, max_size=4, init=init_connection
    )
    database.identity_pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    database.socket_pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)


def upgrade_request(hub_url: str, headers: Mapping[str, str], *extra: str) -> bytes:
    """The bytes of a websocket upgrade request for ``hub_url``, with extra raw header lines."""
    netloc = hub_url.split("://", 1)[1].split("/", 1)[0]
    lines = [
        f"GET {CONNECT_PATH} HTTP/1.1",
        f"Host: {netloc}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version: 13",
        f"Sec-WebSocket-Protocol: {SUBPROTOCOL}",
        *(f"{name}: {value}" for name, value in headers.items()),
        *extra,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@asynccontextmanager
async def raw_socket(
    server: SidecarServer, *, source: str = "127.0.0.1", rcvbuf: int | None = None
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A plain TCP connection to the hub from ``source`` (any 127.x.y.z address works on
    loopback, so tests can play several source addresses)."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((source, 0))
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        yield reader, writer
    finally:
        writer.close()
        with suppress(OSError):
            await writer.wait_closed()


async def http_status(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """Read a plain HTTP response: status, headers (lower-case names), body."""
    async with asyncio.timeout(10):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {
            name.strip().lower(): value.strip()
            for name, _, value in (line.partition(":") for line in lines[1:] if line)
        }
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(lines[0].split(" ")[1]), headers, body


def masked_frame(opcode: int, payload: bytes) -> bytes:
    """A client frame (clients must mask) with a payload under 126 bytes."""
    assert len(payload) < 126
    mask = secrets.token_bytes(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + masked
