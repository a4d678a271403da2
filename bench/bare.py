"""A bare ``websockets`` server, the baseline for memory per idle socket and handshake rate.

    python -m bench.bare        (prints its port, then serves until killed)

Configured as hubd configures its sidecar listener (no compression, 64 KiB messages, a queue of
4, pings every 20 s): it sends one short welcome and then only holds the socket, so what it
costs per connection is the library's own.
"""

from __future__ import annotations

import asyncio
import json
import resource

from websockets.asyncio.server import ServerConnection, serve


async def _hold(ws: ServerConnection) -> None:
    await ws.send(json.dumps({"type": "welcome"}))
    await ws.wait_closed()


async def main() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    async with serve(
        _hold,
        "127.0.0.1",
        0,
        compression=None,
        max_size=64 * 1024,
        max_queue=4,
        ping_interval=20,
        ping_timeout=20,
        backlog=1024,
    ) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        print(port, flush=True)
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
