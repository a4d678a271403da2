"""A take's events (architecture §8, *A take's events*): a take commits without the feed's lock
and, unless it rings its slot's bell, without a notification; the replica holding the member's
socket announces it (writes its events) when it hears the bell, and looks again while any take
is in flight and until the slot rung is over, so a silent take that commits later is announced
too. Any earlier update of the row writes the take's events first; no application role can hold
the bells."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, overload

import asyncpg
import pytest
from websockets.asyncio.client import ClientConnection

from hubd.aio import TrackedTasks
from hubd.server.handover import Handovers
from hubd.store import Database
from hubd.store.channels import HANDOVER_CHANNEL
from hubd.store.connections import SQL, ConnectionStore
from hubd.store.pools import Pool, PoolStore
from tests.apikit import app_role
from tests.polling import eventually
from tests.wskit import Hub, Sidecar, bind_identity, dial, hearing, running_hub, welcome_of

SPEC = {"image": "python:3.12"}
TAKE = "SELECT id FROM hubd_v1.request('local', 'acme', $1, spec => $2)"
SLOT = "SELECT hubd_take_slot()"


async def members(db: Database, count: int, *, ready: bool = False) -> list[Sidecar]:
    """``count`` pool members allocated, each with a sidecar identity, oldest first; with
    ``ready``, their sidecars connected (as far as a take can tell) without a socket."""
    pools = PoolStore(db, instance_id="test-instance")
    pool = Pool(id="warm", provisioner="local", spec=SPEC, size=count, refill_rate=1000.0)
    await pools.set_pools([pool], served=["local"])
    assert (await pools.refill("warm", most=count)).made == count
    ids = await db.pool.fetch(
        "UPDATE hubd_allocations SET status = 'allocated', next_attempt_at = NULL, "
        "connection_ready = $1 WHERE pool_id = 'warm' AND taken_at IS NULL "
        "RETURNING id, created_at",
        ready,
    )
    return [await bind_identity(db, r["id"]) for r in sorted(ids, key=lambda r: r[1])]


async def connected(
    hub: Hub, sidecar: Sidecar, db: Database, stack: contextlib.AsyncExitStack
) -> ClientConnection:
    ws = await stack.enter_async_context(dial(hub.url, sidecar.headers()))
    await welcome_of(ws)
    await ws.send(json.dumps({"type": "welcome_ack"}))

    async def ready() -> bool:
        return bool(
            await db.pool.fetchval(
                "SELECT connection_ready FROM hubd_allocations WHERE id = $1",
                sidecar.allocation_id,
            )
        )

    await eventually(ready, within=30)
    return ws


async def events_of(db: Database, allocation_id: str) -> list[str]:
    rows = await db.pool.fetch(
        "SELECT event FROM hubd_events WHERE allocation_id = $1 ORDER BY position", allocation_id
    )
    return [r["event"] for r in rows]


class TestAnnouncement:
    async def test_a_take_that_rang_no_bell_is_announced_once_it_commits(
        self, db: Database, database_url: str
    ) -> None:
        """Two takes in flight at once, in one slot of time, their members' sockets on two
        replicas: the first rings the slot's bell, the second finds it held and notifies
        nothing. The first commits, and
        both replicas sweep; the second commits only after the first was announced, and is
        announced all the same, by the replica holding its socket: it was in flight when
        they looked. Without the second look nothing would announce it (no socket check
        runs here)."""
        first, second = await members(db, 2)
        async with (
            running_hub(db, ready_on_connect=True, instance_id="in_one") as one,
            running_hub(db, ready_on_connect=True, instance_id="in_two") as two,
            hearing(database_url, one, two) as heard,
            contextlib.AsyncExitStack() as stack,
        ):
            sockets = {
                first.allocation_id: await connected(one, first, db, stack),
                second.allocation_id: await connected(two, second, db, stack),
            }
            ringing = await stack.enter_async_context(_transaction(database_url))
            silent = await stack.enter_async_context(_transaction(database_url))
            rang, unheard = await _two_takes_in_one_slot(ringing, silent)
            assert {rang, unheard} == set(sockets)
            await ringing.execute("COMMIT")
            await eventually(lambda: _has(db, rang, ["requested", "ready"]), within=30)
            assert await events_of(db, unheard) == []
            await silent.execute("COMMIT")
            await eventually(lambda: _has(db, unheard, ["requested", "ready"]), within=30)
            async with asyncio.timeout(30):
                told = json.loads(await sockets[unheard].recv())
            assert (told["type"], told["session"]) == ("session", "s-2")
            assert len(heard) == 1
            # Announced once each, whichever replica looked.
            assert await events_of(db, rang) == ["requested", "ready"]
            assert await events_of(db, unheard) == ["requested", "ready"]

    async def test_a_take_kept_uncommitted_silences_no_other_for_long(
        self, db: Database, database_url: str
    ) -> None:
        """An application keeps a take uncommitted: it holds its slot's bell and its mark for
        as long as it likes. A take of another slot rings, and the replica then looks for as
        long as the first stays in flight: a take of a slot of the held bell, which stays
        silent, is announced all the same. Without the looks nothing would announce it."""
        sidecars = await members(db, 3)
        async with (
            running_hub(db, ready_on_connect=True, instance_id="in_one") as one,
            hearing(database_url, one) as heard,
            contextlib.AsyncExitStack() as stack,
        ):
            for sidecar in sidecars:
                await connected(one, sidecar, db, stack)
            kept = await stack.enter_async_context(_transaction(database_url))
            await kept.fetchval(TAKE, "s-kept", json.dumps(SPEC))
            free = {
                r["bell"]
                for r in await db.pool.fetch(
                    "SELECT bell FROM hubd_take_bells WHERE bell LIKE 'bell%' "
                    "FOR UPDATE SKIP LOCKED"
                )
            }
            (held,) = {f"bell_{n}" for n in range(16)} - free
            rung = await _take_in_slot(db, lambda slot: f"bell_{slot % 16}" != held)
            await eventually(lambda: _has(db, rung, ["requested", "ready"]), within=30)
            await eventually(lambda: len(heard) == 1, within=10)
            silent = await _take_in_slot(db, lambda slot: f"bell_{slot % 16}" == held)
            await eventually(lambda: _has(db, silent, ["requested", "ready"]), within=30)
            # Notices arrive in commit order: one sent after it shows none came from it.
            after = await db.pool.fetchval("SELECT hubd_notice('al_none', '1:take')")
            await db.pool.execute("SELECT pg_notify($1, $2)", HANDOVER_CHANNEL, after)
            await eventually(lambda: after in heard, within=10)
            assert len(heard) == 2

    async def test_a_take_that_cannot_mark_itself_in_flight_notifies(
        self, db: Database, database_url: str
    ) -> None:
        """A replica's look holds the in-flight mark an instant; a take that finds it so, with
        the bell held by another take, notifies rather than go unheard."""
        await members(db, 2, ready=True)
        async with contextlib.AsyncExitStack() as stack:
            listener = await asyncpg.connect(database_url)
            stack.push_async_callback(listener.close)
            heard: list[str] = []
            await listener.add_listener(HANDOVER_CHANNEL, lambda *args: heard.append(args[-1]))
            ringing = await stack.enter_async_context(_transaction(database_url))
            looking = await stack.enter_async_context(_transaction(database_url))
            # A take's hold on the bells (every slot's), and a replica's look, at once.
            await ringing.execute(
                "SELECT 1 FROM hubd_take_bells WHERE bell LIKE 'bell%' FOR UPDATE"
            )
            await looking.execute(
                "SELECT 1 FROM hubd_take_bells WHERE bell = 'in_flight' FOR UPDATE"
            )
            await db.pool.fetchval(TAKE, "s-1", json.dumps(SPEC))
            await eventually(lambda: len(heard) == 1, within=10)
            # Marked in flight, with the bell held: this one stays silent.
            await looking.execute("ROLLBACK")
            marked = await db.pool.fetchval(TAKE, "s-2", json.dumps(SPEC))
            await ringing.execute("ROLLBACK")
            # Notices arrive in commit order: one sent after it shows none came from it.
            await db.pool.execute("SELECT pg_notify($1, 'after')", HANDOVER_CHANNEL)
            await eventually(lambda: heard[-1] == "after", within=10)
            assert len(heard) == 2
            # No replica runs here: neither take is announced.
            assert await events_of(db, marked) == []
            assert await db.pool.fetchval("SELECT count(*) FROM hubd_events") == 0

    async def test_an_update_before_the_announcement_writes_the_take_events_first(
        self, db: Database, database_url: str
    ) -> None:
        """An application releases what it took before any replica announced the take: the
        release's commit writes 'requested' before 'releasing', and a later
        announcement finds nothing left to write."""
        (member,) = await members(db, 1, ready=True)
        async with _silenced(database_url):
            assert await db.pool.fetchval(TAKE, "s-1", json.dumps(SPEC)) == member.allocation_id
        assert await events_of(db, member.allocation_id) == []
        await db.pool.execute("SELECT (hubd_v1.release($1)).id", member.allocation_id)
        # Ready no longer when announced: the feed says what is true at its commit.
        assert await events_of(db, member.allocation_id) == ["requested", "releasing"]
        store = ConnectionStore(db, instance_id="in_one")
        assert await store.announce_takes(stale_after=0.0) == []
        assert await events_of(db, member.allocation_id) == ["requested", "releasing"]

    async def test_a_take_whose_replica_is_gone_is_announced_by_any_once_stale(
        self, db: Database, database_url: str
    ) -> None:
        """Its socket is held by no replica here (it died, or froze): another announces it
        only once it is older than the socket check's bound, not at once."""
        member = await _unheard_take(db, database_url)
        store = ConnectionStore(db, instance_id="in_other")
        assert await store.announce_takes() == []
        assert await store.announce_takes(stale_after=3600.0) == []
        announced = await store.announce_takes(stale_after=0.0)
        assert [(a.handover.target.allocation_id, a.handover.session) for a in announced] == [
            (member.allocation_id, "s-1")
        ]
        assert await events_of(db, member.allocation_id) == ["requested", "ready"]

    async def test_an_announcement_a_paused_replica_holds_is_skipped_then_made_once(
        self, db: Database, database_url: str
    ) -> None:
        """A replica froze inside its announcement (its rows locked, uncommitted): another's
        announcement skips those rows rather than wait, and writes nothing. The frozen one
        dies (its transaction rolls back): the next announcement makes it, once."""
        member = await _unheard_take(db, database_url)
        other = ConnectionStore(db, instance_id="in_other")
        async with _transaction(database_url) as frozen:
            held = SQL.announce_takes(instance_id="in_frozen", stale_after=0.0)
            assert [r["id"] for r in await frozen.fetch(held.sql, *held.args)] == [
                member.allocation_id
            ]
            async with asyncio.timeout(10):
                assert await other.announce_takes(stale_after=0.0) == []
            assert await events_of(db, member.allocation_id) == []
        done = await other.announce_takes(stale_after=0.0)
        assert [a.handover.target.allocation_id for a in done] == [member.allocation_id]
        assert await other.announce_takes(stale_after=0.0) == []
        assert await events_of(db, member.allocation_id) == ["requested", "ready"]


class TestSweep:
    async def test_a_sweep_announces_again_without_a_look_while_takes_keep_coming(
        self, db: Database, database_url: str
    ) -> None:
        """A look holds the in-flight mark an instant, and every take that meets it notifies:
        in a burst, a look per announcement would make the burst's takes notify in turn. So
        while announcements find takes the sweep announces again and does not look; it looks
        once two announcements in a row find none (a burst's find none now and then), and
        then announces once more."""
        await members(db, 3, ready=True)
        calls: list[str] = []
        taken: list[str] = []

        class Recorded(ConnectionStore):
            async def announce_takes(self, *, stale_after: float | None = None) -> list[Any]:
                # No socket is held here: the takes are announced as stale ones are.
                announced = await super().announce_takes(stale_after=0.0)
                calls.append(f"announce {len(announced)}")
                if announced and len(taken) < 3:
                    # The burst goes on: another take commits before the next announcement.
                    async with _silenced(database_url):
                        taken.append(await _take(db))
                return announced

            async def takes_in_flight(self) -> bool:
                calls.append("look")
                return await super().takes_in_flight()

        tasks = TrackedTasks()
        handovers = Handovers(
            Recorded(db, instance_id="in_one"),
            tasks=tasks,
            sockets=lambda _: [],
            close=lambda *_: None,
            follow=_nothing,
            timeout=10.0,
        )
        async with _silenced(database_url):
            taken.append(await _take(db))
        handovers.heard()
        async with asyncio.timeout(30):
            await tasks.drain()
        await handovers.close()
        # No bell rang (every one was held): only the takes in flight keep the sweep going.
        assert calls == [
            "announce 1",
            "announce 1",
            "announce 1",
            "announce 0",
            "announce 0",
            "look",
            "announce 0",
        ]
        for allocation_id in taken:
            assert await events_of(db, allocation_id) == ["requested", "ready"]


class TestBells:
    async def test_an_application_role_can_neither_lock_nor_look_at_the_bells(
        self, db: Database, database_url: str
    ) -> None:
        """Whatever an application could lock it could hold forever: the bells are hubd's."""
        async with app_role(database_url) as dsn:
            conn = await asyncpg.connect(dsn)
            try:
                for sql in (
                    "SELECT 1 FROM hubd_take_bells FOR KEY SHARE",
                    "SELECT 1 FROM hubd_take_bells FOR UPDATE",
                    "SELECT hubd_takes_in_flight()",
                    "LOCK TABLE hubd_take_bells",
                ):
                    with pytest.raises(asyncpg.InsufficientPrivilegeError):
                        await conn.execute(f"BEGIN; {sql}; COMMIT")
                    await conn.execute("ROLLBACK")
            finally:
                await conn.close()

    async def test_a_bell_rings_once_in_its_slot(self, db: Database, database_url: str) -> None:
        """The take that rang its slot's bell committed; a take later in the same slot finds
        the bell rung and notifies nothing (the replicas that heard the ring look until the
        slot is over). A bell free again at each ring's commit would ring once per take in
        flight, and a burst's takes would take NOTIFY's lock in turn."""
        await members(db, 20, ready=True)
        async with contextlib.AsyncExitStack() as stack:
            listener = await asyncpg.connect(database_url)
            stack.push_async_callback(listener.close)
            heard: list[str] = []
            await listener.add_listener(HANDOVER_CHANNEL, lambda *args: heard.append(args[-1]))
            async with asyncio.timeout(60):
                while True:
                    before = len(heard)
                    rung = await _ring(db)
                    await eventually(lambda: len(heard) == before + 1, within=10)  # noqa: B023
                    if await _take_in_slot(db, lambda slot, rung=rung: slot == rung, tries=1):
                        break
            await db.pool.execute("SELECT pg_notify($1, 'after')", HANDOVER_CHANNEL)
            await eventually(lambda: heard[-1] == "after", within=10)
            # Notices arrive in commit order: the ring's, then the one sent after.
            assert len(heard) == before + 2

    async def test_a_look_says_takes_may_come_until_the_slot_rung_is_over(
        self, db: Database, database_url: str
    ) -> None:
        """A look in the slot a bell rang in says takes may yet commit unheard, with none in
        flight: a take of that slot stays silent. Once the slot is over it says none may."""
        await members(db, 20, ready=True)
        store = ConnectionStore(db, instance_id="in_one")
        async with db.pool.acquire() as conn, asyncio.timeout(60):
            while True:
                rung = await _ring(db)
                async with conn.transaction():
                    began = await conn.fetchval(SLOT)
                    looked = await conn.fetchval("SELECT hubd_takes_in_flight()")
                    ended = await conn.fetchval(SLOT)
                if began == ended == rung:
                    break
        assert looked is True

        async def none_may() -> bool:
            return not await store.takes_in_flight()

        await eventually(none_may, within=10)
        assert await db.pool.fetchval(SLOT) > rung

    async def test_a_look_finds_takes_in_flight_until_they_commit(
        self, db: Database, database_url: str
    ) -> None:
        await members(db, 1, ready=True)
        store = ConnectionStore(db, instance_id="in_one")
        assert await store.takes_in_flight() is False
        async with _transaction(database_url) as taking:
            await taking.fetchval(TAKE, "s-1", json.dumps(SPEC))
            assert await store.takes_in_flight() is True
        assert await store.takes_in_flight() is False


async def _unheard_take(db: Database, database_url: str) -> Sidecar:
    """A ready member taken (session 's-1') while every bell was held: silent, unannounced."""
    (member,) = await members(db, 1, ready=True)
    async with _silenced(database_url):
        await db.pool.fetchval(TAKE, "s-1", json.dumps(SPEC))
    return member


@contextlib.asynccontextmanager
async def _silenced(database_url: str) -> AsyncIterator[None]:
    """Every bell held, as by takes uncommitted elsewhere: a take now rings none and stays
    silent, its events owed to an announcement."""
    async with _transaction(database_url) as holding:
        await holding.execute("SELECT 1 FROM hubd_take_bells WHERE bell LIKE 'bell%' FOR UPDATE")
        yield


@overload
async def _take_in_slot(db: Database, wanted: Callable[[int], bool]) -> str: ...
@overload
async def _take_in_slot(
    db: Database, wanted: Callable[[int], bool], *, tries: int
) -> str | None: ...
async def _take_in_slot(
    db: Database, wanted: Callable[[int], bool], *, tries: int | None = None
) -> str | None:
    """A take committed in a slot of time that ``wanted`` accepts (by the database's clock): a
    take that crossed into another slot, or began in one not wanted, is rolled back (it
    notified nothing) and tried again, early in the next wanted slot; at most ``tries``
    times (``None``: until it is), then ``None``."""

    async def now_wanted() -> bool:
        at = await db.pool.fetchval("SELECT extract(epoch FROM clock_timestamp())::float8 * 50")
        return wanted(int(at)) and at - int(at) < 0.5

    async with db.pool.acquire() as conn, asyncio.timeout(60):
        tried = 0
        while tries is None or tried < tries:
            tried += 1
            if tries is None:
                await eventually(now_wanted, within=30, every=0.002)
            trying = conn.transaction()
            await trying.start()
            began = await conn.fetchval(SLOT)
            taken: str = await conn.fetchval(TAKE, "s-" + os.urandom(4).hex(), json.dumps(SPEC))
            if wanted(began) and await conn.fetchval(SLOT) == began:
                await trying.commit()
                return taken
            await trying.rollback()
    return None


async def _ring(db: Database) -> int:
    """A take committed in a slot after every one a bell rang in, so that it rings its
    slot's bell; that slot."""

    async def past_rung() -> bool:
        return bool(
            await db.pool.fetchval(
                "SELECT hubd_take_slot() > coalesce(max(rang), -1) FROM hubd_take_bells"
            )
        )

    await eventually(past_rung, within=10, every=0.002)
    await _take(db)
    rung: int = await db.pool.fetchval("SELECT max(rang) FROM hubd_take_bells")
    return rung


async def _two_takes_in_one_slot(
    first: asyncpg.Connection, second: asyncpg.Connection
) -> tuple[str, str]:
    """A take in each open transaction, both in one slot of time (by the database's clock),
    so that the second finds the bell the first rang held: a pair that crossed a slot's end
    is rolled back (neither notified) and tried again in new transactions."""
    async with asyncio.timeout(60):
        while True:
            began = await first.fetchval(SLOT)
            one: str = await first.fetchval(TAKE, "s-1", json.dumps(SPEC))
            two: str = await second.fetchval(TAKE, "s-2", json.dumps(SPEC))
            if await second.fetchval(SLOT) == began:
                return one, two
            for conn in (first, second):
                await conn.execute("ROLLBACK")
                await conn.execute("BEGIN")


class TestQueuedTriggers:
    async def test_rows_that_write_no_event_queue_no_event_trigger(
        self, db: Database, database_url: str
    ) -> None:
        """The event triggers are queued only where an event can follow: a member's own
        provisioning, a take and the acknowledgement of a member that was ready already run no
        hubd_record_event at commit (each was a call for nothing in the commits a burst of
        takes waits behind); a cold request's insert and the take's announcement still do, and
        write the events. Counted by PostgreSQL's function statistics of the transaction."""
        (member,) = await members(db, 1)
        conn = await asyncpg.connect(database_url)
        try:
            runs = _trigger_runs(conn)
            assert await runs(
                "UPDATE hubd_allocations SET connection_ready = true WHERE id = $1 RETURNING id",
                member.allocation_id,
            ) == (0, 1)
            assert await runs(TAKE, "s-1", json.dumps(SPEC)) == (0, 1)
            assert await events_of(db, member.allocation_id) == []
            assert await runs(
                "UPDATE hubd_allocations SET handover_pending = false WHERE id = $1 RETURNING id",
                member.allocation_id,
            ) == (1, 1)
            assert await events_of(db, member.allocation_id) == ["requested", "ready"]
            assert await runs(
                "UPDATE hubd_allocations SET handover_pending = true WHERE id = $1 RETURNING id",
                member.allocation_id,
            ) == (0, 1)
            assert await runs(
                "UPDATE hubd_allocations SET handover_pending = false WHERE id = $1 RETURNING id",
                member.allocation_id,
            ) == (0, 1)
            cold = "SELECT id FROM hubd_v1.request('local', 'acme', 's-2', spec => '{}')"
            assert await runs(cold) == (1, 1)
        finally:
            await conn.close()
        assert await events_of(db, member.allocation_id) == ["requested", "ready"]


def _trigger_runs(conn: asyncpg.Connection) -> Callable[..., Awaitable[tuple[int, int]]]:
    """Runs a statement in a transaction of its own, firing its deferred triggers before the
    commit; how many times hubd_record_event ran, and how many rows the statement touched."""

    async def runs(statement: str, *args: Any) -> tuple[int, int]:
        # The counts of a transaction can carry what earlier ones left unflushed: the
        # difference is this statement's.
        calls = "SELECT coalesce(pg_stat_get_xact_function_calls('hubd_record_event'::regproc), 0)"
        async with conn.transaction():
            await conn.execute("SET LOCAL track_functions = 'pl'")
            before = await conn.fetchval(calls)
            touched = len(await conn.fetch(statement, *args))
            await conn.execute("SET CONSTRAINTS ALL IMMEDIATE")
            after = await conn.fetchval(calls)
        return int(after - before), touched

    return runs


async def _take(db: Database) -> str:
    taken: str = await db.pool.fetchval(TAKE, "s-" + os.urandom(4).hex(), json.dumps(SPEC))
    return taken


async def _nothing(_: object) -> None:
    return None


async def _has(db: Database, allocation_id: str, wanted: list[str]) -> bool:
    return await events_of(db, allocation_id) == wanted


@contextlib.asynccontextmanager
async def _transaction(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection in an open transaction, rolled back at the end if still open."""
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("BEGIN")
        yield conn
        if conn.is_in_transaction():
            await conn.execute("ROLLBACK")
    finally:
        await conn.close()
