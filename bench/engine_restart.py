"""What a container engine's restart does to the ``container`` provisioner's allocations.

    .venv/bin/python -m bench.engine_restart                          every row, 3 runs each
    .venv/bin/python -m bench.engine_restart --rows podman --runs 2 --json restart.json

Needs root, busybox, Podman and Debian's docker.io (``.ci/install-podman``). Each run starts a
real ``hubd run`` (``bench.procs.DaemonProcess``) on a database of its own in an embedded
PostgreSQL, whose container provisioner runs the reference sidecar in every container
(``tests/containerkit.py``: the busybox image, this interpreter and checkout bind-mounted, host
networking), with ``[reconciler] connect_timeout = "20s"`` (``--connect-timeout``). Five
allocations (``--allocations``) are requested and waited ready, then the engine's daemon is
restarted with ``.ci/container-engine restart``, as an upgrade or ``systemctl restart`` does,
and the run watches, every 50 ms, each allocation's row (``hubd_v1.allocations``, what an
application reads), and every 200 ms ``/readyz`` and ``hubd_provisioner_watch_failures_total``;
the ledger's entries (database clock) and the
daemon's ``sidecar_watch_*`` / ``sidecar_died`` log lines say what hubd did and when. Times
are seconds from the moment the restart began.

The rows (``--rows``), each on a private engine (``.ci/container-engine start``):

- ``dockerd``: dockerd without live-restore, automatic_replacement_recovery off;
- ``dockerd-recovery``: the same engine, ``automatic_replacement_recovery = true``;
- ``dockerd-live-restore``: dockerd with ``"live-restore": true``;
- ``podman``: Podman's API service (``podman system service``).

A run ends once every allocation has settled (ended, or ready again) and the watch follows the
engine again, at least 5 s after the restart returned; or, at the latest, ``connect_timeout``
+ 15 s after it (so that a death hubd did not hear of shows as the connect deadline's release).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import asyncpg

from bench import databases
from bench.procs import DaemonProcess
from hubd.client import Client
from hubd.store.embedded import EmbeddedPostgres
from tests import containerkit

__all__ = ["main", "run"]

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "container-engine"
ROWS: Final = {
    # name: (engine kind, live-restore, automatic_replacement_recovery)
    "dockerd": ("dockerd", False, False),
    "dockerd-recovery": ("dockerd", False, True),
    "dockerd-live-restore": ("dockerd", True, False),
    "podman": ("podman", False, False),
}
LABELS: Final = {
    "dockerd": "dockerd",
    "dockerd-recovery": "dockerd, `automatic_replacement_recovery = true`",
    "dockerd-live-restore": 'dockerd, `"live-restore": true`',
    "podman": "Podman (its API service)",
}
ROW_EVERY = 0.05
ADMIN_EVERY = 0.2
SETTLE_AFTER = 5.0
"""The least a run watches after the restart returned."""
WATCH_EVENTS: Final = ("sidecar_watch_failed", "sidecar_watch_following", "sidecar_died")
_FAILURES = re.compile(r"^hubd_provisioner_watch_failures_total\{([^}]*)\} (\S+)$")


async def _engine(kind: str, live_restore: bool, directory: Path) -> containerkit.Engine:
    env = {**os.environ, "HUBD_TEST_LIVE_RESTORE": "1" if live_restore else "0"}
    done = await asyncio.to_thread(
        subprocess.run,
        [str(SCRIPT), "start", str(directory), "runc", kind],
        env=env, capture_output=True, text=True, check=False, timeout=180,
    )  # fmt: skip
    if done.returncode != 0:
        await _stop_engine(directory)
        raise SystemExit(f"bench.engine_restart: {kind} did not start: {done.stderr[-500:]}")
    return containerkit.Engine(socket=done.stdout.strip(), directory=directory, kind=kind)


async def _stop_engine(directory: Path) -> None:
    await asyncio.to_thread(
        subprocess.run, [str(SCRIPT), "stop", str(directory)],
        capture_output=True, check=False, timeout=180,
    )  # fmt: skip


def _config(
    path: Path, *, dsn: str, options: dict[str, Any], connect_timeout: float, recovery: bool
) -> Path:
    path.write_text(
        f'[database]\nurl = "{dsn}"\n[state]\ndir = "{path.parent / "state"}"\n'
        '[server]\nlisten = "127.0.0.1:0"\n[admin]\nlisten = "127.0.0.1:0"\n'
        f'[reconciler]\nconnect_timeout = "{connect_timeout:g}s"\n'
        f"automatic_replacement_recovery = {'true' if recovery else 'false'}\n"
        '[log]\nformat = "json"\nlevel = "info"\n'
        '[[provisioners]]\nid = "container"\nplugin = "container"\n[provisioners.options]\n'
        + containerkit.toml_options(options)
        + "\n"
    )
    return path


async def _admin(daemon: DaemonProcess, path: str) -> tuple[int, str]:
    """``GET path`` on the daemon's admin listener: the status and the body."""
    hostport = str(daemon.running["admin"]).removeprefix("http://").partition("/")[0]
    host, _, port = hostport.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: {hostport}\r\nConnection: close\r\n\r\n".encode()
        )
        await writer.drain()
        head, _, body = (await reader.read()).decode(errors="replace").partition("\r\n\r\n")
    finally:
        writer.close()
    return int(head.split(" ", 2)[1]), body


def _watch_failures(metrics: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in metrics.splitlines():
        matched = _FAILURES.match(line)
        if matched:
            code = re.search(r'code="([^"]*)"', matched.group(1))
            found[code.group(1) if code else ""] = float(matched.group(2))
    return found


def _shape(line: str) -> str:
    """A ``/readyz`` line with its running count of seconds left out."""
    return re.sub(r"for \d+s;", "for Ns;", line)


class Observer:
    """What the run sees after the restart began, in seconds from ``t0`` (``time.time()``)."""

    def __init__(self, conn: asyncpg.Connection, daemon: DaemonProcess, ids: list[str]) -> None:
        self.conn = conn
        self.daemon = daemon
        self.ids = ids
        self.t0 = time.time()
        self.rows: dict[str, dict[str, Any]] = {}
        self.not_ready: dict[str, float] = {}
        self.ready_again: dict[str, float] = {}
        self.statuses: dict[str, list[tuple[float, str]]] = {i: [] for i in ids}
        self.readyz: dict[str, float] = {}
        """Each ``/readyz`` answer's first line and detail (seconds shown as N): first seen."""
        self.readyz_last: dict[str, float] = {}
        self.failures_before: dict[str, float] = {}
        self.failures: dict[str, float] = {}

    def now(self) -> float:
        return time.time() - self.t0

    async def rows_loop(self) -> None:
        while True:
            found = await self.conn.fetch(
                "SELECT id, status, ready AS connection_ready, generation, failure_code,"
                " failure_message, end_reason FROM hubd_v1.allocations WHERE id = ANY($1::text[])",
                self.ids,
            )
            at = self.now()
            for row in found:
                i = row["id"]
                self.rows[i] = dict(row)
                if not row["connection_ready"]:
                    self.not_ready.setdefault(i, at)
                elif i in self.not_ready:
                    self.ready_again.setdefault(i, at)
                if not self.statuses[i] or self.statuses[i][-1][1] != row["status"]:
                    self.statuses[i].append((at, row["status"]))
            await asyncio.sleep(ROW_EVERY)

    async def admin_loop(self) -> None:
        while True:
            at = self.now()
            try:
                status, body = await self.daemon_get("/readyz")
                lines = body.strip().splitlines()
                shape = f"{status} {lines[0] if lines else ''}"
                for line in [shape, *(_shape(line) for line in lines[1:])]:
                    self.readyz.setdefault(line, at)
                    self.readyz_last[line] = at
                _, metrics = await self.daemon_get("/metrics")
                self.failures = _watch_failures(metrics)
            except (OSError, ValueError, IndexError) as exc:
                self.readyz.setdefault(f"admin unreachable: {exc}", at)
            await asyncio.sleep(ADMIN_EVERY)

    async def daemon_get(self, path: str) -> tuple[int, str]:
        return await _admin(self.daemon, path)

    def settled(self) -> bool:
        for i in self.ids:
            row = self.rows.get(i)
            if row is None:
                return False
            ended = row["status"] in ("released", "failed", "destroy_failed")
            if not ended and not (row["connection_ready"] and row["status"] == "allocated"):
                return False
        return True

    def following_again(self) -> bool:
        """Whether the daemon's watch follows the engine after its last failure."""
        events = [e for e in self.watch_events() if e["event"] != "sidecar_died"]
        return not events or events[-1]["event"] == "sidecar_watch_following"

    def watch_events(self) -> list[dict[str, Any]]:
        found = []
        for text in self.daemon.lines:
            if not any(name in text for name in WATCH_EVENTS):
                continue
            try:
                line = json.loads(text)
            except ValueError:
                continue
            stamp = line.get("timestamp")
            if line.get("event") not in WATCH_EVENTS or not isinstance(stamp, str):
                continue
            at = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() - self.t0
            if at >= 0:
                found.append({"at": round(at, 2), **line})
        return found


async def _containers(engine: containerkit.Engine, deployment: str) -> list[dict[str, Any]]:
    return [
        {
            "id": c["Id"][:12],
            "status": c["State"]["Status"],
            "exit_code": c["State"].get("ExitCode"),
            "started_at": c["State"].get("StartedAt"),
        }
        for c in await containerkit.containers(engine, deployment)
    ]


async def one_run(
    args: argparse.Namespace,
    row: str,
    engine: containerkit.Engine,
    maintenance: str,
    workdir: Path,
) -> dict[str, Any]:
    _kind, _live_restore, recovery = ROWS[row]
    deployment = f"hubd-restart-{uuid.uuid4().hex[:8]}"
    name = f"hubd_bench_restart_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    rundir = workdir / deployment
    rundir.mkdir()
    dsn = await databases.fresh(maintenance, name)
    options = containerkit.options(engine, deployment=deployment)
    config = _config(
        rundir / "hubd.toml", dsn=dsn, options=options, connect_timeout=args.connect_timeout,
        recovery=recovery,
    )  # fmt: skip
    daemon = DaemonProcess(config, max_sockets=0)
    result: dict[str, Any] = {"row": row}
    try:
        await daemon.start()
        async with await Client.connect(dsn, max_size=args.allocations) as client:
            requested = await asyncio.gather(
                *(client.request("container") for _ in range(args.allocations))
            )
            ids = [allocation.id for allocation in requested]
            await _until_ready(client, ids)
        before = await _containers(engine, deployment)
        conn = await asyncpg.connect(dsn)
        try:
            result.update(
                await _restart(
                    args=args,
                    engine=engine,
                    deployment=deployment,
                    daemon=daemon,
                    conn=conn,
                    ids=ids,
                    before=before,
                )
            )
        finally:
            await conn.close()
    finally:
        await daemon.stop()
        await containerkit.remove_all(engine, deployment)
        await databases.drop(maintenance, name)
    return result


async def _until_ready(client: Client, ids: list[str], within: float = 120) -> None:
    async with asyncio.timeout(within):
        while True:
            rows = [await client.get(i) for i in ids]
            if all(row.ready for row in rows):
                return
            await asyncio.sleep(0.2)


async def _restart(
    *,
    args: argparse.Namespace,
    engine: containerkit.Engine,
    deployment: str,
    daemon: DaemonProcess,
    conn: asyncpg.Connection,
    ids: list[str],
    before: list[dict[str, Any]],
) -> dict[str, Any]:
    observer = Observer(conn, daemon, ids)
    _, metrics = await observer.daemon_get("/metrics")
    observer.failures_before = _watch_failures(metrics)
    observer.failures = dict(observer.failures_before)
    tasks = [asyncio.create_task(observer.rows_loop()), asyncio.create_task(observer.admin_loop())]
    try:
        observer.t0 = time.time()
        await asyncio.to_thread(
            subprocess.run, [str(SCRIPT), "restart", str(engine.directory)],
            capture_output=True, check=True, timeout=120,
        )  # fmt: skip
        restart = observer.now()
        after = await _containers(engine, deployment)
        latest = restart + args.connect_timeout + 15
        while observer.now() < latest:
            if (
                observer.now() >= restart + SETTLE_AFTER
                and observer.settled()
                and observer.following_again()
            ):
                break
            await asyncio.sleep(0.1)
        ended = await _containers(engine, deployment)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    ledger = await conn.fetch(
        "SELECT allocation_id, at, generation, kind, from_status, to_status, error_code, message"
        " FROM hubd_allocation_ledger WHERE allocation_id = ANY($1::text[]) AND at >= $2"
        " ORDER BY at",
        ids,
        datetime.fromtimestamp(observer.t0).astimezone(),
    )
    started = {c["id"]: c["started_at"] for c in before}
    return {
        "restart_s": restart,
        "containers_before": before,
        "containers_after": after,
        "containers_same": {c["id"]: c["started_at"] for c in after} == started,
        "containers_at_end": ended,
        "not_ready": observer.not_ready,
        "ready_again": observer.ready_again,
        "statuses": observer.statuses,
        "final": {
            i: {k: v for k, v in row.items() if k != "id"} for i, row in observer.rows.items()
        },
        "ledger": [
            {
                **{k: v for k, v in dict(entry).items() if k != "at"},
                "at": round(entry["at"].timestamp() - observer.t0, 3),
            }
            for entry in ledger
        ],
        "readyz": {
            line: [first, observer.readyz_last[line]] for line, first in observer.readyz.items()
        },
        "watch_failures": {
            code: value - observer.failures_before.get(code, 0.0)
            for code, value in observer.failures.items()
            if value != observer.failures_before.get(code, 0.0)
        },
        "watch_events": [
            {
                k: e.get(k)
                for k in ("at", "event", "code", "error", "reason", "exit_code", "allocation_id")
                if e.get(k) is not None
            }
            for e in observer.watch_events()
        ],
        "observed_s": observer.now(),
    }


def _span(values: list[float]) -> str:
    if not values:
        return "—"
    low, high = min(values), max(values)
    return f"{low:.1f} s" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f}-{high:.1f} s"


def summarize(row: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row from a row's runs: ranges over every run and allocation."""
    after = collections.Counter()
    for result in runs:
        states = collections.Counter(c["status"] for c in result["containers_after"])
        codes = sorted(
            {c["exit_code"] for c in result["containers_after"] if c["status"] != "running"}
        )
        text = ", ".join(f"{n} `{s}`" for s, n in sorted(states.items()))
        if codes:
            text += f" (exit {'/'.join(map(str, codes))})"
        if result["containers_same"] and set(states) == {"running"}:
            text += ", same start times"
        after[text] += 1
    changes: dict[str, list[float]] = collections.defaultdict(list)
    failures: collections.Counter[str] = collections.Counter()
    for result in runs:
        for entry in result["ledger"]:
            if entry["to_status"] and entry["to_status"] != entry["from_status"]:
                changes[f"{entry['from_status']}→{entry['to_status']}"].append(entry["at"])
            if entry["error_code"]:
                message = re.sub(r": .*", ": …", entry["message"] or "")
                failures[f"{entry['kind']} {entry['error_code']} {message}"] += 1
    watch = collections.Counter()
    for result in runs:
        for code, n in result["watch_failures"].items():
            watch[code] += int(n)
    following = [
        e["at"] for result in runs for e in result["watch_events"]
        if e["event"] == "sidecar_watch_following"
    ]  # fmt: skip
    died = [
        e["at"] for result in runs for e in result["watch_events"] if e["event"] == "sidecar_died"
    ]
    readyz = sorted({line for result in runs for line in result["readyz"]})
    return {
        "row": row,
        "runs": len(runs),
        "restart": _span([r["restart_s"] for r in runs]),
        "containers_after": dict(after),
        "not_ready": _span([t for r in runs for t in r["not_ready"].values()]),
        "ready_again": _span([t for r in runs for t in r["ready_again"].values()]),
        "transitions": {k: _span(v) for k, v in sorted(changes.items())},
        "failures": dict(failures),
        "sidecar_died": _span(died),
        "watch_following_again": _span(following),
        "watch_failures": dict(watch),
        "readyz": readyz,
        "final": dict(
            collections.Counter(
                f"{f['status']} gen {f['generation']}{' ready' if f['connection_ready'] else ''}"
                f" failure {f['failure_code']} end_reason {f['end_reason']}"
                for r in runs
                for f in r["final"].values()
            )
        ),
    }


def render(summaries: list[dict[str, Any]]) -> str:
    lines = []
    for s in summaries:
        lines += [
            f"== {LABELS[s['row']]} ({s['runs']} runs)",
            f"restart: {s['restart']}",
            f"containers after it: {s['containers_after']}",
            f"not ready: {s['not_ready']}; ready again: {s['ready_again']}",
            f"status changes: {s['transitions']}",
            f"failures: {s['failures']}",
            f"sidecar_died logged: {s['sidecar_died']}; watch following again: "
            f"{s['watch_following_again']}; watch failures: {s['watch_failures']}",
            "readyz: " + " | ".join(s["readyz"]),
            f"final: {s['final']}",
            "",
        ]
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    workdir = Path(tempfile.mkdtemp(prefix="hubd-benchr"))
    embedded = EmbeddedPostgres(workdir)
    results: dict[str, list[dict[str, Any]]] = {row: [] for row in args.rows}
    try:
        maintenance = await asyncio.to_thread(embedded.start)
        # One engine for the rows that share its settings (dockerd with and without recovery).
        engines: dict[tuple[str, bool], list[str]] = {}
        for row in args.rows:
            engines.setdefault(ROWS[row][:2], []).append(row)
        for (kind, live_restore), rows in engines.items():
            directory = workdir / f"engine-{kind}{'-lr' if live_restore else ''}"
            engine = await _engine(kind, live_restore, directory)
            try:
                for row in rows:
                    for n in range(args.runs):
                        print(f"bench.engine_restart: {row} run {n + 1}", file=sys.stderr)
                        results[row].append(await one_run(args, row, engine, maintenance, workdir))
            finally:
                await _stop_engine(directory)
    finally:
        await asyncio.to_thread(embedded.stop)
        shutil.rmtree(workdir, ignore_errors=True)
    versions = {}
    for tool in ("dockerd", "podman"):
        if shutil.which(tool):
            process = await asyncio.create_subprocess_exec(
                tool, "--version", stdout=asyncio.subprocess.PIPE
            )
            versions[tool] = (await process.communicate())[0].decode().strip()
    return {
        "connect_timeout": args.connect_timeout,
        "allocations": args.allocations,
        "versions": versions,
        "runs": results,
        "summaries": [summarize(row, results[row]) for row in args.rows],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rows", type=lambda v: v.split(","), default=list(ROWS))
    parser.add_argument("--runs", type=int, default=3, help="runs of each row")
    parser.add_argument("--allocations", type=int, default=5)
    parser.add_argument("--connect-timeout", type=float, default=20.0, help="seconds")
    parser.add_argument("--json", type=Path, help="write every run's record here as well")
    args = parser.parse_args(argv)
    unknown = [row for row in args.rows if row not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown} (of {', '.join(ROWS)})")
    if os.geteuid() != 0:
        parser.error("needs root (a private engine)")
    report = asyncio.run(run(args))
    print(render(report["summaries"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
