"""hubd's benchmark suite: every measure and its baseline in one invocation, one table, one JSON.

    .venv/bin/python -m bench --quick                 a minute or three
    .venv/bin/python -m bench --size full --json bench.json --profile lifecycle.raw

What runs, in order, on one PostgreSQL (the embedded one in a temporary directory, or
``--database-url``, a maintenance DSN allowed to create databases):

1. baselines with no daemon running: the hand floor (claim with lease + 7 fenced statements per
   allocation, asyncpg, 16 workers) with its commits counted, and PgQueuer batch 1;
2. periodic statement cost at 10,000 and at many more terminal rows (``bench.scale``);
3. for 16, 64 and 256 ``max_concurrent_claims``, a fresh ``hubd run``: the lifecycle of N
   allocations, the commits it took, then idle commits per second; at 16 also the same burst
   with every sidecar dialling from one address (on another fresh daemon), and connect → ready
   latency on the then idle daemon;
4. fair claiming (``bench.fairness``): on a fresh daemon of the default claim count, one
   tenant's request → ready latency alone and under another tenant's burst of ten times as
   many, with the fair claim and with the former FIFO one;
5. deadlines under load (``bench.deadlines``): on two fresh replicas, how late lifetimes and
   idle timeouts end while other requests come and go and one replica is paused, then killed
   and restarted, and whether any ended twice or never;
6. the HTTP API (``bench.http``): on a fresh daemon serving it, request → ready through HTTP
   against SQL, event stream delivery and the wait's answer after commit, idle streams' memory;
7. warm pools (``bench.pools``): on a fresh daemon with a pool of each provisioner, warm
   request → ready beside cold, a burst against the full pool, recovery after one of twice
   its size, the refill rate;
8. for every socket count, a fresh daemon and a fresh bare websockets server: RSS per idle
   socket and the reconnect storm.

See docs/performance.md for what each measure means and a recorded run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import attrs

from bench import baselines, databases, deadlines, fairness, http, phases, pools, scale
from bench.procs import DaemonProcess, FarmClient, raise_open_files, server_processes
from bench.report import Measures, profile_summary, render
from bench.watch import Watcher, xact_commit
from hubd.claimrules import DEFAULT_CLAIMS
from hubd.daemon.loops import EVENT_LOOPS
from hubd.store.embedded import EmbeddedPostgres

__all__ = ["SIZES", "Size", "main", "run"]

CLAIMS = (16, 64, 256)
ONE_SOURCE = "127.0.0.1"
"""The one address of the one-address burst: the local provisioner's sidecars dial from it."""


@attrs.frozen(kw_only=True)
class Size:
    lifecycle: int
    sockets: tuple[int, ...]
    storms: int
    """Reconnect storms per socket count (the rate reported is their median)."""
    latency: int
    idle_seconds: float
    small_rows: int
    large_rows: int
    statement_reps: int
    floor: int
    pgqueuer: int
    within: float
    rounds: int
    """Rounds of the floor, PgQueuer and the three claim counts, run in turn (medians kept)."""


SIZES = {
    # For the smoke test: every measure, numbers meaningless.
    "tiny": Size(
        lifecycle=20,
        sockets=(30,),
        storms=1,
        latency=5,
        idle_seconds=2,
        small_rows=1_000,
        large_rows=3_000,
        statement_reps=5,
        floor=100,
        pgqueuer=50,
        within=60,
        rounds=1,
    ),
    "quick": Size(
        lifecycle=500,
        sockets=(1_000,),
        storms=3,
        latency=50,
        idle_seconds=5,
        small_rows=10_000,
        large_rows=100_000,
        statement_reps=50,
        floor=2_000,
        pgqueuer=1_000,
        within=180,
        rounds=3,
    ),
    "mid": Size(
        lifecycle=2_000,
        sockets=(2_000, 5_000),
        storms=3,
        latency=200,
        idle_seconds=10,
        small_rows=10_000,
        large_rows=1_000_000,
        statement_reps=200,
        floor=5_000,
        pgqueuer=2_000,
        within=600,
        rounds=3,
    ),
    "full": Size(
        lifecycle=5_000,
        sockets=(2_000, 5_000, 10_000),
        storms=3,
        latency=200,
        idle_seconds=10,
        small_rows=10_000,
        large_rows=1_000_000,
        statement_reps=200,
        floor=5_000,
        pgqueuer=5_000,
        within=1_200,
        rounds=3,
    ),
}


def machine() -> dict[str, Any]:
    memory = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = f"{int(line.split()[1]) // 1024} MiB"
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "memory": memory,
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


class Run:
    """One invocation: the databases, the farm, the watcher, and what was measured."""

    def __init__(self, args: argparse.Namespace, size: Size, workdir: Path) -> None:
        self.args = args
        self.size = size
        self.workdir = workdir
        self.measures = Measures()
        self.results: dict[str, Any] = {}
        self.rounds: dict[str, list[dict[str, Any]]] = {}
        self.dsn = ""
        self.floor_dsn = ""
        self.farm = FarmClient(workdir / "farm.sock", loop=args.farm_loop)
        self.watcher = Watcher()
        self.stats: asyncpg.Connection | None = None
        self.config: phases.BenchConfig | None = None
        self.daemon_root: Path | None = None
        """Another checkout whose daemon runs (``bench.compare``); ``None``: this one."""
        self.open_store: Callable[[str], Awaitable[tuple[Any, Any]]] = phases.open_store
        """How the claim parts request and release: this checkout's store, or the SQL API
        (``bench.compare``, on a database another checkout migrated)."""

    async def step(
        self,
        name: str,
        work: Callable[[], Awaitable[Any]],
        *,
        combine: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None,
    ) -> Any:
        """Run one part; a failure is recorded under its name and the run goes on. A part run
        once per round has ``combine``, which makes its result of every round so far."""
        if self.args.only and name.split("_", maxsplit=1)[0] not in self.args.only:
            return None
        if "error" in self.results.get(name, {}):
            return None  # failed in an earlier round: the failure stands
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        started = time.monotonic()
        try:
            result = await work()
        except Exception as exc:  # noqa: BLE001 -- one broken measure must not hide the rest
            traceback.print_exc()
            self.results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            return None
        if combine is None:
            self.results[name] = result
        else:
            self.rounds.setdefault(name, []).append(result)
            self.results[name] = combine(self.rounds[name])
        print(f"bench: {name} done in {time.monotonic() - started:.1f} s", file=sys.stderr)
        return result

    async def daemon(self, claims: int, *, max_sockets: int = 0) -> DaemonProcess:
        assert self.config is not None
        daemon = DaemonProcess(
            self.config.write(claims=claims), max_sockets=max_sockets, root=self.daemon_root
        )
        await daemon.start()
        return daemon

    async def claims_phase(self, claims: int, *, first: bool = True) -> dict[str, Any]:
        """On a fresh daemon: idle commits, then the counted lifecycle, which ends with the
        daemon's exit; at the first claim count of the first round, latency on another fresh
        daemon (and the profile, if asked for, of the lifecycle)."""
        assert self.stats is not None
        result: dict[str, Any] = {}
        await self.watcher.mute()
        await phases.vacuum(self.stats)
        db, store = await self.open_store(self.dsn)
        # Every sidecar of the run stays connected until the release: the listener's default
        # cap (4,096) would refuse a larger run's last ones, which then never become ready.
        daemon = await self.daemon(claims, max_sockets=self.size.lifecycle + 1_000)
        profiler = None
        try:
            # Every count of the start-up reported, so the idle window and the lifecycle's see
            # only their own.
            await asyncio.sleep(phases.STATS_LAG)
            result["idle"] = await phases.idle_commits(self.stats, seconds=self.size.idle_seconds)
            if self.args.profile and claims == DEFAULT_CLAIMS and first:
                profiler = await _start_profiler(daemon.pid, self.args.profile)

            async def stop() -> None:
                result["listener_refusals"] = await daemon.refusals()
                result["statements"] = _statements(await daemon.metrics(), self.size.lifecycle)
                await daemon.stop()

            backend = await phases.backend_pid(db)

            def cpu() -> dict[str, float]:
                # The server's processes read at each sample: the daemon's pools open
                # connections as the burst arrives.
                return phases.cpu(
                    daemon=[daemon.pid],
                    postgres=server_processes(backend),
                    farm=[self.farm.pid],
                    bench=[os.getpid()],
                )

            cycle = await phases.lifecycle(
                self.dsn,
                store,
                n=self.size.lifecycle,
                within=self.size.within,
                stats=self.stats,
                stop=stop,
                cpu=cpu,
            )
        finally:
            if profiler is not None:
                await _stop_profiler(profiler)
            await daemon.stop()
            await db.close()
            await self.watcher.unmute()
            await self.farm.call("forget")
        # Commits the idle daemon would have made anyway during the window are not the
        # lifecycle's.
        cycle["commits_per_lifecycle"] = (
            cycle["commits_raw"] - result["idle"]["rate"] * cycle["window_seconds"]
        ) / self.size.lifecycle
        result["lifecycle"] = cycle
        if claims in (CLAIMS[0], CLAIMS[-1]):
            result["one_source"] = await self.one_source_burst(claims)
        if claims == CLAIMS[0] and first:
            daemon = await self.daemon(claims)
            try:
                await asyncio.sleep(1)
                result["latency"] = await phases.latency(
                    self.dsn, self.watcher, self.farm, samples=self.size.latency
                )
            finally:
                await daemon.stop()
                await self.farm.call("forget")
        return result

    async def one_source_burst(self, claims: int) -> dict[str, Any]:
        """The lifecycle's burst again, on a fresh daemon, with every sidecar dialling from
        one address; a failure is recorded here and leaves the spread burst's figures be."""
        assert self.stats is not None
        await self.watcher.mute()
        await phases.vacuum(self.stats)
        db, store = await self.open_store(self.dsn)
        await self.farm.call("sources", value=[ONE_SOURCE])
        try:
            daemon = await self.daemon(claims, max_sockets=self.size.lifecycle + 1_000)
            try:
                result = await phases.burst(
                    self.dsn,
                    store,
                    n=self.size.lifecycle,
                    within=self.size.within,
                    stats=self.stats,
                )
                result["listener_refusals"] = await daemon.refusals()
            finally:
                await daemon.stop()
        except Exception as exc:  # noqa: BLE001 -- one broken measure must not hide the rest
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            await db.close()
            await self.farm.call("sources", value=None)
            await self.farm.call("forget")
            await self.watcher.unmute()
        return result

    async def fairness_phase(self) -> dict[str, Any]:
        """``bench.fairness`` at this run's size, the watcher muted (its notifications would
        wake the daemon's listener once per ready row of the burst)."""
        await self.watcher.mute()
        try:
            return await fairness.measure(
                self.dsn,
                self.farm,
                self.workdir,
                fairness.LOADS[self.args.size],
                root=self.daemon_root,
            )
        finally:
            await self.watcher.unmute()

    async def deadlines_phase(self) -> dict[str, Any]:
        """``bench.deadlines`` at this run's size, the watcher muted as for fairness."""
        await self.watcher.mute()
        try:
            return await deadlines.measure(
                self.dsn,
                self.farm,
                self.workdir,
                deadlines.LOADS[self.args.size],
                root=self.daemon_root,
            )
        finally:
            await self.watcher.unmute()

    async def http_phase(self) -> dict[str, Any]:
        """``bench.http`` at this run's size, the watcher muted as for fairness."""
        await self.watcher.mute()
        try:
            return await http.measure(
                self.dsn, self.farm, self.workdir, http.LOADS[self.args.size], root=self.daemon_root
            )
        finally:
            await self.watcher.unmute()

    async def pools_phase(self) -> dict[str, Any]:
        """``bench.pools`` at this run's size, the watcher muted as for fairness."""
        await self.watcher.mute()
        try:
            return await pools.measure(
                self.dsn,
                self.farm,
                self.workdir,
                pools.LOADS[self.args.size],
                root=self.daemon_root,
            )
        finally:
            await self.watcher.unmute()

    async def socket_phase(self, n: int) -> dict[str, Any]:
        # The bare server's sockets stay open (idle, in their own process) while hubd's are
        # measured, so that each of its storms can run just before one of hubd's.
        bare = phases.BareSockets(self.farm, n=n)
        await bare.start()
        try:
            daemon = await self.daemon(CLAIMS[0], max_sockets=n + 1_000)
            try:
                hubd = await phases.socket_phase(
                    self.dsn,
                    self.watcher,
                    self.farm,
                    daemon,
                    n=n,
                    within=self.size.within,
                    storms=self.size.storms,
                    before_storm=bare.storm,
                    opener=self.open_store,
                )
                hubd["listener_refusals"] = await daemon.refusals()
            finally:
                await daemon.stop()
        finally:
            await bare.stop()
        return {"bare": bare.result(), "hubd": hubd}

    async def floor(self) -> dict[str, Any]:
        # A database of its own: in hubd's, the floor's churn (its tables dropped and made
        # again each round, thousands of updates) brought autovacuum into the next daemon's
        # idle window, 9 and 15 commits in 5 s against 3 in the other rounds.
        stats = await asyncpg.connect(self.floor_dsn)
        try:
            before = await xact_commit(stats)
            result = await baselines.hand_floor(self.floor_dsn, n=self.size.floor, workers=16)
            await asyncio.sleep(phases.STATS_LAG)
            after = await xact_commit(stats)
        finally:
            await stats.close()
        # Less the bench's own: schema, fill, ANALYZE, one statistics read.
        result["commits_per_lifecycle"] = (after - before - 4) / self.size.floor
        return result


def combine_rates(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A baseline over its rounds: the first round's result with the median rate (and commits
    per lifecycle), and each round's own."""
    if any("skipped" in each for each in rounds):
        return rounds[0]
    combined = dict(rounds[0])
    kept = [key for key in ("rate", "commits_per_lifecycle") if key in combined]
    for key in kept:
        combined[key] = statistics.median(each[key] for each in rounds)
    combined["rounds"] = [{key: each[key] for key in kept} for each in rounds]
    return combined


def combine_claims(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A claim count over its rounds: the first round's details (latency, ledger steps,
    statements) with the median rates, commits and WAL per lifecycle, the idle windows pooled, and
    each round's own figures."""
    combined = dict(rounds[0])
    cycles = [each["lifecycle"] for each in rounds]
    lifecycle = dict(cycles[0])
    medians = ("ready_rate", "lifecycle_rate", "commits_per_lifecycle", "wal_bytes_per_lifecycle")
    for key in medians:
        lifecycle[key] = statistics.median(cycle[key] for cycle in cycles)
    combined["lifecycle"] = lifecycle
    bursts = [each.get("one_source", {}) for each in rounds]
    if all("ready_rate" in burst for burst in bursts):
        one_source = dict(bursts[0])
        for key in ("ready_rate", "lifecycle_rate"):
            one_source[key] = statistics.median(burst[key] for burst in bursts)
        combined["one_source"] = one_source
    seconds = sum(each["idle"]["seconds"] for each in rounds)
    commits = sum(each["idle"]["commits"] for each in rounds)
    combined["idle"] = {"seconds": seconds, "commits": commits, "rate": commits / seconds}
    combined["rounds"] = [
        {
            "ready_rate": each["lifecycle"]["ready_rate"],
            "lifecycle_rate": each["lifecycle"]["lifecycle_rate"],
            "commits_per_lifecycle": each["lifecycle"]["commits_per_lifecycle"],
            "idle_rate": each["idle"]["rate"],
            "cpu_ms": each["lifecycle"]["cpu_ms"],
            "one_source_ready_rate": each.get("one_source", {}).get("ready_rate"),
        }
        for each in rounds
    ]
    return combined


def _statements(metrics: dict[str, float], n: int) -> dict[str, float]:
    """Per allocation of the lifecycle: the claim statements, and each batcher's or pipeline's
    statements (round trips) and the requests they carried; counted from the daemon's start,
    whose idle polls add a few claim statements."""
    batched = ("hubd_batched_statements_total{", "hubd_batched_requests_total{")
    claims = ("hubd_claim_statements_total", "hubd_claim_statements_idle_total")
    return {
        key.removeprefix("hubd_"): value / n
        for key, value in metrics.items()
        if key.startswith(batched) or key in claims
    }


async def _start_profiler(pid: int, path: Path) -> asyncio.subprocess.Process:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    process = await asyncio.create_subprocess_exec(
        py_spy,
        "record",
        "--pid",
        str(pid),
        "--format",
        "raw",
        "--rate",
        "200",
        "--output",
        str(path),
        "--nonblocking",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    await asyncio.sleep(1)  # attached, or failed (ptrace restrictions) and said so
    if process.returncode is not None:
        assert process.stderr is not None
        message = (await process.stderr.read()).decode(errors="replace")
        raise RuntimeError(f"py-spy could not attach to the daemon: {message.strip()}")
    return process


async def _stop_profiler(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.send_signal(signal.SIGINT)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(30):
                await process.wait()


def _size(args: argparse.Namespace) -> Size:
    """The named size with the command line's overrides."""
    size = SIZES[args.size]
    if args.lifecycle:
        size = attrs.evolve(size, lifecycle=args.lifecycle)
    if args.sockets:
        size = attrs.evolve(size, sockets=tuple(args.sockets))
    if args.storms:
        size = attrs.evolve(size, storms=args.storms)
    if args.rounds:
        size = attrs.evolve(size, rounds=args.rounds)
    return size


async def run(args: argparse.Namespace) -> dict[str, Any]:  # noqa: PLR0915 -- the parts in order
    main_task = asyncio.current_task()
    assert main_task is not None
    # A TERM (a supervisor, a timeout, kill) ends the run as Ctrl-C does: the finally blocks
    # below stop the daemon, the farm and the embedded PostgreSQL and drop the databases,
    # instead of leaving them running after the bench has gone.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    size = _size(args)
    raise_open_files()
    load_before = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="hubd-bench"))
    embedded: EmbeddedPostgres | None = None
    # Named for this process: several runs (or a run and the tests) may share one server.
    names = [
        f"hubd_bench_{os.getpid()}{part}"
        for part in ("", "_scale", "_pgq", "_scale_large", "_floor")
    ]
    try:
        if args.database_url:
            maintenance = args.database_url
        else:
            embedded = EmbeddedPostgres(workdir)
            maintenance = await asyncio.to_thread(embedded.start)
        bench_run = Run(args, size, workdir)
        bench_run.dsn = await databases.fresh(maintenance, names[0], migrate=True)
        scale_dsn = await databases.fresh(maintenance, names[1], migrate=True)
        pgq_dsn = await databases.fresh(maintenance, names[2], migrate=False)
        scale_large_dsn = await databases.fresh(maintenance, names[3], migrate=True)
        bench_run.floor_dsn = await databases.fresh(maintenance, names[4], migrate=False)
        bench_run.config = phases.BenchConfig(workdir, bench_run.dsn, bench_run.farm.socket_path)
        bench_run.stats = await asyncpg.connect(bench_run.dsn)
        server_version = await bench_run.stats.fetchval("SHOW server_version")
        await bench_run.watcher.start(bench_run.dsn)
        await bench_run.farm.start()
        try:
            # The baselines and hubd in turn, round after round, so that what else the machine
            # does at a given moment falls on both alike; each rate is the median of its rounds.
            for index in range(size.rounds):
                await bench_run.step("floor", bench_run.floor, combine=combine_rates)
                await bench_run.step(
                    "pgqueuer",
                    lambda: baselines.pgqueuer_drain(pgq_dsn, n=size.pgqueuer),
                    combine=combine_rates,
                )
                for claims in CLAIMS:
                    await bench_run.step(
                        f"claims_{claims}",
                        functools.partial(bench_run.claims_phase, claims, first=index == 0),
                        combine=combine_claims,
                    )
            await bench_run.step("fairness", bench_run.fairness_phase)
            await bench_run.step("deadlines", bench_run.deadlines_phase)
            await bench_run.step("http", bench_run.http_phase)
            await bench_run.step("pools", bench_run.pools_phase)
            await bench_run.step(
                "statements",
                lambda: scale.statement_costs(
                    scale_dsn,
                    scale_large_dsn,
                    small=size.small_rows,
                    large=size.large_rows,
                    reps=size.statement_reps,
                ),
            )
            for n in size.sockets:
                await bench_run.step(f"sockets_{n}", functools.partial(bench_run.socket_phase, n))
        finally:
            await bench_run.farm.stop()
            await bench_run.watcher.stop()
            await bench_run.stats.close()
            await databases.drop(maintenance, *names)
    finally:
        if embedded is not None:
            embedded.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    description = machine()
    description["load_average_before"] = load_before
    description["postgresql"] = server_version
    report: dict[str, Any] = {
        "size": args.size,
        "parameters": attrs.asdict(size),
        "machine": description,
        "farm_loop": bench_run.farm.running_loop,
        "results": bench_run.results,
    }
    if args.profile and await asyncio.to_thread(args.profile.exists):
        report["profile"] = profile_summary(args.profile)
    report["measures"] = bench_run.measures.build(bench_run.results, size)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="mid")
    parser.add_argument("--quick", action="store_const", const="quick", dest="size")
    parser.add_argument("--lifecycle", type=int, default=0, help="allocations per lifecycle run")
    parser.add_argument(
        "--sockets", type=int, action="append", help="idle socket count (repeatable)"
    )
    parser.add_argument(
        "--storms", type=int, help="reconnect storms per socket count (the median is reported)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="rounds of the floor, PgQueuer and the claim counts, in turn (medians reported)",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=[
            "floor",
            "pgqueuer",
            "statements",
            "claims",
            "fairness",
            "deadlines",
            "http",
            "pools",
            "sockets",
        ],
        help="run only these parts (repeatable; the table then has gaps)",
    )
    parser.add_argument("--database-url", default=os.environ.get("HUBD_BENCH_DATABASE_URL", ""))
    parser.add_argument(
        "--farm-loop",
        choices=EVENT_LOOPS,
        default="uvloop",
        help="the sidecar farm's event loop (runs before 2026-12-04 used asyncio)",
    )
    parser.add_argument("--json", type=Path, default=Path("bench-results.json"))
    parser.add_argument(
        "--profile",
        type=Path,
        help="py-spy raw profile of the lifecycle at the default claim count",
    )
    parser.add_argument("--render", type=Path, help="print the table of a saved JSON and exit")
    args = parser.parse_args(argv)
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return 0
    try:
        report = asyncio.run(run(args))
    except asyncio.CancelledError:
        print("bench: stopped by SIGTERM; its processes and databases are gone", file=sys.stderr)
        return 128 + signal.SIGTERM
    args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(render(report))
    print(f"\nJSON: {args.json}")
    failed = [name for name, result in report["results"].items() if "error" in result]
    missing = [key for key, row in report["measures"].items() if row["hubd"] is None]
    # With --only, the parts left out leave gaps on purpose; a failure is still one.
    return 1 if failed or (missing and not args.only) else 0
