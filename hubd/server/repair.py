"""SocketRepair: the sockets held here follow what every replica writes.

Any replica may write an allocation's newer record, generation or terminal status, and the
sockets this instance holds must follow. A ``hubd_sockets`` notification (a newer generation, a
terminal status) or a ``hubd_connected`` one (a newer record of the allocation, on any replica)
closes what no longer belongs; so does a write fenced on a socket's record that matches nothing
(:meth:`~SocketRepair.follow_record`), rather than wait for the notification. The periodic
check (:meth:`~SocketRepair.verify`), the fallback for a lost notification, also writes again
the record of an open socket that a peer swept while this instance could not heartbeat: a
database outage must not turn a healthy sidecar into a lost one.
"""

from __future__ import annotations

import asyncio

from hubd.aio import KeyedFifo
from hubd.errors import StoreError
from hubd.redaction import describe_error
from hubd.routing import Arrivals, Target
from hubd.server.handshake import CloseCode
from hubd.server.registry import SocketRegistry
from hubd.server.sockets import SocketEntry
from hubd.store.channels import ConnectedNotice, SocketControl
from hubd.store.connections import ConnectionStore
from hubd.store.rows import Status

__all__ = ["SocketRepair"]


class SocketRepair:
    """Closes the sockets held here that another replica's write says no longer belong, and
    writes again the records a peer swept while their sockets stayed open.

    ``serial`` is the router's per-allocation FIFO: a record written again takes its turn
    behind the allocation's connect and disconnect steps."""

    def __init__(
        self,
        registry: SocketRegistry,
        connections: ConnectionStore,
        *,
        serial: KeyedFifo,
        arrivals: Arrivals,
        event_timeout: float,
    ) -> None:
        self._registry = registry
        self._connections = connections
        self._serial = serial
        self._arrivals = arrivals
        self._event_timeout = event_timeout
        self.remote_closes = 0
        """Sockets closed because another replica's write said they no longer belong."""

    def notice_connected(self, notice: ConnectedNotice) -> None:
        """A ``hubd_connected`` notification arrived (from any replica, this one included):
        wake waiters, and close local sockets that the new record superseded or fenced. Its tag
        names an allocation only if a waiter, a socket or a handshake of it is held here; any
        other notice concerns nothing here."""
        waited = self._arrivals.allocation(notice.tag)
        if waited is not None:
            self._arrivals.arrived(Target(waited, notice.generation))
        allocation_id = self._registry.allocation(notice.tag)
        if allocation_id is None:
            return
        for entry in self._registry.marked(allocation_id):
            if entry.target.generation < notice.generation:
                self.remote_closes += 1
                self._registry.close(entry, CloseCode.FENCED)
            elif (
                entry.target.generation == notice.generation
                and entry.connection_id != notice.connection_id
            ):
                if entry.seq is None:
                    # Its admission is under way: whether its record is older than this one
                    # is known once its number is (see admitted).
                    entry.seen_seq = max(entry.seen_seq or 0, notice.seq)
                elif entry.seq < notice.seq:
                    self.remote_closes += 1
                    self._registry.close(entry, CloseCode.SUPERSEDED)

    def admitted(self, entry: SocketEntry) -> None:
        """``entry``'s record was written (its number is known): closed if a newer record of
        its generation was announced while its admission ran."""
        if (entry.seen_seq or 0) > (entry.seq or 0):
            # Another replica recorded the sidecar after this admission's statement, and said
            # so before this process acted on the answer (it was slow, or paused).
            self.remote_closes += 1
            self._registry.close(entry, CloseCode.SUPERSEDED)

    def apply_control(self, control: SocketControl) -> None:
        """A ``hubd_sockets`` notification: the allocation moved to a newer generation, or
        became terminal, on some replica. A tag that names no allocation held here closes
        nothing."""
        allocation_id = self._registry.allocation(control.tag)
        if allocation_id is None:
            return
        if control.retire:
            self.remote_closes += self._registry.retire(allocation_id)
        else:
            self.remote_closes += self._registry.fence(allocation_id, control.generation)

    async def verify(self) -> tuple[int, int]:
        """Compare every recorded socket held here with the database: close what no longer
        belongs (retired, fenced, superseded) and write again the records a sweep removed
        while the socket stayed open. Returns (records written again, sockets closed)."""
        held = self._registry.recorded()
        if not held:
            return 0, 0
        checks = await self._connections.check_sockets(
            [(e.target.allocation_id, e.connection_id) for e in held]
        )
        by_id = {entry.connection_id: entry for entry in held}
        close = self._registry.close
        reasserted = closed = 0
        for check in checks:
            entry = by_id.get(check.connection_id)
            if entry is None or entry.closed_by_hub is not None:
                continue
            if check.status is None or check.status.terminal:
                close(entry, CloseCode.RETIRED)
                closed += 1
            elif check.generation is not None and check.generation > entry.target.generation:
                close(entry, CloseCode.FENCED)
                closed += 1
            elif check.recorded_connection_id == entry.connection_id:
                continue
            elif check.recorded_connection_id is not None:
                if (check.recorded_seq or 0) > (entry.seq or 0):
                    close(entry, CloseCode.SUPERSEDED)
                    closed += 1
            elif check.status in (Status.PROVISIONING, Status.ALLOCATED) and await self._reassert(
                entry
            ):
                reasserted += 1
        return reasserted, closed

    async def _reassert(self, entry: SocketEntry) -> bool:
        async with self._serial.hold(entry.target.allocation_id):
            # Checked under the allocation's lock: a socket whose handler finished meanwhile
            # has cleared (or is about to clear) its record, and must not get it back.
            if entry.gone or entry.closed_by_hub is not None:
                return False
            try:
                async with asyncio.timeout(self._event_timeout):
                    seq = await self._connections.reassert(
                        entry.connection_id, entry.target, entry.sidecar_id
                    )
            except (StoreError, TimeoutError) as exc:
                entry.log.warning("connection_not_reasserted", error=describe_error(exc))
                return False
            if seq is None:
                return False
            entry.seq = seq
            entry.log.info("connection_reasserted", seq=seq)
            return True

    async def follow_record(self, entry: SocketEntry) -> None:
        """A write fenced on ``entry``'s record matched nothing: close the socket as the
        database says it no longer belongs (retired, fenced, superseded) rather than wait for
        the notification or the repair sweep; with no record of it left (cleared by a sweep),
        1011, so the sidecar reconnects and records itself again."""
        close = self._registry.close
        try:
            async with asyncio.timeout(self._event_timeout):
                checks = await self._connections.check_sockets(
                    [(entry.target.allocation_id, entry.connection_id)]
                )
        except (StoreError, TimeoutError) as exc:
            entry.log.warning("sidecar_record_unknown", error=describe_error(exc))
            close(entry, CloseCode.INTERNAL_ERROR)
            return
        for check in checks:
            if check.status is None or check.status.terminal:
                close(entry, CloseCode.RETIRED)
            elif check.generation is not None and check.generation > entry.target.generation:
                close(entry, CloseCode.FENCED)
            elif check.recorded_connection_id not in (None, entry.connection_id):
                close(entry, CloseCode.SUPERSEDED)
            elif check.recorded_connection_id is None:
                close(entry, CloseCode.INTERNAL_ERROR)
