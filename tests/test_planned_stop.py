"""A planned stop is not a failure: however long the daemon was stopped, a sidecar that waited
it out gets the restart window from the next start to come back, and keeps its allocation at
its generation (docs/operations.md, "What stop, restart and a crash do")."""

from __future__ import annotations

import signal
from pathlib import Path

import asyncpg
import pytest

from hubd.store import AllocationStore, Database, Status
from tests.daemonkit import DaemonProcess, free_port, sidecar_pids, write_config
from tests.polling import eventually
from tests.storekit import drive_to
from tests.test_daemon import all_ready, request_many

WINDOW = 60.0


async def _unconnected_past_deadline(db: Database, store: AllocationStore) -> str:
    """An allocated row nobody claims, no sidecar connected, its connect deadline a second past
    (what a clean stop leaves once the stop outlasted connect_timeout)."""
    fence = await drive_to(store, db, Status.ALLOCATED)
    await db.pool.execute(
        "UPDATE hubd_allocations SET lease_id = NULL, lease_expires_at = NULL, "
        "connect_deadline = now() - interval '1 second', "
        "next_attempt_at = now() + interval '1 hour' WHERE id = $1",
        fence.allocation_id,
    )
    return fence.allocation_id


async def _seconds_left(db: Database, allocation_id: str) -> float:
    left = await db.pool.fetchval(
        "SELECT extract(epoch FROM connect_deadline - now())::float8 FROM hubd_allocations "
        "WHERE id = $1",
        allocation_id,
    )
    return float(left)


class TestReconnectWindowAtStart:
    async def test_a_start_with_no_live_peer_gives_every_unconnected_sidecar_the_window(
        self, db: Database, store: AllocationStore
    ) -> None:
        lapsed = await _unconnected_past_deadline(db, store)
        later = await _unconnected_past_deadline(db, store)
        await db.pool.execute(
            "UPDATE hubd_allocations SET connect_deadline = now() + interval '1 hour' "
            "WHERE id = $1",
            later,
        )
        claimed = await _unconnected_past_deadline(db, store)
        await db.pool.execute(
            "UPDATE hubd_allocations SET lease_id = 'someone', "
            "lease_expires_at = now() + interval '1 minute' WHERE id = $1",
            claimed,
        )
        assert await store.open_reconnect_windows(instance_ttl=5, window=WINDOW) == 1
        assert WINDOW - 5 < await _seconds_left(db, lapsed) <= WINDOW
        # The claim that watched the old deadline watches the new one.
        assert await db.pool.fetchval(
            "SELECT next_attempt_at = connect_deadline FROM hubd_allocations WHERE id = $1",
            lapsed,
        )
        # A deadline already later is kept; a row a claim holds decides for itself.
        assert await _seconds_left(db, later) > 3000
        assert await _seconds_left(db, claimed) < 0

    async def test_a_peer_up_for_the_window_means_the_sidecars_had_a_hub_to_return_to(
        self, db: Database, store: AllocationStore
    ) -> None:
        lapsed = await _unconnected_past_deadline(db, store)
        # A peer that started with this one (replicas restarted together) was no hub to return
        # to either.
        await db.pool.execute(
            "INSERT INTO hubd_instances (id, hostname, pid, ws_url) "
            "VALUES ('peer', 'elsewhere', 1, 'ws://127.0.0.1:1')"
        )
        assert await store.open_reconnect_windows(instance_ttl=5, window=WINDOW) == 1
        await db.pool.execute(
            "UPDATE hubd_allocations SET connect_deadline = now() - interval '1 second' "
            "WHERE id = $1",
            lapsed,
        )
        # One that has been up for the window was.
        await db.pool.execute(
            "UPDATE hubd_instances SET started_at = now() - interval '2 minutes' WHERE id = 'peer'"
        )
        assert await store.open_reconnect_windows(instance_ttl=5, window=WINDOW) == 0
        assert await _seconds_left(db, lapsed) < 0
        # A peer whose heartbeat is older than the TTL is no hub to return to.
        await db.pool.execute(
            "UPDATE hubd_instances SET heartbeat_at = now() - interval '10 seconds' "
            "WHERE id = 'peer'"
        )
        assert await store.open_reconnect_windows(instance_ttl=5, window=WINDOW) == 1


class TestPlannedStop:
    @pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill"])
    async def test_a_stop_longer_than_connect_timeout_keeps_every_sidecar(
        self,
        database_url: str,
        observer: AllocationStore,
        marker: str,
        state_dir: Path,
        stop: signal.Signals,
    ) -> None:
        """Two ready allocations; a clean stop (SIGTERM), or a crash (SIGKILL), that lasts past
        connect_timeout (3 s) by the database's clock; the next start takes the same sidecar
        processes back at the same generation, and no allocation was replaced. The sidecars
        meanwhile back off to dials seconds apart, longer than connect_timeout: the restart
        window, not connect_timeout, is what they get."""
        config = write_config(
            state_dir / "hubd.toml",
            database_url=database_url,
            state_dir=state_dir,
            marker=marker,
            server_port=free_port(),  # the sidecars dial the same address after the stop
        )
        env = {"HUBD_RECONCILER_CONNECT_TIMEOUT": "3s"}
        first = DaemonProcess(config, env)
        await first.start()
        try:
            ids = await request_many(2, {"HUBD_DATABASE_URL": database_url})
            await eventually(lambda: all_ready(observer, ids), within=90, every=0.2)
            before = {i: (await observer.get(i)).generation for i in ids}
            pids = sidecar_pids(marker)
            assert len(pids) == 2
            await first.signal(stop)
            assert await first.wait() == (0 if stop is signal.SIGTERM else -signal.SIGKILL)
        finally:
            await first.kill()

        async def every_deadline_passed() -> bool:
            if stop is signal.SIGKILL:
                # A crash writes no deadline: the stop has outlasted connect_timeout once the
                # dead daemon's last heartbeat is older than that and its instance TTL.
                passed = await admin.fetchval(
                    "SELECT bool_and(heartbeat_at < now() - interval '10 seconds') "
                    "FROM hubd_instances"
                )
                return passed is True
            passed = await admin.fetchval(
                "SELECT bool_and(connect_deadline < now()) FROM hubd_allocations "
                "WHERE id = ANY($1::text[])",
                ids,
            )
            return passed is True

        admin = await asyncpg.connect(database_url)
        try:
            await eventually(
                every_deadline_passed, within=30, every=0.2, what="the deadlines to pass"
            )
            second = DaemonProcess(config, env)
            await second.start()
            try:
                await eventually(lambda: all_ready(observer, ids), within=90, every=0.2)
                after = {i: (await observer.get(i)) for i in ids}
            finally:
                await second.signal(signal.SIGTERM)
                await second.wait()
                await second.kill()
            failures = await admin.fetch(
                "SELECT allocation_id, kind, message FROM hubd_allocation_ledger "
                "WHERE allocation_id = ANY($1::text[]) AND message LIKE '%connect%deadline%'",
                ids,
            )
        finally:
            await admin.close()
        assert {i: a.generation for i, a in after.items()} == before
        assert all(a.status is Status.ALLOCATED for a in after.values())
        assert sidecar_pids(marker) == pids
        assert failures == []
