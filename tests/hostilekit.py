"""Attacks on a real ``hubd run`` and what they cost it: shared by tests/hostile/ (CI size) and
bench/hostile.py (full size).

Attackers dial from 127.0.0.2 and up (loopback answers on all of 127/8), as distinct hosts
would; the legitimate sidecars dial from 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import re
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, Final

import attrs

from hubd.store import connect_database
from tests.clikit import run_hubd_async
from tests.daemonkit import MARKER_VARIABLE, DaemonProcess, http_get, write_config
from tests.polling import eventually
from tests.wskit import CONNECT_PATH, SUBPROTOCOL, masked_frame

__all__ = [
    "ATTACKS",
    "HOLDER_ATTACKS",
    "MUTE",
    "STOLEN_ATTACKS",
    "UNAUTHORIZED",
    "Attacker",
    "Measured",
    "hostile_config",
    "ledger_rows",
    "measure",
    "open_fds",
    "rss_mib",
    "sidecar_environment",
    "unconnected_sidecar",
]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def sidecar_environment(marker: str, allocation_id: str) -> dict[str, str]:
    """The environment the local provisioner gave ``allocation_id``'s sidecar process: what any
    process of the same uid reads from its /proc/<pid>/environ."""
    needle = f"{MARKER_VARIABLE}={marker}".encode()
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
    raise AssertionError("no sidecar process of that allocation")


MUTE: Final = "mute"
"""A provisioner whose sidecar command only sleeps: its allocations wait for a sidecar that
never dials by itself, so whoever holds the environment it was given connects first and is,
for the hub, the allocation's genuine sidecar."""


UNAUTHORIZED: Final = "401 unauthorized"
"""The one answer to every authentication failure."""


def hostile_config(path: Path, *, state_dir: Path, marker: str) -> Path:
    """The test daemon's config (:func:`tests.daemonkit.write_config`) with the production
    instance TTL, plus the :data:`MUTE` provisioner."""
    mute = f"""
[[provisioners]]
id = "{MUTE}"
plugin = "local"
[provisioners.options]
command = ["sleep", "3600"]
grace = 2
[provisioners.options.env]
{MARKER_VARIABLE} = "{marker}"
"""
    config = write_config(path, state_dir=state_dir, marker=marker, extra=mute)
    # The production instance TTL: readiness reports a heartbeat older than the TTL, and the
    # test config's 5 s is shorter than the event-loop stalls a loaded 2-core machine shows
    # while one process floods the daemon.
    config.write_text(config.read_text().replace('ttl = "5s"', 'ttl = "20s"'))
    return config


async def ready_after_request(dsn: str, allocation_ids: list[str]) -> list[float]:
    """For each allocation, seconds from its request to its first ``mark_ready`` ledger row,
    by the database's clock."""
    db = await connect_database(dsn)
    try:
        async with db.pool.acquire() as conn:
            rows = await conn.fetch(
                "SELECT extract(epoch FROM min(l.at) - a.created_at) AS seconds"
                " FROM hubd_allocations a JOIN hubd_allocation_ledger l ON l.allocation_id = a.id"
                " WHERE a.id = ANY($1) AND l.kind = 'mark_ready' GROUP BY a.id",
                allocation_ids,
            )
    finally:
        await db.close()
    return [float(row["seconds"]) for row in rows]


async def ledger_rows(dsn: str, allocation_id: str) -> int:
    """The allocation's ledger rows (it only ever grows)."""
    db = await connect_database(dsn)
    try:
        async with db.pool.acquire() as conn:
            count = await conn.fetchval(
                "SELECT count(*) FROM hubd_allocation_ledger WHERE allocation_id = $1",
                allocation_id,
            )
    finally:
        await db.close()
    return int(count)


async def unconnected_sidecar(env: dict[str, str], marker: str) -> tuple[str, dict[str, str]]:
    """A new allocation of the :data:`MUTE` provisioner, and the environment its sidecar was
    given: the attacker that reads it connects first, as the real sidecar would have."""
    outcome = await run_hubd_async("alloc", "request", "--provisioner", MUTE, env=env)
    assert outcome.code == 0, outcome.err
    allocation_id = outcome.out.strip()
    found: dict[str, dict[str, str]] = {}

    def started() -> bool:
        with contextlib.suppress(AssertionError):
            found["env"] = sidecar_environment(marker, allocation_id)
        return "env" in found

    await eventually(started, within=60, every=0.1, what="mute sidecar started")
    return allocation_id, found["env"]


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


async def header_flood(port: int, size: int, seconds: float, attacker: Attacker) -> int:
    """``size`` connections, each sending ~1 MiB of headers slowly and never finishing."""
    del attacker
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


async def half_open(port: int, size: int, seconds: float, attacker: Attacker) -> int:
    """``size`` connections that never send a byte."""
    del attacker

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


def _spread_source(index: int) -> str:
    """An address of a /24 of its own: a flood no range's share contains."""
    return f"127.{1 + index // 250}.{2 + index % 250}.1"


async def half_open_reconnecting(port: int, size: int, seconds: float, attacker: Attacker) -> int:
    """``size`` connections from 200 addresses (each of a /24 of its own), each sending the
    request line and headers but never the blank line that ends them, and opened again the
    moment the hub closes it (a refusal, an eviction), for ``seconds`` or until
    ``attacker.enough`` is set. Returns the connections opened."""
    partial = _request(port, {"Hubd-Allocation-Id": "al_" + "0" * 32})
    deadline = time.monotonic() + seconds
    opened = 0

    async def one(index: int) -> None:
        nonlocal opened
        while time.monotonic() < deadline and not attacker.enough.is_set():
            try:
                reader, writer = await _connect(port, _spread_source(index % 200))
            except OSError:
                # Out of ports or descriptors for a moment: the flood goes on.
                await asyncio.sleep(0.01)
                continue
            opened += 1
            try:
                writer.write(partial)
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    while await reader.read(4096):
                        pass
            except (OSError, TimeoutError):
                pass
            finally:
                writer.close()

    await asyncio.gather(*(one(i) for i in range(size)))
    return opened


async def bad_tokens(port: int, size: int, seconds: float, attacker: Attacker) -> int:
    """Well-formed handshakes with wrong tokens, ``size`` at a time, for ``seconds``."""
    identity = attacker.identity
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


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One frame from the hub (servers do not mask): opcode and payload."""
    head = await reader.readexactly(2)
    length = head[1] & 0x7F
    if length == 126:
        length = int.from_bytes(await reader.readexactly(2), "big")
    elif length == 127:
        length = int.from_bytes(await reader.readexactly(8), "big")
    return head[0] & 0x0F, await reader.readexactly(length)


async def _open_as_sidecar(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    port: int,
    identity: dict[str, str],
    secret: str | None,
    outcomes: collections.Counter[str],
) -> str | None:
    """The protocol v2 handshake as the reference sidecar does it: the welcome read and
    acknowledged at once. Returns the welcome's reconnect secret, or ``None`` when refused
    (``outcomes`` counts the status) or closed before the welcome."""
    headers = {
        "Authorization": f"Bearer {identity['HUBD_TOKEN']}",
        "Hubd-Allocation-Id": identity["HUBD_ALLOCATION_ID"],
        "Hubd-Sidecar-Id": identity["HUBD_SIDECAR_ID"],
        "Hubd-Generation": identity["HUBD_GENERATION"],
    }
    if secret is not None:
        headers["Hubd-Reconnect-Secret"] = secret
    writer.write(_request(port, headers) + b"\r\n")
    async with asyncio.timeout(10):
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 101:
            length = re.search(rb"(?i)\r\ncontent-length: *([0-9]+)", head)
            reason = await reader.readexactly(int(length.group(1))) if length else b""
            outcomes[f"{status} {reason.decode(errors='replace').strip()}"] += 1
            if status in (429, 503) and not re.search(rb"(?i)\r\nretry-after: *[0-9]+", head):
                outcomes[f"{status} without Retry-After"] += 1
            return None
        opcode, payload = await _read_frame(reader)
    if opcode != 0x1:
        outcomes["closed before welcome"] += 1
        return None
    welcome = json.loads(payload)
    writer.write(masked_frame(0x1, b'{"type": "welcome_ack"}'))
    await writer.drain()
    outcomes["welcome"] += 1
    return str(welcome["reconnect_secret"])


async def ping_flood(port: int, size: int, seconds: float, attacker: Attacker) -> int:
    """One sidecar socket pinging as fast as it can after its welcome, never reading again,
    until the hub drops it or ``seconds`` pass.

    As the allocation's first connector (``attacker.holder``) it is the genuine sidecar and
    the hub must drop it for what it does; with a token copied from a sidecar that already
    connected it gets the one 401 and nothing else."""
    del size
    outcomes = attacker.outcomes
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.bind(("127.0.0.9", 0))
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    # A small stream buffer: past 2 KiB unread the transport stops reading the socket, so what
    # the hub writes after the welcome piles up on its side, as with a peer that never reads.
    reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
    sent = 0
    try:
        if await _open_as_sidecar(reader, writer, port, attacker.identity, None, outcomes) is None:
            return sent
        burst = masked_frame(0x9, b"p" * 125) * 256
        started = time.monotonic()
        deadline = started + seconds
        while time.monotonic() < deadline:
            if writer.transport.is_closing():
                raise ConnectionResetError("closed by the hub")
            writer.write(burst)
            sent += 256
            async with asyncio.timeout(max(0.01, deadline - time.monotonic())):
                await writer.drain()
        outcomes["never dropped"] += 1
    except (OSError, asyncio.IncompleteReadError):
        if outcomes["welcome"]:
            outcomes["dropped"] += 1
            attacker.dropped_after = time.monotonic() - started
    except TimeoutError:
        outcomes["never dropped"] += 1
    finally:
        writer.close()
    return sent


def _told_to_stop(outcomes: collections.Counter[str]) -> bool:
    """Whether the hub answered with a status after which the protocol says a sidecar stops
    (400, 401, 403, 409): an attacker holding the genuine identity gains nothing by going on,
    and only loses it."""
    return any(key[:3] in ("400", "401", "403", "409") for key in outcomes)


async def reconnect_loop(port: int, size: int, seconds: float, attacker: Attacker) -> int:
    """A sidecar reconnecting in a loop as fast as the hub answers, each time with the
    reconnect secret of its latest welcome (acknowledged at once), ignoring ``Retry-After``.

    After one accepted reconnect it takes over its own live socket (the hub closes the old one
    with 4000), after the next it closes the live socket first, so the hub also sees it lost
    and reconnected.
    As the first connector each accepted reconnect is legitimate and only the per-allocation
    bucket bounds them; with a copied token the first try gets 401. It stops where the protocol
    says a sidecar stops."""
    del size
    outcomes = attacker.outcomes
    deadline = time.monotonic() + seconds
    secret: str | None = None
    live: asyncio.StreamWriter | None = None
    tries = 0
    close_first = False
    try:
        while time.monotonic() < deadline and not _told_to_stop(outcomes):
            tries += 1
            if live is not None and close_first:
                live.close()
                live = None
            try:
                reader, writer = await _connect(port, "127.0.0.10")
                fresh = None
                try:
                    fresh = await _open_as_sidecar(
                        reader, writer, port, attacker.identity, secret, outcomes
                    )
                finally:
                    if fresh is None:
                        writer.close()
                if fresh is not None:
                    secret = fresh
                    close_first = not close_first
                    if live is not None:
                        live.close()
                    live = writer
            except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
                outcomes[f"error {type(exc).__name__}"] += 1
    finally:
        if live is not None:
            live.close()
    return tries


Attack = Callable[[int, int, float, "Attacker"], Coroutine[Any, Any, int]]
ATTACKS: dict[str, Attack] = {
    "header-flood": header_flood,
    "half-open": half_open,
    "half-open-reconnecting": half_open_reconnecting,
    "bad-tokens": bad_tokens,
    "ping-flood": ping_flood,
    "reconnect-loop": reconnect_loop,
    "ping-flood-stolen": ping_flood,
    "reconnect-loop-stolen": reconnect_loop,
}
HOLDER_ATTACKS = frozenset({"ping-flood", "reconnect-loop"})
"""Attacks made as the allocation's genuine sidecar: the attacker is its first connector."""
STOLEN_ATTACKS = frozenset({"ping-flood-stolen", "reconnect-loop-stolen"})
"""The same with a token copied from a sidecar that had already connected."""


@attrs.define
class Attacker:
    """Whose identity an attack uses, and what the hub answered it."""

    identity: dict[str, str] = attrs.field(repr=False)
    outcomes: collections.Counter[str] = attrs.field(factory=collections.Counter)
    dropped_after: float | None = None
    enough: asyncio.Event = attrs.field(factory=asyncio.Event, repr=False)
    """Set to end an attack that stops when asked (the reconnecting flood) before its time."""


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
    readyz_separate: dict[str, Any] = attrs.field(factory=dict)
    """/readyz as a process of its own saw it during the attack (the benchmark's prober)."""
    legit: list[float] = attrs.field(factory=list)
    """Seconds each legitimate ``alloc request --wait`` took, the CLI's own start included."""
    legit_ready: list[float] = attrs.field(factory=list)
    """Seconds from each legitimate request's commit to its allocation's first ready, by the
    database's clock: the hub's part of ``legit``."""
    legit_failures: int = 0
    legit_while_attacked: bool = False
    """Whether every legitimate request was done before the attack was."""
    log_lines: int = 0
    outcomes: dict[str, int] = attrs.field(factory=dict)
    dropped_after: float | None = None
    ledger_growth: int | None = None
    """Ledger rows the attacker's own allocation gained (holder attacks)."""


Prober = Callable[[str], contextlib.AbstractAsyncContextManager[dict[str, Any]]]
"""Given the /readyz URL, probes it for as long as the context lasts; the dict it yields is
filled in when the context ends."""


async def measure(
    daemon: DaemonProcess,
    name: str,
    *,
    size: int,
    seconds: float,
    env: dict[str, str],
    attacker: Attacker,
    legit_requests: int = 1,
    separate_prober: Prober | None = None,
    dsn: str | None = None,
    until_legit_done: bool = False,
) -> Measured:
    """Run one attack against ``daemon`` while probing /readyz and making legitimate
    ``alloc request --wait`` calls; settle, then measure again. With the daemon's ``dsn``, also
    how long each legitimate allocation took to be ready after its request. With
    ``until_legit_done``, an attack that can be stopped runs (for ``seconds`` at most) until
    the legitimate requests are done."""
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

    requested: list[str] = []

    async def legit() -> None:
        for _ in range(legit_requests):
            started = time.monotonic()
            outcome = await run_hubd_async(
                "alloc", "request", "--provisioner", "local", "--wait", "--timeout", "60s", env=env
            )
            if outcome.code == 0:
                result.legit.append(time.monotonic() - started)
                requested.append(outcome.out.strip())
            else:
                result.legit_failures += 1

    separate = separate_prober or (lambda url: contextlib.nullcontext({}))
    async with separate(daemon.admin_url + "/readyz") as seen:
        prober = asyncio.create_task(probe())
        started = time.monotonic()
        attack = asyncio.create_task(ATTACKS[name](port, size, seconds, attacker))
        # Started with the attack: the CLI's own start-up takes longer than the attack's.
        await legit()
        result.legit_while_attacked = not attack.done()
        if until_legit_done:
            attacker.enough.set()
        result.offered = await attack
        result.seconds = time.monotonic() - started
        done.set()
        await prober
    result.readyz_separate = seen
    if dsn is not None and requested:
        result.legit_ready = await ready_after_request(dsn, requested)
    result.outcomes = dict(attacker.outcomes)
    result.dropped_after = attacker.dropped_after
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
