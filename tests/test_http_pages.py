"""The event streams' shared pages (hubd/http/pages.py), on a real PostgreSQL: the streams of
one tenant share one walled read of the feed per move, each gets exactly what its own read
would give, and nothing read for one tenant reaches another's streams."""

from __future__ import annotations

import asyncio
from typing import Any

from hubd.client import Client, Event
from hubd.http.pages import TenantPages
from hubd.store import AllocationStore, Database


class CountingClient(Client):
    """The real client, counting its reads of the feed."""

    reads = 0

    async def events_page(self, **kwargs: Any) -> list[Event]:
        CountingClient.reads += 1
        return await super().events_page(**kwargs)


async def test_one_read_serves_every_stream_of_a_tenant(
    database_url: str, db: Database, store: AllocationStore
) -> None:
    client = await Client.connect(database_url)
    try:
        acme = CountingClient(client._pool, wall="acme")
        direct = client.for_tenant("acme")
        pages = TenantPages(keep=50)
        start = int(await db.pool.fetchval("SELECT hubd_v1.event_cursor()"))
        with pages.streaming("acme", start), pages.streaming("globex", start):
            for index in range(6):
                await store.request(provisioner_id="p", tenant_id="acme", session_id=f"s{index}")
                await store.request(provisioner_id="p", tenant_id="globex")
            heard = int(await db.pool.fetchval("SELECT hubd_v1.event_cursor()"))
            CountingClient.reads = 0
            got = await asyncio.gather(
                *(
                    pages.after(acme, "acme", start, heard=heard, allocation_id=None, limit=500)
                    for _ in range(20)
                )
            )
            assert CountingClient.reads == 1
            expected = await direct.events_page(after=start, limit=500)
            assert len(expected) == 6
            assert all(page == expected for page in got)
            assert {event.tenant for page in got for event in page} == {"acme"}
            # A cursor inside what is kept, a filter, a limit: no read.
            one = expected[2]
            assert await pages.after(
                acme, "acme", start, heard=heard, allocation_id=one.allocation_id, limit=500
            ) == [one]
            assert await pages.after(
                acme, "acme", expected[3].position, heard=heard, allocation_id=None, limit=1
            ) == [expected[4]]
            assert CountingClient.reads == 1
            # Another tenant's pages are its own read, walled into it.
            globex = CountingClient(client._pool, wall="globex")
            theirs = await pages.after(
                globex, "globex", start, heard=heard, allocation_id=None, limit=500
            )
            assert {event.tenant for event in theirs} == {"globex"}
            assert CountingClient.reads == 2
            # Past what is kept (50 events), a cursor falls back to a read of its own.
            for _ in range(60):
                await store.request(provisioner_id="p", tenant_id="acme")
            heard = int(await db.pool.fetchval("SELECT hubd_v1.event_cursor()"))
            newest = await pages.after(acme, "acme", heard - 1, heard=heard, allocation_id=None,
                                       limit=500)  # fmt: skip
            assert [event.position for event in newest] == [heard]
            old = await pages.after(acme, "acme", start, heard=heard, allocation_id=None,
                                    limit=500)  # fmt: skip
            assert old == (await direct.events_page(after=start, limit=500))
    finally:
        await client.close()
