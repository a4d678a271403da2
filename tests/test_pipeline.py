"""Fenced transitions asked for together run as one pipelined batch against a real PostgreSQL:
each still its own fenced statement, in allocation id order, with errors and cancellations
kept to the request they belong to."""

from __future__ import annotations

import asyncio
import gc
import secrets

import pytest

from hubd.errors import InvalidRequest
from hubd.store import Allocation, AllocationStore, Database, Fence, Status, connect_database
from tests.polling import eventually
from tests.storekit import claim_one, token_hash
from tests.test_connection_races import blocked_on_a_lock

BIND = "bind_initial_sidecar"


async def pending_claims(store: AllocationStore, n: int) -> list[Fence]:
    fences = []
    for _ in range(n):
        allocation = await store.request(provisioner_id="fake")
        fences.append(await claim_one(store, allocation.id))
    return fences


async def bind(
    store: AllocationStore,
    fence: Fence,
    *,
    digest: bytes | None = None,
    sidecar_id: str | None = None,
) -> Allocation | None:
    return await store.bind_initial_sidecar(
        fence,
        sidecar_id=sidecar_id or "sc_" + secrets.token_hex(8),
        token_hash=token_hash() if digest is None else digest,
        connect_timeout=120,
        api_version="1",
        binding_fingerprint="fp",
    )


async def statuses(db: Database, fences: list[Fence]) -> list[str]:
    async with db.connection("read") as conn:
        rows = await conn.fetch(
            "SELECT id, status FROM hubd_allocations WHERE id = ANY($1::text[])",
            [f.allocation_id for f in fences],
        )
    by_id = {row["id"]: row["status"] for row in rows}
    return [by_id[f.allocation_id] for f in fences]


async def test_concurrent_transitions_share_a_batch_and_each_gets_its_own_row(
    db: Database, store: AllocationStore
) -> None:
    fences = await pending_claims(store, 8)
    results = await asyncio.gather(*(bind(store, fence) for fence in fences))
    assert [r.id if r else None for r in results] == [f.allocation_id for f in fences]
    assert all(r is not None and r.status is Status.PROVISIONING for r in results)
    pipeline = store.pipelines[BIND]
    assert pipeline.carried == 8
    assert pipeline.batches < 8
    # Run in allocation id order, whatever order they were asked in: the lock order.
    async with db.connection("read") as conn:
        logged = await conn.fetch(
            "SELECT allocation_id FROM hubd_allocation_ledger "
            "WHERE kind = 'bind_sidecar' ORDER BY seq"
        )
    assert [row["allocation_id"] for row in logged] == sorted(f.allocation_id for f in fences)


async def test_a_stale_fence_in_a_batch_matches_nothing_and_the_rest_commit(
    db: Database, store: AllocationStore
) -> None:
    fences = await pending_claims(store, 4)
    stale = Fence(
        allocation_id=fences[1].allocation_id,
        lease_id="ls_not_ours",
        generation=fences[1].generation,
    )
    asked = [fences[0], stale, fences[2], fences[3]]
    results = await asyncio.gather(*(bind(store, fence) for fence in asked))
    assert results[1] is None
    assert all(r is not None for i, r in enumerate(results) if i != 1)
    assert store.pipelines[BIND].batches < 4
    assert await statuses(db, fences) == ["provisioning", "pending", "provisioning", "provisioning"]


async def test_an_error_reaches_only_its_own_request(db: Database, store: AllocationStore) -> None:
    fences = await pending_claims(store, 4)
    bad = b"\x00" * 7  # the schema wants a 32-byte hash
    outcomes = await asyncio.gather(
        *(bind(store, fence, digest=bad if i == 2 else None) for i, fence in enumerate(fences)),
        return_exceptions=True,
    )
    assert isinstance(outcomes[2], InvalidRequest)
    assert all(
        not isinstance(o, BaseException) and o is not None for i, o in enumerate(outcomes) if i != 2
    )
    assert await statuses(db, fences) == ["provisioning", "provisioning", "pending", "provisioning"]


async def test_a_request_cancelled_in_its_batch_waits_for_the_batch(
    db: Database, database_url: str, store: AllocationStore
) -> None:
    fences = await pending_claims(store, 3)
    blocker = fences[0]
    async with db.connection("hold the row") as conn, conn.transaction():
        await conn.execute(
            "SELECT 1 FROM hubd_allocations WHERE id = $1 FOR UPDATE", blocker.allocation_id
        )
        # Two requests in one batch, the batch waiting on the held row.
        first = asyncio.create_task(bind(store, fences[0]))
        second = asyncio.create_task(bind(store, fences[1]))
        await blocked_on_a_lock(database_url)
        # A third asked while that batch runs waits for the next one; cancelled there, it
        # never runs.
        queued = asyncio.create_task(bind(store, fences[2]))
        await eventually(lambda: store.pipelines[BIND].carried == 2, what="the first batch")
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        # Cancelled while its batch runs: it stays until the batch has ended, since its write
        # may yet commit.
        second.cancel()
        # Polled until the batch is seen still waiting on the held row: the cancelled request
        # has not ended meanwhile.
        await blocked_on_a_lock(database_url)
        assert not second.done()
    with pytest.raises(asyncio.CancelledError):
        await second
    assert (await first) is not None
    # The cancelled request's write was in the batch, and committed with it.
    assert await statuses(db, fences) == ["provisioning", "provisioning", "pending"]


async def test_a_batch_every_request_gave_up_on_is_cancelled(
    db: Database, database_url: str, store: AllocationStore
) -> None:
    fences = await pending_claims(store, 2)
    async with db.connection("hold the row") as conn, conn.transaction():
        await conn.execute(
            "SELECT 1 FROM hubd_allocations WHERE id = $1 FOR UPDATE", fences[0].allocation_id
        )
        asked = [asyncio.create_task(bind(store, fence)) for fence in fences]
        await blocked_on_a_lock(database_url)
        for task in asked:
            task.cancel()
        # Both end while the row is still held: the batch's statement was cancelled, as a
        # single statement's would be.
        for task in asked:
            with pytest.raises(asyncio.CancelledError):
                await task
    assert await statuses(db, fences) == ["pending", "pending"]
    # The pipeline carries on with the next request.
    assert await bind(store, fences[1]) is not None


async def test_a_batch_behind_another_replicas_release_writes_nothing_for_it(
    db: Database, database_url: str
) -> None:
    """Replica B binds x and y in one batch while replica A's release of x is written but not
    yet committed. B's bind of x passed its fence in B's snapshot and waits on x's row; once
    the release commits, the re-check sees the row released and writes nothing, while B's
    bind of y, still its own, commits."""
    store_a = AllocationStore(db, instance_id="replica_a")
    db_b = await connect_database(database_url, pool_size=4)
    try:
        store_b = AllocationStore(db_b, instance_id="replica_b")
        # x runs first in B's batch (allocation id order), so an answer given to the wrong
        # request would show.
        x, y = sorted(await pending_claims(store_b, 2), key=lambda f: f.allocation_id)
        async with db.connection("release") as conn, conn.transaction():
            await store_a.release(x.allocation_id, reason="user", conn=conn)
            by_b = [
                asyncio.create_task(bind(store_b, x, sidecar_id="sc_x_of_b")),
                asyncio.create_task(bind(store_b, y, sidecar_id="sc_y_of_b")),
            ]
            await blocked_on_a_lock(database_url)
        x_write, y_write = await asyncio.gather(*by_b)
        assert store_b.pipelines[BIND].carried == 2
        assert store_b.pipelines[BIND].batches == 1
        assert x_write is None
        assert y_write is not None
        assert y_write.sidecar_id == "sc_y_of_b"
        async with db.connection("read") as conn:
            x_now = await conn.fetchrow(
                "SELECT status, generation, sidecar_id FROM hubd_allocations WHERE id = $1",
                x.allocation_id,
            )
            x_binds = await conn.fetchval(
                "SELECT count(*) FROM hubd_allocation_ledger "
                "WHERE allocation_id = $1 AND kind = 'bind_sidecar'",
                x.allocation_id,
            )
        # A pending row is released outright (nothing was bound to destroy).
        assert dict(x_now) == {"status": "released", "generation": 1, "sidecar_id": None}
        assert x_binds == 0
        # B frozen for a while and then writing again under its old fence: still nothing.
        assert await bind(store_b, x, sidecar_id="sc_x_of_b_later") is None
    finally:
        await db_b.close()


@pytest.mark.usefixtures("collector_off")
async def test_a_batch_lets_its_requests_go_as_their_callers_return(
    db: Database, store: AllocationStore
) -> None:
    """A request and its batch refer to each other; once the batch has ended the requests
    (their rows, their futures) are freed as their callers return, not when the garbage
    collector next runs."""
    fences = await pending_claims(store, 8)
    ours = {fence.allocation_id for fence in fences}
    results = await asyncio.gather(*(bind(store, fence) for fence in fences))
    assert all(result is not None for result in results)
    pipeline = store.pipelines[BIND]
    assert pipeline.carried == 8
    del results
    # The callers have their rows; the runner lets the batch go once it has seen it end.
    # Only this test's requests: earlier tests may have left theirs to the collector (a
    # request whose statement failed is held by its exception's traceback).
    await eventually(
        lambda: (
            not any(
                type(o).__name__ == "_Request" and getattr(o, "allocation_id", None) in ours
                for o in gc.get_objects()
            )
        ),
        what="the batch's requests freed",
    )
