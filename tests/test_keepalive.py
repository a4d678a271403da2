"""The listener's keepalive: one timer pings every open socket; a sidecar that stops answering is
failed with 1011 and counted lost, one that answers stays. Real clients over loopback, real
PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

from hubd.server.connection import SidecarConnection
from hubd.server.keepalive import TIMEOUT_REASON, Keepalive
from hubd.store import AllocationStore, Database
from tests.polling import eventually, scaled
from tests.wskit import Hub, Sidecar, dial, record_row, running_hub, sidecar_in, welcome_of


def keepalive_of(hub: Hub) -> Keepalive:
    keepalive = hub.server.keepalive
    assert keepalive is not None
    return keepalive


def hub_side(hub: Hub, sidecar: Sidecar) -> SidecarConnection:
    (entry,) = hub.router.sockets(sidecar.allocation_id)
    assert isinstance(entry.ws, SidecarConnection)
    return entry.ws


@asynccontextmanager
async def welcomed(
    hub: Hub, sidecar: Sidecar
) -> AsyncIterator[tuple[ClientConnection, SidecarConnection]]:
    """``sidecar``'s socket past its welcome, with the client's own pings off (only the hub's
    keep it busy), and the hub's side of it."""
    async with dial(hub.url, sidecar.headers(), ping_interval=None) as ws:
        await welcome_of(ws)
        yield ws, hub_side(hub, sidecar)


async def counted_lost_once(db: Database, hub: Hub, sidecar: Sidecar) -> None:
    """The hub reported ``sidecar`` lost, once, and keeps neither its socket nor its record."""
    await eventually(lambda: hub.events.disconnected == [sidecar.target], what="the loss")
    assert await record_row(db, sidecar.allocation_id) is None
    assert hub.router.sockets(sidecar.allocation_id) == []


async def closing_of(ws: Any) -> ConnectionClosed:
    """Read ``ws`` until the hub's close arrives; the exception that says how it closed."""
    try:
        async with asyncio.timeout(scaled(10)):
            while True:
                await ws.recv()
    except ConnectionClosed as exc:
        return exc


@pytest.fixture
async def pinging_hub(db: Database, request: pytest.FixtureRequest) -> AsyncIterator[Hub]:
    options: dict[str, Any] = getattr(request, "param", {})
    async with running_hub(db, **options) as hub:
        yield hub


FAST = {"ping_interval": scaled(0.05), "ping_timeout": scaled(2.0)}
UNANSWERED = {"ping_interval": scaled(0.05), "ping_timeout": scaled(0.2)}


@pytest.mark.parametrize("pinging_hub", [FAST], indirect=True)
async def test_a_sidecar_that_answers_is_pinged_and_stays(
    db: Database, pinging_hub: Hub, sidecar: Sidecar
) -> None:
    hub = pinging_hub
    keepalive = keepalive_of(hub)
    async with welcomed(hub, sidecar) as (ws, connection):
        await eventually(lambda: keepalive.pings_sent >= 5, what="five keepalive pings")
        # websockets matched the pongs to the pings: the latency is measured, no ping waits.
        assert connection.latency > 0
        await eventually(lambda: not connection.pending_pings, what="every pong back")
        assert keepalive.timeouts == 0
        assert ws.state is State.OPEN
        assert hub.events.disconnected == []
        assert await record_row(db, sidecar.allocation_id) is not None


@pytest.mark.parametrize("pinging_hub", [{**UNANSWERED, "close_timeout": 30.0}], indirect=True)
async def test_a_sidecar_that_stops_answering_is_failed_with_1011_and_lost(
    db: Database, pinging_hub: Hub, sidecar: Sidecar
) -> None:
    hub = pinging_hub
    keepalive = keepalive_of(hub)
    async with welcomed(hub, sidecar) as (ws, connection):
        # A frozen sidecar: its end of the socket reads nothing, so no ping is answered.
        ws.transport.pause_reading()
        await eventually(lambda: keepalive.timeouts == 1, what="the keepalive timeout")
        assert connection.protocol.state is State.CLOSING
        # Thawed, it reads the hub's close frame and closes its end; the hub then counts the
        # sidecar lost, exactly once, and its record is gone.
        ws.transport.resume_reading()
        closed = await closing_of(ws)
        assert closed.rcvd is not None
        assert (closed.rcvd.code, closed.rcvd.reason) == (1011, TIMEOUT_REASON)
    await counted_lost_once(db, hub, sidecar)
    assert keepalive.timeouts == 1


@pytest.mark.parametrize(
    "pinging_hub", [{**UNANSWERED, "close_timeout": scaled(0.3)}], indirect=True
)
async def test_a_sidecar_that_never_answers_again_is_aborted_after_the_close_timeout(
    db: Database, pinging_hub: Hub, sidecar: Sidecar
) -> None:
    hub = pinging_hub
    keepalive = keepalive_of(hub)
    async with welcomed(hub, sidecar) as (ws, _connection):
        ws.transport.pause_reading()
        # It never reads the close frame either: the hub gives up on it after close_timeout
        # instead of holding the socket (and the allocation's readiness) for ever.
        await counted_lost_once(db, hub, sidecar)
        assert keepalive.timeouts == 1


async def test_idle_sockets_hold_one_task_each_and_one_keepalive_entry(
    db: Database, store: AllocationStore
) -> None:
    """websockets' keepalive is a task per socket; hubd's is one timer for all of them."""
    count = 6
    sidecars = [(await sidecar_in(store, db))[0] for _ in range(count)]
    async with running_hub(db) as hub:
        keepalive = keepalive_of(hub)
        tasks_before = len(asyncio.all_tasks())
        clients = [
            await dial(hub.url, sidecar.headers(), ping_interval=None) for sidecar in sidecars
        ]
        try:
            for ws in clients:
                await welcome_of(ws)
            # The records' and acknowledgements' statements have run and their tasks ended: what
            # is left is what an idle socket holds.
            await eventually(
                lambda: all(hub.router.sockets(s.allocation_id)[0].recorded for s in sidecars),
                what="every socket recorded",
            )
            await eventually(
                lambda: len(asyncio.all_tasks()) - tasks_before <= count,
                what="no more than one task per idle socket",
            )
            assert len(keepalive) == count
        finally:
            for ws in clients:
                await ws.close()


@pytest.mark.parametrize("pinging_hub", [FAST], indirect=True)
async def test_a_socket_whose_ping_fails_is_aborted_and_the_others_keep_theirs(
    db: Database, store: AllocationStore, pinging_hub: Hub
) -> None:
    hub = pinging_hub
    keepalive = keepalive_of(hub)
    broken, healthy = [(await sidecar_in(store, db))[0] for _ in range(2)]
    async with (
        welcomed(hub, broken) as (_broken_ws, broken_side),
        welcomed(hub, healthy) as (healthy_ws, healthy_side),
    ):

        def fails() -> None:
            raise RuntimeError("a socket that cannot be written")

        # An instance attribute shadows the method for this one socket only.
        broken_side.flush = fails  # type: ignore[method-assign]
        await eventually(lambda: hub.events.disconnected == [broken.target], what="the abort")
        sent = keepalive.pings_sent
        await eventually(lambda: keepalive.pings_sent >= sent + 3, what="three more pings")
        assert healthy_ws.state is State.OPEN
        assert healthy_side.latency > 0
        assert await record_row(db, healthy.allocation_id) is not None
        assert hub.events.disconnected == [broken.target]
