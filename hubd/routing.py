"""The seam between the reconciler and whatever carries sidecar connections.

The reconciler asks a :class:`Router` to fence and retire the sockets this process holds and to
wait for a sidecar's connect notification. Whether a sidecar *is* connected is never asked of a
router: that is the database's answer (:meth:`hubd.store.connections.ConnectionStore.readiness`),
the same on every replica. A router may tell a :class:`ConnectionEvents` sink (metrics, tests)
what its sockets do. Neither side imports the other: both depend on this module only.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Protocol

import attrs

# Part of the seam (wait_ready raises it), defined with every other error and re-exported here.
from hubd.errors import SidecarNotConnected

__all__ = [
    "Arrivals",
    "ConnectionEvents",
    "MemoryRouter",
    "Router",
    "SidecarNotConnected",
    "Target",
    "not_connected",
]


@attrs.frozen
class Target:
    """One generation of one allocation: what a connection, a fence or a wait is about."""

    allocation_id: str
    generation: int


class Router(Protocol):
    def fence(self, allocation_id: str, generation: int) -> None:
        """Close sockets of generations older than ``generation`` (close code 4002)."""

    def retire(self, allocation_id: str, generation: int) -> None:
        """The allocation is terminal: close its sockets (close code 4001)."""

    async def wait_ready(self, target: Target, within: float) -> None:
        """Return once a connect of the target's sidecar is announced (on any replica), or
        at once if one is recorded; raise :class:`SidecarNotConnected` when ``within`` seconds
        pass first. A hint only: the caller reads the record before acting on it."""


class ConnectionEvents(Protocol):
    """Told in the order an allocation's sockets opened and closed, on the router's path: a
    sink only counts or records, it never waits."""

    def handle_connected(self, target: Target) -> None:
        """A sidecar of ``target`` connected and its connection record is written."""

    def handle_disconnect(self, target: Target) -> None:
        """The current connection of ``target`` closed (not superseded, fenced or retired)."""


class Arrivals:
    """Waiters for connect notifications, by target. A waiter is registered before anyone
    asks the database whether the sidecar is connected, so a connect that lands between the
    question and the wait resolves it instead of being missed."""

    def __init__(self) -> None:
        self._waiters: dict[Target, set[asyncio.Future[None]]] = {}

    @contextlib.contextmanager
    def expect(self, target: Target) -> Iterator[asyncio.Future[None]]:
        """A future resolved by the next :meth:`arrived` of ``target``, for the block."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(target, set()).add(waiter)
        try:
            yield waiter
        finally:
            waiters = self._waiters.get(target)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[target]

    def arrived(self, target: Target) -> None:
        for waiter in self._waiters.get(target, ()):
            if not waiter.done():
                waiter.set_result(None)

    def __len__(self) -> int:
        return sum(len(waiters) for waiters in self._waiters.values())


def not_connected(target: Target, within: float) -> SidecarNotConnected:
    return SidecarNotConnected(
        f"sidecar of {target.allocation_id} generation {target.generation} did not connect "
        f"within {within:g}s"
    )


class MemoryRouter:
    """A :class:`Router` with no sockets: it remembers what it was asked to fence and retire,
    and its waiters wake when the owner calls :meth:`notify_connected` (as a ``hubd_connected``
    notification would). Used by reconciler tests and by embedders with no websocket side."""

    def __init__(self) -> None:
        self.fenced: list[Target] = []
        self.retired: list[Target] = []
        self._arrivals = Arrivals()

    def notify_connected(self, target: Target) -> None:
        self._arrivals.arrived(target)

    def fence(self, allocation_id: str, generation: int) -> None:
        self.fenced.append(Target(allocation_id, generation))

    def retire(self, allocation_id: str, generation: int) -> None:
        self.retired.append(Target(allocation_id, generation))

    async def wait_ready(self, target: Target, within: float) -> None:
        with self._arrivals.expect(target) as arrival:
            try:
                async with asyncio.timeout(within):
                    await arrival
            except TimeoutError:
                raise not_connected(target, within) from None
