"""The database fails over, partitions or turns read-only, and hubd follows by itself
(docs/operations.md): real PostgreSQL servers, a real TCP proxy that holds or drops traffic."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import tempfile
import time
import types
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import cast

import asyncpg
import pytest
from structlog.testing import capture_logs

import hubd.daemon.heartbeat as heartbeat_module
import hubd.daemon.wakeups as wakeups_module
import hubd.store.database as database_module
import hubd.store.notifications as notifications_module
import hubd.store.sessions as sessions_module
from hubd.daemon.heartbeat import Heartbeat
from hubd.daemon.metrics import Metrics
from hubd.daemon.running import Listening
from hubd.daemon.wakeups import NotificationListener
from hubd.dburl import connect_options, host_labels, hosts_problem
from hubd.errors import DatabaseReadOnly, DatabaseUnavailable
from hubd.store import AllocationStore, Database, connect_database
from hubd.store.database import try_hosts
from hubd.store.embedded import EmbeddedPostgres
from hubd.store.instances import InstanceStore
from hubd.store.migrate import apply_migrations
from hubd.store.queries import Bound, Statement
from tests.conftest import PostgresServer, drop_database, fresh_database
from tests.polling import eventually
from tests.proxykit import Blackhole, blackhole, rewrite_hosts


async def _set_read_only(maintenance_dsn: str, database: str, on: bool) -> None:
    """``database`` read-only for every new session (``on``) or writable again; the sessions
    already open keep what they started with, as after a server's demotion and restart."""
    conn = await asyncpg.connect(maintenance_dsn)
    try:
        if on:
            await conn.execute(f"ALTER DATABASE {database} SET default_transaction_read_only = on")
        else:
            await conn.execute(f"ALTER DATABASE {database} RESET default_transaction_read_only")
    finally:
        await conn.close()


async def _end_sessions(maintenance_dsn: str, database: str) -> None:
    conn = await asyncpg.connect(maintenance_dsn)
    try:
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = $1 AND pid <> pg_backend_pid()",
            database,
        )
    finally:
        await conn.close()


async def _count(dsn: str, provisioner_id: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM hubd_allocations WHERE provisioner_id = $1",
                provisioner_id,
            )
        )
    finally:
        await conn.close()


# A write that touches nothing: refused all the same by a read-only transaction.
_TOUCH = "UPDATE hubd_allocations SET status = status WHERE false"


async def _server_read_only(maintenance_dsn: str, on: bool) -> None:
    """The whole server read-only for every session, open ones included (at their next
    statement after the reload), or writable again."""
    conn = await asyncpg.connect(maintenance_dsn)
    try:
        if on:
            await conn.execute("ALTER SYSTEM SET default_transaction_read_only = on")
        else:
            await conn.execute("ALTER SYSTEM RESET default_transaction_read_only")
        await conn.execute("SELECT pg_reload_conf()")
    finally:
        await conn.close()


async def _gone(maintenance_dsn: str, pid: int) -> bool:
    conn = await asyncpg.connect(maintenance_dsn)
    try:
        return not await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)", pid
        )
    finally:
        await conn.close()


def _name(dsn: str) -> str:
    return urllib.parse.urlsplit(dsn).path.lstrip("/")


class TestHostList:
    def test_a_url_without_target_session_attrs_asks_for_a_writable_server(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """libpq's default would take a standby listed first; hubd asks for read-write."""
        monkeypatch.delenv("PGTARGETSESSIONATTRS", raising=False)
        assert connect_options("postgresql://u@a,b/hubd") == {"target_session_attrs": "read-write"}
        assert connect_options("postgresql://u@a/hubd?target_session_attrs=any") == {}
        monkeypatch.setenv("PGTARGETSESSIONATTRS", "primary")
        assert connect_options("postgresql://u@a,b/hubd") == {}

    @pytest.mark.parametrize(
        ("url", "fragment"),
        [
            ("postgresql://u@a,,b/hubd", "empty host"),
            ("postgresql://u@a,b/hubd?target_session_attrs=standby", "would pick a standby"),
            ("postgresql://u@a/hubd?target_session_attrs=read-only", "would pick a standby"),
            ("postgresql://u@a/hubd?target_session_attrs=rw", "must be read-write"),
            (
                "postgresql://u@a/hubd?target_session_attrs=any&target_session_attrs=any",
                "more than once",
            ),
        ],
    )
    def test_a_broken_host_list_or_target_is_named(self, url: str, fragment: str) -> None:
        problem = hosts_problem(url)
        assert problem is not None
        assert fragment in problem

    @pytest.mark.parametrize("target", ["read-write", "primary", "any"])
    def test_writable_targets_pass(self, target: str) -> None:
        assert (
            hosts_problem(f"postgresql://u:pw@a:5432,b:5433/hubd?target_session_attrs={target}")
            is None
        )

    def test_host_labels_carry_no_credentials(self) -> None:
        assert host_labels("postgresql://u:secret@a:5432,b:5433/hubd") == ["a:5432", "b:5433"]


@pytest.fixture(scope="module")
def second_server() -> Iterator[str]:
    """A second PostgreSQL server (the embedded one, in a directory of its own): the other
    host of a two-host URL. Yields its maintenance DSN."""
    tmp = tempfile.mkdtemp(prefix="hubd-f")
    server = EmbeddedPostgres(Path(tmp))
    try:
        maintenance = server.start()
    except Exception as exc:  # noqa: BLE001 -- no second server, no test
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.skip(f"a second embedded PostgreSQL would not start: {exc}")
    try:
        yield maintenance
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
async def twin(second_server: str, database_url: str) -> AsyncIterator[str]:
    """The test's database on the second server too, migrated, under the same name."""
    name = _name(database_url)
    maintenance = PostgresServer(maintenance_dsn=second_server, template="", embedded=None)
    dsn = await fresh_database(maintenance, name)
    conn = await asyncpg.connect(dsn)
    try:
        await apply_migrations(conn)
    finally:
        await conn.close()
    try:
        yield dsn
    finally:
        await drop_database(maintenance, name)


class TestReadOnlyServer:
    async def test_a_session_the_server_turned_read_only_is_closed(
        self, twin: str, second_server: str
    ) -> None:
        """A server set read-only under open sessions (``ALTER SYSTEM`` and a reload): the
        write it refuses closes its connection rather than return it to the pool, and the
        error says read-only."""
        db = await connect_database(twin)
        try:
            async with db.connection("look") as conn:
                await conn.execute(_TOUCH)
                pid = conn.get_server_pid()
            await _server_read_only(second_server, True)

            async def reloaded() -> bool:
                # The reload reaches each session in its own time: wait until this one has it.
                async with db.connection("look") as conn:
                    assert conn.get_server_pid() == pid
                    return bool(await conn.fetchval("SHOW default_transaction_read_only") == "on")

            await eventually(reloaded, what="the open session read-only")
            handed: list[int] = []

            async def write() -> None:
                async with db.connection("write") as conn:
                    handed.append(conn.get_server_pid())
                    await conn.execute(_TOUCH)

            with pytest.raises(DatabaseReadOnly):
                await write()
            assert handed == [pid]  # the pool handed out its last one
            await eventually(lambda: _gone(second_server, pid), what="the session closed")
        finally:
            await _server_read_only(second_server, False)
            await db.close()

    async def test_by_default_a_read_only_server_is_refused_at_connect(
        self, database_url: str, postgres_server: PostgresServer
    ) -> None:
        """No host that takes writes: the connect says so rather than hand out read-only
        sessions."""
        await _set_read_only(postgres_server.maintenance_dsn, _name(database_url), True)
        with pytest.raises(DatabaseReadOnly):
            await connect_database(database_url)

    async def test_the_pools_follow_the_writable_host_of_the_list(
        self, database_url: str, postgres_server: PostgresServer, twin: str, second_server: str
    ) -> None:
        """Two hosts, no ``target_session_attrs``: the read-only one listed first is skipped;
        when the writable one turns read-only and drops its sessions (a demotion), the pools
        reconnect to the other, which was promoted meanwhile."""
        name = _name(database_url)
        await _set_read_only(second_server, name, True)
        async with blackhole(twin) as b, blackhole(database_url) as a:
            url = rewrite_hosts(database_url, [f"127.0.0.1:{b.port}", f"127.0.0.1:{a.port}"])
            db = await connect_database(url)
            try:
                store = AllocationStore(db, instance_id="in_test")
                await store.request(provisioner_id="first")
                assert await _count(database_url, "first") == 1
                assert await _count(twin, "first") == 0

                await _set_read_only(second_server, name, False)
                await _set_read_only(postgres_server.maintenance_dsn, name, True)
                await _end_sessions(postgres_server.maintenance_dsn, name)

                failures: list[str] = []

                async def wrote() -> bool:
                    try:
                        await store.request(provisioner_id="second")
                    except DatabaseUnavailable as exc:
                        failures.append(type(exc).__name__)
                        return False
                    return True

                await eventually(wrote, within=20, every=0.1, what="a write on the other host")
                assert await _count(twin, "second") == 1
                assert await _count(database_url, "second") == 0
                # One failed statement per connection that was open, not a loop.
                assert len(failures) <= 2 * database_module.connections_opened(10)
            finally:
                await db.close()

    async def test_each_host_is_named_with_what_it_answered(
        self, database_url: str, postgres_server: PostgresServer, twin: str, second_server: str
    ) -> None:
        await _set_read_only(second_server, _name(database_url), True)
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        refused = closed.getsockname()[1]
        closed.close()
        async with blackhole(twin) as b, blackhole(database_url) as a:
            url = rewrite_hosts(
                database_url,
                [f"127.0.0.1:{b.port}", f"127.0.0.1:{refused}", f"127.0.0.1:{a.port}"],
            )
            answers = await try_hosts(url, within=5)
        assert answers == [
            f"127.0.0.1:{b.port}: read-only (default_transaction_read_only)",
            f"127.0.0.1:{refused}: refused",
            f"127.0.0.1:{a.port}: writable",
        ]


@pytest.fixture
async def proxy(database_url: str) -> AsyncIterator[Blackhole]:
    async with blackhole(database_url) as running:
        yield running


@pytest.fixture
async def proxied(proxy: Blackhole, database_url: str) -> AsyncIterator[Database]:
    db = await connect_database(proxy.url(database_url), pool_size=2)
    try:
        yield db
    finally:
        db.terminate()


class TestSilence:
    async def test_connections_carry_keepalives(self, proxied: Database) -> None:
        async with proxied.connection("look") as conn:
            sock = conn._con._transport.get_extra_info("socket")  # type: ignore[attr-defined]
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 10
            user_timeout = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
            assert user_timeout == sessions_module.TCP_USER_TIMEOUT_MS
            # The server's end is asked for too; it reads 0 here only because the proxy
            # reaches the server over its Unix socket, so look at who set it.
            sources = await conn.fetch(
                "SELECT name, source FROM pg_settings WHERE name LIKE 'tcp_%' ORDER BY name"
            )
            assert {row["name"]: row["source"] for row in sources} == dict.fromkeys(
                (
                    "tcp_keepalives_count",
                    "tcp_keepalives_idle",
                    "tcp_keepalives_interval",
                    "tcp_user_timeout",
                ),
                "client",
            )

    async def test_a_statement_the_network_swallowed_frees_its_caller_at_its_budget(
        self, proxied: Database, proxy: Blackhole
    ) -> None:
        """asyncpg would send a CancelRequest (through the same dead network) and hold the
        release until it is acknowledged; the connection is closed instead."""
        await proxied.fetchval("warm", _select(1))
        proxy.drop()

        async def budgeted() -> None:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5):
                    await proxied.fetchval("swallowed", _select(2))

        # A deadline for the test, far beyond the budget: the old behaviour never returns.
        async with asyncio.timeout(15):
            await budgeted()
        proxy.heal()
        assert await proxied.fetchval("after", _select(3)) == 3

    async def test_an_idle_connection_the_network_lost_is_replaced_before_use(
        self, proxied: Database, proxy: Blackhole, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """After a quiet period a pooled connection answers a short check first; a dead one
        is closed and a new one opened, with no budget needed from the caller."""
        before = await proxied.fetchval("pid", _pid())
        proxy.drop()
        proxy.heal()  # the old connections stay dead, new ones pass
        monkeypatch.setattr(sessions_module, "QUIET_PERIOD", 0.0)
        async with asyncio.timeout(15):
            after = await proxied.fetchval("pid", _pid(), pool=database_module.Pool.MAIN)
        assert after != before

    async def test_a_busy_connection_is_not_checked(self, proxied: Database) -> None:
        """No extra round trip on the hot path: within the quiet period a connection goes
        straight to its statement."""
        await proxied.fetchval("warm", _select(1))
        async with proxied.connection("count") as conn:
            before = conn.get_settings()  # any attribute: the proxy is live
            assert before is not None
            counted = conn._con._protocol.queries_count  # type: ignore[attr-defined]
        await proxied.fetchval("again", _select(2))
        async with proxied.connection("count") as conn:
            assert conn._con._protocol.queries_count == counted + 1  # type: ignore[attr-defined]

    async def test_the_listener_notices_a_partition_and_listens_again_after_it(
        self, proxied: Database, proxy: Blackhole, database_url: str
    ) -> None:
        """The self-check is not held by a cancellation in flight: it fails within its timeout
        during the partition, and the listener listens again once the network heals."""
        missed: list[None] = []
        connected: list[str] = []
        listener = NotificationListener(
            dsn=proxy.url(database_url),
            db=proxied,
            on_wake=lambda: None,
            on_connected=connected.append,
            selfcheck_interval=0.3,
            selfcheck_timeout=0.5,
            on_selfcheck_failure=lambda: missed.append(None),
        )
        task = asyncio.create_task(listener.run(), name="listener")
        try:
            await eventually(lambda: listener.healthy, what="listening")
            proxy.drop()
            await eventually(lambda: bool(missed), within=15, what="a missed self-check")
            await eventually(lambda: not listener.healthy, what="the listener down")
            proxy.heal()
            await eventually(lambda: listener.healthy, within=30, what="listening again")
            conn = await asyncpg.connect(database_url)
            try:
                await conn.execute("SELECT pg_notify('hubd_connected', 'after-heal')")
            finally:
                await conn.close()
            await eventually(lambda: "after-heal" in connected, what="the notice")
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


class TestRecycle:
    async def test_a_recycled_listener_listens_again_at_once(
        self, proxied: Database, proxy: Blackhole, database_url: str
    ) -> None:
        """After an outage the daemon recycles its LISTEN connection rather than wait for the
        self-check (a minute away here): a recycle ends whatever the listener is doing, a
        connect that hangs on a dead network included (its own timeout is 10 s)."""
        connected: list[str] = []
        reconnects: list[None] = []
        listener = NotificationListener(
            dsn=proxy.url(database_url),
            db=proxied,
            on_wake=lambda: None,
            on_connected=connected.append,
            on_reconnected=lambda: reconnects.append(None),
            selfcheck_interval=60,
        )
        task = asyncio.create_task(listener.run(), name="listener")
        try:
            await eventually(lambda: listener.healthy, what="listening")
            proxy.drop()
            listener.recycle()  # its new connect is swallowed by the dead network
            await eventually(lambda: not listener.healthy, what="the old connection dropped")
            proxy.heal()
            listener.recycle()
            await eventually(lambda: len(reconnects) == 2, within=5, what="listening again")
            conn = await asyncpg.connect(database_url)
            try:
                await conn.execute("SELECT pg_notify('hubd_connected', 'after-recycle')")
            finally:
                await conn.close()
            await eventually(lambda: "after-recycle" in connected, what="the notice")
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


class TestListenerSetup:
    async def test_the_listen_session_bounds_the_servers_end_too(
        self,
        proxied: Database,
        proxy: Blackhole,
        database_url: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """The LISTEN connection asks the server for the pools' keepalives and user timeout,
        so a backend whose hubd vanished is ended by the server too."""
        sources: dict[str, str] = {}

        async def looked_at(conn: asyncpg.Connection) -> None:
            rows = await conn.fetch(
                "SELECT name, source FROM pg_settings WHERE name LIKE 'tcp_%' ORDER BY name"
            )
            sources.update({row["name"]: row["source"] for row in rows})
            await sessions_module.init_connection(conn)

        monkeypatch.setattr(notifications_module, "init_connection", looked_at)
        listener = _listener(proxy.url(database_url), proxied)
        task = asyncio.create_task(listener.run(), name="listener")
        try:
            await eventually(lambda: listener.healthy, what="listening")
        finally:
            await _cancelled(task)
        assert sources == dict.fromkeys(
            (
                "tcp_keepalives_count",
                "tcp_keepalives_idle",
                "tcp_keepalives_interval",
                "tcp_user_timeout",
            ),
            "client",
        )

    async def test_a_setup_the_network_swallowed_is_given_up(
        self,
        proxied: Database,
        proxy: Blackhole,
        database_url: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """A connection whose connect answered but whose LISTEN the network swallowed is given
        up at LISTEN_SETUP_TIMEOUT and another one made, with no recycle from outside (the old
        listener waited for the dead network for as long as it lasted)."""
        monkeypatch.setattr(wakeups_module, "LISTEN_SETUP_TIMEOUT", 1.0)
        swallowed: list[None] = []

        async def dropped_after_connect(conn: asyncpg.Connection) -> None:
            if not swallowed:
                swallowed.append(None)
                proxy.drop()  # this connection is dead for good from here on
                proxy.heal()  # and the next one passes
            await sessions_module.init_connection(conn)

        monkeypatch.setattr(notifications_module, "init_connection", dropped_after_connect)
        reconnects: list[None] = []
        listener = _listener(
            proxy.url(database_url), proxied, on_reconnected=lambda: reconnects.append(None)
        )
        task = asyncio.create_task(listener.run(), name="listener")
        try:
            with capture_logs() as logs:
                await eventually(lambda: listener.healthy, within=15, what="listening")
        finally:
            await _cancelled(task)
        assert swallowed == [None]
        assert reconnects == [None]
        assert "wake_listener_connection_lost" in [entry["event"] for entry in logs]


class TestHeartbeat:
    async def test_the_first_beat_after_a_heal_comes_at_once_whatever_the_report_waits_for(
        self,
        proxied: Database,
        proxy: Blackhole,
        database_url: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """While beats fail on a network that swallows packets, the report of what each host
        answers waits beside them, never before the next beat: here the report never ends,
        and still the first beat after the heal comes within the beat's budget plus
        FAILING_RETRY_CAP, makes the instance alive again and recycles the listener. The
        report, about an outage that is over, is ended then."""
        reporting = asyncio.Event()
        report_cancelled: list[None] = []

        async def hosts_that_never_answer(_url: str, *, within: float) -> list[str]:
            reporting.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                report_cancelled.append(None)
                raise
            raise AssertionError("unreachable")

        monkeypatch.setattr(heartbeat_module, "try_hosts", hosts_that_never_answer)
        instances = InstanceStore(proxied)
        instance_id = "in_heartbeat_test"
        await instances.register(instance_id, "host", 1, None, [])
        recovered: list[float] = []
        interval = 1.0
        heartbeat = Heartbeat(
            cast(
                "Listening",
                types.SimpleNamespace(
                    db=proxied,
                    dsn=proxy.url(database_url),
                    instance_id=instance_id,
                    instances=instances,
                ),
            ),
            hub_ws_url="ws://127.0.0.1:1",
            provisioner_ids=[],
            metrics=Metrics(),
            interval=interval,
            ttl=5.0,
            verify_soon=asyncio.Event(),
            on_recovered=lambda: recovered.append(time.monotonic()),
        )
        task = asyncio.create_task(heartbeat.run(), name="heartbeat")
        try:
            proxy.drop()
            async with asyncio.timeout(15):
                await reporting.wait()
            proxy.heal()
            healed = time.monotonic()
            await eventually(lambda: bool(recovered), within=15, what="a beat after the heal")
            await eventually(lambda: bool(report_cancelled), what="the report ended")
        finally:
            await _cancelled(task)
        took = recovered[0] - healed
        # The beat in flight at the heal may be on a dead connection: its budget, then the
        # pause, then a beat of its own, with room for a loaded machine.
        assert took < interval + heartbeat_module.FAILING_RETRY_CAP + 2.0, took
        assert report_cancelled == [None]


def _select(value: int) -> Bound:
    return Bound(
        Statement(source="test", name="select", sql="SELECT $1::int", params=("v",)), (value,)
    )


def _pid() -> Bound:
    return Bound(Statement(source="test", name="pid", sql="SELECT pg_backend_pid()", params=()), ())


def _listener(
    dsn: str, db: Database, *, on_reconnected: Callable[[], None] = lambda: None
) -> NotificationListener:
    return NotificationListener(
        dsn=dsn,
        db=db,
        on_wake=lambda: None,
        on_connected=lambda _payload: None,
        on_reconnected=on_reconnected,
        selfcheck_interval=60,
    )


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
