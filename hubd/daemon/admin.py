"""The admin listener: ``/healthz``, ``/readyz`` and ``/metrics`` over plain HTTP/1.1.

Deliberately tiny: GET only, one request per connection, bounded request size and time, so a
misbehaving scraper cannot hold resources the daemon needs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

__all__ = ["AdminServer"]

log = structlog.get_logger(__name__)

_MAX_REQUEST = 8192
_READ_TIMEOUT = 5.0
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


class AdminServer:
    def __init__(
        self,
        *,
        host: str,
        port: int,
        readiness: Callable[[], Awaitable[str | None]],
        metrics: Callable[[], bytes],
    ) -> None:
        self._host = host
        self._port = port
        self._readiness = readiness
        self._metrics = metrics
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self._host, self._port)
        log.info("admin_listener_up", host=self._host, port=self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

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
            problem = await self._readiness()
            if problem is None:
                return 200, "text/plain", b"ready\n"
            return 503, "text/plain", f"not ready: {problem}\n".encode()
        if path == "/metrics":
            return 200, "text/plain; version=0.0.4; charset=utf-8", self._metrics()
        return 404, "text/plain", b"not found\n"
