"""Warm pools measured: a request answered by a member already connected, beside the cold path
in the same run, on the instant provisioner and on ``local``.

    .venv/bin/python -m bench.pools [--size tiny|quick|mid|full] [--json pools.json]

One ``hubd run`` (production defaults, the instant provisioner and the farm of ``python -m
bench``, and the ``local`` provisioner running ``hubd sidecar``) with two pools: ``pool``
members of the instant provisioner refilled at 250 a second, and ``local_pool`` of ``local``.
Every latency runs from the moment this process sends ``hubd_v1.request`` to the ``at`` of the
allocation's ``ready`` event (``clock_timestamp()`` in the commit that wrote it; the same system
clock as ``time.time()`` here), so it holds the request's statement, its commit and, for a cold
request, the whole provisioning.

0. **refill**: the pool's first fill, from its first member's ``created_at`` to ``pool``
   members ready, members a second (the local pool is then waited for: its processes' start
   would take the CPU from what follows).
1. **steady**: ``samples`` requests at ``rate`` a second matching the pool (warm), then as many
   not matching it (cold).
2. **burst**: ``pool`` requests at once against the full pool (32 connections, each warmed up
   by a request first, as an application's are).
3. **recovery**: twice ``pool`` requests at once (those the refill does not make in time miss
   and go cold), then requests at
   ``rate`` a second for ``recovery`` seconds (12): the first second from the burst's end whose
   p90 is back under the warm p99 goal, and when the pool was 90% full again (the stream keeps
   taking members meanwhile).
4. **local**: ``local_samples`` requests at 2 a second matching the ``local`` pool, then as
   many cold: real processes that must start and dial back.

Goals (issue 54): warm p50 ≤ 10 ms and p99 ≤ 40 ms at 100 requests a second; a burst of 500
against a pool of 500 p99 ≤ 100 ms; warm p90 back within 10 s of a burst of twice the pool;
refill ≥ 50 members a second. ``python -m bench`` runs it as its ``pools`` part.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import attrs

from bench import standalone
from bench.phases import PROVISIONER, daemon_config, percentile, say, vacuum
from bench.procs import DaemonProcess, FarmClient
from bench.table import columns, labels, lookup, number

__all__ = ["GOALS", "LOADS", "Load", "main", "measure", "measures", "render"]

WARM = {"pool": "bench"}
COLD = {"pool": "none"}
LOCAL = "local"
BURST_CONNECTIONS = 32
WARM_P99_GOAL = 40.0
REFILL_RATE = 250
"""The instant pool's refill_rate: above the steady stream's 100 a second, so the pool keeps
up with it, and paced, so that a burst's refill does not take the cores from the burst."""


@attrs.frozen(kw_only=True)
class Load:
    pool: int
    """Members of the instant provisioner's pool; the burst's size."""
    samples: int
    """Requests of the steady stream, warm and cold each."""
    rate: float
    local_pool: int
    local_samples: int
    recovery: float = 12.0
    """Seconds of requests at ``rate`` after the burst of twice the pool."""

    @property
    def sockets(self) -> int:
        """The most sidecars connected at once: every request of a phase, and the pools."""
        return 2 * self.samples + 4 * self.pool + round(self.rate * self.recovery) + 1_000


LOADS = {
    # For the smoke test: every figure, numbers meaningless.
    "tiny": Load(pool=20, samples=20, rate=100, local_pool=2, local_samples=2, recovery=2),
    "quick": Load(pool=200, samples=300, rate=100, local_pool=4, local_samples=4),
    "mid": Load(pool=500, samples=500, rate=100, local_pool=8, local_samples=8),
    "full": Load(pool=500, samples=1_000, rate=100, local_pool=8, local_samples=8),
}

POOLS = """
[[provisioners]]
id = "local"
plugin = "local"
[provisioners.options]
command = {command}
[[pools]]
id = "bench"
provisioner = "{provisioner}"
spec = {{ pool = "bench" }}
size = {pool}
refill_rate = {refill_rate}
[[pools]]
id = "local"
provisioner = "local"
spec = {{ pool = "local" }}
size = {local_pool}
refill_rate = 50
"""
READY_AT = (
    "SELECT allocation_id, extract(epoch FROM at)::float8 AS at FROM hubd_events "
    "WHERE allocation_id = ANY($1::text[]) AND event = 'ready'"
)
MEMBERS = (
    "SELECT count(*) FILTER (WHERE status = 'allocated' AND connection_ready) FROM "
    "hubd_allocations WHERE pool_id = $1 AND taken_at IS NULL"
)
REQUEST = "SELECT id, warm FROM hubd_v1.request($1, spec => $2)"


def _stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50_ms": statistics.median(values),
        "p90_ms": percentile(values, 0.90),
        "p99_ms": percentile(values, 0.99),
        "max_ms": max(values),
    }


async def _until(check: Callable[[], Awaitable[bool]], failure: str, within: float = 300) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise RuntimeError(failure)
        await asyncio.sleep(0.02)


class _Bench:
    def __init__(self, pool: asyncpg.Pool, stats: asyncpg.Connection) -> None:
        self.pool = pool
        self.stats = stats
        self.made: list[str] = []

    async def members(self, pool_id: str) -> int:
        # On the requests' pool, not ``stats``: the recovery counts members while the stream's
        # latencies are read on ``stats``, and one connection runs one statement at a time.
        ready: int = await self.pool.fetchval(MEMBERS, pool_id)
        return ready

    async def request(self, provisioner: str, spec: dict[str, str]) -> tuple[str, bool, float]:
        async with self.pool.acquire() as conn:
            started = time.time()
            row = await conn.fetchrow(REQUEST, provisioner, json.dumps(spec))
        assert row is not None
        self.made.append(row["id"])
        return row["id"], row["warm"], started

    async def latencies(self, sent: list[tuple[str, bool, float]]) -> list[float]:
        """Each request's start → its ``ready`` event, once every one is ready."""
        ids = [each[0] for each in sent]

        async def all_ready() -> bool:
            count: int = await self.stats.fetchval(
                "SELECT count(*) FROM hubd_events WHERE allocation_id = ANY($1::text[]) "
                "AND event = 'ready'",
                ids,
            )
            return count >= len(ids)

        await _until(all_ready, f"{len(ids)} requests were not all ready")
        at = {r["allocation_id"]: r["at"] for r in await self.stats.fetch(READY_AT, ids)}
        return [(at[i] - started) * 1000 for i, _, started in sent]

    async def stream(
        self, provisioner: str, spec: dict[str, str], n: int, rate: float
    ) -> list[tuple[str, bool, float]]:
        """``n`` requests, one every ``1 / rate`` seconds, each on its own."""
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def at(i: int) -> tuple[str, bool, float]:
            await asyncio.sleep(max(0.0, start + i / rate - loop.time()))
            return await self.request(provisioner, spec)

        return list(await asyncio.gather(*(at(i) for i in range(n))))

    async def warm_up(self, spec: dict[str, str]) -> None:
        """One request for ``spec`` on each connection, unmeasured: a backend's first request
        compiles the request's functions and plans its statements (a take's own, once it
        takes a member), as an application's long-lived connections did long before."""
        connections = [await self.pool.acquire() for _ in range(BURST_CONNECTIONS)]
        try:
            for conn in connections:
                row = await conn.fetchrow(REQUEST, PROVISIONER, json.dumps(spec))
                assert row is not None
                self.made.append(row["id"])
        finally:
            for conn in connections:
                await self.pool.release(conn)
        await self.release_all()

    async def burst(self, n: int) -> list[tuple[str, bool, float]]:
        return list(await asyncio.gather(*(self.request(PROVISIONER, WARM) for _ in range(n))))

    async def release_all(self) -> None:
        """Release what the requests here made, and wait until it has ended: the next
        measure starts on a quiet daemon. Members go with their pools (see measure)."""
        ids, self.made = self.made, []
        await self.stats.execute(
            "SELECT hubd_release_allocation(id, 'bench', NULL) FROM unnest($1::text[]) AS id",
            ids,
        )

        async def ended() -> bool:
            left: int = await self.stats.fetchval(
                "SELECT count(*) FROM hubd_allocations WHERE id = ANY($1::text[]) "
                "AND status NOT IN ('released', 'failed', 'destroy_failed')",
                ids,
            )
            return left == 0

        await _until(ended, f"{len(ids)} allocations released did not end")


async def measure(
    dsn: str, farm: FarmClient, workdir: Path, load: Load, *, root: Path | None = None
) -> dict[str, Any]:
    """Every figure on one fresh daemon (of the checkout ``root``; ``None``: this one)."""
    config = daemon_config(workdir / "hubd-pools.toml", database_url=dsn, claims=16,
                           state_dir=workdir / "state-pools", farm=farm.socket_path)  # fmt: skip
    command = json.dumps([sys.executable, "-m", "hubd.cli", "sidecar"])
    with config.open("a") as text:
        text.write(POOLS.format(command=command, provisioner=PROVISIONER, pool=load.pool,
                                local_pool=load.local_pool, refill_rate=REFILL_RATE))  # fmt: skip
    daemon = DaemonProcess(config, max_sockets=load.sockets, root=root)
    result: dict[str, Any] = {"load": attrs.asdict(load)}
    async with contextlib.AsyncExitStack() as undo:
        undo.push_async_callback(farm.call, "forget")
        stats = await asyncpg.connect(dsn)
        undo.push_async_callback(stats.close)
        await vacuum(stats)
        undo.push_async_callback(daemon.stop)
        await daemon.start()
        pool = await asyncpg.create_pool(
            dsn, min_size=BURST_CONNECTIONS, max_size=BURST_CONNECTIONS
        )
        undo.push_async_callback(pool.close)
        bench = _Bench(pool, stats)
        undo.push_async_callback(_wind_down, stats)
        await bench.warm_up(COLD)

        async def full() -> bool:
            return await bench.members("bench") >= load.pool

        await _until(full, "the pool was never full")
        filled_at = time.time()
        first = await stats.fetchval(
            "SELECT extract(epoch FROM min(created_at))::float8 FROM hubd_allocations "
            "WHERE pool_id = 'bench'"
        )
        result["refill"] = {
            "members": load.pool,
            "seconds": filled_at - first,
            "rate": load.pool / (filled_at - first),
        }

        async def local_full() -> bool:
            return await bench.members(LOCAL) >= load.local_pool

        # The local pool's processes start before anything is measured: they take the CPU.
        await _until(local_full, "the local pool was never full")
        await bench.warm_up(WARM)
        await _until(full, "the pool was not full again after the warm-up")
        say(f"pools: {load.samples} warm requests at {load.rate:g}/s, then as many cold")
        warm = await bench.stream(PROVISIONER, WARM, load.samples, load.rate)
        cold = await bench.stream(PROVISIONER, COLD, load.samples, load.rate)
        result["steady"] = {
            "warm": _stats(await bench.latencies(warm)) | {"hits": sum(w for _, w, _ in warm)},
            "cold": _stats(await bench.latencies(cold)),
        }
        await bench.release_all()
        await _until(full, "the pool was not full again after the steady stream")
        say(f"pools: a burst of {load.pool} against the full pool")
        burst = await bench.burst(load.pool)
        await _until(full, "the pool was not full again after the burst")
        result["burst"] = _stats(await bench.latencies(burst)) | {
            "hits": sum(w for _, w, _ in burst)
        }
        await bench.release_all()
        say(f"pools: a burst of {2 * load.pool}, then {load.rate:g}/s for {load.recovery:g} s")
        result["recovery"] = await _recovery(bench, load)
        await bench.release_all()
        say(f"pools: {load.local_samples} requests of the local pool, then as many cold")
        await _until(local_full, "the local pool was not full again")
        local_warm = await bench.stream(LOCAL, {"pool": "local"}, load.local_samples, 2.0)
        local_cold = await bench.stream(LOCAL, COLD, load.local_samples, 2.0)
        result["local"] = {
            "warm": _stats(await bench.latencies(local_warm))
            | {"hits": sum(w for _, w, _ in local_warm)},
            "cold": _stats(await bench.latencies(local_cold)),
        }
        await bench.release_all()
    return result


async def _recovery(bench: _Bench, load: Load) -> dict[str, Any]:
    burst = await bench.burst(2 * load.pool)
    ended = time.time()
    loop = asyncio.get_running_loop()
    refilled: list[float] = []

    async def nine_tenths() -> bool:
        # Not full: the stream below keeps taking members, each on its way back meanwhile.
        return await bench.members("bench") >= 0.9 * load.pool

    async def watch() -> None:
        await _until(nine_tenths, "the pool was not 90% full again after the burst")
        refilled.append(time.time() - ended)

    watching = loop.create_task(watch())
    try:
        after = await bench.stream(PROVISIONER, WARM, round(load.rate * load.recovery), load.rate)
        latencies = await bench.latencies(after)
        await asyncio.wait_for(watching, 300)
    finally:
        watching.cancel()
    await bench.latencies(burst)
    windows: dict[int, list[float]] = {}
    for (_, _, started), ms in zip(after, latencies, strict=True):
        windows.setdefault(int(started - ended), []).append(ms)
    back = next(
        (
            float(second)
            for second in sorted(windows)
            if all(percentile(windows[s], 0.9) <= WARM_P99_GOAL for s in windows if s >= second)
        ),
        None,
    )
    return {
        "burst": 2 * load.pool,
        "burst_hits": sum(w for _, w, _ in burst),
        "p90_back_s": back,
        "refilled_s": refilled[0] if refilled else None,
        "p90_by_second_ms": [percentile(windows[s], 0.9) for s in sorted(windows)],
    }


async def _wind_down(stats: asyncpg.Connection) -> None:
    """The pools gone (their members released by the daemon's next turn), then every other
    allocation released, and waited for: the local provisioner's sidecars are processes that
    a planned stop would leave running."""
    await stats.execute("DELETE FROM hubd_pools")
    await stats.execute(
        "SELECT hubd_release_allocation(id, 'bench over', NULL) FROM hubd_allocations "
        "WHERE status IN ('pending', 'provisioning', 'allocated', 'replacing') "
        "AND (pool_id IS NULL OR taken_at IS NOT NULL)"
    )

    async def ended() -> bool:
        left: int = await stats.fetchval(
            "SELECT count(*) FROM hubd_allocations WHERE status IN "
            "('pending', 'provisioning', 'allocated', 'replacing', 'releasing')"
        )
        return left == 0

    await _until(ended, "allocations were still active after the bench", within=120)


# key|measure|path|unit|goal (upper bound; "≥" a lower one)
ROWS = (
    "refill_rate|refill of {pool} members|refill.rate|members/s|≥50",
    "warm_p50|warm request → ready p50 at {rate}/s, {samples}|steady.warm.p50_ms|ms|10",
    "warm_p99|warm request → ready p99 at {rate}/s, {samples}|steady.warm.p99_ms|ms|40",
    "cold_p50|cold request → ready p50 at {rate}/s, {samples}|steady.cold.p50_ms|ms|",
    "cold_p99|cold request → ready p99 at {rate}/s, {samples}|steady.cold.p99_ms|ms|",
    "burst_p50|burst of {pool} against a pool of {pool}, p50|burst.p50_ms|ms|",
    "burst_p99|burst of {pool} against a pool of {pool}, p99|burst.p99_ms|ms|100",
    "recovery|warm p90 back after a burst of twice the pool|recovery.p90_back_s|s|10",
    "refilled|pool 90% full again after that burst|recovery.refilled_s|s|",
    "local_warm_p50|local: warm request → ready p50, {local_samples}|local.warm.p50_ms|ms|",
    "local_cold_p50|local: cold request → ready p50, {local_samples}|local.cold.p50_ms|ms|",
)
GOALS = {
    f"pools_{key}": (">=", float(goal[1:])) if goal.startswith("≥") else ("<=", float(goal))
    for key, *_, goal in (spec.split("|") for spec in ROWS)
    if goal
}
"""Each goal by its row's key: ``(op, bound)``."""


def measures(result: dict[str, Any] | None) -> list[tuple[Any, ...]]:
    """The table's rows, as ``(key, measure, value, goal, unit)``: a goal is ``("<=", n)`` or
    ``(">=", n)``, ``None`` without one; a value is ``None`` where the part did not run."""
    got = result or {}
    load = got.get("load", {})
    rows = []
    for spec in ROWS:
        key, label, path, unit, _ = spec.split("|")
        name = f"pools_{key}"
        text = label.format_map(labels(load))
        rows.append((name, text, lookup(got, path), GOALS.get(name), unit))
    return rows


def render(result: dict[str, Any]) -> str:
    """The table of a ``measure`` result."""
    lines = [("measure", "unit", "value", "goal", "met")]
    for _, label, value, goal, unit in measures(result):
        met = ""
        if goal is not None and value is not None:
            op, bound = goal
            met = "yes" if (value <= bound if op == "<=" else value >= bound) else "NO"
        goal_text = "" if goal is None else f"{'≤' if goal[0] == '<=' else '≥'} {goal[1]:g}"
        lines.append((label, unit, number(value), goal_text, met))
    return "\n".join(columns(lines, right=(2,)))


def main(argv: list[str] | None = None) -> int:
    return standalone.main(
        argv, part="pools", doc=__doc__, sizes=LOADS, measure=measure, render=render
    )


if __name__ == "__main__":
    sys.exit(main())
