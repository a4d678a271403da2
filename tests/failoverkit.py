"""hubd's database on the primary and streaming standby of :mod:`tests.pgcluster`, and the steps
of a failover that the suite (tests/test_failover_daemon.py) and bench.failover both take."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import asyncpg

from hubd.store.migrate import apply_migrations
from tests.pgcluster import Cluster

DATABASE = "hubd"


async def create_database(ha: Cluster) -> None:
    """:data:`DATABASE` on the primary, migrated."""
    conn = await asyncpg.connect(ha.maintenance(ha.primary))
    try:
        await conn.execute(f"CREATE DATABASE {DATABASE}")
    finally:
        await conn.close()
    conn = await asyncpg.connect(ha.url(DATABASE, ha.primary))
    try:
        await apply_migrations(conn)
    finally:
        await conn.close()


@asynccontextmanager
async def replay_check(ha: Cluster) -> AsyncIterator[Callable[[], Awaitable[bool]]]:
    """A check that the standby has replayed everything the primary had written when the block
    began. Replication is asynchronous: without that wait a crash could lose the last commits
    (docs/operations.md), which no failover here sets out to show."""
    primary = await asyncpg.connect(ha.maintenance(ha.primary))
    standby = await asyncpg.connect(ha.maintenance(ha.standby))
    try:
        target = await primary.fetchval("SELECT pg_current_wal_lsn()")

        async def caught_up() -> bool:
            return bool(
                await standby.fetchval("SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn", target)
            )

        yield caught_up
    finally:
        await primary.close()
        await standby.close()


async def end_sessions(maintenance: str) -> None:
    """End every session on :data:`DATABASE` of the server ``maintenance`` names."""
    conn = await asyncpg.connect(maintenance)
    try:
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = $1 AND pid <> pg_backend_pid()",
            DATABASE,
        )
    finally:
        await conn.close()
