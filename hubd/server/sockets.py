"""A socket as the router holds it, and the per-allocation FIFO its steps queue on."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

import attrs

from hubd.routing import Target
from hubd.server.handshake import CloseCode

__all__ = ["KeyedFifo", "SidecarSocket", "SocketEntry", "new_connection_id"]


def new_connection_id() -> str:
    return f"cn_{secrets.token_hex(16)}"


class SidecarSocket(Protocol):
    """What the router needs of a websocket connection."""

    async def send(self, message: str) -> None: ...

    async def close(self, code: int, reason: str) -> None: ...


@attrs.define(eq=False)
class SocketEntry:
    """One accepted socket, from registration until its handler is done with it."""

    connection_id: str
    target: Target
    sidecar_id: str
    ws: SidecarSocket = attrs.field(repr=False)
    log: Any = attrs.field(repr=False)
    closed_by_hub: CloseCode | None = None
    """Set (before the close frame is sent) when the hub closes the socket, and why."""
    recorded: bool = False
    seq: int | None = None
    """The connection number its record was written with (the higher of two sockets wins)."""
    gone: bool = False
    """Set when its handler is done with it: no record may be written for it again."""
    secret_hash: bytes | None = attrs.field(default=None, repr=False)
    """The digest of the reconnect secret its welcome carried (v2), until acknowledged."""
    superseded: SocketEntry | None = attrs.field(default=None, repr=False)
    """The socket this one took over from; its record is this one's to clean up if this one
    never manages to write its own."""


@attrs.define(eq=False)
class _Slot:
    lock: asyncio.Lock = attrs.field(factory=asyncio.Lock)
    users: int = 0


class KeyedFifo:
    """One FIFO lock per key, forgotten as soon as nobody holds or waits for it.

    ``asyncio.Lock`` hands itself to waiters in the order they called ``acquire``; callers
    reach ``acquire`` without yielding after the event they serialize, so the order of the steps
    is the order of the events.
    """

    def __init__(self) -> None:
        self._slots: dict[str, _Slot] = {}

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot()
        slot.users += 1
        try:
            async with slot.lock:
                yield
        finally:
            slot.users -= 1
            if slot.users == 0:
                del self._slots[key]

    def __len__(self) -> int:
        return len(self._slots)
