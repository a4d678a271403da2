"""The connection-lost rule on a real PostgreSQL: every statement that clears a sidecar's
connection record (a disconnect, the sweep of a dead instance's records, a clean stop's release
of its own) marks the sidecar lost the same way, with the same ledger row but for its kind and
message."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from hubd.routing import Target
from hubd.store import AllocationStore, Database, Status
from hubd.store.connection_values import Disconnect
from hubd.store.connections import ConnectionStore
from hubd.store.instances import InstanceStore
from tests.storekit import drive_to

HOLDER = "in_holder"
"""The instance whose records go."""
CALLER = "in_caller"
"""The instance that sweeps the holder's records (the holder itself for the other statements)."""
CONNECT_TIMEOUT = 30.0

Clear = Callable[[Database, list[Disconnect]], Awaitable[Any]]


async def _disconnect(db: Database, records: list[Disconnect]) -> Any:
    holder = ConnectionStore(db, instance_id=HOLDER)
    return await holder.disconnect_many(records, connect_timeout=CONNECT_TIMEOUT)


async def _sweep(db: Database, records: list[Disconnect]) -> Any:
    async with db.pool.acquire() as conn:
        await conn.execute(
            "UPDATE hubd_instances SET heartbeat_at = now() - interval '1 hour' WHERE id = $1",
            HOLDER,
        )
    caller = ConnectionStore(db, instance_id=CALLER)
    return await caller.sweep_stale(20, connect_timeout=CONNECT_TIMEOUT)


async def _release(db: Database, records: list[Disconnect]) -> Any:
    holder = ConnectionStore(db, instance_id=HOLDER)
    return await holder.release_instance(connect_timeout=CONNECT_TIMEOUT)


# Each statement, the instance that writes its ledger rows, and the kind and message they carry.
STATEMENTS: dict[str, tuple[Clear, str, str, str | None]] = {
    "disconnect_many": (_disconnect, HOLDER, "connection_lost", None),
    "sweep_stale": (_sweep, CALLER, "connection_swept", f"instance {HOLDER} stopped heartbeating"),
    "release_instance": (_release, HOLDER, "connection_lost", "the hub holding the socket stopped"),
}

# How each case's row stands when its record goes: no lease, and a schedule an hour away
# (parked until its deadline), read ready with no schedule, held by a live claim, or still
# provisioning (held by the claim that bound it).
CASES = ("parked", "ready", "leased", "provisioning")

# What the rule leaves, by case: status, ready, the connection number's step, the connect
# deadline (fresh: connect_timeout from the statement's now; kept: as it was), the schedule
# (the deadline, or kept), whether a claim's lease is held and untouched, and whether a ledger
# row is written.
LOST = {
    "parked": ("allocated", False, 1, "fresh", "deadline", False, True),
    "ready": ("allocated", False, 1, "fresh", "deadline", False, True),
    "leased": ("allocated", False, 1, "fresh", "kept", True, True),
    "provisioning": ("provisioning", False, 1, "kept", "kept", True, False),
}


async def _connected(store: AllocationStore, db: Database, case: str) -> Disconnect:
    """An allocation in ``case``'s state whose sidecar holds a record on :data:`HOLDER`."""
    status = Status.PROVISIONING if case == "provisioning" else Status.ALLOCATED
    fence = await drive_to(store, db, status)
    row = await store.get(fence.allocation_id)
    assert row.sidecar_id is not None
    connection_id = f"cn_{case}"
    holder = ConnectionStore(db, instance_id=HOLDER)
    await holder.record(
        connection_id, Target(fence.allocation_id, fence.generation), row.sidecar_id
    )
    if case in ("parked", "ready"):
        ready = case == "ready"
        async with db.pool.acquire() as conn:
            await conn.execute(
                "UPDATE hubd_allocations SET lease_id = NULL, lease_expires_at = NULL,"
                " connection_ready = $2,"
                " next_attempt_at = CASE WHEN $2 THEN NULL ELSE now() + interval '1 hour' END,"
                " connect_deadline = CASE WHEN $2 THEN NULL ELSE now() + interval '1 hour' END"
                " WHERE id = $1",
                fence.allocation_id,
                ready,
            )
    return Disconnect(fence.allocation_id, connection_id)


_ROW = """
    SELECT status, connection_ready, connection_seq, connect_deadline, next_attempt_at,
           lease_id, lease_expires_at,
           connect_deadline = updated_at + make_interval(secs => $2) AS fresh_deadline,
           EXISTS (SELECT 1 FROM hubd_sidecar_connections WHERE allocation_id = a.id) AS record
    FROM hubd_allocations AS a WHERE id = $1
"""

_LEDGER = """
    SELECT kind, from_status, to_status, phase, instance_id, message
    FROM hubd_allocation_ledger
    WHERE allocation_id = $1 AND kind IN ('connection_lost', 'connection_swept')
    ORDER BY seq
"""


class TestConnectionLost:
    @pytest.mark.parametrize("statement", sorted(STATEMENTS))
    async def test_every_clearing_statement_marks_the_sidecar_lost_alike(
        self, statement: str, store: AllocationStore, db: Database
    ) -> None:
        """Whichever statement clears a record, the allocation ends the same: not ready, its
        connection number bumped; allocated, a fresh connect deadline connect_timeout seconds
        from the statement, a schedule at that deadline unless a claim holds the row (whose
        lease and schedule are never touched), and one committed ledger row of the caller's;
        provisioning, nothing more."""
        clear, writer, kind, message = STATEMENTS[statement]
        await InstanceStore(db).register(HOLDER, "here", 1, None)
        records = {case: await _connected(store, db, case) for case in CASES}
        async with db.pool.acquire() as conn:
            before = {
                case: await conn.fetchrow(_ROW, record.allocation_id, CONNECT_TIMEOUT)
                for case, record in records.items()
            }
        await clear(db, list(records.values()))
        async with db.pool.acquire() as conn:
            for case, record in records.items():
                old = before[case]
                new = await conn.fetchrow(_ROW, record.allocation_id, CONNECT_TIMEOUT)
                ledger = [tuple(row) for row in await conn.fetch(_LEDGER, record.allocation_id)]
                assert not new["record"], case
                deadline = "fresh" if new["fresh_deadline"] else None
                if new["connect_deadline"] == old["connect_deadline"]:
                    deadline = "kept"
                schedule = None
                if new["next_attempt_at"] == old["next_attempt_at"]:
                    schedule = "kept"
                elif new["next_attempt_at"] == new["connect_deadline"]:
                    schedule = "deadline"
                lease_kept = (new["lease_id"], new["lease_expires_at"]) == (
                    old["lease_id"],
                    old["lease_expires_at"],
                )
                shape = (
                    new["status"],
                    new["connection_ready"],
                    new["connection_seq"] - old["connection_seq"],
                    deadline,
                    schedule,
                    lease_kept and new["lease_id"] is not None,
                    bool(ledger),
                )
                assert shape == LOST[case], (statement, case)
                if ledger:
                    status = new["status"]
                    assert ledger == [(kind, status, status, "committed", writer, message)], case
