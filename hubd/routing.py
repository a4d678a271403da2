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
from collections.abc import Callable, Iterator
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
    "TagIndex",
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


class TagIndex:
    """Which allocation a notification's tag names, among the allocations something is held
    for here (``hubd.store.channels``: the daemons' notifications name allocations by tags,
    which any role may read). A tag is made once, when its allocation starts being held, so a
    notification costs a dict look-up; a tag of an allocation not held names nothing."""

    def __init__(self, tag_of: Callable[[str], str]) -> None:
        self._tag_of = tag_of
        self._tags: dict[str, str] = {}
        self._allocations: dict[str, str] = {}

    def track(self, allocation_id: str, *, held: bool) -> None:
        """``allocation_id`` is (still) held here, or no longer is."""
        if held:
            if allocation_id not in self._tags:
                tag = self._tag_of(allocation_id)
                self._tags[allocation_id] = tag
                self._allocations[tag] = allocation_id
        elif allocation_id in self._tags:
            del self._allocations[self._tags.pop(allocation_id)]

    def allocation(self, tag: str) -> str | None:
        """The held allocation ``tag`` names, if any."""
        return self._allocations.get(tag)

    def __len__(self) -> int:
        return len(self._tags)


class Arrivals:
    """Waiters for connect notifications, by target. A waiter is registered before anyone
    asks the database whether the sidecar is connected, so a connect that lands between the
    question and the wait resolves it instead of being missed.

    With ``tag_of`` (how the database tags an allocation), a notification's tag finds the
    allocation waited for (:meth:`allocation`); without it, only :meth:`arrived` wakes waiters."""

    def __init__(self, tag_of: Callable[[str], str] | None = None) -> None:
        self._waiters: dict[Target, set[asyncio.Future[None]]] = {}
        # Waiters per allocation, whatever their generation: its tag is kept while any waits.
        self._counts: dict[str, int] = {}
        self._tags = TagIndex(tag_of) if tag_of is not None else None

    @contextlib.contextmanager
    def expect(self, target: Target) -> Iterator[asyncio.Future[None]]:
        """A future resolved by the next :meth:`arrived` of ``target``, for the block."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(target, set()).add(waiter)
        self._count(target.allocation_id, 1)
        try:
            yield waiter
        finally:
            waiters = self._waiters.get(target)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[target]
            self._count(target.allocation_id, -1)

    def arrived(self, target: Target) -> None:
        for waiter in self._waiters.get(target, ()):
            if not waiter.done():
                waiter.set_result(None)

    def allocation(self, tag: str) -> str | None:
        """The allocation waited for here that ``tag`` names, if any."""
        return self._tags.allocation(tag) if self._tags is not None else None

    def _count(self, allocation_id: str, step: int) -> None:
        count = self._counts.get(allocation_id, 0) + step
        if count > 0:
            self._counts[allocation_id] = count
        else:
            self._counts.pop(allocation_id, None)
        if self._tags is not None:
            self._tags.track(allocation_id, held=count > 0)

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
