"""The attacks of tests/hostile/ at full size against a real ``hubd run``, one table printed.

    .venv/bin/python -m bench.hostile
    .venv/bin/python -m bench.hostile --only header-flood --seconds 10

Each attack runs against one daemon (a fresh state dir and embedded PostgreSQL) while /readyz
is probed every 50 ms and legitimate ``alloc request --wait`` calls run one after another.
Columns: offered (bytes, connections, handshakes, pings or reconnects, by attack), RSS before /
peak / after settling (MiB), descriptors before / after, worst /readyz time, legitimate request
latency p50 / p99, and the daemon's log lines during the attack.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import tempfile
from pathlib import Path

from tests.daemonkit import DaemonProcess, kill_sidecars, new_marker, write_config
from tests.hostilekit import ATTACKS, Measured, measure, stolen_identity
from tests.test_daemon import request_many

FULL = {
    "header-flood": (500, 10.0),
    "half-open": (2000, 15.0),
    "bad-tokens": (100, 30.0),
    "ping-flood": (1, 30.0),
    "reconnect-loop": (1, 30.0),
}


def _row(m: Measured) -> str:
    legit = sorted(m.legit) or [float("nan")]
    p50 = statistics.median(legit)
    p99 = legit[min(len(legit) - 1, round(0.99 * (len(legit) - 1)))]
    return (
        f"{m.attack:<15}{m.offered:>12}{m.seconds:>7.1f}"
        f"{m.rss_before:>8.0f}{m.rss_peak:>7.0f}{m.rss_after:>7.0f}"
        f"{m.fds_before:>6}{m.fds_after:>6}{m.readyz_worst * 1000:>8.1f}{m.readyz_failures:>5}"
        f"{p50:>7.2f}{p99:>7.2f}{m.legit_failures:>5}{m.log_lines:>7}"
    )


async def main(args: argparse.Namespace) -> None:
    # Attackers need descriptors of their own.
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    marker = new_marker()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hubd-b") as tmp:
        state_dir = Path(tmp)
        config = write_config(state_dir / "hubd.toml", state_dir=state_dir, marker=marker)
        env = {"HUBD_STATE_DIR": str(state_dir), "HUBD_CONFIG": str(config)}
        daemon = DaemonProcess(config)
        await daemon.start()
        try:
            for name in args.only or list(ATTACKS):
                size, seconds = FULL[name]
                _healthy, victim = await request_many(2, env, wait=True)
                rows.append(
                    await measure(
                        daemon,
                        name,
                        size=size,
                        seconds=args.seconds or seconds,
                        env=env,
                        identity=stolen_identity(marker, victim),
                        legit_requests=args.legit,
                    )
                )
        finally:
            await daemon.kill()
            kill_sidecars(marker)
    print(
        f"{'attack':<15}{'offered':>12}{'secs':>7}{'rss0':>8}{'peak':>7}{'after':>7}"
        f"{'fd0':>6}{'fd1':>6}{'readyms':>8}{'rfail':>5}{'p50':>7}{'p99':>7}{'lfail':>5}{'lines':>7}"
    )
    for row in rows:
        print(_row(row))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", choices=sorted(ATTACKS))
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--legit", type=int, default=5, help="legitimate requests per attack")
    asyncio.run(main(parser.parse_args()))
