"""The attacks of tests/hostile/ at full size against a real ``hubd run``, one table printed.

    .venv/bin/python -m bench.hostile
    .venv/bin/python -m bench.hostile --only header-flood --seconds 10

Each attack runs against one daemon (a fresh state dir and embedded PostgreSQL) while /readyz
is probed every 50 ms from a separate process (``bench/readyz_probe.py``, so the attacker's own
event-loop stalls are not counted) and legitimate ``alloc request --wait`` calls run one after
another. ``ping-flood`` and ``reconnect-loop`` are made by the allocation's genuine sidecar (the
first to connect with the environment its sidecar was given); the ``-stolen`` variants use a
token copied from a sidecar that had already connected.

Columns: offered (bytes, connections, handshakes, pings or reconnect tries, by attack) and its
rate, seconds, RSS before / peak / after settling (MiB), descriptors before / after, legitimate
request latency p50 / p99 (s) and failures, /readyz p50 / p99 / max (ms, the separate prober)
and failures (either prober), the daemon's log lines during the attack, and what the hub
answered the attacker (``w`` welcomes, ``dropped@s`` when the hub dropped it, statuses with
their reasons, and how many ledger rows the attacker's own allocation gained).
``--json`` also prints every measurement as a JSON line.

``half-open-reconnecting`` is the flood that must not lock a sidecar out: 2,000 connections from
200 addresses (each of its own /24) sending headers without their final blank line, each opened
again the moment the hub closes it, while the legitimate requests dial through it. Its targets
are printed under the table: every legitimate allocation ready within 2 s of its request (p99,
by the database's clock: the request's commit to the allocation's first ``mark_ready``; the
``lp`` columns add the CLI's own start and exit), ``/readyz`` p99 under 100 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import statistics
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tests.clikit import run_hubd_async
from tests.daemonkit import DaemonProcess, kill_sidecars, new_marker
from tests.hostilekit import (
    ATTACKS,
    HOLDER_ATTACKS,
    Attacker,
    Measured,
    hostile_config,
    json_line,
    ledger_rows,
    measure,
    sidecar_environment,
    unconnected_sidecar,
)
from tests.test_daemon import request_many

ROOT = Path(__file__).resolve().parent.parent

FULL = {
    "header-flood": (500, 10.0),
    "half-open": (2000, 15.0),
    # Each reopened the moment the hub closes it: the flood that once kept every slot.
    "half-open-reconnecting": (2000, 30.0),
    "bad-tokens": (100, 30.0),
    # Ends as soon as the hub drops it.
    "ping-flood": (1, 30.0),
    "reconnect-loop": (1, 30.0),
    "ping-flood-stolen": (1, 10.0),
    "reconnect-loop-stolen": (1, 10.0),
}


@contextlib.asynccontextmanager
async def separate_prober(url: str) -> AsyncIterator[dict[str, Any]]:
    """``bench.readyz_probe`` polling ``url`` while the context lasts; the dict it yields gets
    the prober's report when the context ends."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.readyz_probe",
        url,
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    report: dict[str, Any] = {}
    try:
        yield report
    finally:
        out, _ = await process.communicate(b"")
        report.update(json.loads(out))


def _outcome(m: Measured) -> str:
    parts = [f"w{m.outcomes['welcome']}"] if "welcome" in m.outcomes else []
    if m.dropped_after is not None:
        parts.append(f"dropped@{m.dropped_after:.1f}s")
    parts += [f"{k}: {v}" for k, v in sorted(m.outcomes.items()) if k[:1].isdigit()]
    parts += [k for k in m.outcomes if not k[:1].isdigit() and k not in ("welcome", "dropped")]
    if m.ledger_growth is not None:
        parts.append(f"ledger+{m.ledger_growth}")
    return ", ".join(parts) or "-"


HEADER = (
    f"{'attack':<22}{'offered':>10}{'rate/s':>9}{'secs':>6}{'rss0':>6}{'peak':>6}{'after':>6}"
    f"{'fd0':>5}{'fd1':>5}{'lp50':>6}{'lp99':>6}{'lf':>3}"
    f"{'rz50':>7}{'rz99':>7}{'rzmax':>7}{'rf':>4}{'lines':>6}  outcome"
)


def _p99(values: list[float]) -> float:
    ordered = sorted(values) or [float("nan")]
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


TARGETS = {"half-open-reconnecting": (2.0, 100.0)}
"""Attacks with targets: legitimate request p99 (s) at most, /readyz p99 (ms) under."""


def _targets(m: Measured) -> str | None:
    if m.attack not in TARGETS:
        return None
    legit_goal, readyz_goal = TARGETS[m.attack]
    missing = m.legit_failures or len(m.legit_ready) < len(m.legit)
    ready = _p99(m.legit_ready) if not missing else float("inf")
    readyz = float(m.readyz_separate.get("p99_ms", float("nan")))
    return (
        f"{m.attack}: legitimate allocation ready p99 {ready:.2f} s after its request "
        f"(target <= {legit_goal:g} s: {'met' if ready <= legit_goal else 'NOT met'}; "
        f"the CLI's round trip p99 {_p99(m.legit):.2f} s), /readyz p99 {readyz:.1f} ms "
        f"(target < {readyz_goal:g} ms: {'met' if readyz < readyz_goal else 'NOT met'})"
    )


def _row(m: Measured) -> str:
    legit = sorted(m.legit) or [float("nan")]
    p50 = statistics.median(legit)
    p99 = _p99(m.legit)
    rz = m.readyz_separate
    failures = m.readyz_failures + int(rz.get("failures", 0))
    rate = m.offered / m.seconds if m.seconds else 0.0
    return (
        f"{m.attack:<22}{m.offered:>10}{rate:>9.0f}{m.seconds:>6.1f}"
        f"{m.rss_before:>6.0f}{m.rss_peak:>6.0f}{m.rss_after:>6.0f}"
        f"{m.fds_before:>5}{m.fds_after:>5}{p50:>6.2f}{p99:>6.2f}{m.legit_failures:>3}"
        f"{rz.get('p50_ms', float('nan')):>7.1f}{rz.get('p99_ms', float('nan')):>7.1f}"
        f"{rz.get('max_ms', float('nan')):>7.1f}{failures:>4}{m.log_lines:>6}  {_outcome(m)}"
    )


async def _attacker(name: str, env: dict[str, str], marker: str) -> tuple[Attacker, str]:
    """The attacker's identity, and the allocation to release afterwards (holder attacks)."""
    if name in HOLDER_ATTACKS:
        allocation_id, identity = await unconnected_sidecar(env, marker)
        return Attacker(identity), allocation_id
    [victim] = await request_many(1, env, wait=True)
    return Attacker(sidecar_environment(marker, victim)), ""


async def main(args: argparse.Namespace) -> None:
    # Attackers need descriptors of their own.
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    marker = new_marker()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hubd-b") as tmp:
        state_dir = Path(tmp)
        config = hostile_config(state_dir / "hubd.toml", state_dir=state_dir, marker=marker)
        env = {"HUBD_STATE_DIR": str(state_dir), "HUBD_CONFIG": str(config)}
        dsn = f"postgresql://postgres@/hubd?host={tmp}/pgdata"
        daemon = DaemonProcess(config)
        await daemon.start()
        try:
            for name in args.only or list(ATTACKS):
                size, seconds = FULL[name]
                await request_many(1, env, wait=True)  # a bystander
                attacker, held = await _attacker(name, env, marker)
                before = await ledger_rows(dsn, held) if held else 0
                result = await measure(
                    daemon,
                    name,
                    size=size,
                    seconds=args.seconds or seconds,
                    env=env,
                    attacker=attacker,
                    legit_requests=args.legit,
                    separate_prober=separate_prober,
                    dsn=dsn,
                )
                if held:
                    result.ledger_growth = await ledger_rows(dsn, held) - before
                    await run_hubd_async("alloc", "release", held, env=env)
                rows.append(result)
        finally:
            await daemon.kill()
            kill_sidecars(marker)
    print(HEADER)
    for row in rows:
        print(_row(row))
    for row in rows:
        if (line := _targets(row)) is not None:
            print(line)
    if args.json:
        for row in rows:
            print(json_line(row))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", choices=sorted(ATTACKS))
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--legit", type=int, default=5, help="legitimate requests per attack")
    parser.add_argument("--json", action="store_true", help="also print JSON lines")
    asyncio.run(main(parser.parse_args()))
