"""Hand-over (architecture §4): a taken pool member's sidecar learns the session it now serves.

A request that takes a member writes the tenant and session on its row and marks it
``handover_pending`` in its own statement (``hubd_take_member``); the take that rings its slot's
bell notifies ``hubd_handover`` for every take of the slot (architecture §8, *A take's
events*). Each replica that hears it sweeps: it announces the takes whose sockets it holds
(their events are written then) and sends each socket a ``session`` message, and looks again
while any take is in flight or the slot rung is current. The sidecar answers ``session_ack``,
written fenced on its connection, which clears the mark. The message goes again after every
welcome while the mark stands (the admission read it), and the periodic socket check announces
what is left and sends every held socket still owed one, so a notification lost with a LISTEN
connection delays a hand-over by one check at most, never loses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

from hubd.aio import TrackedTasks
from hubd.errors import BatchFull, StoreError
from hubd.redaction import describe_error
from hubd.routing import Target
from hubd.server.batching import Batcher
from hubd.server.handshake import CloseCode
from hubd.server.sockets import SocketEntry
from hubd.store.connection_values import Handover
from hubd.store.connections import ConnectionStore

__all__ = ["FIRST_LOOK", "LAST_LOOK", "QUIET_ANNOUNCEMENTS", "Handovers", "session_message"]

FIRST_LOOK = 0.002
"""Seconds before a sweep looks again for takes that were in flight: a take's statement and
commit take about a millisecond."""
LAST_LOOK = 0.05
"""The longest pause between looks while takes stay in flight with nothing to announce (one
an application keeps uncommitted): each look is two short statements."""

QUIET_ANNOUNCEMENTS = 2
"""Announcements in a row that find no take before a sweep looks for takes in flight."""


def session_message(handover: Handover) -> str:
    """The ``session`` message of a hand-over."""
    return json.dumps(
        {
            "type": "session",
            "allocation_id": handover.target.allocation_id,
            "generation": handover.target.generation,
            "tenant": handover.tenant,
            "session": handover.session,
        }
    )


class Handovers:
    """Sends hand-overs to the sockets held here, and writes their acknowledgements.

    A burst of takes is a few notices, each a sweep that announces what committed since the
    last one (one at a time: a notice during a sweep makes it look again), and then a burst of
    acknowledgements, whose writes that arrive while one statement runs go in the next
    (:class:`~hubd.server.batching.Batcher`), as the activity reports do."""

    def __init__(
        self,
        connections: ConnectionStore,
        *,
        tasks: TrackedTasks,
        sockets: Callable[[str], list[SocketEntry]],
        close: Callable[[SocketEntry, CloseCode], None],
        follow: Callable[[SocketEntry], Awaitable[None]],
        timeout: float,
    ) -> None:
        self._connections = connections
        self._tasks = tasks
        self._sockets = sockets
        self._close = close
        self._follow = follow
        self._heard = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None
        self._writes: Batcher[tuple[str, Target], bool] = Batcher(
            connections.acknowledge_handovers,
            name="handover-acknowledgements",
            timeout=timeout,
            max_waiting=16384,
        )
        self.sent = 0
        """``session`` messages sent."""
        self.acknowledged = 0
        """Hand-overs the sidecars acknowledged here."""

    @property
    def batchers(self) -> tuple[Batcher[Any, Any], ...]:
        return (self._writes,)

    def owed(self, entry: SocketEntry, handover: Handover) -> None:
        """``entry``'s welcome was acknowledged and its admission found a hand-over owed."""
        self._tasks.spawn(self._send([entry], handover), name=f"handover-{entry.connection_id}")

    def heard(self) -> None:
        """A ``hubd_handover`` notice: takes committed, and others may be in flight."""
        self._heard.set()
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = self._tasks.spawn(self._sweep(), name="handover-sweep")

    async def resend(self, *, stale_after: float) -> int:
        """The socket check's turn: announce the takes of sockets held here and every take
        older than ``stale_after`` seconds (one whose replica died before it could), then send
        every hand-over still owed to a socket held here; how many were sent. A failing
        database sends nothing this time."""
        try:
            await self._connections.announce_takes(stale_after=stale_after)
            owed = await self._connections.owed_handovers()
        except StoreError:
            return 0
        sent = 0
        for handover in owed:
            sent += await self._send(self._sockets(handover.target.allocation_id), handover)
        return sent

    async def acknowledge(self, entry: SocketEntry) -> bool:
        """``entry``'s sidecar says it holds its session: written fenced on its record, as a
        publish is (architecture §4). Whether to answer it: a write the fence refuses closes
        the socket as the database says it no longer belongs, and one whose outcome is unknown
        closes it with 1011 (the sidecar reconnects, is told again, and acknowledges again)."""
        try:
            done = await self._writes.request((entry.connection_id, entry.target))
        except (StoreError, TimeoutError, BatchFull) as exc:
            entry.log.warning("handover_acknowledgement_failed", error=describe_error(exc))
            self._close(entry, CloseCode.INTERNAL_ERROR)
            return False
        if done is None:
            await self._follow(entry)
            return False
        if done:
            self.acknowledged += 1
            entry.log.info("handover_acknowledged")
        return True

    async def close(self) -> None:
        await self._writes.close()

    async def _sweep(self) -> None:
        """Announce the takes of sockets held here and send their hand-overs, again while
        announcements find takes; then look: a take that rang no bell may commit after the
        notice that woke this, while it is in flight or its slot's ring is current
        (architecture §8). While the look says so, or a notice came meanwhile, announce and
        look again; once it says neither, announce once more, for the takes that committed
        between the last announcement and the look. A failing database ends it: the socket
        check announces and sends the rest."""
        pause = FIRST_LOOK
        quiet = 0
        while True:
            self._heard.clear()
            try:
                if await self._announce():
                    pause = FIRST_LOOK
                    quiet = 0
                else:
                    quiet += 1
                # No look while takes are still committing: its row lock makes every take that
                # meets it notify, in turn (architecture §8). A burst's announcements find none
                # now and then, so the first look waits for a second announcement that finds
                # none.
                if quiet >= QUIET_ANNOUNCEMENTS:
                    in_flight = await self._connections.takes_in_flight()
                    if not in_flight and not self._heard.is_set():
                        await self._announce()
                        return
            except (StoreError, TimeoutError):
                return
            if not self._heard.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(pause):
                        await self._heard.wait()
                pause = min(pause * 2, LAST_LOOK)

    async def _announce(self) -> int:
        """Announce the takes of sockets held here, and send their hand-overs in a task of
        their own: the next announcement need not wait for a burst's sends; how many."""
        announced = await self._connections.announce_takes()
        owed = [each.handover for each in announced if each.owed]
        if owed:
            self._tasks.spawn(self._send_each(owed), name="handover-send")
        return len(announced)

    async def _send_each(self, handovers: list[Handover]) -> None:
        for handover in handovers:
            await self._send(self._sockets(handover.target.allocation_id), handover)

    async def _send(self, entries: list[SocketEntry], handover: Handover) -> int:
        message = session_message(handover)
        sent = 0
        for entry in entries:
            # Only to a socket of the generation taken, once its welcome was acknowledged:
            # before that, its own welcome comes first, and its acknowledgement sends this.
            if entry.target != handover.target or not entry.acknowledged:
                continue
            if entry.closed_by_hub is not None:
                continue
            try:
                await entry.ws.send(message)
            except Exception as exc:  # noqa: BLE001 -- a peer that vanished is not an error
                entry.log.info("handover_not_sent", error=describe_error(exc))
                continue
            entry.log.info("handover_sent")
            sent += 1
        self.sent += sent
        return sent
