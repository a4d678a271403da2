"""The measurements that run against a live daemon: lifecycle, idle commits, connect → ready
latency, memory per idle socket and the reconnect storm (and their bare-websockets twins)."""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import attrs

from bench.procs import (
    BareServer,
    DaemonProcess,
    FarmClient,
    cpu_seconds,
    rss_kib,
    server_processes,
)
from bench.watch import Watcher, xact_commit
from hubd.store import AllocationStore, connect_database

__all__ = [
    "BareSockets",
    "BenchConfig",
    "backend_pid",
    "burst",
    "cpu",
    "daemon_config",
    "idle_commits",
    "latency",
    "lifecycle",
    "open_store",
    "percentile",
    "say",
    "socket_phase",
    "vacuum",
]

PROVISIONER = "bench"
STATS_LAG = 11.0
"""Seconds after which every idle backend has reported its counts (PostgreSQL flushes an idle
backend's pending statistics after 10 s at the latest)."""


def say(message: str) -> None:
    print(f"bench:   {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class BenchConfig:
    """Where the daemon's config files go and what they share."""

    def __init__(self, workdir: Path, database_url: str, farm: Path) -> None:
        self.workdir = workdir
        self.database_url = database_url
        self.farm = farm
        self._count = 0

    def write(self, *, claims: int) -> Path:
        return daemon_config(
            self.workdir / f"hubd-{self._next()}.toml",
            database_url=self.database_url,
            state_dir=self.workdir / "state",
            farm=self.farm,
            claims=claims,
        )

    def _next(self) -> int:
        self._count += 1
        return self._count


def daemon_config(
    path: Path, *, database_url: str, state_dir: Path, farm: Path, claims: int, per_tenant: int = 0
) -> Path:
    """Production defaults (config/hubd.toml) but for the listeners, the claim count (and
    ``max_claims_per_tenant`` when not 0, its default) and the provisioner; logs at info, as in
    production, so the daemon's own lines are measured too. The key is left out at its default:
    ``bench.compare`` runs trees from before it existed with this config."""
    state_dir.mkdir(parents=True, exist_ok=True)
    room = f"max_claims_per_tenant = {per_tenant}\n" if per_tenant else ""
    path.write_text(
        f"""
[database]
url = "{database_url}"
[state]
dir = "{state_dir}"
[server]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[reconciler]
max_concurrent_claims = {claims}
{room}# Long enough that sockets held back while thousands are provisioned still count.
connect_timeout = "900s"
[[provisioners]]
id = "{PROVISIONER}"
plugin = "bench.plugin:create"
[provisioners.options]
farm = "{farm}"
[log]
format = "json"
level = "info"
"""
    )
    return path


async def _request(store: AllocationStore, dsn: str, n: int) -> list[str]:
    """``n`` allocations in one transaction: none is visible before the commit."""
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            made = [
                await store.request(provisioner_id=PROVISIONER, spec={}, conn=conn)
                for _ in range(n)
            ]
    finally:
        await conn.close()
    return [allocation.id for allocation in made]


async def _release(store: AllocationStore, dsn: str, ids: list[str]) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            for allocation_id in ids:
                await store.release(allocation_id, reason="benchmark done", conn=conn)
    finally:
        await conn.close()


async def open_store(dsn: str) -> tuple[Any, AllocationStore]:
    db = await connect_database(dsn, pool_size=2)
    return db, AllocationStore(db, instance_id="bench")


@attrs.frozen
class _Requested:
    id: str


class SqlApi:
    """Requests and releases through the SQL API (``hubd_v1``), in the shape of the store's
    methods the phases call: a database migrated by another checkout (``bench.compare``) has
    that checkout's tables, which this checkout's statements need not match, and the same
    functions, which any version since the API's first keeps."""

    async def request(
        self, *, provisioner_id: str, spec: dict[str, Any], conn: asyncpg.Connection
    ) -> _Requested:
        assert spec == {}, "the SQL API's spec parameter changed type across versions"
        made = await conn.fetchval("SELECT (hubd_v1.request(provisioner => $1)).id", provisioner_id)
        return _Requested(made)

    async def release(self, allocation_id: str, *, reason: str, conn: asyncpg.Connection) -> None:
        await conn.execute("SELECT hubd_v1.release($1, $2)", allocation_id, reason)


async def open_sql_api(dsn: str) -> tuple[Any, Any]:
    """What :func:`open_store` gives, with :class:`SqlApi` in place of the store."""
    db = await connect_database(dsn, pool_size=2)
    return db, SqlApi()


POLL_INTERVAL = 0.05
"""Most seconds between the progress polls of a counted lifecycle."""
FINAL_POLL = 0.005
"""Fewest seconds between them: near the end, a poll is due when the rate so far says the last
rows will be there."""


# The run's rows are those created since the run began (the bench owns the database, and every
# earlier run's rows are terminal by then), found through hubd's index of active rows: the
# ready ones among the allocated, and the finished ones as those no longer active, so that no
# poll reads the earlier runs' rows and no index is kept for the bench alone (each would cost
# every transition an entry). A filter on the run's ids (``id = ANY($1)``) cost 4-8 ms per poll
# at 2,000 ids, most of it sending and decoding the array, every 50 ms, on the two cores the
# daemon is measured on.
READY_COUNT = (
    "SELECT count(*) FROM hubd_allocations "
    "WHERE status = 'allocated' AND created_at >= $1 AND connection_ready"
)
ACTIVE_COUNT = (
    "SELECT count(*) FROM hubd_allocations "
    "WHERE status IN ('pending', 'provisioning', 'allocated', 'replacing', 'releasing') "
    "AND created_at >= $1"
)


def next_poll(reached: int, wanted: int, elapsed: float) -> float:
    """Seconds until the next progress poll, with ``reached`` of ``wanted`` rows there after
    ``elapsed`` seconds.

    Polled every 50 ms, the end was seen 25 ms late on average, and a phase lasts one to three
    seconds; PgQueuer's drain, the baseline, ends the moment its queue is empty. The last polls
    come when the rate so far says the rest will be done: a few more polls, each a cheap count,
    and the end is seen within about 5 ms."""
    if reached <= 0 or elapsed <= 0:
        return POLL_INTERVAL
    left = (wanted - reached) * elapsed / reached
    return min(POLL_INTERVAL, max(FINAL_POLL, left))


async def _poll_until(
    stats: asyncpg.Connection, ids: list[str], since: datetime, *, ready: bool, within: float
) -> tuple[bool, int, int]:
    """Poll until every row of ``ids`` is ready (or, with ``ready`` false, terminal): whether
    all got there in time, how many did, and how many polls (a transaction each) it took. A
    counted window polls rather than listens: a listener's wake-ups are transactions too, and
    no statement says how many there were."""
    started = time.monotonic()
    deadline = started + within
    polls = 0
    while True:
        polls += 1
        if ready:
            reached = int(await stats.fetchval(READY_COUNT, since))
        else:
            reached = len(ids) - int(await stats.fetchval(ACTIVE_COUNT, since))
        now = time.monotonic()
        if reached >= len(ids) or now >= deadline:
            return reached >= len(ids), reached, polls
        await asyncio.sleep(next_poll(reached, len(ids), now - started))


# The server's WAL insert position: exact at once, unlike the statistics views, which lag.
START = "SELECT now(), pg_current_wal_insert_lsn()"
WAL_SINCE = "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1)"


async def lifecycle(
    dsn: str,
    store: AllocationStore,
    *,
    n: int,
    within: float,
    stats: asyncpg.Connection,
    stop: Callable[[], Awaitable[None]],
    cpu: Callable[[], dict[str, float]],
) -> dict[str, Any]:
    """``n`` allocations requested in one transaction, timed until all are ready, then released
    in one transaction, timed until all are released; commits counted around both, up to the
    daemon's exit (``stop``); and, from ``cpu`` (CPU seconds so far by process group), the CPU
    each group spent per allocation in each phase.

    PostgreSQL reports a backend's counts when it goes idle at least a second after its last
    report, and otherwise keeps them until its next statement or its exit: an idle pool
    connection, or a listening one (which commits a transaction per wake-up and runs no
    statement), can hold its counts for as long as it lives. Only the daemon's exit makes every
    count of its connections land, and land inside the window. ``stats`` must have reported
    everything it ran before (a statement at least a second after its previous report does)."""
    commits_before = await xact_commit(stats)
    # One statement, so no transaction more of the bench's own.
    since, wal_before = await stats.fetchrow(START)
    cpu_start = cpu()
    started = time.monotonic()
    ids = await _request(store, dsn, n)
    committed = time.monotonic()
    all_ready, ready, ready_polls = await _poll_until(stats, ids, since, ready=True, within=within)
    ready_at = time.monotonic()
    cpu_ready = cpu()
    await _release(store, dsn, ids)
    release_committed = time.monotonic()
    all_done, done, done_polls = await _poll_until(stats, ids, since, ready=False, within=within)
    done_at = time.monotonic()
    cpu_done = cpu()
    await stop()
    stopped = time.monotonic()
    wal_bytes = await stats.fetchval(WAL_SINCE, wal_before)
    await asyncio.sleep(STATS_LAG)
    # A second after the last report of ``stats``: this statement reports its polls.
    await stats.execute("SELECT 1")
    commits_after = await xact_commit(stats)
    # After the counted window: the steps are the bench's own reading.
    steps = await ledger_steps(stats, since)
    ready_seconds = ready_at - committed
    release_seconds = done_at - release_committed
    return {
        "n": n,
        "complete": all_ready and all_done,
        "ready": ready,
        "released": done,
        "insert_seconds": committed - started,
        "ready_seconds": ready_seconds,
        "release_seconds": release_seconds,
        "ready_rate": ready / ready_seconds,
        "lifecycle_rate": min(ready, done) / (ready_seconds + release_seconds),
        "polls": ready_polls + done_polls,
        # The bench's own: the first statistics read, the clock read, the request and release
        # connections' start-up and their transactions, every poll, the WAL read and the
        # statement that reports them.
        "commits_raw": commits_after - commits_before - 8 - ready_polls - done_polls,
        # The whole server's, from the first read to the daemon's exit: the request and the
        # release, every transition, ledger row and connection record and their index entries.
        "wal_bytes_per_lifecycle": float(wal_bytes) / n,
        # The daemon ran (and the idle rate applies) from the first read to its exit.
        "window_seconds": stopped - started,
        "ledger_steps": steps,
        # CPU milliseconds per allocation by process group: from the request (its insert
        # included) until all were ready, and from then until all were terminal.
        "cpu_ms": {
            "ready": _per(_spent(cpu_start, cpu_ready), n),
            "release": _per(_spent(cpu_ready, cpu_done), n),
        },
    }


async def burst(
    dsn: str, store: AllocationStore, *, n: int, within: float, stats: asyncpg.Connection
) -> dict[str, Any]:
    """``n`` allocations requested in one transaction, timed until all are ready, then released
    in one transaction, timed until all are released: the rates of :func:`lifecycle`, measured
    the same way, without its counts of commits, WAL and CPU."""
    since = await stats.fetchval("SELECT now()")
    ids = await _request(store, dsn, n)
    committed = time.monotonic()
    all_ready, ready, _ = await _poll_until(stats, ids, since, ready=True, within=within)
    ready_seconds = time.monotonic() - committed
    await _release(store, dsn, ids)
    release_committed = time.monotonic()
    all_done, done, _ = await _poll_until(stats, ids, since, ready=False, within=within)
    release_seconds = time.monotonic() - release_committed
    return {
        "n": n,
        "complete": all_ready and all_done,
        "ready": ready,
        "ready_seconds": ready_seconds,
        "ready_rate": ready / ready_seconds,
        "lifecycle_rate": min(ready, done) / (ready_seconds + release_seconds),
    }


# Each ledger row of the run against the one before it of the same allocation (or, for the
# first, the allocation's creation): where an allocation's time goes, step by step, by the
# database's clock. "ready" is a step of its own when the connect made the row ready.
LEDGER_STEPS = """
WITH rows AS (
    SELECT l.kind || ':' || l.phase AS step,
           extract(epoch FROM l.at - coalesce(
               lag(l.at) OVER (PARTITION BY l.allocation_id ORDER BY l.seq), a.created_at)) AS gap,
           l.seq
    FROM hubd_allocation_ledger l JOIN hubd_allocations a ON a.id = l.allocation_id
    WHERE a.created_at >= $1
)
SELECT step, count(*) AS n, min(seq) AS first,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY gap) * 1000 AS p50_ms,
       percentile_cont(0.9) WITHIN GROUP (ORDER BY gap) * 1000 AS p90_ms
FROM rows GROUP BY step ORDER BY first
"""


async def ledger_steps(stats: asyncpg.Connection, since: datetime) -> list[dict[str, Any]]:
    """The median and 90th percentile of each ledger step of the allocations created since
    ``since`` (the time since the allocation's previous ledger row), in the order they first
    occurred."""
    return [
        {"step": r["step"], "n": r["n"], "p50_ms": r["p50_ms"], "p90_ms": r["p90_ms"]}
        for r in await stats.fetch(LEDGER_STEPS, since)
    ]


HUBD_TABLES = (
    "hubd_allocations",
    "hubd_allocation_ledger",
    "hubd_sidecar_connections",
    "hubd_sidecar_secrets",
    "hubd_instances",
)


async def vacuum(stats: asyncpg.Connection) -> None:
    """Vacuum and analyze hubd's tables now, so that autovacuum finds nothing to do in the
    windows that follow: an earlier run's churn otherwise brings it (ten or so transactions a
    round) into the next daemon's idle window, which then read 2.3 commits/s instead of 1."""
    await stats.execute(f"VACUUM (ANALYZE) {', '.join(HUBD_TABLES)}")


async def idle_commits(stats: asyncpg.Connection, *, seconds: float) -> dict[str, Any]:
    """Commits per second of the database while the daemon has nothing to do; call after the
    statistics of earlier work have been reported (``STATS_LAG`` of quiet)."""
    before = await xact_commit(stats)
    await asyncio.sleep(seconds)
    after = await xact_commit(stats)
    return {
        "seconds": seconds,
        "commits": after - before - 1,
        "rate": (after - before - 1) / seconds,
    }


async def latency(dsn: str, watcher: Watcher, farm: FarmClient, *, samples: int) -> dict[str, Any]:
    """One allocation at a time on an idle daemon, on the host's wall clock: from the farm's
    receipt of the welcome, and from the start of its handshake, to this process's receipt of
    the ready notification (sent at the commit that made the row ready); and to the database
    clock of that update. When a connect makes its parked allocation ready in the statement that
    records it, the row is ready before the welcome is sent: welcome → ready is then negative,
    and dial → ready is the whole cost a sidecar sees."""
    db, store = await open_store(dsn)
    to_notify: list[float] = []
    to_update: list[float] = []
    from_dial: list[float] = []
    try:
        for _ in range(samples):
            index = (await farm.call("status"))["welcomes"]
            (allocation_id,) = await _request(store, dsn, 1)
            if not await watcher.until(lambda a=allocation_id: a in watcher.ready, within=60):
                raise RuntimeError(f"{allocation_id} did not become ready within 60 s")
            received, updated = watcher.ready[allocation_id]
            welcomed: list[float] = []
            deadline = time.monotonic() + 10
            while not welcomed and time.monotonic() < deadline:
                welcomes = (await farm.call("welcomes_since", index=index))["welcomes"]
                welcomed = [t for a, t in welcomes if a == allocation_id]
                if not welcomed:
                    await asyncio.sleep(0.001)
            if not welcomed:
                raise RuntimeError(f"the farm has no welcome for {allocation_id}")
            dialed = (await farm.call("dialed", allocation_id=allocation_id))["at"]
            to_notify.append((received - welcomed[-1]) * 1000)
            to_update.append((updated - welcomed[-1]) * 1000)
            from_dial.append((received - dialed) * 1000)
            await _release(store, dsn, [allocation_id])
            if not await watcher.until(lambda a=allocation_id: a in watcher.done, within=60):
                raise RuntimeError(f"{allocation_id} was not released within 60 s")
    finally:
        await db.close()
    return {
        "samples": samples,
        "p50_ms": statistics.median(to_notify),
        "p99_ms": percentile(to_notify, 0.99),
        "update_p50_ms": statistics.median(to_update),
        "update_p99_ms": percentile(to_update, 0.99),
        "dial_p50_ms": statistics.median(from_dial),
        "dial_p99_ms": percentile(from_dial, 0.99),
    }


async def socket_phase(
    dsn: str,
    watcher: Watcher,
    farm: FarmClient,
    daemon: DaemonProcess,
    *,
    n: int,
    within: float,
    storms: int = 1,
    before_storm: Callable[[], Awaitable[None]] | None = None,
    opener: Callable[[str], Awaitable[tuple[Any, Any]]] | None = None,
) -> dict[str, Any]:
    """On a fresh daemon: ``n`` allocations provisioned while the farm holds their sockets back,
    daemon RSS measured, all sockets opened, RSS measured once all are ready. Then, ``storms``
    times: ``before_storm`` (the baseline's storm, so the two are taken side by side), then
    every socket is dropped at once (the time until the daemon has recorded every loss is the
    loss rate); once it has, all reconnect ``concurrency`` at a time, timed until every welcome,
    with the CPU the daemon, the farm and PostgreSQL spent meanwhile. Finally all are released.
    The storm's rate is the median of its repetitions: one storm of a few seconds on a shared
    2-core machine varies by a third from one run to the next. ``opener`` opens what requests
    and releases (:func:`open_store` unless given)."""
    db, store = await (opener or open_store)(dsn)
    try:
        watcher.reset()
        since = await db.pool.fetchval("SELECT now()")
        await farm.call("hold", value=True)
        ids = await _request(store, dsn, n)
        if not await _provisioned(dsn, ids, within=within):
            raise RuntimeError(f"{n} allocations were not all provisioned within {within} s")
        await asyncio.sleep(2)  # let the claims' leftovers be collected before measuring
        say(f"{n} provisioned, sockets held back")
        rss_before = rss_kib(daemon.pid)
        await farm.call("hold", value=False)
        await farm.call("connect_held")
        if not await watcher.until(lambda: len(watcher.ready) >= n, within=within):
            raise RuntimeError(f"only {len(watcher.ready)} of {n} became ready")
        await asyncio.sleep(2)
        say(f"{n} ready")
        rss_after = rss_kib(daemon.pid)
        runs: list[dict[str, Any]] = []
        for _ in range(storms):
            if before_storm is not None:
                await before_storm()
            runs.append(
                await _storm(db, watcher, farm, daemon, ids=ids, since=since, within=within)
            )
        await _release(store, dsn, ids)
        await watcher.until(lambda: len(watcher.done) >= n, within=within)
        await farm.call("forget")
    finally:
        await db.close()
    return {
        "n": n,
        "rss_before_kib": rss_before,
        "rss_after_kib": rss_after,
        "kib_per_socket": (rss_after - rss_before) / n,
        "dropped": runs[0]["dropped"],
        "storm_rates": [run["count"] / run["seconds"] for run in runs],
        "storm_rate": statistics.median(run["count"] / run["seconds"] for run in runs),
        "storm_refusals": sum(run["refusals"] for run in runs),
        # From the drop until the database says every sidecar is lost (each row's connection
        # record cleared and its connect deadline set), through the watcher's notifications.
        "loss_rates": [n / run["loss_seconds"] for run in runs],
        "loss_rate": statistics.median(n / run["loss_seconds"] for run in runs),
        "storm_cpu_ms": _median_each([run["cpu_ms"] for run in runs]),
        # Per handshake of the storm, each batcher's statements (the batch size is the inverse).
        "storm_statements": _median_each([run["statements"] for run in runs]),
    }


async def _storm(
    db: Any,
    watcher: Watcher,
    farm: FarmClient,
    daemon: DaemonProcess,
    *,
    ids: list[str],
    since: datetime,
    within: float,
) -> dict[str, Any]:
    """One storm of ``socket_phase``: every socket dropped, every loss awaited, all reconnected;
    returns when every row is ready again."""
    n = len(ids)
    postgres = await _postgres(db)
    dropping = time.monotonic()
    dropped = (await farm.call("drop", kind="hubd"))["dropped"]
    if not await watcher.until(lambda: len(watcher.lost) >= n, within=within):
        raise RuntimeError(f"the daemon recorded {len(watcher.lost)} of {n} losses")
    loss_seconds = time.monotonic() - dropping
    say(f"{dropped} dropped, every loss recorded in {loss_seconds:.2f} s; storm")
    # As before the bare server's storm: every close seen, then a quiet moment.
    await asyncio.sleep(2)
    # The watcher is the bench's instrument, not the daemon's work: its trigger and its
    # notification per row (which wakes every listener of the database, the daemon's too, and
    # this process) stay out of the storm; readiness is polled afterwards.
    await watcher.mute()
    try:
        counted = await daemon.metrics()
        before = cpu(**_storm_groups(daemon, farm, postgres))
        storm = await farm.call("reconnect", kind="hubd", n=n)
        spent = _spent(before, cpu(**_storm_groups(daemon, farm, postgres)))
        batches = _batches(counted, await daemon.metrics(), storm["count"])
    finally:
        await watcher.unmute()
    say(f"storm done in {storm['seconds']:.2f} s")
    async with db.pool.acquire() as conn:
        again, ready, _polls = await _poll_until(conn, ids, since, ready=True, within=within)
    if not again:
        raise RuntimeError(f"only {ready} of {n} were ready again")
    watcher.polled_ready(ids)
    return {
        **storm,
        "dropped": dropped,
        "loss_seconds": loss_seconds,
        "cpu_ms": _per(spent, storm["count"]),
        "statements": batches,
    }


# The handshake's statements: one admission (since 2026-12-04) or, in daemons before it, a
# look-up and a record; any of them a daemon does not have reads 0.
STORM_BATCHERS = ("connection-admissions", "identity-lookups", "connection-records")


def _batches(
    before: dict[str, float], after: dict[str, float], handshakes: int
) -> dict[str, float]:
    """Statements per handshake of each batcher a storm goes through, from two reads of the
    daemon's ``hubd_batched_statements_total``."""
    key = "hubd_batched_statements_total{{{}}}"
    return {
        name: (after.get(key.format(name), 0.0) - before.get(key.format(name), 0.0))
        / max(handshakes, 1)
        for name in STORM_BATCHERS
    }


async def backend_pid(db: Any) -> int:
    """The process id of a backend of ``db``'s pool (its siblings are the server's processes)."""
    async with db.pool.acquire() as conn:
        pid: int = await conn.fetchval("SELECT pg_backend_pid()")
        return pid


async def _postgres(db: Any) -> list[int]:
    """The database server's processes, read again after each storm (pool connections come
    and go); empty when the server runs on another machine."""
    return server_processes(await backend_pid(db))


def _storm_groups(
    daemon: DaemonProcess, farm: FarmClient, postgres: list[int]
) -> dict[str, list[int]]:
    # The bench's own process too: whatever it spends during a storm is on the same two cores.
    return {
        "daemon": [daemon.pid],
        "farm": [farm.pid],
        "postgres": postgres,
        "bench": [os.getpid()],
    }


def cpu(**groups: list[int]) -> dict[str, float]:
    return {name: cpu_seconds(pids) for name, pids in groups.items()}


def _spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in before}


def _per(spent: dict[str, float], count: int) -> dict[str, float]:
    """CPU milliseconds per handshake, by process group."""
    return {name: seconds * 1000 / count for name, seconds in spent.items()}


def _median_each(runs: list[dict[str, float]]) -> dict[str, float]:
    return {name: statistics.median(run[name] for run in runs) for name in runs[0]}


async def _provisioned(dsn: str, ids: list[str], *, within: float) -> bool:
    """Whether every allocation reached ``allocated`` (waiting for its sidecar) in time;
    polled every 200 ms (this phase counts no commits)."""
    conn = await asyncpg.connect(dsn)
    try:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            waiting = await conn.fetchval(
                "SELECT count(*) FROM hubd_allocations WHERE id = ANY($1::text[])"
                " AND status = 'allocated'",
                ids,
            )
            if waiting >= len(ids):
                return True
            await asyncio.sleep(0.2)
        return False
    finally:
        await conn.close()


class BareSockets:
    """The same for a bare websockets server: RSS before and after ``n`` idle sockets, then a
    storm at each :meth:`storm` (all dropped and reopened ``concurrency`` at a time), with the
    CPU the server and the farm spent meanwhile.

    Its storms are run in turn with hubd's (``socket_phase``'s ``before_storm``): on this shared
    2-core machine the bare server's storm rate moved by a fifth between runs minutes apart
    (2,296 to 2,852 handshakes/s at 2,000), so storms taken before hubd's were, like single
    samples of the floor, a draw on the machine's state.
    """

    def __init__(self, farm: FarmClient, *, n: int) -> None:
        self._farm = farm
        self._n = n
        self._server = BareServer()
        self._runs: list[dict[str, Any]] = []
        self._measured: dict[str, float] = {}

    async def start(self) -> None:
        """Start the server and open the ``n`` idle sockets, RSS read before and after."""
        await self._server.start()
        await asyncio.sleep(0.5)
        rss_before = rss_kib(self._server.pid)
        opened = await self._farm.call("reconnect", kind="bare", url=self._server.url, n=self._n)
        await asyncio.sleep(2)
        self._measured = {
            "rss_before_kib": rss_before,
            "rss_after_kib": rss_kib(self._server.pid),
            "first_connect_rate": self._n / opened["seconds"],
        }

    async def storm(self) -> None:
        """Drop every socket and open them all again, timed, with the CPU spent."""
        server, farm = self._server, self._farm
        await farm.call("drop", kind="bare")
        await asyncio.sleep(2)  # the server sees every close before the storm
        groups = {"server": [server.pid], "farm": [farm.pid], "bench": [os.getpid()]}
        before = cpu(**groups)
        storm = await farm.call("reconnect", kind="bare", url=server.url, n=self._n)
        spent = _spent(before, cpu(**groups))
        self._runs.append({**storm, "cpu_ms": _per(spent, self._n)})

    async def stop(self) -> None:
        await self._farm.call("drop", kind="bare")
        await self._server.stop()

    def result(self) -> dict[str, Any]:
        n, runs, measured = self._n, self._runs, self._measured
        return {
            "n": n,
            **measured,
            "kib_per_socket": (measured["rss_after_kib"] - measured["rss_before_kib"]) / n,
            "storm_rates": [n / run["seconds"] for run in runs],
            "storm_rate": statistics.median(n / run["seconds"] for run in runs),
            "storm_cpu_ms": _median_each([run["cpu_ms"] for run in runs]),
        }
