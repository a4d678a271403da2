"""What every session hubd opens carries, and when each pooled one was last used.

Every session gets, at its start and at no cost of a round trip:

- **TCP keepalives and ``TCP_USER_TIMEOUT``** on its socket, and the same asked of the server's
  end (:data:`SESSION_SETTINGS`), so a vanished peer is found by the kernel on both sides;
- settings that keep every prepared statement on its index whatever the statistics say;
- the refusal of a session that starts read-only (a standby, or a server set read-only), as
  asyncpg would take one under ``target_session_attrs=any``;
- JSON columns that round-trip as Python objects.

:class:`SessionUsage` remembers when each pooled session was last handed back, so that one idle
for :data:`QUIET_PERIOD` is checked before its next use
(:meth:`hubd.store.database.Database.connection`) and a busy one never is.
"""

from __future__ import annotations

import json
import socket
import time
import weakref
from typing import Any

import asyncpg

__all__ = [
    "QUIET_PERIOD",
    "SESSION_SETTINGS",
    "TCP_KEEPCNT",
    "TCP_KEEPIDLE",
    "TCP_KEEPINTVL",
    "TCP_USER_TIMEOUT_MS",
    "SessionUsage",
    "bound_silence",
    "init_connection",
    "session_of",
]


async def init_connection(conn: asyncpg.Connection) -> None:
    """Per-connection setup: keepalives on its socket; JSON columns round-trip as Python
    objects."""
    bound_silence(conn)
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


# A TCP peer that vanished (a host that died, a NAT or firewall that lost the connection's
# state) is found by the kernel: an idle connection after KEEPIDLE + KEEPCNT * KEEPINTVL
# seconds, one with unacknowledged data after USER_TIMEOUT. PostgreSQL's own end gets the same
# settings (SESSION_SETTINGS), so the server ends a dead hubd session and its locks too.
TCP_KEEPIDLE = 10
TCP_KEEPINTVL = 5
TCP_KEEPCNT = 3
TCP_USER_TIMEOUT_MS = 25_000


def bound_silence(conn: asyncpg.Connection) -> None:
    """Turn on keepalives and ``TCP_USER_TIMEOUT`` on ``conn``'s socket (TCP only: a Unix
    socket has no silent peer). asyncpg takes no socket options, so they are set on the
    connected socket, which it exposes only through its transport."""
    transport = getattr(conn, "_transport", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", TCP_KEEPIDLE),
        ("TCP_KEEPINTVL", TCP_KEEPINTVL),
        ("TCP_KEEPCNT", TCP_KEEPCNT),
        ("TCP_USER_TIMEOUT", TCP_USER_TIMEOUT_MS),
    ):
        option = getattr(socket, name, None)
        if option is not None:  # Linux has them all; other platforms some
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


# Every statement hubd runs is a prepared, parameterised one that finds its rows by key or by a
# partial index; PostgreSQL's default would plan most of them afresh on every execution (a custom
# plan is never costed above the generic one for these), and planning cost more than running.
# A generic plan is made per connection from the statistics of that moment, and kept as long as
# asyncpg caches the statement (five minutes). After a quiet spell the statistics say there are
# almost no active rows, and a burst of them then met sequential scans of the connection
# records, the reconnect secrets and the allocations themselves (identity look-ups, the park's
# look at the record): the CPU of a whole lifecycle run varied by 60% with when each connection
# planned. With sequential scans off, each of those statements takes its index; a statement no
# index serves still scans (docs/performance.md, "Plans that do not depend on the statistics").
SESSION_SETTINGS = {
    "plan_cache_mode": "force_generic_plan",
    "enable_seqscan": "off",
    # The server's end of the keepalives (see bound_silence); ignored on Unix sockets.
    "tcp_keepalives_idle": str(TCP_KEEPIDLE),
    "tcp_keepalives_interval": str(TCP_KEEPINTVL),
    "tcp_keepalives_count": str(TCP_KEEPCNT),
    "tcp_user_timeout": str(TCP_USER_TIMEOUT_MS),
}


QUIET_PERIOD = 10.0
"""Seconds a pooled connection may sit unused before it is checked before its next use."""


class SessionUsage:
    """When each pooled connection was last handed back (or opened), to tell the quiet ones."""

    def __init__(self) -> None:
        self._last: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()

    async def opened(self, conn: asyncpg.Connection) -> None:
        """The pools' ``init`` hook: a session that starts read-only is refused here too (with
        ``target_session_attrs=any`` asyncpg would take it), from the settings the server
        reports at startup, so at no cost of a round trip."""
        settings = conn.get_settings()
        for name in ("default_transaction_read_only", "in_hot_standby"):
            if getattr(settings, name, "off") == "on":
                raise asyncpg.ReadOnlySQLTransactionError(f"session opened with {name} on")
        await init_connection(conn)
        self._last[conn] = time.monotonic()

    def used(self, pooled: asyncpg.Connection) -> None:
        raw = session_of(pooled)
        if raw is not None:
            self._last[raw] = time.monotonic()

    def quiet(self, pooled: asyncpg.Connection) -> bool:
        raw = session_of(pooled)
        last = self._last.get(raw) if raw is not None else None
        return last is None or time.monotonic() - last >= QUIET_PERIOD


def session_of(pooled: asyncpg.Connection) -> Any:
    """The connection behind ``pooled``: a pool hands out a proxy made anew on each acquire,
    and the connection behind it is the one thing that lives as long as the session (asyncpg
    names it nowhere public)."""
    return getattr(pooled, "_con", pooled)
