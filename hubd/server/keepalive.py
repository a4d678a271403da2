"""Keepalive: one timer pings every open sidecar socket, in place of a task per socket.

websockets' own keepalive is a task per connection that sleeps between pings: created with the
socket, cancelled when it closes, it cost a handshake about 25 us of the daemon's CPU and an
idle socket about 1.4 KiB (the task, its coroutine, its sleep's future and timer; an entry here
is 170 bytes, docs/performance.md). Here each socket is one entry in a queue. Every interval is
the same, so a queue kept in the order the entries were added is also in the order they come
due, and one timer armed at its head is enough.

The semantics are websockets': a ping every ``interval`` while the socket is open, and a
socket whose pong has not come back within ``timeout`` is failed with 1011 "keepalive ping
timeout" (the close frame, then the end of the stream; the socket is aborted if the peer has not
closed it ``close_timeout`` later). The pong is matched by websockets' own bookkeeping, so the
connection's ``latency`` stays what it measures.

The queues hold weak references: a socket that closed between two pings is dropped when its
turn comes, and its memory is not kept for up to an interval after it closed.

A socket is anything :class:`Pingable`: websockets' connection with a way to write a frame and
to fail the socket under its own bounds (the listener's
:class:`~hubd.server.connection.SidecarConnection` is one).
"""

from __future__ import annotations

import asyncio
import random
import struct
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Final, Protocol, TypeVar

import structlog
from websockets.frames import CloseCode
from websockets.protocol import Protocol as WebSocketProtocol
from websockets.protocol import State

from hubd.redaction import describe_error

__all__ = ["Keepalive", "Pingable"]

log = structlog.get_logger(__name__)

_T = TypeVar("_T")

TIMEOUT_REASON: Final = "keepalive ping timeout"


class Pingable(Protocol):
    """What the keepalive needs of a socket (weakly referenceable): websockets' protocol and
    the pings it matches pongs against, and the socket's own bounded write and failure."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def transport(self) -> asyncio.Transport: ...

    @property
    def protocol(self) -> WebSocketProtocol: ...

    @property
    def pending_pings(self) -> dict[bytes, tuple[asyncio.Future[float], float]]: ...

    def flush(self) -> None:
        """Write what the protocol has queued, under the socket's write-buffer bound."""

    def fail_now(self, code: int, reason: str) -> None:
        """Send the close frame and end the stream at once; abort the socket if its peer has
        not closed it within the close timeout."""


class Keepalive:
    """Pings every added socket each ``interval`` seconds; fails one whose pong is ``timeout``
    late (``None``: never)."""

    def __init__(self, interval: float, timeout: float | None) -> None:
        if not interval > 0:
            raise ValueError(f"the keepalive interval must be positive, not {interval!r}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"the keepalive timeout must be positive, not {timeout!r}")
        self._interval = interval
        self._timeout = timeout
        # (when the next ping is due, the socket)
        self._due: deque[tuple[float, weakref.ref[Pingable]]] = deque()
        # (when the pong is late, the socket, the pong's future)
        self._pending: deque[tuple[float, weakref.ref[Pingable], asyncio.Future[float]]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.pings_sent = 0
        self.timeouts = 0

    def __len__(self) -> int:
        """Sockets waiting for their next ping (closed ones included until their turn)."""
        return len(self._due)

    def add(self, connection: Pingable) -> None:
        """Ping ``connection`` from one interval from now on, for as long as it is open."""
        if self._closed:
            return
        loop = self._loop = connection.loop
        self._due.append((loop.time() + self._interval, weakref.ref(connection)))
        if self._timer is None:
            self._arm()

    def close(self) -> None:
        """Stop pinging; sockets still open keep whatever they were sent."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._due.clear()
        self._pending.clear()

    def _arm(self) -> None:
        heads = [queue[0][0] for queue in (self._due, self._pending) if queue]
        if not heads or self._loop is None:
            self._timer = None
            return
        self._timer = self._loop.call_at(min(heads), self._fire)

    def _fire(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        due, pending = self._due, self._pending
        try:
            while pending and pending[0][0] <= now:
                _late, ref, answer = pending.popleft()
                connection = ref()
                if connection is not None and not answer.done():
                    self._guarded(self._fail, connection)
            while due and due[0][0] <= now:
                _when, ref = due.popleft()
                connection = ref()
                if connection is None or connection.protocol.state is not State.OPEN:
                    continue
                pong = self._guarded(self._ping, connection, now)
                if pong is None:
                    continue
                due.append((now + self._interval, ref))
                if self._timeout is not None:
                    pending.append((now + self._timeout, ref, pong))
        finally:
            # Whatever one socket did, the others keep their pings.
            if not self._closed:
                self._arm()

    def _guarded(self, act: Callable[..., _T], connection: Pingable, *args: Any) -> _T | None:
        """``act`` on one socket; a failure is that socket's (logged, and it is aborted), never
        the end of every other socket's keepalive."""
        try:
            return act(connection, *args)
        except Exception as exc:  # one socket's fault stays that socket's
            log.exception("keepalive_failed", error=describe_error(exc))
            connection.transport.abort()
            return None

    def _ping(self, connection: Pingable, now: float) -> asyncio.Future[float]:
        """Send a ping with a payload no other unanswered ping of the socket has, registered
        where websockets matches pongs (it sets the future's result to the latency)."""
        waiting = connection.pending_pings
        data = struct.pack("!I", random.getrandbits(32))
        while data in waiting:
            data = struct.pack("!I", random.getrandbits(32))
        pong = connection.loop.create_future()
        waiting[data] = (pong, now)
        connection.protocol.send_ping(data)
        connection.flush()
        self.pings_sent += 1
        return pong

    def _fail(self, connection: Pingable) -> None:
        if connection.protocol.state is not State.OPEN:
            return
        self.timeouts += 1
        connection.fail_now(CloseCode.INTERNAL_ERROR, TIMEOUT_REASON)
