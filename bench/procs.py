"""The processes a benchmark run starts: the daemon, the sidecar farm, the bare server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import resource
import signal
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hubd.config import EventLoop

__all__ = [
    "BareServer",
    "DaemonProcess",
    "FarmClient",
    "children",
    "cpu_seconds",
    "raise_open_files",
    "rss_kib",
    "server_processes",
]


def raise_open_files() -> int:
    """Raise this process's open-file limit to the hard limit (children inherit it)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def cpu_seconds(pids: Iterable[int]) -> float:
    """CPU time used so far by the live threads of ``pids`` together (those still running).

    Read from each thread's ``schedstat`` (nanoseconds on a CPU), not from ``stat``'s clock
    ticks: a tiny run's storm costs the bare server less than one 10 ms tick, which ``stat``
    reads as no time at all."""
    total = 0
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, IndexError, ValueError):
                continue
    return total / 1e9


def server_processes(backend_pid: int) -> list[int]:
    """A local PostgreSQL's processes: the parent of one of its backends and every child of
    that parent; empty when the server is not on this machine."""
    try:
        parent = int(Path(f"/proc/{backend_pid}/stat").read_text().rpartition(")")[2].split()[1])
    except OSError:
        return []
    return [parent, *children(parent)]


def children(parent: int, *, live: bool = False) -> list[int]:
    """The processes whose parent is ``parent`` (with ``live``, not those already exited and
    waiting to be reaped)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == parent and not (live and fields[0] == "Z"):
            found.append(int(entry.name))
    return found


def _child_env(extra: dict[str, str] | None = None, *, root: Path | None = None) -> dict[str, str]:
    """The environment of a child: this checkout's (or ``root``'s) packages first on its path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HUBD_")}
    tree = str(root or Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH", "")]))
    env.pop("PYTHONASYNCIODEBUG", None)
    env.update(extra or {})
    return env


async def _stop(process: asyncio.subprocess.Process, within: float = 30) -> None:
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(within):
            await process.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()


class DaemonProcess:
    """``hubd run`` (through ``bench.launch``), its log written to a file beside its config.

    A file, not a pipe read here: a storm logs a line per handshake, and reading them in this
    process cost 0.02 ms of CPU a handshake on the two cores being measured (the bare server
    logs nothing). The file is read until the daemon says it runs, and again on failure."""

    def __init__(self, config: Path, *, max_sockets: int, root: Path | None = None) -> None:
        self.config = config
        self.max_sockets = max_sockets
        self.root = root
        """The checkout whose ``hubd`` runs; ``None``: this one."""
        self.process: asyncio.subprocess.Process | None = None
        self.running: dict[str, Any] = {}
        self.log_path = config.with_suffix(".log")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def lines(self) -> list[str]:
        """The daemon's log so far."""
        try:
            return self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return []

    async def start(self) -> None:
        with self.log_path.open("wb") as log:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "bench.launch",
                "run",
                "--config",
                str(self.config),
                env=_child_env({"BENCH_MAX_SOCKETS": str(self.max_sockets)}, root=self.root),
                # ``-m`` puts the working directory first on the path, before PYTHONPATH.
                cwd=self.root,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=log,
            )
        try:
            async with asyncio.timeout(60):
                await self._announced()
        except TimeoutError:
            raise RuntimeError("hubd did not start:\n" + "\n".join(self.lines[-20:])) from None
        if not self.running:
            raise RuntimeError("hubd exited at start:\n" + "\n".join(self.lines[-20:]))

    async def _announced(self) -> None:
        """Until the daemon's log announces it running (``self.running``), or it exits."""
        assert self.process is not None
        while self.process.returncode is None:
            for text in self.lines:
                # The announcement of a daemon that is up (spelled either way across versions).
                if '"hubd running"' in text or '"hubd_running"' in text:
                    self.running = json.loads(text)
                    return
            await asyncio.sleep(0.05)

    async def metrics(self) -> dict[str, float]:
        """The daemon's ``/metrics`` samples, each summed over its labels but ``batcher``'s
        (``hubd_batched_statements{batcher="park"}`` stays a key of its own)."""
        rest = str(self.running["admin"]).removeprefix("http://")
        hostport = rest.partition("/")[0]
        host, _, port = hostport.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(f"GET /metrics HTTP/1.1\r\nHost: {hostport}\r\n\r\n".encode())
            await writer.drain()
            body = (await reader.read()).decode().partition("\r\n\r\n")[2]
        finally:
            writer.close()
        found: dict[str, float] = {}
        for line in body.splitlines():
            if not line or line.startswith("#"):
                continue
            sample, _, value = line.rpartition(" ")
            name, _, labels = sample.partition("{")
            batcher = re.search(r'batcher="([^"]*)"', labels)
            key = f"{name}{{{batcher.group(1)}}}" if batcher else name
            found[key] = found.get(key, 0.0) + float(value)
        return found

    async def refusals(self) -> dict[str, float]:
        """The listener's refusals so far: HTTP refusals of handshakes and sockets refused by
        a resource bound, each summed over its labels."""
        found = await self.metrics()
        return {
            name: found.get(name, 0.0)
            for name in ("hubd_handshakes_rejected", "hubd_sockets_refused")
        }

    async def stop(self) -> None:
        if self.process is not None:
            await _stop(self.process)


class FarmClient:
    """The farm process and a control connection to it."""

    def __init__(
        self, socket_path: Path, *, concurrency: int = 64, loop: EventLoop = "uvloop"
    ) -> None:
        self.socket_path = socket_path
        self.concurrency = concurrency
        self.loop = loop
        self.running_loop = ""
        """The loop the farm reports it runs on, once started."""
        self.process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.farm",
            str(self.socket_path),
            "--concurrency",
            str(self.concurrency),
            "--loop",
            self.loop,
            env=_child_env(),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
        )
        assert self.process.stdout is not None
        async with asyncio.timeout(30):
            line = await self.process.stdout.readline()
        if b"farm ready" not in line:
            raise RuntimeError("the sidecar farm did not start")
        self._reader, self._writer = await asyncio.open_unix_connection(
            str(self.socket_path), limit=1 << 26
        )
        self.running_loop = str((await self.call("status"))["loop"])

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        assert self._reader is not None
        assert self._writer is not None
        self._writer.write(json.dumps({"op": op, **fields}).encode() + b"\n")
        await self._writer.drain()
        answer: dict[str, Any] = json.loads(await self._reader.readline())
        if "error" in answer:
            raise RuntimeError(f"farm {op}: {answer['error']}")
        return answer

    async def stop(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self.process is not None:
            await _stop(self.process, within=10)


class BareServer:
    def __init__(self) -> None:
        self.process: asyncio.subprocess.Process | None = None
        self.url = ""

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.bare",
            env=_child_env(),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
        )
        assert self.process.stdout is not None
        async with asyncio.timeout(30):
            port = int(await self.process.stdout.readline())
        self.url = f"ws://127.0.0.1:{port}/"

    async def stop(self) -> None:
        if self.process is not None:
            await _stop(self.process, within=10)
