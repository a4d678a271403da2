"""SocketRouter: the registry of live sidecar sockets, and the :class:`~hubd.routing.Router` the
reconciler talks to.

What it keeps, per allocation: the sockets open on this instance, and the handshakes whose
admission is under way. A socket's durable connection record (one per allocation, so that
readiness is answered from the database and any replica gives the same answer) is written by its
admission, the listener's one statement that authenticates the handshake and records it before
the upgrade (``admit_many`` of :class:`~hubd.store.connections.ConnectionStore`); the router takes
the outcome (:meth:`SocketRouter.admitted`), and clears the record of a socket that closes, or of
a handshake abandoned after its admission (:meth:`SocketRouter.abandon`).

The welcome and the disconnect steps of one allocation run one at a time, in the order the
sockets opened and closed (a FIFO lock per allocation, forgotten when idle), so the reconciler
hears of an allocation's connects and disconnects in that order. A clear is fenced on the
connection id in its statement: an old socket's disconnect that follows its successor's record
clears nothing and reports nothing.

Which closes count as a disconnect:

* a close the sidecar or the network started, one websockets sends by itself (1009, keepalive
  timeout), and a 1008/1011 close by the hub: yes — one statement clears the record and marks
  the sidecar lost, both only if the record is still this socket's (a sidecar that meanwhile
  reconnected, to this replica or another, owns the record and is not lost);
* ``4000 superseded``: no — the socket that took over owns the record now;
* ``4001 retired`` / ``4002 fenced``: no, and nothing is written — the allocation already moved
  on, and the transition that moved it deleted the record in its own transaction;
* ``1001`` at shutdown: nothing per socket. The daemon settles its records as the instance stops
  (``release_instance``: cleared and marked lost in one statement, so a sidecar reconnecting to a
  peer finds a connect deadline; a peer's fresh record is never touched).

Sockets held here follow the database: a ``hubd_sockets`` notification (a newer generation, a
terminal status) or a ``hubd_connected`` one (a newer record of the allocation, on any replica)
closes what no longer belongs, and :meth:`verify`, the fallback for a lost notification, also
writes again the record of an open socket that a peer swept while this instance could not
heartbeat: a database outage must not turn a healthy sidecar into a lost one.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from hubd.errors import DatabaseUnavailable, StoreError
from hubd.redaction import describe_error
from hubd.routing import Arrivals, ConnectionEvents, Target, not_connected
from hubd.server.batching import Batcher
from hubd.server.handshake import CloseCode, HandshakeRequest
from hubd.server.messages import Publish
from hubd.server.sockets import (
    REFUSED_RECORD_CLOSES,
    KeyedFifo,
    SidecarSocket,
    SocketEntry,
    TrackedTasks,
    acknowledge_secret,
    clear_record,
    new_connection_id,
)
from hubd.store.connections import (
    ConnectedNotice,
    ConnectionStore,
    Disconnect,
    PublishOutcome,
    Record,
    RecordOutcome,
    SocketControl,
)
from hubd.store.models import Status
from hubd.store.secrets import Acknowledgement

__all__ = ["SocketRouter"]

log = structlog.get_logger(__name__)

# Closes with no record to clear: a successor's record replaced it, the fencing or retiring
# transition deleted it (hubd_socket_control), or shutdown settles the instance's at once.
_NOTHING_TO_CLEAR = frozenset(
    {CloseCode.GOING_AWAY, CloseCode.SUPERSEDED, CloseCode.FENCED, CloseCode.RETIRED}
)


class SocketRouter:
    """Live sockets of this instance, their durable records, and readiness waits."""

    def __init__(
        self,
        connections: ConnectionStore,
        *,
        events: ConnectionEvents | None = None,
        instance_ttl: float = 20.0,
        connect_timeout: float = 120.0,
        event_timeout: float = 30.0,
        clear_budget: float = 30.0,
    ) -> None:
        self._connections = connections
        self._events = events
        self._instance_ttl = instance_ttl
        self._event_timeout = event_timeout
        # Sockets that close while one clearing statement runs go in the next: a network blip
        # closes thousands at once, and one statement each held the socket pool's connections
        # while the sidecars were already reconnecting (their records use the same pool).
        self._clears: Batcher[Disconnect, bool] = Batcher(
            functools.partial(connections.disconnect_many, connect_timeout=connect_timeout),
            name="connection-clears",
            timeout=event_timeout,
            max_waiting=16384,
            concurrency=2,
        )
        # Clears a record and marks the sidecar lost, retrying within the clear budget.
        self._clear = functools.partial(clear_record, self._clears, budget=clear_budget)
        self._sockets: dict[str, dict[str, SocketEntry]] = {}
        # Handshakes whose admission is under way, by allocation (see expect).
        self._pending: dict[str, dict[str, SocketEntry]] = {}
        self._arrivals = Arrivals()
        self._serial = KeyedFifo()
        self._tasks = TrackedTasks()
        # A reconnect storm acknowledges a welcome per socket: those that arrive while one
        # statement runs go in the next. The cap bounds memory only (see acknowledge_secret).
        self._acknowledgements: Batcher[Acknowledgement, bool] = Batcher(
            connections.acknowledge_secrets,
            name="secret-acknowledgements",
            timeout=event_timeout,
            max_waiting=16384,
        )
        self._closing = False
        self.remote_closes = 0
        """Sockets closed because another replica's write said they no longer belong."""

    # -- the Router seam ------------------------------------------------------------------------

    def fence(self, allocation_id: str, generation: int) -> None:
        for entry in self._marked_entries(allocation_id):
            if entry.target.generation < generation:
                self._close(entry, CloseCode.FENCED)

    def retire(self, allocation_id: str, generation: int) -> None:
        # Every socket goes, whatever its generation: no sidecar of a finished allocation stays.
        del generation
        for entry in self._marked_entries(allocation_id):
            self._close(entry, CloseCode.RETIRED)

    async def is_ready(self, target: Target) -> bool:
        return await self._connections.is_connected(target, self._instance_ttl)

    def notice_connected(self, notice: ConnectedNotice) -> None:
        """A ``hubd_connected`` notification arrived (from any replica, this one included):
        wake waiters, and close local sockets that the new record superseded or fenced."""
        self.notify_connected(notice.target)
        for entry in self._marked_entries(notice.target.allocation_id):
            if entry.target.generation < notice.target.generation:
                self.remote_closes += 1
                self._close(entry, CloseCode.FENCED)
            elif (
                entry.target.generation == notice.target.generation
                and entry.connection_id != notice.connection_id
            ):
                if entry.seq is None:
                    # Its admission is under way: whether its record is older than this one
                    # is known once its number is (see admitted).
                    entry.seen_seq = max(entry.seen_seq or 0, notice.seq)
                elif entry.seq < notice.seq:
                    self.remote_closes += 1
                    self._close(entry, CloseCode.SUPERSEDED)

    def apply_control(self, control: SocketControl) -> None:
        """A ``hubd_sockets`` notification: the allocation moved to a newer generation, or
        became terminal, on some replica."""
        before = len(self._marked_entries(control.allocation_id))
        if control.retire:
            self.retire(control.allocation_id, control.generation)
        else:
            self.fence(control.allocation_id, control.generation)
        self.remote_closes += before - len(self._marked_entries(control.allocation_id))

    async def verify(self) -> tuple[int, int]:
        """Compare every recorded socket held here with the database: close what no longer
        belongs (retired, fenced, superseded) and write again the records a sweep removed
        while the socket stayed open. Returns (records written again, sockets closed)."""
        held = [
            entry
            for peers in list(self._sockets.values())
            for entry in peers.values()
            if entry.closed_by_hub is None and entry.recorded
        ]
        if not held:
            return 0, 0
        checks = await self._connections.check_sockets(
            [(e.target.allocation_id, e.connection_id) for e in held]
        )
        by_id = {entry.connection_id: entry for entry in held}
        reasserted = closed = 0
        for check in checks:
            entry = by_id.get(check.connection_id)
            if entry is None or entry.closed_by_hub is not None:
                continue
            if check.status is None or check.status.terminal:
                self._close(entry, CloseCode.RETIRED)
                closed += 1
            elif check.generation is not None and check.generation > entry.target.generation:
                self._close(entry, CloseCode.FENCED)
                closed += 1
            elif check.recorded_connection_id == entry.connection_id:
                continue
            elif check.recorded_connection_id is not None:
                if (check.recorded_seq or 0) > (entry.seq or 0):
                    self._close(entry, CloseCode.SUPERSEDED)
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

    async def wait_ready(self, target: Target, within: float) -> None:
        deadline = asyncio.get_running_loop().time() + within
        with self._arrivals.expect(target) as waiter:
            try:
                async with asyncio.timeout_at(deadline):
                    ready = await self.is_ready(target)
            except TimeoutError:
                # The database did not answer in time: that is "unknown", not "not connected".
                raise DatabaseUnavailable("readiness check did not finish in time") from None
            if ready:
                return
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except TimeoutError:
                raise not_connected(target, within) from None

    def notify_connected(self, target: Target) -> None:
        """A ``hubd_connected`` notification arrived (from any replica, this one included)."""
        self._arrivals.arrived(target)

    # -- the server side ------------------------------------------------------------------------

    def expect(self, ws: SidecarSocket, request: HandshakeRequest, **context: Any) -> SocketEntry:
        """An entry for a handshake whose admission (authenticate and record, one statement,
        before the upgrade) is about to be asked for.

        Until :meth:`admitted` it takes nothing over, but a fence or a retirement that arrives
        meanwhile marks it, so a record written just before such a transition still ends in the
        right close once the socket is open."""
        target = Target(request.allocation_id, request.generation)
        connection_id = new_connection_id()
        entry = SocketEntry(
            connection_id=connection_id,
            target=target,
            sidecar_id=request.sidecar_id,
            ws=ws,
            log=log.bind(
                allocation_id=target.allocation_id,
                generation=target.generation,
                sidecar_id=request.sidecar_id,
                connection_id=connection_id,
                **context,
            ),
        )
        self._pending.setdefault(target.allocation_id, {})[connection_id] = entry
        if self._closing:
            self._close(entry, CloseCode.GOING_AWAY)
        return entry

    def admitted(self, entry: SocketEntry, record: Record, *, secret_hash: bytes | None) -> None:
        """The handshake's admission came back authenticated: take its record's outcome.

        Synchronous on purpose: the takeover decision and the registration happen with no yield
        in between. Of two sockets of a generation held here, the one with the higher record
        number stays: that is the database's order, whichever handshake finished first."""
        self._forget_pending(entry)
        outcome = record.outcome
        if outcome is not RecordOutcome.RECORDED:
            entry.log.info("connection_refused_by_record", outcome=str(outcome))
            self._close(entry, REFUSED_RECORD_CLOSES[outcome])
            return
        entry.recorded = True
        entry.seq = seq = record.seq
        entry.secret_hash = secret_hash
        # One line per connect, written once the record says how it went: a storm of
        # reconnects logs a line per socket, not one per step.
        entry.log.info("sidecar_connected", seq=seq, ready=record.ready)
        target = entry.target
        if (entry.seen_seq or 0) > (seq or 0):
            # Another replica recorded the sidecar after this admission's statement, and said
            # so before this process acted on the answer (it was slow, or paused).
            self.remote_closes += 1
            self._close(entry, CloseCode.SUPERSEDED)
        peers = self._sockets.setdefault(target.allocation_id, {})
        for other in [other for other in peers.values() if other.closed_by_hub is None]:
            if entry.closed_by_hub is not None:
                break
            if other.target.generation > target.generation:
                # Another socket already moved past this generation: this one is the stale one.
                self._close(entry, CloseCode.FENCED)
            elif other.target.generation < target.generation:
                self._close(other, CloseCode.FENCED)
            elif (other.seq or 0) > (seq or 0):
                self._close(entry, CloseCode.SUPERSEDED)
            else:
                self._close(other, CloseCode.SUPERSEDED)
        peers[entry.connection_id] = entry
        self.notify_connected(target)
        if self._closing:
            self._close(entry, CloseCode.GOING_AWAY)

    def abandon(self, entry: SocketEntry, *, written: bool | None) -> None:
        """The handshake ended without an open socket after its admission was asked for.
        ``written``: whether its record was written (``None``: unknown, the statement failed or
        was given up on, and may have committed). A record that may exist is cleared like a
        closed socket's (only while it is still this connection's) and the disconnect reported."""
        self._forget_pending(entry)
        entry.abandoned = True
        if written is False:
            entry.gone = True
            return
        entry.recorded = True
        self._tasks.spawn(self.unregister(entry), name=f"abandon-{entry.connection_id}")

    def upgraded(self, entry: SocketEntry) -> None:
        """The socket is open: a close the hub decided before the upgrade is sent now."""
        entry.upgraded = True
        code = entry.closed_by_hub
        if code is not None:
            self._tasks.spawn(
                entry.ws.close(int(code), code.reason), name=f"close-{entry.connection_id}"
            )

    async def open(self, entry: SocketEntry, *, welcome: str) -> bool:
        """Send the welcome of an admitted, open socket, then tell the reconciler.

        ``False`` when the socket did not make it (closed by the hub, or gone); it is then
        already being closed."""
        async with self._serial.hold(entry.target.allocation_id):
            if entry.closed_by_hub is not None:
                return False
            # No timer of its own: a socket's writes are bounded where they are made (see
            # SidecarSocket), and a timeout block per handshake cost a storm measurably.
            try:
                await entry.ws.send(welcome)
            except Exception as exc:  # noqa: BLE001 -- a peer that vanished is not an error
                entry.log.info("welcome_not_sent", error=describe_error(exc))
                return False
            await self._deliver(entry, "handle_connected")
            return True

    def acknowledge(self, entry: SocketEntry) -> None:
        """The sidecar says it holds its welcome's secret: from now on only that secret opens
        its generation's next connection. Acted on once per socket."""
        secret_hash, entry.secret_hash = entry.secret_hash, None
        if secret_hash is None or entry.closed_by_hub is not None:
            return
        self._tasks.spawn(
            acknowledge_secret(self._acknowledgements, entry, secret_hash),
            name=f"acknowledge-{entry.connection_id}",
        )

    async def unregister(self, entry: SocketEntry) -> None:
        """The socket's handler is done (or its handshake was abandoned after its admission):
        forget it, clear its record, report the disconnect."""
        entry.gone = True
        peers = self._sockets.get(entry.target.allocation_id)
        if peers is not None:
            peers.pop(entry.connection_id, None)
            if not peers:
                del self._sockets[entry.target.allocation_id]
        code = entry.closed_by_hub
        hub = {"closed_by_hub": int(code), "reason": code.reason} if code else {}
        if entry.abandoned:
            entry.log.info("sidecar_handshake_abandoned", **hub)
        else:
            entry.log.info("sidecar_disconnected", **hub)
        if self._closing or code in _NOTHING_TO_CLEAR or not entry.recorded:
            return
        async with self._serial.hold(entry.target.allocation_id):
            cleared = await self._clear(entry, log=entry.log)
            # ``None`` (the clear kept failing): the socket is gone all the same, so report it.
            if cleared is not False:
                await self._deliver(entry, "handle_disconnect")

    def close_socket(self, entry: SocketEntry, code: CloseCode, reason: str | None = None) -> None:
        """Close one socket on the hub's initiative (policy, protocol error, internal error),
        with ``reason`` (default: the code's) in its close frame."""
        self._close(entry, code, reason)

    async def publish(self, entry: SocketEntry, publish: Publish) -> PublishOutcome | None:
        """Store what ``entry``'s sidecar publishes, fenced on its record. A publish the fence
        refuses closes the socket as the database says it no longer belongs; one whose outcome
        is unknown (the database failed) closes it with 1011, so the sidecar reconnects and
        publishes again. ``None``: unknown."""
        try:
            async with asyncio.timeout(self._event_timeout):
                outcome = await self._connections.publish(
                    entry.connection_id,
                    entry.target,
                    endpoint=publish.endpoint,
                    metadata=publish.metadata,
                )
        except (StoreError, TimeoutError) as exc:
            entry.log.warning("sidecar_publish_failed", error=describe_error(exc))
            self._close(entry, CloseCode.INTERNAL_ERROR)
            return None
        if outcome is PublishOutcome.REFUSED:
            await self._follow_record(entry)
        return outcome

    async def declare_ready(self, entry: SocketEntry) -> bool:
        """``entry``'s sidecar says it is ready: recorded, fenced on its record, as
        :meth:`publish` is (and closed the same way when refused or unknown). Whether it
        was accepted."""
        try:
            async with asyncio.timeout(self._event_timeout):
                declared = await self._connections.declare_ready(entry.connection_id, entry.target)
        except (StoreError, TimeoutError) as exc:
            entry.log.warning("sidecar_ready_failed", error=describe_error(exc))
            self._close(entry, CloseCode.INTERNAL_ERROR)
            return False
        if not declared.accepted:
            await self._follow_record(entry)
            return False
        if declared.seq is not None:
            # The declaration bumped the record's number: the one this socket now holds.
            entry.seq = declared.seq
            entry.log.info("sidecar_declared_ready", seq=declared.seq, ready=declared.ready)
            self.notify_connected(entry.target)
        return True

    async def _follow_record(self, entry: SocketEntry) -> None:
        """A write fenced on ``entry``'s record matched nothing: close the socket as the
        database says it no longer belongs (retired, fenced, superseded) rather than wait for
        the notification or the repair sweep; with no record of it left (cleared by a sweep),
        1011, so the sidecar reconnects and records itself again."""
        try:
            async with asyncio.timeout(self._event_timeout):
                checks = await self._connections.check_sockets(
                    [(entry.target.allocation_id, entry.connection_id)]
                )
        except (StoreError, TimeoutError) as exc:
            entry.log.warning("sidecar_record_unknown", error=describe_error(exc))
            self._close(entry, CloseCode.INTERNAL_ERROR)
            return
        for check in checks:
            if check.status is None or check.status.terminal:
                self._close(entry, CloseCode.RETIRED)
            elif check.generation is not None and check.generation > entry.target.generation:
                self._close(entry, CloseCode.FENCED)
            elif check.recorded_connection_id not in (None, entry.connection_id):
                self._close(entry, CloseCode.SUPERSEDED)
            elif check.recorded_connection_id is None:
                self._close(entry, CloseCode.INTERNAL_ERROR)

    async def close_all(self, code: CloseCode = CloseCode.GOING_AWAY) -> None:
        """Shutdown: close every socket with ``code`` and wait for the close tasks to finish.

        From here on, no close counts as a disconnect and new sockets are closed at once.
        """
        self._closing = True
        for peers in [*self._sockets.values(), *self._pending.values()]:
            for entry in list(peers.values()):
                self._close(entry, code)
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._acknowledgements.close()
        await self._clears.close()

    # -- introspection --------------------------------------------------------------------------

    def sockets(self, allocation_id: str) -> list[SocketEntry]:
        """The sockets of an allocation that the hub has not started closing."""
        return self._open_entries(allocation_id)

    def pending(self, allocation_id: str) -> list[SocketEntry]:
        """The handshakes of an allocation whose admission is under way."""
        return list(self._pending.get(allocation_id, {}).values())

    @property
    def connection_count(self) -> int:
        return sum(len(peers) for peers in self._sockets.values())

    @property
    def waiter_count(self) -> int:
        return len(self._arrivals)

    @property
    def batchers(self) -> tuple[Batcher[Any, Any], ...]:
        return (self._acknowledgements, self._clears)

    @property
    def busy_allocations(self) -> int:
        """Allocations with a connect or disconnect step running or queued."""
        return len(self._serial)

    # -- plumbing -------------------------------------------------------------------------------

    def _open_entries(self, allocation_id: str) -> list[SocketEntry]:
        peers = self._sockets.get(allocation_id, {})
        return [entry for entry in peers.values() if entry.closed_by_hub is None]

    def _marked_entries(self, allocation_id: str) -> list[SocketEntry]:
        """The open entries and those whose admission is under way: what a fence or a
        retirement closes."""
        pending = self._pending.get(allocation_id, {})
        waiting = [entry for entry in pending.values() if entry.closed_by_hub is None]
        return [*self._open_entries(allocation_id), *waiting]

    def _forget_pending(self, entry: SocketEntry) -> None:
        pending = self._pending.get(entry.target.allocation_id)
        if pending is not None:
            pending.pop(entry.connection_id, None)
            if not pending:
                del self._pending[entry.target.allocation_id]

    def _close(self, entry: SocketEntry, code: CloseCode, reason: str | None = None) -> None:
        if entry.closed_by_hub is not None:
            return
        # Marked before the close frame goes out, so the socket's own handler, whenever it
        # sees the close, knows it was the hub's doing and why (its ``sidecar_disconnected``
        # line says so at info; this one is at debug).
        entry.closed_by_hub = code
        entry.log.debug("closing_sidecar", code=int(code), reason=code.reason)
        if not entry.upgraded:
            # Not open yet: the close goes out once it is (see upgraded), or never.
            return
        self._tasks.spawn(
            entry.ws.close(int(code), reason or code.reason), name=f"close-{entry.connection_id}"
        )

    async def _deliver(self, entry: SocketEntry, event: str) -> None:
        if self._events is None:
            return
        handler: Callable[[Target], Awaitable[None]] = getattr(self._events, event)
        try:
            async with asyncio.timeout(self._event_timeout):
                await handler(entry.target)
        except Exception as exc:
            # Logged, not raised: the socket stays, and the reconciler's poll repairs a lost event.
            entry.log.exception("connection_event_failed", event=event, error=describe_error(exc))
