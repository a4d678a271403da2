"""Streams whose readers hung up, found with one timer for them all.

aiohttp tells a handler that its connection is gone only when the handler next writes, and a
quiet event stream writes every ``HEARTBEAT`` (15 s): until then a reader that hung up kept its
key's stream slot, and a client that closed a stream and opened another at once was refused.
A quiet stream registers here while it waits; one task looks at every registered stream's
transport each :data:`INTERVAL` and cancels the handler of each whose transport is gone (as
aiohttp's own ``handler_cancellation`` would, for these handlers only), which gives the slot
back. The task runs only while a stream is registered: no streams, no wake-ups.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any, Final

from aiohttp import web

__all__ = ["INTERVAL", "HangUps"]

INTERVAL: Final = 0.5
"""Seconds between two looks at the quiet streams' transports."""


class HangUps:
    """The quiet streams, and the one task that ends those whose readers hung up."""

    def __init__(self, interval: float = INTERVAL) -> None:
        self._interval = interval
        self._quiet: dict[asyncio.Task[Any], web.Request] = {}
        self._looking: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def quiet(self, request: web.Request) -> Iterator[None]:
        """While the block runs, the current task (``request``'s handler) is cancelled if
        ``request``'s reader hangs up. Only for a wait that is safe to cancel."""
        task = asyncio.current_task()
        assert task is not None
        self._quiet[task] = request
        if self._looking is None or self._looking.done():
            self._looking = asyncio.get_running_loop().create_task(
                self._look(), name="http-hangups"
            )
        try:
            yield
        finally:
            self._quiet.pop(task, None)

    async def close(self) -> None:
        if self._looking is not None:
            self._looking.cancel()
            await asyncio.gather(self._looking, return_exceptions=True)

    async def _look(self) -> None:
        while self._quiet:
            await asyncio.sleep(self._interval)
            for task, request in list(self._quiet.items()):
                transport = request.transport
                if transport is None or transport.is_closing():
                    del self._quiet[task]
                    task.cancel()
