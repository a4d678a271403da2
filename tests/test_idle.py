"""Idle timeouts and the provisioning deadline, decided in the statement that acts: the idle clock
starts at readiness, the sidecar's ``activity`` (architecture §4) and the application's touch
and extend restart it, the sweep ends an idle allocation once with its reason; an allocation
claimed but not ready in time is given up. Real PostgreSQL, real sockets."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from hubd.errors import InvalidRequest
from hubd.reconciler.writes import MarkAllocated
from hubd.store import AllocationStore, Database, LedgerStore, Status, connect_database
from hubd.store.allocations import ProvisionerLimits
from tests.clikit import run_hubd_async
from tests.daemonkit import running, sidecar_pids, write_config
from tests.polling import eventually
from tests.storekit import drive_to
from tests.wskit import Hub, close_code_of, dial, running_hub, sidecar_in, welcome_of

MINUTE = 60.0


@pytest.fixture
async def hub(db: Database) -> AsyncIterator[Hub]:
    async with running_hub(db, ready_on_connect=True) as running:
        yield running


async def clocks(db: Database, allocation_id: str) -> dict[str, Any]:
    """The row's clocks, as seconds from now (``None``: not running)."""
    row = await db.pool.fetchrow(
        "SELECT idle_at, expiring, status, "
        "extract(epoch FROM idle_at - now())::float8 AS idle_in, "
        "extract(epoch FROM now() - starting_since)::float8 AS starting_for "
        "FROM hubd_allocations WHERE id = $1",
        allocation_id,
    )
    assert row is not None
    return dict(row)


async def make_ready(db: Database, allocation_id: str) -> None:
    """What a connection (or a declaration) does to the row: it reads ready."""
    await db.pool.execute(
        "UPDATE hubd_allocations SET connection_ready = true WHERE id = $1", allocation_id
    )


async def age_idle(db: Database, allocation_id: str, idle_in: float) -> None:
    """Move the row's idle deadline to ``idle_in`` seconds from now."""
    await db.pool.execute(
        "UPDATE hubd_allocations SET idle_at = now() + make_interval(secs => $2) WHERE id = $1",
        allocation_id,
        idle_in,
    )


async def events_of(db: Database, allocation_id: str) -> list[str]:
    rows = await db.pool.fetch(
        "SELECT event FROM hubd_v1.events WHERE allocation_id = $1 ORDER BY position",
        allocation_id,
    )
    return [row["event"] for row in rows]


async def say(ws: Any, kind: str) -> dict[str, Any]:
    await ws.send(json.dumps({"type": kind}))
    answer: dict[str, Any] = json.loads(await ws.recv())
    return answer


class TestIdleTimeout:
    async def test_a_request_asks_within_its_provisioner(self, store: AllocationStore) -> None:
        await store.set_limits({"p": ProvisionerLimits(idle_timeout=10 * MINUTE)})
        short = await store.request(provisioner_id="p", idle_timeout=MINUTE)
        assert short.idle_timeout == MINUTE
        default = await store.request(provisioner_id="p")
        assert default.idle_timeout == 10 * MINUTE
        with pytest.raises(InvalidRequest) as refused:
            await store.request(provisioner_id="p", idle_timeout=20 * MINUTE)
        assert "longer than provisioner 'p''s idle_timeout of 600" in str(refused.value)
        with pytest.raises(InvalidRequest, match="positive duration"):
            await store.request(provisioner_id="p", idle_timeout=-1)
        assert (await store.request(provisioner_id="other")).idle_timeout is None

    async def test_the_clock_starts_at_readiness_and_the_end_says_idle(
        self, db: Database, store: AllocationStore, ledger: LedgerStore
    ) -> None:
        """No idle clock runs before the allocation is ready; readiness starts it; past it
        the sweep releases the allocation under a new generation with end_reason 'idle', and
        a second sweep (another replica) moves nothing."""
        await store.set_limits({"p": ProvisionerLimits(idle_timeout=MINUTE)})
        fence = await drive_to(store, db, Status.ALLOCATED, provisioner_id="p")
        allocation_id = fence.allocation_id
        assert (await clocks(db, allocation_id))["idle_at"] is None
        await make_ready(db, allocation_id)
        assert MINUTE - 10 < (await clocks(db, allocation_id))["idle_in"] <= MINUTE
        await age_idle(db, allocation_id, -1)
        swept = await store.sweep_deadlines(warning=1, pending_timeout=None)
        assert (swept.idle, swept.expired) == (1, 0)
        again = await store.sweep_deadlines(warning=1, pending_timeout=None)
        assert (again.idle, again.expired, again.warned) == (0, 0, 0)
        ended = await store.get(allocation_id)
        assert (ended.status, ended.end_reason) == (Status.RELEASING, "idle")
        assert ended.generation == fence.generation + 1
        history = await ledger.history(allocation_id)
        expire = [e for e in history if e.kind == "expire"]
        assert len(expire) == 1
        assert expire[0].message is not None
        assert "idle since" in expire[0].message
        view = await db.pool.fetchrow(
            "SELECT end_reason, idle_timeout FROM hubd_v1.allocations WHERE id = $1",
            allocation_id,
        )
        assert view is not None
        assert view["end_reason"] == "idle"
        assert view["idle_timeout"].total_seconds() == MINUTE

    async def test_touch_and_extend_restart_the_clock_and_withdraw_the_warning(
        self, db: Database, store: AllocationStore
    ) -> None:
        """The warning comes ``warning`` seconds before the idle end; the application's touch
        restarts the clock and withdraws it (an 'extended' event); an extension does too."""
        await store.set_limits({"p": ProvisionerLimits(idle_timeout=MINUTE, max_lifetime=3600)})
        fence = await drive_to(store, db, Status.ALLOCATED, provisioner_id="p")
        allocation_id = fence.allocation_id
        await make_ready(db, allocation_id)
        await age_idle(db, allocation_id, 5)
        swept = await store.sweep_deadlines(warning=10, pending_timeout=None)
        assert swept.warned == 1
        # Read after its warning was given: the next run knows the idle end is next.
        again = await store.sweep_deadlines(warning=10, pending_timeout=None)
        assert again.warned == 0
        assert again.next_in is not None
        assert 0 < again.next_in <= 5
        assert (await clocks(db, allocation_id))["expiring"]
        touched = await store.touch(allocation_id)
        assert not touched.expiring
        assert MINUTE - 10 < (await clocks(db, allocation_id))["idle_in"] <= MINUTE
        await age_idle(db, allocation_id, 5)
        await store.extend(allocation_id, 1800)
        assert MINUTE - 10 < (await clocks(db, allocation_id))["idle_in"] <= MINUTE
        assert (await events_of(db, allocation_id))[-4:] == [
            "ready",
            "expiring",
            "extended",
            "extended",
        ]

    async def test_a_lifetime_warning_outlives_a_touch(
        self, db: Database, store: AllocationStore
    ) -> None:
        """A warning given for the lifetime, the nearer end, stays when the idle clock
        restarts: only an extension withdraws it."""
        await store.set_limits({"p": ProvisionerLimits(idle_timeout=MINUTE, max_lifetime=3600)})
        allocation = await store.request(provisioner_id="p", lifetime=30)
        swept = await store.sweep_deadlines(warning=60, pending_timeout=None)
        assert swept.warned == 1
        touched = await store.touch(allocation.id)
        assert touched.expiring


class TestActivity:
    async def test_activity_restarts_the_clock(
        self, db: Database, store: AllocationStore, hub: Hub
    ) -> None:
        """A sidecar's ``activity`` is answered ``counted`` and moves the idle deadline its
        timeout from now; said again within the second it writes nothing more."""
        sidecar, _ = await sidecar_in(store, db)
        await db.pool.execute(
            "UPDATE hubd_allocations SET idle_timeout = $2 WHERE id = $1",
            sidecar.allocation_id,
            MINUTE,
        )
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcome_of(ws)
            await ws.send(json.dumps({"type": "welcome_ack"}))
            await make_ready(db, sidecar.allocation_id)
            await age_idle(db, sidecar.allocation_id, 5)
            assert await say(ws, "activity") == {"type": "activity_recorded", "counted": True}
            first = await clocks(db, sidecar.allocation_id)
            assert MINUTE - 10 < first["idle_in"] <= MINUTE
            assert await say(ws, "activity") == {"type": "activity_recorded", "counted": True}
            assert (await clocks(db, sidecar.allocation_id))["idle_at"] == first["idle_at"]
        assert hub.server.stats.activity == 2

    async def test_without_an_idle_timeout_nothing_is_counted(
        self, db: Database, hub: Hub, store: AllocationStore
    ) -> None:
        sidecar, _ = await sidecar_in(store, db)
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcome_of(ws)
            await ws.send(json.dumps({"type": "welcome_ack"}))
            assert await say(ws, "activity") == {"type": "activity_recorded", "counted": False}
        assert (await clocks(db, sidecar.allocation_id))["idle_at"] is None

    async def test_before_ack_refused(self, db: Database, hub: Hub, store: AllocationStore) -> None:
        sidecar, _ = await sidecar_in(store, db)
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcome_of(ws)
            await ws.send(json.dumps({"type": "activity"}))
            assert await close_code_of(ws) == 4003
            assert ws.close_reason == "activity before welcome_ack"


class TestCommandLine:
    async def test_request_touch_and_show(
        self, database_url: str, db: Database, store: AllocationStore
    ) -> None:
        """``hubd alloc request --idle-timeout`` asks for one, ``alloc show`` shows the clock,
        ``alloc touch`` restarts it; one longer than the provisioner's is an error."""
        await store.set_limits({"p": ProvisionerLimits(idle_timeout=10 * MINUTE)})
        env = {"HUBD_DATABASE_URL": database_url}
        made = await run_hubd_async(
            "alloc", "request", "--provisioner", "p", "--idle-timeout", "90s", env=env
        )  # fmt: skip
        assert made.code == 0, made.err
        allocation_id = made.out.strip()
        refused = await run_hubd_async(
            "alloc", "request", "--provisioner", "p", "--idle-timeout", "1h", env=env
        )  # fmt: skip
        assert refused.code == 2  # refused as invalid input, as an overlong lifetime is
        assert "longer than provisioner 'p''s idle_timeout of 600" in refused.err
        await db.pool.execute(
            "UPDATE hubd_allocations SET status = 'allocated', sidecar_id = 'sc_t', "
            "token_hash = sha256('t'), connection_ready = true WHERE id = $1",
            allocation_id,
        )
        await age_idle(db, allocation_id, 5)
        touched = await run_hubd_async("alloc", "touch", allocation_id, env=env)
        assert touched.code == 0, touched.err
        assert touched.out.startswith(f"{allocation_id} allocated idle at ")
        shown = await run_hubd_async("alloc", "show", allocation_id, "--json", env=env)
        assert shown.code == 0, shown.err
        data = json.loads(shown.out)
        assert data["idle_timeout"] == 90.0
        assert data["idle_at"] is not None
        assert 80 < (await clocks(db, allocation_id))["idle_in"] <= 90


class TestProvisioningTimeout:
    async def test_the_clock_runs_from_the_claim_to_ready(
        self, db: Database, store: AllocationStore
    ) -> None:
        fence = await drive_to(store, db, Status.ALLOCATED, provisioner_id="p")
        pending = await store.request(provisioner_id="p")
        assert (await clocks(db, pending.id))["starting_for"] is None
        started = await clocks(db, fence.allocation_id)
        assert started["starting_for"] is not None
        assert 0 <= started["starting_for"] < 60
        await make_ready(db, fence.allocation_id)
        assert (await clocks(db, fence.allocation_id))["starting_for"] is None

    async def test_an_allocation_not_ready_in_time_is_given_up(
        self, db: Database, store: AllocationStore, ledger: LedgerStore
    ) -> None:
        """Past its provisioner's provisioning_timeout, an allocation claimed but not ready
        begins a release that ends failed (give_up), failure code and end reason
        'provisioning_timeout'; one within it, and a ready one, are left; a second sweep
        moves nothing."""
        await store.set_limits({"p": ProvisionerLimits(provisioning_timeout=MINUTE)})
        slow = await drive_to(store, db, Status.PROVISIONING, provisioner_id="p")
        fresh = await drive_to(store, db, Status.ALLOCATED, provisioner_id="p")
        ready = await drive_to(store, db, Status.ALLOCATED, provisioner_id="p")
        await make_ready(db, ready.allocation_id)
        await db.pool.execute(
            "UPDATE hubd_allocations SET starting_since = now() - interval '61 seconds' "
            "WHERE id = $1",
            slow.allocation_id,
        )
        swept = await store.sweep_deadlines(warning=1, pending_timeout=None)
        assert swept.provisioning_timeout == 1
        assert (
            await store.sweep_deadlines(warning=1, pending_timeout=None)
        ).provisioning_timeout == 0
        given_up = await store.get(slow.allocation_id)
        assert given_up.status is Status.RELEASING
        assert given_up.give_up
        assert given_up.generation == slow.generation + 1
        assert (given_up.failure_code, given_up.end_reason) == (
            "provisioning_timeout",
            "provisioning_timeout",
        )
        assert given_up.failure_message is not None
        assert "not ready within 61 s" in given_up.failure_message
        assert "give_up" in [e.kind for e in await ledger.history(slow.allocation_id)]
        assert (await store.get(fresh.allocation_id)).status is Status.ALLOCATED
        assert (await store.get(ready.allocation_id)).ready


# A command for ``hubd sidecar``: reports activity on its publish descriptor every 0.2 s for as
# long as the file named by its first argument exists, then idles.
ACTIVE_WHILE_FILE = """
import os, sys, time
fd = int(os.environ["HUBD_PUBLISH_FD"])
while True:
    if os.path.exists(sys.argv[1]):
        os.write(fd, b'{"type": "activity"}\\n')
    time.sleep(0.2)
"""


class TestThroughDaemon:
    async def test_activity_keeps_it_and_idleness_ends_it(
        self, database_url: str, observer: AllocationStore, marker: str, state_dir: Path
    ) -> None:
        """Under ``hubd run``, a local sidecar whose command reports activity outlives its
        3 s idle timeout several times over (its idle deadline keeps moving); once the
        command stops reporting, the allocation is announced expiring and released 'idle',
        and its processes are stopped."""
        active = state_dir / "active"
        active.touch()
        config = write_config(
            state_dir / "hubd.toml",
            database_url=database_url,
            state_dir=state_dir,
            marker=marker,
            provisioner_keys='idle_timeout = "3s"',
            sidecar_args=("--", sys.executable, "-c", ACTIVE_WHILE_FILE, str(active)),
        )
        env = {"HUBD_DATABASE_URL": database_url, "HUBD_RECONCILER_EXPIRY_WARNING": "1s"}
        async with running(config, env=env):
            made = await run_hubd_async(
                "alloc", "request", "--provisioner", "local", "--wait", "--timeout", "60s",
                env={"HUBD_DATABASE_URL": database_url},
            )  # fmt: skip
            assert made.code == 0, made.err
            allocation_id = made.out.strip()
            first = (await observer.get(allocation_id)).idle_at
            assert first is not None

            async def moved_past_three_timeouts() -> bool:
                row = await observer.get(allocation_id)
                assert row.ready, row
                return row.idle_at is not None and (row.idle_at - first).total_seconds() > 9

            await eventually(moved_past_three_timeouts, within=60, every=0.3)
            active.unlink()

            async def idle() -> bool:
                return (await observer.get(allocation_id)).status is Status.RELEASED

            await eventually(idle, within=60, every=0.2)
            assert (await observer.get(allocation_id)).end_reason == "idle"
            await eventually(lambda: _no_sidecars(marker), within=30, every=0.2)
        async with asyncpg.create_pool(database_url, min_size=1, max_size=1) as pool:
            events = [
                r["event"]
                for r in await pool.fetch(
                    "SELECT event FROM hubd_v1.events WHERE allocation_id = $1 ORDER BY position",
                    allocation_id,
                )
            ]
        assert "expiring" in events
        assert events[-2:] == ["releasing", "released"]

    async def test_a_sidecar_that_never_comes_is_given_up(
        self, database_url: str, observer: AllocationStore, marker: str, state_dir: Path
    ) -> None:
        """Under ``hubd run``, a sidecar that never dials back (its connect deadline 30 s
        away) is given up at its provisioner's 3 s provisioning_timeout: its process is
        stopped and the allocation ends failed, 'provisioning_timeout'."""
        config = write_config(
            state_dir / "hubd.toml",
            database_url=database_url,
            state_dir=state_dir,
            marker=marker,
            provisioner_keys='provisioning_timeout = "3s"',
        )
        env = {"HUBD_DATABASE_URL": database_url}
        # Sidecars are told a URL no hub serves: each keeps dialling and never connects.
        daemon_env = {**env, "HUBD_SERVER_PUBLIC_URL": "ws://127.0.0.1:9"}
        async with running(config, env=daemon_env):
            made = await run_hubd_async(
                "alloc", "request", "--provisioner", "local", env=env
            )  # fmt: skip
            assert made.code == 0, made.err
            allocation_id = made.out.strip()

            async def failed() -> bool:
                return (await observer.get(allocation_id)).status is Status.FAILED

            await eventually(failed, within=60, every=0.2)
            row = await observer.get(allocation_id)
            assert (row.failure_code, row.end_reason) == (
                "provisioning_timeout",
                "provisioning_timeout",
            )
            await eventually(lambda: _no_sidecars(marker), within=30, every=0.2)


async def _no_sidecars(marker: str) -> bool:
    return not sidecar_pids(marker)


class TestRaces:
    async def test_two_replicas_sweeping_at_once_end_each_idle_or_stuck_row_once(
        self, db: Database, store: AllocationStore, database_url: str
    ) -> None:
        """Two replicas' sweeps at the same moment, on pools of their own: every idle row and
        every row past its provisioning deadline moves once (one ledger row each)."""
        await store.set_limits({"p": ProvisionerLimits(idle_timeout=MINUTE)})
        idle = [await drive_to(store, db, Status.ALLOCATED, provisioner_id="p") for _ in range(12)]
        for fence in idle:
            await make_ready(db, fence.allocation_id)
            await age_idle(db, fence.allocation_id, -1)
        await store.set_limits(
            {"p": ProvisionerLimits(idle_timeout=MINUTE, provisioning_timeout=MINUTE)}
        )
        stuck = [
            await drive_to(store, db, Status.PROVISIONING, provisioner_id="p") for _ in range(12)
        ]
        await db.pool.execute(
            "UPDATE hubd_allocations SET starting_since = now() - interval '2 minutes' "
            "WHERE id = ANY($1::text[])",
            [fence.allocation_id for fence in stuck],
        )
        other_db = await connect_database(database_url, pool_size=2)
        try:
            other = AllocationStore(other_db, instance_id="in_other")
            first, second = await asyncio.gather(
                store.sweep_deadlines(warning=1, pending_timeout=None),
                other.sweep_deadlines(warning=1, pending_timeout=None),
            )
        finally:
            await other_db.close()
        assert first.idle + second.idle == 12
        assert first.provisioning_timeout + second.provisioning_timeout == 12
        counts = dict(
            await db.pool.fetch(
                "SELECT kind, count(*) FROM hubd_allocation_ledger "
                "WHERE kind IN ('expire', 'give_up') GROUP BY kind"
            )
        )
        assert counts == {"expire": 12, "give_up": 12}
        for fence in idle + stuck:
            row = await store.get(fence.allocation_id)
            assert (row.status, row.generation) == (Status.RELEASING, fence.generation + 1)

    async def test_a_claim_that_froze_before_its_write_finds_the_row_given_up(
        self, db: Database, store: AllocationStore, ledger: LedgerStore
    ) -> None:
        """A claim that froze past the provisioning deadline, then writes the acceptance it
        was about to, writes nothing: the sweep moved the row to a new generation."""
        await store.set_limits({"p": ProvisionerLimits(provisioning_timeout=MINUTE)})
        fence = await drive_to(store, db, Status.PROVISIONING, provisioner_id="p")
        await db.pool.execute(
            "UPDATE hubd_allocations SET starting_since = now() - interval '2 minutes' "
            "WHERE id = $1",
            fence.allocation_id,
        )
        assert (await store.sweep_deadlines(warning=1, pending_timeout=None)).provisioning_timeout
        late = await store.write(fence, MarkAllocated(external_ref="late").transition())
        assert late is None
        row = await store.get(fence.allocation_id)
        assert (row.status, row.external_ref) == (Status.RELEASING, None)

    async def test_activity_of_a_replaced_generation_moves_nothing(
        self, db: Database, store: AllocationStore, hub: Hub
    ) -> None:
        """A socket of a generation already replaced (a replica that had not yet heard)
        reports activity: no idle clock moves, and the answer says none ran."""
        sidecar, _ = await sidecar_in(store, db)
        await db.pool.execute(
            "UPDATE hubd_allocations SET idle_timeout = $2, connection_ready = true WHERE id = $1",
            sidecar.allocation_id,
            MINUTE,
        )
        await age_idle(db, sidecar.allocation_id, 5)
        before = (await clocks(db, sidecar.allocation_id))["idle_at"]
        await db.pool.execute(
            "UPDATE hubd_allocations SET generation = generation + 1, connection_ready = false "
            "WHERE id = $1",
            sidecar.allocation_id,
        )
        counted = await hub.connections.record_activity([sidecar.target])
        assert counted == {}
        assert (await clocks(db, sidecar.allocation_id))["idle_at"] == before
