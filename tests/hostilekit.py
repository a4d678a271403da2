"""Attacks on a real ``hubd run`` and what they cost it: shared by tests/hostile/ (CI size) and
bench/hostile.py (full size).

Attackers dial from 127.0.0.2 and up (loopback answers on all of 127/8), as distinct hosts
would; the legitimate sidecars dial from 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs

from tests.clikit import run_hubd_async
from tests.daemonkit import DaemonProcess, http_get
from tests.polling import eventually
from tests.wskit import CONNECT_PATH, SUBPROTOCOL, masked_frame

__all__ = ["ATTACKS", "Measured", "measure", "open_fds", "rss_mib", "stolen_identity"]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def stolen_identity(marker: str, allocation_id: str) -> dict[str, str]:
    """What any process of the same uid reads from a local sidecar's /proc/<pid>/environ."""
    needle = f"HUBD_TEST_MARKER={marker}".encode()
    wanted = f"HUBD_ALLOCATION_ID={allocation_id}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            items = (entry / "environ").read_bytes().split(b"\0")
            if needle in items and wanted in items:
                pairs = dict(item.decode().split("=", 1) for item in items if b"=" in item)
                if "HUBD_TOKEN" in pairs:
                    return pairs
    raise AssertionError("no sidecar to steal from")


async def _connect(port: int, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await asyncio.open_connection(sock=sock)


def _source(index: int) -> str:
    return f"127.0.{2 + index // 250}.{1 + index % 250}"


def _request(port: int, headers: dict[str, str], *extra: str) -> bytes:
    lines = [
        f"GET {CONNECT_PATH} HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version: 13",
        f"Sec-WebSocket-Protocol: {SUBPROTOCOL}",
        *(f"{k}: {v}" for k, v in headers.items()),
        *extra,
    ]
    return ("\r\n".join(lines) + "\r\n").encode()


async def _quietly(coro: Awaitable[Any]) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError, TimeoutError):
        await coro


async def header_flood(port: int, size: int, seconds: float, identity: dict[str, str]) -> int:
    """``size`` connections, each sending ~1 MiB of headers slowly and never finishing."""
    del identity
    pad = ("X-Pad: " + "a" * 8000 + "\r\n").encode()
    offered = 0

    async def one(index: int) -> None:
        nonlocal offered
        reader, writer = await _connect(port, _source(index % 64))
        try:
            writer.write(_request(port, {}))
            deadline = time.monotonic() + seconds
            for _ in range(128):
                if time.monotonic() > deadline:
                    break
                writer.write(pad)
                offered += len(pad)
                await writer.drain()
                await asyncio.sleep(0.01)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await reader.read()
        finally:
            writer.close()

    await asyncio.gather(*(_quietly(one(i)) for i in range(size)))
    return offered


async def half_open(port: int, size: int, seconds: float, identity: dict[str, str]) -> int:
    """``size`` connections that never send a byte."""
    del identity

    async def one(index: int) -> None:
        reader, writer = await _connect(port, _source(index % 200))
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await reader.read()
        finally:
            writer.close()

    await asyncio.gather(*(_quietly(one(i)) for i in range(size)))
    return size


async def bad_tokens(port: int, size: int, seconds: float, identity: dict[str, str]) -> int:
    """Well-formed handshakes with wrong tokens, ``size`` at a time, for ``seconds``."""
    headers = {
        "Authorization": "Bearer hubd_sc_" + "0" * 64,
        "Hubd-Allocation-Id": identity["HUBD_ALLOCATION_ID"],
        "Hubd-Sidecar-Id": identity["HUBD_SIDECAR_ID"],
        "Hubd-Generation": identity["HUBD_GENERATION"],
    }
    request = _request(port, headers) + b"\r\n"
    deadline = time.monotonic() + seconds
    sent = 0

    async def worker(index: int) -> None:
        nonlocal sent
        while time.monotonic() < deadline:
            reader, writer = await _connect(port, _source(index % 50))
            try:
                writer.write(request)
                sent += 1
                async with asyncio.timeout(5):
                    await reader.read()
            finally:
                writer.close()

    async def forever(index: int) -> None:
        while time.monotonic() < deadline:
            await _quietly(worker(index))

    await asyncio.gather(*(forever(i) for i in range(size)))
    return sent


async def ping_flood(port: int, size: int, seconds: float, identity: dict[str, str]) -> int:
    """One socket authenticated with a stolen token, pinging as fast as it can, never reading.

    It supersedes the real sidecar (4000) as the protocol allows; the point is what the hub
    holds for it, and that the hub drops it."""
    del size
    headers = {
        "Authorization": f"Bearer {identity['HUBD_TOKEN']}",
        "Hubd-Allocation-Id": identity["HUBD_ALLOCATION_ID"],
        "Hubd-Sidecar-Id": identity["HUBD_SIDECAR_ID"],
        "Hubd-Generation": identity["HUBD_GENERATION"],
    }
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.bind(("127.0.0.9", 0))
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    sent = 0
    try:
        writer.write(_request(port, headers) + b"\r\n")
        async with asyncio.timeout(10):
            await reader.readuntil(b"\r\n\r\n")
        burst = masked_frame(0x9, b"p" * 125) * 256
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            writer.write(burst)
            sent += 256
            async with asyncio.timeout(max(0.01, deadline - time.monotonic())):
                await writer.drain()
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()
    return sent


async def reconnect_loop(port: int, size: int, seconds: float, identity: dict[str, str]) -> int:
    """A token holder reconnecting in a loop."""
    del size
    headers = {
        "Authorization": f"Bearer {identity['HUBD_TOKEN']}",
        "Hubd-Allocation-Id": identity["HUBD_ALLOCATION_ID"],
        "Hubd-Sidecar-Id": identity["HUBD_SIDECAR_ID"],
        "Hubd-Generation": identity["HUBD_GENERATION"],
    }
    request = _request(port, headers) + b"\r\n"
    deadline = time.monotonic() + seconds
    tries = 0
    while time.monotonic() < deadline:
        tries += 1
        with contextlib.suppress(OSError, TimeoutError, asyncio.IncompleteReadError):
            reader, writer = await _connect(port, "127.0.0.10")
            try:
                writer.write(request)
                async with asyncio.timeout(5):
                    await reader.readuntil(b"\r\n\r\n")
            finally:
                writer.close()
    return tries


Attack = Callable[[int, int, float, dict[str, str]], Awaitable[int]]
ATTACKS: dict[str, Attack] = {
    "header-flood": header_flood,
    "half-open": half_open,
    "bad-tokens": bad_tokens,
    "ping-flood": ping_flood,
    "reconnect-loop": reconnect_loop,
}


@attrs.define
class Measured:
    attack: str
    offered: int = 0
    seconds: float = 0.0
    rss_before: float = 0.0
    rss_peak: float = 0.0
    rss_after: float = 0.0
    fds_before: int = 0
    fds_after: int = 0
    readyz_worst: float = 0.0
    readyz_failures: int = 0
    readyz_problems: list[str] = attrs.field(factory=list)
    legit: list[float] = attrs.field(factory=list)
    legit_failures: int = 0
    log_lines: int = 0


async def measure(
    daemon: DaemonProcess,
    name: str,
    *,
    size: int,
    seconds: float,
    env: dict[str, str],
    identity: dict[str, str],
    legit_requests: int = 1,
) -> Measured:
    """Run one attack against ``daemon`` while probing /readyz and making legitimate
    ``alloc request --wait`` calls; settle, then measure again."""
    assert daemon.process is not None
    pid = daemon.process.pid
    port = int(daemon.sidecar_url.rsplit(":", 1)[1])
    result = Measured(attack=name, rss_before=rss_mib(pid), fds_before=open_fds(pid))
    lines_before = len(daemon.raw)
    done = asyncio.Event()

    async def probe() -> None:
        while not done.is_set():
            result.rss_peak = max(result.rss_peak, rss_mib(pid))
            started = time.monotonic()
            try:
                # A deadline for "answers at all", scaled for a loaded machine where this
                # process is also the attacker; how fast it answers is the benchmark's to say.
                async with asyncio.timeout(10):
                    status, body = await http_get(daemon.admin_url + "/readyz")
                if status != 200:
                    result.readyz_failures += 1
                    result.readyz_problems.append(f"{status} {body.strip()}")
            except (OSError, TimeoutError) as exc:
                result.readyz_failures += 1
                result.readyz_problems.append(f"{type(exc).__name__}: {exc}")
            result.readyz_worst = max(result.readyz_worst, time.monotonic() - started)
            await asyncio.sleep(0.05)

    async def legit() -> None:
        for _ in range(legit_requests):
            started = time.monotonic()
            outcome = await run_hubd_async(
                "alloc", "request", "--provisioner", "local", "--wait", "--timeout", "60s", env=env
            )
            if outcome.code == 0:
                result.legit.append(time.monotonic() - started)
            else:
                result.legit_failures += 1

    prober = asyncio.create_task(probe())
    started = time.monotonic()
    attack = asyncio.create_task(ATTACKS[name](port, size, seconds, identity))
    # Started with the attack: the CLI's own start-up takes longer than the attack's.
    await legit()
    result.offered = await attack
    result.seconds = time.monotonic() - started
    done.set()
    await prober
    # Settled: the descriptors the attack made the daemon hold are given back.
    with contextlib.suppress(AssertionError):
        await eventually(
            lambda: open_fds(pid) <= result.fds_before + 8, within=30, every=0.2, what="fds"
        )
    result.fds_after = open_fds(pid)
    result.rss_after = rss_mib(pid)
    result.log_lines = len(daemon.raw) - lines_before
    return result


def json_line(result: Measured) -> str:
    return json.dumps(attrs.asdict(result))
