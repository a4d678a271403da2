"""The admin listener: ``/healthz``, ``/readyz`` and ``/metrics`` over plain HTTP/1.1.

Deliberately tiny: GET only, one request per connection, bounded request size and time, so a
misbehaving scraper cannot hold resources the daemon needs.

It runs its own event loop on a thread of its own. A probe must answer while the daemon's loop
is busy (a flood of handshakes, thousands of sockets to check), or a liveness check restarts a
daemon that is merely working; on its own loop a probe waits for the interpreter's lock at most
(a few milliseconds), never behind the daemon's queue of ready callbacks. ``/healthz`` and
``/readyz`` read only state that is safe to read from another thread (flags and monotonic
times); ``/metrics`` is rendered on the daemon's loop, where every value it reads is written
(and where the allocation counts are read from the database, see :mod:`hubd.daemon.counting`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import structlog

__all__ = ["AdminServer"]

log = structlog.get_logger(__name__)

_MAX_REQUEST = 8192
_READ_TIMEOUT = 5.0
_RENDER_TIMEOUT = 10.0
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


class AdminServer:
    def __init__(
        self,
        *,
        host: str,
        port: int,
        readiness: Callable[[], str | None],
        metrics: Callable[[], Coroutine[Any, Any, bytes]],
        detail: Callable[[], Sequence[str]] = lambda: (),
    ) -> None:
        """``readiness`` is called on the admin thread: ``None`` when ready, else what is
        missing; ``detail`` too: lines ``/readyz`` adds whatever the answer (what works only
        in part, such as a provisioner that cannot reach its engine). ``metrics`` is awaited
        on the loop that called :meth:`start`."""
        self._host = host
        self._port = port
        self._readiness = readiness
        self._detail = detail
        self._metrics = metrics
        self._owner: asyncio.AbstractEventLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._bound: int | None = None

    @property
    def port(self) -> int:
        assert self._bound is not None
        return self._bound

    async def start(self) -> None:
        """Bind and serve on the admin thread; a bind error is raised here."""
        self._owner = asyncio.get_running_loop()
        bound: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(bound,), name="hubd-admin", daemon=True
        )
        self._thread.start()
        try:
            self._bound = await asyncio.wrap_future(bound)
        except BaseException:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
            raise
        log.info("admin_listener_up", host=self._host, port=self.port)

    async def close(self) -> None:
        thread, loop = self._thread, self._loop
        if thread is None:
            return
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        await asyncio.to_thread(thread.join)
        self._thread = None

    def _run(self, bound: concurrent.futures.Future[int]) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            try:
                server = loop.run_until_complete(
                    asyncio.start_server(self._serve, self._host, self._port)
                )
            except BaseException as exc:  # noqa: BLE001 -- handed to start() to raise
                bound.set_exception(exc)
                return
            self._loop = loop
            bound.set_result(int(server.sockets[0].getsockname()[1]))
            loop.run_forever()
            server.close()
            loop.run_until_complete(server.wait_closed())
            # Requests still being answered end with the loop.
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        finally:
            loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_READ_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
            status, content_type, body = await self._respond(head)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            writer.close()
            return
        header = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        try:
            writer.write(header + body)
            await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    async def _respond(self, head: bytes) -> tuple[int, str, bytes]:
        if len(head) > _MAX_REQUEST:
            return 404, "text/plain", b"request too large\n"
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = line.split(" ")
        if len(parts) != 3:
            return 404, "text/plain", b"bad request\n"
        method, path = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"GET only\n"
        if path == "/healthz":
            return 200, "text/plain", b"ok\n"
        if path == "/readyz":
            problem = self._readiness()
            detail = "".join(f"{line}\n" for line in self._detail())
            if problem is None:
                return 200, "text/plain", f"ready\n{detail}".encode()
            return 503, "text/plain", f"not ready: {problem}\n{detail}".encode()
        if path == "/metrics":
            body = await self._render()
            if body is None:
                return 503, "text/plain", b"metrics unavailable\n"
            return 200, "text/plain; version=0.0.4; charset=utf-8", body
        return 404, "text/plain", b"not found\n"

    async def _render(self) -> bytes | None:
        """The metrics, rendered on the daemon's loop; ``None`` when it is gone or too busy."""
        owner = self._owner
        if owner is None or owner.is_closed():
            return None

        render = self._metrics()
        try:
            rendered = asyncio.run_coroutine_threadsafe(render, owner)
        except RuntimeError:  # the daemon's loop stopped
            render.close()
            return None
        try:
            async with asyncio.timeout(_RENDER_TIMEOUT):
                return await asyncio.wrap_future(rendered)
        except TimeoutError:
            rendered.cancel()
            return None
