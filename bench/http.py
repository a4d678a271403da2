"""The HTTP API measured: request → ready through HTTP against SQL, event stream delivery, the
long-poll's answer, and the memory of idle streams, all on one daemon in one run.

    .venv/bin/python -m bench.http [--size tiny|quick|full] [--json http.json]

One ``hubd run`` (production defaults, the instant provisioner and the farm of ``python -m
bench``) with ``[http] listen`` set and ``max_streams_per_key`` raised to hold a burst's waits.
The feed's ``at`` (``clock_timestamp()`` in the commit that wrote the event) and this process's
``time.time()`` read the same system clock: their difference is a delay, not a skew.

1. **request → ready**, ``samples`` rounds of one allocation through HTTP (``POST``, then
   ``GET …/wait?until=ready``) and one through SQL (``Client.request``, then ``wait_ready``),
   walled into one tenant, in alternating order: from the start to the ``ready`` event's ``at``
   (feed) and to the answer (observed); and from that ``at`` to the answer (**the wait**).
   Then ``bursts`` bursts of ``burst`` each way, alternating: HTTP, a request and a wait each;
   SQL, the requests, then one ``Client.events`` follower (a ``wait_ready`` each would hold a
   connection each); ``burst`` over the time to the last ``ready`` (feed) or answer.
2. **event streams**: ``streams`` streams of ``GET /v1/events`` on one key while ``churn``
   allocations of its tenant are requested, become ready and are released (20 a second): each
   event's delay from its ``at`` to each stream; again beside the idle streams of 3.
3. **idle streams**: ``idle`` streams, 8 per key (the default cap), each key its own tenant's:
   the daemon's ``VmRSS`` before and 2 s after they open, and their heartbeats over ``hold`` s.

Goals (issue 56): stream delivery p99 ≤ 50 ms; the wait's answer p99 ≤ 20 ms after ready.
``python -m bench`` runs it as its ``http`` part.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import attrs

from bench import standalone
from bench.phases import PROVISIONER, daemon_config, percentile, say, vacuum
from bench.procs import DaemonProcess, FarmClient, rss_kib
from bench.table import columns, labels, lookup, number
from hubd.client import Client
from hubd.http.stream import HEARTBEAT
from hubd.store import connect_database
from hubd.store.api_keys import ApiKeyStore

__all__ = ["GOALS", "LOADS", "Load", "main", "measure", "measures", "render"]

TENANT = "bench-http"
PER_KEY = 8
HOLD = HEARTBEAT + 3
"""Seconds the idle streams are held after the last opened: each has had a heartbeat."""
"""Idle streams per key: the default ``max_streams_per_key``."""


@attrs.frozen(kw_only=True)
class Load:
    samples: int
    """Rounds of request → ready, one allocation each way a round."""
    burst: int
    bursts: int
    streams: int
    """Event streams open on one key while ``churn`` allocations come and go."""
    churn: int
    idle: int
    hold: float


LOADS = {
    # For the smoke test: every figure, numbers meaningless.
    "tiny": Load(samples=6, burst=20, bursts=1, streams=5, churn=8, idle=40, hold=HOLD),
    "quick": Load(samples=100, burst=200, bursts=2, streams=50, churn=100, idle=1_000, hold=HOLD),
    "mid": Load(samples=200, burst=200, bursts=3, streams=50, churn=200, idle=1_000, hold=HOLD),
    "full": Load(samples=300, burst=500, bursts=3, streams=100, churn=300, idle=2_000, hold=HOLD),
}

FEED = (
    "SELECT allocation_id, event, position, extract(epoch FROM at)::float8 AS at "
    "FROM hubd_events WHERE allocation_id = ANY($1::text[]) AND event IN ('requested', 'ready')"
)
ENDED = (
    "SELECT count(*) FROM hubd_allocations WHERE id = ANY($1::text[]) "
    "AND status IN ('released', 'failed', 'destroy_failed')"
)
READY = "SELECT count(*) FROM hubd_events WHERE allocation_id = ANY($1::text[]) AND event = 'ready'"
TENANT_EVENTS = (
    "SELECT position, extract(epoch FROM at)::float8 AS at FROM hubd_events "
    "WHERE position > $1 AND tenant_id = $2 ORDER BY position"
)


def _stats(values: list[float]) -> dict[str, Any]:
    got = [statistics.median(values), percentile(values, 0.99), max(values)] if values else []
    return {"n": len(values), **dict(zip(("p50_ms", "p99_ms", "max_ms"), got, strict=False))}


async def _until(
    count: Callable[[], Awaitable[int]], wanted: int, failure: str, *, within: float = 120
) -> None:
    deadline = time.monotonic() + within
    while await count() < wanted:
        if time.monotonic() > deadline:
            raise RuntimeError(failure)
        await asyncio.sleep(0.1)


def _session(key: str) -> aiohttp.ClientSession:
    # No limit on connections: a burst's requests all at once, as as many clients would send.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=0)
    headers = {"Authorization": f"Bearer {key}"}
    return aiohttp.ClientSession(headers=headers, connector=connector, timeout=timeout)


class _Bench:
    """The daemon's HTTP address and key, a walled SQL client, and a statistics connection."""

    def __init__(self, url: str, key: str, client: Client, stats: asyncpg.Connection) -> None:
        self.url = url
        self.key = key
        self.sql = client
        self.stats = stats
        self.http = _session(key)

    async def via_http(self) -> tuple[str, float]:
        async with self.http.post(
            f"{self.url}/v1/allocations", json={"provisioner": PROVISIONER}
        ) as answer:
            created = await answer.json()
            assert answer.status == 201, created
        path = f"/v1/allocations/{created['id']}/wait?until=ready&timeout=120"
        async with self.http.get(self.url + path) as answer:
            ready = await answer.json()
            assert answer.headers.get("Hubd-Wait") == "ready", ready
        return created["id"], time.time()

    async def via_sql(self) -> tuple[str, float]:
        info = await self.sql.request(PROVISIONER)
        await self.sql.wait_ready(info.id, 120)
        return info.id, time.time()

    async def feed(self, ids: list[str]) -> dict[str, dict[str, float]]:
        """Each allocation's ``requested`` and ``ready`` moments, epoch seconds."""
        found: dict[str, dict[str, float]] = {}
        for row in await self.stats.fetch(FEED, ids):
            found.setdefault(row["allocation_id"], {}).setdefault(row["event"], row["at"])
        return found

    async def finish(self, ids: list[str]) -> None:
        """All of ``ids`` released and terminal, so the next step starts from an idle daemon."""
        for allocation_id in ids:
            await self.sql.release(allocation_id, reason="benchmark done")
        await _until(lambda: self.count(ENDED, ids), len(ids), f"not all {len(ids)} ended")

    async def count(self, query: str, ids: list[str]) -> int:
        return int(await self.stats.fetchval(query, ids))


async def _latency(bench: _Bench, load: Load) -> dict[str, Any]:
    """Request → ready one at a time, HTTP and SQL alternating which goes first."""
    runs: dict[str, list[tuple[str, float, float]]] = {"http": [], "sql": []}
    ways: dict[str, Callable[[], Awaitable[tuple[str, float]]]]
    ways = {"http": bench.via_http, "sql": bench.via_sql}
    for index in range(load.samples):
        for way in ("http", "sql") if index % 2 == 0 else ("sql", "http"):
            started = time.time()
            allocation_id, answered = await ways[way]()
            runs[way].append((allocation_id, started, answered))
        await bench.finish([each[0] for way in runs for each in runs[way][-1:]])
    result: dict[str, Any] = {}
    for way, samples in runs.items():
        feed = await bench.feed([each[0] for each in samples])
        ready = [(feed[i]["ready"] - start) * 1000 for i, start, _ in samples]
        seen = [(end - start) * 1000 for _, start, end in samples]
        after = [(end - feed[i]["ready"]) * 1000 for i, _, end in samples]
        result[way] = {"ready": _stats(ready), "observed": _stats(seen), "answer": _stats(after)}
    return result


async def _burst(bench: _Bench, way: str, n: int) -> dict[str, Any]:
    started = time.time()
    if way == "http":
        done = await asyncio.gather(*(bench.via_http() for _ in range(n)))
        ids, ended = [each[0] for each in done], max(each[1] for each in done)
    else:
        since = await bench.sql.cursor()
        ids = [
            each.id
            for each in await asyncio.gather(*(bench.sql.request(PROVISIONER) for _ in range(n)))
        ]
        wanted = set(ids)
        events = bench.sql.events(since=since)
        async with contextlib.aclosing(events):
            async for event in events:
                if event.event == "ready":
                    wanted.discard(event.allocation_id)
                if not wanted:
                    break
        ended = time.time()
    last = max(each["ready"] for each in (await bench.feed(ids)).values())
    await bench.finish(ids)
    return {"n": n, "rate": n / (last - started), "observed": n / (ended - started)}


class _Stream:
    """One ``GET /v1/events``, reading until cancelled: each event's arrival and the
    heartbeats."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.arrived: dict[int, float] = {}
        self.heartbeats = 0
        self.ended = False
        self.opened = asyncio.Event()
        self._task = asyncio.create_task(self._read(session, url))

    async def _read(self, session: aiohttp.ClientSession, url: str) -> None:
        position = None
        try:
            async with session.get(url) as answer:
                if answer.status != 200:
                    raise RuntimeError(f"{answer.status}: {await answer.text()}")
                self.opened.set()
                async for line in answer.content:
                    if line.startswith(b"id: "):
                        position = int(line[4:])
                    elif line.startswith(b": heartbeat"):
                        self.heartbeats += 1
                    elif line == b"\n" and position is not None:
                        self.arrived[position] = time.time()
                        position = None
        finally:
            self.ended = True

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def wait_open(self) -> None:
        waiting = asyncio.ensure_future(self.opened.wait())
        await asyncio.wait({waiting, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done():
            waiting.cancel()
            self._task.result()  # the stream's own error


async def _open(sessions: list[aiohttp.ClientSession], url: str, n: int) -> list[_Stream]:
    """``n`` streams, 100 opening at a time (the listener's backlog is 512)."""
    streams = [_Stream(sessions[i // PER_KEY % len(sessions)], url) for i in range(n)]
    for start in range(0, n, 100):
        await asyncio.gather(*(each.wait_open() for each in streams[start : start + 100]))
    return streams


async def _delivery(bench: _Bench, load: Load, churn: int) -> dict[str, Any]:
    """``load.streams`` streams on the bench's key while ``churn`` allocations are requested
    (20 a second), become ready and are released: each event's delay to each stream."""
    since = await bench.sql.cursor()
    streams = await _open([bench.http], f"{bench.url}/v1/events?after={since}", load.streams)
    try:
        ids = []
        for _ in range(churn):
            ids.append((await bench.sql.request(PROVISIONER)).id)
            await asyncio.sleep(0.05)
        await _until(lambda: bench.count(READY, ids), churn, "the churn did not become ready")
        for allocation_id in ids:
            await bench.sql.release(allocation_id, reason="benchmark done")
            await asyncio.sleep(0.05)
        await bench.finish(ids)
        committed = {
            r["position"]: r["at"] for r in await bench.stats.fetch(TENANT_EVENTS, since, TENANT)
        }
        with contextlib.suppress(RuntimeError):  # what never came is counted as missed

            async def arrived() -> int:
                return min(len(each.arrived) for each in streams)

            await _until(arrived, len(committed), "", within=30)
    finally:
        for each in streams:
            await each.close()
    delays = [(s.arrived[p] - at) * 1000 for s in streams for p, at in committed.items()
              if p in s.arrived]  # fmt: skip
    return {"streams": load.streams, "events": len(committed), **_stats(delays),
            "missed": len(committed) * len(streams) - len(delays)}  # fmt: skip


async def _keys(dsn: str, tenants: list[str]) -> list[str]:
    """A new key for each of ``tenants``."""
    db = await connect_database(dsn, pool_size=1)
    try:
        store = ApiKeyStore(db)
        return [(await store.create(tenant=tenant, name="bench"))[1] for tenant in tenants]
    finally:
        await db.close()


async def measure(
    dsn: str, farm: FarmClient, workdir: Path, load: Load, *, root: Path | None = None
) -> dict[str, Any]:
    """Every figure on one fresh daemon (of the checkout ``root``; ``None``: this one)."""
    cap = max(load.burst, load.streams) + PER_KEY
    config = daemon_config(workdir / "hubd-http.toml", database_url=dsn, claims=16,
                           state_dir=workdir / "state-http", farm=farm.socket_path)  # fmt: skip
    with config.open("a") as text:
        text.write(f'\n[http]\nlisten = "127.0.0.1:0"\nmax_streams_per_key = {cap}\n')
    daemon = DaemonProcess(config, max_sockets=load.burst + 1_000, root=root)
    result: dict[str, Any] = {"load": attrs.asdict(load)}
    async with contextlib.AsyncExitStack() as undo:
        undo.push_async_callback(farm.call, "forget")
        key, *idle_keys = await _keys(
            dsn, [TENANT, *(f"bench-idle-{i}" for i in range(math.ceil(load.idle / PER_KEY)))]
        )
        undo.push_async_callback(daemon.stop)
        await daemon.start()
        stats = await asyncpg.connect(dsn)
        undo.push_async_callback(stats.close)
        await vacuum(stats)
        client = await Client.connect(dsn, max_size=16)
        undo.push_async_callback(client.close)
        bench = _Bench(f"http://{daemon.running['http']}", key, client.for_tenant(TENANT), stats)
        undo.push_async_callback(bench.http.close)
        # Unmeasured: the pools' first connections and the farm's first sockets.
        await bench.finish([(await bench.via_http())[0], (await bench.via_sql())[0]])
        say("http: request → ready, one at a time, HTTP and SQL in turn")
        result["latency"] = await _latency(bench, load)
        say("http: bursts")
        bursts: dict[str, list[dict[str, Any]]] = {"http": [], "sql": []}
        for index in range(load.bursts):
            for way in ("http", "sql") if index % 2 == 0 else ("sql", "http"):
                bursts[way].append(await _burst(bench, way, load.burst))
        result["burst"] = {way: {k: statistics.median(r[k] for r in each)
                                 for k in ("rate", "observed")} | {"rounds": each}
                           for way, each in bursts.items()}  # fmt: skip
        say(f"http: {load.streams} event streams on one key")
        result["sse"] = await _delivery(bench, load, load.churn)
        result["idle"], result["sse_beside_idle"] = await _idle(bench, daemon, load, idle_keys)
    return result


async def _idle(
    bench: _Bench, daemon: DaemonProcess, load: Load, keys: list[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The idle streams' memory and heartbeats, then stream delivery beside them."""
    await asyncio.sleep(2)
    before = rss_kib(daemon.pid)
    sessions = [_session(key) for key in keys]
    streams: list[_Stream] = []
    try:
        say(f"http: {load.idle} idle streams")
        started = time.monotonic()
        streams = await _open(sessions, f"{bench.url}/v1/events", load.idle)
        opened_s = time.monotonic() - started
        await asyncio.sleep(2)
        after = rss_kib(daemon.pid)
        await asyncio.sleep(max(0.0, started + opened_s + load.hold - time.monotonic()))
        held = rss_kib(daemon.pid)
        idle = {"n": load.idle, "keys": len(keys), "open_seconds": opened_s,
                "rss_before_kib": before, "rss_after_kib": after, "rss_held_kib": held,
                "kib_per_stream": (after - before) / load.idle, "held_seconds": load.hold,
                "with_heartbeat": sum(1 for s in streams if s.heartbeats),
                "ended": sum(1 for s in streams if s.ended),
                "lost": sum(1 for s in streams if s.ended or not s.heartbeats)}  # fmt: skip
        say(f"http: {load.streams} event streams beside the idle ones")
        beside = await _delivery(bench, load, max(4, load.churn // 4))
    finally:
        for each in streams:
            await each.close()
        for session in sessions:
            await session.close()
    return idle, beside


# key|measure|figure|unit: ``{w}`` reads HTTP's figure, and SQL's as the baseline; a key with
# ``{q}`` is two rows, p50 and p99; the measure's other names are the load's.
ROWS = (
    "ready_{q}|request → ready {q}, feed, HTTP (vs SQL), {samples}|latency.{w}.ready.{q}_ms|ms",
    "observed_{q}|request → answer {q}, HTTP (vs SQL), {samples}|latency.{w}.observed.{q}_ms|ms",
    "wait_{q}|ready → answer {q}, /wait (vs wait_ready)|latency.{w}.answer.{q}_ms|ms",
    "burst_rate|burst of {burst} to its last ready, feed, HTTP (vs SQL)|burst.{w}.rate|alloc/s",
    "burst_observed|burst of {burst} to its last answer, HTTP (vs SQL)|burst.{w}.observed|alloc/s",
    "sse_{q}|event commit → each of {streams} streams, {q}|sse.{q}_ms|ms",
    "sse_missed|events missed, {streams} streams|sse.missed|events",
    "sse_idle_{q}|the same beside {idle} idle streams, {q}|sse_beside_idle.{q}_ms|ms",
    "sse_idle_missed|events missed beside {idle} idle streams|sse_beside_idle.missed|events",
    "idle_kib|RSS per idle stream, {idle}|idle.kib_per_stream|KiB",
    "idle_lost|idle streams ended or with no heartbeat after {hold}s|idle.lost|streams",
)
GOALS = {"http_wait_p99": 20.0, "http_sse_p99": 50.0, "http_sse_idle_p99": 50.0}
GOALS |= dict.fromkeys(("http_sse_missed", "http_sse_idle_missed", "http_idle_lost"), 0.0)


def measures(result: dict[str, Any] | None) -> list[tuple[Any, ...]]:
    """The table's rows, as ``(key, measure, HTTP, SQL, goal, unit)``: HTTP is hubd's column,
    SQL the baseline's; a goal is an upper bound; ``None`` where the part did not run."""
    got = result or {}
    load = got.get("load", {})
    rows = []
    for spec in ROWS:
        key, label, path, unit = spec.split("|")
        for q in ("p50", "p99") if "{q}" in key else ("",):
            name = "http_" + key.format(q=q)
            ours, base = (lookup(got, path.format(q=q, w=w)) for w in ("http", "sql"))
            text = label.format_map(labels(load, q=q))
            rows.append((name, text, ours, base if "{w}" in path else None, GOALS.get(name), unit))
    return rows


def render(result: dict[str, Any]) -> str:
    """The table of a ``measure`` result."""
    lines = [("measure", "unit", "SQL", "HTTP", "goal", "met")]
    for _, label, ours, base, goal, unit in measures(result):
        met = "" if goal is None or ours is None else ("yes" if ours <= goal else "NO")
        goal_text = "" if goal is None else f"≤ {goal:g}"
        lines.append((label, unit, number(base), number(ours), goal_text, met))
    out = columns(lines, right=(2, 3))
    i = result["idle"]
    out.append(f"\n{i['n']:,} idle streams on {i['keys']} keys: RSS {i['rss_before_kib']:,} → "
               f"{i['rss_after_kib']:,} KiB, {i['rss_held_kib']:,} after {i['held_seconds']:g} s; "
               f"{i['with_heartbeat']:,} had a heartbeat")  # fmt: skip
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    return standalone.main(
        argv, part="http", doc=__doc__, sizes=LOADS, measure=measure, render=render
    )


if __name__ == "__main__":
    sys.exit(main())
