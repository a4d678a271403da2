"""A small TCP load balancer for process tests: every new connection goes to the next backend
(round robin) that accepts it, and bytes are copied both ways until either side closes, as a
layer-4 balancer in front of several replicas would do."""

from __future__ import annotations

import asyncio
import contextlib
import itertools

__all__ = ["Balancer"]


class Balancer:
    def __init__(self, backends: list[tuple[str, int]]) -> None:
        self._backends = backends
        self._next = itertools.cycle(range(len(backends)))
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        # Stop accepting first, so no connection is handed a task after the ones below were
        # cancelled; every task closes both of its streams however it ends.
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        while self._tasks:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        # A task cancelled before its first step never enters its try: the streams of a
        # connection accepted just before the close are closed here.
        for writer in self._writers:
            writer.close()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        task = asyncio.get_running_loop().create_task(self._serve(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_writer: asyncio.StreamWriter | None = None
        try:
            for _ in self._backends:
                host, port = self._backends[next(self._next)]
                with contextlib.suppress(OSError):
                    up_reader, up_writer = await asyncio.open_connection(host, port)
                    break
            if up_writer is None:
                return
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            writer.close()
            self._writers.discard(writer)
            if up_writer is not None:
                up_writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.write_eof()
