"""A real ``hubd run`` on a primary with a streaming standby (docs/operations.md): the primary
crashes and the standby is promoted, then the old primary comes back as a read-only standby
listed first and every session is reset. Each step is judged on committed rows, the ledger and
the live sidecar processes; the poll interval is 30 s, so anything prompt came from NOTIFY."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import asyncpg
import attrs
import pytest

from tests.daemonkit import INSTANCE_TTL, DaemonProcess, http_get, sidecar_pids, write_config
from tests.failoverkit import DATABASE, create_database, end_sessions, replay_check
from tests.faultkit import ABANDONING, stop_all
from tests.pgcluster import Cluster, cluster
from tests.proxykit import blackhole
from tests.readyzkit import READY, dropped_partition, sampling
from tests.reconcilerkit import poll_until
from tests.test_daemon import request_many

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

PROMPT = 15.0
"""Half the poll interval: an allocation ready within it was woken by a notification."""
HEALED = 25.0
"""After a partition: the heartbeat's recovery comes first (a beat in flight on a dead
connection runs out its budget), still inside the 30 s poll."""
READY_AFTER_HEAL = 15.0
"""The most a probe may see ``/readyz`` not ready after a partition heals (issue #55)."""


@pytest.fixture
def ha() -> Iterator[Cluster]:
    try:
        with cluster() as running:
            yield running
    except RuntimeError as exc:
        if "binaries" in str(exc):
            pytest.skip(str(exc))
        raise


@pytest.fixture
async def url(ha: Cluster) -> str:
    """The database on the cluster, migrated; a URL naming both hosts and no
    ``target_session_attrs`` (hubd asks for a writable one by itself)."""
    await create_database(ha)
    return ha.url(DATABASE)


async def _writable(url: str) -> asyncpg.Connection:
    return await asyncpg.connect(url, target_session_attrs="read-write", timeout=10)


async def _rows(url: str, ids: list[str]) -> dict[str, tuple[str, int, bool]]:
    conn = await _writable(url)
    try:
        rows = await conn.fetch(
            "SELECT id, status, generation, connection_ready FROM hubd_allocations "
            "WHERE id = ANY($1::text[])",
            ids,
        )
    finally:
        await conn.close()
    return {r["id"]: (r["status"], r["generation"], r["connection_ready"]) for r in rows}


async def _all_ready(url: str, ids: list[str]) -> bool:
    try:
        rows = await _rows(url, ids)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
        return False  # mid-promotion: no writable host for a moment
    return len(rows) == len(ids) and all(
        status == "allocated" and ready for status, _, ready in rows.values()
    )


async def _abandoning(url: str, ids: list[str]) -> list[str]:
    conn = await _writable(url)
    try:
        rows = await conn.fetch(
            "SELECT allocation_id, kind FROM hubd_allocation_ledger "
            "WHERE allocation_id = ANY($1::text[]) AND kind = ANY($2::text[])",
            ids,
            list(ABANDONING),
        )
    finally:
        await conn.close()
    return [f"{r['allocation_id']} {r['kind']}" for r in rows]


def _count(daemon: DaemonProcess, event: str, since: int) -> int:
    return sum(1 for line in daemon.lines[since:] if line.get("event") == event)


@attrs.frozen(kw_only=True)
class _Watched:
    """A running ``hubd run`` polling every 30 s, and the allocations it made ready before the
    fault: their rows (checked through ``direct``, never a proxy) and sidecar processes."""

    daemon: DaemonProcess
    env: dict[str, str]
    direct: str
    marker: str
    healthy: list[str]
    rows: dict[str, tuple[str, int, bool]]
    pids: set[int]

    async def assert_kept(self, *later: str) -> None:
        """Nothing healthy was given up: the same rows, generations and processes, and no
        abandoning write for them or for the ``later`` allocations."""
        assert await _rows(self.direct, self.healthy) == self.rows
        assert sidecar_pids(self.marker) >= self.pids
        assert await _abandoning(self.direct, [*self.healthy, *later]) == []


@asynccontextmanager
async def _watched(url: str, direct: str, marker: str, state_dir: Path) -> AsyncIterator[_Watched]:
    """``hubd run`` on ``url`` with four allocations ready, stopped when the block ends."""
    config = write_config(
        state_dir / "hubd.toml", database_url=url, state_dir=state_dir, marker=marker
    )
    daemon = DaemonProcess(config, env={"HUBD_RECONCILER_POLL_INTERVAL": "30s"})
    env = {"HUBD_DATABASE_URL": direct}
    await daemon.start()
    try:
        healthy = await request_many(4, env)
        await poll_until(lambda: _all_ready(direct, healthy), within=60, every=0.2)
        yield _Watched(
            daemon=daemon,
            env=env,
            direct=direct,
            marker=marker,
            healthy=healthy,
            rows=await _rows(direct, healthy),
            pids=sidecar_pids(marker),
        )
    finally:
        await stop_all(daemon)


async def test_hubd_follows_a_promotion_and_skips_the_old_primary_rejoined_as_standby(
    ha: Cluster, url: str, marker: str, state_dir: Path
) -> None:
    async with _watched(url, url, marker, state_dir) as watched:
        daemon, env = watched.daemon, watched.env
        async with replay_check(ha) as caught_up:
            await poll_until(caught_up, within=30, every=0.05)

        # The primary crashes; the standby is promoted.
        await asyncio.to_thread(ha.crash_primary_and_promote)
        promoted = len(daemon.lines)
        first = await request_many(1, env)
        await poll_until(lambda: _all_ready(url, first), within=PROMPT, every=0.1)
        await poll_until(lambda: _all_ready(url, watched.healthy), within=PROMPT, every=0.1)

        # The old primary returns as a standby, still listed first, and every session on the
        # new primary is reset: hubd must not settle on the read-only one.
        await asyncio.to_thread(ha.follow, ha.standby)
        await end_sessions(ha.maintenance(ha.primary))
        rejoined = len(daemon.lines)
        second = await request_many(1, env)
        await poll_until(lambda: _all_ready(url, second), within=PROMPT, every=0.1)

        async def ready() -> bool:
            return (await http_get(daemon.admin_url + "/readyz")) == (200, "ready\n")

        await poll_until(ready, within=PROMPT, every=0.1)

        await watched.assert_kept(*first, *second)
        # No loop: the failures are the few statements that met the fault, not a stream.
        for since in (promoted, rejoined):
            assert _count(daemon, "claim_failed_in_store", since) <= 5
            assert _count(daemon, "heartbeat_failed", since) <= 5
    # Read after the stop: what a pool left behind (an unretrieved exception) is reported
    # when the loop closes.
    assert not any("Traceback" in line for line in daemon.raw)


@pytest.mark.parametrize("mode", ["hold", "drop"])
async def test_hubd_comes_back_promptly_after_a_partition(
    mode: str, database_url: str, marker: str, state_dir: Path
) -> None:
    """The network between hubd and PostgreSQL goes silent for longer than the instance TTL:
    ``hold`` delivers what it held at the heal (TCP outlived the partition), ``drop`` leaves
    every connection open at its start dead for good (a vanished peer, a NAT that lost its
    state). Either way the healthy allocations are kept, and a request made at the heal is
    ready well inside the 30 s poll: its notification reached a live LISTEN connection and
    its sidecar's handshake found a live pooled connection."""
    async with (
        blackhole(database_url) as proxy,
        _watched(proxy.url(database_url), database_url, marker, state_dir) as watched,
    ):
        daemon = watched.daemon
        started = len(daemon.lines)
        proxy.hold() if mode == "hold" else proxy.drop()

        async def lapsed() -> bool:
            return _count(daemon, "heartbeat_failed", started) >= 2

        async def judged_dead() -> bool:
            # Read past the proxy: the instance's last beat, by the database's clock.
            conn = await asyncpg.connect(database_url)
            try:
                return bool(
                    await conn.fetchval(
                        "SELECT bool_and(now() - heartbeat_at > make_interval(secs => $1)) "
                        "FROM hubd_instances",
                        INSTANCE_TTL,
                    )
                )
            finally:
                await conn.close()

        # The partition lasts until the daemon has seen it twice and the database holds its
        # last beat older than its TTL, so its peers (none here) could have judged it dead.
        await poll_until(lapsed, within=30, every=0.1)
        await poll_until(judged_dead, within=30, every=0.1)
        proxy.heal()
        healed = len(daemon.lines)
        fresh = await request_many(1, watched.env)
        # Well under the 30 s poll, with room for a loaded 2-core machine.
        await poll_until(lambda: _all_ready(database_url, fresh), within=HEALED, every=0.1)
        await poll_until(
            lambda: _all_ready(database_url, watched.healthy), within=HEALED, every=0.1
        )
        await watched.assert_kept(*fresh)
        assert _count(daemon, "claim_failed_in_store", healed) <= 5
    assert not any("Traceback" in line for line in daemon.raw)
    assert not any("never retrieved" in line for line in daemon.raw)


async def test_readyz_is_back_soon_after_each_partition_that_dropped_every_connection(
    database_url: str, marker: str, state_dir: Path
) -> None:
    """``/readyz``, sampled every 100 ms from before the fault, says the database is
    unreachable during a partition that leaves every connection dead for good, is back to 200
    within READY_AFTER_HEAL of the heal and stays so, after each of two partitions in a row.
    The beat interval is the shipped 5 s, which bounds that time (a beat in flight on a dead
    connection runs out its budget, the next follows within a second and recycles the LISTEN
    connection); the TTL is 10 s instead of 20 s, to keep the partitions short. The full-size
    run: ``python -m bench.readyz_heal`` (five 45 s partitions, shipped settings)."""
    async with blackhole(database_url) as proxy:
        config = write_config(
            state_dir / "hubd.toml",
            database_url=proxy.url(database_url),
            state_dir=state_dir,
            marker=marker,
        )
        daemon = DaemonProcess(
            config,
            env={"HUBD_INSTANCE_HEARTBEAT_INTERVAL": "5s", "HUBD_INSTANCE_TTL": "10s"},
        )
        await daemon.start()
        try:
            async with sampling(daemon.admin_url + "/readyz") as sampler:
                started = time.monotonic()
                assert await sampler.until(READY, since=started, within=30) is not None
                # Healed as soon as it is noticed, then a while after: the heal falls at
                # another moment of the beats' cycle.
                runs = [
                    await dropped_partition(proxy, sampler, outage=outage, bound=60)
                    for outage in (0.0, 13.0)
                ]
        finally:
            await stop_all(daemon)
    print("heal -> /readyz 200:", [run.ready for run in runs])
    assert all(
        run.ready is not None and run.ready < READY_AFTER_HEAL and not run.flapped for run in runs
    ), runs
    assert not any("Traceback" in line for line in daemon.raw)
