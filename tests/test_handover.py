"""Hand-over (architecture §4): a taken pool member's sidecar is told its session over the
socket it holds, acknowledges it fenced on its connection, and is told again after a reconnect
or a missed notice until it does; with ``ready_when = declared`` the application sees the
allocation ready only once it did."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from websockets.asyncio.client import ClientConnection

from hubd.routing import Target
from hubd.store import AllocationStore, Database
from hubd.store.allocations import ProvisionerLimits
from hubd.store.connections import ConnectionStore
from hubd.store.pools import Pool, PoolStore
from tests.polling import eventually
from tests.wskit import (
    Hub,
    Sidecar,
    bind_identity,
    close_code_of,
    dial,
    hearing,
    running_hub,
    welcome_of,
)

SPEC = {"image": "python:3.12"}


@pytest.fixture
async def hub(db: Database) -> AsyncIterator[Hub]:
    async with running_hub(db, ready_on_connect=True) as running:
        yield running


async def member(db: Database, *, ready_when: str = "connected") -> Sidecar:
    """A pool member allocated and waiting for its sidecar, with a sidecar identity."""
    pools = PoolStore(db, instance_id="test-instance")
    pool = Pool(id="warm", provisioner="local", spec=SPEC, size=1, refill_rate=100.0)
    await pools.set_pools([pool], served=["local"])
    assert (await pools.refill("warm", most=1)).made == 1
    member_id = await db.pool.fetchval(
        "UPDATE hubd_allocations SET status = 'allocated', ready_when = $1, "
        "next_attempt_at = NULL WHERE pool_id = 'warm' AND taken_at IS NULL RETURNING id",
        ready_when,
    )
    return await bind_identity(db, member_id)


async def welcomed(ws: ClientConnection) -> dict[str, Any]:
    welcome = await welcome_of(ws)
    await ws.send(json.dumps({"type": "welcome_ack"}))
    return welcome


async def message_of(ws: ClientConnection) -> dict[str, Any]:
    async with asyncio.timeout(10):
        data: dict[str, Any] = json.loads(await ws.recv())
    return data


async def row(db: Database, allocation_id: str) -> asyncpg.Record:
    found = await db.pool.fetchrow("SELECT * FROM hubd_allocations WHERE id = $1", allocation_id)
    assert found is not None
    return found


async def ready_row(db: Database, allocation_id: str) -> bool:
    return bool((await row(db, allocation_id))["connection_ready"])


async def take(db: Database) -> asyncpg.Record:
    made = await db.pool.fetchrow(
        "SELECT * FROM hubd_v1.request('local', 'acme', 's-1', spec => $1)", json.dumps(SPEC)
    )
    assert made is not None
    return made


class TestHandover:
    async def test_the_sidecar_is_told_its_session_and_its_ack_is_recorded(
        self, db: Database, hub: Hub, database_url: str
    ) -> None:
        sidecar = await member(db)
        async with hearing(database_url, hub), dial(hub.url, sidecar.headers()) as ws:
            welcome = await welcomed(ws)
            assert (welcome["tenant"], welcome["session"]) == (None, None)
            await eventually(lambda: ready_row(db, sidecar.allocation_id), within=30)
            made = await take(db)
            assert (made["id"], made["ready"], made["warm"]) == (sidecar.allocation_id, True, True)
            told = await message_of(ws)
            assert told == {
                "type": "session",
                "allocation_id": sidecar.allocation_id,
                "generation": sidecar.generation,
                "tenant": "acme",
                "session": "s-1",
            }
            assert (await row(db, sidecar.allocation_id))["handover_pending"] is True
            await ws.send(json.dumps({"type": "session_ack"}))
            assert await message_of(ws) == {"type": "session_recorded"}
            # Ready at the take already: the acknowledgement changes nothing the tenant reads.
            events = await db.pool.fetch(
                "SELECT event FROM hubd_v1.events WHERE allocation_id = $1 ORDER BY position",
                sidecar.allocation_id,
            )
            assert [e["event"] for e in events] == ["requested", "ready"]
        assert (await row(db, sidecar.allocation_id))["handover_pending"] is False
        kinds = await db.pool.fetch(
            "SELECT kind FROM hubd_allocation_ledger WHERE allocation_id = $1 ORDER BY seq",
            sidecar.allocation_id,
        )
        # The socket's close may have written its own row after them.
        assert [k["kind"] for k in kinds if k["kind"] in ("take", "handover")] == [
            "take",
            "handover",
        ]

    async def test_a_member_that_must_declare_reads_ready_only_once_it_acknowledged(
        self, db: Database, hub: Hub, database_url: str
    ) -> None:
        sidecar = await member(db, ready_when="declared")
        cursor = await db.pool.fetchval("SELECT hubd_v1.event_cursor()")
        async with hearing(database_url, hub), dial(hub.url, sidecar.headers()) as ws:
            await welcomed(ws)
            await ws.send(json.dumps({"type": "ready"}))
            assert await message_of(ws) == {"type": "ready_recorded"}
            await eventually(lambda: ready_row(db, sidecar.allocation_id), within=30)
            made = await take(db)
            assert (made["id"], made["ready"]) == (sidecar.allocation_id, False)
            assert (await row(db, sidecar.allocation_id))["starting_since"] is not None
            assert (await message_of(ws))["type"] == "session"
            await ws.send(json.dumps({"type": "session_ack"}))
            assert await message_of(ws) == {"type": "session_recorded"}
            view = await db.pool.fetchrow(
                "SELECT ready FROM hubd_v1.allocations WHERE id = $1", sidecar.allocation_id
            )
            assert view is not None
            assert view["ready"] is True
            events = await db.pool.fetch(
                "SELECT event, ready FROM hubd_v1.events_after($1) WHERE allocation_id = $2",
                cursor,
                sidecar.allocation_id,
            )
            assert [tuple(e) for e in events] == [("requested", False), ("ready", True)]
            assert (await row(db, sidecar.allocation_id))["starting_since"] is None

    async def test_a_sidecar_that_reconnects_before_it_acknowledged_is_told_again(
        self, db: Database, hub: Hub
    ) -> None:
        sidecar = await member(db)
        async with dial(hub.url, sidecar.headers()) as ws:
            first = await welcomed(ws)
            await eventually(lambda: ready_row(db, sidecar.allocation_id), within=30)
            await take(db)  # no notice reaches the hub: nothing is sent on this socket

        async def closed() -> bool:
            return not await ready_row(db, sidecar.allocation_id)

        # The hub writes the close before the sidecar is back, as after any real outage.
        await eventually(closed, within=30)
        headers = sidecar.headers(**{"Hubd-Reconnect-Secret": first["reconnect_secret"]})
        async with dial(hub.url, headers) as ws:
            again = await welcomed(ws)
            # The welcome says the session already; the hand-over still asks for its ack.
            assert (again["tenant"], again["session"]) == ("acme", "s-1")
            assert (await message_of(ws))["type"] == "session"
            await ws.send(json.dumps({"type": "session_ack"}))
            assert await message_of(ws) == {"type": "session_recorded"}
            # No replica announced the take: the next update of its row (the close's) wrote
            # its events, saying what was true then; the reconnect made it ready again.
            events = await db.pool.fetch(
                "SELECT event, ready FROM hubd_events WHERE allocation_id = $1 ORDER BY position",
                sidecar.allocation_id,
            )
            assert [tuple(e) for e in events] == [("requested", False), ("ready", True)]
        assert (await row(db, sidecar.allocation_id))["handover_pending"] is False

    async def test_an_ack_from_a_socket_another_replica_superseded_writes_nothing(
        self, db: Database, hub: Hub
    ) -> None:
        """The sidecar reconnected to a second replica after the take; the first replica has
        not heard of it yet, and the old socket's acknowledgement comes late (a paused peer,
        a slow network): the fence on its record refuses it, and the hand-over stays owed
        until the current socket acknowledges."""
        sidecar = await member(db)
        async with (
            running_hub(db, ready_on_connect=True, instance_id="in_two") as two,
            dial(hub.url, sidecar.headers()) as old,
        ):
            first = await welcomed(old)
            await eventually(lambda: ready_row(db, sidecar.allocation_id), within=30)
            await take(db)
            secret = {"Hubd-Reconnect-Secret": first["reconnect_secret"]}
            async with dial(two.url, sidecar.headers(**secret)) as new:
                await welcomed(new)
                assert (await message_of(new))["type"] == "session"
                await old.send(json.dumps({"type": "session_ack"}))
                assert await close_code_of(old) == 4000
                assert (await row(db, sidecar.allocation_id))["handover_pending"] is True
                await new.send(json.dumps({"type": "session_ack"}))
                assert await message_of(new) == {"type": "session_recorded"}
        assert (await row(db, sidecar.allocation_id))["handover_pending"] is False

    async def test_acknowledgements_written_together_are_each_fenced_on_their_own(
        self, db: Database, hub: Hub
    ) -> None:
        """A burst's acknowledgements go in one statement; a late one from a socket that no
        longer holds the record (a paused replica's, a superseded connection's) sits in the
        same batch as the current socket's: it writes nothing, and the current one is done
        once. Written again, the current one finds nothing owed."""
        sidecar = await member(db)
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcomed(ws)
            await eventually(lambda: ready_row(db, sidecar.allocation_id), within=30)
            await take(db)
            current = await db.pool.fetchval(
                "SELECT connection_id FROM hubd_sidecar_connections WHERE allocation_id = $1",
                sidecar.allocation_id,
            )
            target = Target(
                sidecar.allocation_id, (await row(db, sidecar.allocation_id))["generation"]
            )
            late = ConnectionStore(db, instance_id="in_paused")
            batch = [("co_superseded", target), (current, target)]
            assert await late.acknowledge_handovers(batch) == {(current, target): True}
            assert (await row(db, sidecar.allocation_id))["handover_pending"] is False
            assert await late.acknowledge_handovers(batch) == {(current, target): False}
        assert (
            await db.pool.fetchval(
                "SELECT count(*) FROM hubd_allocation_ledger WHERE kind = 'handover'"
            )
            == 1
        )

    async def test_a_missed_notice_is_made_good_by_the_socket_check(
        self, db: Database, hub: Hub
    ) -> None:
        sidecar = await member(db)
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcomed(ws)
            await eventually(lambda: ready_row(db, sidecar.allocation_id), within=30)
            await take(db)
            assert await hub.router.handover.resend(stale_after=1.0) == 1
            assert (await message_of(ws))["tenant"] == "acme"

    async def test_an_ack_before_the_welcome_ack_is_a_protocol_error_and_writes_nothing(
        self, db: Database, hub: Hub
    ) -> None:
        sidecar = await member(db)
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcome_of(ws)
            await ws.send(json.dumps({"type": "session_ack"}))
            assert await close_code_of(ws) == 4003
        assert (
            await db.pool.fetchval(
                "SELECT count(*) FROM hubd_allocation_ledger WHERE kind = 'handover'"
            )
            == 0
        )

    async def test_a_member_that_never_acknowledges_is_given_up(
        self, db: Database, hub: Hub, store: AllocationStore
    ) -> None:
        """An application waiting for a declared member's hand-over does not wait forever:
        the provisioning deadline runs from the take."""
        sidecar = await member(db, ready_when="declared")
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcomed(ws)
            await ws.send(json.dumps({"type": "ready"}))
            assert await message_of(ws) == {"type": "ready_recorded"}
            await eventually(lambda: ready_row(db, sidecar.allocation_id), within=30)
            await take(db)
            await store.set_limits(
                {
                    "local": ProvisionerLimits(
                        max_lifetime=None,
                        pending_timeout=None,
                        idle_timeout=None,
                        provisioning_timeout=0.2,
                    )
                }
            )

            async def given_up() -> bool:
                await store.sweep_deadlines(warning=0, pending_timeout=None)
                found = await row(db, sidecar.allocation_id)
                return found["failure_code"] == "provisioning_timeout"

            await eventually(given_up, within=30, every=0.1)
