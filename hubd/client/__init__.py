"""The application-facing Python client of hubd (docs/api.md).

Three lines get a ready sidecar's address::

    async with await Client.connect(dsn) as hubd:
        allocation = await hubd.request("local", session="s-1", spec={"model": "small"})
        ready = await hubd.wait_ready(allocation.id, timeout=60)
        print(ready.endpoint, ready.metadata)

It uses only the SQL API (``hubd_v1``), which a role holding ``hubd_app`` may call; it never
touches the daemon's tables or pools.
"""

from hubd.client.client import AllocationEnded, Client, ClientClosed
from hubd.client.values import AllocationInfo, Event

__all__ = ["AllocationEnded", "AllocationInfo", "Client", "ClientClosed", "Event"]
