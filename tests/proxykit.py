"""A TCP proxy between hubd and PostgreSQL that passes, holds or drops traffic: the network
partitions of docs/operations.md, on real sockets.

- ``hold()``: bytes wait in the proxy and are delivered at ``heal()``, as TCP delivers them
  once a partition heals before either end gave up;
- ``drop()``: every connection open now, and every one accepted until ``heal()``, is dead for
  good: its bytes are read and thrown away and it is never closed (a vanished peer, a NAT that
  lost its state). Connections accepted after ``heal()`` pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import urllib.parse
from collections.abc import AsyncIterator

import attrs


@attrs.define(eq=False)
class _Pair:
    tasks: list[asyncio.Task[None]] = attrs.field(factory=list)
    writers: list[asyncio.StreamWriter] = attrs.field(factory=list)
    doomed: bool = False


def upstream_of(dsn: str) -> tuple[str, int] | str:
    """Where ``dsn`` points: ``(host, port)``, or the path of a Unix socket."""
    parts = urllib.parse.urlsplit(dsn)
    query = urllib.parse.parse_qs(parts.query)
    directory = query.get("host", [""])[0]
    if directory.startswith("/"):
        port = query.get("port", [str(parts.port or "")])[0]
        if port:
            return f"{directory}/.s.PGSQL.{port}"
        sockets = [s for s in glob.glob(f"{directory}/.s.PGSQL.*") if not s.endswith(".lock")]
        return sockets[0]
    return (parts.hostname or "127.0.0.1", parts.port or 5432)


class Blackhole:
    """The proxy; ``port`` is where it listens on 127.0.0.1."""

    def __init__(self, upstream: tuple[str, int] | str) -> None:
        self._upstream = upstream
        self._server: asyncio.Server | None = None
        self._pairs: set[_Pair] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._dropping = False
        self.accepted = 0
        self._port: int | None = None

    @property
    def port(self) -> int:
        assert self._port is not None, "the proxy was never started"
        return self._port

    def url(self, dsn: str, **query: str) -> str:
        """``dsn`` (user, database, options) through this proxy, plus ``query``."""
        return rewrite_hosts(dsn, [f"127.0.0.1:{self.port}"], **query)

    def hold(self) -> None:
        self._flowing.clear()

    def drop(self) -> None:
        self._dropping = True
        for pair in self._pairs:
            pair.doomed = True

    def heal(self) -> None:
        self._dropping = False
        self._flowing.set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self._port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for pair in list(self._pairs):
            for task in pair.tasks:
                task.cancel()
            for writer in pair.writers:
                writer.transport.abort()
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        pair = _Pair(writers=[writer], doomed=self._dropping)
        self._pairs.add(pair)
        try:
            if isinstance(self._upstream, str):
                up_reader, up_writer = await asyncio.open_unix_connection(self._upstream)
            else:
                up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            writer.transport.abort()
            self._pairs.discard(pair)
            return
        pair.writers.append(up_writer)
        pair.tasks = [
            asyncio.create_task(self._pump(pair, reader, up_writer), name="proxy-up"),
            asyncio.create_task(self._pump(pair, up_reader, writer), name="proxy-down"),
        ]
        # One end closing ends the pair: PostgreSQL closes after a Terminate, and the client
        # waits for that close, so it must pass at once rather than wait for the other way.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait(pair.tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in pair.tasks:
            task.cancel()
        for each in pair.writers:
            each.transport.abort()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*pair.tasks, return_exceptions=True)
        self._pairs.discard(pair)

    async def _pump(
        self, pair: _Pair, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while True:
            data = await reader.read(65536)
            if not data:
                if not pair.doomed:
                    return  # a real close passes; a dead peer's never arrives
                await asyncio.Event().wait()
            await self._flowing.wait()
            if pair.doomed:
                continue
            writer.write(data)
            await writer.drain()


def rewrite_hosts(dsn: str, hosts: list[str], **query: str) -> str:
    """``dsn`` naming ``hosts`` (``host:port`` each) instead of its own, plus ``query``."""
    parts = urllib.parse.urlsplit(dsn)
    userinfo, at, _ = parts.netloc.rpartition("@")
    kept = [
        (k, v)
        for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        if k not in ("host", "port", *query)
    ]
    kept.extend(query.items())
    netloc = f"{userinfo}{at}{','.join(hosts)}"
    return urllib.parse.urlunsplit(
        (parts.scheme, netloc, parts.path, urllib.parse.urlencode(kept), "")
    )


@contextlib.asynccontextmanager
async def blackhole(dsn: str) -> AsyncIterator[Blackhole]:
    """A running proxy to the server of ``dsn``."""
    proxy = Blackhole(upstream_of(dsn))
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()
