"""Deadlines under load, measured: how late after its moment an allocation's lifetime (or idle
timeout) ends, while another stream of requests comes and goes and one of two replicas is
paused (SIGSTOP, then SIGCONT) or killed (SIGKILL, then started again).

    .venv/bin/python -m bench.deadlines [--size tiny|quick|full] [--json deadlines.json]

Two ``hubd run`` replicas (the instant provisioner and the sidecar farm of ``python -m bench``,
production defaults but for ``[instance]``: a 1 s heartbeat and a 5 s ttl, so that a pause of
the quick and full sizes outlasts it) on one database, and a background load: ``load_rate``
requests a second, each released once ready. Then two rounds, ``pause`` and ``restart``:

1. ``n`` allocations requested with lifetimes spread uniformly over ``lead`` to ``lead +
   spread`` seconds, and ``n // 4`` with idle timeouts spread the same (their sidecars never
   report activity: each idles out that long after it became ready);
2. half-way through the window, replica B is stopped for ``pause`` seconds (``pause``) or killed
   and started again after ``pause`` seconds (``restart``);
3. once every one has ended (or the last deadline plus ``MARGIN`` has passed), the database
   says what happened, never this process's clock: a lateness is the ``at`` of the first event
   whose ``end_reason`` is ``expired`` (``idle``) minus the ``expires_at`` (``idle_at``) that
   event carries; ``twice``: allocations with more than one ``expire`` ledger row; ``never``:
   those with no end; the fault's window on the database clock says which fell while B was away.

Goal (issue 53): p99 at most 1 s, none twice or never. ``python -m bench`` runs it as ``deadlines``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import asyncpg
import attrs

from bench import standalone
from bench.phases import PROVISIONER, daemon_config, percentile, say, vacuum
from bench.procs import DaemonProcess, FarmClient
from hubd.store import AllocationStore, connect_database

__all__ = ["GOAL_MS", "LOADS", "ROUNDS", "Load", "main", "measure", "render", "summarize"]

ROUNDS = ("pause", "restart")
GOAL_MS = 1000.0  # the p99 goal of issue 53
MARGIN = 30.0
"""Seconds after the last deadline (as it stands: a sidecar ready again restarts its idle
clock) before an allocation with no end counts as never ended."""
LOAD_TENANT = "bench-load"
INSTANCE = '\n[instance]\nheartbeat_interval = "1s"\nttl = "5s"\n'
TICK = 0.1


@attrs.frozen(kw_only=True)
class Load:
    n: int
    """Allocations with a lifetime per round (and ``n // 4`` with an idle timeout)."""
    lead: float
    """Seconds from the request to the first deadline: time for all to become ready."""
    spread: float
    """Seconds over which the deadlines are spread."""
    pause: float
    """Seconds replica B is stopped, or dead before its restart."""
    load_rate: float
    """Background requests a second, each released once ready."""


LOADS = {
    # For the smoke test: every figure, numbers meaningless.
    "tiny": Load(n=30, lead=4, spread=6, pause=2, load_rate=10),
    "quick": Load(n=1_000, lead=10, spread=20, pause=8, load_rate=50),
    "mid": Load(n=2_000, lead=15, spread=25, pause=8, load_rate=50),
    "full": Load(n=5_000, lead=25, spread=30, pause=8, load_rate=50),
}


def _config(workdir: Path, dsn: str, farm: Path, name: str) -> Path:
    path = daemon_config(
        workdir / f"hubd-deadlines-{name}.toml",
        database_url=dsn,
        state_dir=workdir / f"state-{name}",
        farm=farm,
        claims=16,
    )
    with path.open("a") as config:
        config.write(INSTANCE)
    return path


async def measure(
    dsn: str, farm: FarmClient, workdir: Path, load: Load, *, root: Path | None = None
) -> dict[str, Any]:
    """Both rounds on two fresh replicas (of the checkout ``root``; ``None``: this one), the
    background load running throughout; each round's figures and their summary."""
    sockets = load.n + load.n // 4 + 1_000
    configs = {name: _config(workdir, dsn, farm.socket_path, name) for name in ("a", "b")}
    replicas = {k: DaemonProcess(v, max_sockets=sockets, root=root) for k, v in configs.items()}
    rounds: dict[str, dict[str, Any]] = {}
    async with contextlib.AsyncExitStack() as undo:
        undo.push_async_callback(farm.call, "forget")
        stats = await asyncpg.connect(dsn)
        undo.push_async_callback(stats.close)
        db = await connect_database(dsn, pool_size=4)
        undo.push_async_callback(db.close)
        store = AllocationStore(db, instance_id="bench")
        for name, daemon in replicas.items():
            # Whichever process holds the name at the end: B's restart replaces it.
            undo.push_async_callback(lambda k=name: replicas[k].stop())
            await daemon.start()
        await vacuum(stats)
        stop_load = asyncio.Event()
        background = asyncio.create_task(_background(store, db.pool, load, stop_load))
        try:
            for name in ROUNDS:
                say(f"deadlines round {name}")
                rounds[name] = await _Round(name, stats, store, db.pool, load).run(replicas)
                say(_line(name, rounds[name]))
        finally:
            stop_load.set()
            made = await background
        await _finish(stats, db.pool, store, made)
    return {"load": attrs.asdict(load), "rounds": rounds, **summarize(list(rounds.values()))}


async def _background(
    store: AllocationStore, pool: asyncpg.Pool, load: Load, stop: asyncio.Event
) -> list[str]:
    """``load.load_rate`` requests a second until ``stop``, and every half second a release of
    those ready: the allocations it made."""
    made: list[str] = []
    per_tick = max(1, round(load.load_rate * TICK))
    started = time.monotonic()
    tick = 0
    while not stop.is_set():
        async with pool.acquire() as conn, conn.transaction():
            for _ in range(per_tick):
                made.append((await store.request(provisioner_id=PROVISIONER,
                                                 tenant_id=LOAD_TENANT, conn=conn)).id)  # fmt: skip
        tick += 1
        if tick % 5 == 0:
            ready = await pool.fetch(READY_LOAD, LOAD_TENANT)
            async with pool.acquire() as conn, conn.transaction():
                for row in ready:
                    await store.release(row["id"], reason="benchmark load", conn=conn)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, started + tick * TICK - time.monotonic())):
                await stop.wait()
    return made


READY_LOAD = (
    "SELECT id FROM hubd_allocations WHERE tenant_id = $1 "
    "AND status = 'allocated' AND connection_ready"
)


@attrs.define
class _Round:
    name: str
    stats: asyncpg.Connection
    store: AllocationStore
    pool: asyncpg.Pool
    load: Load

    async def run(self, replicas: dict[str, DaemonProcess]) -> dict[str, Any]:
        """The round's allocations requested, replica B's fault half-way through their
        window, their ends awaited and read, and all of them released."""
        name, stats, store, pool, load = self.name, self.stats, self.store, self.pool, self.load
        tenant = f"bench-deadline-{name}"
        rng = random.Random(name)  # noqa: S311 -- a spread of lifetimes, no secret
        ids: list[str] = []
        since = await stats.fetchval("SELECT coalesce(max(position), 0) FROM hubd_events")
        # Transactions of 200, as an application's batches: the feed's lock is taken at each
        # commit and held through it, and one commit of thousands would stall the load's.
        plan = [("lifetime", load.lead + rng.random() * load.spread) for _ in range(load.n)]
        plan += [("idle", load.lead + rng.random() * load.spread) for _ in range(load.n // 4)]
        for start in range(0, len(plan), 200):
            async with pool.acquire() as conn, conn.transaction():
                for kind, seconds in plan[start : start + 200]:
                    allocation = await store.request(
                        provisioner_id=PROVISIONER,
                        tenant_id=tenant,
                        lifetime=seconds if kind == "lifetime" else None,
                        idle_timeout=seconds if kind == "idle" else None,
                        conn=conn,
                    )
                    ids.append(allocation.id)
        requested = time.monotonic()
        # The fault half-way through the lifetimes' window, by this process's clock (only its
        # moments on the database's clock are measured with).
        await asyncio.sleep(max(0.0, requested + load.lead + (load.spread - load.pause) / 2
                                - time.monotonic()))  # fmt: skip
        b = replicas["b"]
        names = {each.running["instance_id"]: key for key, each in replicas.items()}
        fault_began = await stats.fetchval(NOW)
        if name == "pause":
            os.kill(b.pid, signal.SIGSTOP)
            await asyncio.sleep(load.pause)
            os.kill(b.pid, signal.SIGCONT)
        else:
            assert b.process is not None
            b.process.kill()
            await b.process.wait()
            await asyncio.sleep(load.pause)
            replicas["b"] = b = DaemonProcess(b.config, max_sockets=b.max_sockets, root=b.root)
            await b.start()
        fault_ended = await stats.fetchval(NOW)
        # Read at every poll: a sidecar ready again (after the fault) restarts its idle clock.
        while await stats.fetchval(ENDED, since, tenant) < len(ids):
            if (await stats.fetchval(LAST_DEADLINE, ids) or 0) < -MARGIN:
                break
            await asyncio.sleep(0.5)
        rows = await stats.fetch(ENDS, since, tenant, ids)
        expires = [tuple(r) for r in await stats.fetch(EXPIRE_ROWS, ids)]
        await _finish(stats, pool, store, ids)
        result = _figures(rows, expires, fault_began, fault_ended)
        # Which replica moved how many: B's instance id changes with its restart.
        names[b.running["instance_id"]] = "b" if name == "pause" else "b restarted"
        result["moved_by"] = dict(Counter(names.get(by, by) for _, by in expires))
        result["fault_seconds"] = fault_ended - fault_began
        return result


NOW = "SELECT extract(epoch FROM clock_timestamp())::float8"
# Seconds from now to the last deadline (an idle one is known once ready).
LAST_DEADLINE = (
    "SELECT extract(epoch FROM max(greatest(expires_at, idle_at)) - clock_timestamp())::float8 "
    "FROM hubd_allocations WHERE id = ANY($1::text[])"
)
# The round's events only: a range of the feed's primary key, filtered by the round's tenant.
ENDED = (
    "SELECT count(DISTINCT allocation_id) FROM hubd_events "
    "WHERE position > $1 AND tenant_id = $2 AND end_reason IN ('expired', 'idle')"
)
# Each allocation's deadlines and the first event of its end, on the database's clock; the
# deadline that event ended is the one it carries.
ENDS = """
WITH ends AS (
    SELECT DISTINCT ON (allocation_id) allocation_id, end_reason, at,
           CASE end_reason WHEN 'expired' THEN expires_at ELSE idle_at END AS due
    FROM hubd_events
    WHERE position > $1 AND tenant_id = $2 AND end_reason IN ('expired', 'idle')
    ORDER BY allocation_id, position
), readies AS (
    SELECT allocation_id, count(*) AS n FROM hubd_events
    WHERE position > $1 AND tenant_id = $2 AND event = 'ready' GROUP BY allocation_id)
SELECT a.id, a.idle_timeout IS NOT NULL AS idle_kind, e.end_reason, r.n AS readies,
       extract(epoch FROM e.due)::float8 AS due_at,
       extract(epoch FROM e.at - e.due)::float8 AS late
FROM hubd_allocations AS a
LEFT JOIN ends AS e ON e.allocation_id = a.id
LEFT JOIN readies AS r ON r.allocation_id = a.id
WHERE a.id = ANY($3::text[])
"""
# Who ended each lifetime: one row an end, by the instance whose sweep moved it.
EXPIRE_ROWS = (
    "SELECT allocation_id, instance_id FROM hubd_allocation_ledger "
    "WHERE allocation_id = ANY($1::text[]) AND kind = 'expire'"
)
ACTIVE = (
    "SELECT count(*) FROM hubd_allocations WHERE id = ANY($1::text[]) "
    "AND status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing')"
)


def _figures(
    rows: list[asyncpg.Record], expires: list[tuple[str, str]], began: float, ended: float
) -> dict[str, Any]:
    """A round's lateness in ms by kind (``expired``, ``idle``), those whose deadline fell
    within the fault's window apart, and the allocations ended twice or never."""
    result: dict[str, Any] = {}
    ends = Counter(allocation_id for allocation_id, _ in expires)
    for kind, idle in (("expired", False), ("idle", True)):
        mine = [r for r in rows if r["idle_kind"] == idle]
        ended_ = [r for r in mine if r["late"] is not None]
        result[kind] = {
            "n": len(mine),
            "late_ms": [r["late"] * 1000 for r in ended_],
            "fault_ms": [r["late"] * 1000 for r in ended_ if began <= r["due_at"] <= ended],
            "never": len(mine) - len(ended_),
            "twice": sum(1 for r in mine if ends[r["id"]] > 1),
            "ready_again": sum(1 for r in mine if (r["readies"] or 0) > 1),
        }
    return result


async def _finish(
    stats: asyncpg.Connection, pool: asyncpg.Pool, store: AllocationStore, ids: list[str]
) -> None:
    """All of ``ids`` released and terminal (a killed replica's leases lapse first: ≤ 60 s)."""
    async with pool.acquire() as conn, conn.transaction():
        for allocation_id in ids:
            await store.release(allocation_id, reason="benchmark done", conn=conn)
    deadline = time.monotonic() + 120
    while await stats.fetchval(ACTIVE, ids):
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every one of {len(ids)} allocations ended")
        await asyncio.sleep(0.5)


def _stats(late: list[float]) -> dict[str, float | None]:
    if not late:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None}
    return {
        "p50_ms": statistics.median(late),
        "p99_ms": percentile(late, 0.99),
        "max_ms": max(late),
    }


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind, the rounds pooled: lateness percentiles, during the faults too, and the
    allocations ended twice or never."""
    summary: dict[str, Any] = {}
    for kind in ("expired", "idle"):
        late = [ms for r in rounds for ms in r[kind]["late_ms"]]
        fault = [ms for r in rounds for ms in r[kind]["fault_ms"]]
        summary[kind] = {
            "n": sum(r[kind]["n"] for r in rounds),
            **_stats(late),
            "fault_n": len(fault),
            "fault_p99_ms": _stats(fault)["p99_ms"],
            "twice": sum(r[kind]["twice"] for r in rounds),
            "never": sum(r[kind]["never"] for r in rounds),
            "ready_again": sum(r[kind]["ready_again"] for r in rounds),
        }
    return summary


def _line(name: str, result: dict[str, Any]) -> str:
    return f"{name}: " + "; ".join(
        f"{kind} {e['n']}: p99 {_ms(e['p99_ms'])} ms, twice {e['twice']}, never {e['never']}"
        for kind, e in summarize([result]).items()
    )


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def render(result: dict[str, Any]) -> str:
    """The table of a ``measure`` result: a row per round and kind, then the rounds pooled."""
    head = ("round", "ends", "n", "p50 ms", "p99 ms", "max ms", "in fault: n, p99 ms",
            "twice", "never", "ready again")  # fmt: skip
    lines = []
    for name, summary in [
        *((name, summarize([each])) for name, each in result["rounds"].items()),
        ("pooled", result),
    ]:
        for kind in ("expired", "idle"):
            row = summary[kind]
            lines.append((name, kind, f"{row['n']:,}", *(_ms(row[k]) for k in (
                "p50_ms", "p99_ms", "max_ms")), f"{row['fault_n']:,}, {_ms(row['fault_p99_ms'])}",
                str(row["twice"]), str(row["never"]), str(row["ready_again"])))  # fmt: skip
    widths = [max(len(row[i]) for row in (head, *lines)) for i in range(len(head))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(head, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    out.extend(
        "  ".join([line[0].ljust(widths[0]), line[1].ljust(widths[1])]
                  + [c.rjust(w) for c, w in zip(line[2:], widths[2:], strict=True)])
        for line in lines
    )  # fmt: skip
    load = result["load"]
    p99 = result["expired"]["p99_ms"]
    met = (
        p99 is not None
        and p99 <= GOAL_MS
        and all(result[k]["twice"] == 0 and result[k]["never"] == 0 for k in ("expired", "idle"))
    )
    out.append("")
    out.append(
        f"{load['n']:,} lifetimes and {load['n'] // 4:,} idle timeouts a round, spread over "
        f"{load['lead']:g}-{load['lead'] + load['spread']:g} s; {load['load_rate']:g} other "
        f"requests/s; replica B stopped for {load['pause']:g} s (pause), killed and started "
        f"again {load['pause']:g} s later (restart)."
    )
    out.append(f"Goal, p99 ≤ {GOAL_MS:.0f} ms, none twice or never: {'met' if met else 'NOT met'}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    return standalone.main(
        argv, part="deadlines", doc=__doc__, sizes=LOADS, measure=measure, render=render
    )


if __name__ == "__main__":
    sys.exit(main())
