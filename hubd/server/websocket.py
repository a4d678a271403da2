"""SidecarServer: the asyncio shell around the handshake decisions and the router.

Authentication happens in ``process_request``, before the upgrade, so an unauthenticated peer
never holds an open websocket. Two limits keep a flood of handshakes from hurting anyone else:
at most ``max_pending_handshakes`` are being authenticated at once (more are refused with 503 at
once, not queued), and at most ``max_concurrent_lookups`` identity look-ups use the database pool
at once, so the claim loop always finds a connection.
"""

from __future__ import annotations

import asyncio
import collections
import http
import ipaddress
import json
import logging
import ssl
from collections.abc import Collection
from types import TracebackType
from typing import Any, Final, Self

import attrs
import structlog
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from hubd.config import ServerConfig
from hubd.errors import StoreError
from hubd.redaction import scrub
from hubd.server.handshake import (
    SUBPROTOCOL,
    CloseCode,
    HandshakeRequest,
    Rejection,
    authorize,
    check_origin,
    parse_request,
    unavailable,
)
from hubd.server.router import SocketEntry, SocketRouter
from hubd.store.connections import ConnectionStore, SidecarIdentity

__all__ = [
    "MAX_MESSAGE_SIZE",
    "MessageBudget",
    "ServerStats",
    "SidecarServer",
    "WireLogger",
    "is_loopback_host",
    "tls_context",
]

log = structlog.get_logger(__name__)

MAX_MESSAGE_SIZE: Final = 64 * 1024


class WireLogger(logging.LoggerAdapter[logging.Logger]):
    """The logger handed to websockets: warnings and errors only.

    websockets logs every handshake header at DEBUG, ``Authorization`` included, and a line per
    connection at INFO; neither may reach hubd's logs whatever level an operator configures.
    """

    def __init__(self, name: str) -> None:
        super().__init__(logging.getLogger(name), {})

    def isEnabledFor(self, level: int) -> bool:  # noqa: N802 -- overrides logging's name
        return level >= logging.WARNING and self.logger.isEnabledFor(level)


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


class MessageBudget:
    """A token bucket: ``rate`` messages a second, bursts of ``burst``; the clock is passed in."""

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self._rate = rate
        self._burst = float(burst)
        self._tokens = float(burst)
        self._at = now

    def take(self, now: float) -> bool:
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


@attrs.define
class ServerStats:
    """Counters a test or a metrics exporter reads."""

    accepted: int = 0
    handshakes_in_progress: int = 0
    rejected: collections.Counter[int] = attrs.field(factory=collections.Counter)
    heartbeats: int = 0
    ignored_messages: int = 0
    ignored_by_kind: collections.Counter[str] = attrs.field(factory=collections.Counter)


class _SidecarConnection(ServerConnection):
    """A server connection that carries the handshake it was authenticated with."""

    hubd_request: HandshakeRequest | None = None


class SidecarServer:
    """The sidecar websocket listener (``GET /v1/sidecars/connect``)."""

    def __init__(
        self,
        *,
        router: SocketRouter,
        connections: ConnectionStore,
        host: str = "127.0.0.1",
        port: int = 0,
        ssl_context: ssl.SSLContext | None = None,
        allowed_origins: Collection[str] = (),
        heartbeat_interval: float = 20.0,
        ping_interval: float = 20.0,
        ping_timeout: float = 20.0,
        open_timeout: float = 10.0,
        close_timeout: float = 10.0,
        max_message_size: int = MAX_MESSAGE_SIZE,
        max_pending_handshakes: int = 1024,
        max_concurrent_lookups: int = 8,
        lookup_timeout: float = 5.0,
        retry_after: int = 5,
        message_rate: float = 20.0,
        message_burst: int = 200,
        backlog: int = 1024,
    ) -> None:
        self._router = router
        self._connections = connections
        self._host = host
        self._requested_port = port
        self._ssl = ssl_context
        self._allowed_origins = frozenset(allowed_origins)
        self._heartbeat_interval = heartbeat_interval
        self._ping_interval = ping_interval
        self._ping_timeout = ping_timeout
        self._open_timeout = open_timeout
        self._close_timeout = close_timeout
        self._max_message_size = max_message_size
        self._pending = asyncio.Semaphore(max_pending_handshakes)
        self._lookups = asyncio.Semaphore(max_concurrent_lookups)
        self._lookup_timeout = lookup_timeout
        self._retry_after = retry_after
        self._message_rate = message_rate
        self._message_burst = message_burst
        self._backlog = backlog
        self._server: Server | None = None
        self.stats = ServerStats()

    @classmethod
    def from_config(
        cls,
        config: ServerConfig,
        *,
        router: SocketRouter,
        connections: ConnectionStore,
        **options: Any,
    ) -> SidecarServer:
        context = tls_context(config.tls_cert, config.tls_key) if config.tls_enabled else None
        return cls(
            router=router,
            connections=connections,
            host=config.host,
            port=config.port,
            ssl_context=context,
            allowed_origins=config.allowed_origins,
            **options,
        )

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("the sidecar server is already started")
        if self._ssl is None and not is_loopback_host(self._host):
            log.warning(
                "sidecar_listener_without_tls",
                host=self._host,
                hint="tokens cross the network in clear text; configure server.tls_cert/tls_key",
            )
        self._server = await serve(
            self._handle,
            self._host,
            self._requested_port,
            process_request=self._process_request,
            create_connection=_SidecarConnection,
            subprotocols=[Subprotocol(SUBPROTOCOL)],
            # Off: it multiplies per-connection memory and invites decompression bombs.
            compression=None,
            server_header="hubd",
            open_timeout=self._open_timeout,
            ping_interval=self._ping_interval,
            ping_timeout=self._ping_timeout,
            close_timeout=self._close_timeout,
            max_size=self._max_message_size,
            logger=WireLogger("hubd.server.wire"),
            ssl=self._ssl,
            backlog=self._backlog,
        )
        log.info("sidecar_listener_started", url=self.url)

    async def close(self) -> None:
        """Stop accepting, close every socket with 1001, wait for the handlers; idempotent."""
        server = self._server
        if server is None:
            return
        # Stop accepting first, so no socket slips in between closing the others and waiting.
        server.close(close_connections=False)
        await self._router.close_all(CloseCode.GOING_AWAY)
        await server.wait_closed()
        self._server = None
        log.info("sidecar_listener_stopped")

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the sidecar server is not started")
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def url(self) -> str:
        """The base URL sidecars dial (without the endpoint path)."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        scheme = "wss" if self._ssl is not None else "ws"
        return f"{scheme}://{host}:{self.port}"

    # -- handshake ------------------------------------------------------------------------------

    async def _process_request(
        self, connection: ServerConnection, request: Request
    ) -> Response | None:
        if self._pending.locked():
            # Refused at once rather than queued: a queue would only turn a flood into a slow
            # flood, with every waiting peer holding a socket.
            return self._reject(
                connection,
                Rejection(status=503, reason="too many handshakes", retry_after=self._retry_after),
                None,
            )
        async with self._pending:
            self.stats.handshakes_in_progress += 1
            try:
                return await self._authenticate(connection, request)
            except Exception as exc:  # noqa: BLE001 -- websockets would log a traceback instead
                # No traceback: its frames could quote the request's headers, the token among
                # them. The scrubbed message and the type locate the bug well enough.
                log.error(  # noqa: TRY400
                    "handshake_failed", error=_describe(exc)
                )
                return self._reject(
                    connection, Rejection(status=500, reason="internal error"), None
                )
            finally:
                self.stats.handshakes_in_progress -= 1

    async def _authenticate(
        self, connection: ServerConnection, request: Request
    ) -> Response | None:
        parsed = parse_request(request.path, request.headers)
        if isinstance(parsed, Rejection):
            return self._reject(connection, parsed, None)
        rejection = check_origin(parsed.origin, self._allowed_origins)
        if rejection is not None:
            return self._reject(connection, rejection, parsed)
        try:
            identity = await self._lookup(parsed.allocation_id)
        except (StoreError, TimeoutError) as exc:
            log.warning(
                "sidecar_identity_unknown",
                allocation_id=parsed.allocation_id,
                error_type=type(exc).__name__,
            )
            return self._reject(connection, unavailable(self._retry_after), parsed)
        rejection = authorize(parsed, identity)
        if rejection is not None:
            return self._reject(connection, rejection, parsed)
        assert isinstance(connection, _SidecarConnection)
        connection.hubd_request = parsed
        return None

    async def _lookup(self, allocation_id: str) -> SidecarIdentity | None:
        # One budget for the queue and the query: a peer never waits longer than this.
        async with asyncio.timeout(self._lookup_timeout), self._lookups:
            return await self._connections.identity(allocation_id)

    def _reject(
        self, connection: ServerConnection, rejection: Rejection, parsed: HandshakeRequest | None
    ) -> Response:
        self.stats.rejected[rejection.status] += 1
        context: dict[str, Any] = {"status": rejection.status, "reason": rejection.reason}
        if parsed is not None:
            context.update(
                allocation_id=parsed.allocation_id,
                # Unauthenticated and free-form: a token pasted into the wrong header must not
                # reach the log through it.
                sidecar_id=scrub(parsed.sidecar_id),
                generation=parsed.generation,
            )
        log.info("handshake_rejected", remote=_remote(connection), **context)
        response = connection.respond(http.HTTPStatus(rejection.status), rejection.reason + "\n")
        if rejection.retry_after is not None:
            response.headers["Retry-After"] = str(rejection.retry_after)
        return response

    # -- connection -----------------------------------------------------------------------------

    async def _handle(self, connection: ServerConnection) -> None:
        assert isinstance(connection, _SidecarConnection)
        request = connection.hubd_request
        # The request holds the raw token; nothing after authentication needs it.
        connection.hubd_request = None
        if request is None:  # pragma: no cover -- process_request always sets it
            await connection.close(int(CloseCode.INTERNAL_ERROR), CloseCode.INTERNAL_ERROR.reason)
            return
        entry = self._router.register(connection, request, remote=_remote(connection))
        try:
            welcome = json.dumps(
                {
                    "type": "welcome",
                    "allocation_id": request.allocation_id,
                    "sidecar_id": request.sidecar_id,
                    "generation": request.generation,
                    "heartbeat_interval_s": self._heartbeat_interval,
                }
            )
            if await self._router.open(entry, welcome=welcome):
                self.stats.accepted += 1
                await self._read(connection, entry)
            else:
                # The router is closing it (or the peer left): let the close frame it chose go
                # out before websockets closes the socket with 1000 on our return.
                await _drain(connection)
        finally:
            await self._router.unregister(entry)

    async def _read(self, connection: ServerConnection, entry: SocketEntry) -> None:
        loop = asyncio.get_running_loop()
        budget = MessageBudget(self._message_rate, self._message_burst, loop.time())
        try:
            async for message in connection:
                if not budget.take(loop.time()):
                    entry.log.warning("sidecar_message_rate_exceeded")
                    self._router.close_socket(entry, CloseCode.POLICY)
                    await _drain(connection)
                    return
                self._dispatch(entry, message)
        except ConnectionClosed:
            pass

    def _dispatch(self, entry: SocketEntry, message: str | bytes) -> None:
        if isinstance(message, bytes):
            self._ignore(entry, "binary")
            return
        try:
            data = json.loads(message)
        except (ValueError, RecursionError):
            # RecursionError: 64 KiB of "[" is valid-looking JSON nested too deep to parse.
            self._ignore(entry, "not_json")
            return
        kind = data.get("type") if isinstance(data, dict) else None
        if not isinstance(kind, str):
            self._ignore(entry, "no_type")
        elif kind == "heartbeat":
            self.stats.heartbeats += 1
        else:
            self._ignore(entry, "unknown_type")

    def _ignore(self, entry: SocketEntry, kind: str) -> None:
        self.stats.ignored_messages += 1
        self.stats.ignored_by_kind[kind] += 1
        entry.log.debug("sidecar_message_ignored", kind=kind)


async def _drain(connection: ServerConnection) -> None:
    """Discard messages until the close handshake completes.

    A closing socket must still be read: with its receive queue full, websockets stops reading
    the transport, the peer's close frame is never seen, and the close waits out its timeout.
    """
    try:
        async for _ in connection:
            pass
    except ConnectionClosed:
        pass


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return scrub(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def _remote(connection: ServerConnection) -> str | None:
    address = connection.remote_address
    if not address:
        return None
    return f"{address[0]}:{address[1]}"
