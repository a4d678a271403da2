"""Fair claiming, measured: tenant B's request → ready latency alone and under tenant A's burst
of ten times B's requests, with the claim's fair order and with the former FIFO order.

    .venv/bin/python -m bench.fairness [--size quick|full] [--json fairness.json]

One fresh ``hubd run`` (the default ``max_concurrent_claims``, the instant provisioner and the
sidecar farm of ``python -m bench``) on one database; tenant B's sidecars come from a farm of
their own (a second provisioner), dialling from A's addresses as sidecars of two tenants on one
fleet of hosts do (``--own-range``: from a /24 of their own). In one shared farm B's handshakes
waited in the farm's own queue (64 handshakes at a time) behind A's, up to a second at p99, a
queue of the harness and not of hubd (``--shared-farm`` measures it so). Then,
``rounds`` times, three scenarios:

1. **alone**: tenant B submits ``requests`` requests, ``per_tick`` every 100 ms, each its own
   transaction through ``AllocationStore.request``;
2. **fair**: tenant A requests ten times as many in one transaction, and from A's commit on B
   submits the same as in 1;
3. **fifo**: 2 again, with the claim's former body installed for the scenario in the bench's
   own database (``hubd_due_allocations`` as it was before migration 0023: every due row in
   ``next_attempt_at`` order, whatever its tenant, with the index it walked) and the fair body
   put back after it.

A request's latency is read afterwards from the event feed (``hubd_events``, docs/api.md), on
the database's clock: from its ``requested`` event (written at the request's commit) to its
``ready`` event (written at the commit that made it ready); its claim wait, the part the claim's
order decides, ends at its first claim's ledger row, and the rest of it (claim → ready) is the
lifecycle that follows, where A's burst slows B without queueing it. That rest is split in
three (``PARTS``) at B's farm's dial of the sidecar (the farm's clock, the same host's) and at
the start of the statement that admitted its socket (the connection record's ``connected_at``).
Nothing listens while it runs. Each scenario ends with every allocation ready, released and
terminal. B's percentiles pool every round's requests; A's rate is A's requests over the time
from A's commit to its last ``ready``.
The goal (issue 53): B's p99 under A's burst at most twice B's p99 alone.

``python -m bench`` runs the same at its own size as its ``fairness`` part.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import attrs

from bench import standalone
from bench.phases import PROVISIONER, daemon_config, percentile, say, vacuum
from bench.procs import DaemonProcess, FarmClient
from bench.table import columns
from hubd.config.sections import ReconcilerConfig
from hubd.reconciler.settings import ReconcilerSettings
from hubd.store import AllocationStore, connect_database

__all__ = [
    "BURST_FACTOR",
    "LOADS",
    "SCENARIOS",
    "Load",
    "fifo_claims",
    "main",
    "measure",
    "render",
    "summarize",
]

BURST_FACTOR = 10
"""Tenant A's requests for each of tenant B's."""
TICK = 0.1
"""Seconds between two of B's submissions of ``per_tick`` requests."""
TENANT_A = "bench-a"
TENANT_B = "bench-b"
B_PROVISIONER = "bench-b"
"""Tenant B's provisioner: the same instant plugin, writing to B's own farm."""
B_SOURCES = [f"127.0.1.{n}" for n in range(2, 251)]
"""Where B's sidecars dial from with ``--own-range``: a /24 of their own, which the listener's
per-range handshake shares count apart from A's (by default both farms dial from the same
249 addresses, as sidecars of two tenants on one fleet of hosts do)."""
SCENARIOS = ("alone", "fair", "fifo")
CLAIMS = ReconcilerConfig().max_concurrent_claims
"""The daemon's default: fairness is measured as an operator gets it."""


@attrs.frozen(kw_only=True)
class Load:
    requests: int
    """Tenant B's requests per scenario (A's burst: ``BURST_FACTOR`` times as many)."""
    per_tick: int
    """B's requests submitted together every ``TICK`` seconds."""
    rounds: int
    """Rounds of the three scenarios, in turn."""
    within: float
    """Seconds a scenario's allocations have to become ready, and then to end."""


LOADS = {
    # For the smoke test: every figure, numbers meaningless.
    "tiny": Load(requests=20, per_tick=5, rounds=1, within=60),
    "quick": Load(requests=200, per_tick=5, rounds=3, within=120),
    "mid": Load(requests=300, per_tick=5, rounds=3, within=300),
    "full": Load(requests=500, per_tick=5, rounds=3, within=600),
}


async def measure(
    dsn: str,
    farm: FarmClient,
    workdir: Path,
    load: Load,
    *,
    shared_farm: bool = False,
    own_range: bool = False,
    per_tenant: int = 0,
    root: Path | None = None,
) -> dict[str, Any]:
    """The three scenarios ``load.rounds`` times on one fresh daemon (of the checkout ``root``;
    ``None``: this one) whose config goes in ``workdir``; A's sidecars from ``farm``, B's from a
    farm started here (with ``shared_farm``, from ``farm`` too), dialling from A's addresses or,
    with ``own_range``, from :data:`B_SOURCES`; ``per_tenant`` is the daemon's
    ``max_claims_per_tenant`` (0: its default, half the slots, at most 4). The summary of each
    scenario's rounds."""
    farms = [farm]
    b_provisioner = PROVISIONER
    if not shared_farm:
        farms.append(FarmClient(workdir / "farm-b.sock", loop=farm.loop))
        b_provisioner = B_PROVISIONER
    config = _config(workdir, dsn, [each.socket_path for each in farms], per_tenant=per_tenant)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in SCENARIOS}
    daemon = DaemonProcess(
        config, max_sockets=load.requests * (BURST_FACTOR + 1) + 1_000, root=root
    )
    # Undone in reverse: the daemon stopped first, so that nothing claims or dials while the
    # farms and connections go; the suite's farm forgets the last sidecars last.
    async with contextlib.AsyncExitStack() as undo:
        undo.push_async_callback(farm.call, "forget")
        stats = await asyncpg.connect(dsn)
        undo.push_async_callback(stats.close)
        # A connection for each of B's requests of a tick: they are submitted together.
        db = await connect_database(dsn, pool_size=load.per_tick)
        undo.push_async_callback(db.close)
        store = AllocationStore(db, instance_id="bench")
        for each in farms[1:]:
            undo.push_async_callback(each.stop)
            await each.start()
        if own_range and not shared_farm:
            await farms[-1].call("sources", value=B_SOURCES)
        undo.push_async_callback(daemon.stop)
        await daemon.start()
        # Unmeasured: both farms' first sockets, the plugins' first writes and the pools'
        # first connections, which otherwise fell on the first round's B alone (a tiny run:
        # 195 ms p50, against 14 ms with the warm-up).
        say("fairness warm-up")
        warm_up = attrs.evolve(load, requests=load.per_tick * 4)
        await _scenario(
            stats,
            db.pool,
            store,
            warm_up,
            burst=warm_up.requests,
            b_provisioner=b_provisioner,
            b_farm=farms[-1],
        )
        for each in farms:
            await each.call("forget")
        for index in range(load.rounds):
            for name in SCENARIOS:
                say(f"fairness round {index + 1}/{load.rounds}: {name}")
                counted = await daemon.metrics()
                async with contextlib.AsyncExitStack() as stack:
                    if name == "fifo":
                        await stack.enter_async_context(fifo_claims(stats))
                    result = await _scenario(
                        stats,
                        db.pool,
                        store,
                        load,
                        burst=0 if name == "alone" else load.requests * BURST_FACTOR,
                        b_provisioner=b_provisioner,
                        b_farm=farms[-1],
                    )
                result["claims_per_statement"] = _per_statement(counted, await daemon.metrics())
                for each in farms:
                    await each.call("forget")
                rounds[name].append(result)
                say(_line(name, result))
    return {
        "load": {
            **attrs.asdict(load),
            "burst": load.requests * BURST_FACTOR,
            "claims": CLAIMS,
            "per_tenant": per_tenant,
            "shared_farm": shared_farm,
            "own_range": own_range and not shared_farm,
        },
        **{name: summarize(rounds[name]) for name in SCENARIOS},
    }


def _per_statement(before: dict[str, float], after: dict[str, float]) -> float:
    """Claims per claim statement that claimed something, between two reads of the daemon's
    metrics (the statements that found nothing due are idle polls, left out)."""

    def spent(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    statements = spent("hubd_claim_statements_total") - spent("hubd_claim_statements_idle_total")
    return spent("hubd_claims_total") / max(statements, 1.0)


def _config(workdir: Path, dsn: str, farms: list[Path], *, per_tenant: int = 0) -> Path:
    """The suite's daemon config (``bench.phases.daemon_config``) at the default claim count,
    with B's provisioner added when B has a farm of its own, and ``max_claims_per_tenant``."""
    path = daemon_config(
        workdir / "hubd-fairness.toml",
        database_url=dsn,
        state_dir=workdir / "state",
        farm=farms[0],
        claims=CLAIMS,
        per_tenant=per_tenant,
    )
    if len(farms) > 1:
        with path.open("a") as config:
            config.write(
                f"""
[[provisioners]]
id = "{B_PROVISIONER}"
plugin = "bench.plugin:create"
[provisioners.options]
farm = "{farms[1]}"
"""
            )
    return path


async def _scenario(
    stats: asyncpg.Connection,
    pool: asyncpg.Pool,
    store: AllocationStore,
    load: Load,
    *,
    burst: int,
    b_provisioner: str,
    b_farm: FarmClient,
) -> dict[str, Any]:
    """One scenario: A's burst of ``burst`` requests (none: B alone), then B's stream; every
    allocation awaited ready, its latency read (with, for B's, when ``b_farm`` dialled its
    sidecar), all released and awaited terminal."""
    await vacuum(stats)
    # The feed's positions follow commit order: every event of this scenario comes after it.
    since = await stats.fetchval("SELECT coalesce(max(position), 0) FROM hubd_events")
    ids = await _burst(store, pool, n=burst) if burst else []
    ids += await _stream(
        store, pool, n=load.requests, per_tick=load.per_tick, provisioner=b_provisioner
    )
    if not await _until(stats, since, READY, len(ids), within=load.within):
        raise RuntimeError(f"not every one of {len(ids)} allocations became ready")
    rows = await stats.fetch(LATENCIES, since)
    dialed = {
        r["allocation_id"]: (await b_farm.call("dialed", allocation_id=r["allocation_id"]))["at"]
        for r in rows
        if r["tenant_id"] == TENANT_B
    }
    async with pool.acquire() as conn, conn.transaction():
        for allocation_id in ids:
            await store.release(allocation_id, reason="benchmark done", conn=conn)
    if not await _until(stats, since, ENDED, len(ids), within=load.within):
        raise RuntimeError(f"not every one of {len(ids)} allocations ended")
    return _round(rows, dialed)


async def _burst(store: AllocationStore, pool: asyncpg.Pool, *, n: int) -> list[str]:
    """Tenant A's ``n`` requests in one transaction: all due at once, at its commit."""
    async with pool.acquire() as conn, conn.transaction():
        return [
            (
                await store.request(
                    provisioner_id=PROVISIONER, tenant_id=TENANT_A, spec={}, conn=conn
                )
            ).id
            for _ in range(n)
        ]


async def _stream(
    store: AllocationStore, pool: asyncpg.Pool, *, n: int, per_tick: int, provisioner: str
) -> list[str]:
    """Tenant B's ``n`` requests, ``per_tick`` of them every ``TICK`` seconds on the clock of
    the first (a slow request does not push the next tick back), each its own transaction."""
    made: list[str] = []

    async def one() -> None:
        async with pool.acquire() as conn:
            allocation = await store.request(
                provisioner_id=provisioner, tenant_id=TENANT_B, spec={}, conn=conn
            )
        made.append(allocation.id)

    started = time.monotonic()
    async with asyncio.TaskGroup() as group:
        for tick in range(math.ceil(n / per_tick)):
            await asyncio.sleep(max(0.0, started + tick * TICK - time.monotonic()))
            for index in range(min(per_tick, n - tick * per_tick)):
                group.create_task(one(), name=f"bench-b-{tick}-{index}")
    return made


# Polled every quarter second (the latencies come from the events' own times, not from the poll):
# a range of the feed's primary key, the scenario's events only.
READY = (
    "SELECT count(DISTINCT allocation_id) FROM hubd_events WHERE position > $1 AND event = 'ready'"
)
ENDED = (
    "SELECT count(DISTINCT allocation_id) FROM hubd_events "
    "WHERE position > $1 AND event IN ('released', 'failed', 'destroy_failed')"
)
POLL = 0.25


async def _until(
    stats: asyncpg.Connection, since: int, query: str, count: int, *, within: float
) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await stats.fetchval(query, since) >= count:
            return True
        await asyncio.sleep(POLL)
    return False


# Each allocation of the scenario: its tenant, and the database clock (seconds since the epoch)
# of its request's commit, of its first claim (the claim's first ledger row, which binds its
# sidecar), of the start of the statement that admitted its sidecar's socket (the record's
# connected_at, read before the release clears it) and of the commit that first made it ready.
LATENCIES = """
SELECT e.allocation_id, e.tenant_id, e.requested, e.ready,
       extract(epoch FROM (
           SELECT min(l.at) FROM hubd_allocation_ledger AS l
           WHERE l.allocation_id = e.allocation_id
             AND l.kind = 'bind_sidecar' AND l.phase = 'committed'))::float8 AS claimed,
       extract(epoch FROM c.connected_at)::float8 AS admitted
FROM (
    SELECT allocation_id, tenant_id,
           extract(epoch FROM min(at) FILTER (WHERE event = 'requested'))::float8 AS requested,
           extract(epoch FROM min(at) FILTER (WHERE event = 'ready'))::float8 AS ready
    FROM hubd_events
    WHERE position > $1
    GROUP BY allocation_id, tenant_id
) AS e
LEFT JOIN hubd_sidecar_connections AS c ON c.allocation_id = e.allocation_id
"""


def _round(rows: list[asyncpg.Record], dialed: dict[str, float | None]) -> dict[str, Any]:
    """One scenario's figures from its ``LATENCIES`` rows and the farm's dial of each of B's
    sidecars (``dialed``, by allocation): B's latencies in ms, in request order, the part of each
    spent waiting for the claim, and its claim → ready in parts; A's count and rate; how many of
    B's requests committed while A's burst was still being served."""
    b = sorted(
        (r["requested"], r["ready"], r["claimed"]) for r in rows if r["tenant_id"] == TENANT_B
    )
    a = [(r["requested"], r["ready"]) for r in rows if r["tenant_id"] == TENANT_A]
    result: dict[str, Any] = {
        "b_ms": [(ready - asked) * 1000 for asked, ready, _ in b],
        "b_claim_ms": [(claimed - asked) * 1000 for asked, _, claimed in b],
        "b_parts_ms": _parts(rows, dialed),
    }
    if a:
        # Every A request commits in one transaction; the feed writes their events at that
        # commit, one after another: the last is the commit's moment.
        committed = max(asked for asked, _ in a)
        last = max(ready for _, ready in a)
        result["a_n"] = len(a)
        result["a_rate"] = len(a) / (last - committed)
        result["a_ms"] = [(ready - asked) * 1000 for asked, ready in a]
        result["b_during_burst"] = sum(1 for asked, _, _ in b if asked < last)
    return result


PARTS = ("claim → dial", "dial → admission", "admission → ready")
"""B's claim → ready in turn: the ensure, the plugin's word to the farm and the farm's start
of the dial; the connect, the request, the listener and the wait for the admission statement
to start; that statement and its commit, and the ready commit (when the sidecar connected
before its park committed, the park's commit too)."""


def _parts(rows: list[asyncpg.Record], dialed: dict[str, float | None]) -> list[list[float]]:
    """The three :data:`PARTS` in ms, one triple for each of B's allocations whose dial and
    admission are both known (a sidecar dialled again carries its last dial)."""
    parts = []
    for r in rows:
        dial = dialed.get(r["allocation_id"])
        if r["tenant_id"] != TENANT_B or dial is None or r["admitted"] is None:
            continue
        marks = (r["claimed"], dial, r["admitted"], r["ready"])
        parts.append([(later - earlier) * 1000 for earlier, later in itertools.pairwise(marks)])
    return parts


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A scenario over its rounds: B's percentiles (request → ready, and request → claim) over
    every round's requests pooled, each round's p99, and A's median rate and pooled
    percentiles."""
    pooled = [ms for each in rounds for ms in each["b_ms"]]
    claims = [ms for each in rounds for ms in each["b_claim_ms"]]
    # The rest of each request's latency: its lifecycle once claimed (the ensure, the sidecar's
    # handshake, the ready commit, and any follow-up claim), where A's burst slows B without
    # queueing it.
    after = [ms - claim for ms, claim in zip(pooled, claims, strict=True)]
    summary: dict[str, Any] = {
        "b_n": len(pooled),
        "b_p50_ms": statistics.median(pooled),
        "b_p99_ms": percentile(pooled, 0.99),
        "b_max_ms": max(pooled),
        "b_p99_ms_rounds": [percentile(each["b_ms"], 0.99) for each in rounds],
        "b_claim_p50_ms": statistics.median(claims),
        "b_claim_p99_ms": percentile(claims, 0.99),
        "b_after_claim_p50_ms": statistics.median(after),
        "b_after_claim_p99_ms": percentile(after, 0.99),
    }
    parts = [triple for each in rounds for triple in each.get("b_parts_ms", [])]
    if parts:
        summary["b_parts_n"] = len(parts)
        summary["b_parts_ms"] = {
            name: [statistics.median(column), percentile(list(column), 0.99)]
            for name, column in zip(PARTS, zip(*parts, strict=True), strict=True)
        }
    if all("claims_per_statement" in each for each in rounds):
        summary["claims_per_statement"] = statistics.median(
            each["claims_per_statement"] for each in rounds
        )
    if all("a_rate" in each for each in rounds):
        a_pooled = [ms for each in rounds for ms in each["a_ms"]]
        summary |= {
            "a_n": sum(each["a_n"] for each in rounds),
            "a_rate": statistics.median(each["a_rate"] for each in rounds),
            "a_rates": [each["a_rate"] for each in rounds],
            "a_p50_ms": statistics.median(a_pooled),
            "a_p99_ms": percentile(a_pooled, 0.99),
            "b_during_burst": sum(each["b_during_burst"] for each in rounds),
        }
    return summary


def _line(name: str, result: dict[str, Any]) -> str:
    text = (
        f"{name}: B p50 {statistics.median(result['b_ms']):.0f} ms, "
        f"p99 {percentile(result['b_ms'], 0.99):.0f} ms "
        f"(claim wait p99 {percentile(result['b_claim_ms'], 0.99):.0f} ms)"
    )
    if "a_rate" in result:
        text += (
            f"; A {result['a_n']} at {result['a_rate']:.0f}/s; "
            f"{result['b_during_burst']} of B's during A's burst"
        )
    return text


# The claim's body before migration 0023 (hubd/store/schema.sql at aa4116f), and the index it
# walked: every due row in due order, whatever its tenant, with no room per tenant (the signature
# of 0026, whose rooms it ignores). Installed in the bench's database only, for the scenario that
# compares with it; the settings as they were, and the fixed search path of 0016 set again as
# 0023 does.
FIFO_INDEX = """
CREATE INDEX IF NOT EXISTS hubd_bench_fifo_due_idx ON hubd_allocations (next_attempt_at, id)
    WHERE next_attempt_at IS NOT NULL
      AND status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing')
"""
FIFO_CLAIM = """
CREATE OR REPLACE FUNCTION hubd_due_allocations(exclude text[], wanted integer,
    room integer DEFAULT NULL, listed text[] DEFAULT '{}', rooms integer[] DEFAULT '{}')
RETURNS TABLE (id text, next_attempt_at timestamptz)
LANGUAGE sql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
AS $$
    SELECT a.id, a.next_attempt_at FROM hubd_allocations AS a
    WHERE a.next_attempt_at IS NOT NULL
      AND a.next_attempt_at <= now()
      AND a.status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing')
      AND (a.lease_expires_at IS NULL OR a.lease_expires_at <= now())
      AND a.id <> ALL (exclude)
    ORDER BY a.next_attempt_at, a.id
    LIMIT wanted
    FOR NO KEY UPDATE OF a SKIP LOCKED
$$;
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION hubd_due_allocations(text[], integer, integer, text[], '
                   'integer[]) SET search_path = pg_catalog, %I, pg_temp', current_schema());
END;
$$;
"""
CURRENT_CLAIM = (
    "SELECT pg_get_functiondef("
    "'hubd_due_allocations(text[], integer, integer, text[], integer[])'::regprocedure)"
)


@contextlib.asynccontextmanager
async def fifo_claims(conn: asyncpg.Connection) -> AsyncIterator[None]:
    """The former FIFO claim while the block runs, the current one (as the migrations made it,
    settings and all) again after it. A running daemon takes the body in force at each claim
    statement: PostgreSQL checks a SQL function's definition at every call."""
    current = await conn.fetchval(CURRENT_CLAIM)
    await conn.execute(FIFO_INDEX)
    await conn.execute(FIFO_CLAIM)
    try:
        yield
    finally:
        await conn.execute(current)
        await conn.execute("DROP INDEX IF EXISTS hubd_bench_fifo_due_idx")


LABELS = {
    "alone": "B alone",
    "fair": "B + A's burst, fair claim",
    "fifo": "B + A's burst, FIFO claim",
}


def render(result: dict[str, Any]) -> str:
    """The table of a ``measure`` result."""
    load = result["load"]
    head = (
        "scenario",
        "B p50 ms",
        "B p99 ms",
        "B p99 / alone",
        "B claim wait p50 / p99 ms",
        "B claim → ready p50 / p99 ms",
        "A alloc/s",
        "claims / statement",
        "B during burst",
    )
    alone = result["alone"]["b_p99_ms"]
    lines = []
    for name in SCENARIOS:
        each = result[name]
        lines.append(
            (
                LABELS[name],
                f"{each['b_p50_ms']:.1f}",
                f"{each['b_p99_ms']:.1f}",
                f"{each['b_p99_ms'] / alone:.2f}x",
                f"{each['b_claim_p50_ms']:.1f} / {each['b_claim_p99_ms']:.1f}",
                f"{each['b_after_claim_p50_ms']:.1f} / {each['b_after_claim_p99_ms']:.1f}",
                f"{each['a_rate']:,.0f}" if "a_rate" in each else "—",
                f"{each['claims_per_statement']:.1f}",
                f"{each['b_during_burst']} of {each['b_n']}" if "a_rate" in each else "—",
            )
        )
    out = columns([head, *lines], right=range(1, len(head)))
    if all("b_parts_ms" in result[name] for name in SCENARIOS):
        out.append("")
        out.extend(_parts_table(result))
    ratio = result["fair"]["b_p99_ms"] / alone
    per_round = " / ".join(
        f"{fair / own:.2f}x"
        for fair, own in zip(
            result["fair"]["b_p99_ms_rounds"], result["alone"]["b_p99_ms_rounds"], strict=True
        )
    )
    farm = "A's" if load["shared_farm"] else "their own"
    hosts = "a /24 of their own" if load.get("own_range") else "A's addresses"
    out.append("")
    out.append(
        f"B: {load['requests']} requests per scenario, {load['per_tick']} every "
        f"{TICK * 1000:.0f} ms, its sidecars from {farm} farm "
        f"dialling from {hosts}; A: {load['burst']} in one "
        f"transaction; {load['claims']} claims, at most "
        f"{_room(load['claims'], load.get('per_tenant', 0))} a tenant while another is in sight; "
        f"{load['rounds']} rounds, percentiles over the rounds pooled."
    )
    out.append(
        f"Goal, B's p99 under the burst ≤ 2x alone: {'met' if ratio <= 2 else 'NOT met'} "
        f"({ratio:.2f}x; per round {per_round})"
    )
    return "\n".join(out)


def _parts_table(result: dict[str, Any]) -> list[str]:
    """B's claim → ready in :data:`PARTS`, each part's p50 / p99 over the rounds pooled."""
    head = ("B's claim → ready in parts, p50 / p99 ms", *PARTS, "of B's")
    lines = [
        (
            LABELS[name],
            *("{:.1f} / {:.1f}".format(*result[name]["b_parts_ms"][part]) for part in PARTS),
            f"{result[name]['b_parts_n']} of {result[name]['b_n']}",
        )
        for name in SCENARIOS
    ]
    return columns([head, *lines], right=range(1, len(head)))


def _room(claims: int, per_tenant: int) -> int:
    """The claims one tenant holds while another is in sight, as the daemon decides it."""
    settings = ReconcilerSettings(max_concurrent_claims=claims, max_claims_per_tenant=per_tenant)
    return settings.tenant_room


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fairness", description=(__doc__ or "").split("\n")[0]
    )
    standalone.add_arguments(parser, LOADS)
    # B's own range is its own farm's addresses: with A's farm there is none to give it.
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--shared-farm",
        action="store_true",
        help="B's sidecars from A's farm, queued with A's handshakes (default: a farm of B's own)",
    )
    where.add_argument(
        "--own-range",
        action="store_true",
        help="B's sidecars dial from 127.0.1.2-250 (default: the same addresses as A's)",
    )
    parser.add_argument(
        "--max-claims-per-tenant",
        dest="per_tenant",
        type=int,
        default=0,
        help="the daemon's [reconciler] max_claims_per_tenant (0: half the slots, at most 4)",
    )
    args = parser.parse_args(argv)
    load = LOADS[args.size]

    async def measured(dsn: str, farm: FarmClient, workdir: Path) -> dict[str, Any]:
        return await measure(
            dsn,
            farm,
            workdir,
            load,
            shared_farm=args.shared_farm,
            own_range=args.own_range,
            per_tenant=args.per_tenant,
        )

    return standalone.report("fairness", args, measured, render)


if __name__ == "__main__":
    sys.exit(main())
