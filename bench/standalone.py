"""What a benchmark part run on its own (``python -m bench.<part>``) needs around its
``measure``: a database (a private embedded PostgreSQL, or ``--database-url``'s server), the
sidecar farm, the machine's load before and after, and a TERM that ends the run as Ctrl-C does,
its processes stopped and its database dropped."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from bench import databases
from bench.procs import FarmClient, raise_open_files
from hubd.daemon.loops import EVENT_LOOPS
from hubd.store.embedded import EmbeddedPostgres

__all__ = ["main", "run"]

Measure = Callable[[str, FarmClient, Path], Awaitable[dict[str, Any]]]
"""``measure(dsn, farm, workdir)``: the part's result, on a database of its own."""


async def run(
    part: str, size: str, database_url: str, farm_loop: str, measure: Measure
) -> dict[str, Any]:
    main_task = asyncio.current_task()
    assert main_task is not None
    # A TERM ends the run as Ctrl-C does: the finally blocks stop what was started.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    raise_open_files()
    load_before = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix=f"hubd-{part}"))
    embedded: EmbeddedPostgres | None = None
    name = f"hubd_bench_{part}_{os.getpid()}"
    try:
        if database_url:
            maintenance = database_url
        else:
            embedded = EmbeddedPostgres(workdir)
            maintenance = await asyncio.to_thread(embedded.start)
        dsn = await databases.fresh(maintenance, name)
        farm = FarmClient(workdir / "farm.sock", loop=farm_loop)
        await farm.start()
        try:
            result = await measure(dsn, farm, workdir)
        finally:
            await farm.stop()
            await databases.drop(maintenance, name)
    finally:
        if embedded is not None:
            embedded.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    machine = {"nproc": os.cpu_count(), "load_average": [load_before, os.getloadavg()]}
    return {"size": size, "machine": machine, part: result}


def add_arguments(parser: argparse.ArgumentParser, sizes: Mapping[str, object]) -> None:
    """The options every part run on its own takes: ``--size``, ``--database-url``,
    ``--farm-loop``, ``--json``."""
    parser.add_argument("--size", choices=sorted(sizes), default="quick")
    parser.add_argument("--database-url", default=os.environ.get("HUBD_BENCH_DATABASE_URL", ""))
    parser.add_argument("--farm-loop", choices=EVENT_LOOPS, default="uvloop")
    parser.add_argument("--json", type=Path, help="write the whole report here as well")


def report(
    part: str,
    args: argparse.Namespace,
    measure: Measure,
    render: Callable[[dict[str, Any]], str],
) -> int:
    """Run ``measure`` once as :func:`run` does, with :func:`add_arguments`' options, and print
    its table (and write the JSON, if asked)."""
    try:
        result = asyncio.run(run(part, args.size, args.database_url, args.farm_loop, measure))
    except asyncio.CancelledError:
        print("bench: stopped by SIGTERM; its processes and database are gone", file=sys.stderr)
        return 128 + signal.SIGTERM
    print(render(result[part]))
    machine = result["machine"]
    before, after = (" ".join(f"{v:.2f}" for v in each) for each in machine["load_average"])
    print(f"size {result['size']}; {machine['nproc']} cores; load average {before} → {after}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def main(
    argv: list[str] | None,
    *,
    part: str,
    doc: str | None,
    sizes: Mapping[str, object],
    measure: Callable[[str, FarmClient, Path, Any], Awaitable[dict[str, Any]]],
    render: Callable[[dict[str, Any]], str],
) -> int:
    """``python -m bench.<part> [--size S] [--database-url DSN] [--farm-loop L] [--json F]``:
    ``measure(dsn, farm, workdir, sizes[S])`` once, its table printed."""
    parser = argparse.ArgumentParser(
        prog=f"python -m bench.{part}", description=(doc or "").split("\n")[0]
    )
    add_arguments(parser, sizes)
    args = parser.parse_args(argv)
    load = sizes[args.size]

    async def measured(dsn: str, farm: FarmClient, workdir: Path) -> dict[str, Any]:
        return await measure(dsn, farm, workdir, load)

    return report(part, args, measured, render)
