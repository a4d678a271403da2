"""The seam between the reconciler and whatever carries sidecar connections.

The reconciler asks a :class:`Router` to fence and retire sockets and whether a sidecar is
ready; the router tells a :class:`ConnectionEvents` sink (the reconciler) when sidecars connect
and disconnect. Neither side imports the other: both depend on this module only.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from hubd.errors import HubdError

__all__ = ["ConnectionEvents", "Router", "SidecarNotConnected", "Target"]


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
