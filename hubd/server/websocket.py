"""SidecarServer: the asyncio shell around the handshake decisions and the router.

Authentication happens in ``process_request``, before the upgrade, so an unauthenticated peer
never holds an open websocket. What a peer can make the listener hold is bounded before
websockets sees a byte (:mod:`hubd.server.limits` says how each cap was sized): sockets and
unfinished handshakes are admitted by a :class:`~hubd.server.slots.SourceGate` as they are
accepted (a socket that finds no slot for its address waits, unread, for one; a handshake too
slow for the load is evicted), every byte before the upgrade goes through a
:class:`~hubd.server.limits.HeaderScanner`, a socket whose peer stops reading is aborted once
its write buffer is full or has stalled for a few seconds, and ping/pong frames spend the same
budget as messages. Identity look-ups are batched (:mod:`hubd.server.batching`, on a pool of
their own). A source address or an allocation that keeps failing or reconnecting is refused
with 429 and ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import functools
import http
import json
import ssl
import time
from collections.abc import Collection
from types import TracebackType
from typing import Any, Final, Self, cast

import structlog
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from hubd.config import ServerConfig
from hubd.errors import BatchFull, StoreError
from hubd.logs import Sampler
from hubd.published import MAX_METADATA_BYTES
from hubd.redaction import describe_error, scrub
from hubd.server.batching import Batcher
from hubd.server.connection import SidecarConnection, drain, remote_of
from hubd.server.handshake import (
    SUBPROTOCOLS,
    UNAUTHORIZED,
    CloseCode,
    HandshakeRequest,
    Rejection,
    authorize,
    check_origin,
    parse_request,
    unavailable,
)
from hubd.server.keepalive import Keepalive
from hubd.server.limits import BucketMap, ListenerLimits, TokenBucket
from hubd.server.messages import ProtocolError, parse_publish, parse_ready
from hubd.server.router import SocketRouter
from hubd.server.slots import SourceGate
from hubd.server.sockets import SocketEntry
from hubd.server.wire import ServerStats, WireLogger, is_loopback_host, tls_context
from hubd.store.connections import (
    Admission,
    Admitted,
    ConnectionStore,
    PublishOutcome,
    RecordOutcome,
    Served,
    SidecarIdentity,
)
from hubd.tokens import hash_token, new_reconnect_secret

__all__ = ["MAX_MESSAGE_SIZE", "SidecarServer"]


log = structlog.get_logger(__name__)

MAX_MESSAGE_SIZE: Final = 64 * 1024

# The hub's answers to a publish and a ready that landed.
_PUBLISHED: Final = json.dumps({"type": "published"})
_READY: Final = json.dumps({"type": "ready_recorded"})
_ACKNOWLEDGED: Final[dict[str, Any]] = {"type": "welcome_ack"}


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
        self._allowed_origins = frozenset(allowed_origins)
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
        self._reconnects = BucketMap(
            self.limits.reconnect_rate, self.limits.reconnect_burst, self.limits.max_tracked
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
        # Handshakes of an allocation whose reconnect budget is spent are only looked up (see
        # _too_often): nothing is written for them.
        self.lookups: Batcher[str, SidecarIdentity] = bounds(
            connections.identities, name="identity-lookups"
        )
        self._retry_after = retry_after
        self._message_rate = message_rate
        self._message_burst = message_burst
        self._backlog = backlog
        self._server: Server | None = None
        self.stats = ServerStats()
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
        self._server = await serve(
            self._handle,
            self._host,
            self._requested_port,
            process_request=self._process_request,
            # websockets calls this like the class it names; the partial hands each connection
            # the server whose limits it applies.
            create_connection=cast(
                "type[ServerConnection]", functools.partial(SidecarConnection, hub=self)
            ),
            subprotocols=[Subprotocol(name) for name in SUBPROTOCOLS],
            # Off: it multiplies per-connection memory and invites decompression bombs.
            compression=None,
            server_header="hubd",
            open_timeout=self._open_timeout,
            ping_interval=None,
            close_timeout=self._close_timeout,
            max_size=self._max_message_size,
            max_queue=self.limits.max_queue,
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

    # -- handshake ------------------------------------------------------------------------------

    async def _process_request(
        self, connection: ServerConnection, request: Request
    ) -> Response | None:
        assert isinstance(connection, SidecarConnection)
        self.stats.handshakes_in_progress += 1
        try:
            return await self._authenticate(connection, request)
        except Exception as exc:  # noqa: BLE001 -- websockets would log a traceback instead
            # No traceback: its frames could quote the request's headers, the token among
            # them. The scrubbed message and the type locate the bug well enough.
            log.error(  # noqa: TRY400
                "handshake_failed", error=describe_error(exc)
            )
            return self._reject(connection, Rejection(status=500, reason="internal error"), None)
        finally:
            self.stats.handshakes_in_progress -= 1
            connection.handshake_over()

    async def _authenticate(
        self, connection: SidecarConnection, request: Request
    ) -> Response | None:
        parsed = parse_request(request.path, request.headers)
        if isinstance(parsed, Rejection):
            return self._reject(connection, parsed, None)
        rejection = check_origin(parsed.origin, self._allowed_origins)
        if rejection is not None:
            return self._reject(connection, rejection, parsed)
        now = asyncio.get_running_loop().time()
        if not self._reconnects.available(parsed.allocation_id, now):
            return await self._too_often(connection, parsed, now)
        # v2: a fresh secret per connection, the only credential that opens the next one. Only
        # its digest leaves this listener other than in the welcome itself.
        secret = new_reconnect_secret() if parsed.version == 2 else None
        secret_hash = hash_token(secret) if secret is not None else None
        entry = self._router.expect(connection, parsed, remote=remote_of(connection))
        admission = Admission(
            connection_id=entry.connection_id,
            target=entry.target,
            sidecar_id=parsed.sidecar_id,
            version=parsed.version,
            token_hash=hash_token(parsed.token),
            presented_hash=hash_token(parsed.secret) if parsed.secret is not None else None,
            secret_hash=secret_hash,
        )
        try:
            admitted = await self.admissions.request(admission)
        except (StoreError, TimeoutError) as exc:
            # A statement that failed or was given up on may still have committed.
            self._router.abandon(entry, written=False if isinstance(exc, BatchFull) else None)
            return self._unknown(connection, parsed, exc)
        except BaseException:
            self._router.abandon(entry, written=None)
            raise
        if admitted is None:  # pragma: no cover -- admit_many answers every admission
            self._router.abandon(entry, written=None)
            return self._reject(connection, unavailable(self._retry_after), parsed)
        # The answer is the protocol's check, in constant time, on the identity the statement
        # read; the statement wrote only where the same check, made there, admitted it.
        rejection = authorize(parsed, admitted.identity)
        record = admitted.record
        if (rejection is None) != (record is not None):
            log.error(
                "handshake_checks_disagree",
                allocation_id=parsed.allocation_id,
                listener=rejection is None,
                statement=record is not None,
            )
        if rejection is not None or record is None:
            written = record is not None and record.outcome is RecordOutcome.RECORDED
            self._router.abandon(entry, written=written)
            return self._reject(connection, rejection or UNAUTHORIZED, parsed)
        # Counted only once authenticated: anyone may know an allocation id, and spending its
        # budget must take its token. A token holder reconnecting in a loop is slowed to the
        # bucket's rate, each reconnect being a record write and a ledger row. Handshakes of
        # one allocation admitted together may spend a little more than the bucket held.
        self._reconnects.take(parsed.allocation_id, now)
        self._router.admitted(entry, record, secret_hash=secret_hash)
        connection.hubd_entry = entry
        connection.hubd_secret = secret
        connection.hubd_served = record.served
        return None

    async def _too_often(
        self, connection: SidecarConnection, parsed: HandshakeRequest, now: float
    ) -> Response:
        """The allocation's reconnect budget is spent: 429 for a handshake that authenticates
        (checked against its identity, nothing written), the usual refusal for one that
        does not."""
        try:
            identity = await self.lookups.request(parsed.allocation_id)
        except (StoreError, TimeoutError) as exc:
            return self._unknown(connection, parsed, exc)
        rejection = authorize(parsed, identity)
        if rejection is not None:
            return self._reject(connection, rejection, parsed)
        wait = max(1, round(self._reconnects.wait(parsed.allocation_id, now) + 0.5))
        return self._reject(
            connection,
            Rejection(status=429, reason="reconnecting too often", retry_after=wait),
            parsed,
        )

    def _unknown(
        self, connection: SidecarConnection, parsed: HandshakeRequest, exc: Exception
    ) -> Response:
        """The identity could not be checked (or the connection recorded): 503, never 401."""
        log.warning(
            "sidecar_identity_unknown",
            allocation_id=parsed.allocation_id,
            error_type=type(exc).__name__,
        )
        return self._reject(connection, unavailable(self._retry_after), parsed)

    def _reject(
        self,
        connection: SidecarConnection,
        rejection: Rejection,
        parsed: HandshakeRequest | None,
    ) -> Response:
        self.stats.rejected[rejection.status] += 1
        if rejection.status < 500 and rejection.status != 429:
            # The peer got something wrong: its address spends from its failure budget.
            self.gate.failed(connection.source, asyncio.get_running_loop().time())
        context: dict[str, Any] = {"status": rejection.status, "reason": rejection.reason}
        if parsed is not None:
            context.update(
                allocation_id=parsed.allocation_id,
                # Unauthenticated and free-form: a token pasted into the wrong header must not
                # reach the log through it.
                sidecar_id=scrub(parsed.sidecar_id),
                generation=parsed.generation,
            )
        self._note("handshake_rejected", f"rejected-{rejection.status}", connection, **context)
        response = connection.respond(http.HTTPStatus(rejection.status), rejection.reason + "\n")
        if rejection.retry_after is not None:
            response.headers["Retry-After"] = str(rejection.retry_after)
        return response

    def refused(self, connection: SidecarConnection, rejection: Rejection, *, early: bool) -> None:
        """A socket refused by a resource bound, before websockets read its request."""
        self.stats.refused_early[rejection.reason] += 1
        if not early:
            # Oversized or malformed headers: the peer's fault, like a bad handshake.
            self.gate.failed(connection.source, asyncio.get_running_loop().time())
        self._note(
            "connection_refused",
            f"refused-{rejection.reason}",
            connection,
            status=rejection.status,
            reason=rejection.reason,
        )

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
        self._note("connection_aborted", f"aborted-{why}", connection, reason=why)

    def _note(self, event: str, key: str, connection: ServerConnection, **context: Any) -> None:
        suppressed = self._sampler.admit(key, time.monotonic())
        if suppressed is None:
            return
        if suppressed:
            context["suppressed"] = suppressed
        log.info(event, remote=remote_of(connection), **context)

    # -- connection -----------------------------------------------------------------------------

    async def _handle(self, connection: ServerConnection) -> None:
        assert isinstance(connection, SidecarConnection)
        entry, secret = connection.hubd_entry, connection.hubd_secret
        served = connection.hubd_served
        connection.hubd_entry = connection.hubd_secret = connection.hubd_served = None
        # The request's headers hold the raw token; nothing after the admission needs them.
        connection.forget_handshake()
        if entry is None:  # pragma: no cover -- process_request always sets it
            await connection.close(int(CloseCode.INTERNAL_ERROR), CloseCode.INTERNAL_ERROR.reason)
            return
        self._router.upgraded(entry)
        if self.keepalive is not None:
            self.keepalive.add(connection)
        loop = asyncio.get_running_loop()
        # From the upgrade on, control frames spend it too (see SidecarConnection).
        connection.budget = TokenBucket(self._message_rate, self._message_burst, loop.time())
        connection.on_violation = functools.partial(self._violation, entry)
        welcome = welcome_message(entry, served, self._heartbeat_interval, secret)
        try:
            if await self._router.open(entry, welcome=welcome):
                self.stats.accepted += 1
                # v1 sends no acknowledgement: its welcome is all it gets.
                await self._read(connection, entry, acknowledged=secret is None)
            else:
                # The router is closing it (or the peer left): let the close frame it chose go
                # out before websockets closes the socket with 1000 on our return.
                await drain(connection)
        finally:
            # The callback holds the entry, which holds the connection: a cycle left to the
            # collector for every socket that ever opened.
            connection.on_violation = None
            await self._router.unregister(entry)

    def handshake_abandoned(self, entry: SocketEntry) -> None:
        """The handshake was admitted, but the socket never opened (the peer left before the
        upgrade, the handshake timed out, the listener is closing)."""
        self._router.abandon(entry, written=entry.recorded)

    async def _read(
        self, connection: SidecarConnection, entry: SocketEntry, *, acknowledged: bool
    ) -> None:
        """Act on the socket's messages one at a time, in order: a publish is stored (or
        refused) before the message after it is read, so a ``ready`` after a ``publish`` finds
        the publish written, and a sidecar that writes faster than the database is slowed to
        it (its messages wait in websockets' bounded queue)."""
        loop = asyncio.get_running_loop()
        budget = connection.budget
        assert budget is not None
        try:
            async for message in connection:
                if entry.closed_by_hub is not None:
                    # Closing: keep reading (see _drain) but act on nothing more.
                    continue
                if not budget.take(loop.time()):
                    connection.on_violation = None
                    self._violation(entry, "message rate exceeded")
                    continue
                data = self._dispatch(entry, message, acknowledged=acknowledged)
                if data is _ACKNOWLEDGED:
                    acknowledged = True
                elif data is not None:
                    await self._act(entry, data, acknowledged=acknowledged)
        except ConnectionClosed:
            pass

    async def _act(self, entry: SocketEntry, data: dict[str, Any], *, acknowledged: bool) -> None:
        """A ``publish`` or a ``ready``: refused with 4003 when malformed or early, else
        written, fenced on the socket's record (architecture §4, *Publish and ready*)."""
        if data["type"] == "publish":
            publish = parse_publish(data, acknowledged=acknowledged)
            if isinstance(publish, ProtocolError):
                self._protocol_error(entry, publish)
                return
            outcome = await self._router.publish(entry, publish)
            if outcome is PublishOutcome.TOO_LARGE:
                too_large = f"publish: merged metadata is larger than {MAX_METADATA_BYTES} bytes"
                self._protocol_error(entry, ProtocolError(too_large))
            elif outcome is PublishOutcome.PUBLISHED:
                self.stats.published += 1
                await self._answer(entry, _PUBLISHED)
        elif data["type"] == "ready":
            ready = parse_ready(acknowledged=acknowledged)
            if isinstance(ready, ProtocolError):
                self._protocol_error(entry, ready)
                return
            if await self._router.declare_ready(entry):
                self.stats.declared_ready += 1
                await self._answer(entry, _READY)

    async def _answer(self, entry: SocketEntry, answer: str) -> None:
        if entry.closed_by_hub is not None:
            return
        try:
            await entry.ws.send(answer)
        except Exception as exc:  # noqa: BLE001 -- a peer that vanished is not an error
            entry.log.info("answer_not_sent", error=describe_error(exc))

    def _protocol_error(self, entry: SocketEntry, error: ProtocolError) -> None:
        """A message the hub refuses: the socket is closed with 4003, nothing written."""
        self.stats.protocol_errors += 1
        if self._sampler.admit("protocol-error", time.monotonic()) is not None:
            entry.log.warning("sidecar_protocol_error", reason=scrub(error.reason))
        self._router.close_socket(entry, CloseCode.PROTOCOL_ERROR, error.reason)

    def _violation(self, entry: SocketEntry, why: str) -> None:
        """The peer broke its budget: closed with 1008. A peer that does not read the close
        frame is aborted by the write-stall bound instead of holding the socket."""
        if entry.closed_by_hub is not None:
            return
        if self._sampler.admit(f"policy-{why}", time.monotonic()) is not None:
            entry.log.warning("sidecar_policy_violation", reason=why)
        self._router.close_socket(entry, CloseCode.POLICY)

    def _dispatch(
        self, entry: SocketEntry, message: str | bytes, *, acknowledged: bool
    ) -> dict[str, Any] | None:
        """Act on a message that needs no database, or hand back the one that does (a
        ``publish``, a ``ready``); ``_ACKNOWLEDGED`` for the welcome's acknowledgement."""
        if isinstance(message, bytes):
            self._ignore(entry, "binary")
            return None
        try:
            data = json.loads(message)
        except (ValueError, RecursionError):
            # RecursionError: 64 KiB of "[" is valid-looking JSON nested too deep to parse.
            self._ignore(entry, "not_json")
            return None
        kind = data.get("type") if isinstance(data, dict) else None
        if not isinstance(kind, str):
            self._ignore(entry, "no_type")
        elif kind == "heartbeat":
            self.stats.heartbeats += 1
        elif kind == "welcome_ack" and not acknowledged:
            self._router.acknowledge(entry)
            return _ACKNOWLEDGED
        elif kind in ("publish", "ready"):
            result: dict[str, Any] = data
            return result
        else:
            self._ignore(entry, "unknown_type")
        return None

    def _ignore(self, entry: SocketEntry, kind: str) -> None:
        self.stats.ignored_messages += 1
        self.stats.ignored_by_kind[kind] += 1
        entry.log.debug("sidecar_message_ignored", kind=kind)


def welcome_message(
    entry: SocketEntry, served: Served | None, heartbeat_interval: float, secret: str | None
) -> str:
    """The welcome of an admitted socket (architecture §4): its identity, what its sidecar
    serves, and on v2 its reconnect secret. Every field is sent to v1 and v2 alike: a sidecar
    ignores the fields it does not know."""
    served = served or Served()
    welcome: dict[str, Any] = {
        "type": "welcome",
        "allocation_id": entry.target.allocation_id,
        "sidecar_id": entry.sidecar_id,
        "generation": entry.target.generation,
        "heartbeat_interval_s": heartbeat_interval,
        "spec": served.spec,
        "tenant": served.tenant,
        "session": served.session,
        "ready_when": served.ready_when,
    }
    if secret is not None:
        welcome["reconnect_secret"] = secret
    return json.dumps(welcome)
