"""``hubd alloc forget``: an operator ends an allocation whose sidecar is gone for good, in one
fenced statement, with the reason in the ledger; a claim on the row is fenced off."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import asyncpg
import pytest

from hubd.reconciler.writes import Retry
from hubd.store import AllocationStore, Database, LedgerStore, Status
from hubd.store.allocations import SQL as ALLOCATIONS
from hubd.store.rows import Phase
from hubd.store.transitions import SQL as TRANSITIONS
from tests.clikit import run_hubd_async
from tests.polling import eventually
from tests.storekit import drive_to

ACTIVE = [
    Status.PENDING,
    Status.PROVISIONING,
    Status.ALLOCATED,
    Status.REPLACING,
    Status.RELEASING,
]


async def events_of(db: Database, allocation_id: str) -> list[asyncpg.Record]:
    async with db.pool.acquire() as conn:
        return list(
            await conn.fetch(
                "SELECT event, status, generation, failure_code, failure_message "
                "FROM hubd_events WHERE allocation_id = $1 ORDER BY position",
                allocation_id,
            )
        )


class TestForgetInTheStore:
    @pytest.mark.parametrize("status", ACTIVE)
    async def test_ends_the_row_and_fences_the_claim(
        self, store: AllocationStore, ledger: LedgerStore, db: Database, status: Status
    ) -> None:
        """From every active status, a claimed row ends at once under a new generation (a
        release under way ends released, anything else failed), with failure 'forgotten' and
        the reason, no lease and no schedule; the claim can write nothing more."""
        fence = await drive_to(store, db, status)
        before = await store.get(fence.allocation_id)
        assert before.lease_id is not None  # a claim holds it
        forgotten = await store.forget(fence.allocation_id, reason="host wiped: ticket OPS-7")
        assert forgotten is not None
        expected = Status.RELEASED if status is Status.RELEASING else Status.FAILED
        assert forgotten.status is expected
        assert forgotten.generation == before.generation + 1
        assert (forgotten.failure_code, forgotten.failure_message) == (
            "forgotten",
            "host wiped: ticket OPS-7",
        )
        assert (forgotten.lease_id, forgotten.next_attempt_at) == (None, None)
        assert forgotten.finished_at is not None
        assert not forgotten.ready
        # What the operator may have to clean up is still named.
        assert forgotten.sidecar_id == before.sidecar_id
        assert forgotten.external_ref == before.external_ref
        # The claim's writes, renewal and effects all match nothing now.
        assert await store.write(fence, Retry(expected=status, delay=0).transition()) is None
        assert not await store.renew_lease(fence.allocation_id, fence.lease_id, 60)
        assert not await ledger.record_effect(
            fence, effect_id="ef_late", kind="destroy", phase=Phase.INTENT, status=status
        )
        assert await store.get(fence.allocation_id) == forgotten
        last = (await ledger.history(fence.allocation_id))[-1]
        assert (last.kind, last.phase, last.from_status, last.to_status) == (
            "forget",
            Phase.COMMITTED,
            str(status),
            str(expected),
        )
        assert (last.error_code, last.message, last.generation) == (
            "forgotten",
            "host wiped: ticket OPS-7",
            forgotten.generation,
        )
        assert last.instance_id == "in_test"

    async def test_the_feed_says_so(self, store: AllocationStore, db: Database) -> None:
        """Applications following the feed see the end as a terminal event carrying the
        failure."""
        fence = await drive_to(store, db, Status.ALLOCATED)
        forgotten = await store.forget(fence.allocation_id, reason="gone")
        assert forgotten is not None

        async def written() -> bool:
            return (await events_of(db, fence.allocation_id))[-1]["event"] == "failed"

        await eventually(written, what="the failed event")
        last = (await events_of(db, fence.allocation_id))[-1]
        assert (last["status"], last["generation"]) == ("failed", forgotten.generation)
        assert (last["failure_code"], last["failure_message"]) == ("forgotten", "gone")

    async def test_ended_or_unknown_is_left_alone(
        self, store: AllocationStore, db: Database
    ) -> None:
        """An allocation that has ended is not forgotten (nothing changes, not even the
        ledger); an unknown id neither."""
        allocation = await store.request(provisioner_id="fake")
        released = await store.release(allocation.id)
        assert released.status is Status.RELEASED
        async with db.pool.acquire() as conn:
            count = "SELECT count(*) FROM hubd_allocation_ledger WHERE allocation_id = $1"
            entries = await conn.fetchval(count, allocation.id)
            assert await store.forget(allocation.id, reason="again") is None
            assert await conn.fetchval(count, allocation.id) == entries
        assert await store.get(allocation.id) == released
        assert await store.forget("al_" + "0" * 32, reason="nothing") is None

    async def test_reason_is_bounded_and_scrubbed(self, store: AllocationStore) -> None:
        """The reason is kept to one line of at most 500 characters."""
        allocation = await store.request(provisioner_id="fake")
        forgotten = await store.forget(allocation.id, reason="line\nbreak " + "x" * 600)
        assert forgotten is not None
        assert forgotten.failure_message is not None
        assert len(forgotten.failure_message) == 500
        assert "\n" not in forgotten.failure_message


async def blocked_on_a_lock(database_url: str) -> None:
    """Wait until another session waits for a row lock (the statement under test)."""
    conn = await asyncpg.connect(database_url)
    try:

        async def waiting() -> bool:
            n = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
            return bool(n >= 1)

        await eventually(waiting, within=10, what="a statement waiting on the row lock")
    finally:
        await conn.close()


@pytest.fixture
async def operator(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(database_url)
    try:
        yield conn
    finally:
        await conn.close()


class TestForgetRacesAClaim:
    async def test_a_claims_write_waiting_behind_the_forget_matches_nothing(
        self, store: AllocationStore, db: Database, database_url: str, operator: asyncpg.Connection
    ) -> None:
        """A claim's write that reaches the row while a forget holds it waits, then finds the
        row fenced: it writes nothing, and the forget stands."""
        fence = await drive_to(store, db, Status.ALLOCATED)
        forget = ALLOCATIONS.forget_allocation(
            allocation_id=fence.allocation_id, instance_id="cli", reason="gone"
        )
        async with operator.transaction():
            forgotten = await operator.fetchrow(forget.sql, *forget.args)
            assert forgotten["status"] == "failed"
            late = asyncio.create_task(
                store.write(fence, Retry(expected=Status.ALLOCATED, delay=0).transition())
            )
            await blocked_on_a_lock(database_url)
        assert await late is None
        row = await store.get(fence.allocation_id)
        assert (row.status, row.failure_code, row.generation) == (
            Status.FAILED,
            "forgotten",
            fence.generation + 1,
        )

    async def test_a_forget_waiting_behind_a_claims_write_still_forgets(
        self, store: AllocationStore, db: Database, database_url: str, operator: asyncpg.Connection
    ) -> None:
        """A forget that reaches the row while a claim's write holds it waits, then decides on
        the row as that write left it (still active): it forgets, and the claim's next write
        matches nothing."""
        fence = await drive_to(store, db, Status.PROVISIONING)
        # The provisioner's acceptance, written and not yet committed: the claim keeps its lease.
        accept = TRANSITIONS.mark_allocated(
            **fence.parameters("in_claim"),
            external_ref="ref-1",
            endpoint=None,
            metadata=None,
            effects="[]",
        )
        async with operator.transaction():
            accepted = await operator.fetchrow(accept.sql, *accept.args)
            assert accepted["status"] == "allocated"
            forgetting = asyncio.create_task(store.forget(fence.allocation_id, reason="gone"))
            await blocked_on_a_lock(database_url)
        forgotten = await forgetting
        assert forgotten is not None
        assert forgotten.status is Status.FAILED
        assert forgotten.generation == fence.generation + 1
        assert forgotten.external_ref == "ref-1"
        assert (
            await store.write(fence, Retry(expected=Status.ALLOCATED, delay=0).transition()) is None
        )
        history = await LedgerStore(db, instance_id="in_test").history(fence.allocation_id)
        assert [(e.kind, e.from_status) for e in history[-2:]] == [
            ("mark_allocated", "provisioning"),
            ("forget", "allocated"),
        ]


class TestForgetCommand:
    async def test_refused_without_confirm(
        self, database_url: str, store: AllocationStore, db: Database
    ) -> None:
        """Without --confirm nothing changes: exit 2, saying what forgetting means."""
        fence = await drive_to(store, db, Status.RELEASING)
        before = await store.get(fence.allocation_id)
        result = await run_hubd_async(
            "alloc",
            "forget",
            fence.allocation_id,
            "--reason",
            "gone",
            env={"HUBD_DATABASE_URL": database_url},
        )
        assert result.code == 2
        assert result.out == ""
        assert "without destroying its sidecar" in result.err
        assert "yours to clean up" in result.err
        assert "--confirm" in result.err
        assert f"hubd alloc release {fence.allocation_id}" in result.err
        assert await store.get(fence.allocation_id) == before

    @pytest.mark.parametrize(("reason", "problem"), [("  ", "say why"), ("x" * 501, "500")])
    async def test_reason_refused(self, reason: str, problem: str) -> None:
        """An empty reason, or one longer than the ledger keeps, is a usage error."""
        result = await run_hubd_async(
            "alloc", "forget", "al_" + "0" * 32, "--reason", reason, "--confirm"
        )
        assert result.code == 2
        assert problem in result.err

    async def test_forget_a_stuck_release(
        self, database_url: str, store: AllocationStore, db: Database
    ) -> None:
        """A release that cannot finish is forgotten: released, the reason in show's history
        and failure; a second forget exits 1 saying it has ended; an unknown id exits 1."""
        env = {"HUBD_DATABASE_URL": database_url}
        fence = await drive_to(store, db, Status.RELEASING)
        sidecar_id = (await store.get(fence.allocation_id)).sidecar_id
        argv = ("alloc", "forget", fence.allocation_id, "--reason", "image gone", "--confirm")
        result = await run_hubd_async(*argv, env=env)
        assert result.code == 0, result.err
        assert result.out == f"{fence.allocation_id} released\n"
        assert f"no further attempt to destroy its sidecar {sidecar_id}" in result.err
        shown = json.loads(
            (await run_hubd_async("alloc", "show", fence.allocation_id, "--json", env=env)).out
        )
        assert (shown["status"], shown["failure_code"], shown["failure_message"]) == (
            "released",
            "forgotten",
            "image gone",
        )
        assert shown["next"].startswith("nothing: forgotten by an operator (image gone)")
        assert shown["history"][-1]["kind"] == "forget"
        assert shown["history"][-1]["message"] == "image gone"
        again = await run_hubd_async(*argv, env=env)
        assert again.code == 1
        assert "has ended already (released (forgotten: image gone))" in again.err
        unknown = await run_hubd_async(
            "alloc", "forget", "al_" + "0" * 32, "--reason", "x", "--confirm", env=env
        )
        assert unknown.code == 1
        assert "no allocation" in unknown.err
