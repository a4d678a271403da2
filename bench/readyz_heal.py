"""``/readyz`` after partitions that drop every connection for good, at full size.

    .venv/bin/python -m bench.readyz_heal                   # 5 runs, 45 s partitions
    .venv/bin/python -m bench.readyz_heal --runs 10 --outage 60 --allocations 10

Each run: a fresh database on one embedded PostgreSQL, reached through a TCP proxy
(tests/proxykit.py); one ``hubd run`` on it with the shipped defaults of ``[reconciler]`` and
``[instance]`` (heartbeat 5 s, instance TTL 20 s, poll 5 s), the ``local`` provisioner running
the reference sidecar, ``--allocations`` allocations made ready. Then the proxy drops every
connection, open and new, without closing any (a vanished peer, a NAT that lost its state) for
``--outage`` seconds, and at least until ``/readyz`` says the database is unreachable; then it
heals (connections made from then on pass; the old ones stay dead).

``/readyz`` is sampled every 100 ms on a fresh connection from the daemon's start
(tests/readyzkit.py). Printed per run, as a Markdown table row: how long the partition lasted,
when ``/readyz`` noticed it, the seconds from the heal to the first 200, whether it then stayed
200 for ``--steady`` seconds, and what ``/readyz`` said meanwhile. Last, the slowest run; the
exit status is 1 when a run took longer than ``--bound`` (15 s) or flapped.

The suite runs two shorter partitions (tests/test_failover_daemon.py); this is the full-size run
behind docs/operations.md's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import warnings
from pathlib import Path

import asyncpg

from hubd.config.sections import InstanceConfig, ReconcilerConfig
from hubd.dburl import with_database
from hubd.store.embedded import EmbeddedPostgres
from hubd.units import format_duration
from tests.daemonkit import DaemonProcess, kill_sidecars, new_marker, write_config
from tests.faultkit import stop_all
from tests.proxykit import blackhole
from tests.readyzkit import READY, Healed, dropped_partition, sampling
from tests.test_daemon import request_many

COLUMNS = (
    "run",
    "partition lasted",
    "/readyz said unreachable after",
    "heal → /readyz 200",
    "stayed 200",
    "/readyz said",
)


def shipped_settings() -> dict[str, str]:
    """The shipped defaults of every ``[reconciler]`` and ``[instance]`` timing, as overrides
    of the test config's short ones."""
    reconciler, instance = ReconcilerConfig(), InstanceConfig()
    timings = {
        "RECONCILER_LEASE_DURATION": reconciler.lease_duration,
        "RECONCILER_CONNECT_TIMEOUT": reconciler.connect_timeout,
        "RECONCILER_OPERATION_TIMEOUT": reconciler.operation_timeout,
        "RECONCILER_POLL_INTERVAL": reconciler.poll_interval,
        "RECONCILER_REPAIR_INTERVAL": reconciler.repair_interval,
        "INSTANCE_HEARTBEAT_INTERVAL": instance.heartbeat_interval,
        "INSTANCE_TTL": instance.ttl,
    }
    return {f"HUBD_{key}": format_duration(value) for key, value in timings.items()}


async def _one(run: int, maintenance: str, tmp: Path, args: argparse.Namespace) -> Healed:
    name = f"hubd_heal_{run}"
    conn = await asyncpg.connect(maintenance)
    try:
        await conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await conn.execute(f"CREATE DATABASE {name}")
    finally:
        await conn.close()
    direct = with_database(maintenance, name)
    marker = new_marker()
    state_dir = tmp / f"run-{run}"
    state_dir.mkdir()
    async with blackhole(direct) as proxy:
        config = write_config(
            state_dir / "hubd.toml",
            database_url=proxy.url(direct),
            state_dir=state_dir,
            marker=marker,
        )
        daemon = DaemonProcess(config, env=shipped_settings())
        try:
            await daemon.start()
            async with sampling(daemon.admin_url + "/readyz") as sampler:
                await request_many(args.allocations, {"HUBD_DATABASE_URL": direct}, wait=True)
                healed = await dropped_partition(
                    proxy, sampler, outage=args.outage, bound=60.0, steady=args.steady
                )
        finally:
            await stop_all(daemon)
            kill_sidecars(marker)
            if args.log is not None:
                (args.log / f"run-{run}.log").write_text(daemon.output + "\n")
    return healed


def _row(run: int, healed: Healed, steady: float) -> str:
    ready = "> 60 s" if healed.ready is None else f"{healed.ready:.1f} s"
    stayed = "—" if healed.ready is None else ("yes" if not healed.flapped else "no")
    cells = (
        str(run + 1),
        f"{healed.lasted:.1f} s",
        f"{healed.noticed:.1f} s",
        ready,
        stayed if stayed == "—" else f"{stayed} ({steady:g} s)",
        "; ".join(healed.said) or READY,
    )
    return "| " + " | ".join(cells) + " |"


async def main_async(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="hubd-h") as tmp:
        server = EmbeddedPostgres(Path(tmp))
        maintenance = await asyncio.to_thread(server.start)
        try:
            conn = await asyncpg.connect(maintenance)
            try:
                version = await conn.fetchval("SHOW server_version")
            finally:
                await conn.close()
            print(
                f"PostgreSQL {version}; {os.cpu_count()} CPUs; {args.allocations} allocations; "
                f"partitions of at least {args.outage:g} s; shipped settings: "
                + ", ".join(f"{k}={v}" for k, v in shipped_settings().items()),
                flush=True,
            )
            print("| " + " | ".join(COLUMNS) + " |")
            print("|" + "---|" * len(COLUMNS), flush=True)
            runs = []
            for run in range(args.runs):
                healed = await _one(run, maintenance, Path(tmp), args)
                runs.append(healed)
                print(_row(run, healed, args.steady), flush=True)
        finally:
            await asyncio.to_thread(server.stop)
    times = [healed.ready for healed in runs]
    worst = None if None in times else max(t for t in times if t is not None)
    good = worst is not None and worst <= args.bound and not any(h.flapped for h in runs)
    slowest = "> 60 s" if worst is None else f"{worst:.1f} s"
    print(
        f"slowest heal → 200: {slowest}; every run within {args.bound:g} s and steady: "
        f"{'yes' if good else 'NO'}"
    )
    return 0 if good else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--outage", type=float, default=45.0, help="seconds, at least")
    parser.add_argument("--allocations", type=int, default=10)
    parser.add_argument("--steady", type=float, default=10.0, help="seconds to stay 200")
    parser.add_argument("--bound", type=float, default=15.0, help="seconds from heal to 200")
    parser.add_argument("--log", type=Path, help="a directory for each run's daemon log")
    args = parser.parse_args()
    # platformdirs warns when XDG_RUNTIME_DIR is unset (root shells); the wheel falls back to /tmp.
    warnings.filterwarnings("ignore", category=UserWarning, module="platformdirs")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
