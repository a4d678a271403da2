"""The client's followers under connection faults (docs/api.md, "The Python client"): no fault
ends one, a closed connection is known at once and a silent one within two health intervals,
nothing is skipped or delivered twice, and ``close()`` returns promptly whatever the follower is
doing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import pytest

from hubd.client import Client, ClientClosed
from hubd.client.faults import is_fault
from hubd.store import AllocationStore, Database, Status
from tests.apikit import app_role
from tests.conftest import PostgresServer
from tests.followkit import FAULTS, FOLLOWER, Fire, follower_backends, named, under_fire
from tests.polling import eventually, scaled
from tests.storekit import drive_to

T = TypeVar("T")

QUIET = 3600.0
"""A health interval no test waits for: what a test sees came from elsewhere."""


@pytest.fixture
async def app_dsn(database_url: str) -> AsyncIterator[str]:
    async with app_role(database_url) as dsn:
        yield dsn


@pytest.fixture
async def admin(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(database_url)
    try:
        yield conn
    finally:
        await conn.close()


async def _listening_backend(admin: asyncpg.Connection) -> int:
    """The follower's backend once it waits for a notification (its reads done)."""
    found: list[int] = []

    async def idle() -> bool:
        rows = await admin.fetch(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1 "
            "AND state = 'idle' AND query LIKE '%hubd_v1.%'",
            FOLLOWER,
        )
        found[:] = [row["pid"] for row in rows]
        return len(found) == 1

    await eventually(idle, within=20, what="the follower listening")
    return found[0]


async def _read_held(admin: asyncpg.Connection) -> None:
    """Until the follower's read waits on the lock the caller holds."""

    async def waiting() -> bool:
        rows = await follower_backends(admin)
        return any(row["wait_event_type"] == "Lock" for row in rows)

    await eventually(waiting, within=20, what="the follower's read held on the lock")


@contextlib.asynccontextmanager
async def _running(coro: Coroutine[Any, Any, T]) -> AsyncIterator[asyncio.Task[T]]:
    """``coro`` as a task for the block, cancelled and awaited after it (whatever happened)."""
    task = asyncio.create_task(coro)
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@contextlib.contextmanager
def _stopped(server: PostgresServer, pid: int) -> Iterator[None]:
    """The backend ``pid`` stopped (SIGSTOP) while the block runs: a connection whose server
    neither answers nor closes. Only on the embedded server, whose backends are this host's
    processes."""
    if server.embedded is None:
        pytest.skip("stops a backend process: needs the embedded server on this host")
    command = Path(f"/proc/{pid}/cmdline")
    if not command.exists() or b"postgres" not in command.read_bytes():
        pytest.skip("the backend is not a process of this host")
    try:
        os.kill(pid, signal.SIGSTOP)
    except PermissionError:
        pytest.skip("may not signal the server's processes")
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


class TestFaults:
    def test_every_connection_fault_is_read_again_and_every_answer_raised(self) -> None:
        """Terminated backends, shutdowns, cancelled statements, the driver's lost protocol
        state and timeouts are faults; the API's refusals and missing privileges are answers."""
        faults = [
            asyncpg.AdminShutdownError("terminating connection due to administrator command"),
            asyncpg.CrashShutdownError(),
            asyncpg.CannotConnectNowError(),
            asyncpg.QueryCanceledError(),
            asyncpg.TooManyConnectionsError(),
            asyncpg.ConnectionDoesNotExistError(),
            asyncpg.InterfaceError("connection is closed"),
            asyncpg.InternalClientError("cannot switch to state 11; another operation (2)"),
            ConnectionResetError(),
            TimeoutError(),
        ]
        answers = [
            asyncpg.PostgresError.new({"C": "HU410", "M": "too old", "S": "ERROR"}),
            asyncpg.InsufficientPrivilegeError(),
            asyncpg.InvalidSchemaNameError(),
            asyncpg.InvalidPasswordError(),
            ValueError(),
        ]
        assert [is_fault(e) for e in faults] == [True] * len(faults)
        assert [is_fault(e) for e in answers] == [False] * len(answers)


@pytest.mark.slow
@pytest.mark.timeout(180)
class TestUnderFire:
    async def test_every_event_arrives_once_in_order_while_the_backends_are_killed(
        self, database_url: str, app_dsn: str
    ) -> None:
        """Writers commit out of order for 15 s while the follower's backend is terminated or
        its read cancelled every 0.2-0.6 s (listening, mid-read, while it reconnects): every
        event arrives once, in commit order, and close() returns promptly."""
        account = await under_fire(
            database_url,
            app_dsn,
            Fire(seconds=15, writers=4, fault_every=(0.2, 0.6)),
            catch_up=scaled(30),
            close_deadline=scaled(10),
        )
        assert account.died is None
        assert account.committed > 1_000
        assert (account.received, account.missing, account.repeated, account.out_of_order) == (
            account.committed,
            0,
            0,
            0,
        )
        assert set(account.faults) == set(FAULTS), account.faults
        assert account.backends > sum(account.faults.values())
        assert account.ended_with == "ClientClosed"


class TestDeadConnections:
    async def test_wait_ready_hears_of_a_killed_listening_connection_at_once(
        self,
        app_dsn: str,
        admin: asyncpg.Connection,
        store: AllocationStore,
        db: Database,
    ) -> None:
        """Its backend terminated while it listens, the follower reconnects on the driver's
        signal and reads the feed: a ready that committed meanwhile is seen in seconds, with no
        health check due for an hour."""
        fence = await drive_to(store, db, Status.ALLOCATED)
        async with (
            await Client.connect(named(app_dsn, FOLLOWER)) as client,
            _running(
                client.wait_ready(fence.allocation_id, timeout=scaled(60), health_interval=QUIET)
            ) as waiting,
        ):
            pid = await _listening_backend(admin)
            assert await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
            await db.pool.execute(
                "UPDATE hubd_allocations SET connection_ready = true WHERE id = $1",
                fence.allocation_id,
            )
            async with asyncio.timeout(scaled(10)):
                ready = await waiting
        assert ready.ready
        assert ready.id == fence.allocation_id

    async def test_an_event_committed_while_the_listener_is_dead_arrives_in_seconds(
        self, app_dsn: str, admin: asyncpg.Connection
    ) -> None:
        """The same for events(): the event whose notification went to the dead connection is
        read from the feed on the new one."""
        async with await Client.connect(named(app_dsn, FOLLOWER)) as client:
            start = await client.cursor()
            events = client.events(since=start, health_interval=QUIET)
            async with contextlib.aclosing(events), _running(anext(events)) as first:
                pid = await _listening_backend(admin)
                assert await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
                made = await client.request("fake")
                async with asyncio.timeout(scaled(10)):
                    event = await first
        assert (event.allocation_id, event.event) == (made.id, "requested")

    async def test_a_silent_connection_is_given_up_after_two_health_intervals(
        self, app_dsn: str, admin: asyncpg.Connection, postgres_server: PostgresServer
    ) -> None:
        """A backend that neither answers nor closes (stopped): after one interval of silence
        the follower asks, gets no answer within another, and reads on a new connection."""
        interval = scaled(0.5)
        async with await Client.connect(named(app_dsn, FOLLOWER)) as client:
            start = await client.cursor()
            events = client.events(since=start, health_interval=interval)
            async with contextlib.aclosing(events), _running(anext(events)) as first:
                pid = await _listening_backend(admin)
                with _stopped(postgres_server, pid):
                    made = await client.request("fake")
                    async with asyncio.timeout(scaled(10)):
                        event = await first
        assert event.allocation_id == made.id


class TestClose:
    async def test_close_returns_at_once_while_a_read_is_stuck(
        self, app_dsn: str, admin: asyncpg.Connection
    ) -> None:
        """A read held on a lock (it would wait for READ_TIMEOUT): close() terminates the
        follower's connection and returns; the follower raises ClientClosed."""
        client = await Client.connect(named(app_dsn, FOLLOWER))
        try:
            async with admin.transaction():
                await admin.execute("LOCK TABLE hubd_event_horizon IN ACCESS EXCLUSIVE MODE")
                async with _running(anext(client.events(since=0))) as follower:
                    await _read_held(admin)
                    async with asyncio.timeout(scaled(5)):
                        await client.close()
                        with pytest.raises(ClientClosed):
                            await follower
        finally:
            await client.close()

    async def test_close_returns_at_once_while_the_backend_is_stopped(
        self, app_dsn: str, admin: asyncpg.Connection, postgres_server: PostgresServer
    ) -> None:
        """A listening connection whose server stopped answering: close() does not wait for it
        (nor for the health check) and every later follower of the client raises."""
        client = await Client.connect(named(app_dsn, FOLLOWER))
        try:
            events = client.events(since=0, health_interval=QUIET)
            async with _running(anext(events)) as follower:
                pid = await _listening_backend(admin)
                with _stopped(postgres_server, pid):
                    async with asyncio.timeout(scaled(5)):
                        await client.close()
                        with pytest.raises(ClientClosed):
                            await follower
            with pytest.raises(ClientClosed):
                await client.wait_ready("al_" + "0" * 32, timeout=5)
        finally:
            await client.close()

    async def test_an_applications_timeout_ends_a_stuck_read_and_the_pool_is_whole(
        self, app_dsn: str, admin: asyncpg.Connection
    ) -> None:
        """wait_ready's own timeout cancels a read held on a lock: it raises TimeoutError at
        its deadline, and the interrupted connection is terminated, not handed back."""
        async with await Client.connect(named(app_dsn, FOLLOWER)) as client:
            made = await client.request("fake")
            async with admin.transaction():
                await admin.execute("LOCK TABLE hubd_event_horizon IN ACCESS EXCLUSIVE MODE")
                with pytest.raises(TimeoutError, match="not ready after"):
                    async with asyncio.timeout(scaled(10)):
                        await client.wait_ready(made.id, timeout=scaled(1))
            assert (await client.get(made.id)).status == "pending"
            pool = client._pool
            assert pool.get_idle_size() == pool.get_size()

    async def test_a_follower_whose_pool_is_terminated_raises_client_closed(
        self, app_dsn: str, admin: asyncpg.Connection
    ) -> None:
        """A pool of the application's, terminated under a follower: the follower tries to
        reconnect, finds the pool closed, and raises rather than retry forever."""
        pool = await asyncpg.create_pool(named(app_dsn, FOLLOWER), min_size=1, max_size=2)
        try:
            client = Client(pool)
            events = client.events(since=0, health_interval=QUIET)
            async with _running(anext(events)) as follower:
                await _listening_backend(admin)
                pool.terminate()
                async with asyncio.timeout(scaled(5)):
                    with pytest.raises(ClientClosed, match="pool"):
                        await follower
        finally:
            pool.terminate()

    async def test_a_pool_closed_under_a_follower_closes_within_a_health_interval(
        self, app_dsn: str, admin: asyncpg.Connection
    ) -> None:
        """Pool.close() waits for the connections it lent: the follower gives its back at its
        next health check and raises ClientClosed."""
        interval = scaled(0.5)
        pool = await asyncpg.create_pool(named(app_dsn, FOLLOWER), min_size=1, max_size=2)
        try:
            client = Client(pool)
            events = client.events(since=0, health_interval=interval)
            async with _running(anext(events)) as follower:
                await _listening_backend(admin)
                async with asyncio.timeout(scaled(5)):
                    await pool.close()
                    with pytest.raises(ClientClosed, match="pool"):
                        await follower
        finally:
            pool.terminate()
