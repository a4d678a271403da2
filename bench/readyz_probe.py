"""A /readyz prober in a process of its own, so what it measures is the daemon's answer time and
not the event-loop stalls of whoever is attacking it.

    python -m bench.readyz_probe http://127.0.0.1:9465/readyz [--every 0.05]

Probes until its standard input closes, then prints one JSON object: probes, failures (a status
other than 200, or no answer within 10 s), the first few problems, and p50 / p99 / max answer
times in milliseconds.
"""

from __future__ import annotations

import argparse
import http.client
import json
import select
import sys
import time
import urllib.parse
from typing import Any


def _percentile(sorted_values: list[float], fraction: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, round(fraction * (len(sorted_values) - 1)))]


def probe_once(host: str, port: int, path: str) -> tuple[float, str | None]:
    """One GET on a fresh connection (as a liveness probe makes it): seconds, and a problem."""
    started = time.perf_counter()
    problem = None
    connection = http.client.HTTPConnection(host, port, timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        body = response.read()
        if response.status != 200:
            problem = f"{response.status} {body.decode(errors='replace').strip()}"
    except (OSError, http.client.HTTPException) as exc:
        problem = f"{type(exc).__name__}: {exc}"
    finally:
        connection.close()
    return time.perf_counter() - started, problem


def run(url: str, every: float) -> dict[str, Any]:
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    times: list[float] = []
    problems: list[str] = []
    failures = 0
    while True:
        took, problem = probe_once(host, port, parts.path or "/")
        times.append(took)
        if problem is not None:
            failures += 1
            if len(problems) < 5:
                problems.append(problem)
        # Waiting on stdin doubles as the pause between probes: EOF means stop.
        readable, _, _ = select.select([sys.stdin], [], [], every)
        if readable and not sys.stdin.buffer.read1(4096):
            break
    times.sort()
    return {
        "probes": len(times),
        "failures": failures,
        "problems": problems,
        "p50_ms": _percentile(times, 0.5) * 1000,
        "p99_ms": _percentile(times, 0.99) * 1000,
        "max_ms": times[-1] * 1000,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("url")
    parser.add_argument("--every", type=float, default=0.05, help="seconds between probes")
    args = parser.parse_args()
    print(json.dumps(run(args.url, args.every)), flush=True)
