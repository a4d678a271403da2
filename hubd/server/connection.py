"""One sidecar socket with hubd's resource bounds, as websockets' connection class.

What the bounds are and how each was sized is :mod:`hubd.server.limits`. The connection knows
its listener only as a :class:`ConnectionHost`: the gate that admits and counts the sockets, and
where to report what a socket does (the listener, :class:`~hubd.server.listener.SidecarServer`,
is one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Final, Protocol

from websockets.asyncio.server import Server, ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.frames import Frame, Opcode
from websockets.protocol import Event, State
from websockets.server import ServerProtocol

from hubd.server.handshake import Rejection
from hubd.server.limits import HeaderScanner, ListenerLimits, TokenBucket
from hubd.server.slots import SourceGate
from hubd.server.sockets import SocketEntry
from hubd.store.connection_values import Served

__all__ = ["ConnectionHost", "SidecarConnection", "drain"]

_CONTROL: Final = frozenset({Opcode.PING, Opcode.PONG})
_STATUS_LINES: Final = {
    429: "429 Too Many Requests",
    431: "431 Request Header Fields Too Large",
    503: "503 Service Unavailable",
}


class ConnectionHost(Protocol):
    """What a sidecar connection needs of the listener that accepted it: the gate it is
    admitted by, the bounds it applies, and where it reports what happens to it."""

    @property
    def gate(self) -> SourceGate[SidecarConnection]: ...

    @property
    def limits(self) -> ListenerLimits: ...

    @property
    def refusal_linger(self) -> float:
        """Seconds a refused socket stays open, reads discarded, so its peer reads the
        refusal."""

    def settle(self) -> None:
        """Carry out what the gate decides now that a socket's count changed."""

    def queued(self, connection: SidecarConnection) -> None:
        """``connection`` waits for a handshake slot."""

    def refused(self, connection: SidecarConnection, rejection: Rejection, *, early: bool) -> None:
        """``connection`` was refused by a resource bound before websockets read its request;
        ``early``: before any of its bytes was read."""

    def aborted(self, connection: SidecarConnection, why: str) -> None:
        """``connection`` was aborted for a resource bound."""

    def handshake_abandoned(self, entry: SocketEntry) -> None:
        """The handshake of ``entry`` was admitted, but its socket never opened."""


class SidecarConnection(ServerConnection):
    """A server connection with hubd's resource bounds, carrying the handshake it was
    authenticated with.

    The bounds live in the asyncio protocol callbacks because that is the only place that sees
    bytes before websockets buffers them, and write-buffer pressure before a writer is stuck.
    """

    # websockets' connection already keeps about thirty attributes in its instance dict; ours
    # in that dict too would push it past CPython's key-sharing limit and cost about 1.3 KiB
    # more per socket (measured with tracemalloc); as slots they cost 8 bytes each.
    __slots__ = (
        "_aborted",
        "_counted",
        "_give_up",
        "_handshaking",
        "_hub",
        "_limits",
        "_lingering",
        "_refused",
        "_scanner",
        "_stall",
        "_stash",
        "_waiting",
        "budget",
        "hubd_entry",
        "hubd_secret",
        "hubd_served",
        "on_violation",
        "source",
    )

    def __init__(
        self, protocol: ServerProtocol, server: Server, *, hub: ConnectionHost, **options: Any
    ) -> None:
        super().__init__(protocol, server, **options)
        self.hubd_entry: SocketEntry | None = None
        """The router's entry of an admitted handshake, from its admission until its handler
        takes it (or the handshake is abandoned)."""
        self.hubd_secret: str | None = None
        """The reconnect secret its welcome will carry (v2), from its admission until then."""
        self.hubd_served: Served | None = None
        """What its sidecar serves (spec, tenant, session), for its welcome, until then."""
        self.budget: TokenBucket | None = None
        """Messages and control frames together; set once the socket is open."""
        self.on_violation: Callable[[str], None] | None = None
        """Called (once) when the peer breaks the budget; set once the socket is registered."""
        self._hub = hub
        self._limits = hub.limits
        self._scanner: HeaderScanner | None = HeaderScanner(hub.limits)
        self.source = ""
        self._counted = False
        self._handshaking = False
        self._waiting = False
        self._stash = b""
        self._refused = False
        self._lingering = False
        self._aborted = False
        self._stall: asyncio.TimerHandle | None = None
        self._give_up: asyncio.TimerHandle | None = None

    def forget_handshake(self) -> None:
        """Drop the headers websockets keeps of the opening handshake: nothing reads them once
        the socket is open, the request's include the token and the reconnect secret, and
        together they would cost a few KiB for as long as the socket lives.

        Emptied in place, not replaced: websockets' parser keeps the request it parsed (in its
        generator's frame) for as long as the socket lives, so a new request on the connection
        would leave the original headers, the token among them, where they were."""
        if self.request is not None:
            self.request.headers.clear()
        if self.response is not None:
            self.response.headers.clear()

    async def handshake(self, *args: Any, **kwargs: Any) -> None:
        """websockets' opening handshake; an admitted handshake that does not end with an open
        socket is handed back to the listener, whose admission may have left a record."""
        try:
            await super().handshake(*args, **kwargs)
        finally:
            entry = self.hubd_entry
            if entry is not None and self.protocol.state is not State.OPEN:
                self.hubd_entry = self.hubd_secret = self.hubd_served = None
                self._hub.handshake_abandoned(entry)

    # -- admission ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # websockets starts the handler task here; a refused socket's handler sees the
        # connection lost and ends without calling process_request.
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        self.source = str(peer[0]) if peer else ""
        admitted = self._hub.gate.arrive(self, self.source, self.loop.time())
        if isinstance(admitted, Rejection):
            self._refuse(admitted, early=True)
            return
        self._counted = True
        if admitted:
            self._handshaking = True
        else:
            self._wait()
        self._hub.settle()

    def _wait(self) -> None:
        """Wait for a handshake slot without reading: the request stays in the kernel's buffer,
        and websockets' parser sees nothing until the slot is taken for it."""
        self._waiting = True
        self._hub.queued(self)
        self.transport.pause_reading()
        # uvloop starts reading once connection_made has returned, whatever was paused in it;
        # the pause is made again on the loop's next turn.
        self.loop.call_soon(self._keep_paused)

    def _keep_paused(self) -> None:
        if self._waiting and not self.transport.is_closing():
            self.transport.pause_reading()

    def admit(self) -> None:
        """Its turn came: a handshake slot is held for it from now on, so its request is read."""
        if not self._waiting:
            return
        self._waiting = False
        self._handshaking = True
        self.transport.resume_reading()
        scanner = self._scanner
        if self._stash and scanner is not None and scanner.complete:
            # Its whole request was read while it waited.
            self._hand_over(b"")

    def refuse_waiting(self, rejection: Rejection) -> None:
        """It waited its bound, or gave its place to a socket of another address."""
        if self._waiting:
            self._waiting = False
            self._stash = b""
            self._refuse(rejection, early=True)

    def handshake_over(self) -> None:
        """The handshake was decided (upgrade or refusal): its slot is free again."""
        if self._handshaking:
            self._handshaking = False
            self._scanner = None
            self._hub.gate.handshake_over(self, self.loop.time())
            self._hub.settle()

    def evict(self, why: str) -> None:
        """The gate gave this unfinished handshake's slot away (its count is already free):
        abort it."""
        self._handshaking = False
        self._scanner = None
        self._abort(why)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._waiting:
            self._waiting = False
            self._hub.gate.leave(self)
        self.handshake_over()
        if self._counted:
            self._counted = False
            self._hub.gate.closed()
        if self._lingering:
            self._lingering = False
            self._hub.gate.lingered()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        if self._give_up is not None:
            self._give_up.cancel()
            self._give_up = None
        super().connection_lost(exc)
        self._release_protocol()

    def _release_protocol(self) -> None:
        """Break the reference cycles websockets' protocol is left in once its connection is
        lost, so reference counting frees it at once.

        Its parser is a generator whose frame holds the protocol, and a handshake that ends
        without a request keeps an exception whose traceback holds the parser's frames. A flood
        of short connections (thousands a second, each closed before its request) otherwise
        leaves tens of thousands of objects a second to the cyclic collector, whose pauses
        (100-400 ms, holding the interpreter's lock) stalled even the admin thread's /readyz.
        Nothing reads either once the protocol is closed: the handshake coroutine sees no request
        and returns, and a closed protocol ignores further input."""
        protocol = self.protocol
        protocol.handshake_exc = None
        protocol.parser.close()

    def _refuse(self, rejection: Rejection, *, early: bool) -> None:
        """Answer with a plain HTTP refusal, without websockets' parser: it is used before (or
        instead of) reading the request.

        The socket lingers (reads discarded) for ``refusal_linger`` after a half-close, so the
        peer reads the status instead of a reset caused by its unread request; the number of
        lingering sockets is capped too, beyond which a refusal is a plain abort.
        """
        self._refused = True
        self._stash = b""
        self._hub.refused(self, rejection, early=early)
        self.handshake_over()
        transport = self.transport
        if not self._hub.gate.linger():
            self._aborted = True
            transport.abort()
            return
        body = (rejection.reason + "\n").encode()
        head = (
            f"HTTP/1.1 {_STATUS_LINES.get(rejection.status, str(rejection.status))}\r\n"
            "Server: hubd\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n"
        )
        if rejection.retry_after is not None:
            head += f"Retry-After: {rejection.retry_after}\r\n"
        transport.write(head.encode() + b"\r\n" + body)
        self._lingering = True
        # A socket refused from the queue was not being read: what its peer sent is read and
        # dropped now, or closing over it unread would reset the connection before the status.
        transport.resume_reading()
        if transport.can_write_eof():
            transport.write_eof()
            self._stall = self.loop.call_later(self._hub.refusal_linger, transport.abort)
        else:
            transport.close()

    # -- incoming bytes -------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        scanner = self._scanner
        if scanner is not None:
            problem = scanner.feed(data)
            if problem is not None:
                if self._waiting:
                    self._waiting = False
                    self._hub.gate.leave(self)
                self._refuse(Rejection(status=431, reason=problem), early=False)
                return
            if self._waiting or not scanner.complete:
                # Kept until the header block is complete (websockets' parser would buffer
                # the same bytes, within the scanner's bounds): a request that never completes
                # costs no parsing. A waiting socket reads no more until its turn (this read
                # came before the pause took hold).
                self._stash += data
                if self._waiting:
                    self.transport.pause_reading()
                return
            self._hand_over(data)
            return
        self._received(data)

    def _hand_over(self, data: bytes) -> None:
        """The request is complete: no longer a candidate for eviction, and parsed."""
        if self._stash:
            data, self._stash = self._stash + data, b""
        self._hub.gate.complete(self)
        self._received(data)

    def _received(self, data: bytes) -> None:
        super().data_received(data)
        # Automatic pongs (and close frames) are written without waiting for the buffer to
        # drain: a peer that pings and never reads grows it here, so it is measured here.
        self._bound_write_buffer()

    def process_event(self, event: Event) -> None:
        if (
            self.request is not None
            and isinstance(event, Frame)
            and event.opcode in _CONTROL
            and self.budget is not None
            and not self.budget.take(self.loop.time())
        ):
            # Pings cost the hub a pong each and pongs a dictionary look-up: they spend the
            # same budget as messages, or a ping flood would be free.
            self._violate("control frame rate exceeded")
        super().process_event(event)

    def _violate(self, why: str) -> None:
        callback, self.on_violation = self.on_violation, None
        if callback is not None:
            callback(why)

    # -- outgoing bytes -------------------------------------------------------------------------

    def flush(self) -> None:
        """Write what the protocol has queued (a frame sent outside websockets' coroutines, such
        as a keepalive ping), under the same write-buffer bound as its automatic pongs."""
        self.send_data()
        self._bound_write_buffer()

    def _bound_write_buffer(self) -> None:
        if self.transport.get_write_buffer_size() > self._limits.max_write_buffer:
            self._abort("write buffer full")

    def fail_now(self, code: int, reason: str) -> None:
        """Fail the connection as websockets' keepalive does: the close frame and the end of the
        stream at once, and the socket aborted if the peer has not closed it ``close_timeout``
        later."""
        self.protocol.fail(code, reason)
        self.send_data()
        if self._give_up is None and self.close_timeout is not None:
            self._give_up = self.loop.call_later(self.close_timeout, self.transport.abort)

    def pause_writing(self) -> None:
        super().pause_writing()
        # Every writer now waits in drain(), websockets' keepalive ping and close included:
        # nothing else would ever end a socket whose peer stopped reading.
        if self._stall is None:
            self._stall = self.loop.call_later(
                self._limits.write_stall_timeout, self._abort, "peer stopped reading"
            )

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _abort(self, why: str) -> None:
        self._stall = None
        if self._aborted:
            return
        self._aborted = True
        self._hub.aborted(self, why)
        self.transport.abort()


async def drain(connection: ServerConnection) -> None:
    """Discard messages until the close handshake completes.

    A closing socket must still be read: with its receive queue full, websockets stops reading
    the transport, the peer's close frame is never seen, and the close waits out its timeout.
    """
    try:
        async for _ in connection:
            pass
    except ConnectionClosed:
        pass
