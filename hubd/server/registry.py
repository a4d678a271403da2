"""SocketRegistry: the sidecar sockets this instance holds, by allocation (the open ones, and the
handshakes whose admission is under way, which a fence or a retirement reaches too), and the
hub's closes of them."""

from __future__ import annotations

from collections.abc import Callable

from hubd.aio import TrackedTasks
from hubd.routing import TagIndex
from hubd.server.handshake import CloseCode
from hubd.server.sockets import SocketEntry

__all__ = ["SocketRegistry"]


class SocketRegistry:
    """The open sockets and pending handshakes of this instance, by allocation and connection
    id, and the tags (``tag_of``: how the database tags an allocation in its notifications) of
    the allocations they belong to. Closes run on ``tasks``."""

    def __init__(self, tasks: TrackedTasks, *, tag_of: Callable[[str], str]) -> None:
        self._tasks = tasks
        self._sockets: dict[str, dict[str, SocketEntry]] = {}
        self._pending: dict[str, dict[str, SocketEntry]] = {}
        self._tags = TagIndex(tag_of)

    # -- what it holds --------------------------------------------------------------------------

    def expect(self, entry: SocketEntry) -> None:
        """Hold a handshake whose admission is about to be asked for."""
        self._pending.setdefault(entry.target.allocation_id, {})[entry.connection_id] = entry
        self._track(entry.target.allocation_id)

    def forget_pending(self, entry: SocketEntry) -> None:
        pending = self._pending.get(entry.target.allocation_id)
        if pending is not None:
            pending.pop(entry.connection_id, None)
            if not pending:
                del self._pending[entry.target.allocation_id]
        self._track(entry.target.allocation_id)

    def add(self, entry: SocketEntry) -> None:
        """Hold an admitted socket."""
        self._sockets.setdefault(entry.target.allocation_id, {})[entry.connection_id] = entry
        self._track(entry.target.allocation_id)

    def remove(self, entry: SocketEntry) -> None:
        peers = self._sockets.get(entry.target.allocation_id)
        if peers is not None:
            peers.pop(entry.connection_id, None)
            if not peers:
                del self._sockets[entry.target.allocation_id]
        self._track(entry.target.allocation_id)

    def allocation(self, tag: str) -> str | None:
        """The allocation ``tag`` names, if a socket or a handshake of it is held here."""
        return self._tags.allocation(tag)

    def _track(self, allocation_id: str) -> None:
        held = allocation_id in self._sockets or allocation_id in self._pending
        self._tags.track(allocation_id, held=held)

    def sockets(self, allocation_id: str) -> list[SocketEntry]:
        """The admitted sockets of an allocation that the hub has not started closing."""
        peers = self._sockets.get(allocation_id, {})
        return [entry for entry in peers.values() if entry.closed_by_hub is None]

    def pending(self, allocation_id: str) -> list[SocketEntry]:
        """The handshakes of an allocation whose admission is under way."""
        return list(self._pending.get(allocation_id, {}).values())

    def marked(self, allocation_id: str) -> list[SocketEntry]:
        """The open entries and those whose admission is under way: what a fence or a
        retirement closes."""
        pending = self._pending.get(allocation_id, {})
        waiting = [entry for entry in pending.values() if entry.closed_by_hub is None]
        return [*self.sockets(allocation_id), *waiting]

    def recorded(self) -> list[SocketEntry]:
        """Every admitted socket whose record was written, unless the hub is closing it."""
        return [
            entry
            for peers in list(self._sockets.values())
            for entry in peers.values()
            if entry.closed_by_hub is None and entry.recorded
        ]

    @property
    def connection_count(self) -> int:
        return sum(len(peers) for peers in self._sockets.values())

    # -- closes ---------------------------------------------------------------------------------

    def close(self, entry: SocketEntry, code: CloseCode, reason: str | None = None) -> None:
        """Close ``entry`` with ``code`` and ``reason`` (default: the code's), once."""
        if entry.closed_by_hub is not None:
            return
        # Marked before the close frame goes out, so the socket's own handler, whenever it
        # sees the close, knows it was the hub's doing and why (its ``sidecar_disconnected``
        # line says so at info; this one is at debug).
        entry.closed_by_hub = code
        entry.log.debug("closing_sidecar", code=int(code), reason=code.reason)
        if not entry.upgraded:
            # Not open yet: the close goes out once it is (see SocketRouter.upgraded), or never.
            return
        self._tasks.spawn(
            entry.ws.close(int(code), reason or code.reason), name=f"close-{entry.connection_id}"
        )

    def fence(self, allocation_id: str, generation: int) -> int:
        """Close the allocation's sockets older than ``generation`` with 4002; how many."""
        closed = 0
        for entry in self.marked(allocation_id):
            if entry.target.generation < generation:
                self.close(entry, CloseCode.FENCED)
                closed += 1
        return closed

    def retire(self, allocation_id: str) -> int:
        """Close every socket of the allocation with 4001, whatever its generation; how many."""
        closed = 0
        for entry in self.marked(allocation_id):
            self.close(entry, CloseCode.RETIRED)
            closed += 1
        return closed

    def close_every(self, code: CloseCode) -> None:
        """Close every socket and pending handshake held here with ``code``."""
        for peers in [*self._sockets.values(), *self._pending.values()]:
            for entry in list(peers.values()):
                self.close(entry, code)
