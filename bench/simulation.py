"""The seeded fault simulation (tests/simkit.py) over as many seeds as asked, outside pytest,
on its own embedded PostgreSQL:

    .venv/bin/python -m bench.simulation --seeds 2000 [--first 0] [--steps 40] [--rate 0.2]

Prints the seeds that broke an invariant (replay one with ``HUBD_SIM_SEED=<seed> pytest
tests/test_simulation.py``), then one table: how many faults landed at each boundary, by kind,
and the violations by invariant.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import tempfile
import time
from pathlib import Path

import asyncpg
import structlog

from hubd.dburl import with_database
from hubd.store import connect_database
from hubd.store.embedded import EmbeddedPostgres
from hubd.store.migrate import apply_migrations
from tests.faultkit import install_observer
from tests.simkit import Coverage, Fault, Simulation, describe, expected_pairs, reset


async def run(maintenance: str, args: argparse.Namespace) -> None:
    conn = await asyncpg.connect(maintenance)
    try:
        await conn.execute("CREATE DATABASE hubd_simulation")
    finally:
        await conn.close()
    dsn = with_database(maintenance, "hubd_simulation")
    conn = await asyncpg.connect(dsn)
    try:
        await apply_migrations(conn)
    finally:
        await conn.close()
    await install_observer(dsn)
    db = await connect_database(dsn, pool_size=20)
    coverage = Coverage()
    broken: collections.Counter[str] = collections.Counter()
    failed: list[int] = []
    started = time.monotonic()
    try:
        for seed in range(args.first, args.first + args.seeds):
            await reset(db)
            sim = Simulation(
                seed=seed, db=db, dsn=dsn, steps=args.steps, rate=args.rate, coverage=coverage
            )
            try:
                found = describe(await sim.run())
            except Exception as exc:  # noqa: BLE001 -- a seed that raises is a finding
                found = {"raised": [f"{type(exc).__name__}: {exc}"]}
            if found:
                failed.append(seed)
                broken.update({name: len(items) for name, items in found.items()})
                print(f"seed {seed}: {found}", flush=True)
    finally:
        await db.close()
    elapsed = time.monotonic() - started
    print()
    faults = list(Fault)
    print(f"{'boundary':<17}" + "".join(f"{f.value:>22}" for f in faults))
    for boundary in sorted({b for b, _ in expected_pairs()}):
        cells = "".join(
            f"{coverage.pairs[boundary, f] if (boundary, f) in expected_pairs() else '-':>22}"
            for f in faults
        )
        print(f"{boundary:<17}{cells}")
    print(
        f"{args.seeds} seeds x {args.steps} steps in {elapsed:.0f} s; faults landed "
        f"{sum(coverage.pairs.values())}; pairs never exercised {len(coverage.missing())}; "
        f"seeds broken {len(failed)}; violations {dict(broken) or 'none'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=1000)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rate", type=float, default=0.2)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    with tempfile.TemporaryDirectory(prefix="hubd-s") as tmp:
        server = EmbeddedPostgres(Path(tmp))
        maintenance = server.start()
        try:
            asyncio.run(run(maintenance, args))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
