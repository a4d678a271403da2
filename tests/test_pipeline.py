"""Fenced transitions asked for together run as one batch against a real PostgreSQL: pipelined,
each still its own fenced statement, in allocation id order; or, for a transition with a set
form, one statement that fences and writes each row as the transition alone would. Errors and
cancellations are kept to the request they belong to."""

from __future__ import annotations

import asyncio
import gc
import secrets
from collections.abc import Callable
from typing import Any

import pytest

from hubd.errors import InvalidRequest
from hubd.reconciler.writes import AcceptAndPark, BindInitial, MarkAllocated, MarkReleased, Park
from hubd.store import Allocation, AllocationStore, Database, Fence, Status, connect_database
from hubd.store.inputs import Failure, ParkMode
from hubd.store.pipeline import Pipeline
from hubd.store.queries import Bound
from hubd.store.rows import EffectRow, Phase
from hubd.store.transitions import SQL
from tests.polling import eventually
from tests.storekit import claim_one, drive_to, token_hash
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
    return await store.write(
        fence,
        BindInitial(
            sidecar_id=sidecar_id or "sc_" + secrets.token_hex(8),
            token_hash=token_hash() if digest is None else digest,
            connect_timeout=120,
            api_version="1",
            binding_fingerprint="fp",
        ).transition(),
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


# -- transitions with a set form: a batch is one statement ------------------------------------

MARK_RELEASED = "mark_released"
# What differs between two allocations whatever wrote them: their identity and the clock.
_PER_ROW = {
    "id",
    "sidecar_id",
    "token_hash",
    "created_at",
    "updated_at",
    "finished_at",
    "connect_deadline",
    "starting_since",
    "idle_at",
}
# A ledger row as the transition wrote it, without what belongs to the allocation itself.
_LEDGER = (
    "SELECT generation, lease_id, instance_id, kind, from_status, to_status, phase, error_code, "
    "message, effect_id, duration_ms FROM hubd_allocation_ledger "
    "WHERE allocation_id = $1 AND seq > $2 ORDER BY seq"
)


async def releasing_claims(store: AllocationStore, db: Database, n: int) -> list[Fence]:
    return [await drive_to(store, db, Status.RELEASING) for _ in range(n)]


def destroyed(n: int) -> tuple[EffectRow, ...]:
    """The outcome of the destroy before a release: the ledger row the release carries."""
    return (
        EffectRow(
            effect_id=f"ef_{n}",
            kind="destroy",
            phase=Phase.COMMITTED,
            status=Status.RELEASING,
            duration_ms=1.5,
        ),
    )


async def last_seq(db: Database) -> int:
    async with db.connection("read") as conn:
        seq: int = await conn.fetchval("SELECT coalesce(max(seq), 0) FROM hubd_allocation_ledger")
    return seq


async def written(
    db: Database, fence: Fence, since: int
) -> tuple[dict[str, object], list[dict[str, object]]]:
    """The allocation's row (without its identity and timestamps) and the ledger rows written
    for it since ``since``, with ``lease_id`` read as whether it is the fence's."""
    async with db.connection("read") as conn:
        row = await conn.fetchrow(
            "SELECT * FROM hubd_allocations WHERE id = $1", fence.allocation_id
        )
        ledger = await conn.fetch(_LEDGER, fence.allocation_id, since)
    assert row is not None
    kept = {key: value for key, value in row.items() if key not in _PER_ROW}
    kept["finished"] = row["finished_at"] is not None
    kept["connect_deadline"] = row["connect_deadline"] is not None
    rows = []
    for entry in ledger:
        each = dict(entry)
        each["lease_id"] = each["lease_id"] == fence.lease_id
        each["effect_id"] = None if each["effect_id"] is None else "set"
        rows.append(each)
    return kept, rows


async def test_a_set_form_batch_is_one_statement_and_a_pipelined_one_a_statement_a_row(
    db: Database, store: AllocationStore
) -> None:
    fences = await releasing_claims(store, db, 8)
    results = await asyncio.gather(*(store.write(f, MarkReleased().transition()) for f in fences))
    assert [r.id if r else None for r in results] == [f.allocation_id for f in fences]
    assert all(r is not None and r.status is Status.RELEASED for r in results)
    released = store.pipelines[MARK_RELEASED]
    assert released.carried == 8
    assert released.batches < 8
    assert released.executions == released.batches
    # A transition without one (the bind) still runs a statement per row.
    pending = await pending_claims(store, 8)
    binds = store.pipelines[BIND]  # made when the claims above were driven to releasing
    before = (binds.batches, binds.executions)
    bound = await asyncio.gather(*(bind(store, f) for f in pending))
    assert all(b is not None for b in bound)
    assert binds.batches - before[0] < 8
    assert binds.executions - before[1] == 8


async def test_a_set_form_writes_each_row_of_a_batch_as_it_writes_a_row_alone(
    db: Database, store: AllocationStore
) -> None:
    together = await releasing_claims(store, db, 4)
    alone = await releasing_claims(store, db, 2)
    since = await last_seq(db)
    results = await asyncio.gather(
        *(store.write(f, MarkReleased().transition(destroyed(i))) for i, f in enumerate(together))
    )
    assert all(r is not None for r in results)
    pipeline = store.pipelines[MARK_RELEASED]
    assert pipeline.executions < 4
    for i, fence in enumerate(alone):
        before = pipeline.executions
        assert await store.write(fence, MarkReleased().transition(destroyed(i))) is not None
        assert pipeline.executions == before + 1
    expected = await written(db, alone[0], since)
    assert expected[0]["status"] == "released"
    assert expected[0]["lease_id"] is None
    assert [(row["kind"], row["phase"]) for row in expected[1]] == [
        ("destroy", "committed"),
        ("mark_released", "committed"),
    ]
    assert all(row["lease_id"] for row in expected[1])
    for fence in [*together, alone[1]]:
        assert await written(db, fence, since) == expected


@pytest.mark.parametrize("spoiled", ["lease", "generation", "expired", "status"])
async def test_a_row_whose_fence_fails_in_a_set_form_batch_is_absent_and_the_rest_commit(
    db: Database, store: AllocationStore, spoiled: str
) -> None:
    fences = await releasing_claims(store, db, 4)
    target = fences[1]
    asked = list(fences)
    if spoiled == "lease":
        asked[1] = Fence(
            allocation_id=target.allocation_id, lease_id="ls_not_ours", generation=target.generation
        )
    elif spoiled == "generation":
        asked[1] = Fence(
            allocation_id=target.allocation_id,
            lease_id=target.lease_id,
            generation=target.generation - 1,
        )
    else:
        spoil = (
            "UPDATE hubd_allocations SET lease_expires_at = now() - interval '1 second' "
            "WHERE id = $1"
            if spoiled == "expired"
            else "UPDATE hubd_allocations SET status = 'allocated' WHERE id = $1"
        )
        async with db.connection("spoil") as conn:
            await conn.execute(spoil, target.allocation_id)
    since = await last_seq(db)
    results = await asyncio.gather(*(store.write(f, MarkReleased().transition()) for f in asked))
    assert store.pipelines[MARK_RELEASED].executions < 4
    assert results[1] is None
    assert all(r is not None for i, r in enumerate(results) if i != 1)
    assert await statuses(db, fences) == [
        "released",
        "allocated" if spoiled == "status" else "releasing",
        "released",
        "released",
    ]
    assert (await written(db, target, since))[1] == []


async def test_an_error_in_a_set_form_batch_reaches_only_its_own_request(
    db: Database, store: AllocationStore
) -> None:
    """The one statement fails whole; each request then runs on its own, as the pipelined
    form does."""
    fences = await releasing_claims(store, db, 4)
    pipeline = Pipeline(db, SQL.mark_released, set_form=True)

    def query(i: int, fence: Fence) -> Bound:
        return SQL.mark_released(
            **fence.parameters(store.instance_id), effects="not json" if i == 2 else "[]"
        )

    outcomes = await asyncio.gather(
        *(
            pipeline.fetchrow("mark released", f.allocation_id, query(i, f))
            for i, f in enumerate(fences)
        ),
        return_exceptions=True,
    )
    assert isinstance(outcomes[2], InvalidRequest)
    assert all(
        not isinstance(o, BaseException) and o is not None for i, o in enumerate(outcomes) if i != 2
    )
    # The batch first (failed whole), then each on its own.
    assert pipeline.batches == 1
    assert pipeline.executions == 1 + 4
    assert await statuses(db, fences) == ["released", "released", "releasing", "released"]


async def test_a_set_form_batch_behind_a_takeover_writes_nothing_for_it(
    db: Database, database_url: str, store: AllocationStore
) -> None:
    """x and y go in one statement while another writer, holding x's row, moves x's lease on
    (another replica's claim after this one's lease expired). The statement waits for x's row;
    once that write commits, x's fence is checked again on the row as it now stands and fails,
    and only y is released."""
    x, y = sorted(await releasing_claims(store, db, 2), key=lambda f: f.allocation_id)
    since = await last_seq(db)
    async with db.connection("take over") as conn, conn.transaction():
        await conn.execute(
            "UPDATE hubd_allocations SET lease_id = 'ls_of_another_replica' WHERE id = $1",
            x.allocation_id,
        )
        asked = [asyncio.create_task(store.write(f, MarkReleased().transition())) for f in (x, y)]
        await blocked_on_a_lock(database_url)
    x_write, y_write = await asyncio.gather(*asked)
    pipeline = store.pipelines[MARK_RELEASED]
    assert (pipeline.batches, pipeline.executions) == (1, 1)
    assert x_write is None
    assert y_write is not None
    assert y_write.status is Status.RELEASED
    async with db.connection("read") as conn:
        x_now = await conn.fetchrow(
            "SELECT status, lease_id FROM hubd_allocations WHERE id = $1", x.allocation_id
        )
    assert dict(x_now) == {"status": "releasing", "lease_id": "ls_of_another_replica"}
    assert (await written(db, x, since))[1] == []


def accepting(**accepted: Any) -> Callable[[Park], AcceptAndPark]:
    return lambda park: AcceptAndPark(accepted=MarkAllocated(**accepted), park=park)


def awaiting(**park: Any) -> Park:
    return Park(mode=ParkMode.AWAIT_CONNECTION, delay=30.0, **park)


PARKS: dict[str, Park | AcceptAndPark] = {
    # The lifecycle's park: the ensure accepted, the sidecar not yet connected.
    "accept and await": accepting(external_ref="ref-1")(awaiting(connection_seq=0)),
    # The same, the acceptance saying where the sidecar serves and what it is.
    "accept with endpoint": accepting(
        external_ref="ref-1", endpoint="10.0.0.7:8080", metadata={"pod": "p", "ports": [8080]}
    )(awaiting(connection_seq=0)),
    # A connect or disconnect recorded since the claim's look: due now, as a follow-up.
    "connection moved": accepting(external_ref="ref-1")(awaiting(connection_seq=5)),
    # The sidecar already holds a live record: ready in the park itself.
    "accept and ready": accepting(
        external_ref="ref-1", endpoint="10.0.0.7:8080", metadata={"pod": "p"}
    )(awaiting(connection_seq=0, ready_within=20.0)),
    # Looked for a record, found none: parked.
    "no record": accepting(external_ref="ref-1")(awaiting(connection_seq=0, ready_within=20.0)),
    "retry after error": Park(
        mode=ParkMode.RETRY_AFTER_ERROR,
        delay=30.0,
        failure=Failure("plugin_failed", "ensure failed"),
    ),
}


@pytest.mark.parametrize("case", sorted(PARKS))
async def test_a_park_writes_each_row_of_a_batch_as_it_writes_a_row_alone(
    db: Database, store: AllocationStore, case: str
) -> None:
    park = PARKS[case]
    fences = [await drive_to(store, db, Status.PROVISIONING) for _ in range(4)]
    if case == "accept and ready":
        async with db.connection("record") as conn:
            for i, fence in enumerate(fences):
                await conn.execute(
                    "INSERT INTO hubd_sidecar_connections "
                    "(connection_id, allocation_id, generation, sidecar_id, instance_id, seq) "
                    "SELECT $1, id, generation, sidecar_id, $2, 0 FROM hubd_allocations "
                    "WHERE id = $3",
                    f"cn_{i}",
                    store.instance_id,
                    fence.allocation_id,
                )
    since = await last_seq(db)
    effects = (
        EffectRow(
            effect_id="ef_e", kind="ensure", phase=Phase.COMMITTED, status=Status.PROVISIONING
        ),
    )
    together, alone = fences[:3], fences[3]
    pipeline_results = await asyncio.gather(
        *(store.write(f, park.transition(effects)) for f in together)
    )
    assert all(r is not None for r in pipeline_results)
    parks = store.pipelines["park"]
    assert parks.executions < 3
    before = parks.executions
    assert await store.write(alone, park.transition(effects)) is not None
    assert parks.executions == before + 1
    expected = await written(db, alone, since)
    ready, due_now = expected[0]["connection_ready"], expected[1][-1]["kind"] == "follow_up"
    assert ready == (case == "accept and ready")
    assert due_now == (case == "connection moved")
    assert expected[0]["endpoint"] == (
        park.accepted.endpoint if isinstance(park, AcceptAndPark) else None
    )
    # Each row's schedule is its own (its connect deadline, now()): whether it has one is what
    # the form decides.
    expected[0]["next_attempt_at"] = expected[0]["next_attempt_at"] is not None
    for fence in together:
        got = await written(db, fence, since)
        got[0]["next_attempt_at"] = got[0]["next_attempt_at"] is not None
        assert got == expected


async def test_a_park_in_a_set_form_batch_fenced_by_a_connect_that_commits_meanwhile(
    db: Database, database_url: str, store: AllocationStore
) -> None:
    """x and y park in one statement, each having seen a live record. Another writer, holding
    x's row, records a new connection of x (its number moves on). The statement's look at x's
    record was taken before; under x's lock it sees the number moved and does not make x ready:
    x is due at once, as a follow-up, while y becomes ready."""
    x, y = sorted(
        [await drive_to(store, db, Status.PROVISIONING) for _ in range(2)],
        key=lambda f: f.allocation_id,
    )
    async with db.connection("record") as conn:
        for i, fence in enumerate((x, y)):
            await conn.execute(
                "INSERT INTO hubd_sidecar_connections "
                "(connection_id, allocation_id, generation, sidecar_id, instance_id, seq) "
                "SELECT $1, id, generation, sidecar_id, $2, 0 FROM hubd_allocations WHERE id = $3",
                f"cn_{i}",
                store.instance_id,
                fence.allocation_id,
            )
    async with db.connection("reconnect") as conn, conn.transaction():
        await conn.execute(
            "UPDATE hubd_allocations SET connection_seq = connection_seq + 1 WHERE id = $1",
            x.allocation_id,
        )
        asked = [
            asyncio.create_task(
                store.write(
                    f,
                    AcceptAndPark(
                        accepted=MarkAllocated(external_ref="ref-1"),
                        park=Park(
                            mode=ParkMode.AWAIT_CONNECTION,
                            delay=30.0,
                            connection_seq=0,
                            ready_within=20.0,
                        ),
                    ).transition(),
                )
            )
            for f in (x, y)
        ]
        await blocked_on_a_lock(database_url)
    x_row, y_row = await asyncio.gather(*asked)
    pipeline = store.pipelines["park"]
    assert (pipeline.batches, pipeline.executions) == (1, 1)
    assert x_row is not None
    assert y_row is not None
    assert not x_row.ready
    assert x_row.status is Status.ALLOCATED
    assert y_row.ready
    async with db.connection("read") as conn:
        kinds = {
            row["allocation_id"]: row["kind"]
            for row in await conn.fetch(
                "SELECT DISTINCT ON (allocation_id) allocation_id, kind "
                "FROM hubd_allocation_ledger ORDER BY allocation_id, seq DESC"
            )
        }
    assert kinds[x.allocation_id] == "follow_up"
    assert kinds[y.allocation_id] == "mark_ready"
