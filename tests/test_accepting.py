"""The acceptor takes every socket waiting on the listener in a turn of uvloop's loop, which
itself takes one a turn (hubd.server.accepting), with and without TLS."""

from __future__ import annotations

import asyncio
import errno
import os
import resource
import socket
import ssl
import struct
import subprocess
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, cast

import pytest
import structlog

from hubd.logs import Sampler
from hubd.server import accepting
from hubd.server.accepting import PER_TURN, Acceptor, drains_itself
from tests.polling import eventually

uvloop = pytest.importorskip("uvloop")

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="reads the accept queue with Linux's TCP_INFO"
)


def waiting(listening: socket.socket) -> int:
    """Sockets in ``listening``'s accept queue (TCP_INFO's tcpi_unacked, for a listener)."""
    info = listening.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    count: int = struct.unpack_from("I", info, 24)[0]
    return count


class _Made(asyncio.Protocol):
    def __init__(self, made: list[asyncio.BaseTransport]) -> None:
        self._made = made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._made.append(transport)

    def data_received(self, data: bytes) -> None:
        pass


def on_uvloop(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert not drains_itself(runner.get_loop())
        runner.run(scenario())


def _listening() -> socket.socket:
    listening = socket.create_server(("127.0.0.1", 0), backlog=1024)
    listening.setblocking(False)
    return listening


def _acceptor(
    listening: socket.socket,
    factory: Callable[[], asyncio.Protocol],
    ssl_context: ssl.SSLContext | None = None,
) -> Acceptor:
    return Acceptor(
        listening,
        factory,
        ssl_context=ssl_context,
        ssl_handshake_timeout=10,
        ssl_shutdown_timeout=10,
        sampler=Sampler(),
    )


async def turns_until_empty(listening: socket.socket) -> int:
    """Turns of the loop until ``listening``'s accept queue is empty: a callback that runs once
    a turn (one scheduled while the loop runs callbacks waits for the next turn) counts them."""
    loop = asyncio.get_running_loop()
    emptied: asyncio.Future[int] = loop.create_future()
    turns = 0

    def turn() -> None:
        nonlocal turns
        turns += 1
        if waiting(listening) == 0:
            emptied.set_result(turns)
        else:
            loop.call_soon(turn)

    loop.call_soon(turn)
    return await asyncio.wait_for(emptied, 30)


def test_a_queue_of_sockets_is_taken_in_a_turn_or_two() -> None:
    count = 2 * PER_TURN + 44

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        made: list[asyncio.BaseTransport] = []
        with _listening() as listening:
            # The listener's own server on the loop, as websockets' is: it takes one a turn.
            server = await loop.create_server(lambda: _Made(made), sock=listening, backlog=1024)
            acceptor = _acceptor(listening, lambda: _Made(made))
            # Dialled while the loop is held here: the kernel completes every connect and
            # queues the sockets, as it does while a busy loop's turn runs.
            clients = [socket.create_connection(listening.getsockname()) for _ in range(count)]
            try:
                assert waiting(listening) == count
                turns = await turns_until_empty(listening)
                # One accept a turn would take `count` turns.
                assert turns <= 4
                await eventually(lambda: len(made) == count, within=30, what="every socket made")
                assert acceptor.taken >= count - turns
                # Closed, it takes no more: what comes now is the loop's own, one a turn.
                acceptor.close()
                taken = acceptor.taken
                more = [socket.create_connection(listening.getsockname()) for _ in range(8)]
                clients += more
                await eventually(lambda: len(made) == count + 8, within=30, what="the rest")
                assert acceptor.taken == taken
            finally:
                for client in clients:
                    client.close()
                for transport in made:
                    transport.close()
                server.close()

    on_uvloop(scenario)


def _certificate(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-nodes",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def test_a_tls_socket_taken_here_is_served_over_tls(tmp_path: Path) -> None:
    cert, key = _certificate(tmp_path)
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(cert, key)
    client_context = ssl.create_default_context(cafile=str(cert))

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            # uvloop's TLS transport is a transport in all but its class.
            self._transport = cast("asyncio.Transport", transport)

        def data_received(self, data: bytes) -> None:
            self._transport.write(data.upper())

    async def scenario() -> None:
        with _listening() as listening:
            # No server of the loop's own: only the acceptor takes sockets here.
            acceptor = _acceptor(listening, Echo, server_context)
            try:
                host, port = listening.getsockname()
                reader, writer = await asyncio.open_connection(host, port, ssl=client_context)
                writer.write(b"hello")
                assert await asyncio.wait_for(reader.readexactly(5), 30) == b"HELLO"
                writer.close()
                # A peer that does not speak TLS fails its handshake: the socket is closed,
                # and the acceptor goes on taking sockets.
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(b"GET / HTTP/1.1\r\n\r\n")
                assert await asyncio.wait_for(reader.read(), 30) == b""
                writer.close()
                reader, writer = await asyncio.open_connection(host, port, ssl=client_context)
                writer.write(b"again")
                assert await asyncio.wait_for(reader.readexactly(5), 30) == b"AGAIN"
                writer.close()
                assert acceptor.taken == 3
            finally:
                acceptor.close()

    on_uvloop(scenario)


def test_out_of_descriptors_it_pauses_and_takes_the_queue_once_it_can(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """accept() failing for want of a descriptor would fail again at every turn: the acceptor
    stops watching for a while, says so once, and takes the waiting sockets when it can."""
    monkeypatch.setattr(accepting, "ACCEPT_RETRY", 0.05)
    count = 6

    async def scenario() -> None:
        made: list[asyncio.BaseTransport] = []
        with _listening() as listening:
            clients = [socket.create_connection(listening.getsockname()) for _ in range(count)]
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            acceptor = None
            try:
                with structlog.testing.capture_logs() as logs:
                    acceptor = _acceptor(listening, lambda: _Made(made))
                    # No descriptor left for an accepted socket (the listing counts its own).
                    in_use = len(os.listdir("/proc/self/fd")) - 1
                    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use, hard))
                    await eventually(
                        lambda: any(e["event"] == "sidecar_accept_paused" for e in logs),
                        within=30,
                        what="the pause",
                    )
                    # A descriptor freed meanwhile may have served one; the rest wait.
                    assert acceptor.taken < count
                    assert waiting(listening) == count - acceptor.taken
                    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
                    await eventually(lambda: len(made) == count, within=30, what="the queue")
                assert acceptor.taken == count
                paused = [e for e in logs if e["event"] == "sidecar_accept_paused"]
                assert paused[0]["error"] == os.strerror(errno.EMFILE)
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
                if acceptor is not None:
                    acceptor.close()
                for client in clients:
                    client.close()
                for transport in made:
                    transport.close()

    on_uvloop(scenario)
