"""Connection writes racing each other inside PostgreSQL: one replica's statement holds the
allocation's row lock, uncommitted, while another replica's statement starts and blocks on it.
What the second decides once the first commits is read back from the rows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg

from hubd.routing import Target
from hubd.store import AllocationStore, Database, Status
from hubd.store.connections import SQL as CONNECTION_SQL
from hubd.store.connections import ConnectionStore
from hubd.store.instances import InstanceStore
from tests.polling import eventually
from tests.wskit import record_row, sidecar_in


@asynccontextmanager
async def record_held_open(
    database_url: str, connection_id: str, target: Target, sidecar_id: str, instance: str
) -> AsyncIterator[asyncpg.Connection]:
    """Replica ``instance`` records ``connection_id`` in a transaction left open (the row lock
    held) until the block ends, then commits."""
    conn = await asyncpg.connect(database_url)
    try:
        async with conn.transaction():
            record = CONNECTION_SQL.record(
                connection_id=connection_id,
                allocation_id=target.allocation_id,
                generation=target.generation,
                sidecar_id=sidecar_id,
                instance_id=instance,
            )
            row = await conn.fetchrow(record.sql, *record.args)
            assert row["seq"] is not None
            yield conn
    finally:
        await conn.close()


async def blocked_on_a_lock(database_url: str) -> None:
    """Wait until some other session is waiting for a row lock (the statement under test)."""
    conn = await asyncpg.connect(database_url)
    try:

        async def waiting() -> bool:
            n = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
            return bool(n)

        await eventually(waiting, within=10, what="a statement waiting on the row lock")
    finally:
        await conn.close()


class TestRacingStatements:
    async def test_repair_blocked_behind_a_connect_does_not_mark_it_lost(
        self, db: Database, database_url: str, store: AllocationStore
    ) -> None:
        """A repair sweep that found no live record, then waited on the row lock of a connect
        being recorded on another replica, writes nothing once that connect commits: the
        connection number it was fenced on moved."""
        await InstanceStore(db).register("in_a", "a", 1, None)
        sidecar, fence = await sidecar_in(store, db)
        seen = await ConnectionStore(db, instance_id="in_a").readiness(sidecar.target, 20)
        ready = await store.mark_connection_ready(fence, connection_seq=seen.connection_seq)
        assert ready is not None
        assert ready.ready  # reads ready with no record at all: a repair candidate
        async with record_held_open(
            database_url, "cn_b", sidecar.target, sidecar.sidecar_id, "in_a"
        ):
            repair = asyncio.create_task(
                store.mark_unconnected(instance_ttl=20, connect_timeout=60)
            )
            await blocked_on_a_lock(database_url)
            assert not repair.done()
        assert await repair == 0
        after = await store.get(sidecar.allocation_id)
        assert after.ready
        assert after.connection_seq == ready.connection_seq + 1

    async def test_reassert_blocked_behind_a_takeover_leaves_the_new_record(
        self, db: Database, database_url: str, store: AllocationStore
    ) -> None:
        """Replica A writing back its swept record while the sidecar's new socket is being
        recorded on replica B: once B commits, A writes nothing (the newer record stays) and is
        told so, so it closes its socket instead of stealing the record back."""
        instances = InstanceStore(db)
        await instances.register("in_a", "a", 1, None)
        await instances.register("in_b", "b", 2, None)
        sidecar, _ = await sidecar_in(store, db)
        a = ConnectionStore(db, instance_id="in_a")
        assert (await a.record("cn_a", sidecar.target, sidecar.sidecar_id)).seq is not None
        async with db.pool.acquire() as conn:  # a peer's sweep removed A's record
            await conn.execute("DELETE FROM hubd_sidecar_connections WHERE connection_id = 'cn_a'")
        async with record_held_open(
            database_url, "cn_b", sidecar.target, sidecar.sidecar_id, "in_b"
        ):
            reassert = asyncio.create_task(a.reassert("cn_a", sidecar.target, sidecar.sidecar_id))
            await blocked_on_a_lock(database_url)
        assert await reassert is None
        record = await record_row(db, sidecar.allocation_id)
        assert record is not None
        assert (record["connection_id"], record["instance_id"]) == ("cn_b", "in_b")

    async def test_disconnect_blocked_behind_a_reconnect_changes_nothing(
        self, db: Database, database_url: str, store: AllocationStore
    ) -> None:
        """The close of A's socket, waiting on the lock of the sidecar's reconnect being
        recorded on B, clears nothing and marks nothing lost once B commits."""
        instances = InstanceStore(db)
        await instances.register("in_a", "a", 1, None)
        await instances.register("in_b", "b", 2, None)
        sidecar, fence = await sidecar_in(store, db)
        a = ConnectionStore(db, instance_id="in_a")
        record = await a.record("cn_a", sidecar.target, sidecar.sidecar_id)
        assert record.seq is not None
        ready = await store.mark_connection_ready(fence, connection_seq=record.seq)
        assert ready is not None
        async with record_held_open(
            database_url, "cn_b", sidecar.target, sidecar.sidecar_id, "in_b"
        ):
            disconnect = asyncio.create_task(
                a.disconnect(sidecar.allocation_id, "cn_a", connect_timeout=60)
            )
            await blocked_on_a_lock(database_url)
        assert await disconnect is False
        after = await store.get(sidecar.allocation_id)
        assert after.ready
        assert after.status is Status.ALLOCATED
        kept = await record_row(db, sidecar.allocation_id)
        assert kept is not None
        assert kept["connection_id"] == "cn_b"
