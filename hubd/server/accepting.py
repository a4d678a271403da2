"""Accepting: every socket the kernel holds for the listener, taken in one turn of the loop.

libuv (uvloop's loop) accepts one connection each time the listening socket reports ready, and
reports it once a turn. While a turn takes milliseconds (a daemon provisioning hundreds of
sidecars a second), sockets then wait in the kernel's accept queue, a hundred at a time for a
few hundred milliseconds, before anything is known of them; another tenant's sidecar waits in
the same queue (docs/measurements.md, "Fair claiming among tenants"). :class:`Acceptor` watches a
duplicate of the listening socket and takes every socket waiting, up to :data:`PER_TURN` a turn,
handing each to the loop as a connection the listener's own factory makes: what happens to a
socket from there (the gate, the handshake, its bounds) does not depend on who accepted it.
asyncio's own loop takes the whole queue a turn already and needs none.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import ssl
import time
from collections.abc import Callable
from typing import Final

import structlog

from hubd.logs import Sampler

__all__ = ["ACCEPT_RETRY", "PER_TURN", "Acceptor", "drains_itself"]

log = structlog.get_logger(__name__)

PER_TURN: Final = 128
"""Sockets taken a turn at most: a flood cannot hold the loop in one callback."""
ACCEPT_RETRY: Final = 1.0
"""Seconds without taking sockets after the system refused one (no descriptor or memory left),
as asyncio does; uvloop's own accept sheds the queue meanwhile."""

_GONE: Final = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM})
"""Errors of one socket that went away before it was taken: take the next."""


def drains_itself(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` takes every waiting socket a turn itself (asyncio's selector loop
    does; uvloop's takes one)."""
    return type(loop).__module__.partition(".")[0] != "uvloop"


class Acceptor:
    """Takes the sockets waiting on ``listening`` each turn and hands them to the loop."""

    def __init__(
        self,
        listening: socket.socket,
        factory: Callable[[], asyncio.Protocol],
        *,
        ssl_context: ssl.SSLContext | None,
        ssl_handshake_timeout: float,
        ssl_shutdown_timeout: float,
        sampler: Sampler,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        # A duplicate: the listener's socket stays its server's, and closing this one closes
        # nothing of it.
        self._socket = socket.socket(fileno=os.dup(listening.fileno()))
        self._socket.setblocking(False)
        self._factory = factory
        self._tls: dict[str, object] = (
            {}
            if ssl_context is None
            else {
                "ssl": ssl_context,
                "ssl_handshake_timeout": ssl_handshake_timeout,
                "ssl_shutdown_timeout": ssl_shutdown_timeout,
            }
        )
        self._sampler = sampler
        self._connecting: set[asyncio.Task[object]] = set()
        self._retry: asyncio.TimerHandle | None = None
        self._closed = False
        self.taken = 0
        """Sockets taken here (the rest were taken by the loop's own accept)."""
        self._loop.add_reader(self._socket.fileno(), self._take)

    def close(self) -> None:
        """Take no more sockets; a connection still being set up (a TLS handshake) is
        cancelled, which closes its socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
        self._loop.remove_reader(self._socket.fileno())
        self._socket.close()
        for task in self._connecting:
            task.cancel()

    def _take(self) -> None:
        for _ in range(PER_TURN):
            try:
                connection, _ = self._socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _GONE:
                    continue
                self._pause(exc)
                return
            connection.setblocking(False)
            self.taken += 1
            task = self._loop.create_task(
                self._loop.connect_accepted_socket(self._factory, connection, **self._tls)  # type: ignore[arg-type]
            )
            self._connecting.add(task)
            task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task[object]) -> None:
        self._connecting.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            # A TLS handshake that failed or timed out: the loop closed the socket.
            suppressed = self._sampler.admit("setup-failed", time.monotonic())
            if suppressed is not None:
                log.info("sidecar_socket_setup_failed", error=type(exc).__name__,
                         suppressed=suppressed)  # fmt: skip

    def _pause(self, exc: OSError) -> None:
        self._loop.remove_reader(self._socket.fileno())
        suppressed = self._sampler.admit("accept-paused", time.monotonic())
        if suppressed is not None:
            log.warning("sidecar_accept_paused", error=os.strerror(exc.errno or 0),
                        retry_in=ACCEPT_RETRY, suppressed=suppressed)  # fmt: skip

        def resume() -> None:
            self._retry = None
            if not self._closed:
                with contextlib.suppress(OSError):
                    self._loop.add_reader(self._socket.fileno(), self._take)

        self._retry = self._loop.call_later(ACCEPT_RETRY, resume)
