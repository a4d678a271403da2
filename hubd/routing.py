"""The seam between the reconciler and whatever carries sidecar connections.

The reconciler asks a :class:`Router` to fence and retire sockets and whether a sidecar is
ready; the router tells a :class:`ConnectionEvents` sink (the reconciler) when sidecars connect
and disconnect. Neither side imports the other: both depend on this module only.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import attrs

from hubd.errors import DatabaseUnavailable, HubdError

__all__ = ["ConnectionEvents", "MemoryRouter", "Router", "SidecarNotConnected", "Target"]


@attrs.frozen
class Target:
    """One generation of one allocation: what a connection, a fence or a wait is about."""

    allocation_id: str
    generation: int


class SidecarNotConnected(HubdError):
    """The sidecar did not connect before its connect deadline."""


class Router(Protocol):
    def fence(self, allocation_id: str, generation: int) -> None:
        """Close sockets of generations older than ``generation`` (close code 4002)."""

    def retire(self, allocation_id: str, generation: int) -> None:
        """The allocation is terminal: close its sockets (close code 4001)."""

    async def is_ready(self, target: Target) -> bool:
        """Whether the target's sidecar holds a current connection, on any replica.

        Raises :class:`hubd.errors.DatabaseUnavailable` when that cannot be known: unknown is
        never reported as absent.
        """

    async def wait_ready(self, target: Target, within: float) -> None:
        """Return once the target's sidecar is connected; raise :class:`SidecarNotConnected`
        when ``within`` seconds pass first."""


class ConnectionEvents(Protocol):
    async def handle_connected(self, target: Target) -> None:
        """A sidecar of ``target`` connected and its connection record is written."""

    async def handle_disconnect(self, target: Target) -> None:
        """The current connection of ``target`` closed (not superseded, fenced or retired)."""


class MemoryRouter:
    """A :class:`Router` kept in memory: connections are whatever the owner says they are.

    Used by reconciler tests and by embedders that have no websocket side; ``unavailable``
    makes readiness unknowable, as a database outage would.
    """

    def __init__(self) -> None:
        self.connected: set[Target] = set()
        self.fenced: list[Target] = []
        self.retired: list[Target] = []
        self.unavailable = False
        self._arrivals: dict[Target, asyncio.Event] = {}

    def connect(self, target: Target) -> None:
        self.connected.add(target)
        arrival = self._arrivals.pop(target, None)
        if arrival is not None:
            arrival.set()

    def disconnect(self, target: Target) -> None:
        self.connected.discard(target)

    def fence(self, allocation_id: str, generation: int) -> None:
        self.fenced.append(Target(allocation_id, generation))
        self.connected = {
            t
            for t in self.connected
            if t.allocation_id != allocation_id or t.generation >= generation
        }

    def retire(self, allocation_id: str, generation: int) -> None:
        self.retired.append(Target(allocation_id, generation))
        self.connected = {t for t in self.connected if t.allocation_id != allocation_id}

    async def is_ready(self, target: Target) -> bool:
        if self.unavailable:
            raise DatabaseUnavailable("readiness is unknown: the router is unavailable")
        return target in self.connected

    async def wait_ready(self, target: Target, within: float) -> None:
        if target in self.connected:
            return
        arrival = self._arrivals.setdefault(target, asyncio.Event())
        try:
            async with asyncio.timeout(within):
                await arrival.wait()
        except TimeoutError:
            raise SidecarNotConnected(
                f"sidecar of {target.allocation_id} generation {target.generation} did not "
                f"connect within {within:g}s"
            ) from None
