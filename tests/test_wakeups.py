"""The wake-up listener's connection, as the store opens it (hubd.store.notifications.listen),
and what the listener makes of its failures. Real PostgreSQL; a port nobody answers on and a
server that accepts and never speaks stand in for the two ways a connect fails."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable

import asyncpg
import pytest
from structlog.testing import capture_logs

from hubd.daemon.wakeups import NotificationListener
from hubd.errors import DatabaseUnavailable
from hubd.store.channels import CONNECTED_CHANNEL, WAKE_CHANNEL
from hubd.store.database import Database
from hubd.store.notifications import listen
from tests.polling import eventually


def _refusing_url() -> str:
    """A URL whose port nobody listens on (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"postgresql://hubd@127.0.0.1:{port}/hubd"


@contextlib.asynccontextmanager
async def _silent_server() -> AsyncIterator[str]:
    """A URL whose server accepts and never says a word."""
    held: list[asyncio.StreamWriter] = []

    async def accept(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"postgresql://hubd@127.0.0.1:{port}/hubd"
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


class TestListen:
    async def test_notifications_arrive_and_a_lost_connection_is_told(
        self, database_url: str
    ) -> None:
        heard: list[tuple[str, str]] = []
        async with listen(
            database_url, (WAKE_CHANNEL, CONNECTED_CHANNEL), _on(heard), setup_timeout=10
        ) as lost:
            other = await asyncpg.connect(database_url)
            try:
                await other.execute("SELECT pg_notify($1, 'one')", WAKE_CHANNEL)
                await other.execute("SELECT pg_notify($1, 'two')", CONNECTED_CHANNEL)
                await other.execute("SELECT pg_notify('hubd_unheard', 'three')")
                await eventually(lambda: len(heard) == 2, what="the notifications")
                assert heard == [(WAKE_CHANNEL, "one"), (CONNECTED_CHANNEL, "two")]
                assert not lost.is_set()
                listeners = await other.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN%'"
                )
                assert listeners == 1
                await other.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE query LIKE 'LISTEN%'"
                )
                async with asyncio.timeout(10):
                    await lost.wait()
            finally:
                await other.close()

    async def test_the_connection_is_closed_when_the_block_ends(self, database_url: str) -> None:
        async with listen(database_url, (WAKE_CHANNEL,), _on([]), setup_timeout=10):
            pass
        other = await asyncpg.connect(database_url)
        try:

            async def listeners() -> int:
                count: int = await other.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN%'"
                )
                return count

            async def none_listening() -> bool:
                return await listeners() == 0

            await eventually(none_listening, within=30, every=0.1)
        finally:
            await other.close()

    async def test_a_refused_connect_is_an_outage(self) -> None:
        with pytest.raises(DatabaseUnavailable) as raised:
            async with listen(_refusing_url(), (WAKE_CHANNEL,), _on([]), setup_timeout=5):
                pytest.fail("listening on a refused connection")
        assert isinstance(raised.value.__cause__, OSError)

    async def test_a_connect_the_server_never_answers_is_given_up_at_the_setup_timeout(
        self,
    ) -> None:
        async with _silent_server() as url:
            loop = asyncio.get_running_loop()
            began = loop.time()
            with pytest.raises(DatabaseUnavailable):
                async with listen(url, (WAKE_CHANNEL,), _on([]), setup_timeout=0.5):
                    pytest.fail("listening on a silent server")
            assert loop.time() - began < 5


class TestListener:
    async def test_a_lost_connection_is_logged_in_the_drivers_words(self, db: Database) -> None:
        listener = NotificationListener(
            dsn=_refusing_url(),
            db=db,
            on_wake=lambda: None,
            on_connected=lambda _payload: None,
        )
        with capture_logs() as logs:
            task = asyncio.create_task(listener.run(), name="listener")
            try:
                await eventually(
                    lambda: any(e["event"] == "wake_listener_connection_lost" for e in logs),
                    what="the lost connection logged",
                )
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        lost = next(e for e in logs if e["event"] == "wake_listener_connection_lost")
        # The OS's account of the refusal, not the store's "database unavailable".
        assert "unavailable" not in lost["error"]
        assert lost["error"]
        assert not listener.healthy


def _on(heard: list[tuple[str, str]]) -> Callable[[str, str], None]:
    def on_notify(channel: str, payload: str) -> None:
        heard.append((channel, payload))

    return on_notify
