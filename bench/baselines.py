"""The anchors measured in the same run as hubd: a hand-written minimal lifecycle and PgQueuer.

The hand floor is what a lifecycle costs with nothing but the fences: a claim with a lease
(``FOR UPDATE SKIP LOCKED``) and then 7 fenced statements per allocation, each checking id,
lease id, generation and a live lease by the database clock and appending a ledger row in the
same statement, as hubd's transitions do: 8 commits per allocation, ``workers`` asyncpg
connections claiming in parallel. It runs on tables of its own in hubd's database.

PgQueuer (the optional ``bench`` extra) drains no-op jobs with batch size 1 in a database of
its own; it is skipped, with a note, when the package is not installed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import asyncpg

__all__ = ["hand_floor", "pgqueuer_drain"]

_FLOOR_SCHEMA = """
DROP TABLE IF EXISTS bench_floor_ledger;
DROP TABLE IF EXISTS bench_floor;
CREATE TABLE bench_floor (
    id               bigint PRIMARY KEY,
    status           text NOT NULL,
    generation       integer NOT NULL DEFAULT 1,
    lease_id         uuid,
    lease_expires_at timestamptz,
    next_attempt_at  timestamptz
);
CREATE INDEX bench_floor_due ON bench_floor (next_attempt_at, id)
    WHERE next_attempt_at IS NOT NULL;
CREATE TABLE bench_floor_ledger (
    seq        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    floor_id   bigint NOT NULL,
    generation integer NOT NULL,
    lease_id   uuid,
    to_status  text NOT NULL,
    at         timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""

_CLAIM = """
UPDATE bench_floor AS f SET lease_id = $1, lease_expires_at = now() + interval '60 seconds'
FROM (
    SELECT id FROM bench_floor
    WHERE next_attempt_at IS NOT NULL AND next_attempt_at <= now()
      AND (lease_expires_at IS NULL OR lease_expires_at <= now())
    ORDER BY next_attempt_at, id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
) AS due
WHERE f.id = due.id
RETURNING f.id, f.generation
"""

_FENCED = """
WITH updated AS (
    UPDATE bench_floor SET
        status = $4,
        generation = generation + $5,
        next_attempt_at = CASE WHEN $6 THEN NULL ELSE next_attempt_at END,
        lease_id = CASE WHEN $6 THEN NULL ELSE lease_id END,
        lease_expires_at = CASE WHEN $6 THEN NULL ELSE lease_expires_at END
    WHERE id = $1 AND lease_id = $2 AND generation = $3
      AND lease_expires_at > clock_timestamp()
    RETURNING id, generation
), logged AS (
    INSERT INTO bench_floor_ledger (floor_id, generation, lease_id, to_status)
    SELECT id, generation, $2, $4 FROM updated
)
SELECT generation FROM updated
"""

# (status, generation bump, final): bind, allocated, connected, ready, releasing (a new
# generation, as hubd's release), destroyed, released (lease dropped, off the queue).
_STEPS = (
    ("provisioning", 0, False),
    ("allocated", 0, False),
    ("connected", 0, False),
    ("ready", 0, False),
    ("releasing", 1, False),
    ("destroyed", 0, False),
    ("released", 0, True),
)


async def hand_floor(dsn: str, *, n: int, workers: int) -> dict[str, Any]:
    """Run ``n`` lifecycles on ``workers`` connections; allocations per second and commits."""
    setup = await asyncpg.connect(dsn)
    try:
        await setup.execute(_FLOOR_SCHEMA)
        await setup.execute(
            "INSERT INTO bench_floor (id, status, next_attempt_at) "
            "SELECT g, 'pending', now() FROM generate_series(1, $1) AS g",
            n,
        )
        await setup.execute("ANALYZE bench_floor")
        pool = await asyncpg.create_pool(dsn, min_size=workers, max_size=workers)
    finally:
        await setup.close()
    done = 0

    async def worker() -> None:
        nonlocal done
        async with pool.acquire() as conn:
            claim = await conn.prepare(_CLAIM)
            fenced = await conn.prepare(_FENCED)
            while True:
                lease = uuid.uuid4()
                row = await claim.fetchrow(lease)
                if row is None:
                    return
                generation = row["generation"]
                for status, bump, final in _STEPS:
                    generation = await fenced.fetchval(
                        row["id"], lease, generation, status, bump, final
                    )
                    if generation is None:
                        raise RuntimeError("the hand floor lost a lease it just took")
                done += 1

    try:
        started = time.monotonic()
        async with asyncio.TaskGroup() as group:
            for _ in range(workers):
                group.create_task(worker())
        seconds = time.monotonic() - started
    finally:
        await pool.close()
    if done != n:
        raise RuntimeError(f"the hand floor finished {done} of {n}")
    return {"n": n, "workers": workers, "seconds": seconds, "rate": n / seconds}


async def pgqueuer_drain(dsn: str, *, n: int) -> dict[str, Any]:
    """PgQueuer draining ``n`` no-op jobs with batch size 1; ``{"skipped": why}`` when absent."""
    try:
        from pgqueuer import PgQueuer
        from pgqueuer.db import AsyncpgDriver
        from pgqueuer.queries import Queries
        from pgqueuer.types import QueueExecutionMode
    except ImportError:
        return {"skipped": "pgqueuer is not installed (pip install -e '.[bench]')"}
    conn = await asyncpg.connect(dsn)
    try:
        driver = AsyncpgDriver(conn)
        queries = Queries(driver)
        # Each round starts from a fresh schema, as the first did.
        if await queries.schema_is_installed():
            await queries.uninstall()
        await queries.install()
        await queries.enqueue(["noop"] * n, [None] * n, [0] * n)
        pgq = PgQueuer(driver)
        handled = 0

        @pgq.entrypoint("noop")
        async def noop(job: Any) -> None:
            nonlocal handled
            del job
            handled += 1

        started = time.monotonic()
        await pgq.run(batch_size=1, mode=QueueExecutionMode.drain)
        seconds = time.monotonic() - started
    finally:
        await conn.close()
    if handled != n:
        raise RuntimeError(f"PgQueuer handled {handled} of {n} jobs")
    return {"n": n, "seconds": seconds, "rate": n / seconds}
