"""Request a sidecar, wait until it is ready, read where it serves, and release it.

    HUBD_DATABASE_URL="$(hubd db-url)" python python.py [provisioner]

The role needs only hubd_app (docs/api.md). ``wait_ready`` waits on the hubd_events channel.
"""

from __future__ import annotations

import asyncio
import os
import sys

from hubd.client import Client


async def main(provisioner: str) -> None:
    async with await Client.connect(os.environ["HUBD_DATABASE_URL"]) as hubd:
        allocation = await hubd.request(provisioner, session="python-example", spec={"n": 1})
        print(f"requested {allocation.id}")
        ready = await hubd.wait_ready(allocation.id, timeout=60)
        print(f"ready {ready.id} endpoint={ready.endpoint} metadata={dict(ready.metadata or {})}")
        released = await hubd.release(ready.id, reason="python example done")
        print(f"released {released.id} {released.status}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "local"))
