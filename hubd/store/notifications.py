"""A connection of its own that LISTENs: how the daemon hears the channels of
:mod:`hubd.store.channels`.

Notifications arrive only on a connection that stays open, idle and subscribed, so the listener
cannot borrow a pooled one: it opens its own, with the pools' settings on both ends (keepalives
and ``TCP_USER_TIMEOUT``, :mod:`hubd.store.sessions`), so that a LISTEN backend whose hubd
vanished is ended rather than left to hold back the server's notification queue. What to do when
it is lost or silent (reconnect, poll, self-check) is the caller's: :mod:`hubd.daemon.wakeups`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from hubd.dburl import connect_options
from hubd.store.driver_errors import translate_errors
from hubd.store.sessions import SESSION_SETTINGS, init_connection

__all__ = ["listen"]


@asynccontextmanager
async def listen(
    dsn: str,
    channels: Iterable[str],
    on_notify: Callable[[str, str], None],
    *,
    setup_timeout: float,
) -> AsyncIterator[asyncio.Event]:
    """A new connection to ``dsn``, listening on ``channels`` for the block: each notification
    calls ``on_notify(channel, payload)``; the event yielded is set when the connection is lost.
    Each new connection is set up as the pools' are (``init_connection``, looked up at each
    connect, so a test can watch the set-up of each one).

    Connecting and subscribing take at most ``setup_timeout`` seconds, a connect that answered
    and a subscription the network swallowed included. Their driver errors, and a set-up past its
    time, raise :class:`~hubd.errors.StoreError` (:class:`~hubd.errors.DatabaseUnavailable` for
    an outage). The connection is closed when the block ends, whatever ends it.
    """
    conn: asyncpg.Connection | None = None

    def notified(_conn: Any, _pid: int, channel: str, payload: str) -> None:
        on_notify(channel, payload)

    try:
        lost = asyncio.Event()
        with translate_errors("listen for notifications"):
            async with asyncio.timeout(setup_timeout):
                conn = await asyncpg.connect(
                    dsn,
                    timeout=setup_timeout,
                    server_settings=SESSION_SETTINGS,
                    **connect_options(dsn),
                )
                await init_connection(conn)
                conn.add_termination_listener(lambda _conn: lost.set())
                for channel in channels:
                    await conn.add_listener(channel, notified)
        yield lost
    finally:
        if conn is not None:
            conn.terminate()
