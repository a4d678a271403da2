"""The floor under a burst of warm takes: requests taking pool members with no daemon running.

    .venv/bin/python -m bench.takes [--size tiny|quick|mid|full] [--json takes.json]

On a fresh database, ``pool`` members are made ready by hand (no sidecar, no daemon), then
``pool`` requests matching them are sent at once on ``connections`` connections, each warmed up
by a take first, as an application's are. Each request is timed from the moment its connection
sends it to its answer (its statement and commit), and the burst from its first send to its
last answer; ``rounds`` bursts. What it shows is what the takes' own commits cost one another:
with the feed's lock and NOTIFY's taken at every take they flushed in turn (architecture §8, "A
take's events"). ``bench.pools`` measures the same burst with the daemon, to each ``ready``
event.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
import attrs

from bench import standalone
from bench.phases import PROVISIONER, percentile
from bench.procs import FarmClient
from bench.table import columns, number

__all__ = ["LOADS", "Load", "main", "measure", "render"]

SPEC = json.dumps({"pool": "takes"})
REQUEST = "SELECT id, warm FROM hubd_v1.request($1, spec => $2)"


@attrs.frozen(kw_only=True)
class Load:
    pool: int
    """Members, and requests in each burst."""
    connections: int = 32
    rounds: int = 3


LOADS = {
    "tiny": Load(pool=20, connections=4, rounds=1),
    "quick": Load(pool=200),
    "mid": Load(pool=500),
    "full": Load(pool=2_000),
}


async def _members(conn: asyncpg.Connection, count: int, label: str) -> None:
    await conn.execute(
        "INSERT INTO hubd_allocations (id, provisioner_id, spec, pool_id, status, "
        "connection_ready) SELECT 'al_' || $2 || '_' || g, $3, $4::jsonb, 'takes', "
        "'allocated', true FROM generate_series(1, $1) AS g",
        count,
        label,
        PROVISIONER,
        SPEC,
    )


async def _burst(pool: asyncpg.Pool, n: int) -> tuple[list[float], float, int]:
    """Each request's milliseconds, the burst's seconds, and how many took a member."""
    times: list[float] = []

    async def one() -> bool:
        async with pool.acquire() as conn:
            started = time.perf_counter()
            row = await conn.fetchrow(REQUEST, PROVISIONER, SPEC)
            times.append((time.perf_counter() - started) * 1000)
        assert row is not None
        return bool(row["warm"])

    started = time.perf_counter()
    warm = await asyncio.gather(*(one() for _ in range(n)))
    return times, time.perf_counter() - started, sum(warm)


async def measure(dsn: str, _farm: FarmClient, _workdir: Path, load: Load) -> dict[str, Any]:
    admin = await asyncpg.connect(dsn)
    pool = await asyncpg.create_pool(dsn, min_size=load.connections, max_size=load.connections)
    rounds: list[dict[str, Any]] = []
    try:
        await admin.execute(
            "INSERT INTO hubd_pools (pool_id, provisioner_id, spec, size, refill_rate) "
            "VALUES ('takes', $1, $2::jsonb, $3, 1)",
            PROVISIONER,
            SPEC,
            load.pool + load.connections,
        )
        await _members(admin, load.connections, "warm_up")
        connections = [await pool.acquire() for _ in range(load.connections)]
        for conn in connections:
            await conn.fetchrow(REQUEST, PROVISIONER, SPEC)
        for conn in connections:
            await pool.release(conn)
        for number_ in range(load.rounds):
            await _members(admin, load.pool, f"r{number_}")
            times, seconds, warm = await _burst(pool, load.pool)
            rounds.append(
                {
                    "p50_ms": statistics.median(times),
                    "p99_ms": percentile(times, 0.99),
                    "burst_ms": seconds * 1000,
                    "warm": warm,
                }
            )
    finally:
        await pool.close()
        await admin.close()
    return {
        "load": attrs.asdict(load),
        "rounds": rounds,
        "p50_ms": statistics.median(r["p50_ms"] for r in rounds),
        "p99_ms": statistics.median(r["p99_ms"] for r in rounds),
        "burst_ms": statistics.median(r["burst_ms"] for r in rounds),
        "warm": min(r["warm"] for r in rounds),
    }


MEASURES = (
    ("request p50, {pool} at once on {connections} connections", "p50_ms", "ms"),
    ("request p99", "p99_ms", "ms"),
    ("the whole burst, first send to last answer", "burst_ms", "ms"),
    ("requests that took a member (the fewest of a round)", "warm", ""),
)


def render(result: dict[str, Any]) -> str:
    """The table of a ``measure`` result, the medians of its rounds."""
    lines = [("measure", "unit", "value")]
    for label, key, unit in MEASURES:
        value = result[key]
        shown = str(value) if isinstance(value, int) else number(value)
        lines.append((label.format(**result["load"]), unit, shown))
    return "\n".join(columns(lines, right=(2,)))


def main(argv: list[str] | None = None) -> int:
    return standalone.main(
        argv, part="takes", doc=__doc__, sizes=LOADS, measure=measure, render=render
    )


if __name__ == "__main__":
    sys.exit(main())
