"""Running ``hubd run`` as a real child process, and watching what it and its sidecars do."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.clikit import hubd_env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


INSTANCE_TTL = 5.0
"""Seconds a test daemon's instance stays alive without a heartbeat (``[instance] ttl``)."""


def daemon_sections(
    *,
    database_url: str,
    state_dir: Path,
    server_port: int,
    operation_timeout: str = "5s",
    max_concurrent_claims: int | None = 8,
) -> str:
    """The sections every test daemon's config starts with: its database (embedded in
    ``state_dir`` when ``database_url`` is empty), both listeners on loopback, and reconciler
    and instance timings short enough for a test (``max_concurrent_claims`` ``None``: the
    default)."""
    claims = (
        ""
        if max_concurrent_claims is None
        else f"max_concurrent_claims = {max_concurrent_claims}\n"
    )
    return f"""[database]
url = "{database_url}"
[state]
dir = "{state_dir}"
[server]
listen = "127.0.0.1:{server_port}"
[admin]
listen = "127.0.0.1:0"
[reconciler]
lease_duration = "10s"
connect_timeout = "30s"
operation_timeout = "{operation_timeout}"
{claims}poll_interval = "1s"
repair_interval = "2s"
shutdown_grace = "5s"
[instance]
heartbeat_interval = "1s"
ttl = "{INSTANCE_TTL:g}s"
"""


LOG_SECTION = '[log]\nformat = "json"\nlevel = "info"\n'
"""JSON lines, which :class:`DaemonProcess` parses."""


def write_config(
    path: Path,
    *,
    database_url: str = "",
    state_dir: Path,
    server_port: int = 0,
    marker: str,
    extra: str = "",
    plugin: str = "local",
    plugin_options: str = "",
    provisioner_keys: str = "",
    sidecar_args: Sequence[str] = (),
) -> Path:
    """A config for tests: short timeouts, the local provisioner running the reference sidecar
    (with ``sidecar_args`` after ``hubd sidecar``) with ``marker`` in its environment so the
    test can find (and clean up) its processes. ``provisioner_keys`` are TOML lines of the
    provisioner's own entry (``idle_timeout = "3s"``)."""
    command = json.dumps([sys.executable, "-m", "hubd.cli", "sidecar", *sidecar_args])
    path.write_text(
        "\n"
        + daemon_sections(database_url=database_url, state_dir=state_dir, server_port=server_port)
        + f"""[[provisioners]]
id = "local"
plugin = "{plugin}"
{provisioner_keys}
[provisioners.options]
command = {command}
grace = 2
{plugin_options}
[provisioners.options.env]
HUBD_TEST_MARKER = "{marker}"
"""
        + LOG_SECTION
        + f"{extra}\n"
    )
    return path


def replicas(
    ports: list[int],
    *,
    database_url: str,
    state_dir: Path,
    marker: str,
    public_url: str | None = None,
    env: Mapping[str, str] | None = None,
) -> list[DaemonProcess]:
    """A ``hubd run`` replica listening on each of ``ports`` (not started), all on one
    database; sidecars are told ``public_url``, every replica's address by default."""
    urls = public_url or ",".join(f"ws://127.0.0.1:{port}" for port in ports)
    return [
        DaemonProcess(
            write_config(
                state_dir / f"hubd-{index}.toml",
                database_url=database_url,
                state_dir=state_dir,
                marker=marker,
                server_port=port,
            ),
            env={"HUBD_SERVER_PUBLIC_URL": urls, **(env or {})},
        )
        for index, port in enumerate(ports)
    ]


def new_marker() -> str:
    return f"hubd-test-{uuid.uuid4().hex[:12]}"


MARKER_VARIABLE = "HUBD_TEST_MARKER"


def _live_pids(matches: Callable[[Path], bool]) -> set[int]:
    """Live (not zombie) processes whose ``/proc`` entry ``matches``; one that vanishes or
    cannot be read while it is looked at does not."""
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if matches(entry) and ") Z " not in (entry / "stat").read_text():
                found.add(int(entry.name))
        except OSError:
            continue
    return found


def _kill(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def sidecar_pids(marker: str) -> set[int]:
    """Live processes whose environment carries ``marker``."""
    needle = f"{MARKER_VARIABLE}={marker}".encode()
    return _live_pids(lambda entry: needle in (entry / "environ").read_bytes().split(b"\0"))


def sidecar_generations(marker: str) -> list[tuple[str, str]]:
    """(allocation id, generation) of every live sidecar process carrying ``marker``."""
    result = []
    for pid in sidecar_pids(marker):
        try:
            pairs = dict(
                item.split(b"=", 1)
                for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if b"=" in item
            )
        except OSError:
            continue
        result.append(
            (
                pairs.get(b"HUBD_ALLOCATION_ID", b"").decode(),
                pairs.get(b"HUBD_GENERATION", b"").decode(),
            )
        )
    return result


def kill_sidecars(marker: str) -> None:
    _kill(sidecar_pids(marker))


def pids_writing_under(directory: Path) -> set[int]:
    """Live processes whose standard output is a file under ``directory``: the sidecars a
    ``local`` provisioner with that state dir started (each writes to its log there). ``hubd
    dev`` configures its own provisioner, and the provisioner passes a sidecar only PATH, HOME,
    LANG and TZ of its own environment, so a marker cannot reach them."""
    prefix = str(directory.resolve()) + os.sep
    return _live_pids(lambda entry: os.readlink(entry / "fd" / "1").startswith(prefix))


def kill_writing_under(directory: Path) -> None:
    _kill(pids_writing_under(directory))


class DaemonProcess:
    """``hubd run`` (or ``args``) in a child process; its log lines are collected as they
    arrive (JSON ones parsed)."""

    def __init__(
        self,
        config: Path | None,
        env: Mapping[str, str] | None = None,
        *,
        args: tuple[str, ...] | None = None,
    ) -> None:
        self.config = config
        self.args = args if args is not None else ("run", "--config", str(config))
        self.env = hubd_env(env)
        self.process: asyncio.subprocess.Process | None = None
        self.lines: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self._reader: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    async def start(self, *, ready_text: str | None = None) -> None:
        """Start, and wait for the ``hubd_running`` log line (or a line containing
        ``ready_text``)."""
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "hubd.cli",
            *self.args,
            env=self.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        self._reader = asyncio.create_task(self._read())
        if ready_text is None:
            await self.wait_for_log("hubd_running", within=60)
        else:
            await self.wait_for_text(ready_text, within=60)

    async def _read(self) -> None:
        assert self.process is not None
        assert self.process.stderr is not None
        async for raw in self.process.stderr:
            text = raw.decode(errors="replace").rstrip("\n")
            self.raw.append(text)
            with contextlib.suppress(ValueError):
                self.lines.append(json.loads(text))
            self._changed.set()
        self._changed.set()

    async def wait_for_log(self, event: str, *, within: float = 30) -> dict[str, Any]:
        async with asyncio.timeout(within):
            while True:
                for line in self.lines:
                    if line.get("event") == event:
                        return line
                if self.process is not None and self.process.returncode is not None:
                    raise AssertionError(
                        f"hubd exited {self.process.returncode} before {event!r}:\n"
                        + "\n".join(self.raw[-30:])
                    )
                self._changed.clear()
                await self._changed.wait()

    async def wait_for_text(self, text: str, *, within: float = 30) -> str:
        """The first output line containing ``text``."""
        async with asyncio.timeout(within):
            while True:
                for line in self.raw:
                    if text in line:
                        return line
                if self.process is not None and self.process.returncode is not None:
                    raise AssertionError(
                        f"hubd exited {self.process.returncode} before {text!r}:\n"
                        + "\n".join(self.raw[-30:])
                    )
                self._changed.clear()
                await self._changed.wait()

    @property
    def output(self) -> str:
        return "\n".join(self.raw)

    @property
    def admin_url(self) -> str:
        for line in self.lines:
            if line.get("event") == "hubd_running":
                return str(line["admin"])
        raise AssertionError("hubd has not said where its admin listener is")

    @property
    def http_url(self) -> str:
        """Where the HTTP API answers (``[http] listen`` set)."""
        for line in self.lines:
            if line.get("event") == "hubd_running" and line.get("http"):
                return f"http://{line['http']}"
        raise AssertionError("hubd has not said where its HTTP API is")

    @property
    def sidecar_url(self) -> str:
        for line in self.lines:
            if line.get("event") == "hubd_running":
                return str(line["sidecar_url"])
        raise AssertionError("hubd has not said where sidecars dial")

    async def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    async def wait(self, within: float = 30) -> int:
        assert self.process is not None
        async with asyncio.timeout(within):
            code = await self.process.wait()
        if self._reader is not None:
            await self._reader
        return code

    def assert_running(self) -> None:
        """Fail with the end of the log when the daemon has exited."""
        assert self.process is not None
        if self.process.returncode is not None:
            tail = "\n".join(self.raw[-15:])
            raise AssertionError(f"hubd exited {self.process.returncode}:\n{tail}")

    async def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
        if self._reader is not None:
            await self._reader


@contextlib.asynccontextmanager
async def running(
    config: Path, env: Mapping[str, str] | None = None
) -> AsyncIterator[DaemonProcess]:
    """``hubd run`` with ``config``, started; when the block ends, stopped with SIGTERM and
    waited for."""
    daemon = DaemonProcess(config, env)
    await daemon.start()
    try:
        yield daemon
    finally:
        await daemon.signal(signal.SIGTERM)
        await daemon.wait()
        await daemon.kill()


async def http_get(url: str) -> tuple[int, str]:
    """A minimal GET over loopback (the admin listener)."""
    rest = url.removeprefix("http://")
    hostport, _, path = rest.partition("/")
    host, _, port = hostport.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"GET /{path} HTTP/1.1\r\nHost: {hostport}\r\n\r\n".encode())
        await writer.drain()
        data = await reader.read()
    finally:
        writer.close()
    head, _, body = data.decode().partition("\r\n\r\n")
    return int(head.split(" ")[1]), body
