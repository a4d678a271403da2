"""The ``container`` provisioner against the engine it drives, in one run, printing a table.

    .venv/bin/python -m bench.containers                          20 one at a time, 50 at once
    .venv/bin/python -m bench.containers --samples 5 --concurrent 10 --json containers.json

Needs root, Podman and busybox (``.ci/install-podman``). It starts a private engine
(``.ci/container-engine``), an embedded PostgreSQL (or uses ``--database-url``, a maintenance
DSN allowed to create databases) and a real ``hubd run`` whose container provisioner runs the
reference sidecar in every container, as the tests do (``tests/containerkit.py``: the busybox
image, this interpreter and checkout bind-mounted, host networking).

The baseline is the engine alone: a bare aiodocker loop creating, starting, stopping and
deleting containers of the very body the provisioner sends (``create_body``), whose sidecars
dial a bare websockets server in this process. Both sides start the same sidecar process and
wait for it to dial in, so the ratio is what hubd adds: its claim, the provisioner's inspects
and settle, the hub's handshake and the commits.

- **ensure → ready**: hubd, from the request (``hubd_v1.request``) to the notification of the
  row turning ready; engine, from the create call to the sidecar's handshake at the bare server.
- **release → destroyed**: hubd, from the release to the notification of the row's
  ``released`` (the container stopped and removed first); engine, stop + delete.
- **N at once**: hubd, N requests at once until every row is ready, then N releases until every
  row is released; engine, N create + start at once until every handshake, then N stop + delete.

One-at-a-time samples alternate engine and hubd, so that what else the machine does falls on
both alike; one warm-up of each goes first and is not counted. Ratios are hubd's over the
engine's (hubd's target: at most 1.3).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiodocker
from websockets.asyncio.server import ServerConnection, serve
from websockets.typing import Subprotocol

from bench import databases
from bench.procs import DaemonProcess
from bench.suite import machine
from bench.watch import Watcher
from hubd.client import Client
from hubd.plugins.container import ContainerOptions, parse_options
from hubd.plugins.container.engine import API_VERSION
from hubd.plugins.container.spec import container_name, create_body
from hubd.plugins.protocol import EnsureRequest
from hubd.sidecar.client import SUBPROTOCOL
from hubd.store.embedded import EmbeddedPostgres
from tests import containerkit

__all__ = ["main", "run"]

ROOT = Path(__file__).resolve().parent.parent
TARGET = 1.3
"""The ratio hubd / engine each measure is held to: hubd's overhead on top of the engine's."""
WITHIN = 300.0
"""How long any one wait may take before the run gives up (a wedged engine, a dead daemon)."""


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: a value that was measured, never an interpolation."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


class Arrivals:
    """The bare websockets server's record of sidecars dialing in: the moment (this process's
    monotonic clock) each sidecar id's first handshake completed. It sends no welcome; the
    sidecar only has to reach it, as it has to reach the hub."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self._changed = asyncio.Event()

    async def handler(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        self.at.setdefault(ws.request.headers.get("Hubd-Sidecar-Id", ""), time.monotonic())
        self._changed.set()
        await ws.wait_closed()

    async def wait_for(self, ids: list[str]) -> None:
        async with asyncio.timeout(WITHIN):
            while not all(i in self.at for i in ids):
                self._changed.clear()
                await self._changed.wait()


def _request(hub_url: str) -> EnsureRequest:
    return EnsureRequest(
        allocation_id=f"al_{uuid.uuid4().hex}",
        generation=1,
        tenant_id=None,
        session_id=None,
        spec={},
        sidecar_id=f"sc_{uuid.uuid4().hex}",
        token=f"hubd_sc_{uuid.uuid4().hex}{uuid.uuid4().hex}",
        hub_ws_url=hub_url,
    )


class Bare:
    """The engine alone, driven as the provisioner drives it (same body, same API version)."""

    def __init__(
        self, docker: aiodocker.Docker, options: ContainerOptions, hub: str, arrivals: Arrivals
    ) -> None:
        self.docker = docker
        self.options = options
        self.hub_url = hub
        self.arrivals = arrivals

    async def up(self) -> tuple[str, dict[str, float]]:
        """Create and start one container; its name and how long each step took (s)."""
        request = _request(self.hub_url)
        name = container_name(request.sidecar_id)
        began = time.monotonic()
        container = await self.docker.containers.create(
            create_body(self.options, "bare", request), name=name
        )
        created = time.monotonic()
        await container.start()
        started = time.monotonic()
        await self.arrivals.wait_for([request.sidecar_id])
        dialed = self.arrivals.at[request.sidecar_id]
        return name, {
            "create": created - began,
            "start": started - created,
            "dial": dialed - started,
            "ready": dialed - began,
        }

    async def down(self, name: str) -> float:
        """Stop (the provisioner's grace) and delete one container; how long it took (s)."""
        began = time.monotonic()
        container = self.docker.containers.container(name)
        await container.stop(t=round(self.options.stop_timeout))
        await container.delete(force=True, v=True)
        return time.monotonic() - began


class Hubd:
    """The daemon, driven as an application drives it: the client library's request and
    release, readiness and the end heard from the database (bench.watch)."""

    def __init__(self, client: Client, watcher: Watcher) -> None:
        self.client = client
        self.watcher = watcher

    async def up(self) -> tuple[str, float]:
        began = time.time()
        allocation = await self.client.request("container")
        await self.until(lambda: allocation.id in self.watcher.ready)
        return allocation.id, self.watcher.ready[allocation.id][0] - began

    async def down(self, allocation_id: str) -> float:
        began = time.time()
        await self.client.release(allocation_id)
        await self.until(lambda: allocation_id in self.watcher.done)
        status = (await self.client.get(allocation_id)).status
        if status != "released":
            raise RuntimeError(f"allocation {allocation_id} ended {status}, not released")
        return self.watcher.done[allocation_id][0] - began

    async def until(self, condition: Callable[[], bool]) -> None:
        if not await self.watcher.until(condition, within=WITHIN):
            raise RuntimeError(f"hubd did not get there within {WITHIN:g} s")


async def _at_once(count: int, one: Callable[[], Awaitable[Any]]) -> list[Any]:
    return list(await asyncio.gather(*(one() for _ in range(count))))


def _config(path: Path, *, dsn: str, state_dir: Path, claims: int, options: dict[str, Any]) -> Path:
    path.write_text(
        f'[database]\nurl = "{dsn}"\n[state]\ndir = "{state_dir}"\n'
        '[server]\nlisten = "127.0.0.1:0"\n[admin]\nlisten = "127.0.0.1:0"\n'
        f"[reconciler]\nmax_concurrent_claims = {claims}\n"
        '[log]\nformat = "json"\nlevel = "info"\n'
        '[[provisioners]]\nid = "container"\nplugin = "container"\n[provisioners.options]\n'
        + containerkit.toml_options(options)
        + "\n"
    )
    return path


async def _engine(directory: Path) -> containerkit.Engine:
    if os.geteuid() != 0 or shutil.which("podman") is None or shutil.which("busybox") is None:
        raise SystemExit("bench.containers needs root, podman and busybox (.ci/install-podman)")
    done = await asyncio.to_thread(
        subprocess.run,
        [str(ROOT / ".ci" / "container-engine"), "start", str(directory)],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"bench.containers: the engine did not start: {done.stderr[-500:]}")
    return containerkit.Engine(socket=done.stdout.strip(), directory=directory)


async def measure(
    args: argparse.Namespace, engine: containerkit.Engine, dsn: str, workdir: Path
) -> dict[str, Any]:
    deployment = f"hubd-bench-{os.getpid()}"
    options = containerkit.options(engine, deployment=deployment)
    bare_options = parse_options(
        {**options, "deployment": f"{deployment}-bare"}, provisioner_id="bare"
    )
    config = _config(
        workdir / "hubd.toml", dsn=dsn, state_dir=workdir / "state", claims=args.claims,
        options=options,
    )  # fmt: skip
    daemon = DaemonProcess(config, max_sockets=0)
    watcher = Watcher()
    arrivals = Arrivals()
    results: dict[str, Any] = {}
    async with (
        aiodocker.Docker(url=engine.socket, api_version=API_VERSION) as docker,
        await Client.connect(dsn, max_size=max(args.concurrent, 4)) as client,
    ):
        version = await docker.version()
        results["engine"] = {
            "socket": engine.socket,
            "version": str(version.get("Version", "")),
            "components": [c.get("Name") for c in version.get("Components") or []],
        }
        await watcher.start(dsn)
        try:
            await daemon.start()
            hubd = Hubd(client, watcher)
            # The bare side's hub: a websockets server that only takes the handshake.
            async with serve(
                arrivals.handler,
                "127.0.0.1",
                0,
                subprotocols=[Subprotocol(SUBPROTOCOL)],
                compression=None,
            ) as server:
                port = next(iter(server.sockets)).getsockname()[1]
                bare = Bare(docker, bare_options, f"ws://127.0.0.1:{port}", arrivals)
                results.update(await _phases(args, bare, hubd))
            left = await containerkit.containers(engine, deployment)
            results["containers_left"] = len(left)
        finally:
            await daemon.stop()
            await watcher.stop()
    return results


async def _phases(args: argparse.Namespace, bare: Bare, hubd: Hubd) -> dict[str, Any]:
    print("bench.containers: warming up", file=sys.stderr)
    name, _ = await bare.up()
    await bare.down(name)
    allocation_id, _ = await hubd.up()
    await hubd.down(allocation_id)

    engine_steps: dict[str, list[float]] = {"create": [], "start": [], "dial": [], "ready": []}
    engine_down: list[float] = []
    hubd_ready: list[float] = []
    hubd_down: list[float] = []
    for sample in range(args.samples):
        name, steps = await bare.up()
        for key, value in steps.items():
            engine_steps[key].append(value)
        engine_down.append(await bare.down(name))
        allocation_id, ready = await hubd.up()
        hubd_ready.append(ready)
        hubd_down.append(await hubd.down(allocation_id))
        print(f"bench.containers: sample {sample + 1}/{args.samples}", file=sys.stderr)

    n = args.concurrent
    print(f"bench.containers: {n} at once", file=sys.stderr)
    began = time.monotonic()
    ups = await _at_once(n, bare.up)
    engine_all_ready = time.monotonic() - began
    began = time.monotonic()
    await asyncio.gather(*(bare.down(name) for name, _ in ups))
    engine_all_down = time.monotonic() - began

    began = time.time()
    allocations = await _at_once(n, lambda: hubd.client.request("container"))
    ids = [allocation.id for allocation in allocations]
    await hubd.until(lambda: all(i in hubd.watcher.ready for i in ids))
    hubd_each_ready = [hubd.watcher.ready[i][0] - began for i in ids]
    hubd_all_ready = max(hubd_each_ready)
    began = time.time()
    await asyncio.gather(*(hubd.client.release(i) for i in ids))
    await hubd.until(lambda: all(i in hubd.watcher.done for i in ids))
    hubd_all_down = max(hubd.watcher.done[i][0] for i in ids) - began
    statuses = {(await hubd.client.get(i)).status for i in ids}
    if statuses != {"released"}:
        raise RuntimeError(f"{n} at once ended {sorted(statuses)}, not all released")

    return {
        "samples": {
            "engine": {**engine_steps, "down": engine_down},
            "hubd": {"ready": hubd_ready, "down": hubd_down},
        },
        "at_once": {
            "n": n,
            "engine": {
                "all_ready": engine_all_ready,
                "all_down": engine_all_down,
                "each_ready": [steps["ready"] for _, steps in ups],
            },
            "hubd": {
                "all_ready": hubd_all_ready,
                "all_down": hubd_all_down,
                "each_ready": hubd_each_ready,
            },
        },
    }


def measures(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The table's rows: hubd's figure, the engine's and their ratio."""
    samples = results["samples"]
    at_once = results["at_once"]
    rows: list[dict[str, Any]] = []
    for label, hubd_values, engine_values in (
        ("ensure → ready", samples["hubd"]["ready"], samples["engine"]["ready"]),
        ("release → destroyed", samples["hubd"]["down"], samples["engine"]["down"]),
    ):
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            rows.append(
                {
                    "measure": f"{label} {name} (ms)",
                    "hubd": 1000 * percentile(hubd_values, q),
                    "engine": 1000 * percentile(engine_values, q),
                }
            )
    n = at_once["n"]
    for label, key in (("all ready", "all_ready"), ("all destroyed", "all_down")):
        rows.append(
            {
                "measure": f"{n} at once: {label} (s)",
                "hubd": at_once["hubd"][key],
                "engine": at_once["engine"][key],
            }
        )
    for row in rows:
        row["ratio"] = row["hubd"] / row["engine"]
    return rows


def render(report: dict[str, Any]) -> str:
    rows = report["measures"]
    engine = report["results"]["engine"]
    described = report["machine"]
    steps = report["results"]["samples"]["engine"]
    lines = [
        f"bench.containers: {report['samples']} one at a time, {report['concurrent']} at once; "
        f"{described['nproc']} CPUs ({described['cpu']}), "
        f"{(engine['components'] or ['engine'])[0]} {engine['version']}; "
        f"max_concurrent_claims {report['claims']}",
        "",
        f"{'measure':<34}{'hubd':>10}{'engine':>10}{'ratio':>8}",
    ]
    for row in rows:
        mark = "" if row["ratio"] <= TARGET else "  > target"
        lines.append(
            f"{row['measure']:<34}{row['hubd']:>10.1f}{row['engine']:>10.1f}"
            f"{row['ratio']:>8.2f}{mark}"
        )
    lines += [
        "",
        "engine alone, per container (p50): "
        + ", ".join(
            f"{key} {1000 * statistics.median(steps[key]):.0f} ms"
            for key in ("create", "start", "dial")
        )
        + f"; stop + delete {1000 * statistics.median(steps['down']):.0f} ms",
        f"target: hubd / engine ≤ {TARGET}; containers of hubd's left after the run: "
        f"{report['results']['containers_left']}",
    ]
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    main_task = asyncio.current_task()
    assert main_task is not None
    # A TERM ends the run as Ctrl-C does: the finally blocks stop the daemon, the engine and
    # the embedded PostgreSQL instead of leaving them behind.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    load_before = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="hubd-benchc"))
    embedded: EmbeddedPostgres | None = None
    name = f"hubd_bench_containers_{os.getpid()}"
    engine: containerkit.Engine | None = None
    try:
        engine = await _engine(workdir / "engine")
        if args.database_url:
            maintenance = args.database_url
        else:
            embedded = EmbeddedPostgres(workdir)
            maintenance = await asyncio.to_thread(embedded.start)
        dsn = await databases.fresh(maintenance, name)
        try:
            results = await measure(args, engine, dsn, workdir)
        finally:
            await databases.drop(maintenance, name)
    finally:
        if embedded is not None:
            embedded.stop()
        if engine is not None:
            await asyncio.to_thread(
                subprocess.run,
                [str(ROOT / ".ci" / "container-engine"), "stop", str(engine.directory)],
                capture_output=True, check=False, timeout=120,
            )  # fmt: skip
        shutil.rmtree(workdir, ignore_errors=True)
    described = machine()
    described["load_average_before"] = load_before
    report: dict[str, Any] = {
        "samples": args.samples,
        "concurrent": args.concurrent,
        "claims": args.claims,
        "machine": described,
        "results": results,
    }
    report["measures"] = measures(results)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=20, help="one-at-a-time samples")
    parser.add_argument("--concurrent", type=int, default=50, help="allocations at once")
    parser.add_argument("--claims", type=int, default=16, help="max_concurrent_claims")
    parser.add_argument("--database-url", default="", help="maintenance DSN (default: embedded)")
    parser.add_argument("--json", type=Path, help="write the report here as well")
    args = parser.parse_args(argv)
    if args.samples < 1 or args.concurrent < 1:
        parser.error("--samples and --concurrent must be at least 1")
    report = asyncio.run(run(args))
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
