"""This tree's daemon against another tree's, in interleaved pairs, on one PostgreSQL.

    .venv/bin/python -m bench.compare ../hubd-before --pairs 3
    .venv/bin/python -m bench.compare ../hubd-before --part sockets --sockets 3000

The same code measured minutes apart on a shared machine moves by a third (docs/performance.md),
so a change is judged by pairs: a run of the other tree's daemon, then one of this tree's, again
and again, each fresh, with the same farm, plugin and PostgreSQL: each tree's daemon on a
database its own migrations made, requested from and released through the SQL API
(``hubd_v1.request``/``release``), which both keep. It prints each pair and the
medians, with this tree's median over the other's, and writes the JSON.

``OTHER`` is a checkout of this repository (its own ``hubd`` and ``bench.plugin`` are what its
daemon runs, through its ``bench.launch``); the farm, the bench and PostgreSQL are this tree's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import asyncpg
import attrs

from bench import databases, phases
from bench.procs import raise_open_files
from bench.suite import SIZES, Run
from bench.watch import Watcher
from hubd.daemon.loops import EVENT_LOOPS
from hubd.store.embedded import EmbeddedPostgres

__all__ = ["main"]

TREES = ("other", "this")
"""Each pair runs the other tree's daemon first."""
_CLAIM_KEYS = ("lifecycle_rate", "ready_rate")
_SOCKET_KEYS = ("storm_rate", "loss_rate")


def _claims_row(result: dict[str, Any]) -> dict[str, float]:
    cycle = result["lifecycle"]
    cpu = cycle["cpu_ms"]
    return {
        "lifecycle_rate": cycle["lifecycle_rate"],
        "ready_rate": cycle["ready_rate"],
        "daemon_cpu_ready_ms": cpu["ready"]["daemon"],
        "daemon_cpu_release_ms": cpu["release"]["daemon"],
        "postgres_cpu_ready_ms": cpu["ready"]["postgres"],
        "postgres_cpu_release_ms": cpu["release"]["postgres"],
        "wal_bytes_per_lifecycle": cycle["wal_bytes_per_lifecycle"],
        **(
            {"one_source_ready_rate": result["one_source"]["ready_rate"]}
            if "ready_rate" in result.get("one_source", {})
            else {}
        ),
    }


def _sockets_row(result: dict[str, Any]) -> dict[str, float]:
    hubd = result["hubd"]
    return {
        "storm_rate": hubd["storm_rate"],
        "loss_rate": hubd["loss_rate"],
        "bare_storm_rate": result["bare"]["storm_rate"],
        "daemon_cpu_per_handshake_ms": hubd["storm_cpu_ms"]["daemon"],
    }


async def _migrate_with(tree: Path, dsn: str) -> None:
    """Apply ``tree``'s migrations to ``dsn``, in a child that imports ``tree``'s hubd."""
    script = (
        "import asyncio, sys, asyncpg\n"
        "from hubd.store.migrate import apply_migrations\n"
        "async def main():\n"
        "    conn = await asyncpg.connect(sys.argv[1])\n"
        "    try:\n"
        "        await apply_migrations(conn)\n"
        "    finally:\n"
        "        await conn.close()\n"
        "asyncio.run(main())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tree)}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, dsn, cwd=tree, env=env, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await child.communicate()
    if child.returncode != 0:
        raise SystemExit(f"bench.compare: migrating with {tree} failed:\n{stderr.decode()[-2000:]}")


def _medians(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


async def compare(args: argparse.Namespace) -> dict[str, Any]:
    other = args.other.resolve()
    if not (other / "bench" / "launch.py").is_file() or not (other / "hubd").is_dir():
        raise SystemExit(f"bench.compare: {other} is not a checkout of hubd (no bench/launch.py)")
    raise_open_files()
    size = attrs.evolve(SIZES["quick"], lifecycle=args.lifecycle, storms=args.storms)
    workdir = Path(tempfile.mkdtemp(prefix="hubd-compare"))
    embedded = None if args.database_url else EmbeddedPostgres(workdir)
    names = {label: f"hubd_bench_compare_{label}_{os.getpid()}" for label in TREES}
    pairs: list[dict[str, dict[str, float]]] = []
    try:
        if embedded is None:
            maintenance = args.database_url
        else:
            maintenance = await asyncio.to_thread(embedded.start)
        bench_run = Run(args, size, workdir)
        # Each tree's daemon on a database its own migrations made (a daemon refuses one a
        # newer checkout migrated), requested from and released through the SQL API both keep.
        bench_run.open_store = phases.open_sql_api
        sides = {
            "this": await databases.fresh(maintenance, names["this"], migrate=True),
            "other": await databases.fresh(maintenance, names["other"], migrate=False),
        }
        await _migrate_with(other, sides["other"])
        stats = {label: await asyncpg.connect(dsn) for label, dsn in sides.items()}
        watchers = {label: Watcher() for label in sides}
        for label, dsn in sides.items():
            await watchers[label].start(dsn)
        await bench_run.farm.start()
        try:
            for index in range(args.pairs):
                pair: dict[str, dict[str, float]] = {}
                for label in TREES:
                    bench_run.daemon_root = other if label == "other" else None
                    bench_run.dsn = sides[label]
                    bench_run.stats = stats[label]
                    bench_run.watcher = watchers[label]
                    bench_run.config = phases.BenchConfig(
                        workdir, sides[label], bench_run.farm.socket_path
                    )
                    phases.say(f"pair {index + 1}/{args.pairs}: {label} tree")
                    if args.part == "claims":
                        result = await bench_run.claims_phase(args.claims, first=False)
                        pair[label] = _claims_row(result)
                    else:
                        pair[label] = _sockets_row(await bench_run.socket_phase(args.sockets))
                pairs.append(pair)
                print(_pair_line(index, pair), flush=True)
        finally:
            await bench_run.farm.stop()
            for watcher in watchers.values():
                await watcher.stop()
            for conn in stats.values():
                await conn.close()
            await databases.drop(maintenance, *names.values())
    finally:
        if embedded is not None:
            embedded.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    medians = {label: _medians([pair[label] for pair in pairs]) for label in ("other", "this")}
    return {"other": str(other), "part": args.part, "pairs": pairs, "medians": medians}


def _pair_line(index: int, pair: dict[str, dict[str, float]]) -> str:
    keys = _CLAIM_KEYS if "lifecycle_rate" in pair["this"] else _SOCKET_KEYS
    cells = ", ".join(
        f"{key} {pair['other'][key]:,.0f} -> {pair['this'][key]:,.0f}" for key in keys
    )
    return f"pair {index + 1}: {cells}"


def render(report: dict[str, Any]) -> str:
    lines = [f"{'measure':<30} {'other':>10} {'this':>10} {'this/other':>11}"]
    other, this = report["medians"]["other"], report["medians"]["this"]
    for key in this:
        ratio = this[key] / other[key] if other[key] else float("nan")
        lines.append(f"{key:<30} {other[key]:>10.3f} {this[key]:>10.3f} {ratio:>10.3f}x")
    lines.append(f"medians of {len(report['pairs'])} pairs; other: {report['other']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__)
    parser.add_argument("other", type=Path, help="a checkout of hubd to compare against")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--part", choices=["claims", "sockets"], default="claims")
    parser.add_argument("--claims", type=int, default=16, help="max_concurrent_claims")
    parser.add_argument("--lifecycle", type=int, default=2000, help="allocations per lifecycle")
    parser.add_argument("--sockets", type=int, default=1000, help="sockets of the storm part")
    parser.add_argument("--storms", type=int, default=3, help="storms per sockets run")
    parser.add_argument(
        "--database-url",
        default=os.environ.get("HUBD_BENCH_DATABASE_URL", ""),
        help="a maintenance DSN; default: a private embedded PostgreSQL",
    )
    parser.add_argument(
        "--farm-loop", choices=EVENT_LOOPS, default="uvloop", help="the farm's loop"
    )
    parser.add_argument("--json", type=Path, default=Path("bench-compare.json"))
    args = parser.parse_args(argv)
    # What Run reads of the suite's own arguments.
    args.only, args.profile = None, None
    report = asyncio.run(compare(args))
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(render(report))
    print(f"\nJSON: {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
