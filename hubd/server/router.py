"""SocketRouter: the life of a sidecar socket on this instance, from its admission to its
disconnect, and the :class:`~hubd.routing.Router` the reconciler talks to.

It holds, per allocation, the sockets open on this instance and the handshakes whose admission is
under way (in a :class:`~hubd.server.registry.SocketRegistry`). A socket's durable connection
record (one per allocation, so that
readiness is answered from the database and any replica gives the same answer) is written by its
admission, the listener's one statement that authenticates the handshake and records it before
the upgrade (``admit_many`` of :class:`~hubd.store.connections.ConnectionStore`); the router takes
the outcome (:meth:`SocketRouter.admitted`), and clears the record of a socket that closes, or of
a handshake abandoned after its admission (:meth:`SocketRouter.abandon`).

The welcome and the disconnect steps of one allocation run one at a time, in the order the
sockets opened and closed (a FIFO lock per allocation, forgotten when idle), so a
:class:`~hubd.routing.ConnectionEvents` sink, when the router is given one, hears of an
allocation's connects and disconnects in that order. A clear is fenced on the
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

What other replicas write reaches the sockets held here through the router's
:class:`~hubd.server.repair.SocketRepair`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import structlog

from hubd.aio import KeyedFifo, TrackedTasks
from hubd.errors import DatabaseUnavailable, StoreError
from hubd.redaction import describe_error
from hubd.routing import Arrivals, ConnectionEvents, Target, not_connected
from hubd.server.activity import ActivityRecorder
from hubd.server.batching import Batcher
from hubd.server.handover import Handovers
from hubd.server.handshake import CloseCode, HandshakeRequest
from hubd.server.messages import Publish
from hubd.server.registry import SocketRegistry
from hubd.server.repair import SocketRepair
from hubd.server.sockets import (
    REFUSED_RECORD_CLOSES,
    SidecarSocket,
    SocketEntry,
    acknowledge_secret,
    clear_record,
    new_connection_id,
)
from hubd.store.channels import NoticeKey
from hubd.store.connection_values import Disconnect, PublishOutcome, Record, RecordOutcome
from hubd.store.connections import ConnectionStore
from hubd.store.secrets import Acknowledgement

__all__ = ["SocketRouter"]


def _task_failed(name: str, exc: BaseException) -> None:
    log.error("router_task_failed", task=name, error=describe_error(exc))


log = structlog.get_logger(__name__)

# Closes with no record to clear: a successor's record replaced it, the fencing or retiring
# transition deleted it (hubd_socket_control), or shutdown settles the instance's at once.
_NOTHING_TO_CLEAR = frozenset(
    {CloseCode.GOING_AWAY, CloseCode.SUPERSEDED, CloseCode.FENCED, CloseCode.RETIRED}
)


class SocketRouter:
    """Live sockets of this instance, their durable records, and readiness waits.

    ``notice_key`` is the database's key for the allocation tags its notifications carry and
    the macs that authenticate them (:func:`hubd.store.channels.read_notice_key`): the
    sockets, handshakes and waiters held here are found by their tags."""

    def __init__(
        self,
        connections: ConnectionStore,
        *,
        notice_key: NoticeKey,
        events: ConnectionEvents | None = None,
        instance_ttl: float = 20.0,
        connect_timeout: float = 120.0,
        event_timeout: float = 30.0,
        clear_budget: float = 30.0,
    ) -> None:
        self._connections = connections
        self.notice_key = notice_key
        """What the notifications handed to :attr:`repair` are read with."""
        self._events = events
        self._instance_ttl = instance_ttl
        self._connect_timeout = connect_timeout
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
        # The router's fire-and-forget work (closes, acknowledgements): nobody awaits it, so a
        # failure is logged, as an error.
        self._tasks = TrackedTasks(on_failure=_task_failed)
        self._registry = SocketRegistry(self._tasks, tag_of=notice_key.tag)
        self._arrivals = Arrivals(tag_of=notice_key.tag)
        self._serial = KeyedFifo()
        # A reconnect storm acknowledges a welcome per socket: those that arrive while one
        # statement runs go in the next. The cap bounds memory only (see acknowledge_secret).
        self._acknowledgements: Batcher[Acknowledgement, bool] = Batcher(
            connections.acknowledge_secrets,
            name="secret-acknowledgements",
            timeout=event_timeout,
            max_waiting=16384,
        )
        self.activity = ActivityRecorder(connections, timeout=event_timeout)
        """Where the sidecars' activity reports go."""
        self._closing = False
        self.repair = SocketRepair(
            self._registry,
            connections,
            serial=self._serial,
            arrivals=self._arrivals,
            event_timeout=event_timeout,
        )
        """Where notifications of other replicas' writes, and the periodic check, go."""
        self.handover = Handovers(
            connections,
            tasks=self._tasks,
            sockets=self._registry.sockets,
            close=self._registry.close,
            follow=self.repair.follow_record,
            timeout=event_timeout,
        )
        """What tells taken pool members' sidecars their session (architecture §4)."""

    # -- the Router seam ------------------------------------------------------------------------

    def fence(self, allocation_id: str, generation: int) -> None:
        self._registry.fence(allocation_id, generation)

    def retire(self, allocation_id: str, generation: int) -> None:
        # Every socket goes, whatever its generation: no sidecar of a finished allocation stays.
        del generation
        self._registry.retire(allocation_id)

    async def is_ready(self, target: Target) -> bool:
        return await self._connections.is_connected(target, self._instance_ttl)

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
        self._registry.expect(entry)
        if self._closing:
            self._registry.close(entry, CloseCode.GOING_AWAY)
        return entry

    def admitted(self, entry: SocketEntry, record: Record, *, secret_hash: bytes | None) -> None:
        """The handshake's admission came back authenticated: take its record's outcome.

        Synchronous on purpose: the takeover decision and the registration happen with no yield
        in between. Of two sockets of a generation held here, the one with the higher record
        number stays: that is the database's order, whichever handshake finished first."""
        self._registry.forget_pending(entry)
        close = self._registry.close
        outcome = record.outcome
        if outcome is not RecordOutcome.RECORDED:
            entry.log.info("connection_refused_by_record", outcome=str(outcome))
            close(entry, REFUSED_RECORD_CLOSES[outcome])
            return
        entry.recorded = True
        entry.seq = seq = record.seq
        entry.secret_hash = secret_hash
        # One line per connect, written once the record says how it went: a storm of
        # reconnects logs a line per socket, not one per step.
        entry.log.info("sidecar_connected", seq=seq, ready=record.ready)
        target = entry.target
        self.repair.admitted(entry)
        for other in self._registry.sockets(target.allocation_id):
            if entry.closed_by_hub is not None:
                break
            if other.target.generation > target.generation:
                # Another socket already moved past this generation: this one is the stale one.
                close(entry, CloseCode.FENCED)
            elif other.target.generation < target.generation:
                close(other, CloseCode.FENCED)
            elif (other.seq or 0) > (seq or 0):
                close(entry, CloseCode.SUPERSEDED)
            else:
                close(other, CloseCode.SUPERSEDED)
        self._registry.add(entry)
        self.notify_connected(target)
        if self._closing:
            close(entry, CloseCode.GOING_AWAY)

    def abandon(self, entry: SocketEntry, *, written: bool | None) -> None:
        """The handshake ended without an open socket after its admission was asked for.
        ``written``: whether its record was written (``None``: unknown, the statement failed or
        was given up on, and may have committed). A record that may exist is cleared like a
        closed socket's (only while it is still this connection's) and the disconnect reported."""
        self._registry.forget_pending(entry)
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
        """Send the welcome of an admitted, open socket, then tell the events sink, if any.

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
            self._deliver(entry, "handle_connected")
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
        self._registry.remove(entry)
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
                self._deliver(entry, "handle_disconnect")

    def close_socket(self, entry: SocketEntry, code: CloseCode, reason: str | None = None) -> None:
        """Close one socket on the hub's initiative (policy, protocol error, internal error),
        with ``reason`` (default: the code's) in its close frame."""
        self._registry.close(entry, code, reason)

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
            self._registry.close(entry, CloseCode.INTERNAL_ERROR)
            return None
        if outcome is PublishOutcome.REFUSED:
            await self.repair.follow_record(entry)
        return outcome

    async def declare_ready(self, entry: SocketEntry, *, serving: bool = True) -> bool:
        """``entry``'s sidecar says it is ready (``serving``), or no longer is: recorded,
        fenced on its record, as :meth:`publish` is (and closed the same way when refused or
        unknown). Whether it was accepted."""
        connections, target = self._connections, entry.target
        try:
            async with asyncio.timeout(self._event_timeout):
                if serving:
                    declared = await connections.declare_ready(entry.connection_id, target)
                else:
                    declared = await connections.declare_not_ready(
                        entry.connection_id, target, connect_timeout=self._connect_timeout
                    )
        except (StoreError, TimeoutError) as exc:
            entry.log.warning("sidecar_ready_failed", error=describe_error(exc))
            self._registry.close(entry, CloseCode.INTERNAL_ERROR)
            return False
        if not declared.accepted:
            await self.repair.follow_record(entry)
            return False
        if declared.seq is not None and not serving:
            # The record's new number is the one this socket now holds; no waiter waits for
            # readiness to go, so nobody is woken.
            entry.seq = declared.seq
            entry.log.info(
                "sidecar_declared_not_ready", seq=declared.seq, was_ready=declared.withdrawn
            )
        elif declared.seq is not None:
            # The declaration bumped the record's number: the one this socket now holds.
            entry.seq = declared.seq
            entry.log.info("sidecar_declared_ready", seq=declared.seq, ready=declared.ready)
            self.notify_connected(entry.target)
        return True

    async def close_all(self, code: CloseCode = CloseCode.GOING_AWAY) -> None:
        """Shutdown: close every socket with ``code`` and wait for the close tasks to finish.

        From here on, no close counts as a disconnect and new sockets are closed at once.
        """
        self._closing = True
        self._registry.close_every(code)
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._acknowledgements.close()
        await self._clears.close()
        await self.activity.close()
        await self.handover.close()

    # -- introspection --------------------------------------------------------------------------

    def sockets(self, allocation_id: str) -> list[SocketEntry]:
        """The sockets of an allocation that the hub has not started closing."""
        return self._registry.sockets(allocation_id)

    def pending(self, allocation_id: str) -> list[SocketEntry]:
        """The handshakes of an allocation whose admission is under way."""
        return self._registry.pending(allocation_id)

    @property
    def connection_count(self) -> int:
        return self._registry.connection_count

    @property
    def waiter_count(self) -> int:
        return len(self._arrivals)

    @property
    def batchers(self) -> tuple[Batcher[Any, Any], ...]:
        return (
            self._acknowledgements,
            self._clears,
            self.activity.batcher,
            *self.handover.batchers,
        )

    @property
    def busy_allocations(self) -> int:
        """Allocations with a connect or disconnect step running or queued."""
        return len(self._serial)

    # -- plumbing -------------------------------------------------------------------------------

    def _deliver(self, entry: SocketEntry, event: str) -> None:
        if self._events is None:
            return
        handler: Callable[[Target], None] = getattr(self._events, event)
        try:
            handler(entry.target)
        except Exception as exc:
            # Logged, not raised: a failing sink must not cost the socket its welcome or its clear.
            entry.log.exception("connection_event_failed", event=event, error=describe_error(exc))
