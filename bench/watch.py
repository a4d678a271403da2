"""Watching allocations from outside the daemon, with the database clock of each change.

A trigger the benchmark installs on ``hubd_allocations`` notifies ``hubd_bench`` when a row
becomes ready, stops being ready, or reaches a terminal status; the payload carries the database
clock at the update. One LISTEN connection collects them. Listening is not free to count:
every notification wakes every listener of the database (the daemon's too), and each wake-up is
a transaction of that listener's that no statement shows, so a window whose commits are counted
mutes the watcher and polls instead (:func:`bench.phases.lifecycle`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg

__all__ = ["CHANNEL", "TRIGGER", "Watcher", "xact_commit"]

CHANNEL = "hubd_bench"

TRIGGER = """
CREATE OR REPLACE FUNCTION hubd_bench_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('hubd_bench', concat_ws(' ',
        CASE
            WHEN NEW.status IN ('released', 'failed', 'destroy_failed') THEN 'done'
            WHEN NEW.connection_ready THEN 'ready'
            ELSE 'lost'
        END,
        NEW.id, extract(epoch FROM clock_timestamp())));
    RETURN NULL;
END;
$$;
DROP TRIGGER IF EXISTS hubd_bench_notify ON hubd_allocations;
CREATE TRIGGER hubd_bench_notify AFTER UPDATE ON hubd_allocations FOR EACH ROW
    WHEN (NEW.connection_ready IS DISTINCT FROM OLD.connection_ready
          OR (NEW.status IS DISTINCT FROM OLD.status
              AND NEW.status IN ('released', 'failed', 'destroy_failed')))
    EXECUTE FUNCTION hubd_bench_notify();
"""


async def xact_commit(conn: asyncpg.Connection) -> int:
    """Committed transactions of this database so far, as the statistics system has them
    (a backend reports its counts at most once a second, and up to 10 s late when idle).
    One statement, so one transaction, with a statistics snapshot of its own."""
    value = await conn.fetchval(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
    )
    return int(value)


class Watcher:
    """Which allocations became ready, lost readiness or finished, and when (this process's
    ``time.time()`` on receipt, and the database clock of the update)."""

    def __init__(self) -> None:
        self.ready: dict[str, tuple[float, float]] = {}
        self.lost: set[str] = set()
        self.done: dict[str, tuple[float, float]] = {}
        self._conn: asyncpg.Connection | None = None
        self._changed = asyncio.Event()

    async def start(self, dsn: str) -> None:
        self._conn = await asyncpg.connect(dsn)
        await self._conn.execute(TRIGGER)
        await self._conn.add_listener(CHANNEL, self._on_notify)

    async def stop(self) -> None:
        if self._conn is not None:
            await self._conn.close()

    async def mute(self) -> None:
        """Stop listening and stop the trigger's notifications, for a window whose commits are
        counted: every notification wakes every listener of the database, the daemon's too,
        and each wake-up is a transaction of that listener's."""
        assert self._conn is not None
        await self._conn.remove_listener(CHANNEL, self._on_notify)
        await self._conn.execute(f"ALTER TABLE hubd_allocations DISABLE TRIGGER {CHANNEL}_notify")

    async def unmute(self) -> None:
        assert self._conn is not None
        await self._conn.execute(f"ALTER TABLE hubd_allocations ENABLE TRIGGER {CHANNEL}_notify")
        await self._conn.add_listener(CHANNEL, self._on_notify)

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        received = time.time()
        kind, allocation, at = payload.split(" ")
        if kind == "ready":
            self.ready[allocation] = (received, float(at))
            self.lost.discard(allocation)
        elif kind == "lost":
            self.ready.pop(allocation, None)
            self.lost.add(allocation)
        else:
            self.done[allocation] = (received, float(at))
            self.ready.pop(allocation, None)
            self.lost.discard(allocation)
        self._changed.set()

    def polled_ready(self, ids: list[str]) -> None:
        """Rows a poll found ready while the watcher was muted (no notification said so)."""
        now = time.time()
        for allocation in ids:
            self.ready[allocation] = (now, now)
            self.lost.discard(allocation)

    def reset(self) -> None:
        self.ready.clear()
        self.lost.clear()
        self.done.clear()

    async def until(self, condition: Any, *, within: float) -> bool:
        """Wait until ``condition()`` holds; ``False`` if ``within`` seconds pass first."""
        try:
            async with asyncio.timeout(within):
                while not condition():
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            return False
        return True
