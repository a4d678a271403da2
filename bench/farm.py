"""The sidecar farm: one process holding one real websocket per allocation.

    python -m bench.farm SOCKET_PATH [--loop uvloop|asyncio]

It listens on a Unix socket for JSON lines. The bench's provisioner plugin (``bench.plugin``)
writes ``{"op": "open", ...}`` with each sidecar's credentials and expects no answer; the bench
sends control requests and reads one JSON line back for each (see ``Farm.control``).

Every sidecar speaks the reference protocol (architecture §4): the four headers, subprotocol
``hubd.sidecar.v1``, no compression, the welcome checked against its identity; then it only
holds the socket (websockets answers the hub's pings). Refusals with ``Retry-After`` (503, 429)
are retried after it, as a real sidecar would; 4000/4001/4002 and 401/409 end the sidecar.

Connections are spread over source addresses 127.0.0.2-127.0.0.250 (all loopback on Linux) so
that the listener's per-source caps see many hosts, as they would in production, and at most
``--concurrency`` handshakes are in flight at once. The ``sources`` request changes the addresses
(one address: what the local provisioner, host networking or a NAT give every sidecar).

The farm runs on uvloop unless ``--loop asyncio`` says otherwise. It stands in for sidecars on
other machines, yet shares the measured cores with the daemon and PostgreSQL: on the standard
loop its websockets clients took as much CPU per allocation as the daemon (docs/performance.md),
charged to hubd's rates and to no baseline's. The bare server's storms use the same farm, so
both sides of that ratio pay the same client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.typing import Subprotocol

from hubd.daemon.loops import EVENT_LOOPS, loop_factory, loop_name
from hubd.sidecar.client import SUBPROTOCOL as _SUBPROTOCOL
from hubd.sidecar.settings import connect_urls

SUBPROTOCOL = Subprotocol(_SUBPROTOCOL)
_STOP_CODES = frozenset({4000, 4001, 4002})
_STOP_STATUSES = frozenset({400, 401, 403, 409})
SOURCES = [f"127.0.0.{n}" for n in range(2, 251)]


class Sidecar:
    """One allocation's sidecar as the farm holds it."""

    def __init__(self, creds: dict[str, Any]) -> None:
        self.creds = creds
        # Worked out once, as a sidecar does from its environment, not on every dial.
        self.url = connect_urls(str(creds["url"]))[0]
        self.ws: ClientConnection | None = None
        self.task: asyncio.Task[None] | None = None
        self.stopped = False


class Farm:
    def __init__(self, concurrency: int) -> None:
        self.sidecars: dict[str, Sidecar] = {}
        self.bare: list[ClientConnection] = []
        self.hold = False
        self.handshakes = asyncio.Semaphore(concurrency)
        self.welcomes: list[tuple[str, float]] = []
        self.dialed: dict[str, float] = {}
        """When the latest handshake of each allocation started (host wall clock)."""
        self.refusals: dict[str, int] = {}
        self.sources = itertools.cycle(SOURCES)
        self.tasks: set[asyncio.Task[Any]] = set()
        self.awaited: tuple[int, asyncio.Future[None]] | None = None
        """While a storm runs: the count of welcomes it waits for, and its future."""

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def refused(self, reason: str) -> None:
        self.refusals[reason] = self.refusals.get(reason, 0) + 1

    # -- hubd sidecars ----------------------------------------------------------------------

    def open(self, creds: dict[str, Any]) -> None:
        allocation = str(creds["allocation_id"])
        known = self.sidecars.get(allocation)
        if known is not None and known.creds["sidecar_id"] == creds["sidecar_id"]:
            return  # ensure is idempotent per sidecar id
        if known is not None:
            self.retire(known)
        sidecar = Sidecar(creds)
        self.sidecars[allocation] = sidecar
        if not self.hold:
            sidecar.task = self.spawn(self.run_sidecar(sidecar))

    def retire(self, sidecar: Sidecar) -> None:
        sidecar.stopped = True
        if sidecar.task is not None:
            sidecar.task.cancel()
        if sidecar.ws is not None:
            sidecar.ws.transport.abort()

    async def run_sidecar(self, sidecar: Sidecar) -> None:
        """Connect until welcomed, then hold the socket until it closes; returns after a close
        the hub meant for good, or when the farm dropped it."""
        creds = sidecar.creds
        failures = 0
        while not sidecar.stopped:
            welcomes = len(self.welcomes)
            try:
                delay: float | None = await self.session(sidecar, creds)
            except Exception as exc:  # noqa: BLE001 -- a sidecar retries whatever went wrong
                # websockets' client can fail an internal assertion when a server refuses the
                # socket before reading its request, on uvloop; a sidecar dials again.
                self.refused(type(exc).__name__)
                delay = 0.2
            # A hub that is gone for good (the bench stopped it) is not dialed forever.
            failures = 0 if len(self.welcomes) > welcomes else failures + 1
            if delay is None or failures > 50:
                return
            await asyncio.sleep(delay)

    async def session(self, sidecar: Sidecar, creds: dict[str, Any]) -> float | None:
        """One connection; the delay before the next one, or ``None`` to stop."""
        try:
            async with self.handshakes:
                self.dialed[str(creds["allocation_id"])] = time.time()
                ws = await connect(
                    sidecar.url,
                    additional_headers={
                        "Authorization": f"Bearer {creds['token']}",
                        "Hubd-Allocation-Id": str(creds["allocation_id"]),
                        "Hubd-Sidecar-Id": str(creds["sidecar_id"]),
                        "Hubd-Generation": str(creds["generation"]),
                    },
                    subprotocols=[SUBPROTOCOL],
                    compression=None,
                    proxy=None,
                    open_timeout=30,
                    ping_interval=None,
                    max_size=64 * 1024,
                    local_addr=(next(self.sources), 0),
                )
                welcome = json.loads(await ws.recv())
                welcomed_at = time.time()
            if welcome.get("allocation_id") != creds["allocation_id"]:
                self.refused("welcome_mismatch")
                await ws.close()
                return None
            sidecar.ws = ws
            self.welcomes.append((str(creds["allocation_id"]), welcomed_at))
            self.count_welcome()
            await ws.wait_closed()
            code = ws.close_code
        except InvalidStatus as exc:
            status = exc.response.status_code
            self.refused(str(status))
            if status in _STOP_STATUSES:
                return None
            retry = exc.response.headers.get("Retry-After", "1")
            return min(float(retry) if retry.isdigit() else 1.0, 5.0)
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else None
        except (InvalidHandshake, OSError, TimeoutError) as exc:
            self.refused(type(exc).__name__)
            return 0.2
        finally:
            sidecar.ws = None
        if sidecar.stopped or code in _STOP_CODES:
            return None
        return 0.2

    def count_welcome(self) -> None:
        awaited = self.awaited
        if awaited is not None and len(self.welcomes) >= awaited[0] and not awaited[1].done():
            awaited[1].set_result(None)

    def connected(self) -> int:
        return sum(1 for s in self.sidecars.values() if s.ws is not None)

    # -- control ----------------------------------------------------------------------------

    async def control(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        if op == "hold":
            self.hold = bool(request["value"])
            return {}
        if op == "sources":
            # The addresses sidecars dial from from now on; none: the spread default.
            self.sources = itertools.cycle(request.get("value") or SOURCES)
            return {}
        if op == "connect_held":
            for sidecar in self.sidecars.values():
                if sidecar.task is None and not sidecar.stopped:
                    sidecar.task = self.spawn(self.run_sidecar(sidecar))
            return {}
        if op == "status":
            return {
                "sidecars": len(self.sidecars),
                "connected": self.connected(),
                "bare": len(self.bare),
                "welcomes": len(self.welcomes),
                "refusals": self.refusals,
                "loop": loop_name(asyncio.get_running_loop()),
            }
        if op == "dialed":
            return {"at": self.dialed.get(str(request["allocation_id"]))}
        if op == "welcomes_since":
            start = int(request["index"])
            return {"welcomes": self.welcomes[start:], "next": len(self.welcomes)}
        if op == "drop":
            return {"dropped": self.drop(request["kind"])}
        if op == "reconnect":
            return await self.reconnect(request["kind"], request.get("url", ""), request["n"])
        if op == "forget":
            for sidecar in self.sidecars.values():
                self.retire(sidecar)
            self.sidecars.clear()
            self.drop("bare")
            return {}
        raise ValueError(f"unknown op {op!r}")

    def drop(self, kind: str) -> int:
        """Abort every socket of ``kind`` at once, as a network blip would."""
        if kind == "bare":
            dropped = len(self.bare)
            for ws in self.bare:
                ws.transport.abort()
            self.bare.clear()
            return dropped
        dropped = 0
        for sidecar in self.sidecars.values():
            if sidecar.task is not None:
                sidecar.stopped = True
                sidecar.task.cancel()
                sidecar.task = None
            if sidecar.ws is not None:
                sidecar.ws.transport.abort()
                dropped += 1
        return dropped

    async def reconnect(self, kind: str, url: str, n: int) -> dict[str, Any]:
        """Open ``n`` sockets of ``kind`` (every dropped hubd sidecar, or ``n`` bare ones),
        ``--concurrency`` handshakes at a time; returns when all are welcomed."""
        before = len(self.welcomes)
        refusals = sum(self.refusals.values())
        started = time.monotonic()
        if kind == "bare":
            await asyncio.gather(*(self.open_bare(url) for _ in range(n)))
            opened = n
        else:
            pending = [s for s in self.sidecars.values() if s.ws is None]
            for sidecar in pending:
                sidecar.stopped = False
                sidecar.task = self.spawn(self.run_sidecar(sidecar))
            # Woken once, by the last welcome, not by each of them.
            everyone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.awaited = (before + len(pending), everyone)
            self.count_welcome()
            try:
                await everyone
            finally:
                self.awaited = None
            opened = len(pending)
        return {
            "count": opened,
            "seconds": time.monotonic() - started,
            "refusals": sum(self.refusals.values()) - refusals,
        }

    async def open_bare(self, url: str) -> None:
        while True:
            try:
                async with self.handshakes:
                    ws = await connect(
                        url,
                        compression=None,
                        proxy=None,
                        open_timeout=30,
                        ping_interval=None,
                        max_size=64 * 1024,
                        local_addr=(next(self.sources), 0),
                    )
                    await ws.recv()
                self.bare.append(ws)
                self.welcomes.append(("bare", time.time()))
                return
            except (InvalidHandshake, OSError, TimeoutError) as exc:
                self.refused(type(exc).__name__)
                await asyncio.sleep(0.2)


async def serve(path: Path, concurrency: int) -> None:
    farm = Farm(concurrency)

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            async for line in reader:
                request = json.loads(line)
                if request["op"] == "open":
                    farm.open(request)
                    continue
                try:
                    answer = await farm.control(request)
                except Exception as exc:  # noqa: BLE001 -- reported to the caller, not fatal
                    answer = {"error": repr(exc)}
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(client, path=str(path), limit=1 << 20)
    print("farm ready", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("socket", type=Path)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--loop", choices=EVENT_LOOPS, default="uvloop")
    args = parser.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with (
        contextlib.suppress(KeyboardInterrupt),
        asyncio.Runner(loop_factory=loop_factory(args.loop)) as runner,
    ):
        runner.run(serve(args.socket, args.concurrency))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(args.socket)


if __name__ == "__main__":
    main()
