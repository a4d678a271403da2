"""Lifetimes and deadlines, decided in the statement that acts: a request's lifetime within its
provisioner's max_lifetime, extensions, the expiry and the pending deadline (each moved once,
whichever replica sweeps first), the expiring warning, and the reason every end carries."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import asyncpg
import pytest

from hubd.client import Client
from hubd.errors import InvalidRequest
from hubd.store import AllocationStore, Database, LedgerStore, Status, connect_database
from hubd.store.allocations import ProvisionerLimits
from tests.clikit import run_hubd_async
from tests.daemonkit import running, sidecar_pids, write_config
from tests.polling import eventually

HOUR = 3600.0


async def shift(db: Database, allocation_id: str, seconds: float) -> None:
    """Make ``seconds`` pass for the row's deadlines (its request and its end)."""
    await db.pool.execute(
        "UPDATE hubd_allocations SET created_at = created_at - make_interval(secs => $2), "
        "expires_at = expires_at - make_interval(secs => $2) WHERE id = $1",
        allocation_id,
        seconds,
    )


async def seconds_left(db: Database, allocation_id: str) -> float:
    left = await db.pool.fetchval(
        "SELECT extract(epoch FROM expires_at - now())::float8 FROM hubd_allocations WHERE id = $1",
        allocation_id,
    )
    return float(left)


async def events_of(db: Database, allocation_id: str) -> list[tuple[str, str | None]]:
    rows = await db.pool.fetch(
        "SELECT event, end_reason FROM hubd_v1.events WHERE allocation_id = $1 ORDER BY position",
        allocation_id,
    )
    return [(row["event"], row["end_reason"]) for row in rows]


class TestLifetime:
    async def test_a_request_lives_what_it_asks_within_the_maximum(
        self, db: Database, store: AllocationStore
    ) -> None:
        await store.set_limits({"p": ProvisionerLimits(max_lifetime=HOUR)})
        short = await store.request(provisioner_id="p", lifetime=60)
        assert 55 < await seconds_left(db, short.id) <= 60
        default = await store.request(provisioner_id="p")
        assert HOUR - 5 < await seconds_left(db, default.id) <= HOUR
        with pytest.raises(InvalidRequest) as refused:
            await store.request(provisioner_id="p", lifetime=2 * HOUR)
        assert "longer than provisioner 'p''s max_lifetime of 3600" in str(refused.value)
        unlimited = await store.request(provisioner_id="other")
        assert unlimited.expires_at is None

    async def test_an_extension_stays_within_the_maximum(
        self, db: Database, store: AllocationStore, ledger: LedgerStore
    ) -> None:
        await store.set_limits({"p": ProvisionerLimits(max_lifetime=HOUR)})
        allocation = await store.request(provisioner_id="p", lifetime=60)
        extended = await store.extend(allocation.id, 1800)
        assert extended.expires_at is not None
        assert 1795 < await seconds_left(db, allocation.id) <= 1800
        await shift(db, allocation.id, 1800)  # half the maximum has gone
        with pytest.raises(InvalidRequest) as refused:
            await store.extend(allocation.id, 1900)
        assert "may live until" in str(refused.value)
        await store.extend(allocation.id, 1700)
        assert [e.kind for e in await ledger.history(allocation.id)].count("extend") == 2
        await store.release(allocation.id)
        released = await store.extend(allocation.id, 60)
        assert released.status is Status.RELEASED

    async def test_the_application_api_takes_an_interval(self, db: Database) -> None:
        async with db.pool.acquire() as conn:
            made = await conn.fetchrow(
                "SELECT * FROM hubd_v1.request('p', lifetime => interval '90 seconds')"
            )
            assert made["expires_at"] is not None
            later = await conn.fetchrow(
                "SELECT * FROM hubd_v1.extend($1, interval '2 hours')", made["id"]
            )
            assert later["expires_at"] > made["expires_at"]
            with pytest.raises(asyncpg.InvalidParameterValueError):
                await conn.fetch("SELECT * FROM hubd_v1.request('p', lifetime => interval '-1 s')")
        assert [event for event, _ in await events_of(db, made["id"])] == [
            "requested",
            "extended",
        ]


class TestClient:
    async def test_request_with_a_lifetime_and_extend(self, database_url: str) -> None:
        async with await Client.connect(database_url) as client:
            made = await client.request("p", lifetime=timedelta(minutes=5))
            assert made.expires_at is not None
            later = await client.extend(made.id, timedelta(hours=1))
            assert later.expires_at is not None
            assert later.expires_at > made.expires_at
            with pytest.raises(InvalidRequest):
                await client.request("p", lifetime=timedelta(seconds=-1))


class TestSweep:
    async def test_what_expired_ends_once_with_its_reason(
        self, db: Database, store: AllocationStore, ledger: LedgerStore
    ) -> None:
        """A pending allocation past its end is released at once, a bound one begins its
        release under a new generation; both say 'expired'. A second sweep (another replica)
        moves nothing."""
        waiting = await store.request(provisioner_id="p", lifetime=60)
        bound = await store.request(provisioner_id="p", lifetime=60)
        await db.pool.execute(
            "UPDATE hubd_allocations SET status = 'allocated', sidecar_id = 'sc_b', "
            "token_hash = sha256('t') WHERE id = $1",
            bound.id,
        )
        for allocation in (waiting, bound):
            await shift(db, allocation.id, 61)
        swept = await store.sweep_deadlines(warning=60, pending_timeout=None)
        assert (swept.expired, swept.unserved) == (2, 0)
        again = await store.sweep_deadlines(warning=60, pending_timeout=None)
        assert (again.expired, again.unserved, again.warned) == (0, 0, 0)
        ended = await store.get(waiting.id)
        assert (ended.status, ended.end_reason) == (Status.RELEASED, "expired")
        releasing = await store.get(bound.id)
        assert (releasing.status, releasing.generation) == (Status.RELEASING, 2)
        assert releasing.end_reason == "expired"
        assert "expire" in [e.kind for e in await ledger.history(bound.id)]
        assert (await events_of(db, waiting.id))[-1] == ("released", "expired")

    async def test_two_replicas_sweeping_at_once_move_each_row_once(
        self, db: Database, store: AllocationStore, database_url: str
    ) -> None:
        """Two replicas' sweeps at the same moment, on pools of their own: every expired row is
        released once (one ledger row each), whichever sweep took it."""
        made = [await store.request(provisioner_id="p", lifetime=60) for _ in range(40)]
        for allocation in made:
            await shift(db, allocation.id, 61)
        other_db = await connect_database(database_url, pool_size=2)
        try:
            other = AllocationStore(other_db, instance_id="in_other")
            first, second = await asyncio.gather(
                store.sweep_deadlines(warning=60, pending_timeout=None),
                other.sweep_deadlines(warning=60, pending_timeout=None),
            )
        finally:
            await other_db.close()
        assert first.expired + second.expired == 40
        expires = await db.pool.fetchval(
            "SELECT count(*) FROM hubd_allocation_ledger WHERE kind = 'expire'"
        )
        assert expires == 40
        assert {(await store.get(a.id)).status for a in made} == {Status.RELEASED}

    async def test_the_end_is_announced_before_it_comes(
        self, db: Database, store: AllocationStore
    ) -> None:
        soon = await store.request(provisioner_id="p", lifetime=30)
        later = await store.request(provisioner_id="p", lifetime=HOUR)
        swept = await store.sweep_deadlines(warning=60, pending_timeout=None)
        assert swept.warned == 1
        # Read before its own warning: the next run knows the end is next.
        again = await store.sweep_deadlines(warning=60, pending_timeout=None)
        assert again.warned == 0
        assert again.next_in is not None
        assert 0 < again.next_in <= 30
        assert (await store.get(soon.id)).expiring
        assert not (await store.get(later.id)).expiring
        assert ("expiring", None) in await events_of(db, soon.id)
        await store.extend(soon.id, HOUR)
        assert not (await store.get(soon.id)).expiring

    async def test_a_request_nobody_serves_fails_as_unserved(
        self, db: Database, store: AllocationStore
    ) -> None:
        served = await store.request(provisioner_id="p")
        orphan = await store.request(provisioner_id="nobody")
        await store.set_limits({"p": ProvisionerLimits(pending_timeout=7200.0)})
        for allocation in (served, orphan):
            await db.pool.execute(
                "UPDATE hubd_allocations SET created_at = now() - interval '1 hour' WHERE id = $1",
                allocation.id,
            )
        swept = await store.sweep_deadlines(warning=60, pending_timeout=600)
        assert swept.unserved == 1
        failed = await store.get(orphan.id)
        assert (failed.status, failed.failure_code, failed.end_reason) == (
            Status.FAILED,
            "unserved",
            "unserved",
        )
        assert failed.failure_message is not None
        assert "no daemon serving provisioner 'nobody' took it within" in failed.failure_message
        assert (await store.get(served.id)).status is Status.PENDING  # its own limit: 2 h


class TestEndReasons:
    async def test_who_released_it(self, db: Database, store: AllocationStore) -> None:
        by_app = await store.request(provisioner_id="p")
        by_operator = await store.request(provisioner_id="p")
        async with db.pool.acquire() as conn:
            await conn.fetch("SELECT * FROM hubd_v1.release($1)", by_app.id)
        await store.release(by_operator.id)
        reasons = dict(
            await db.pool.fetch(
                "SELECT id, end_reason FROM hubd_v1.allocations WHERE id = ANY($1::text[])",
                [by_app.id, by_operator.id],
            )
        )
        assert reasons == {by_app.id: "application", by_operator.id: "operator"}


class TestThroughDaemon:
    async def test_an_allocation_ends_at_its_lifetime(
        self, database_url: str, observer: AllocationStore, marker: str, state_dir: Path
    ) -> None:
        """Under ``hubd run``: an allocation asked for with a 4 s lifetime becomes ready, is
        announced expiring, and is released at its end ('expired'), its sidecar process
        stopped."""
        config = write_config(
            state_dir / "hubd.toml", database_url=database_url, state_dir=state_dir, marker=marker
        )
        env = {"HUBD_DATABASE_URL": database_url}
        async with running(config):
            made = await run_hubd_async(
                "alloc", "request", "--provisioner", "local", "--lifetime", "4s", "--wait",
                "--timeout", "60s", env=env,
            )  # fmt: skip
            assert made.code == 0, made.err
            allocation_id = made.out.strip()

            async def expired() -> bool:
                row = await observer.get(allocation_id)
                return row.status is Status.RELEASED

            await eventually(expired, within=60, every=0.2)
            row = await observer.get(allocation_id)
            assert row.end_reason == "expired"
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

    async def test_an_idle_daemon_is_woken_for_the_deadlines_of_a_new_request(
        self, database_url: str, observer: AllocationStore, marker: str, state_dir: Path
    ) -> None:
        """With nothing active the deadline sweep waits for a request's notification rather
        than running every second (its quiet wait is 30 s): a request made while it waits
        still ends at its 2 s lifetime."""
        config = write_config(
            state_dir / "hubd.toml", database_url=database_url, state_dir=state_dir, marker=marker
        )
        async with running(config):
            conn = await asyncpg.connect(database_url)
            try:
                assert not await conn.fetchval(
                    "SELECT count(*) FROM hubd_allocations WHERE status IN "
                    "('pending', 'provisioning', 'allocated', 'replacing', 'releasing')"
                )
            finally:
                await conn.close()
            made = await observer.request(provisioner_id="local", lifetime=2)

            async def ended() -> bool:
                return (await observer.get(made.id)).status is Status.RELEASED

            # Far short of the quiet wait: only the notification can have run the sweep.
            await eventually(ended, within=15, every=0.1)
            row = await observer.get(made.id)
            assert row.end_reason == "expired"


async def _no_sidecars(marker: str) -> bool:
    return not sidecar_pids(marker)
