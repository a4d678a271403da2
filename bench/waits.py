"""Where the lifecycle's statements wait: PostgreSQL's wait events and statement costs while the
suite's claim part runs.

    python -m bench.waits --database-url postgresql://postgres@127.0.0.1:55432/postgres

``--database-url`` is a maintenance DSN of a server this runs ``python -m bench --only claims``
against (``--size``, ``--rounds`` passed on). Meanwhile a connection of its own samples
``pg_stat_activity`` every 5 ms: for every active backend of the bench's databases, the
statement (by its description, the comment it starts with in hubd's SQL files) and its wait
event, ``CPU`` when it has none (running, or runnable and waiting
for a core). With ``pg_stat_statements`` loaded (``shared_preload_libraries``), it is reset
first and the daemon's statements are reported too: calls, rows, execution time per call and
per row, WAL per call. docs/measurements.md, "Where the lifecycle waits", has a run and how to
start a server with the extension from the embedded PostgreSQL's own binaries.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
from pathlib import Path
from typing import Any

import asyncpg

from bench.table import columns
from hubd.store.queries import load_queries

__all__ = ["main"]

LIFECYCLE = {
    ("claims.sql", "claim_due"): "claim (claim_due)",
    ("transitions.sql", "park"): "park",
    ("connections.sql", "record"): "admission (record)",
    ("transitions.sql", "mark_released"): "mark_released",
    ("transitions.sql", "mark_connection_ready"): "mark_connection_ready",
}
"""The daemon's statements of a lifecycle, by file and name in ``hubd/store/sql``."""

HEAD = 100
"""Characters of a statement's body (whitespace made single spaces) that name it where its
description is not there: ``pg_stat_activity`` shows the text as sent, the description's first
line first; ``pg_stat_statements`` keeps it from the statement on, without the comment."""


def _single_spaced(text: str) -> str:
    return " ".join(text.split())


def _heads() -> list[tuple[str, str, str]]:
    heads = []
    for (filename, name), label in LIFECYCLE.items():
        lines = load_queries(filename)[name].sql.splitlines()
        body = "\n".join(line for line in lines if not line.lstrip().startswith("--"))
        heads.append((_single_spaced(lines[0]), _single_spaced(body)[:HEAD], label))
    return heads


HEADS = _heads()


def statement(text: str) -> str | None:
    """Which lifecycle statement ``text`` (as either view shows it) is, if any."""
    text = _single_spaced(text)
    for described, body, label in HEADS:
        if text.startswith(described) or text[:HEAD] == body:
            return label
    return None


SAMPLE = """
SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU') AS wait,
       left(query, 400) AS head
FROM pg_stat_activity
WHERE state = 'active' AND pid <> pg_backend_pid() AND datname LIKE 'hubd_bench%'
  AND backend_type = 'client backend'
"""


async def sample(dsn: str, stop: asyncio.Event) -> dict[str, collections.Counter[str]]:
    waits: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    conn = await asyncpg.connect(dsn)
    try:
        while not stop.is_set():
            for row in await conn.fetch(SAMPLE):
                name = statement(row["head"])
                if name is not None:
                    waits[name][row["wait"]] += 1
            await asyncio.sleep(0.005)
    finally:
        await conn.close()
    return waits


async def statement_costs(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    rows = await conn.fetch(
        "SELECT left(query, 400) AS head, calls, rows, total_exec_time, wal_bytes "
        "FROM pg_stat_statements"
    )
    costs: dict[str, dict[str, float]] = {}
    for row in rows:
        name = statement(row["head"])
        if name is None:
            continue
        entry = costs.setdefault(name, {"calls": 0, "rows": 0, "ms": 0.0, "wal": 0.0})
        entry["calls"] += row["calls"]
        entry["rows"] += row["rows"]
        entry["ms"] += row["total_exec_time"]
        entry["wal"] += float(row["wal_bytes"])
    return [
        {
            "statement": name,
            "calls": int(c["calls"]),
            "rows_per_call": c["rows"] / c["calls"],
            "ms_per_call": c["ms"] / c["calls"],
            "ms_per_row": c["ms"] / max(c["rows"], 1),
            "wal_per_call": c["wal"] / c["calls"],
        }
        for name, c in sorted(costs.items(), key=lambda item: -item[1]["ms"])
        if c["calls"]
    ]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    conn = await asyncpg.connect(args.database_url)
    try:
        counted = bool(
            await conn.fetchval(
                "SELECT 'pg_stat_statements' = ANY (string_to_array("
                "current_setting('shared_preload_libraries'), ','))"
            )
        )
        if counted:
            await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            await conn.execute("SELECT pg_stat_statements_reset()")
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample(args.database_url, stop))
        try:
            bench = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench", "--only", "claims", "--size", args.size,
                "--rounds", str(args.rounds), "--database-url", args.database_url,
                "--json", str(args.bench_json), stdout=sys.stderr,
            )  # fmt: skip
            code = await bench.wait()
        finally:
            stop.set()
            waits = await sampler
        if code != 0:
            raise SystemExit(f"bench.waits: the claim part failed (exit {code})")
        result: dict[str, Any] = {
            "waits": {name: dict(found.most_common()) for name, found in waits.items()},
            "statements": await statement_costs(conn) if counted else None,
        }
    finally:
        await conn.close()
    return result


def report(result: dict[str, Any]) -> str:
    waits = sorted(result["waits"].items(), key=lambda item: -sum(item[1].values()))
    rows = [["statement", "samples", "wait events, 1% and more (CPU: none)"]]
    for name, found in waits:
        total = sum(found.values())
        shares = ", ".join(
            f"{wait} {count / total:.0%}" for wait, count in found.items() if count / total >= 0.01
        )
        rows.append([name, f"{total:,}", shares])
    lines = columns(rows, right=[1])
    if result["statements"] is None:
        lines.append("pg_stat_statements is not loaded on this server: no statement costs")
        return "\n".join(lines)
    costs = [["statement", "calls", "rows/call", "ms/call", "ms/row", "WAL B/call"]]
    for s in result["statements"]:
        costs.append(
            [
                s["statement"],
                f"{s['calls']:,}",
                f"{s['rows_per_call']:.1f}",
                f"{s['ms_per_call']:.2f}",
                f"{s['ms_per_row']:.3f}",
                f"{s['wal_per_call']:,.0f}",
            ]
        )
    return "\n".join([*lines, "", *columns(costs, right=[1, 2, 3, 4, 5])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.waits", description=__doc__)
    parser.add_argument("--database-url", required=True, help="a maintenance DSN")
    parser.add_argument("--size", default="mid", choices=["tiny", "quick", "mid", "full"])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", type=Path, default=Path("bench-waits.json"))
    parser.add_argument("--bench-json", type=Path, default=Path("bench-waits-claims.json"))
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    args.json.write_text(json.dumps(result, indent=2))
    print(report(result))
    print(f"\nJSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
