"""Driving allocations into a given status through the store's own transitions."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable

from hubd.reconciler.writes import Abandon, BindInitial, MarkAllocated
from hubd.store import Allocation, AllocationStore, Database, Failure, Fence, Status
from tests.pgtime import age_row

LEASE_SECONDS = 60.0


def new_lease() -> str:
    return f"ls_{secrets.token_hex(16)}"


def token_hash() -> bytes:
    return hashlib.sha256(secrets.token_bytes(16)).digest()


async def claim_next(
    store: AllocationStore, *, lease_id: str, lease_duration: float, exclude: Iterable[str] = ()
) -> Allocation | None:
    """Lease the oldest due active allocation whose id is not in ``exclude`` (one slot of the
    dispatcher's batch claim)."""
    claimed = await store.claim_due(
        lease_ids=[lease_id], lease_duration=lease_duration, exclude=exclude
    )
    return claimed[0].allocation if claimed else None


async def claim_one(store: AllocationStore, allocation_id: str) -> Fence:
    """Claim exactly ``allocation_id`` (it must be due) and return its fence."""
    lease = new_lease()
    claimed = await claim_next(store, lease_id=lease, lease_duration=LEASE_SECONDS)
    assert claimed is not None, "expected a due allocation"
    assert claimed.id == allocation_id, "another allocation was due first"
    return Fence(allocation_id=claimed.id, lease_id=lease, generation=claimed.generation)


async def _bind(store: AllocationStore, fence: Fence) -> Allocation | None:
    return await store.write(
        fence,
        BindInitial(
            sidecar_id="sc_" + secrets.token_hex(16),
            token_hash=token_hash(),
            connect_timeout=120,
            api_version="1",
            binding_fingerprint="fp",
        ).transition(),
    )


async def drive_to(
    store: AllocationStore, db: Database, status: Status, *, provisioner_id: str = "fake"
) -> Fence:
    """A new allocation in ``status``, claimed, with the fence of that claim."""
    allocation = await store.request(provisioner_id=provisioner_id)
    fence = await claim_one(store, allocation.id)
    if status is Status.PENDING:
        return fence
    bound = await _bind(store, fence)
    if status is Status.RELEASING:
        await store.release(allocation.id)
        await age_row(db, allocation.id, LEASE_SECONDS + 1)
        return await claim_one(store, allocation.id)
    assert bound is not None
    if status is Status.PROVISIONING:
        return fence
    allocated = await store.write(fence, MarkAllocated(external_ref="ref-1").transition())
    assert allocated is not None
    if status is Status.ALLOCATED:
        return fence
    assert status is Status.REPLACING, status
    replaced = await store.write(
        fence,
        Abandon(
            release=False,
            expected=Status.ALLOCATED,
            delay=0,
            failure=Failure("sidecar_connect_failed", "test"),
        ).transition(),
    )
    assert replaced is not None
    return await claim_one(store, allocation.id)
