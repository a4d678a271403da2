"""The client's event follower under fire at full size, printing its account.

    .venv/bin/python -m bench.follow_faults --seconds 300 --writers 8 --every 2 4

Writers commit pairs of transactions out of order for ``--seconds`` while, every ``--every``
seconds (uniformly random), the follower's backend is terminated while it listens, terminated
mid-read, its read cancelled, or terminated and then terminated again as it reconnects
(tests/followkit.py). Then the follower is given ``--catch-up`` seconds to receive everything,
and its client is closed. Prints the account as JSON (``--json`` writes it too) and exits 1
unless every event arrived once, in commit order, and ``close()`` returned.

On the embedded PostgreSQL (a temporary directory) or ``--database-url``, a maintenance DSN
allowed to create databases and roles. The suite runs the same at CI size
(tests/test_client_faults.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import attrs

from bench import databases
from hubd.store.embedded import EmbeddedPostgres
from tests.apikit import app_role
from tests.followkit import Fire, under_fire


async def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="hubd-benchf"))
    embedded: EmbeddedPostgres | None = None
    name = f"hubd_bench_follow_{os.getpid()}"
    try:
        if args.database_url:
            maintenance = args.database_url
        else:
            embedded = EmbeddedPostgres(workdir)
            maintenance = await asyncio.to_thread(embedded.start)
        dsn = await databases.fresh(maintenance, name)
        try:
            async with app_role(dsn) as app_dsn:
                fire = Fire(
                    seconds=args.seconds,
                    writers=args.writers,
                    fault_every=(args.every[0], args.every[1]),
                    seed=args.seed,
                )
                account = await under_fire(
                    dsn, app_dsn, fire, catch_up=args.catch_up, close_deadline=30
                )
        finally:
            await databases.drop(maintenance, name)
    finally:
        if embedded is not None:
            embedded.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return {"fire": attrs.asdict(fire), "account": attrs.asdict(account), "exact": account.exact}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300, help="how long writers commit")
    parser.add_argument("--writers", type=int, default=8, help="writers at once")
    parser.add_argument(
        "--every", type=float, nargs=2, default=(2.0, 4.0), metavar=("MIN", "MAX"),
        help="seconds between two faults (uniformly random)",
    )  # fmt: skip
    parser.add_argument("--catch-up", type=float, default=120, help="seconds to catch up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--database-url", default="", help="maintenance DSN (default: embedded)")
    parser.add_argument("--json", type=Path, help="write the report here as well")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.writers < 1 or not 0 < args.every[0] <= args.every[1]:
        parser.error("--seconds, --writers and --every must be positive (MIN <= MAX)")
    report = asyncio.run(run(args))
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0 if report["exact"] and report["account"]["ended_with"] == "ClientClosed" else 1


if __name__ == "__main__":
    sys.exit(main())
