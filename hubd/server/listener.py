"""SidecarServer: the sidecar listener, websockets' server wired to hubd's admission, sessions
and bounds.

What a peer can make the listener hold is bounded before websockets sees a byte
(:mod:`hubd.server.limits` says how each cap was sized): sockets and unfinished handshakes are
admitted by a :class:`~hubd.server.slots.SourceGate` as they are accepted (a socket that finds no
slot for its address waits, unread, for one; a handshake too slow for the load is evicted),
every byte before the upgrade goes through a :class:`~hubd.server.limits.HeaderScanner`, a socket
whose peer stops reading is aborted once its write buffer is full or has stalled for a few
seconds, and ping/pong frames spend the same budget as messages. A source address that keeps
failing handshakes is refused with 429 and ``Retry-After``. The handshake is decided by
:mod:`hubd.server.admission`, the open socket served by :mod:`hubd.server.session`.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from collections.abc import Collection
from types import TracebackType
from typing import Any, Final, Self, cast

import structlog
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.server import ServerProtocol
from websockets.typing import Subprotocol

from hubd.config import ServerConfig
from hubd.logs import Sampler
from hubd.server.accepting import Acceptor, drains_itself
from hubd.server.admission import Admitter
from hubd.server.batching import Batcher
from hubd.server.connection import SidecarConnection
from hubd.server.handshake import SUBPROTOCOLS, CloseCode, Rejection
from hubd.server.keepalive import Keepalive
from hubd.server.limits import ListenerLimits
from hubd.server.router import SocketRouter
from hubd.server.session import SessionHandler
from hubd.server.slots import SourceGate
from hubd.server.sockets import SocketEntry
from hubd.server.wire import ServerStats, WireLogger, is_loopback_host, note, tls_context
from hubd.store.connection_values import Admission, Admitted, SidecarIdentity
from hubd.store.connections import ConnectionStore

__all__ = ["MAX_MESSAGE_SIZE", "SidecarServer"]


log = structlog.get_logger(__name__)

MAX_MESSAGE_SIZE: Final = 64 * 1024


class SidecarServer:
    """The sidecar websocket listener (``GET /v1/sidecars/connect``), the
    :class:`~hubd.server.connection.ConnectionHost` of its sockets."""

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
        ping_interval: float | None = 20.0,
        ping_timeout: float | None = 20.0,
        open_timeout: float = 10.0,
        close_timeout: float = 10.0,
        max_message_size: int = MAX_MESSAGE_SIZE,
        limits: ListenerLimits | None = None,
        max_connections: int | None = None,
        max_waiting_lookups: int = 256,
        lookup_concurrency: int = 1,
        lookup_timeout: float = 5.0,
        retry_after: int = 5,
        message_rate: float = 20.0,
        message_burst: int = 200,
        backlog: int = 1024,
        refusal_linger: float = 1.0,
    ) -> None:
        """``max_connections`` overrides ``limits.max_connections`` (the daemon lowers it to
        fit the descriptor limit)."""
        self._router = router
        self._host = host
        self._requested_port = port
        self._ssl = ssl_context
        self._heartbeat_interval = heartbeat_interval
        self._ping_interval = ping_interval
        self._ping_timeout = ping_timeout
        self.keepalive: Keepalive | None = None
        self._open_timeout = open_timeout
        self._close_timeout = close_timeout
        self._max_message_size = max_message_size
        self.limits = limits or ListenerLimits(retry_after=retry_after)
        self.gate: SourceGate[SidecarConnection] = SourceGate(
            self.limits, max_connections=max_connections
        )
        self.refusal_linger = refusal_linger
        # A flood is one line per kind every few seconds, with the count of the lines it
        # stands for, never a line per refused socket.
        self._sampler = Sampler()
        # One budget for queue and query. One statement at a time: whatever arrives meanwhile
        # goes in the next, and a storm's CPU goes further in fewer, larger statements than in
        # two at once (docs/performance.md). The identity pool's second connection is a spare,
        # for the statement after one that timed out while its connection is being reset.
        # The two handshake batchers share these bounds (and the identity pool).
        bounds = functools.partial(
            Batcher,
            timeout=lookup_timeout,
            max_waiting=max_waiting_lookups,
            concurrency=lookup_concurrency,
        )
        self.admissions: Batcher[Admission, Admitted] = bounds(
            connections.admit_many, name="connection-admissions"
        )
        self.lookups: Batcher[str, SidecarIdentity] = bounds(
            connections.identities, name="identity-lookups"
        )
        self._message_rate = message_rate
        self._message_burst = message_burst
        self._backlog = backlog
        self._server: Server | None = None
        self._acceptors: list[Acceptor] = []
        self.stats = ServerStats()
        self._admitter = Admitter(
            router=router,
            admissions=self.admissions,
            lookups=self.lookups,
            gate=self.gate,
            limits=self.limits,
            stats=self.stats,
            sampler=self._sampler,
            allowed_origins=allowed_origins,
            retry_after=retry_after,
        )
        # One timer for every deadline of the gate (a waiting socket's bound, the oldest
        # unfinished handshake's budget), set for the earliest.
        self._gate_timer: asyncio.TimerHandle | None = None
        self._gate_timer_at = 0.0
        self._settling = False
        self._settle_again = False

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
        if self._ping_interval is not None:
            # One timer for every socket's pings, not websockets' task per socket (see
            # hubd.server.keepalive).
            self.keepalive = Keepalive(self._ping_interval, self._ping_timeout)
        sessions = SessionHandler(
            router=self._router,
            keepalive=self.keepalive,
            stats=self.stats,
            sampler=self._sampler,
            heartbeat_interval=self._heartbeat_interval,
            message_rate=self._message_rate,
            message_burst=self._message_burst,
        )
        # What makes a socket's connection, whoever accepts it: websockets' server, or the
        # acceptor that takes the rest of the queue (hubd.server.accepting).
        protocol: dict[str, Any] = {
            "subprotocols": [Subprotocol(name) for name in SUBPROTOCOLS],
            "max_size": self._max_message_size,
            "logger": WireLogger("hubd.server.wire"),
        }
        connection: dict[str, Any] = {
            "ping_interval": None,
            "close_timeout": self._close_timeout,
            "max_queue": self.limits.max_queue,
        }
        self._server = server = await serve(
            sessions.handle,
            self._host,
            self._requested_port,
            process_request=self._admitter.process_request,
            # websockets calls this like the class it names; the partial hands each connection
            # its host: the gate and the limits it applies, where it reports.
            create_connection=cast(
                "type[ServerConnection]", functools.partial(SidecarConnection, hub=self)
            ),
            # Off: it multiplies per-connection memory and invites decompression bombs.
            compression=None,
            server_header="hubd",
            open_timeout=self._open_timeout,
            ssl=self._ssl,
            backlog=self._backlog,
            **protocol,
            **connection,
        )
        if not drains_itself(asyncio.get_running_loop()):

            def made() -> SidecarConnection:
                return SidecarConnection(ServerProtocol(**protocol), server, hub=self, **connection)

            self._acceptors = [
                Acceptor(
                    listening,
                    made,
                    ssl_context=self._ssl,
                    ssl_handshake_timeout=self._open_timeout,
                    ssl_shutdown_timeout=self._close_timeout,
                    sampler=self._sampler,
                )
                for listening in server.sockets
            ]
        log.info("sidecar_listener_started", url=self.url)

    async def close(self) -> None:
        """Stop accepting, close every socket with 1001, wait for the handlers; idempotent."""
        server = self._server
        if server is None:
            return
        # Stop accepting first, so no socket slips in between closing the others and waiting.
        for acceptor in self._acceptors:
            acceptor.close()
        self._acceptors = []
        server.close(close_connections=False)
        # Sockets waiting for a handshake slot would otherwise hold the close until their
        # bound: they are told to come back (to this replica once restarted, or another).
        going = Rejection(status=503, reason="server is shutting down", retry_after=1)
        for connection in self.gate.drain():
            connection.refuse_waiting(going)
        if self._gate_timer is not None:
            self._gate_timer.cancel()
            self._gate_timer = None
        if self.keepalive is not None:
            self.keepalive.close()
        await self._router.close_all(CloseCode.GOING_AWAY)
        await server.wait_closed()
        await self.admissions.close()
        await self.lookups.close()
        self._server = None
        if self._gate_timer is not None:
            self._gate_timer.cancel()
            self._gate_timer = None
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

    # -- what its sockets report ----------------------------------------------------------------

    def refused(self, connection: SidecarConnection, rejection: Rejection, *, early: bool) -> None:
        """A socket refused by a resource bound, before websockets read its request."""
        self.stats.refused_early[rejection.reason] += 1
        if not early:
            # Oversized or malformed headers: the peer's fault, like a bad handshake.
            self.gate.failed(connection.source, asyncio.get_running_loop().time())
        note(
            self._sampler,
            "connection_refused",
            f"refused-{rejection.reason}",
            connection,
            status=rejection.status,
            reason=rejection.reason,
        )

    def queued(self, connection: SidecarConnection) -> None:
        """A socket waits for a handshake slot."""
        del connection
        self.stats.queued += 1

    def settle(self) -> None:
        """Carry out what the gate decides now (evictions, refusals of waiting sockets, slots
        taken for them), and set the timer for its next deadline. Not re-entered: what the
        sockets do meanwhile is settled in the same call."""
        if self._settling:
            self._settle_again = True
            return
        self._settling = True
        loop = asyncio.get_running_loop()
        try:
            again = True
            while again:
                self._settle_again = False
                settled = self.gate.settle(loop.time())
                for connection, why in settled.evicted:
                    connection.evict(why)
                for connection, rejection in settled.refused:
                    connection.refuse_waiting(rejection)
                for connection in settled.admitted:
                    connection.admit()
                again = self._settle_again
        finally:
            self._settling = False
        due = self.gate.next_deadline(loop.time())
        if due is None or self._server is None:
            return
        # Only ever moved earlier: a timer that fires before anything is due settles nothing
        # and sets the next one, which costs less than rescheduling at every socket's event.
        if self._gate_timer is None or due < self._gate_timer_at:
            if self._gate_timer is not None:
                self._gate_timer.cancel()
            self._gate_timer_at = due
            self._gate_timer = loop.call_at(due, self._gate_due)

    def _gate_due(self) -> None:
        self._gate_timer = None
        self.settle()

    def aborted(self, connection: SidecarConnection, why: str) -> None:
        """A socket aborted for a resource bound (its peer stopped reading)."""
        self.stats.aborted[why] += 1
        note(self._sampler, "connection_aborted", f"aborted-{why}", connection, reason=why)

    def handshake_abandoned(self, entry: SocketEntry) -> None:
        """The handshake was admitted, but the socket never opened (the peer left before the
        upgrade, the handshake timed out, the listener is closing)."""
        self._router.abandon(entry, written=entry.recorded)
