"""An HTTP event stream resumed on another replica after the first was killed (kill -9) in the
middle of it: with ``Last-Event-ID``, nothing is missed and nothing repeated. The requests name a
provisioner no daemon serves, so each allocation's events are its request and its failure
(``provisioner_unavailable``), committed while the streams read."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from hubd.store import AllocationStore, Database
from hubd.store.api_keys import ApiKeyStore
from tests.daemonkit import DaemonProcess, write_config
from tests.polling import eventually
from tests.ssekit import sse_events

pytestmark = pytest.mark.timeout(180)


async def read_until(
    session: aiohttp.ClientSession,
    url: str,
    seen: list[tuple[int, str, str]],
    *,
    stop: int,
    **headers: str,
) -> None:
    """Append each event of the stream at ``url`` to ``seen`` (id, allocation, event) until
    ``stop`` are there or the stream breaks (its replica died)."""
    try:
        async with session.get(url, headers=headers) as response:
            assert response.status == 200, await response.text()
            async for position, _, data in sse_events(response):
                seen.append((position, data["allocation_id"], data["event"]))
                if len(seen) >= stop:
                    return
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, ConnectionError):
        return


async def test_a_stream_resumes_on_another_replica_without_a_gap(
    database_url: str, store: AllocationStore, db: Database, marker: str, state_dir: Path
) -> None:
    key = (await ApiKeyStore(db).create(tenant="acme"))[1]
    env = {"HUBD_DATABASE_URL": database_url, "HUBD_HTTP_LISTEN": "127.0.0.1:0"}
    daemons = [
        DaemonProcess(
            write_config(
                state_dir / f"hubd-{index}.toml",
                database_url=database_url,
                state_dir=state_dir / f"state-{index}",
                marker=marker,
            ),
            env,
        )
        for index in range(2)
    ]
    for daemon in daemons:
        await daemon.start()
    try:
        start = await db.pool.fetchval("SELECT hubd_v1.event_cursor()")
        seen: list[tuple[int, str, str]] = []
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as session:
            first = asyncio.ensure_future(
                read_until(session, f"{daemons[0].http_url}/v1/events?after={start}", seen,
                           stop=10**6)
            )  # fmt: skip

            async def requests(n: int) -> None:
                for _ in range(n):
                    await store.request(provisioner_id="nobody", tenant_id="acme")

            await requests(20)
            await eventually(lambda: len(seen) >= 10, within=30, every=0.05)
            await daemons[0].kill()
            await asyncio.wait_for(first, 30)
            # Requests keep coming while no stream is open; the second replica's stream resumes
            # from the last id the first delivered.
            await requests(20)
            resumed = asyncio.ensure_future(
                read_until(session, f"{daemons[1].http_url}/v1/events", seen, stop=10**6,
                           **{"Last-Event-ID": str(seen[-1][0])})
            )  # fmt: skip
            await requests(20)

            async def all_ended() -> bool:
                left = await db.pool.fetchval(
                    "SELECT count(*) FROM hubd_allocations WHERE tenant_id = 'acme' "
                    "AND status NOT IN ('released', 'failed', 'destroy_failed')"
                )
                return bool(left == 0)

            await eventually(all_ended, within=60, every=0.1)
            feed = await db.pool.fetch(
                "SELECT position, allocation_id, event FROM hubd_v1.events "
                "WHERE position > $1 AND tenant = 'acme' ORDER BY position",
                start,
            )
            await eventually(lambda: len(seen) >= len(feed), within=30, every=0.05)
            resumed.cancel()
        assert seen == [(r["position"], r["allocation_id"], r["event"]) for r in feed]
        assert {event for _, _, event in seen} == {"requested", "failed"}
        assert len(seen) == 120
    finally:
        for daemon in daemons:
            await daemon.kill()
